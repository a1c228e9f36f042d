"""Tenants: the public name of an API key.

A tenant is one API key. Its id is a short hash of the key's sha256 digest: stable
whatever other keys are configured, safe to show in config files, logs and metrics,
and what ``api.tenant_weights`` and the fair scheduler know it by. `folio tenant-id`
prints it for a key.
"""
from __future__ import annotations

import hashlib


def key_digest(key: str) -> bytes:
    """The sha256 digest of an API key (what the API process keeps, never the key)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def tenant_id(digest: bytes) -> str:
    """The tenant id of the key with this digest."""
    return "t-" + hashlib.sha256(b"folio tenant id\0" + digest).hexdigest()[:12]
