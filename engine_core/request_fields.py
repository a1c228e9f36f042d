"""The engine core's own checks of a request's fields (whatever the API in front of it
allowed): each raises InvalidRequestError naming the field."""
from __future__ import annotations

import math
from collections.abc import Sequence

from engine_core.sampling_params import InvalidRequestError

MAX_TENANT_CHARS = 128  # tenants are API-key names, not payloads


def check_tenant(tenant: object, tenant_weight: object) -> None:
    """A tenant is null or a short name; its weight a finite number above 0."""
    if tenant is not None and (not isinstance(tenant, str)
                               or not 0 < len(tenant) <= MAX_TENANT_CHARS):
        raise InvalidRequestError(f"tenant must be null or a non-empty string of at most "
                                  f"{MAX_TENANT_CHARS} characters", "tenant")
    if (isinstance(tenant_weight, bool) or not isinstance(tenant_weight, (int, float))
            or not math.isfinite(tenant_weight) or tenant_weight <= 0):
        raise InvalidRequestError(f"tenant_weight must be a finite number > 0, got "
                                  f"{tenant_weight!r}", "tenant_weight")


def check_vocabulary(token_ids: frozenset[int], param: str, upper: int | None) -> None:
    """Never more ids than the vocabulary holds, none outside it (the engine's own
    bound, whatever the API in front of it allows)."""
    if upper is None or not token_ids:
        return
    if len(token_ids) > upper:
        raise InvalidRequestError(f"{param} holds {len(token_ids)} ids, more than the "
                                  f"vocabulary's {upper}", param)
    if max(token_ids) >= upper:
        raise InvalidRequestError(f"{param} holds token id {max(token_ids)}, outside "
                                  f"the vocabulary [0, {upper})", param)


def check_prompt(prompt_token_ids: Sequence[int], upper: int | None) -> list[int]:
    """Ints in the vocabulary; the per-id loops run in C (``map``, ``min``, ``max``)."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise InvalidRequestError("prompt must contain at least one token", "prompt")
    if not set(map(type, prompt)) <= {int}:  # bool is not an int here
        bad = next(t for t in prompt if type(t) is not int)
        raise InvalidRequestError(f"prompt token ids must be integers, got {bad!r}",
                                  "prompt")
    low, high = min(prompt), max(prompt)
    if low < 0 or (upper is not None and high >= upper):
        raise InvalidRequestError(f"prompt token id {low if low < 0 else high} is "
                                  f"outside the vocabulary [0, {upper})", "prompt")
    return prompt
