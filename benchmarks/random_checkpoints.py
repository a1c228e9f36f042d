"""Random-weight Llama checkpoints in real models' shapes, written on the spot.

The GPU check cannot carry a real model (the default one alone is 94 MB), so it writes
checkpoints of the shapes that matter with the transformers found on the machine: a
``config.json`` + safetensors folder any Llama loader reads, plus a word-level
``tokenizer.json`` of the same vocabulary (token ``t<i>`` is id i), so Folio and
Hugging Face run the very same weights. Nothing is downloaded.

==================  ========================================================================
smollm2-random      SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads of 64, tied
llama3-random       Llama-3-like: head_dim 128, 16 query heads per 2 KV heads (groups of
                    8), vocabulary 128256, llama3 rope scaling, tied (as Llama 3.2)
tinyllama-random    TinyLlama-1.1B: 22 layers, hidden 2048, 32 / 4 heads, untied, ~1.1B
tiny                2 layers, hidden 64 (CPU smoke runs)
==================  ========================================================================

``small=True`` keeps a shape's heads, head_dim, rope and tying but cuts it to 2 layers,
hidden 16 per head and a 4096-token vocabulary: the same code paths at a CPU's pace.

Weights are drawn N(0, std). At transformers' 0.02 a random Llama repeats the token
it was given for ever (its tied embedding outweighs the layers), which would let a
stale-state bug pass a parity check; at 0.2 a 30-layer one turns chaotic (float32
rounding grows to 1e-3 in the logits, enough to flip near-tied greedy choices).
Measured on the CPU against transformers: full shapes at 0.05 give varied tokens with
float32 logits within ~3e-5 of Hugging Face's; the 2-layer small ones need 0.2.
"""
from __future__ import annotations

from pathlib import Path

import torch

INIT_STD = {False: 0.05, True: 0.2}  # by small
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
ARCHS = {
    "smollm2-random": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                           max_position_embeddings=8192,
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama3-random": dict(vocab_size=128256, hidden_size=1024, intermediate_size=3584,
                          num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=2, head_dim=128, tie_word_embeddings=True,
                          max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE),
    "tinyllama-random": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                             num_hidden_layers=22, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
                             max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, tie_word_embeddings=True, max_position_embeddings=2048,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def architecture(name: str, small: bool = False) -> dict:
    """The LlamaConfig keywords of ``name``, cut down to CPU size when ``small``."""
    arch = dict(ARCHS[name])
    if small and name != "tiny":  # transformers wants hidden a multiple of the heads
        arch.update(num_hidden_layers=2, hidden_size=16 * arch["num_attention_heads"],
                    intermediate_size=512, vocab_size=4096)
    return arch


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id (``t<i>``), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def write_checkpoint(name: str, folder: Path, small: bool = False, seed: int = 0,
                     dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Path:
    """Write ``name``'s random checkpoint (weights in ``dtype``) and tokenizer to ``folder``.

    ``device`` only speeds up drawing the weights (a GPU draws a billion in
    milliseconds); the files are the same kind either way.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    arch = architecture(name, small)
    config = LlamaConfig(bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                         initializer_range=INIT_STD[small], **arch)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(folder)
    write_tokenizer(folder, arch["vocab_size"])
    del model
    return folder
