"""A quantized tile at two revisions, side by side in one process.

Builds ``kernels/csrc/quant_tiles.h`` as it was at ``--base`` (a git revision) and as it is
in the working tree into one small program, each copy in its own namespace, and times
their widening tile (``--tile int8``: the AVX2 int8 tile; ``--tile int16``: the int16
tile; ``--tile bf16``: the bf16 tile; ``--tile vnni``: the AVX512-VNNI int8 tile) (one
thread, one activation row) on the same random matrix in each GGUF format (``--n`` x
``--k``: the default fits the L2 with the tile's arithmetic in view; a matrix larger than
the last-level cache streams from memory as a decode step's layers do), alternating A B A B; prints the best time of each, the ratio, and whether the two
outputs are bit for bit equal. ``--march`` builds for another instruction set than this
machine's (``haswell``: the AVX2 forms, which this machine runs too).

On a shared machine two builds timed in two processes moved 2x between runs; timed in
one process, pair by pair, the ratio holds.

    .venv/bin/python benchmarks/quant_tile_ab.py --base HEAD~1 --march haswell native
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import machine_facts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "kernels/csrc"

TRANSLATION_UNIT = """#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#define folio folio_{v}
#include "tiles_{v}.h"
// NAME(fmt, qs, sc, B, groups, x, xsum, out): TILE<Fmt> for the format fmt names
#define BY_FORMAT(NAME, TILE) \\
  extern "C" void NAME(long fmt, const uint8_t* qs, const uint8_t* sc, long B, long groups, \\
                       const float* x, const float* xsum, float* out) {{ \\
    using namespace folio_{v}::quant; \\
    if (fmt == kQ4_K) TILE<kQ4_K>(qs, sc, B, groups, x, xsum, out); \\
    else if (fmt == kQ6_K) TILE<kQ6_K>(qs, sc, B, groups, x, xsum, out); \\
    else if (fmt == kQ4_1) TILE<kQ4_1>(qs, sc, B, groups, x, xsum, out); \\
    else if (fmt == kQ4_0) TILE<kQ4_0>(qs, sc, B, groups, x, xsum, out); \\
    else TILE<kQ8_0>(qs, sc, B, groups, x, xsum, out); \\
  }}
// bytes of one group's quants and scales for B blocks, as this revision packs them
extern "C" void layout_{v}(long fmt, long B, long* qsz, long* ssz) {{
  using namespace folio_{v}::quant;
  *qsz = B * qs_bytes(fmt);
  *ssz = group_scale_bytes(fmt, B);
}}
template <int64_t Fmt>
void widen(const uint8_t* qs, const uint8_t* sc, long B, long groups, const float* x,
           const float* xsum, float* out) {{
  using namespace folio_{v}::quant;
  long qsz, ssz;
  layout_{v}(Fmt, B, &qsz, &ssz);
  for (long g = 0; g < groups; ++g)
    tile_widen<Fmt, 1>(qs + g * qsz, sc + g * ssz, B, x, B * 32, xsum, 0, out + 16 * g);
}}
BY_FORMAT(widen_{v}, widen)
// One activation row, quantized per block as the int8 routes take it, through `tile`.
template <int64_t Fmt, typename Tile>
void int8_row(const uint8_t* qs, const uint8_t* sc, long B, long groups, const float* x,
              float* out, Tile tile) {{
  using namespace folio_{v}::quant;
  long qsz, ssz;
  layout_{v}(Fmt, B, &qsz, &ssz);
  QuantizedRows xr;
  quantize_rows(x, B * 32, 1, B * 32, xr);
  for (long g = 0; g < groups; ++g) tile(qs + g * qsz, sc + g * ssz, B, xr, out + 16 * g);
}}
#ifdef __AVX2__
template <int64_t Fmt>
void dot8(const uint8_t* qs, const uint8_t* sc, long B, long groups, const float* x,
          const float*, float* out) {{
  using namespace folio_{v}::quant;
  int8_row<Fmt>(qs, sc, B, groups, x, out,
                [](const uint8_t* q, const uint8_t* s, long B, const QuantizedRows& xr,
                   float* o) {{ tile_avx2<Fmt, 1>(q, s, B, xr, 0, o); }});
}}
BY_FORMAT(int8_{v}, dot8)
#endif
"""

# The int16 tile (only revisions that have it: added to the program for --tile int16).
INT16_UNIT = """#ifdef __AVX2__
template <int64_t Fmt>
void dot16(const uint8_t* qs, const uint8_t* sc, long B, long groups, const float* x,
           const float* xsum, float* out) {{
  using namespace folio_{v}::quant;
  long qsz, ssz;
  layout_{v}(Fmt, B, &qsz, &ssz);
  if constexpr (Fmt == kQ6_K) {{  // the route widens Q6_K
    widen<Fmt>(qs, sc, B, groups, x, xsum, out);
  }} else {{
    Int16Rows xr;  // one activation row, rounded per block as the int16 route takes it
    quantize_rows16(x, B * 32, 1, B * 32, Fmt == kQ8_0, xr);
    for (long g = 0; g < groups; ++g)
      tile_int16<Fmt, 1>(qs + g * qsz, sc + g * ssz, B, xr, 0, out + 16 * g);
  }}
}}
BY_FORMAT(int16_{v}, dot16)
#endif
"""

# The AVX512-VNNI int8 tile (the int8 route's tile where the CPU has VNNI: one row takes it
# on the AVX-512 EPYC).
VNNI_UNIT = """#ifdef FOLIO_QUANT_VNNI512
template <int64_t Fmt>
void dotvnni(const uint8_t* qs, const uint8_t* sc, long B, long groups, const float* x,
             const float*, float* out) {{
  using namespace folio_{v}::quant;
  int8_row<Fmt>(qs, sc, B, groups, x, out,
                [](const uint8_t* q, const uint8_t* s, long B, const QuantizedRows& xr,
                   float* o) {{ tile_vnni512<Fmt, 1>(q, s, B, xr, 0, o); }});
}}
BY_FORMAT(vnni_{v}, dotvnni)
#endif
"""
# The bf16 tile (AVX512-BF16 builds only; Q8_0 widens, as in its route): x rounded to bf16
# and laid out in pairs as quant_linear.cpp lays it out.
BF16_UNIT = """#ifdef __AVX512BF16__
template <int64_t Fmt>
void dotbf16(const uint8_t* qs, const uint8_t* sc, long B, long groups, const float* x,
             const float* xsum, float* out) {{
  using namespace folio_{v}::quant;
  long qsz, ssz;
  layout_{v}(Fmt, B, &qsz, &ssz);
  if constexpr (!is_q4(Fmt)) {{
    widen<Fmt>(qs, sc, B, groups, x, xsum, out);
  }} else {{
    const long K = B * 32;
    std::vector<uint32_t> xp(K / 2);
    const int low[4] = {{0, 1, 4, 5}};
    const auto bits = [&](long k) {{ return static_cast<uint32_t>(c10::BFloat16(x[k]).x); }};
    for (long c = 0; c < K / 8; ++c)
      for (int p = 0; p < 4; ++p)
        xp[4 * c + p] = bits(8 * c + low[p]) | (bits(8 * c + low[p] + 2) << 16);
    for (long g = 0; g < groups; ++g)
      tile_bf16dot<Fmt, 1>(qs + g * qsz, sc + g * ssz, B, xp.data(), K / 2, xsum, 0,
                           out + 16 * g);
  }}
}}
BY_FORMAT(bf16_{v}, dotbf16)
#endif
"""

MAIN = r"""#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <omp.h>
#include <random>
#include <vector>
extern "C" void TILE_a(long, const uint8_t*, const uint8_t*, long, long, const float*, const float*, float*);
extern "C" void TILE_b(long, const uint8_t*, const uint8_t*, long, long, const float*, const float*, float*);
extern "C" void layout_a(long, long, long*, long*);
extern "C" void layout_b(long, long, long*, long*);
// argv: N K reps threads copies. `copies` matrices are multiplied in turn (a decode
// step's layers, one after another); each matrix's groups are split evenly between the
// threads, which meet after each matrix as at::parallel_for's calls do.
int main(int argc, char** argv) {
  const long N = atol(argv[1]), K = atol(argv[2]), reps = atol(argv[3]);
  const int threads = argc > 4 ? atoi(argv[4]) : 1;
  const long copies = argc > 5 ? atol(argv[5]) : 1;
  const long B = K / 32, groups = N / 16;
  std::mt19937 rng(1);
  const long formats[] = {12, 14, 3, 2, 8};  // ggml ids: Q4_K, Q6_K, Q4_1, Q4_0, Q8_0
  const char* names[] = {"q4_k", "q6_k", "q4_1", "q4_0", "q8_0"};
  for (int f = 0; f < 5; ++f) {
    const long fmt = formats[f];
    long qsz, ssz, qsz_b, ssz_b;
    layout_a(fmt, B, &qsz, &ssz);
    layout_b(fmt, B, &qsz_b, &ssz_b);
    if (qsz != qsz_b || ssz != ssz_b) {
      fprintf(stderr, "the two revisions pack the weights differently: no common input\n");
      return 1;
    }
    std::vector<uint8_t> qs(copies * groups * qsz), sc(copies * groups * ssz);
    for (auto& b : qs) b = rng();
    for (auto& b : sc) b = rng() & 0x3f;  // fp16 halves stay small and finite
    std::vector<float> x(K), xsum(2 * B, 0.5f), out_a(copies * N), out_b(copies * N);
    for (auto& v : x) v = (rng() % 1000) / 500.f - 1.f;
    double best[2] = {1e9, 1e9};
    for (long rep = 0; rep < reps; ++rep)
      for (int w = 0; w < 2; ++w) {
        float* out = w ? out_b.data() : out_a.data();
        const auto t = std::chrono::steady_clock::now();
        for (long c = 0; c < copies; ++c) {
          const uint8_t* q = qs.data() + c * groups * qsz;
          const uint8_t* s = sc.data() + c * groups * ssz;
#pragma omp parallel num_threads(threads)
          {
            const long per = (groups + threads - 1) / threads;
            const long g0 = omp_get_thread_num() * per, g1 = g0 + per < groups ? g0 + per : groups;
            if (g0 < g1)
              (w ? TILE_b : TILE_a)(fmt, q + g0 * qsz, s + g0 * ssz, B, g1 - g0, x.data(),
                                    xsum.data(), out + c * N + 16 * g0);
          }
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        if (s < best[w]) best[w] = s;
      }
    printf("{\"format\": \"%s\", \"base_ms\": %.4f, \"tree_ms\": %.4f, \"identical\": %s}\n",
           names[f], best[0] * 1e3, best[1] * 1e3,
           std::memcmp(out_a.data(), out_b.data(), copies * N * 4) == 0 ? "true" : "false");
  }
}
"""


def build(base: str, march: str, folder: Path, tile: str = "widen") -> Path:
    """The A/B program for one ``-march`` and ``tile`` (``widen``; ``int8``: the AVX2
    int8 tile, activations quantized per block; ``int16``: the int16 tile and ``bf16``:
    the bf16 tile, both revisions must have them): tiles at ``base`` as A, the tree's as
    B."""
    import torch
    import torch.utils.cpp_extension as ext
    header = subprocess.run(["git", "show", f"{base}:kernels/csrc/quant_tiles.h"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    (folder / "tiles_a.h").write_text(header.replace('"quant_pack.h"', f'"{CSRC}/quant_pack.h"'))
    (folder / "tiles_b.h").write_text((CSRC / "quant_tiles.h").read_text().replace(
        '"quant_pack.h"', f'"{CSRC}/quant_pack.h"'))
    for v in "ab":
        (folder / f"tu_{v}.cpp").write_text(TRANSLATION_UNIT.format(v=v) + (
            {"int16": INT16_UNIT, "bf16": BF16_UNIT, "vnni": VNNI_UNIT}.get(tile, "").format(v=v)))
    (folder / "main.cpp").write_text(MAIN.replace("TILE", tile))
    lib = Path(torch.__file__).parent / "lib"
    program = folder / f"ab_{tile}_{march}"
    subprocess.run(["g++", "-O3", f"-march={march}", "-fopenmp", "-w",
                    *(f"-I{p}" for p in ext.include_paths()), f"-I{folder}", f"-I{CSRC}",  # amx.h and quant_pack.h: the tree's
                    "-o", str(program), *(str(folder / f) for f in ("tu_a.cpp", "tu_b.cpp",
                                                                     "main.cpp")),
                    f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"], check=True)
    return program


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision of the A side")
    ap.add_argument("--march", nargs="+", default=["native"])
    ap.add_argument("--n", type=int, default=5632, help="weight rows (a multiple of 16)")
    ap.add_argument("--k", type=int, default=2048, help="inputs (a multiple of 256)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads splitting each matrix's row groups (1: one tile stream)")
    ap.add_argument("--copies", type=int, default=1,
                    help="matrices multiplied in turn per timed pass (layer after layer)")
    ap.add_argument("--tile", choices=["widen", "int8", "int16", "bf16", "vnni"], default="widen",
                    help="widen: the widening tile; int8: the AVX2 int8 tile (tile_avx2); "
                         "int16: the int16 tile (Q6_K widens, as in its route); bf16: the "
                         "bf16 tile (AVX512-BF16; Q8_0 widens, as in its route); vnni: the "
                         "AVX512-VNNI int8 tile (tile_vnni512)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    report = {"machine": machine_facts(), "base": args.base, "tile": args.tile, "n": args.n,
              "k": args.k, "threads": args.threads, "copies": args.copies,
              "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for march in args.march:
            program = build(args.base, march, Path(tmp), args.tile)
            out = subprocess.run([str(program), str(args.n), str(args.k), str(args.reps),
                                  str(args.threads), str(args.copies)],
                                 check=True, capture_output=True, text=True).stdout
            rows = [json.loads(line) for line in out.splitlines()]
            report["results"][march] = rows
            for row in rows:
                print(f"-march={march} {row['format']} {args.tile} tile, {args.threads} thread(s), "
                      f"{args.copies} matrix(es): "
                      f"{args.base} {row['base_ms']:.3f} ms, tree {row['tree_ms']:.3f} ms "
                      f"({row['base_ms'] / row['tree_ms']:.2f}x), outputs bit for bit equal: "
                      f"{row['identical']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
