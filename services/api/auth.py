"""API keys: who may call the API, and which tenant's prefix cache a request may touch.

Keys come from the YAML (``api.api_keys``) and the environment (``FOLIO_API_KEYS``,
comma-separated). With none at all the API is open. With any, every route but the
public ones (``/health``; ``/metrics`` when ``api.public_metrics``) answers 401
unless the request carries ``Authorization: Bearer <key>``.

Public routes are recognised by the route the router resolved, never by the raw path,
so ``//v1/models``, ``/v1/%6Dodels`` or ``/health/../v1/models`` can only reach a
public handler if the router itself sends them there. Candidate keys are compared in
constant time against every configured key (sha256 digests of equal length, no early
exit), and keys are never logged: only whether one was missing or wrong.

Each key is a tenant, named by a short hash of the key's digest (services/tenants.py:
what ``api.tenant_weights`` and the fair scheduler know it by). Its cache salt is an HMAC of the key's digest under a secret
derived from all configured keys, so the salt is the same in every API process, is
not the key, and a client cannot choose it: two tenants never share a KV block.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from aiohttp import web

from observability.logging import get_logger
from services.api.errors import error_response
from services.api.openai_protocol import APIError
from services.tenants import key_digest, tenant_id

ENV_API_KEYS = "FOLIO_API_KEYS"
CACHE_SALT = web.RequestKey("folio.cache_salt", str)  # the tenant's salt, set on success
TENANT = web.RequestKey("folio.tenant", str)  # the tenant's id, set on success
ALWAYS_PUBLIC = frozenset({"/health"})
log = get_logger(__name__)


class APIKeys:
    """The accepted keys (as digests) and the salts of their tenants."""

    def __init__(self, keys: Iterable[str]):
        self._digests = sorted({key_digest(k) for k in keys if k})
        self._salt_secret = hashlib.sha256(b"folio cache salt\0" + b"".join(self._digests)
                                           ).digest()

    @classmethod
    def from_sources(cls, configured: Iterable[str],
                     environ: Mapping[str, str]) -> "APIKeys":
        """Keys of the YAML plus those of ``FOLIO_API_KEYS`` (comma-separated)."""
        from_env = [k.strip() for k in environ.get(ENV_API_KEYS, "").split(",")]
        return cls([*configured, *from_env])

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"APIKeys({len(self)} keys)"

    def tenant_of(self, authorization: str | None) -> bytes | None:
        """The matching key's digest for an ``Authorization`` header, else None.

        Every configured key is compared, whichever matches, so the time taken says
        nothing about which key (or how much of one) was right.
        """
        if not authorization:
            return None
        scheme, _, candidate = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not candidate.strip():
            return None
        digest = key_digest(candidate.strip())
        found = None
        for known in self._digests:
            if hmac.compare_digest(digest, known):
                found = known
        return found

    def cache_salt(self, tenant: bytes) -> str:
        """The tenant's prefix-cache salt (hex); never the key itself."""
        return hmac.new(self._salt_secret, tenant, hashlib.sha256).hexdigest()


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="folio"'})


class Authenticator:
    """401 unless the resolved route is public or the key is right.

    Unknown routes are not public, so a caller without a key cannot probe which exist.
    ``check`` also answers ``Expect: 100-continue`` (expect_continue.py), which aiohttp
    runs before any middleware.
    """

    def __init__(self, keys: APIKeys, public_paths: Iterable[str] = ALWAYS_PUBLIC):
        self.keys, self.public = keys, frozenset(public_paths)

    def check(self, request: web.Request) -> None:
        """Raise the 401 the request gets, if any; on success note its tenant (salt, id)."""
        if not self.keys.enabled:
            return
        tenant = self.keys.tenant_of(request.headers.get("Authorization"))
        if tenant is not None:
            request[CACHE_SALT] = self.keys.cache_salt(tenant)
            request[TENANT] = tenant_id(tenant)
            return
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical in self.public:
            return
        reason = "missing" if "Authorization" not in request.headers else "invalid"
        log.debug("unauthorized request", method=request.method, reason=reason)
        raise unauthorized("a valid API key is required: 'Authorization: Bearer <key>'"
                           if reason == "missing" else "the API key is not valid")

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        try:
            self.check(request)
        except APIError as e:
            return error_response(request, e)
        return await handler(request)
