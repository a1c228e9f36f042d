// y = x @ W.T (+ bias) for a bf16 weight on AMX tiles, the weight read as stored.
//
// The usual nn.Linear weight, `[N, K]` row-major, is the tile product's *left* operand:
// 16 consecutive weight rows x 32 k are one A tile (16 rows of 64 bytes, the rows K * 2
// bytes apart), so the weight needs no second, repacked copy (oneDNN's `mkldnn` path
// keeps one), and a weight update is seen at once. The activations are the right
// operand, which AMX wants as bf16 pairs: x's rows are transposed once per call into B
// tiles (tile row r, column c = x[m0 + c, k0 + 2r .. k0 + 2r + 1]), KB-sized and
// L1/L2-resident. One `tdpbf16ps` then gives a 16 x 16 block of y transposed
// (y^T[n, m]), which the epilogue turns back with one 16 x 16 transpose in registers.
//
//   output rows n: groups of 16 (one A tile tall); threads take contiguous group ranges
//   per pair of groups, 32 rows of x at a time: C tiles tmm0-3 [16 n x 16 m floats]
//   (2 groups x 2 row tiles) += A (tmm4, tmm5: the groups) x B (tmm6, tmm7: the row
//   tiles), k 32 at a time: four products per four tile loads. From k 2,048 on, one
//   group a pass instead, up to 64 rows (C tmm0-3), its A tile double-buffered (tmm4 /
//   tmm5): 16 weight rows stream instead of 32. The C tiles are then transposed, the
//   bias added in float32, and each output rounded once to bf16.
//
// Decode steps (a few to 64 rows) are bound by reading the weight. In the pair pass it
// streams as 32 rows side by side and the next pair's rows are requested into the L2
// (prefetcht2) while this pair's products run; the group pass's 16 rows are left to the
// hardware prefetchers, which follow them better alone. On an AMX Xeon that read the
// default model's projections at 15-40 GB/s and the 1B model's at 23-30, where oneDNN's
// prepacked kernel read 13-22 and 15-26 (README, "AMX bf16 linear").
// Prefill row counts have no cache blocking beyond a pair of groups, and oneDNN's GEMM
// is faster there: the measured choice (worker/linear_backend.py) times this kernel up
// to 64 rows only.
//
// Products are exact in float32 and summed in float32 (in the hardware's order), as in
// torch's bf16 GEMM; only the summation order differs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "kernel_entries.h"

#if defined(FOLIO_AMX) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define FOLIO_AMX_LINEAR 1
#endif

namespace folio {
namespace {

#ifdef FOLIO_AMX_LINEAR

constexpr int64_t kGroup = 16;     // weight rows per A tile
constexpr int64_t kKStep = 32;     // k per tile (16 bf16 pairs)
constexpr int64_t kTileBytes = 1024;
// From this k on, one weight group a pass (group_product): the 1B model's 2,048 x 5,632
// down projection read 1.5x faster than in pairs at 48-64 rows (20-23 against 14-15
// GB/s) and went from 1.1x slower than oneDNN to 0.77x at 1-32 rows; 11,264 x 2,048 a
// little faster; at k 576 and 1,536 pairs stayed as fast or faster.
constexpr int64_t kGroupPassMinK = 2048;

// Transposes a 16 x 16 block of 32-bit elements held as 16 rows.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved within each 128-bit lane
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // now r[4i + j], lane L: column 4L + j of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  __m512i o[16];
  for (int j = 0; j < 4; ++j) {  // gather each column's four lanes from the row quartets
    const __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
    o[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    o[4 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    o[8 + j] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    o[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = o[i];
}

// x [M, K] as B tiles, [K / 32][m_tiles][16 pairs][16 rows of x] (rows past M zero).
void pack_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t m_tiles, uint32_t* xp) {
  const auto* words = reinterpret_cast<const uint32_t*>(x);
  const int64_t k_steps = K / kKStep, row_words = K / 2;
  at::parallel_for(0, m_tiles, 16, [&](int64_t mt0, int64_t mt1) {
    for (int64_t mt = mt0; mt < mt1; ++mt)
      for (int64_t kc = 0; kc < k_steps; ++kc) {
        __m512i r[16];
        for (int c = 0; c < 16; ++c) {
          const int64_t m = mt * 16 + c;
          r[c] = m < M ? _mm512_loadu_si512(words + m * row_words + kc * 16)
                       : _mm512_setzero_si512();
        }
        transpose16(r);
        uint32_t* dst = xp + (kc * m_tiles + mt) * 256;
        for (int i = 0; i < 16; ++i) _mm512_store_si512(dst + i * 16, r[i]);
      }
  });
}

// Two weight groups (32 rows: `w`, and `w + group_bytes` if `TWO`) against MT (1 or 2)
// B-tile columns of x from `xb`: C tiles 0, 1 = group 0 x m-tiles 0, 1; tiles 2, 3 =
// group 1. The y^T blocks go to buf [2 groups][2 m-tiles][16 n][16 m]. `next` (or
// null): the next pair's `next_bytes`, requested into the L2 a slice per k step.
template <int MT, bool TWO>
inline void pair_product(const char* w, int64_t group_bytes, int64_t K, int64_t m_tiles,
                         const char* xb, const char* next, int64_t next_bytes, float* buf) {
  _tile_zero(0);
  if constexpr (MT == 2) _tile_zero(1);
  if constexpr (TWO) _tile_zero(2);
  if constexpr (TWO && MT == 2) _tile_zero(3);
  const int64_t stride = K * 2, k_steps = K / kKStep;
  const int64_t slice = next_bytes / k_steps;
  for (int64_t kc = 0; kc < k_steps; ++kc) {
    if (next != nullptr)
      for (int64_t l = 0; l < slice; l += 64) _mm_prefetch(next + kc * slice + l, _MM_HINT_T2);
    const char* b = xb + kc * m_tiles * kTileBytes;
    _tile_loadd(4, w + kc * 64, stride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MT == 2) {
      _tile_loadd(7, b + kTileBytes, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TWO) {
      _tile_loadd(5, w + group_bytes + kc * 64, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (MT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, buf, 64);
  if constexpr (MT == 2) _tile_stored(1, buf + 256, 64);
  if constexpr (TWO) _tile_stored(2, buf + 512, 64);
  if constexpr (TWO && MT == 2) _tile_stored(3, buf + 768, 64);
}

// One weight group against MT (1 to 4) B-tile columns (C tiles 0..MT-1, buf [MT][16 n]
// [16 m]), for a long k: a pair pass streams 32 weight rows at once and, past 32 rows of
// x, reads each pair twice, from past L1 at that k. The A tile is double-buffered (tmm4 /
// tmm5): k step s + 1's weight rows load while step s's products run. Nothing is
// prefetched: the 16 rows stream in order, which the L2's own streamer follows, and
// software prefetches of the next group (as in the pair pass) made the 1B model's
// projections read at 16-23 GB/s where without them they read 23-30 (README).
template <int MT>
inline void group_product(const char* w, int64_t K, int64_t m_tiles, const char* xb,
                          float* buf) {
  _tile_zero(0);
  if constexpr (MT >= 2) _tile_zero(1);
  if constexpr (MT >= 3) _tile_zero(2);
  if constexpr (MT == 4) _tile_zero(3);
  const int64_t stride = K * 2, k_steps = K / kKStep;
  const auto b_tiles = [&](int64_t kc) { return xb + kc * m_tiles * kTileBytes; };
// Step kc's products with the A tile in register A (a literal: the tile intrinsics
// paste register numbers into their instructions), the B tiles at b.
#define FOLIO_GROUP_STEP(A)                  \
  _tile_loadd(6, b, 64);                     \
  _tile_dpbf16ps(0, A, 6);                   \
  if constexpr (MT >= 2) {                   \
    _tile_loadd(7, b + kTileBytes, 64);      \
    _tile_dpbf16ps(1, A, 7);                 \
  }                                          \
  if constexpr (MT >= 3) {                   \
    _tile_loadd(6, b + 2 * kTileBytes, 64);  \
    _tile_dpbf16ps(2, A, 6);                 \
  }                                          \
  if constexpr (MT == 4) {                   \
    _tile_loadd(7, b + 3 * kTileBytes, 64);  \
    _tile_dpbf16ps(3, A, 7);                 \
  }
  _tile_loadd(4, w, stride);
  for (int64_t kc = 0; kc < k_steps; kc += 2) {
    if (kc + 1 < k_steps) _tile_loadd(5, w + (kc + 1) * 64, stride);
    const char* b = b_tiles(kc);
    FOLIO_GROUP_STEP(4)
    if (kc + 1 == k_steps) break;
    if (kc + 2 < k_steps) _tile_loadd(4, w + (kc + 2) * 64, stride);
    b = b_tiles(kc + 1);
    FOLIO_GROUP_STEP(5)
  }
#undef FOLIO_GROUP_STEP
  _tile_stored(0, buf, 64);
  if constexpr (MT >= 2) _tile_stored(1, buf + 256, 64);
  if constexpr (MT >= 3) _tile_stored(2, buf + 512, 64);
  if constexpr (MT == 4) _tile_stored(3, buf + 768, 64);
}

// One y^T block (buf: [16 n][16 m] floats) into out's rows row0.. (at most `rows`),
// columns n0..n0 + 15: transposed in registers, the bias added, rounded once to bf16.
inline void store_block(const float* buf, const float* bias, int64_t n0, int64_t row0,
                        int64_t rows, int64_t N, uint16_t* out) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_load_si512(buf + n * 16);
  transpose16(r);  // r[m]: the 16 outputs of row row0 + m
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[m]), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (row0 + m) * N + n0),
                        (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Where one thread's passes read and write: x's B tiles, the weight, bias, y.
struct Operands {
  const char* xb;  // B tiles of x, [K / 32][m_tiles][1 KB]
  const char* w;   // weight rows, group after group
  const float* bias;
  uint16_t* out;
  int64_t M, N, K, m_tiles;
  int64_t group_bytes() const { return kGroup * K * 2; }
};

// Groups [g0, g1) one at a time, up to 64 rows of x a pass (long k).
void run_groups(const Operands& op, int64_t g0, int64_t g1, float* buf) {
  const int64_t group_bytes = op.group_bytes();
  for (int64_t g = g0; g < g1; ++g) {
    const char* w = op.w + g * group_bytes;
    for (int64_t m0 = 0; m0 < op.m_tiles; m0 += 4) {
      const int64_t mt = std::min<int64_t>(4, op.m_tiles - m0);
      const char* xb = op.xb + m0 * kTileBytes;
      if (mt == 4)
        group_product<4>(w, op.K, op.m_tiles, xb, buf);
      else if (mt == 3)
        group_product<3>(w, op.K, op.m_tiles, xb, buf);
      else if (mt == 2)
        group_product<2>(w, op.K, op.m_tiles, xb, buf);
      else
        group_product<1>(w, op.K, op.m_tiles, xb, buf);
      for (int64_t i = 0; i < mt; ++i) {
        const int64_t row0 = (m0 + i) * 16;
        store_block(buf + i * 256, op.bias, g * kGroup, row0,
                    std::min<int64_t>(16, op.M - row0), op.N, op.out);
      }
    }
  }
}

// Groups [g0, g1) two at a time, 32 rows of x a pass.
void run_pairs(const Operands& op, int64_t g0, int64_t g1, float* buf) {
  const int64_t group_bytes = op.group_bytes();
  for (int64_t g = g0; g < g1; g += 2) {
    const bool two = g + 1 < g1;
    const char* w = op.w + g * group_bytes;
    const int64_t next_bytes =
        std::min<int64_t>(2, std::max<int64_t>(0, g1 - g - 2)) * group_bytes;
    for (int64_t m0 = 0; m0 < op.m_tiles; m0 += 2) {
      const int64_t mt = std::min<int64_t>(2, op.m_tiles - m0);
      const char* xb = op.xb + m0 * kTileBytes;
      // the next pair is requested while the first rows meet this one
      const char* next = (m0 == 0 && next_bytes > 0) ? w + 2 * group_bytes : nullptr;
      if (mt == 2 && two)
        pair_product<2, true>(w, group_bytes, op.K, op.m_tiles, xb, next, next_bytes, buf);
      else if (mt == 2)
        pair_product<2, false>(w, group_bytes, op.K, op.m_tiles, xb, next, next_bytes, buf);
      else if (two)
        pair_product<1, true>(w, group_bytes, op.K, op.m_tiles, xb, next, next_bytes, buf);
      else
        pair_product<1, false>(w, group_bytes, op.K, op.m_tiles, xb, next, next_bytes, buf);
      for (int gi = 0; gi < (two ? 2 : 1); ++gi)
        for (int64_t i = 0; i < mt; ++i) {
          const int64_t row0 = (m0 + i) * 16;
          store_block(buf + (gi * 2 + i) * 256, op.bias, (g + gi) * kGroup, row0,
                      std::min<int64_t>(16, op.M - row0), op.N, op.out);
        }
    }
  }
}

void run(const c10::BFloat16* x, const c10::BFloat16* weight, const float* bias, int64_t M,
         int64_t N, int64_t K, c10::BFloat16* out) {
  const int64_t m_tiles = (M + 15) / 16, groups = N / kGroup;
  at::Tensor packed = at::empty({K / kKStep * m_tiles * 256 + 16}, at::kInt);
  // 64-byte aligned B tiles (the allocator aligns to 64; the slack covers others)
  auto* xp = reinterpret_cast<uint32_t*>(
      (reinterpret_cast<uintptr_t>(packed.data_ptr()) + 63) & ~uintptr_t(63));
  pack_rows(x, M, K, m_tiles, xp);
  const Operands op{reinterpret_cast<const char*>(xp), reinterpret_cast<const char*>(weight),
                    bias, reinterpret_cast<uint16_t*>(out), M, N, K, m_tiles};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), groups);
  at::parallel_for(0, workers, 1, [&](int64_t t0, int64_t t1) {
    configure_full_tiles();
    alignas(64) float buf[4 * 256];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = groups * t / workers, g1 = groups * (t + 1) / workers;
      if (K >= kGroupPassMinK)
        run_groups(op, g0, g1, buf);
      else
        run_pairs(op, g0, g1, buf);
    }
  });
}

#endif  // FOLIO_AMX_LINEAR

}  // namespace

bool amx_linear_available() {
#ifdef FOLIO_AMX_LINEAR
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_linear_available(),
              "amx_linear: needs AMX-BF16 (and the tile state) and AVX512-BF16");
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2, "amx_linear: 2-D operands expected");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "amx_linear: bf16 x and weight");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "amx_linear: x is [M, K], weight [N, K]");
  TORCH_CHECK(weight.is_contiguous(), "amx_linear: the weight must be contiguous [N, K]");
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "amx_linear: N must be a multiple of 16 and K of 32");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "amx_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x_in.options());
#ifdef FOLIO_AMX_LINEAR
  if (M > 0 && N > 0) {
    const at::Tensor x = x_in.contiguous();
    run(x.const_data_ptr<c10::BFloat16>(), weight.const_data_ptr<c10::BFloat16>(),
        b.defined() ? b.const_data_ptr<float>() : nullptr, M, N, K,
        out.data_ptr<c10::BFloat16>());
  }
#endif
  return out;
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("amx_linear_available() -> bool", &folio::amx_linear_available);
  m.def("amx_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) { m.impl("amx_linear", &folio::amx_linear); }
