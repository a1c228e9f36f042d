"""The ways one linear layer can run, and a per-layer choice among them by row count.

A path computes ``x @ W.T (+ bias)`` for a weight held as a tensor (float32, bf16,
fp16) or block-quantized (a ``PackedWeight``, kernels/quant_linear.py):

* ``native``: torch's ``F.linear`` on the weight as held (a quantized weight is
  dequantised per call first, which only pays off at many rows, if ever);
* ``kernel``: Folio's 16-bit kernel (``half_linear``: bf16/fp16 weights read once,
  float32 arithmetic);
* ``widen``: float32 arithmetic on weights widened per call (16-bit), or in registers
  by the quantized kernel (quantized);
* ``int8``: the quantized kernel's integer route (activations quantized per block);
* ``int16``: its 16-bit integer route (Q4_0/Q4_1/Q4_K/Q8_0, AVX2 CPUs): activations
  rounded per block of 32 to int16, 16-bit pairs multiplied by ``vpmaddwd``;
* ``bf16dot``: the quantized kernel's bf16 route (Q4_0/Q4_1/Q4_K/Q6_K, AVX512-BF16
  CPUs): bf16 activations times the weights turned into bf16 pairs, ``vdpbf16ps``,
  products exact in float32 as in ``widen`` (which it is for other activations);
* ``amx``: the same on AMX tiles (AMX-BF16 CPUs), 16 rows at a time, for every format
  (Q8_0's values converted to bf16, exactly); for a bf16 weight, Folio's tile kernel on
  the weight as stored (``kernels/csrc/amx_linear.cpp``: no second copy);
* ``mkldnn``: bf16 weights through oneDNN with the weight reordered once, not per call
  (worker/models/prepacked.py; AVX512-BF16/AMX CPUs), at the price of a second copy of
  the weight.

Which one is fastest depends on the CPU (bf16/VNNI/AMX instructions, cache sizes), the
weight's shape and the number of rows, so worker/linear_backend.py times them at load
and gives each layer a :class:`LinearChoice`; :func:`path_for` is the fallback rule for
a layer without one.

``int8`` is the one path that computes another function: rounding each activation to
1/127 of its block's largest moves a layer's output by 0.4-1% (relative, measured on the
default model's real activations; llama.cpp's Q8_1 activations do the same). On the
default model that flips greedy answers (the first token of "What is the capital of
France?" is 0.08 logits from the runner-up), so it is ``LOSSY``: the measured choice
never takes it, only ``worker.linear_backend: int8`` does. ``int16`` rounds each
activation by at most 1/65534 of its block's largest, 256 times less; on the default
model it kept every top-1 token of a 2,070-token text, logits within 7.3e-3 (6.3e-4 mean)
of the dequantised model's (README, "On an AVX2-only CPU"), finer than the bf16
activations the widening and bf16 routes take on a bf16 model, so the measured choice
may take it.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_extension
from kernels.quant_linear import AMX as AMX_ROUTE, BEST_INT8, BF16DOT as BF16DOT_ROUTE
from kernels.quant_linear import INT16 as INT16_ROUTE, INT16_FORMATS, Q4_0, Q4_1, Q4_K, Q6_K
from kernels.quant_linear import WIDEN as WIDEN_ROUTE, PackedWeight, routes_available
from kernels.quant_linear import quant_linear, weight_rows
from worker.models import prepacked

NATIVE, KERNEL, WIDEN, INT8, BF16DOT, AMX = "native", "kernel", "widen", "int8", "bf16dot", "amx"
MKLDNN, INT16 = "mkldnn", "int16"
PATHS = (NATIVE, KERNEL, WIDEN, INT8, BF16DOT, AMX, MKLDNN, INT16)
_BF16DOT_FORMATS = frozenset({Q4_0, Q4_1, Q4_K, Q6_K})  # values of at most 6 bits
LOSSY = frozenset({INT8})  # paths whose result is not x @ W.T to float rounding
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Row counts a choice is made for; a call takes the bucket nearest in log2 (upper
# bounds 2, 8, 32, 128). Decode batches live in the first four, prefill chunks in the last.
ROW_BUCKETS = (1, 4, 16, 64, 256)
_BUCKET_BOUNDS = (2, 8, 32, 128)


def bucket_index(rows: int) -> int:
    """Index into ROW_BUCKETS of the bucket ``rows`` falls in."""
    return bisect.bisect_left(_BUCKET_BOUNDS, rows)


@dataclass(frozen=True, slots=True)
class LinearChoice:
    """The path a layer runs at each row bucket (``paths[i]`` for ROW_BUCKETS[i])."""

    paths: tuple[str, ...]

    @classmethod
    def always(cls, path: str) -> "LinearChoice":
        return cls((path,) * len(ROW_BUCKETS))

    def path_for(self, rows: int) -> str:
        return self.paths[bucket_index(rows)]


def weight_kind(weight) -> str:
    """What a weight is held as: a quantized format name or a dtype name."""
    if isinstance(weight, PackedWeight):
        return weight.format_name.lower()
    return str(weight.dtype).removeprefix("torch.")


def kernel_takes(weight) -> bool:
    """Whether the native 16-bit kernel can run ``x @ weight.T``: row-major 16-bit
    weight, out a multiple of 16 and in of 32, and the kernels built."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.dtype in HALF_DTYPES and weight.stride(1) == 1
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and cpu_extension.is_available())


@functools.cache
def _amx_linear_granted() -> bool:
    """Whether the extension has the bf16 tile kernel and the tile state (asked once)."""
    return bool(cpu_extension.require().amx_linear_available())


def amx_linear_takes(weight, dtype: torch.dtype | None) -> bool:
    """Whether the bf16 tile kernel can run ``x @ weight.T``: a contiguous bf16 weight,
    out a multiple of 16 and in of 32, bf16 activations (``dtype`` None: any), the
    kernels built with AMX-BF16 and the tile state granted."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and weight.device.type == "cpu" and weight.shape[0] % 16 == 0
            and weight.shape[1] % 32 == 0 and dtype in (None, torch.bfloat16)
            and cpu_extension.is_available() and _amx_linear_granted())


def bf16dot_takes(weight, dtype: torch.dtype | None) -> bool:
    """Whether the bf16 route computes (rather than falls back to widening) for this
    weight and activations of ``dtype`` (None: any)."""
    return (isinstance(weight, PackedWeight) and weight.fmt in _BF16DOT_FORMATS
            and dtype in (None, torch.bfloat16) and BF16DOT_ROUTE in routes_available())


def amx_takes(weight, dtype: torch.dtype | None) -> bool:
    """Whether the AMX route computes (rather than falls back to widening): any packed
    format, bf16 activations (``dtype`` None: any), AMX-BF16 built and granted."""
    return (isinstance(weight, PackedWeight) and dtype in (None, torch.bfloat16)
            and AMX_ROUTE in routes_available())


def int16_takes(weight) -> bool:
    """Whether the int16 route computes (rather than falls back to widening)."""
    return (isinstance(weight, PackedWeight) and weight.fmt in INT16_FORMATS
            and INT16_ROUTE in routes_available())


# Folio's bf16 tile kernel is blocked for decode: one weight group (16 rows) against up
# to 64 activation rows at a time, nothing larger. At prefill chunks (256-2048 rows)
# oneDNN's blocked GEMM ran the default model's projections 1.4-1.9x faster on an AMX
# Xeon, though a single timed call at 256 rows had favoured the tile kernel: the measured
# choice times it only up to here.
AMX_LINEAR_MAX_ROWS = 64


def path_max_rows(path: str, weight) -> int | None:
    """The most rows ``path`` is timed, and so chosen, for on ``weight`` (None: any)."""
    return AMX_LINEAR_MAX_ROWS if path == AMX and isinstance(weight, torch.Tensor) else None


def candidates(weight, lossy: bool = True, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The paths that can run this weight on this machine (the first is the default);
    ``lossy=False`` leaves out the ``LOSSY`` ones (what the measured choice picks from);
    ``dtype``: the activations' (None: any)."""
    if isinstance(weight, PackedWeight):
        if not cpu_extension.is_available():
            return (NATIVE,)
        exact = (WIDEN,) + ((BF16DOT,) if bf16dot_takes(weight, dtype) else ())
        exact += (AMX,) if amx_takes(weight, dtype) else ()
        exact += (INT16,) if int16_takes(weight) else ()
        return (*exact, INT8, NATIVE) if lossy else (*exact, NATIVE)
    if weight.dtype in HALF_DTYPES:
        paths = (NATIVE, KERNEL, WIDEN) if kernel_takes(weight) else (NATIVE, WIDEN)
        paths += (AMX,) if amx_linear_takes(weight, dtype) else ()
        # oneDNN on the prepacked weight is the default where it runs: the timing must
        # find another path 10% faster to take it (see linear_backend.py)
        return ((MKLDNN,) + paths) if prepacked.takes(weight, dtype) else paths
    return (NATIVE,)


def run_path(path: str, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in x's dtype through ``path`` (one of candidates())."""
    if isinstance(weight, PackedWeight):
        if path == NATIVE:
            return F.linear(x, weight_rows(weight, None, x.dtype), bias)
        route = {WIDEN: WIDEN_ROUTE, BF16DOT: BF16DOT_ROUTE, AMX: AMX_ROUTE,
                 INT16: INT16_ROUTE}.get(path, BEST_INT8)
        return quant_linear(x, weight, bias, route)
    if path == MKLDNN:
        return prepacked.linear(x, weight, bias)
    if path in (KERNEL, AMX):
        ops = cpu_extension.require()
        run = ops.half_linear if path == KERNEL else ops.amx_linear
        out = run(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if path == WIDEN:
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)
    return F.linear(x, weight, bias)
