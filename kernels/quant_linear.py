"""Linear layers on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), kept
quantized.

The weight is held in Folio's packed layout (``csrc/quant_pack.h`` draws it): rows in
groups of 16 side by side, so a 64-byte vector holds 4 consecutive k of 16 rows, the
operand of one ``vpdpbusd``. :func:`pack_gguf_blocks` re-lays a GGUF tensor's blocks
into it byte for byte (the same number of bytes; the K-quants' 256-value superblocks
keep their scales as stored, 6-bit and 8-bit integers under a per-row fp16 ``d``, a
few bytes more per 16 rows), :func:`dequantize` is the torch
reference of what the weight means, and :func:`quant_linear` runs ``x @ W.T`` on it:
the native kernel (``csrc/quant_linear.cpp``) when it is built, the Triton dequant-GEMM
on CUDA, else the reference.

Routes of the native kernel (``ROUTES``): the int8 ones quantize each row of x per
block of 32 to int8 (scale ``max|x| / 127``, round half to even) and multiply in
integers, as llama.cpp does; :func:`reference` emulates that exactly in float64, so the
kernel differs from it only by float32 rounding. ``WIDEN`` keeps x in float32 and
widens the weights in registers. Their difference from the dequantised product
``x @ dequantize(W).T`` is bounded by :func:`activation_rounding_bound`. ``BF16DOT``
(AVX512-BF16 CPUs) multiplies bf16 activations by 4-bit weights turned into bf16 pairs
with ``vdpbf16ps``: products exact in float32, like ``WIDEN``, which it falls back to
for other activations and formats. ``AMX`` (AMX-BF16 CPUs) is the same product on AMX
tiles, ``tdpbf16ps``, 16 activation rows x 16 weight rows x one block per instruction.
``INT16`` (AVX2 CPUs; Q4_0, Q4_1, Q4_K, Q8_0, else widening) rounds x per block of 32 to
int16 (scale ``max|x| / 32767``) and multiplies 16-bit pairs with ``vpmaddwd``, exact in
integers: its only rounding is the activations', 256 times finer than the int8 routes'.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_extension

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14  # ggml type ids
FORMAT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
K_QUANTS = frozenset({Q4_K, Q6_K})
BLOCK = 32
SUPERBLOCK = 256  # the K-quants' unit along k: 8 blocks under one d per row
GROUP_ROWS = 16
# GGUF block bytes (per 32 values; per 256 for the K-quants)
_GGUF_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q6_K: 210}
_OFFSET = {Q4_0: 8, Q4_1: 0, Q8_0: 128, Q4_K: 0, Q6_K: 32}  # stored u = q + offset
# Packed scale bytes per group of 16 rows and superblock (csrc/quant_pack.h):
#   Q4_K: d fp16[16] | dmin fp16[16] | sc low nibbles [8 blocks][8] | m low [8][8]
#         | sc top bits [8][4] | m top [8][4]   (6-bit sc and m, as GGUF's 16 bytes a row)
#   Q6_K: d fp16[16] | sc i8[8 blocks][2 halves][16]
_K_SCALE_BYTES = {Q4_K: 256, Q6_K: 288}

BEST_INT8, VNNI512, AVX2, SCALAR, WIDEN, BF16DOT, AMX, INT16 = 0, 1, 2, 3, 4, 5, 6, 7
ROUTES = {"int8": BEST_INT8, "int8_vnni512": VNNI512, "int8_avx2": AVX2,
          "int8_scalar": SCALAR, "widen": WIDEN, "bf16dot": BF16DOT, "amx": AMX,
          "int16": INT16}
INT16_FORMATS = frozenset({Q4_0, Q4_1, Q4_K, Q8_0})  # INT16 widens the others
EXACT_ROUTES = frozenset({WIDEN, BF16DOT, AMX})  # x as given: float32 rounding only


@dataclass(slots=True)
class PackedWeight:
    """An ``[n, k]`` weight in the packed layout: ``qs`` uint8 ``[groups, k/32,
    256|384|512]`` and ``scales`` fp16 ``[groups, k/32, 16|32]`` (d of the 16 rows, then
    m for Q4_1), or for the K-quants uint8 ``[groups, k/256, 256|288]``."""

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
        return self.qs.numel() + self.scales.element_size() * self.scales.numel()

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]


def _pack_values(u: torch.Tensor, fmt: int) -> torch.Tensor:
    """Stored values ``u`` [n, blocks, 32] (0..15, 0..63 or 0..255) as packed ``qs``."""
    n, blocks, _ = u.shape
    groups = -(-n // GROUP_ROWS)
    pad = groups * GROUP_ROWS - n
    u = F.pad(u.to(torch.uint8), (0, 0, 0, 0, 0, pad)).view(groups, GROUP_ROWS, blocks, 32)
    if fmt == Q8_0:  # [g, j, b, chunk c, t] -> [g, b, c, j, t]
        qs = u.view(groups, GROUP_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
        return qs.reshape(groups, blocks, -1).contiguous()
    # k = 8c + 4h + t: byte = low nibble of u[h=0] | of u[h=1] << 4, then [g, b, c, j, t]
    halves = (u & 15).view(groups, GROUP_ROWS, blocks, 4, 2, 4)
    qs = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    qs = qs.reshape(groups, blocks, -1)
    if fmt != Q6_K:
        return qs.contiguous()
    # Q6_K's top two bits: plane h (k 16h..16h+15), byte 4j + t, bits 2f..2f+1 hold
    # k = 16h + 4f + t of row j
    top = (u >> 4).view(groups, GROUP_ROWS, blocks, 2, 4, 4)  # [g, j, b, h, f, t]
    planes = top[..., 0, :] | top[..., 1, :] << 2 | top[..., 2, :] << 4 | top[..., 3, :] << 6
    planes = planes.permute(0, 2, 3, 1, 4).reshape(groups, blocks, -1)  # [g, b, h, j, t]
    return torch.cat([qs, planes], dim=2).contiguous()


def _row_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, ...] → [groups, 16, ...], rows zero-padded to whole groups."""
    pad = groups * GROUP_ROWS - t.shape[0]
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return t.view(groups, GROUP_ROWS, *t.shape[1:])


def _pack(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, fmt: int) -> PackedWeight:
    """Pack stored values ``u`` [n, blocks, 32] (0..15 or 0..255) and fp16 scales."""
    n, blocks, _ = u.shape
    groups = -(-n // GROUP_ROWS)
    parts = [d] if m is None else [d, m]
    scales = [_row_groups(s.to(torch.float16), groups).transpose(1, 2) for s in parts]
    return PackedWeight(fmt, n, blocks * BLOCK, _pack_values(u, fmt),
                        torch.cat(scales, dim=2).contiguous())


def _pack_six_bits(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 6-bit sc or m of 16 rows, ``v`` uint8 [..., 8 blocks, 16], as 12 bytes a
    block: 8 of low nibbles (byte j: row j | row j + 8 << 4) and 4 of top bits (byte j,
    bits 2f..2f+1: row 4f + j); flattened over the blocks, [..., 64] and [..., 32]."""
    lo = (v[..., :8] & 15) | ((v[..., 8:] & 15) << 4)
    top = (v >> 4).view(*v.shape[:-1], 4, 4)  # [..., f, j]: row 4f + j
    hi = top[..., 0, :] | top[..., 1, :] << 2 | top[..., 2, :] << 4 | top[..., 3, :] << 6
    return lo.flatten(-2), hi.flatten(-2)


def _six_bits(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pack_six_bits`: [..., 64] and [..., 32] bytes to the
    values uint8 [..., 8 blocks, 16 rows]."""
    lo, hi = lo.unflatten(-1, (8, 8)), hi.unflatten(-1, (8, 4))
    low = torch.cat([lo & 15, lo >> 4], dim=-1)
    top = torch.cat([(hi >> (2 * f)) & 3 for f in range(4)], dim=-1)
    return low | (top << 4)


def _pack_k(u: torch.Tensor, d: torch.Tensor, parts: list[torch.Tensor], fmt: int) -> PackedWeight:
    """A K-quant: ``u`` [n, blocks, 32], ``d`` fp16 [n, superblocks] and the per-row
    integer ``parts`` (Q4_K: dmin fp16 [n, sb], sc and m u8 [n, sb, 8]; Q6_K: sc i8
    [n, sb, 16]) into the packed scale bytes, per group and superblock."""
    n, blocks, _ = u.shape
    groups, sb = -(-n // GROUP_ROWS), blocks * BLOCK // SUPERBLOCK

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [n, sb, ...] -> [g, sb, bytes]
        t = _row_groups(t.contiguous().view(torch.uint8).view(n, sb, -1), groups)
        if t.shape[-1] == 2:  # an fp16 per row: [g, j, sb, 2] -> [g, sb, j, 2]
            return t.permute(0, 2, 1, 3).reshape(groups, sb, -1)
        # integers per row and block: [g, j, sb, i] -> [g, sb, i, j]
        return t.permute(0, 2, 3, 1).reshape(groups, sb, -1)

    fields = [per_group(p[..., None] if p.dtype == torch.float16 else p) for p in parts]
    if fmt == Q4_K:  # 6-bit sc and m: low nibbles, then top bits (_six_bits)
        dmin, sc, m = fields
        (sc_lo, sc_hi), (m_lo, m_hi) = (_pack_six_bits(t.view(groups, sb, 8, GROUP_ROWS))
                                        for t in (sc, m))
        fields = [dmin, sc_lo, m_lo, sc_hi, m_hi]
    scales = torch.cat([per_group(d[..., None])] + fields, dim=2)
    assert scales.shape[2] == _K_SCALE_BYTES[fmt]
    return PackedWeight(fmt, n, blocks * BLOCK, _pack_values(u, fmt), scales.contiguous())


def _q4_k_fields(blocks: torch.Tensor):
    """Q4_K superblocks [n, sb, 144] → d, dmin fp16 [n, sb], sc, m u8 [n, sb, 8] and
    u [n, sb * 8, 32]: w = d * sc * u - dmin * m per block of 32."""
    n, sb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    packed = blocks[..., 4:16].reshape(n, sb, 3, 4)  # 6-bit sc and m of 8 blocks
    lo, mid, top = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([lo & 63, (top & 15) | ((lo >> 2) & 48)], dim=-1)
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 2) & 48)], dim=-1)
    qs = blocks[..., 16:].reshape(n, sb, 4, 1, 32)  # 4 x 32 bytes: low nibbles block 2i
    u = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, sb * 8, 32)
    return d, dmin, sc, m, u


def _q6_k_fields(blocks: torch.Tensor):
    """Q6_K superblocks [n, sb, 210] → d fp16 [n, sb], sc i8 [n, sb, 16] and
    u [n, sb * 8, 32] (0..63): w = d * sc * (u - 32) per 16 values."""
    n, sb, _ = blocks.shape
    ql = blocks[..., 0:128].reshape(n, sb, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(n, sb, 2, 1, 32)
    sc = blocks[..., 192:208].contiguous().view(torch.int8)
    d = blocks[..., 208:210].contiguous().view(torch.float16)[..., 0]
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(n, sb, 2, 4, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3)  # [n, sb, 2, 4, 32]
    u = (low | (high << 4)).reshape(n, sb * 8, 32)
    return d, sc, u


PACK_ROWS = 4096  # rows packed at a time (a multiple of GROUP_ROWS)


def pack_gguf_blocks(raw: torch.Tensor, fmt: int, k: int) -> PackedWeight:
    """A GGUF tensor's bytes, uint8 ``[n, k / 32 * block_bytes]``, in the packed layout.
    Rows go PACK_ROWS at a time, so the unpacking's temporaries stay small beside the
    result (a 1B model's 49,152-row LM head would otherwise peak at several copies)."""
    n = raw.shape[0]
    if n > PACK_ROWS:
        parts = [pack_gguf_blocks(raw[i:i + PACK_ROWS], fmt, k) for i in range(0, n, PACK_ROWS)]
        return PackedWeight(fmt, n, k, torch.cat([q.qs for q in parts]),
                            torch.cat([q.scales for q in parts]))
    if fmt in K_QUANTS:
        if k % SUPERBLOCK:
            raise ValueError(f"{FORMAT_NAMES[fmt]} rows hold whole superblocks of 256 values")
        blocks = raw.reshape(n, k // SUPERBLOCK, _GGUF_BLOCK_BYTES[fmt])
        if fmt == Q4_K:
            d, dmin, sc, m, u = _q4_k_fields(blocks)
            return _pack_k(u, d, [dmin, sc, m], fmt)
        d, sc, u = _q6_k_fields(blocks)
        return _pack_k(u, d, [sc], fmt)
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


def _stored_values(p: PackedWeight, g: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Stored values u [rows, blocks, 32] of rows 16g + j, as int16."""
    blocks = p.k // BLOCK
    chunks = 8 if p.fmt == Q8_0 else 4
    body = p.qs[:, :, :64 * chunks].reshape(-1, blocks, chunks, GROUP_ROWS, 4)
    qs = body[g, :, :, j, :]  # [rows, b, c, t]
    if p.fmt != Q8_0:  # k = 8c + 4h + t
        qs = torch.stack([qs & 15, qs >> 4], dim=3)
    u = qs.reshape(qs.shape[0], blocks, BLOCK).to(torch.int16)
    if p.fmt == Q6_K:  # k = 16h + 4f + t: bits 2f of plane h, byte 4j + t
        planes = p.qs[:, :, 256:].reshape(-1, blocks, 2, GROUP_ROWS, 4)[g, :, :, j, :]
        top = torch.stack([(planes >> (2 * f)) & 3 for f in range(4)], dim=3)  # [r, b, h, f, t]
        u = u | (top.reshape(u.shape).to(torch.int16) << 4)
    return u


def _block_scales(p: PackedWeight, g: torch.Tensor, j: torch.Tensor):
    """D and M [rows, blocks, 2] float32 of rows 16g + j, per half block of 16 values:
    ``w = D * (u - offset) + M`` (M is zero but for Q4_1 and Q4_K)."""
    if p.fmt not in K_QUANTS:  # d[16g + j, b] = scales[g, b, j], m = scales[g, b, 16 + j]
        sc = p.scales.float()
        d = sc[g, :, j]
        m = sc[g, :, GROUP_ROWS + j] if p.fmt == Q4_1 else torch.zeros_like(d)
        return d[..., None].expand(-1, -1, 2), m[..., None].expand(-1, -1, 2)
    raw = p.scales[g]  # [rows, sb, bytes]
    rows, sb = raw.shape[:2]
    d = raw[..., :32].contiguous().view(torch.float16).float()  # [rows, sb, 16]
    pick = lambda t: t.gather(-1, j.view(-1, 1, 1).expand(-1, sb, 1))[..., 0]  # noqa: E731
    if p.fmt == Q4_K:
        dmin = raw[..., 32:64].contiguous().view(torch.float16).float()
        sc = _six_bits(raw[..., 64:128], raw[..., 192:224])  # [rows, sb, 8, 16]
        m = _six_bits(raw[..., 128:192], raw[..., 224:256])
        jj = j.view(-1, 1, 1, 1).expand(-1, sb, 8, 1)
        D = pick(d)[..., None] * sc.gather(-1, jj)[..., 0].float()
        M = -(pick(dmin)[..., None] * m.gather(-1, jj)[..., 0].float())
        return D.reshape(rows, -1)[..., None].expand(-1, -1, 2), \
            M.reshape(rows, -1)[..., None].expand(-1, -1, 2)
    sc = raw[..., 32:288].contiguous().view(torch.int8).reshape(rows, sb, 16, GROUP_ROWS)
    jj = j.view(-1, 1, 1, 1).expand(-1, sb, 16, 1)
    D = pick(d)[..., None] * sc.gather(-1, jj)[..., 0].float()  # [rows, sb, 8 * 2]
    D = D.reshape(rows, -1, 2)
    return D, torch.zeros_like(D)


def dequantize(p: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as float32, ``[n, k]``, or only ``rows`` (e.g. embedding lookups)."""
    rows = torch.arange(p.n) if rows is None else rows.reshape(-1).long()
    g, j = rows // GROUP_ROWS, rows % GROUP_ROWS
    u = _stored_values(p, g, j).view(rows.numel(), -1, 2, BLOCK // 2)
    D, M = _block_scales(p, g, j)
    w = (u.float() - _OFFSET[p.fmt]) * D[..., None] + M[..., None]
    return w.reshape(rows.numel(), p.k)


def weight_rows(p: PackedWeight, rows: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize` in ``dtype`` through the native kernel when it is built (one
    op: what an embedding lookup or a dequantise-then-GEMM path calls per step)."""
    if cpu_extension.is_available():
        return cpu_extension.require().quant_dequantize(p.qs, p.scales, p.fmt, p.n, rows, dtype)
    return dequantize(p, rows).to(dtype)


def levels(route: int, fmt: int) -> int | None:
    """The largest integer a route rounds activations to on weights of ``fmt`` (None:
    it keeps them; INT16 widens the formats it does not take)."""
    if route in EXACT_ROUTES or (route == INT16 and fmt not in INT16_FORMATS):
        return None
    return 32767 if route == INT16 else 127


def quantize_activations(x: torch.Tensor, top: int = 127) -> torch.Tensor:
    """x [M, K] as the int8 routes (``top`` 127) or the int16 route (32767) see it: per
    block of 32, ``xd * round(x / xd)`` with ``xd = max|x| / top``, in float32 (exactly
    the kernel's quantization)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    xd = xb.abs().amax(dim=-1, keepdim=True) / top
    inv = torch.where(xd != 0, 1 / xd, torch.zeros_like(xd))
    return (torch.round(xb * inv) * xd).reshape(x.shape)


def reference(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None = None,
              route: int = BEST_INT8, w: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ dequantize(p).T (+ bias)`` with x as the route sees it (``w``:
    ``dequantize(p)`` when the caller has it)."""
    top = levels(route, p.fmt)
    xs = x.float() if top is None else quantize_activations(x, top)
    out = xs.double() @ (dequantize(p) if w is None else w).double().t()
    return out if bias is None else out + bias.double()


def activation_rounding_bound(x: torch.Tensor, p: PackedWeight,
                              w: torch.Tensor | None = None, top: int = 127) -> torch.Tensor:
    """Bound on |route - x @ dequantize(p).T| per output, [M, n], float64, for a route
    that rounds activations to ``top`` levels: each moves by at most half a step,
    ``max|x| of its block / (2 top)``."""
    xb = x.double().reshape(x.shape[0], -1, BLOCK)
    half_step = xb.abs().amax(dim=-1) / (2 * top)  # [M, blocks]
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
    CUDA for the 32-value formats, or the dequantised torch product otherwise."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and cpu_extension.is_available():
        out = cpu_extension.require().quant_linear(x2, p.qs, p.scales, p.fmt, p.n, bias, route)
    elif x.device.type == "cuda" and p.qs.device == x.device and p.fmt not in K_QUANTS:
        from kernels.triton_quant_linear import quant_linear_triton  # triton: GPU installs
        out = quant_linear_triton(x2, p, bias)
    else:
        out = F.linear(x2, dequantize(p).to(device=x.device, dtype=x.dtype), bias)
    return out.reshape(*x.shape[:-1], p.n)
