// Causal attention of a step's prompt segments in bf16: on AMX tiles where the CPU has
// them, else the same products as AVX512-BF16 dot products (scores_dot,
// weighted_values_dot below).
//
// A segment is a request whose keys are all this step's own tokens (a prompt, or its
// first chunk): query i of the segment sees keys 0..i of the same segment. q [T, H, hd],
// k and v [T, kv_heads, hd] are the step's projections (token rows may be strided, as
// slices of the fused q/k/v output are); out [T, H, hd] gets the segments' rows and
// nothing else. GQA: query head h reads kv head h / (H / kv_heads).
//
// First, per segment and kv head, the keys and values are laid out as B tiles:
//
//   kt  per 16 keys:  [hd / 2 pairs][16 keys] of 32-bit (k[2r], k[2r+1])
//                     (the B tile of one 32-dimension step is 16 of those rows)
//   vt  per 32 keys:  [16 key pairs][hd][2] bf16 (v_2p[n], v_2p+1[n])
//                     (the B tile of 16 dimensions is 16 rows of 64 bytes, hd * 4 apart)
//
// zero past the segment's end. Then a work item is (segment, query head, 16 query
// tokens), pulled off a shared counter, costliest first. Its softmax is exact in two
// passes, which tiles suit better than an online one (no rescaling of accumulators held
// in tiles):
//
//   1. S = Q K^T on tiles: Q is one A tile per 32 dimensions (16 tokens x 32), each 16
//      keys one C tile, two of them in flight; the raw scores go to `s` [16][keys].
//   2. per row: max over its visible keys, p = exp(scale * (s - max)) in float32, l =
//      sum of p, and p split into two bf16 parts, p = hi + lo (lo = bf16(p - hi)), into
//      `p` and `p_lo` [16][keys rounded up to 32] (zero past the row's last key).
//   3. O = P V on tiles: four C tiles of 16 dimensions accumulate hi V + lo V over the
//      key blocks (A: 16 rows x 32 keys of hi, then of lo; B: a vt tile), then O / l is
//      the output.
//
// Products are exact and sums float32 (`tdpbf16ps`), in the hardware's order. With the
// two parts p carries 16 bits of mantissa into P V instead of bf16's 8: measured on
// random bf16 inputs, 99.9% of outputs are float32 attention rounded to bf16, against
// 80.7% for torch's SDPA on the same inputs (which rounds p to bf16 once).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "cpu_vec.h"

namespace folio {
namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FOLIO_PREFILL_ATTENTION 1

constexpr int64_t kTile = 16;   // tokens per A tile, keys per S tile, dims per O tile
constexpr int64_t kBlock = 32;  // keys per P/V tile pair

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// kt of one segment's kv head (`k` at its first token): see the top of the file.
template <int64_t HD>
void pack_keys(const c10::BFloat16* k, int64_t k_stride, int64_t len, uint32_t* kt) {
  const __m512i at = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(k_stride * 2)));  // byte offsets of 16 keys
  const auto* base = reinterpret_cast<const uint8_t*>(k);
  for (int64_t c = 0; c < round_up(len, kTile) / kTile; ++c) {
    const int64_t live = std::min(kTile, len - c * kTile);
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
    const uint8_t* rows = base + c * kTile * k_stride * 2;
    uint32_t* dst = kt + c * (HD / 2) * kTile;
    for (int64_t r = 0; r < HD / 2; ++r) {
      const __m512i pairs =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, at, rows + 4 * r, 1);
      _mm512_storeu_si512(dst + r * kTile, pairs);
    }
  }
}

// vt of one segment's kv head: key pair p's row interleaves v_2p and v_2p+1 word by word.
template <int64_t HD>
void pack_values(const c10::BFloat16* v, int64_t v_stride, int64_t len, uint16_t* vt) {
  const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003,
                                       0x00240004, 0x00250005, 0x00260006, 0x00270007,
                                       0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                       0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t pairs = round_up(len, kBlock) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    uint16_t* dst = vt + p * HD * 2;
    for (int64_t n = 0; n < HD; n += 32) {
      const int64_t j = 2 * p;
      const __m512i a = j < len ? _mm512_loadu_si512(v + j * v_stride + n) : _mm512_setzero_si512();
      const __m512i b = j + 1 < len ? _mm512_loadu_si512(v + (j + 1) * v_stride + n)
                                    : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * n, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + 2 * n + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// Per-thread working memory, sized for the longest segment.
struct Work {
  std::vector<float> s;        // [16][keys] raw scores
  std::vector<uint16_t> p;     // [16][keys rounded up to 32] probabilities, bf16
  std::vector<uint16_t> p_lo;  // the same shape: what p's rounding left, bf16
  std::vector<float> o;        // [16][hd] P V
  std::vector<c10::BFloat16> q;  // [16][hd] a short block's queries, zero-padded
  float l[kTile];
  Work(int64_t max_len, int64_t hd)
      : s(kTile * round_up(max_len, kBlock)), p(kTile * round_up(max_len, kBlock)),
        p_lo(kTile * round_up(max_len, kBlock)),
        o(kTile * hd), q(kTile * hd) {}
};

struct Shape {
  int64_t heads, kv_heads, group, q_stride, k_stride, v_stride, out_stride;
};

#if defined(FOLIO_AMX)
// Rows [0, 16) of S: tokens i0.. of head `h` (A tiles from `qa`, `qa_stride` bytes apart)
// against the keys' tiles 0..ctiles-1. Tiles: C tmm0/tmm1, Q tmm2/tmm3 (dims 0-63; for
// hd 128 dims 64-127 in tmm6/tmm7), K tmm4/tmm5.
template <int64_t HD>
void scores(const char* qa, int64_t qa_stride, const uint32_t* kt, int64_t ctiles, float* s,
            int64_t s_stride) {
  static_assert(HD == 64 || HD == 128);
  _tile_loadd(2, qa, qa_stride);
  _tile_loadd(3, qa + 64, qa_stride);
  if constexpr (HD == 128) {
    _tile_loadd(6, qa + 128, qa_stride);
    _tile_loadd(7, qa + 192, qa_stride);
  }
  const int64_t tile_u32 = (HD / 2) * kTile;  // one 16-key kt tile group
  for (int64_t c = 0; c < ctiles; c += 2) {
    const bool two = c + 1 < ctiles;
    const uint32_t* k0 = kt + c * tile_u32;
    const uint32_t* k1 = k0 + tile_u32;
    _tile_zero(0);
    if (two) _tile_zero(1);
    // k-step ks: pairs [16 ks, 16 ks + 16) = rows of 64 bytes, 256 uint32 apart
    _tile_loadd(4, k0, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (two) { _tile_loadd(5, k1, 64); _tile_dpbf16ps(1, 2, 5); }
    _tile_loadd(4, k0 + 256, 64);
    _tile_dpbf16ps(0, 3, 4);
    if (two) { _tile_loadd(5, k1 + 256, 64); _tile_dpbf16ps(1, 3, 5); }
    if constexpr (HD == 128) {
      _tile_loadd(4, k0 + 512, 64);
      _tile_dpbf16ps(0, 6, 4);
      if (two) { _tile_loadd(5, k1 + 512, 64); _tile_dpbf16ps(1, 6, 5); }
      _tile_loadd(4, k0 + 768, 64);
      _tile_dpbf16ps(0, 7, 4);
      if (two) { _tile_loadd(5, k1 + 768, 64); _tile_dpbf16ps(1, 7, 5); }
    }
    _tile_stored(0, s + c * kTile, s_stride * 4);
    if (two) _tile_stored(1, s + (c + 1) * kTile, s_stride * 4);
  }
}
#endif

// Row r (token i0 + r, keys 0..i0 + r visible): p and l from its scores.
inline void softmax_row(const float* s, int64_t visible, int64_t width, float scale,
                        uint16_t* p, uint16_t* p_lo, float& l) {
  const int64_t full = visible / kTile * kTile;
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += kTile) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - full)) - 1);
  if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + full));
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 sv = _mm512_set1_ps(scale), msv = _mm512_set1_ps(m * scale);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < visible; j += kTile) {
    const __mmask16 live = j + kTile <= visible
                               ? static_cast<__mmask16>(0xffff)
                               : static_cast<__mmask16>((1u << (visible - j)) - 1);
    __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), sv, msv);  // scale * (s - m)
    vec::vf xv;
    std::memcpy(&xv, &x, sizeof x);
    xv = vec::exp_nonpos(xv);
    std::memcpy(&x, &xv, sizeof x);
    x = _mm512_maskz_mov_ps(live, x);
    sum = _mm512_add_ps(sum, x);
    const __m256bh h = _mm512_cvtneps_pbh(x);
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_sub_ps(x, _mm512_cvtpbh_ps(h)));
    std::memcpy(p + j, &h, sizeof h);
    std::memcpy(p_lo + j, &r, sizeof r);
  }
  std::memset(p + j, 0, (width - j) * 2);  // keys past the row's last
  std::memset(p_lo + j, 0, (width - j) * 2);
  l = _mm512_reduce_add_ps(sum);
}

#if defined(FOLIO_AMX)
// O [16][HD] = P [16][blocks * 32] V, dims 64 at a time in four C tiles (tmm0-3), A tmm4,
// B tmm5.
template <int64_t HD>
void weighted_values(const uint16_t* p, const uint16_t* p_lo, int64_t p_stride,
                     const uint16_t* vt, int64_t blocks, float* o) {
  for (int64_t n0 = 0; n0 < HD; n0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; ++b) {
      _tile_loadd(4, p + b * kBlock, p_stride * 2);
      _tile_loadd(6, p_lo + b * kBlock, p_stride * 2);
      const uint16_t* vb = vt + b * (kBlock / 2) * HD * 2 + n0 * 2;  // 16 pair rows
      _tile_loadd(5, vb, HD * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(0, 6, 5);
      _tile_loadd(7, vb + 32, HD * 4);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(5, vb + 64, HD * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(2, 6, 5);
      _tile_loadd(7, vb + 96, HD * 4);
      _tile_dpbf16ps(3, 4, 7);
      _tile_dpbf16ps(3, 6, 7);
    }
    _tile_stored(0, o + n0, HD * 4);
    _tile_stored(1, o + n0 + 16, HD * 4);
    _tile_stored(2, o + n0 + 32, HD * 4);
    _tile_stored(3, o + n0 + 48, HD * 4);
  }
}
#endif

// The same two products on AVX512-BF16 alone (CPUs without AMX: `vdpbf16ps` on the same
// kt / vt layouts, one key pair or dimension pair per instruction and lane). Products
// are exact and sums float32, as on tiles; the order of the sums is this loop's.

// S as scores(): per 16-key tile, lane j of row r sums q_r's pairs against key j's,
// eight rows at once (eight independent chains, each kt row loaded once for them).
template <int64_t HD>
void scores_dot(const char* qa, int64_t qa_stride, const uint32_t* kt, int64_t ctiles,
                float* s, int64_t s_stride) {
  constexpr int64_t kPairs = HD / 2, kRows = 8;
  for (int64_t c = 0; c < ctiles; ++c) {
    const uint32_t* kc = kt + c * kPairs * kTile;  // [pairs][16 keys]
    for (int64_t r0 = 0; r0 < kTile; r0 += kRows) {
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t i = 0; i < kPairs; ++i) {
        const __m512bh keys = (__m512bh)_mm512_loadu_si512(kc + i * kTile);
        for (int r = 0; r < kRows; ++r) {
          uint32_t pair;
          std::memcpy(&pair, qa + (r0 + r) * qa_stride + 4 * i, sizeof pair);
          const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          acc[r] = _mm512_dpbf16_ps(acc[r], qp, keys);
        }
      }
      for (int r = 0; r < kRows; ++r)
        _mm512_storeu_ps(s + (r0 + r) * s_stride + c * kTile, acc[r]);
    }
  }
}

// O as weighted_values(): per key pair, lane j of dimension vector d gains p_r's pair
// (hi, then lo) times the pair's values at dimension 16 d + j; a few rows at once, all
// their dimensions in registers.
template <int64_t HD>
void weighted_values_dot(const uint16_t* p, const uint16_t* p_lo, int64_t p_stride,
                         const uint16_t* vt, int64_t blocks, float* o) {
  constexpr int kVecs = HD / 16, kRows = HD == 64 ? 4 : 2;
  const int64_t pairs = blocks * (kBlock / 2);
  for (int64_t r0 = 0; r0 < kTile; r0 += kRows) {
    __m512 acc[kRows][kVecs];
    for (int r = 0; r < kRows; ++r)
      for (int d = 0; d < kVecs; ++d) acc[r][d] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; ++q) {
      const uint16_t* row = vt + q * HD * 2;  // (v_2q[n], v_2q+1[n]) for every n
      __m512bh vals[kVecs];
      for (int d = 0; d < kVecs; ++d) vals[d] = (__m512bh)_mm512_loadu_si512(row + 32 * d);
      for (int r = 0; r < kRows; ++r) {
        uint32_t hi, lo;
        std::memcpy(&hi, p + (r0 + r) * p_stride + 2 * q, sizeof hi);
        std::memcpy(&lo, p_lo + (r0 + r) * p_stride + 2 * q, sizeof lo);
        const __m512bh h = (__m512bh)_mm512_set1_epi32(static_cast<int>(hi));
        const __m512bh l = (__m512bh)_mm512_set1_epi32(static_cast<int>(lo));
        for (int d = 0; d < kVecs; ++d) {
          acc[r][d] = _mm512_dpbf16_ps(acc[r][d], h, vals[d]);
          acc[r][d] = _mm512_dpbf16_ps(acc[r][d], l, vals[d]);
        }
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int d = 0; d < kVecs; ++d) _mm512_storeu_ps(o + (r0 + r) * HD + 16 * d, acc[r][d]);
  }
}

template <int64_t HD, bool kAmx>
void attend_block(const Shape& sh, const c10::BFloat16* q, const uint32_t* kt,
                  const uint16_t* vt, int64_t seg_start, int64_t len, int64_t h, int64_t i0,
                  float scale, c10::BFloat16* out, Work& w) {
  const int64_t rows = std::min(kTile, len - i0);
  const int64_t keys = i0 + rows;  // the last row's visible keys
  const int64_t width = round_up(keys, kBlock), ctiles = round_up(keys, kTile) / kTile;
  const c10::BFloat16* q0 = q + (seg_start + i0) * sh.q_stride + h * HD;
  const char* qa = reinterpret_cast<const char*>(q0);
  int64_t qa_stride = sh.q_stride * 2;
  if (rows < kTile) {  // the tile reads 16 rows: stage a short block, zero-padded
    std::fill(w.q.begin(), w.q.end(), c10::BFloat16(0.f));
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(w.q.data() + r * HD, q0 + r * sh.q_stride, HD * 2);
    qa = reinterpret_cast<const char*>(w.q.data());
    qa_stride = HD * 2;
  }
#if defined(FOLIO_AMX)
  if constexpr (kAmx) scores<HD>(qa, qa_stride, kt, ctiles, w.s.data(), width);
  else
#endif
    scores_dot<HD>(qa, qa_stride, kt, ctiles, w.s.data(), width);
  for (int64_t r = 0; r < kTile; ++r) {
    uint16_t* pr = w.p.data() + r * width;
    uint16_t* lo = w.p_lo.data() + r * width;
    if (r < rows) {
      softmax_row(w.s.data() + r * width, i0 + r + 1, width, scale, pr, lo, w.l[r]);
    } else {
      std::memset(pr, 0, width * 2);
      std::memset(lo, 0, width * 2);
    }
  }
  const int64_t blocks = width / kBlock;
#if defined(FOLIO_AMX)
  if constexpr (kAmx) weighted_values<HD>(w.p.data(), w.p_lo.data(), width, vt, blocks, w.o.data());
  else
#endif
    weighted_values_dot<HD>(w.p.data(), w.p_lo.data(), width, vt, blocks, w.o.data());
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);  // key 0 is always visible: l > 0
    c10::BFloat16* o = out + (seg_start + i0 + r) * sh.out_stride + h * HD;
    for (int64_t n = 0; n < HD; n += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * HD + n), inv);
      const __m256bh b = _mm512_cvtneps_pbh(x);
      std::memcpy(o + n, &b, sizeof b);
    }
  }
}

template <int64_t HD, bool kAmx>
void run(const Shape& sh, const c10::BFloat16* q, const c10::BFloat16* k,
         const c10::BFloat16* v, const int64_t* starts, const int64_t* lens, int64_t count,
         float scale, c10::BFloat16* out) {
  // every (segment, kv head)'s kt and vt
  std::vector<int64_t> kt_at(count + 1, 0), vt_at(count + 1, 0);
  int64_t max_len = 0;
  for (int64_t s = 0; s < count; ++s) {
    kt_at[s + 1] = kt_at[s] + round_up(lens[s], kTile) * (HD / 2) * sh.kv_heads;
    vt_at[s + 1] = vt_at[s] + round_up(lens[s], kBlock) * HD * sh.kv_heads;
    max_len = std::max(max_len, lens[s]);
  }
  std::vector<uint32_t> kt(kt_at[count]);
  std::vector<uint16_t> vt(vt_at[count]);
  const auto kt_of = [&](int64_t s, int64_t kvh) {
    return kt.data() + kt_at[s] + kvh * round_up(lens[s], kTile) * (HD / 2);
  };
  const auto vt_of = [&](int64_t s, int64_t kvh) {
    return vt.data() + vt_at[s] + kvh * round_up(lens[s], kBlock) * HD;
  };
  at::parallel_for(0, count * sh.kv_heads, 1, [&](int64_t b, int64_t e) {
    for (int64_t x = b; x < e; ++x) {
      const int64_t s = x / sh.kv_heads, kvh = x % sh.kv_heads;
      pack_keys<HD>(k + starts[s] * sh.k_stride + kvh * HD, sh.k_stride, lens[s], kt_of(s, kvh));
      pack_values<HD>(v + starts[s] * sh.v_stride + kvh * HD, sh.v_stride, lens[s], vt_of(s, kvh));
    }
  });
  struct Item { int64_t s, h, i0; };
  std::vector<Item> items;
  for (int64_t s = 0; s < count; ++s)
    for (int64_t i0 = 0; i0 < lens[s]; i0 += kTile)
      for (int64_t h = 0; h < sh.heads; ++h) items.push_back({s, h, i0});
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.i0 > b.i0; });  // costliest first
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#if defined(FOLIO_AMX)
    if constexpr (kAmx) configure_full_tiles();
#endif
    Work w(max_len, HD);
    for (int64_t it = next.fetch_add(1); it < num_items; it = next.fetch_add(1)) {
      const Item& x = items[it];
      const int64_t kvh = x.h / sh.group;
      attend_block<HD, kAmx>(sh, q, kt_of(x.s, kvh), vt_of(x.s, kvh), starts[x.s],
                             lens[x.s], x.h, x.i0, scale, out, w);
    }
  });
}
#endif

}  // namespace

// Where the kernel runs on tiles: AMX built in and the tile state granted.
bool prefill_attention_on_tiles() {
#if defined(FOLIO_PREFILL_ATTENTION) && defined(FOLIO_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

bool prefill_attention_available() {
#ifdef FOLIO_PREFILL_ATTENTION
  return true;
#else
  return false;
#endif
}

void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& seg_starts, const at::Tensor& seg_lens, double scale,
                       at::Tensor& out) {
  TORCH_CHECK(prefill_attention_available(),
              "prefill_attention: needs AVX512-BF16");
#ifdef FOLIO_PREFILL_ATTENTION
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 tensors only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 3,
              "prefill_attention: q/out [T, H, hd], k/v [T, kv_heads, hd]");
  const int64_t T = query.size(0), H = query.size(1), hd = query.size(2);
  const int64_t kvh = key.size(1);
  TORCH_CHECK(hd == 64 || hd == 128, "prefill_attention: head_dim 64 or 128");
  TORCH_CHECK(kvh > 0 && H % kvh == 0, "prefill_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(key.size(0) == T && value.size(0) == T && out.size(0) == T &&
                  value.size(1) == kvh && key.size(2) == hd && value.size(2) == hd &&
                  out.size(1) == H && out.size(2) == hd,
              "prefill_attention: shapes differ");
  for (const at::Tensor* t : {&query, &key, &value, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == hd,
                "prefill_attention: each token's heads must be contiguous");
  TORCH_CHECK(seg_starts.scalar_type() == at::kLong && seg_lens.scalar_type() == at::kLong &&
                  seg_starts.is_contiguous() && seg_lens.is_contiguous() &&
                  seg_starts.numel() == seg_lens.numel(),
              "prefill_attention: seg_starts / seg_lens int64, one each per segment");
  const int64_t count = seg_starts.numel();
  const int64_t* starts = seg_starts.data_ptr<int64_t>();
  const int64_t* lens = seg_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < count; ++s)
    TORCH_CHECK(starts[s] >= 0 && lens[s] > 0 && starts[s] + lens[s] <= T,
                "prefill_attention: segment ", s, " is outside the step");
  const Shape sh{H, kvh, H / kvh, query.stride(0), key.stride(0), value.stride(0), out.stride(0)};
  const auto* q = query.const_data_ptr<c10::BFloat16>();
  const auto* k = key.const_data_ptr<c10::BFloat16>();
  const auto* v = value.const_data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const float sc = static_cast<float>(scale);
  if (prefill_attention_on_tiles()) {
#if defined(FOLIO_AMX)
    if (hd == 64) run<64, true>(sh, q, k, v, starts, lens, count, sc, o);
    else run<128, true>(sh, q, k, v, starts, lens, count, sc, o);
#endif
  } else if (hd == 64) {
    run<64, false>(sh, q, k, v, starts, lens, count, sc, o);
  } else {
    run<128, false>(sh, q, k, v, starts, lens, count, sc, o);
  }
#endif
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("prefill_attention_available() -> bool", &folio::prefill_attention_available);
  m.def("prefill_attention_on_tiles() -> bool", &folio::prefill_attention_on_tiles);
  m.def(
      "prefill_attention(Tensor query, Tensor key, Tensor value, Tensor seg_starts, "
      "Tensor seg_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) { m.impl("prefill_attention", &folio::prefill_attention); }
