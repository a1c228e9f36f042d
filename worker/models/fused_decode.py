"""Decode steps through one native call for all decoder layers
(``kernels/csrc/decode_layer.cpp``: ``decode_layers``, which runs ``decode_layer`` for
each).

At batch 1 on a CPU a Llama layer's torch ops (norms, the fused projections, RoPE, the
cache write, attention, SiLU, the splits and views between them: about 100 per layer)
cost more in dispatch than the layer's arithmetic: on the default model they were 4.5
of a 10.6 ms forward. The native op runs the same kernels and the same rounding
(``LlamaDecoderLayer.forward`` is its spec, tests/worker/test_fused_decode.py holds
them together) from one call per step: a call per layer had still cost about 10 us of
dispatch and argument conversion, 0.3 ms of a 4.4 ms batch-1 step.

It was chosen over ``torch.compile`` (inductor's CPU backend), which the issue allowed:
the layer's linear layers and attention are already Folio's native kernels (quantized
blocks, 16-bit weights read once, paged attention), which inductor can only call as
opaque ops, so it would fuse only the cheap elementwise ops between them, after a
compile of minutes per batch shape on a 2-core machine.

At a few rows (up to 8) with quantized weights, or 16-bit ones on Folio's kernel, the
op runs all layers in one parallel region (its row stack, ``stack_takes``), which saved
the per-op parallel regions and serial preparation that had idled the second thread
(1.21-1.25x on the default model's batch-1 step).

A step takes the fused path when every row is a decode on the native CPU attention
kernel, with no LoRA, no tensor parallelism, no deterministic mode (whose padded
linears it does not run) and a KV cache in the activation dtype or fp8 (written as
``kernels/kv_quant.py`` quantizes it); otherwise the torch layers run. A q/k/v
projection packed in two formats (``SplitQuantLinear``: a Q4_K_M file's Q6_K v_proj
beside Q4_K q and k) passes its second part as the op's ``qkv_tail``; a model with any
other split projection runs the torch layers. ``worker.fused_decode: false`` turns it
off.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import cpu_extension
from kernels.cpu_paged_attention import v_pass_index
from kernels.kv_quant import is_fp8
from kernels.quant_linear import PackedWeight
from worker.models.linear import linear_path
from worker.models import prepacked
from worker.models.linear_paths import (AMX, BF16DOT, INT8, INT16, KERNEL, MKLDNN, NATIVE,
                                        WIDEN)
from worker.models.quant_linear import SplitQuantLinear

if TYPE_CHECKING:
    from worker.models.llama import AttentionContext, LlamaDecoderLayer, LlamaForCausalLM
    from worker.models.rotary_embedding import RotaryAngles

# decode_layer.cpp's path codes
_PATH_CODES = {NATIVE: 0, KERNEL: 1, WIDEN: 2, INT8: 3, BF16DOT: 4, AMX: 5, MKLDNN: 6,
               INT16: 7}


def _operands(layer) -> tuple[list, tuple]:
    """A linear layer's (weight or qs, scales) and its fixed meta (fmt, n). A tensor
    weight's scales slot carries its oneDNN copy in the steps that run the mkldnn path
    (filled per call, see FusedDecode.run)."""
    w = layer.weight
    if isinstance(w, PackedWeight):
        return [w.qs, w.scales], (w.fmt, w.n)
    return [w, None], (0, w.shape[0])


def _splits_allowed(layer) -> bool:
    """Whether the native op takes this layer's projections: split only q/k/v, in two."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = attn.qkv_proj
    return (not any(isinstance(m, SplitQuantLinear) for m in (attn.o_proj, mlp.gate_up_proj,
                                                              mlp.down_proj))
            and (not isinstance(qkv, SplitQuantLinear) or len(qkv.parts) == 2))


class FusedDecode:
    """The native per-layer decode op for one model: each layer's operands gathered
    once (parameters, whose ``.data`` sleep mode may swap, are passed as themselves) and
    each row count's linear paths once."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.ops = cpu_extension.require()
        self.layers: list[list] = []
        self._linears: list[list] = []  # per layer: (layer, fmt, n) of qkv, o, gate_up,
        # down and qkv's tail (None, 0, 0 without one)
        self._scales_slot: dict[int, int] = {}  # id(linear layer) -> its scales slot
        offset = 0  # where this layer's operands start in the flat list
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            linears = []
            qkv, tail = attn.qkv_proj, None
            if isinstance(qkv, SplitQuantLinear):
                (head, tail), bias = qkv.parts, qkv.bias
            else:
                head, bias = qkv, qkv.bias
            for i, lin in enumerate((head, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, tail)):
                if lin is None:  # no tail: (path, fmt, n) = 0 in the meta
                    weights += [None, None]
                    linears.append((None, 0, 0))
                    continue
                operands, (fmt, n) = _operands(lin)
                self._scales_slot[id(lin)] = offset + len(weights) + 1
                weights += operands
                if i == 0:
                    weights.append(bias)
                linears.append((lin, fmt, n))
            self.layers.append(weights)
            self._linears.append(linears)
            offset += len(weights)
        attn = model.layers[0].self_attn
        self.head_shape = [attn.num_heads, attn.num_kv_heads, attn.head_dim]
        self.scale = attn.scale
        self.eps = model.layers[0].input_layernorm.eps
        self._metas: dict[tuple[int, torch.dtype], list[int]] = {}
        # per (rows, dtype): (scales slot, layer) of the linears on the mkldnn path
        self._prepacked: dict[tuple[int, torch.dtype], list[tuple[int, object]]] = {}
        self.weights = [w for layer in self.layers for w in layer]  # the op's flat list

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Whether this model can take the fused path at all (checked once, at load)."""
        return (model.tp is None and model.norm.weight.device.type == "cpu"
                and cpu_extension.is_available()
                and all(_splits_allowed(layer) for layer in model.layers))

    def takes(self, num_tokens: int, dtype: torch.dtype, kv_caches: list[torch.Tensor],
              ctx: AttentionContext) -> bool:
        """Whether this step can run fused: decode rows only, on the native kernel."""
        plan = ctx.plan
        return (num_tokens > 0 and plan.num_decodes == num_tokens and not plan.prefills
                and plan.decode_block_tables is not None
                and (kv_caches[0].dtype == dtype or is_fp8(kv_caches[0].dtype))
                and not self.model.is_batch_invariant)

    def _meta(self, rows: int, dtype: torch.dtype) -> list[int]:
        """Every layer's meta for ``rows`` rows, layer after layer (decode_layer.cpp)."""
        key = (rows, dtype)
        metas = self._metas.get(key)
        if metas is None:
            metas, packed = [], []
            for linears in self._linears:
                metas += self.head_shape
                for lin, fmt, n in linears:
                    if lin is None:
                        metas += [0, 0, 0]
                        continue
                    path = linear_path(rows, dtype, torch.device("cpu"), lin.weight, lin.choice)
                    if path == MKLDNN:
                        packed.append((self._scales_slot[id(lin)], lin))
                    metas += [_PATH_CODES[path], fmt, n]
            self._metas[key] = metas
            self._prepacked[key] = packed
        return metas

    def stack_takes(self, rows: int, dtype: torch.dtype, kv_caches: list[torch.Tensor]) -> bool:
        """Whether a step of ``rows`` decode rows runs all layers in one parallel region
        (``decode_layer.cpp``'s row stack: 1 to 8 rows, two threads or more, every linear
        layer quantized on a route that takes a tile of rows alone, or 16-bit on Folio's
        kernel) rather than layer by layer."""
        hidden_size = self.model.layers[0].input_layernorm.weight.shape[0]
        half = self.head_shape[2] // 2
        return self.ops.decode_layers_stack_takes(
            torch.zeros(rows, hidden_size, dtype=dtype), self.weights, self._meta(rows, dtype),
            kv_caches, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, half, dtype=dtype),
            torch.zeros(rows, half, dtype=dtype))

    def run(self, angles: RotaryAngles, hidden: torch.Tensor, kv_caches: list[torch.Tensor],
            ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer on ``hidden`` [rows, hidden]; (hidden, residual) before
        the final norm, as the unfused loop leaves them."""
        rows = hidden.shape[0]
        plan = ctx.plan
        half = self.head_shape[2] // 2
        cos = angles.cos.reshape(rows, half).contiguous()
        sin = angles.sin.reshape(rows, half).contiguous()
        tables, lens = plan.decode_block_tables, plan.decode_seq_lens
        slots = ctx.slot_mapping.contiguous()
        hidden = hidden.contiguous()
        meta = self._meta(rows, hidden.dtype)
        packed = self._prepacked[(rows, hidden.dtype)]
        for slot, lin in packed:  # current copies (a weight update repacks), this call only
            self.weights[slot] = prepacked.packed(lin.weight)
        try:
            return self.ops.decode_layers(hidden, self.weights, meta, kv_caches, slots, tables,
                                          lens, cos, sin, self.eps, self.scale,
                                          plan.sliding_window,
                                          v_pass_index(plan.decode_v_pass))
        finally:
            for slot, _ in packed:  # the list never keeps a copy alive (sleep frees them)
                self.weights[slot] = None
