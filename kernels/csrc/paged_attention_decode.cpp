// Fused decode attention over a paged KV cache, on the CPU.
//
// One query token per request ("decode"), its keys and values read in place from the
// paged cache through the block table: no gather copy, no padding, each K and V row
// fetched from memory once. Built at first use by kernels/cpu_paged_attention.py and
// registered as the operator torch.ops.folio.paged_attention_decode.
//
// Cache indexing (kv_cache is contiguous [2, num_blocks, block_size, kv_heads, hd]):
//
//   kv_cache[0] = keys, kv_cache[1] = values            (values start plane_stride later)
//
//   block_tables[r] = [ 7 | 2 | 9 | ... ]    position p of request r lives in
//                       |   |                block  b = block_tables[r][p / block_size]
//                       v   v                offset o = p % block_size
//   block 7: slot o=0 [ h0: hd | h1: hd | .. ]  <- one "slot row" = kv_heads * hd elements
//            slot o=1 [ h0: hd | h1: hd | .. ]
//            ...                                  a block's keys: one contiguous run of
//                                                 block_size * kv_heads * hd elements
//   element (b, o, kvh, i) = base + ((b * block_size + o) * kv_heads + kvh) * hd + i
//
// Work split: a work item is a request, a contiguous range of its kv heads (all of them
// when the batch alone keeps the threads busy) and its visible keys, or one partition of
// them when there are more than a partition's worth (partial results merged in order,
// see Plan).
// The item's query heads (G = heads / kv_heads per kv head, GQA: query head h uses kv
// head h / G) are processed together, so every K and V row is loaded from memory once
// for all the heads that read it. Threads pull items off a shared counter (requests are
// ragged).
//
// Softmax: single pass, online, per chunk of up to kChunk keys. For each query head g
// we keep a running max m_g, running sum l_g = sum exp(s - m_g) and an unnormalised
// accumulator acc_g = sum exp(s - m_g) * v. Per chunk and kv head: the K pass computes
// the scores, the chunk max raises m_g (l_g and acc_g rescaled by exp(m_old - m_new)),
// then the V pass adds exp(s - m_new) * v. Output = acc_g / l_g. All arithmetic is
// float32 whatever the storage dtype (bf16/fp16 are widened as they are loaded), with
// one exception: bf16 queries on a bf16 cache with AVX512-BF16 take the probabilities
// in bf16 for the V pass (accumulate_bf16). The
// cache may hold fp8 (memory.kv_cache_dtype, scale 1.0) under 16- or 32-bit queries:
// its rows are widened the same way (template parameter C, the cache's element type).
// Meanwhile the next chunk's rows, and the thread's next work item, are prefetched (see
// Prefetcher).
//
// Visible keys of request r: positions [start, seq_len) where start = 0, or, with a
// sliding window W > 0, max(0, seq_len - W) (query at seq_len - 1 sees pos > seq_len-1-W).
// Positions outside that range are never read, so a window also saves the bandwidth.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "kernel_entries.h"

namespace folio {
namespace {

using vec::kLanes;
using vec::vf;

constexpr int64_t kChunk = 64;  // keys per online-softmax step (a multiple of kLanes)
static_assert(kChunk % kLanes == 0);

// ---- shapes and slots ------------------------------------------------------------------

struct Shape {
  int64_t num_decodes, num_heads, num_kv_heads, head_dim;
  int64_t num_blocks, block_size, max_blocks;
  int64_t group;         // query heads per kv head
  int64_t slot_stride;   // elements between consecutive slots: kv_heads * hd
  int64_t plane_stride;  // elements from kv_cache[0] to kv_cache[1]
  int64_t kv_per_item;   // kv heads per work item (a contiguous range of them)
  int64_t items_per_req;
  int64_t partition;     // visible keys per partition (Plan), a multiple of kChunk
  bool paired_v = false; // the V pass of a bf16 cache under bf16 queries (VPass)
};

// Element offsets of a request's slot rows, position after position: the (block index,
// offset) pair is carried along, so there is no division per key.
struct SlotWalker {
  const int64_t* table = nullptr;
  int64_t block_size = 1, slot_stride = 0, bi = 0, off = 0;
  SlotWalker() = default;
  SlotWalker(const Shape& sh, const int64_t* table, int64_t pos)
      : table(table), block_size(sh.block_size), slot_stride(sh.slot_stride),
        bi(pos / sh.block_size), off(pos % sh.block_size) {}
  int64_t next() {
    const int64_t o = (table[bi] * block_size + off) * slot_stride;
    if (++off == block_size) { off = 0; ++bi; }
    return o;
  }
  // The next `count` offsets into `out`: one block-table read per block, the run inside
  // a block a stride apart.
  void fill(int64_t* out, int64_t count) {
    while (count > 0) {
      const int64_t run = std::min(count, block_size - off);
      const int64_t base = (table[bi] * block_size + off) * slot_stride;
      for (int64_t i = 0; i < run; ++i) out[i] = base + i * slot_stride;
      out += run;
      count -= run;
      off += run;
      if (off == block_size) { off = 0; ++bi; }
    }
  }
};

// ---- prefetching ----------------------------------------------------------------------
//
// The hardware prefetchers cannot follow the block table's jumps, so the kernel asks
// for its rows by software, on two horizons:
//  * near: while a chunk is being computed, the next chunk's K and V rows, a few slots
//    at every step of the row loops (step() is called once per kLanes keys): spread out
//    like this the requests overlap the compute instead of stalling it. They ask for the
//    lines in L1 (locality 3, prefetcht0): a chunk is read once and soon, and on the
//    AVX-512 EPYC the L2-only hint left each layer call 10-20% slower.
//  * far: over the whole of a work item, every K and V row of the item the thread does
//    next, into L2 (locality 2, prefetcht1). One chunk ahead is too little to cover
//    memory latency: with only the near horizon the EPYC's layer call read K/V from
//    memory at about a third of its streaming rate and took ~2.4x as long as with the
//    rows already in L3. The far horizon keeps many more lines in flight: batch 64 at
//    ~170 tokens went from ~0.6 to ~0.43 ms a layer call (decode_attention.py, bf16).
//    Into L1 (prefetcht0) it measured slower than without it, evicting the chunk in
//    use; prefetcht2 measured no better than prefetcht1. The next item's rows (~130 KB
//    at 170 tokens) fit the L2 with room to spare.
struct Prefetcher {
  const char* keys = nullptr;  // the item's first K element, as bytes
  int64_t plane_bytes = 0, span_bytes = 0;
  const int64_t* offs = nullptr;  // element offsets of the slots still to request
  int64_t left = 0, per_step = 0, elem = 0;
  // The far horizon: the next item's rows, walked slot by slot.
  const char* far_keys = nullptr;
  int64_t far_span_bytes = 0, far_left = 0, far_per_step = 0;
  SlotWalker far_walk;

  // Queue `count` slots (element offsets `offs`), spread over `steps` calls of step().
  void reset(const int64_t* o, int64_t count, int64_t steps) {
    offs = o;
    left = count;
    per_step = per(count, steps);
  }
  // Queue `count` slots from `walk` (the next item's, K rows at `k`, `span` bytes a
  // slot) on the far horizon, spread over `steps` calls of step().
  void reset_far(const char* k, int64_t span, const SlotWalker& walk, int64_t count,
                 int64_t steps) {
    far_keys = k;
    far_span_bytes = span;
    far_walk = walk;
    far_left = count;
    far_per_step = per(count, steps);
  }
  void step() {
    near(per_step);
    const int64_t f = std::min(far_per_step, far_left);
    for (int64_t i = 0; i < f; ++i) lines<2>(far_keys + far_walk.next() * elem, far_span_bytes);
    far_left -= f;
  }
  void flush() { near(left); }  // the near slots the steps did not cover

 private:
  static int64_t per(int64_t count, int64_t steps) {
    return steps > 0 ? (count + steps - 1) / steps : count;
  }
  void near(int64_t count) {
    const int64_t m = std::min(count, left);
    for (int64_t i = 0; i < m; ++i) lines<3>(keys + offs[i] * elem, span_bytes);
    offs += m;
    left -= m;
  }
  template <int kLocality>
  void lines(const char* k, int64_t span) const {
    for (int64_t b = 0; b < span; b += 64) {  // every cache line of K and V
      __builtin_prefetch(k + b, 0, kLocality);
      __builtin_prefetch(k + plane_bytes + b, 0, kLocality);
    }
  }
};

// ---- per-chunk row operations ---------------------------------------------------------
//
// `rows[j]` points at key/value j of the chunk for one kv head (hd elements of the
// cache's dtype T, read in place); `q` is [G, hd], `s`/`p` are [G, kChunk] (row stride
// kChunk), `acc` is [G, hd], all float.

// head_dim known at compile time and a multiple of the vector width: rows are NV
// vectors, converted to float as they are loaded and held in registers.
template <typename T, int64_t HD>
struct RowOps {
  static constexpr int NV = HD / kLanes;
  // query heads whose accumulators stay in registers together in the V pass
  static constexpr int GB = NV >= 8 ? 2 : (NV >= 4 ? 4 : 8);

  // s[g, j] = q_g . k_j for j < n rounded up to kLanes (the padding repeats row n-1;
  // the caller overwrites those scores). Keys go kLanes at a time, so their dot
  // products are reduced together by one transpose_sum.
  static void scores(const float* q, int64_t G, const T* const* rows, int64_t n, float* s,
                     int64_t /*hd*/, float* /*tmp*/, Prefetcher& pf) {
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
      pf.step();
      const T* r[kLanes];
      for (int t = 0; t < kLanes; ++t) r[t] = rows[std::min<int64_t>(j0 + t, n - 1)];
      for (int64_t g = 0; g < G; ++g) {
        vf qv[NV];
#pragma GCC unroll 16
        for (int u = 0; u < NV; ++u) qv[u] = vec::load(q + g * HD + u * kLanes);
        vf d[kLanes];
#pragma GCC unroll 16
        for (int t = 0; t < kLanes; ++t) {
          d[t] = qv[0] * vec::load(r[t]);
#pragma GCC unroll 16
          for (int u = 1; u < NV; ++u) d[t] += qv[u] * vec::load(r[t] + u * kLanes);
        }
        vec::store(s + g * kChunk + j0, vec::transpose_sum(d));
      }
    }
  }

  // acc_b += sum_j p[b, j] * v_j for B heads, accumulators in registers across j
  template <int B>
  static void accumulate_block(float* acc, const float* p, const T* const* rows, int64_t n,
                               Prefetcher& pf) {
    vf a[B][NV];
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) a[b][u] = vec::load(acc + b * HD + u * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      if (j % kLanes == 0) pf.step();
      vf v[NV];
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) v[u] = vec::load(rows[j] + u * kLanes);
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b) {
        const vf pb = vec::splat(p[b * kChunk + j]);
#pragma GCC unroll 16
        for (int u = 0; u < NV; ++u) a[b][u] += pb * v[u];
      }
    }
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) vec::store(acc + b * HD + u * kLanes, a[b][u]);
  }

  template <int B = GB>
  static void accumulate_rest(float* acc, const float* p, const T* const* rows, int64_t n,
                              int64_t left, Prefetcher& pf) {
    if constexpr (B > 0) {
      if (left == B) return accumulate_block<B>(acc, p, rows, n, pf);
      accumulate_rest<B - 1>(acc, p, rows, n, left, pf);
    }
  }

  static void accumulate(float* acc, int64_t G, const float* p, const T* const* rows,
                         int64_t n, int64_t /*hd*/, float* /*tmp*/, Prefetcher& pf) {
    int64_t g = 0;
    for (; g + GB <= G; g += GB)
      accumulate_block<GB>(acc + g * HD, p + g * kChunk, rows, n, pf);
    if (g < G) accumulate_rest(acc + g * HD, p + g * kChunk, rows, n, G - g, pf);
  }
};

// Any head_dim: each row converted to float into `tmp` ([hd]), then plain loops over hd.
template <typename T>
struct RowOps<T, 0> {
  static void scores(const float* q, int64_t G, const T* const* rows, int64_t n, float* s,
                     int64_t hd, float* tmp, Prefetcher& pf) {
    for (int64_t j = 0; j < n; ++j) {
      if (j % kLanes == 0) pf.step();
      const float* k = vec::row_as_float(rows[j], tmp, hd);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * hd;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t i = 0; i < hd; ++i) d += qg[i] * k[i];
        s[g * kChunk + j] = d;
      }
    }
  }

  static void accumulate(float* acc, int64_t G, const float* p, const T* const* rows,
                         int64_t n, int64_t hd, float* tmp, Prefetcher& pf) {
    for (int64_t j = 0; j < n; ++j) {
      if (j % kLanes == 0) pf.step();
      const float* v = vec::row_as_float(rows[j], tmp, hd);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * hd;
        const float pj = p[g * kChunk + j];
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) a[i] += pj * v[i];
      }
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define FOLIO_ATTN_BF16DOT 1
// bf16 queries against a bf16 cache: the K pass as `vdpbf16ps` on the stored values (two
// keys' elements per lane, products exact in float32, sums in float32), with no
// widening copy of the keys; the scale multiplies the finished dot products. Same
// contract as RowOps::scores (s[g, j] for j < n rounded up to kLanes), queries unscaled.
template <int64_t HD>
void scores_bf16(const c10::BFloat16* q, int64_t G, const c10::BFloat16* const* rows, int64_t n,
                 float scale, float* s, Prefetcher& pf) {
  static_assert(HD % 32 == 0 && kLanes == 16);
  constexpr int NV = HD / 32;  // 32 bf16 per vector
  const auto load = [](const c10::BFloat16* p) {
    return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
  };
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    pf.step();
    const c10::BFloat16* r[kLanes];
    for (int t = 0; t < kLanes; ++t) r[t] = rows[std::min<int64_t>(j0 + t, n - 1)];
    for (int64_t g = 0; g < G; ++g) {
      __m512bh qv[NV];
#pragma GCC unroll 8
      for (int u = 0; u < NV; ++u) qv[u] = load(q + g * HD + 32 * u);
      vf d[kLanes];
#pragma GCC unroll 16
      for (int t = 0; t < kLanes; ++t) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], load(r[t]));
#pragma GCC unroll 8
        for (int u = 1; u < NV; ++u) acc = _mm512_dpbf16_ps(acc, qv[u], load(r[t] + 32 * u));
        std::memcpy(&d[t], &acc, sizeof acc);
      }
      vec::store(s + g * kChunk + j0, vec::transpose_sum(d) * scale);
    }
  }
}

// The V pass of a bf16 cache as `vdpbf16ps`: the probabilities, rounded to bf16, pair up
// two keys, and each lane adds p_j * v_j[i] + p_{j+1} * v_{j+1}[i] in float32 (l keeps
// the float sums: the weights' rounding, under 2^-9 of each, stays below half a step of
// the bf16 output; FlashAttention also takes P in 16 bits for P V). The two keys' rows
// are interleaved element by element (unpacklo/hi_epi16, within each 128-bit lane), so
// the accumulators hold a head's dims in a fixed permuted order (PairOrder, below); the
// online softmax only scales them, and attend_one puts them back in order at the end.
// `pb` holds the probabilities' bf16 bits ([G, kChunk], zero past n: n may be odd).
//
// PairOrder: in each 32-dim segment of a head's accumulator, the first 16 floats (lo)
// hold, per 128-bit lane L, dims 8L..8L+3 and the next 16 (hi) dims 8L+4..8L+7.
// unpermute() restores dim order: out = [lo.L0 hi.L0 lo.L1 hi.L1 | lo.L2 hi.L2 lo.L3 hi.L3].
template <int64_t HD>
struct PairOrder {
  static void unpermute(float* acc, int64_t heads) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t u = 0; u < HD / 32; ++u) {
        float* seg = acc + h * HD + 32 * u;
        const __m512 lo = _mm512_loadu_ps(seg), hi = _mm512_loadu_ps(seg + 16);
        // [lo.L0 lo.L1 hi.L0 hi.L1] -> [lo.L0 hi.L0 lo.L1 hi.L1], and likewise L2, L3
        const __m512 a = _mm512_shuffle_f32x4(lo, hi, 0x44), b = _mm512_shuffle_f32x4(lo, hi, 0xEE);
        _mm512_storeu_ps(seg, _mm512_shuffle_f32x4(a, a, 0xD8));
        _mm512_storeu_ps(seg + 16, _mm512_shuffle_f32x4(b, b, 0xD8));
      }
  }
};

template <int64_t HD, int B>
void accumulate_bf16_block(float* acc, const uint16_t* pb, const c10::BFloat16* const* rows,
                           int64_t n, Prefetcher& pf) {
  constexpr int NS = HD / 32;
  __m512 a[B][2 * NS];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int u = 0; u < 2 * NS; ++u) a[b][u] = _mm512_loadu_ps(acc + b * HD + 16 * u);
  for (int64_t j = 0; j < n; j += 2) {
    if (j % kLanes == 0) pf.step();
    const c10::BFloat16* r0 = rows[j];
    const c10::BFloat16* r1 = rows[std::min<int64_t>(j + 1, n - 1)];  // p = 0 past n
    __m512i lo[NS], hi[NS];
#pragma GCC unroll 8
    for (int u = 0; u < NS; ++u) {
      const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(r0 + 32 * u));
      const __m512i y = _mm512_loadu_si512(reinterpret_cast<const void*>(r1 + 32 * u));
      lo[u] = _mm512_unpacklo_epi16(x, y);
      hi[u] = _mm512_unpackhi_epi16(x, y);
    }
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      uint32_t pair;
      std::memcpy(&pair, pb + b * kChunk + j, sizeof pair);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 8
      for (int u = 0; u < NS; ++u) {
        a[b][2 * u] = _mm512_dpbf16_ps(a[b][2 * u], p, (__m512bh)lo[u]);
        a[b][2 * u + 1] = _mm512_dpbf16_ps(a[b][2 * u + 1], p, (__m512bh)hi[u]);
      }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int u = 0; u < 2 * NS; ++u) _mm512_storeu_ps(acc + b * HD + 16 * u, a[b][u]);
}

template <int64_t HD, int B>
void accumulate_bf16_rest(float* acc, const uint16_t* pb, const c10::BFloat16* const* rows,
                          int64_t n, int64_t left, Prefetcher& pf) {
  if constexpr (B > 0) {
    if (left == B) return accumulate_bf16_block<HD, B>(acc, pb, rows, n, pf);
    accumulate_bf16_rest<HD, B - 1>(acc, pb, rows, n, left, pf);
  }
}

// acc [G, HD] (PairOrder) += p [G, kChunk] (rounded to bf16) times the chunk's V rows.
template <int64_t HD>
void accumulate_bf16(float* acc, int64_t G, const float* p, const c10::BFloat16* const* rows,
                     int64_t n, uint16_t* pb, Prefetcher& pf) {
  constexpr int GB = HD / 32 >= 4 ? 2 : 4;  // heads whose accumulators fit the registers
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < padded; j += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + g * kChunk + j),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + g * kChunk + j)));
  int64_t g = 0;
  for (; g + GB <= G; g += GB)
    accumulate_bf16_block<HD, GB>(acc + g * HD, pb + g * kChunk, rows, n, pf);
  if (g < G) accumulate_bf16_rest<HD, GB>(acc + g * HD, pb + g * kChunk, rows, n, G - g, pf);
}
#endif

// The V passes a bf16 cache under bf16 queries can take (a call's v_pass): kWidenedV, the
// rows widened to float32 for FMAs (the default), and where AVX512-BF16 is built,
// kPairedV (accumulate_bf16), which rounds the probabilities to bf16: opt-in through
// worker.decode_v_pass (worker/decode_v_pass.py).
enum VPass : int64_t { kWidenedV = 0, kPairedV = 1 };
#ifdef FOLIO_ATTN_BF16DOT
constexpr int64_t kLastVPass = kPairedV;
#else
constexpr int64_t kLastVPass = kWidenedV;
#endif

// Online-softmax step for one head over a chunk: s[0, n) are its scores (the row is
// padded with -inf up to a multiple of kLanes). Raises the running max m, rescales l and
// acc[0, hd) to it, turns s into exp(s - m) and adds their sum to l.
inline void softmax_step(float* s, int64_t n, float& m, float& l, float* acc, int64_t hd) {
  const int64_t nv = (n + kLanes - 1) / kLanes;
  vf mx = vec::load(s);
  for (int64_t v = 1; v < nv; ++v) {
    const vf x = vec::load(s + v * kLanes);
    mx = x > mx ? x : mx;
  }
  const float mc = vec::hmax(mx);
  if (mc > m) {
    // exp(-inf) = 0 on the first chunk, when acc and l are still zero anyway.
    const float alpha = std::exp(m - mc);
    l *= alpha;
#pragma omp simd
    for (int64_t i = 0; i < hd; ++i) acc[i] *= alpha;
    m = mc;
  }
  vf sum = vec::splat(0.f);
  const vf mv = vec::splat(m);
  for (int64_t v = 0; v < nv; ++v) {
    const vf e = vec::exp_nonpos(vec::load(s + v * kLanes) - mv);
    vec::store(s + v * kLanes, e);
    sum += e;
  }
  l += vec::hsum(sum);
}

// ---- the kernel ----------------------------------------------------------------------


// Per-thread working memory, reused across work items (nh = query heads of an item).
struct Scratch {
  std::vector<float> q, acc;       // [nh, hd] scaled queries, unnormalised outputs
  std::vector<float> m, l;         // [nh] running max and sum
  std::vector<float> s;            // [G, kChunk] scores, then probabilities
  std::vector<float> tmp;          // [hd] one row converted to float
  std::vector<float> keys;         // [kChunk, hd] a chunk's keys widened to float
  std::vector<int64_t> offs;       // [kChunk] element offsets of a chunk's slot rows
  std::vector<int64_t> next_offs;  // [kChunk] the same for the next chunk (prefetch)
  std::vector<uint16_t> pb;        // [G, kChunk] probabilities as bf16 (paired V pass)
  explicit Scratch(const Shape& sh) {
    const int64_t nh = sh.kv_per_item * sh.group;
    q.resize(nh * sh.head_dim);
    acc.resize(nh * sh.head_dim);
    m.resize(nh);
    l.resize(nh);
    s.resize(sh.group * kChunk);
    tmp.resize(sh.head_dim);
    keys.resize(kChunk * sh.head_dim);
    offs.resize(kChunk);
    next_offs.resize(kChunk);
    if (sh.paired_v) pb.resize(sh.group * kChunk);
  }
};


// Pointers to the chunk's n rows of one kv head (`base` already offset to that head).
template <typename T>
inline void row_pointers(const T* base, const int64_t* offs, int64_t n, const T** rows) {
  for (int64_t j = 0; j < n; ++j) rows[j] = base + offs[j];
}

// The K pass reads every key row once per query head of the group: for bf16/fp16 it
// pays to widen the chunk's keys to float once, into `buf` ([n, HD]), and score those.
template <int64_t HD, typename T>
inline void widen_rows(const T* const* rows, int64_t n, float* buf, const float** out) {
  for (int64_t j = 0; j < n; ++j) {
    float* dst = buf + j * HD;
#pragma GCC unroll 16
    for (int64_t u = 0; u < HD / kLanes; ++u)
      vec::store(dst + u * kLanes, vec::load(rows[j] + u * kLanes));
    out[j] = dst;
  }
}

// Partitions: a row's visible keys are cut every `partition` keys, counted from its first
// visible key, and each (request, kv-head range, partition) is a work item of its own. At
// one request the 3 kv heads of the default model were 3 items for 2 threads, one thread
// doing two: the attention took two items' time (decode_attention.py, batch 1 at 2,048
// tokens: 0.18 ms a layer call, 0.09-0.11 with the cut). A partition ends in a partial
// result (running max, sum and unnormalised accumulator per query head) and the thread
// that finishes a row's last partition merges them, in partition order. A multiple of
// kChunk keeps the chunk boundaries.
//
// How finely (choose_split): in batch-invariant mode every kPartition keys, so the cut
// depends on the row alone and a row's result is the same whatever else is in its batch
// and at any thread count (the deterministic mode relies on it). Otherwise, when one or
// two requests leave fewer items than kItemsPerThread a thread, their rows are cut finer,
// down to kChunk keys, for about that many items: the default model's Q4_1 step at batch
// 1 ran 1.12x as fast at ~300 tokens and 1.09x at ~450, within noise at ~950
// (benchmarks/decode_checkouts.py, three alternated pairs; README).
constexpr int64_t kPartition = 512;
static_assert(kPartition % kChunk == 0);

// A work item: request d's kv heads [kv0, kv0 + nkv) over keys [start, seq_len), the
// whole of its visible keys (partial = -1) or one partition of them (partial: its slot
// in the partial results, group: the (request, kv range) whose partitions it shares).
struct Item {
  int64_t d, kv0, nkv, start, seq_len;
  const int64_t* table;
  int64_t partial = -1, group = -1;
};

// The work items of a call, in order, and the partitioned (request, kv range) groups.
struct Plan {
  std::vector<Item> items;
  std::vector<Item> groups;          // request, kv range and visible keys of each group
  std::vector<int64_t> first, parts;  // per group: its first partial slot, partition count
  int64_t num_partials = 0;
};

inline Plan make_plan(const Shape& sh, const int64_t* tables, const int64_t* seq_lens,
                      int64_t window) {
  Plan plan;
  plan.items.reserve(static_cast<size_t>(sh.num_decodes * sh.items_per_req));
  for (int64_t d = 0; d < sh.num_decodes; ++d) {
    const int64_t len = seq_lens[d];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t parts = std::max<int64_t>(1, (len - start + sh.partition - 1) / sh.partition);
    for (int64_t r = 0; r < sh.items_per_req; ++r) {
      const int64_t kv0 = r * sh.kv_per_item;
      const Item whole{d, kv0, std::min(sh.kv_per_item, sh.num_kv_heads - kv0), start, len,
                       tables + d * sh.max_blocks};
      if (parts == 1) {
        plan.items.push_back(whole);
        continue;
      }
      const auto group = static_cast<int64_t>(plan.groups.size());
      plan.groups.push_back(whole);
      plan.first.push_back(plan.num_partials);
      plan.parts.push_back(parts);
      for (int64_t p = 0; p < parts; ++p) {
        Item part = whole;
        part.start = start + p * sh.partition;
        part.seq_len = std::min(len, part.start + sh.partition);
        part.partial = plan.num_partials + p;
        part.group = group;
        plan.items.push_back(part);
      }
      plan.num_partials += parts;
    }
  }
  return plan;
}

// Floats of one partial result: m [nh], l [nh], acc [nh, hd] for nh query heads.
inline int64_t partial_floats(const Shape& sh) {
  return sh.kv_per_item * sh.group * (sh.head_dim + 2);
}

// A group's partitions merged into its rows of `out`: the largest running max M, then
// l = sum_p l_p exp(m_p - M) and acc = sum_p acc_p exp(m_p - M), in partition order.
template <typename T>
void merge_partials(const Shape& sh, const Item& g, const float* partials, int64_t parts,
                    T* out) {
  const int64_t hd = sh.head_dim, nh = g.nkv * sh.group, stride = partial_floats(sh);
  std::vector<float> acc(static_cast<size_t>(hd));
  for (int64_t h = 0; h < nh; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, partials[p * stride + h]);
    float l = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float* part = partials + p * stride;
      if (part[nh + h] == 0.f) continue;  // nothing visible in it (l = 0, m = -inf)
      const float w = std::exp(part[h] - top);
      l += part[nh + h] * w;
      const float* a = part + 2 * nh + h * hd;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) acc[i] += a[i] * w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* o = out + (g.d * sh.num_heads + g.kv0 * sh.group + h) * hd;
    for (int64_t i = 0; i < hd; ++i) o[i] = static_cast<T>(acc[i] * inv);
  }
}

// `it`'s first chunk (at most kChunk slots) into `offs`; returns the slot count.
inline int64_t first_chunk(const Shape& sh, const Item& it, int64_t* offs) {
  const int64_t n = std::min(kChunk, it.seq_len - it.start);
  SlotWalker(sh, it.table, it.start).fill(offs, n);
  return n;
}

// Attention of one work item: request d, kv heads [kv0, kv0 + nkv), i.e. query heads
// [kv0*G, (kv0+nkv)*G). Per chunk of keys, kv head by kv head: K pass (scores of its G
// query heads), softmax step, V pass. The item's kv heads are adjacent in a slot row,
// so the chunk's slots are read as contiguous runs (whole blocks when nkv = kv_heads),
// and each slot is fetched from memory once: later kv heads hit the cache.
// `following`: the item this thread does next (null if none), whose first chunk is
// requested during this item's last one; `requested`: this item's first chunk was.
template <typename T, typename C, int64_t HD>
void attend_one(const Shape& sh, const Item& it, const Item* following, bool requested,
                const T* query, const C* cache, float scale, T* out, float* partial,
                Scratch& ws) {
  const int64_t d = it.d, kv0 = it.kv0, nkv = it.nkv, seq_len = it.seq_len;
  using Ops = RowOps<C, HD>;
  // bf16 cache and queries with AVX512-BF16: the V pass may pair keys (accumulate_bf16)
#ifdef FOLIO_ATTN_BF16DOT
  constexpr bool kCanPairV = HD > 0 && HD % 32 == 0 && std::is_same_v<C, c10::BFloat16> &&
                             std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kCanPairV = false;
#endif
  const bool paired_v = kCanPairV && sh.paired_v;
  const int64_t hd = sh.head_dim;
  const int64_t G = sh.group;
  const int64_t nh = nkv * G;
  const int64_t head0 = kv0 * G;
  float* q = ws.q.data();
  float* acc = ws.acc.data();
  float* s = ws.s.data();
  const C* rows[kChunk];
  const float* keys[kChunk];  // rows widened to float (bf16/fp16/fp8 K pass)
  float* tmp = ws.tmp.data();
  int64_t* offs = ws.offs.data();

  for (int64_t h = 0; h < nh; ++h) {
    const float* qh = vec::row_as_float(query + (d * sh.num_heads + head0 + h) * hd, tmp, hd);
    for (int64_t i = 0; i < hd; ++i) q[h * hd + i] = qh[i] * scale;
    std::fill(acc + h * hd, acc + (h + 1) * hd, 0.f);
    ws.m[h] = -std::numeric_limits<float>::infinity();
    ws.l[h] = 0.f;
  }

  const int64_t start = it.start;
  SlotWalker ahead(sh, it.table, start);  // the slots of the chunk after the current one
  int64_t* next_offs = ws.next_offs.data();
  Prefetcher pf;
  const auto aim = [&](const Item& target) {  // the prefetches' K rows and span
    pf.keys = reinterpret_cast<const char*>(cache + target.kv0 * hd);
    pf.span_bytes = target.nkv * hd * static_cast<int64_t>(sizeof(C));
  };
  aim(it);
  pf.plane_bytes = sh.plane_stride * static_cast<int64_t>(sizeof(C));
  pf.elem = sizeof(C);
  if (following != nullptr) {  // the far horizon: all of it over this item's steps
    int64_t steps = 0;
    for (int64_t p0 = start; p0 < seq_len; p0 += kChunk)
      steps += 2 * nkv * ((std::min(kChunk, seq_len - p0) + kLanes - 1) / kLanes);
    pf.reset_far(reinterpret_cast<const char*>(cache + following->kv0 * hd),
                 following->nkv * hd * static_cast<int64_t>(sizeof(C)),
                 SlotWalker(sh, following->table, following->start),
                 following->seq_len - following->start, steps);
  }
  // The first chunk, unless the previous item requested it, has nothing to hide
  // behind: request it up front.
  const int64_t n0 = std::min(kChunk, seq_len - start);
  ahead.fill(next_offs, n0);
  if (!requested) {
    pf.reset(next_offs, n0, 0);
    pf.flush();
  }

  for (int64_t p0 = start; p0 < seq_len; p0 += kChunk) {
    const int64_t n = std::min(kChunk, seq_len - p0);
    std::swap(offs, next_offs);  // this chunk's slots, found one chunk ago
    int64_t n_next = std::min(kChunk, std::max<int64_t>(0, seq_len - p0 - kChunk));
    ahead.fill(next_offs, n_next);
    if (n_next == 0 && following != nullptr) {  // the last chunk: the next item's first
      n_next = first_chunk(sh, *following, next_offs);
      aim(*following);
    }
    const int64_t steps_per_pass = (n + kLanes - 1) / kLanes;
    pf.reset(next_offs, n_next, 2 * nkv * steps_per_pass);

    const int64_t padded = steps_per_pass * kLanes;
    for (int64_t kv = kv0; kv < kv0 + nkv; ++kv) {
      const int64_t h = (kv - kv0) * G;  // first local query head of this kv head
      row_pointers(cache + kv * hd, offs, n, rows);
#ifdef FOLIO_ATTN_BF16DOT
      if constexpr (HD > 0 && HD % 32 == 0 && std::is_same_v<C, c10::BFloat16> &&
                    std::is_same_v<T, c10::BFloat16>) {
        scores_bf16<HD>(query + (d * sh.num_heads + head0 + h) * hd, G, rows, n, scale, s, pf);
      } else
#endif
      if constexpr (HD > 0 && !std::is_same_v<C, float>) {
        widen_rows<HD>(rows, n, ws.keys.data(), keys);
        RowOps<float, HD>::scores(q + h * hd, G, keys, n, s, hd, tmp, pf);
      } else {
        Ops::scores(q + h * hd, G, rows, n, s, hd, tmp, pf);
      }
      for (int64_t g = 0; g < G; ++g) {
        std::fill(s + g * kChunk + n, s + g * kChunk + padded,
                  -std::numeric_limits<float>::infinity());
        softmax_step(s + g * kChunk, n, ws.m[h + g], ws.l[h + g], acc + (h + g) * hd, hd);
      }
      row_pointers(cache + sh.plane_stride + kv * hd, offs, n, rows);
#ifdef FOLIO_ATTN_BF16DOT
      if constexpr (kCanPairV) {
        if (paired_v) {
          accumulate_bf16<HD>(acc + h * hd, G, s, rows, n, ws.pb.data(), pf);
          continue;
        }
      }
#endif
      Ops::accumulate(acc + h * hd, G, s, rows, n, hd, tmp, pf);
    }
    pf.flush();
  }

#ifdef FOLIO_ATTN_BF16DOT
  if constexpr (kCanPairV) {
    if (paired_v) PairOrder<HD>::unpermute(acc, nh);
  }
#endif
  if (partial != nullptr) {  // one partition: m, l and acc for merge_partials
    std::copy(ws.m.begin(), ws.m.begin() + nh, partial);
    std::copy(ws.l.begin(), ws.l.begin() + nh, partial + nh);
    std::copy(acc, acc + nh * hd, partial + 2 * nh);
    return;
  }
  for (int64_t h = 0; h < nh; ++h) {
    // seq_len == 0 (nothing visible) leaves l = 0: write zeros rather than NaN.
    const float inv = ws.l[h] > 0.f ? 1.f / ws.l[h] : 0.f;
    T* o = out + (d * sh.num_heads + head0 + h) * hd;
    const float* a = acc + h * hd;
    for (int64_t i = 0; i < hd; ++i) o[i] = static_cast<T>(a[i] * inv);
  }
}

// One call's work items and the state its threads share: the shared counter they pull
// items from and, per partitioned group, the partitions still running (the thread that
// finishes the last merges). reset() readies it for another call on the same plan.
struct Team {
  Plan plan;
  std::vector<float> partials;
  std::unique_ptr<std::atomic<int64_t>[]> left;
  std::atomic<int64_t> next{0};

  Team(const Shape& sh, const int64_t* tables, const int64_t* seq_lens, int64_t window)
      : plan(make_plan(sh, tables, seq_lens, window)),
        partials(static_cast<size_t>(plan.num_partials * partial_floats(sh))),
        left(new std::atomic<int64_t>[plan.groups.size()]) {
    reset();
  }
  void reset() {
    for (size_t g = 0; g < plan.groups.size(); ++g)
      left[g].store(plan.parts[g], std::memory_order_relaxed);
    next.store(0, std::memory_order_relaxed);
  }
};

// One thread's share of a call: items off the shared counter until none is left.
// Requests are ragged, so a static split would leave a thread idle. A thread claims its
// next item when it starts one, so that the next item's first keys are on their way
// while this one finishes (most requests span a few chunks, and a first chunk requested
// only when its item starts had stalled on memory).
template <typename T, typename C, int64_t HD>
void team_work(const Shape& sh, Team& team, const T* query, const C* cache, float scale,
               T* out) {
  const auto num_items = static_cast<int64_t>(team.plan.items.size());
  int64_t item = team.next.fetch_add(1);
  if (item >= num_items) return;
  Scratch ws(sh);
  for (bool requested = false;;) {
    const Item& it = team.plan.items[item];
    const int64_t following = team.next.fetch_add(1);
    const bool more = following < num_items;
    float* partial =
        it.partial < 0 ? nullptr : team.partials.data() + it.partial * partial_floats(sh);
    attend_one<T, C, HD>(sh, it, more ? &team.plan.items[following] : nullptr, requested,
                         query, cache, scale, out, partial, ws);
    // acq_rel: the last one sees every other partition's partial result
    if (it.group >= 0 && team.left[it.group].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge_partials(sh, team.plan.groups[it.group],
                     team.partials.data() + team.plan.first[it.group] * partial_floats(sh),
                     team.plan.parts[it.group], out);
    if (!more) break;
    item = following;
    requested = true;
  }
}

template <typename T, typename C, int64_t HD>
void run_decode(const Shape& sh, const T* query, const C* cache, const int64_t* tables,
                const int64_t* seq_lens, float scale, int64_t window, T* out) {
  Team team(sh, tables, seq_lens, window);
  const int64_t num_workers =
      std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(team.plan.items.size()));
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    team_work<T, C, HD>(sh, team, query, cache, scale, out);
  });
}

// Head dims that fill whole vectors get register-blocked row operations.
template <typename T, typename C>
void run_for_head_dim(const Shape& sh, const T* query, const C* cache, const int64_t* tables,
                      const int64_t* seq_lens, float scale, int64_t window, T* out) {
  if (sh.head_dim == 64) {
    run_decode<T, C, 64>(sh, query, cache, tables, seq_lens, scale, window, out);
  } else if (sh.head_dim == 128) {
    run_decode<T, C, 128>(sh, query, cache, tables, seq_lens, scale, window, out);
  } else {
    run_decode<T, C, 0>(sh, query, cache, tables, seq_lens, scale, window, out);
  }
}

// Work items per request: whole slot rows (all kv heads, the most contiguous reads)
// when there are enough requests to keep every thread busy, else the kv heads are
// split into ranges so that there are about kItemsPerThread items per thread; if that
// still leaves fewer, and the call need not be batch-invariant, the rows' keys are
// partitioned finer (see kPartition). `longest`: the most visible keys of any request.
constexpr int64_t kItemsPerThread = 4;

void choose_split(Shape& sh, int64_t num_threads, int64_t longest, bool batch_invariant) {
  const int64_t want = kItemsPerThread * std::max<int64_t>(num_threads, 1);
  const int64_t d = std::max<int64_t>(sh.num_decodes, 1);
  const int64_t pieces = std::max<int64_t>(1, std::min(sh.num_kv_heads, (want + d - 1) / d));
  sh.kv_per_item = std::max<int64_t>(1, (sh.num_kv_heads + pieces - 1) / pieces);
  sh.items_per_req = (sh.num_kv_heads + sh.kv_per_item - 1) / sh.kv_per_item;
  sh.partition = kPartition;
  const int64_t items = sh.num_decodes * sh.items_per_req;
  if (batch_invariant || items >= want) return;
  const int64_t per_row = (want + items - 1) / items;  // partitions wanted per item
  const int64_t keys = (longest + per_row - 1) / per_row;
  sh.partition = std::clamp((keys + kChunk - 1) / kChunk * kChunk, kChunk, kPartition);
}

}  // namespace

namespace {

// The call's Shape, its operands checked: what the kernel will dereference included (an
// out-of-range block id would otherwise read outside the cache; cheap next to the
// attention itself). `longest`: the most visible keys of any request.
Shape checked_shape(const at::Tensor& query, const at::Tensor& kv_cache,
                    const at::Tensor& tables, const at::Tensor& lens, int64_t window,
                    int64_t v_pass, int64_t& longest) {
  TORCH_CHECK(v_pass >= kWidenedV && v_pass <= kLastVPass, "paged_attention_decode: v_pass ",
              v_pass, kLastVPass == kPairedV ? " is not 0 (widened) or 1 (paired)"
                                             : " is not built here (0, widened, only)");
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() &&
                  tables.device().is_cpu() && lens.device().is_cpu(),
              "paged_attention_decode: CPU tensors only");
  TORCH_CHECK(query.dim() == 3, "query must be [num_decodes, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(cache_type == query.scalar_type() || cache_type == at::kFloat8_e4m3fn ||
                  cache_type == at::kFloat8_e5m2,
              "kv_cache must have the query's dtype or be float8_e4m3fn / float8_e5m2");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == query.size(0),
              "block_tables must be [num_decodes, max_blocks]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == query.size(0),
              "seq_lens must be [num_decodes]");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous");

  Shape sh;
  sh.num_decodes = query.size(0);
  sh.num_heads = query.size(1);
  sh.head_dim = query.size(2);
  sh.num_blocks = kv_cache.size(1);
  sh.block_size = kv_cache.size(2);
  sh.num_kv_heads = kv_cache.size(3);
  sh.max_blocks = tables.size(1);
  TORCH_CHECK(kv_cache.size(4) == sh.head_dim, "query and kv_cache head_dim differ");
  TORCH_CHECK(sh.num_kv_heads > 0 && sh.num_heads % sh.num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  sh.group = sh.num_heads / sh.num_kv_heads;
  sh.slot_stride = sh.num_kv_heads * sh.head_dim;
  sh.plane_stride = sh.num_blocks * sh.block_size * sh.slot_stride;
  sh.paired_v = v_pass == kPairedV;

  const int64_t* tab = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  longest = 0;
  for (int64_t d = 0; d < sh.num_decodes; ++d) {
    TORCH_CHECK(len[d] >= 0 && len[d] <= sh.max_blocks * sh.block_size,
                "seq_lens[", d, "] = ", len[d], " does not fit its block table");
    const int64_t start = window > 0 ? std::max<int64_t>(0, len[d] - window) : 0;
    longest = std::max(longest, len[d] - start);
    const int64_t first = start / sh.block_size;
    const int64_t last = (len[d] + sh.block_size - 1) / sh.block_size;
    for (int64_t b = first; b < last; ++b) {
      const int64_t id = tab[d * sh.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < sh.num_blocks, "block_tables[", d, ", ", b, "] = ", id,
                  " is outside the cache (", sh.num_blocks, " blocks)");
    }
  }
  return sh;
}

int64_t window_of(std::optional<int64_t> sliding_window) {
  TORCH_CHECK(!sliding_window.has_value() || *sliding_window > 0,
              "sliding_window must be positive");
  return sliding_window.has_value() ? *sliding_window : 0;
}

}  // namespace

at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, std::optional<int64_t> sliding_window,
                                  bool batch_invariant, int64_t v_pass) {
  const int64_t window = window_of(sliding_window);
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  int64_t longest = 0;
  Shape sh = checked_shape(q, kv_cache, tables, lens, window, v_pass, longest);
  at::Tensor out = q.new_empty(q.sizes());  // (new_empty: no extra ATen op header)
  if (sh.num_decodes == 0 || sh.num_heads == 0 || sh.head_dim == 0) return out;

  choose_split(sh, at::get_num_threads(), longest, batch_invariant);
  const auto cache_type = kv_cache.scalar_type();
  const int64_t* tab = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_decode", [&] {
        if constexpr (std::is_same_v<scalar_t, double>) {
          TORCH_CHECK(false, "paged_attention_decode: float64 is not supported");
        } else {
          const scalar_t* qp = q.const_data_ptr<scalar_t>();
          scalar_t* op = out.data_ptr<scalar_t>();
          if (cache_type == at::kFloat8_e4m3fn) {
            run_for_head_dim(sh, qp, kv_cache.const_data_ptr<c10::Float8_e4m3fn>(), tab, len,
                             fscale, window, op);
          } else if (cache_type == at::kFloat8_e5m2) {
            run_for_head_dim(sh, qp, kv_cache.const_data_ptr<c10::Float8_e5m2>(), tab, len,
                             fscale, window, op);
          } else {
            run_for_head_dim(sh, qp, kv_cache.const_data_ptr<scalar_t>(), tab, len, fscale,
                             window, op);
          }
        }
      });
  return out;
}

// How many V passes are built (VPass: 0 widened, then 1 paired with AVX512-BF16).
int64_t decode_v_passes() { return kLastVPass + 1; }

struct TeamAttention::State {
  Shape sh;
  at::ScalarType dtype, cache_type;
  float scale;
  std::unique_ptr<Team> team;  // null when there is nothing to attend to
};

TeamAttention::TeamAttention(const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             double scale, std::optional<int64_t> sliding_window,
                             int64_t team_size, int64_t v_pass)
    : s_(std::make_unique<State>()) {
  const int64_t window = window_of(sliding_window);
  TORCH_CHECK(query.scalar_type() != at::kDouble,
              "paged_attention_decode: float64 is not supported");
  int64_t longest = 0;
  s_->sh = checked_shape(query, kv_cache, block_tables, seq_lens, window, v_pass, longest);
  s_->dtype = query.scalar_type();
  s_->cache_type = kv_cache.scalar_type();
  s_->scale = static_cast<float>(scale);
  if (s_->sh.num_decodes == 0 || s_->sh.num_heads == 0 || s_->sh.head_dim == 0) return;
  choose_split(s_->sh, team_size, longest, /*batch_invariant=*/false);
  s_->team = std::make_unique<Team>(s_->sh, block_tables.const_data_ptr<int64_t>(),
                                    seq_lens.const_data_ptr<int64_t>(), window);
}

TeamAttention::~TeamAttention() = default;

void TeamAttention::reset() {
  if (s_->team) s_->team->reset();
}

namespace {
template <typename T, typename C>
void team_for_head_dim(const Shape& sh, Team& team, const void* query, const void* cache,
                       float scale, void* out) {
  const T* q = static_cast<const T*>(query);
  const C* c = static_cast<const C*>(cache);
  T* o = static_cast<T*>(out);
  if (sh.head_dim == 64) team_work<T, C, 64>(sh, team, q, c, scale, o);
  else if (sh.head_dim == 128) team_work<T, C, 128>(sh, team, q, c, scale, o);
  else team_work<T, C, 0>(sh, team, q, c, scale, o);
}

template <typename T>
void team_for_cache(const Shape& sh, Team& team, at::ScalarType cache_type, const void* query,
                    const void* cache, float scale, void* out) {
  if (cache_type == at::kFloat8_e4m3fn)
    team_for_head_dim<T, c10::Float8_e4m3fn>(sh, team, query, cache, scale, out);
  else if (cache_type == at::kFloat8_e5m2)
    team_for_head_dim<T, c10::Float8_e5m2>(sh, team, query, cache, scale, out);
  else
    team_for_head_dim<T, T>(sh, team, query, cache, scale, out);
}
}  // namespace

void TeamAttention::work(const void* query, const void* cache, void* out) {
  if (!s_->team) return;
  if (s_->dtype == at::kBFloat16)
    team_for_cache<c10::BFloat16>(s_->sh, *s_->team, s_->cache_type, query, cache, s_->scale, out);
  else if (s_->dtype == at::kHalf)
    team_for_cache<c10::Half>(s_->sh, *s_->team, s_->cache_type, query, cache, s_->scale, out);
  else
    team_for_cache<float>(s_->sh, *s_->team, s_->cache_type, query, cache, s_->scale, out);
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def(
      "paged_attention_decode(Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int? sliding_window=None, bool batch_invariant=False, "
      "int v_pass=0) -> Tensor");
  m.def("decode_v_passes() -> int", &folio::decode_v_passes);
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("paged_attention_decode", &folio::paged_attention_decode);
}
