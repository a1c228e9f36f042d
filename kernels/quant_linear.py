"""Linear layers on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), kept quantized.

The weight is held in Folio's packed layout (``csrc/quant_pack.h`` draws it): rows in
groups of 16 side by side, so a 64-byte vector holds 4 consecutive k of 16 rows, the
operand of one ``vpdpbusd``. :func:`pack_gguf_blocks` re-lays a GGUF tensor's blocks
into it byte for byte (the same number of bytes), :func:`dequantize` is the torch
reference of what the weight means, and :func:`quant_linear` runs ``x @ W.T`` on it:
the native kernel (``csrc/quant_linear.cpp``) when it is built, the Triton dequant-GEMM
on CUDA, else the reference.

Routes of the native kernel (``ROUTES``): the int8 ones quantize each row of x per
block of 32 to int8 (scale ``max|x| / 127``, round half to even) and multiply in
integers, as llama.cpp does; :func:`reference` emulates that exactly in float64, so the
kernel differs from it only by float32 rounding. ``WIDEN`` keeps x in float32 and
widens the weights in registers. Their difference from the dequantised product
``x @ dequantize(W).T`` is bounded by :func:`activation_rounding_bound`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_extension

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
BLOCK = 32
GROUP_ROWS = 16
# GGUF block bytes: fp16 d (and m for Q4_1), then the quants.
_GGUF_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
_OFFSET = {Q4_0: 8, Q4_1: 0, Q8_0: 128}  # stored unsigned value u = q + offset

BEST_INT8, VNNI512, AVX2, SCALAR, WIDEN = 0, 1, 2, 3, 4
ROUTES = {"int8": BEST_INT8, "int8_vnni512": VNNI512, "int8_avx2": AVX2,
          "int8_scalar": SCALAR, "widen": WIDEN}


@dataclass(slots=True)
class PackedWeight:
    """An ``[n, k]`` weight in the packed layout: ``qs`` uint8 ``[groups, k/32, 256|512]``
    and ``scales`` fp16 ``[groups, k/32, 16|32]`` (d of the 16 rows, then m for Q4_1)."""

    fmt: int
    n: int
    k: int
    qs: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * self.scales.numel()

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]


def _pack(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, fmt: int) -> PackedWeight:
    """Pack stored values ``u`` [n, blocks, 32] (0..15 or 0..255) and fp16 scales."""
    n, blocks, _ = u.shape
    groups = -(-n // GROUP_ROWS)
    pad = groups * GROUP_ROWS - n
    u = F.pad(u.to(torch.uint8), (0, 0, 0, 0, 0, pad)).view(groups, GROUP_ROWS, blocks, 32)
    if fmt == Q8_0:  # [g, j, b, chunk c, t] -> [g, b, c, j, t]
        qs = u.view(groups, GROUP_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    else:  # k = 8c + 4h + t: byte = u[h=0] | u[h=1] << 4, then [g, b, c, j, t]
        halves = u.view(groups, GROUP_ROWS, blocks, 4, 2, 4)
        qs = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    parts = [d] if m is None else [d, m]
    scales = [F.pad(s.to(torch.float16), (0, 0, 0, pad)).view(groups, GROUP_ROWS, blocks)
              .transpose(1, 2) for s in parts]
    return PackedWeight(fmt, n, blocks * BLOCK, qs.reshape(groups, blocks, -1).contiguous(),
                        torch.cat(scales, dim=2).contiguous())


def pack_gguf_blocks(raw: torch.Tensor, fmt: int, k: int) -> PackedWeight:
    """A GGUF tensor's bytes, uint8 ``[n, k / 32 * block_bytes]``, in the packed layout."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // BLOCK, _GGUF_BLOCK_BYTES[fmt])
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if fmt == Q8_0:
        u = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128
        return _pack(u, d, None, fmt)
    start = 4 if fmt == Q4_1 else 2
    nibbles = blocks[..., start:]  # byte i: q[i] low, q[i + 16] high
    u = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if fmt == Q4_1 else None
    return _pack(u, d, m, fmt)


def int8_per_channel(weight: torch.Tensor) -> PackedWeight:
    """A float ``[n, k]`` weight quantized symmetrically per output row to int8
    (``scale = max|w| / 127``), held as Q8_0 blocks that share their row's scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).to(torch.float16).float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv[:, None]).clamp(-127, 127)
    blocks = w.shape[1] // BLOCK
    u = (q.to(torch.int16) + 128).view(w.shape[0], blocks, BLOCK)
    return _pack(u, scale[:, None].expand(-1, blocks), None, Q8_0)


def _stored_values(p: PackedWeight, g: torch.Tensor | None, j: torch.Tensor | None):
    """Stored values u [rows, blocks, 32] (all rows, or rows 16g + j) as int16."""
    blocks = p.k // BLOCK
    chunks = 8 if p.fmt == Q8_0 else 4
    qs = p.qs.view(-1, blocks, chunks, GROUP_ROWS, 4)
    qs = qs.permute(0, 3, 1, 2, 4).reshape(-1, blocks, chunks, 4) if g is None \
        else qs[g, :, :, j, :]  # [rows, b, c, t]
    if p.fmt != Q8_0:  # k = 8c + 4h + t
        qs = torch.stack([qs & 15, qs >> 4], dim=3)
    return qs.reshape(qs.shape[0], blocks, BLOCK).to(torch.int16)


def _scale_columns(p: PackedWeight, g: torch.Tensor | None, j: torch.Tensor | None):
    """d (and m) [rows, blocks] as float32, for all rows or rows 16g + j."""
    sc = p.scales.float()
    if g is None:  # d[16g + j, b] = scales[g, b, j], m = scales[g, b, 16 + j]
        per_row = sc.permute(0, 2, 1)  # [g, j (+16 for m), b]
        d = per_row[:, :GROUP_ROWS].reshape(-1, sc.shape[1])[:p.n]
        m = per_row[:, GROUP_ROWS:].reshape(-1, sc.shape[1])[:p.n] if p.fmt == Q4_1 else None
        return d, m
    d = sc[g, :, j]
    return d, (sc[g, :, GROUP_ROWS + j] if p.fmt == Q4_1 else None)


def dequantize(p: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as float32, ``[n, k]``, or only ``rows`` (e.g. embedding lookups)."""
    g = j = None
    if rows is not None:
        rows = rows.reshape(-1).long()
        g, j = rows // GROUP_ROWS, rows % GROUP_ROWS
    u = _stored_values(p, g, j)[:p.n if rows is None else None]
    d, m = _scale_columns(p, g, j)
    w = (u.float() - _OFFSET[p.fmt]) * d[..., None]
    if m is not None:
        w = w + m[..., None]
    return w.reshape(w.shape[0], p.k)


def weight_rows(p: PackedWeight, rows: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize` in ``dtype`` through the native kernel when it is built (one
    op: what an embedding lookup or a dequantise-then-GEMM path calls per step)."""
    if cpu_extension.is_available():
        return cpu_extension.require().quant_dequantize(p.qs, p.scales, p.fmt, p.n, rows, dtype)
    return dequantize(p, rows).to(dtype)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int8 routes see it: per block of 32, ``xd * round(x / xd)`` with
    ``xd = max|x| / 127``, in float32 (exactly the kernel's quantization)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    xd = xb.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(xd != 0, 1 / xd, torch.zeros_like(xd))
    return (torch.round(xb * inv) * xd).reshape(x.shape)


def reference(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None = None,
              route: int = BEST_INT8, w: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ dequantize(p).T (+ bias)`` with x as the route sees it (``w``:
    ``dequantize(p)`` when the caller has it)."""
    xs = x.float() if route == WIDEN else quantize_activations(x)
    out = xs.double() @ (dequantize(p) if w is None else w).double().t()
    return out if bias is None else out + bias.double()


def activation_rounding_bound(x: torch.Tensor, p: PackedWeight,
                              w: torch.Tensor | None = None) -> torch.Tensor:
    """Bound on |int8 route - x @ dequantize(p).T| per output, [M, n], float64: each
    activation moves by at most half a step, ``max|x| of its block / 254``."""
    xb = x.double().reshape(x.shape[0], -1, BLOCK)
    half_step = xb.abs().amax(dim=-1) / 254  # [M, blocks]
    w = dequantize(p) if w is None else w
    w_abs = w.abs().reshape(p.n, -1, BLOCK).sum(dim=-1).double()  # [n, blocks]
    return half_step @ w_abs.t()


def routes_available() -> list[int]:
    """Native routes built on this machine (empty without the kernels)."""
    if not cpu_extension.is_available():
        return []
    return list(cpu_extension.require().quant_routes())


def quant_linear(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None = None,
                 route: int = BEST_INT8) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in x's dtype for x ``[..., k]``: the native kernel's
    ``route`` on the CPU, the Triton dequant-GEMM (kernels/triton_quant_linear.py) on
    CUDA, or the dequantised torch product when neither applies."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and cpu_extension.is_available():
        out = cpu_extension.require().quant_linear(x2, p.qs, p.scales, p.fmt, p.n, bias, route)
    elif x.device.type == "cuda" and p.qs.device == x.device:
        from kernels.triton_quant_linear import quant_linear_triton  # triton: GPU installs
        out = quant_linear_triton(x2, p, bias)
    else:
        out = F.linear(x2, dequantize(p).to(device=x.device, dtype=x.dtype), bias)
    return out.reshape(*x.shape[:-1], p.n)
