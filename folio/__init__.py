"""Folio's public face: the offline ``LLM`` engine, ``SamplingParams``, ``LoRARequest``."""
from engine_core.sampling_params import SamplingParams
from folio.lora_request import LoRARequest

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name):
    # Import lazily so `import folio` stays cheap for tools that only need the CLI.
    if name == "LLM":
        from folio.llm import LLM
        return LLM
    raise AttributeError(name)
