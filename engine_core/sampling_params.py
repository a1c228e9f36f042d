"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

import copy
import math
from collections.abc import Collection
from dataclasses import dataclass, field, fields

from config.request_bounds import ENGINE_MAX_LOGPROBS as MAX_LOGPROBS
from config.request_bounds import ENGINE_MAX_STOP_STRINGS as MAX_STOP_STRINGS
from config.request_bounds import ENGINE_MAX_STOP_TOKEN_IDS as MAX_STOP_TOKEN_IDS
from engine_core.structured_outputs import StructuredOutputError, StructuredOutputsParams

MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (OpenAI allows 300)


class InvalidRequestError(ValueError):
    """A request field holds a value the engine cannot serve.

    ``param`` names the offending field so that callers (the offline API, the
    HTTP layer) can report it without parsing the message.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__}", name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}", name)


def _int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)


def _check_token_ids(ids: Collection) -> None:
    """Non-negative ints (never bools), at most MAX_STOP_TOKEN_IDS of them. The loops
    run in C (``map(type, ...)``, ``min``): a long list costs no Python call per id."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are "
                                  f"allowed, got {len(ids)}", "stop_token_ids")
    if not set(map(type, ids)) <= {int}:
        raise InvalidRequestError("stop_token_ids must be integers", "stop_token_ids")
    if ids and min(ids) < 0:
        raise InvalidRequestError("stop_token_ids must be non-negative", "stop_token_ids")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request (the fields vLLM users know).

    ``temperature == 0`` means greedy decoding. ``max_tokens=None`` means "as many as
    fit in ``max_model_len``"; the engine fills it in when the request is added.
    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or
    grammar (engine_core/structured_outputs.py; a dict of its fields is accepted).
    Validated on construction; ``clone`` re-checks only what it changes.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    # Any collection of ints is accepted and frozen: membership is O(1) per sampled token.
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return besides the sampled one
    # per prompt token (all but the first): its logprob and this many top ones
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id → added to its logit
    priority: int = 0  # lower value is served first under the priority policy
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        ids = self.stop_token_ids
        if not isinstance(ids, frozenset):
            try:
                ids = list(ids or ())
            except TypeError:
                raise InvalidRequestError("stop_token_ids must be a list of integers",
                                          "stop_token_ids") from None
        _check_token_ids(ids)  # before hashing: [[1]] is a bad request, not a TypeError
        # Immutable, so the n samples of a request (and their clones) share one set.
        self.stop_token_ids = frozenset(ids)
        if self.top_k == -1:
            self.top_k = 0
        self._check_scalars()
        self._check_stop_strings()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field out of range.

        Linear in the stop lists, and each element costs C, not Python, calls."""
        self._check_scalars()
        self._check_stop_strings()
        _check_token_ids(self.stop_token_ids)

    def _check_scalars(self) -> None:
        """Every field but the stop lists: O(1)."""
        _int("n", self.n)
        if self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}", "n")
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be non-negative, got {self.temperature}", "temperature")
        _finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _int("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be -1 (disable) or at least 1, got {self.top_k}", "top_k")
        _finite("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None:
            _int("seed", self.seed)
        self._check_lengths()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        _finite("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2 ** 16:
            raise InvalidRequestError(
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
                "repetition_penalty")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                    f"{self.prompt_logprobs}", "prompt_logprobs")
        _int("priority", self.priority)
        self._check_structured_outputs()
        if self.logit_bias is not None:
            self._check_logit_bias()

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams "
                                      "or a dict of its fields", "structured_outputs")
        # The grammar allows EOS only at its end, and min_tokens bans EOS before it: a
        # grammar that ends early would leave no token to sample.
        if self.min_tokens:
            raise InvalidRequestError("min_tokens cannot be combined with structured "
                                      "outputs", "min_tokens")

    def _check_logit_bias(self) -> None:
        """Token ids (non-negative ints) → finite biases in [-100, 100]; the vocabulary's
        upper bound is the API's and the engine's to check (they know the model)."""
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} "
                                      f"entries, got {len(bias)}", "logit_bias")
        for token_id, value in bias.items():
            _int("logit_bias", token_id)
            if token_id < 0:
                raise InvalidRequestError(f"logit_bias holds token id {token_id}, which is "
                                          f"negative", "logit_bias")
            _finite("logit_bias", value)
            if not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got "
                                          f"{value} for token {token_id}", "logit_bias")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidRequestError(
                    f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens})", "min_tokens")

    def _check_stop_strings(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
                "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop strings must be non-empty strings", "stop")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed, and those checked.

        Scalars are re-checked in O(1); the stop lists only when they are among the
        changes. So the n samples of a request (``n=1``, ``seed + i``, ``max_tokens``
        filled in) cost nothing per stop token id: they share the request's one
        validated, immutable ``stop_token_ids``.
        """
        new = copy.copy(self)
        new.stop = list(self.stop)
        for name, value in changes.items():
            setattr(new, name, value)
        if changes.keys() & {"stop", "stop_token_ids", "top_k"}:
            new.__post_init__()  # normalise these, then check everything
        else:
            new._check_scalars()
        return new

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _structured(fields_: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields_)
    except TypeError as e:
        raise InvalidRequestError(f"structured_outputs: {e}", "structured_outputs") from None
    except StructuredOutputError as e:
        raise InvalidRequestError(str(e), "structured_outputs") from None
