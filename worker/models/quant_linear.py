"""Model layers whose weights stay block-quantized, and putting them into a model.

Two ways in, both ending in :class:`QuantLinear` layers that hold a ``PackedWeight``
(kernels/quant_linear.py) and compute through the native quantized kernels:

* :func:`install_gguf_blocks`: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices, as loaded by
  worker/gguf_loader.py's ``load_gguf_quantized``. q/k/v and gate/up are fused as
  the float model fuses them, by stacking rows of blocks (blocks never straddle rows);
  the embedding becomes a :class:`QuantEmbedding` and, when tied, the LM head reads the
  same packed matrix. Parts in different formats (a Q4_K_M file's Q6_K v_proj beside
  Q4_K q and k) stay apart in a :class:`SplitQuantLinear`. Call it before
  ``load_weights``, which then loads only the rest.
* :func:`quantize_linears_int8`: after a float model is loaded, each linear weight is
  quantized per output channel to int8 (vLLM's on-the-fly style), held as Q8_0 blocks
  that share their row's scale. Embedding and LM head stay as they are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.quant_linear import BLOCK, PackedWeight, int8_per_channel, pack_gguf_blocks
from kernels.quant_linear import weight_rows
from worker.models.linear import Linear, linear
from worker.models.linear_paths import LinearChoice

if TYPE_CHECKING:  # the model code imports this module on GPU machines, which lack gguf
    from worker.gguf_loader import QuantizedBlocks


class QuantLinear(nn.Module):
    """A linear layer on a packed quantized ``weight`` (same attribute names as
    ``nn.Linear``; ``choice`` is the measured path per row count, set at load)."""

    choice: LinearChoice | None = None

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight  # not a buffer: .to(dtype) must never cast its fp16 scales
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.in_features, self.out_features = weight.k, weight.n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.choice)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.weight.format_name}")


class SplitQuantLinear(nn.Module):
    """A fused projection whose parts are packed in different formats: one
    :class:`QuantLinear` per run of same-format parts, their outputs side by side (the
    rows the fused float layer would hold, in order); the fused ``bias``, if any, is
    this layer's, so it loads under the fused layer's name."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


class QuantEmbedding(nn.Module):
    """Token embeddings looked up in a packed quantized matrix (rows dequantised on
    demand, into the dtype the model was last moved to)."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = weight_rows(self.weight, input_ids, self.dtype)
        return rows.reshape(*input_ids.shape, self.weight.k)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) reaches here: follow the dtype it gives a float tensor
        probe = fn(torch.empty(0, dtype=self.dtype))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        return self


def _stack(parts: list[QuantizedBlocks]) -> PackedWeight | None:
    """One packed matrix of the parts' rows, or None if their formats differ."""
    if len({p.ggml_type for p in parts}) != 1:
        return None
    raw = torch.cat([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
    return pack_gguf_blocks(raw, parts[0].ggml_type, parts[0].shape[1])


def _split_layer(parts: list[QuantizedBlocks], bias: torch.Tensor | None) -> SplitQuantLinear:
    """Runs of same-format parts, each packed on its own rows."""
    runs: list[list[QuantizedBlocks]] = []
    for part in parts:
        if runs and runs[-1][0].ggml_type == part.ggml_type:
            runs[-1].append(part)
        else:
            runs.append([part])
    return SplitQuantLinear([QuantLinear(_stack(run)) for run in runs], bias)


def _fused_groups(num_layers: int) -> dict[str, list[str]]:
    """Model module path → the HF weight names it fuses, in row order."""
    groups = {}
    for i in range(num_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        groups[m + "self_attn.qkv_proj"] = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
        groups[m + "self_attn.o_proj"] = [f"{p}self_attn.o_proj.weight"]
        groups[m + "mlp.gate_up_proj"] = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        groups[m + "mlp.down_proj"] = [f"{p}mlp.down_proj.weight"]
    groups["lm_head"] = ["lm_head.weight"]
    return groups


@torch.no_grad()
def install_gguf_blocks(model: nn.Module, blocks: dict[str, QuantizedBlocks]) -> int:
    """Swap in quantized layers for the matrices in ``blocks``; returns how many.

    Entries used are removed from ``blocks``; what is left (a matrix no layer here
    takes) the caller dequantises and loads as floats."""
    count = 0
    for path, names in _fused_groups(model.arch.num_hidden_layers).items():
        if not all(n in blocks for n in names):
            continue
        parts = [blocks[n] for n in names]
        packed = _stack(parts)
        layer = model.get_submodule(path)
        bias = getattr(layer, "bias", None)
        model.set_submodule(path, QuantLinear(packed, bias) if packed is not None
                            else _split_layer(parts, bias))
        for n in names:
            del blocks[n]
        count += 1
    embed = blocks.pop("model.embed_tokens.weight", None)
    if embed is not None:
        packed = _stack([embed])
        model.embed_tokens = QuantEmbedding(packed)
        if model.lm_head is None:
            model.head_weight = packed  # tied: compute_logits reads the same blocks
        count += 1
    return count


@torch.no_grad()
def quantize_linears_int8(model: nn.Module) -> int:
    """Replace every :class:`Linear` whose in-features are whole blocks of 32 with an
    int8 per-channel :class:`QuantLinear`; returns how many."""
    count = 0
    for path, layer in list(model.named_modules()):
        if isinstance(layer, Linear) and layer.in_features % BLOCK == 0:
            model.set_submodule(path, QuantLinear(int8_per_channel(layer.weight), layer.bias))
            count += 1
    return count
