"""Folio's public face: the offline ``LLM`` engine and ``SamplingParams``."""
from engine_core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # Import lazily so `import folio` stays cheap for tools that only need the CLI.
    if name == "LLM":
        from folio.llm import LLM
        return LLM
    raise AttributeError(name)
