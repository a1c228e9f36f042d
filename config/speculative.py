"""The ``speculative`` section: speculative decoding (README, "Speculative decoding")."""
from __future__ import annotations

from dataclasses import dataclass

from config.fields import _check, _f

SPEC_METHODS = ("none", "ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: cheap draft tokens, verified by the model in one forward.

    Outputs stay what the model alone would give: token for token at temperature 0,
    the same distribution (and, for n-gram drafts, the same seeded tokens) when
    sampling.
    """

    method: str = _f("none", "none | ngram (prompt lookup: propose what followed an "
                     "earlier occurrence of the request's last n-gram) | draft_model (a "
                     "smaller model with the same tokenizer proposes)")
    num_speculative_tokens: int = _f(5, "most draft tokens one request verifies per step "
                                     "(k); each counts against the step's token budget")
    prompt_lookup_min: int = _f(2, "ngram: the shortest n-gram that may match")
    prompt_lookup_max: int = _f(5, "ngram: the longest n-gram tried (the longest match "
                                "wins; among its occurrences, one with k tokens after "
                                "it, then the latest)")
    draft_model: str | None = _f(None, "draft_model: GGUF file or checkpoint folder of the "
                                 "draft, like model.path; its tokenizer must be the "
                                 "model's (checked at start-up)")
    disable_by_batch_size: int | None = _f(None, "no drafts in a step where more requests "
                                           "run than this; null: no limit")
    enable_adaptive: bool = _f(True, "per request, shrink k (down to 0) while its drafts "
                               "are rejected and grow it back when they hit (a probe "
                               "draft every few steps at k = 0); false: always k")

    def __post_init__(self):
        _check(self.method in SPEC_METHODS, "speculative.method",
               f"must be one of {SPEC_METHODS}, got {self.method!r}")
        _check(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               "speculative.num_speculative_tokens",
               f"must be in 1..{MAX_SPECULATIVE_TOKENS}")
        _check(self.prompt_lookup_min >= 1, "speculative.prompt_lookup_min",
               "must be at least 1")
        _check(self.prompt_lookup_max >= self.prompt_lookup_min,
               "speculative.prompt_lookup_max", "must be at least prompt_lookup_min")
        _check(self.method != "draft_model" or bool(self.draft_model),
               "speculative.draft_model", "method draft_model needs a draft_model path")
        _check(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
               "speculative.disable_by_batch_size", "must be at least 1 (or null)")

    @property
    def is_enabled(self) -> bool:
        return self.method != "none"
