"""The widening and int16 tiles (kernels/csrc/quant_tiles.h) built for other instruction
sets than this machine's, against a float64 reference of the same weights.

The extension is built with ``-march=native``, so on an AVX-512 machine (CI's) its
tests never run the AVX2 or the plain-vector forms of ``tile_widen``, which differ in
how they widen (AVX2 has no unsigned conversion). Here each form is compiled into a
small program (``-march=haswell``: AVX2, FMA, F16C; ``-march=x86-64-v2``: SSE4.2, no
F16C), which runs every format at 1, 3 and 8 activation rows and reports the worst
error against ``sum_k (D (u - offset) + M) x_k`` in float64, from the header's own
``stored_at`` and ``block_scales``, relative to ``sum_k |w_k x_k|``. The tile sums in
float32, so that error stays within a few hundred ulps of float32; a wrong shift, mask
or scale moves it to order one.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import cpu_extension

CSRC = Path(__file__).resolve().parents[2] / "kernels/csrc"

if os.environ.get(cpu_extension.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpu_extension.DISABLE_ENV} is set", allow_module_level=True)
if shutil.which("g++") is None:
    pytest.skip("no g++", allow_module_level=True)

PROGRAM = r"""#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <vector>
#include "quant_tiles.h"
using namespace folio::quant;

uint64_t digest = 14695981039346656037ull;

template <int64_t Fmt, int MR>
double worst(std::mt19937& rng) {
  const int64_t N = 64, B = 16, K = B * kBlock, groups = N / kGroupRows;
  const int64_t qsz = B * qs_bytes(Fmt), ssz = group_scale_bytes(Fmt, B);
  std::vector<uint8_t> qs(groups * qsz), sc(groups * ssz);
  for (auto& b : qs) b = rng();
  for (auto& b : sc) b = rng();
  // K-quants: d (and dmin) fp16 in [2^-8, 2^-7); the integers as drawn (any bytes are
  // valid packed 6-bit Q4_K scales)
  if (is_k(Fmt)) {
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t s = 0; s < B / kSuperBlocks; ++s) {
        uint8_t* rec = sc.data() + g * ssz + s * k_scale_bytes(Fmt);
        for (int i = 0; i < (Fmt == kQ4_K ? 32 : 16); ++i)
          reinterpret_cast<c10::Half*>(rec)[i] = c10::Half(std::ldexp(1.0f + (rng() % 64) / 64.f, -8));
      }
  } else {
    c10::Half* h = reinterpret_cast<c10::Half*>(sc.data());
    for (size_t i = 0; i < sc.size() / 2; ++i)
      h[i] = c10::Half(((rng() % 2000) / 1000.f - 1.f) / 64.f);
  }
  const int H = split_halves(Fmt) ? 2 : 1;
  std::vector<float> x(MR * K), xsum(MR * B * H, 0.f), out(MR * kGroupRows);
  for (auto& v : x) v = (rng() % 20001) / 10000.f - 1.f;
  for (int r = 0; r < MR; ++r)
    for (int64_t i = 0; i < K; ++i) xsum[(r * B + i / kBlock) * H + (i % kBlock) / (kBlock / H)] += x[r * K + i];
  double err = 0.0;
#ifdef INT16_TILE
  Int16Rows xr;
  quantize_rows16(x.data(), K, MR, K, Fmt == kQ8_0, xr);
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = qs.data() + g * qsz;
    const uint8_t* s = sc.data() + g * ssz;
#ifdef INT16_TILE
    tile_int16<Fmt, MR>(q, s, B, xr, 0, out.data());
#else
    tile_widen<Fmt, MR>(q, s, B, x.data(), K, xsum.data(), 0, out.data());
#endif
    for (float v : out) {  // FNV-1a over the outputs' bits: equal builds print equal hashes
      uint32_t u;
      std::memcpy(&u, &v, 4);
      digest = (digest ^ u) * 1099511628211ull;
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < kGroupRows; ++j) {
        double want = 0.0, mag = 0.0;
        for (int64_t b = 0; b < B; ++b) {
          alignas(64) float D[2][16], M[2][16];
          block_scales<Fmt>(s, b, D, M);
          for (int k = 0; k < kBlock; ++k) {
            const int h = split_halves(Fmt) ? k / 16 : 0;
            const double w = double(D[h][j]) * (stored_at<Fmt>(q + b * qs_bytes(Fmt), j, k) - offset_of(Fmt)) +
                             (has_min(Fmt) ? double(M[0][j]) : 0.0);
            want += w * x[r * K + b * kBlock + k];
            mag += std::fabs(w * x[r * K + b * kBlock + k]);
          }
        }
        err = std::fmax(err, std::fabs(out[r * kGroupRows + j] - want) / mag);
      }
  }
  return err;
}

template <int64_t Fmt>
void report(const char* name, std::mt19937& rng) {
  digest = 14695981039346656037ull;
  const double e1 = worst<Fmt, 1>(rng), e3 = worst<Fmt, 3>(rng), e8 = worst<Fmt, 8>(rng);
  printf("%s %.3e %.3e %.3e %llx\n", name, e1, e3, e8, static_cast<unsigned long long>(digest));
}

int main() {
  std::mt19937 rng(7);
  report<kQ4_0>("q4_0", rng);
  report<kQ4_1>("q4_1", rng);
  report<kQ8_0>("q8_0", rng);
  report<kQ4_K>("q4_k", rng);
#ifndef INT16_TILE  // the int16 route widens Q6_K
  report<kQ6_K>("q6_k", rng);
#endif
}
"""


def run_tiles(march: str, tmp_path: Path, *defines: str) -> dict[str, list[str]]:
    """Build PROGRAM for ``march`` and run it: per format, the worst errors at 1, 3 and 8
    rows and the hash of the outputs' bits."""
    import torch.utils.cpp_extension as ext
    import torch
    source = tmp_path / "tiles.cpp"
    source.write_text(PROGRAM)
    program = tmp_path / f"tiles_{march}"
    lib = Path(torch.__file__).parent / "lib"
    subprocess.run(["g++", "-O2", f"-march={march}", "-std=c++17", "-w", *defines,
                    *(f"-I{p}" for p in ext.include_paths()), f"-I{CSRC}",
                    "-o", str(program), str(source), f"-L{lib}", "-lc10", "-ltorch_cpu",
                    f"-Wl,-rpath,{lib}"], check=True)
    lines = subprocess.run([str(program)], check=True, capture_output=True,
                           text=True).stdout.split("\n")
    return {parts[0]: parts[1:] for parts in map(str.split, lines) if parts}


@pytest.mark.parametrize("march", ["haswell", "x86-64-v2"])
def test_widening_tile_on_other_isas(march, tmp_path):
    errors = run_tiles(march, tmp_path)
    assert set(errors) == {"q4_0", "q4_1", "q8_0", "q4_k", "q6_k"}
    for fmt, row in errors.items():
        worst = [float(v) for v in row[:3]]
        # float32 sums of 512 terms: a few hundred ulps (1.2e-7 each) at most
        assert max(worst) < 3e-5, (march, fmt, worst)


def test_int16_tile_forms_agree_bit_for_bit(tmp_path):
    """The int16 tile's AVX2 form (8 rows a vector) and, on a CPU with AVX-512 BW, its
    16-row form (``vpdpwssd`` with VNNI) against float64 and against each other: the
    integer sums are exact and the float operations per row the same, so the outputs'
    bits must be equal."""
    forms = {"haswell": run_tiles("haswell", tmp_path, "-DINT16_TILE")}
    if {"avx512bw", "avx512f"} <= set(cpu_extension.cpu_flags().split()):
        forms["native"] = run_tiles("native", tmp_path, "-DINT16_TILE")
    for march, errors in forms.items():
        assert set(errors) == {"q4_0", "q4_1", "q8_0", "q4_k"}
        for fmt, row in errors.items():
            worst = [float(v) for v in row[:3]]
            # activations rounded to 1/65534 of their block's largest: relative to
            # sum |w x| at most ~3e-5; a wrong mask, shift or scale is order one
            assert max(worst) < 1e-4, (march, fmt, worst)
    if "native" in forms:
        assert {f: r[3] for f, r in forms["native"].items()} == \
            {f: r[3] for f, r in forms["haswell"].items()}
