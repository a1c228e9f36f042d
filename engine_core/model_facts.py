"""What the engine core must know of the model and its KV pool."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The model's limits and the KV pool, as the worker found them at load time.

    The worker announces them (``WorkerReady``) and the engine core and every API
    process size themselves from them; the offline ``LLM`` passes them in-process.
    """

    num_blocks: int  # KV blocks in the pool, block 0 (the null block) included
    block_size: int  # tokens per block
    max_model_len: int  # longest prompt + output
    vocab_size: int  # the model's vocabulary (token ids are in [0, vocab_size))
    eos_token_ids: list[int]  # the model's and the tokenizer's end tokens, merged
    dtype: str  # the weights' and activations' dtype, as resolved ("float32", ...)
    device: str  # where the model runs ("cpu", "cuda:0")
