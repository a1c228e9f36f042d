// GGUF block-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) in Folio's packed layout,
// and the per-block int8 quantization of activations the integer kernels multiply them
// with.
//
// A GGUF stores a weight row by row in blocks of 32 values along K; a Q4_1 block is
//
//   byte  0   2   4                                   20
//        +---+---+------------------------------------+
//        | d | m | qs[16]: byte i = q[i] | q[i+16]<<4  |     w[k] = d * q[k] + m
//        +---+---+------------------------------------+
//
// (Q4_0: no m, w = d * (q - 8); Q8_0: d then 32 signed bytes, w = d * q; d, m fp16.)
// The kernels want 16 weight rows side by side, so that one 64-byte vector holds 4
// consecutive k of 16 rows: each 32-bit lane j is one row, and `vpdpbusd` adds the 4
// products of a lane with the same 4 activations broadcast to every lane. Rows are
// cut into groups of 16 (the last one zero-padded) and the model's layout becomes
//
//   qs     [G][B][chunk][64] u8   G = ceil(N / 16) groups, B = K / 32 blocks
//   scales [G][B][S] fp16         S = 16 (d of the 16 rows) or 32 (d then m, Q4_1)
//
//   Q4 chunk c (4 per block), byte 4j + t (row j of the group, t = 0..3):
//        low nibble  = q[row j, k = 32b + 8c + t]
//        high nibble = q[row j, k = 32b + 8c + 4 + t]
//   Q8 chunk c (8 per block), byte 4j + t = q[row j, k = 32b + 4c + t] + 128 (unsigned)
//
// so unpacking a Q4 chunk is `v & 15` (k 8c..8c+3) and `(v >> 4) & 15` (k 8c+4..8c+7),
// the operands of activation words 2c and 2c+1; a Q8 chunk is used as it is, against
// word c. The bytes are exactly as many as the GGUF's (16 blocks of 20 bytes = 256 +
// 64 for Q4_1); kernels/quant_linear.py packs them and holds the torch reference.
//
// The K-quants hold 256 values (a superblock, 8 blocks) under one fp16 d per row:
//
//   Q4_K  w = d * sc * q - dmin * m, q 4-bit, sc and m 6-bit per block of 32
//   Q6_K  w = d * sc * (q - 32),     q 6-bit, sc int8 per half block of 16
//
// Their qs are laid out as above (Q4_K like Q4_1; Q6_K's low four bits like Q4_1, then
// two 64-byte planes of the top two bits: plane h, byte 4j + t, bits 2f..2f+1 hold k =
// 16h + 4f + t of row j, so plane h serves chunks 2h and 2h+1). Their scales stay
// integers, as stored, per group and superblock (uint8 [G][B/8][bytes]):
//
//   Q4_K  d fp16[16] | dmin fp16[16] | sc lo[8 blocks][8] | m lo[8][8]
//         | sc hi[8 blocks][4] | m hi[8][4]                                        256
//   Q6_K  d fp16[16] | sc i8[8 blocks][2 halves][16]                              288
//
// Q4_K's sc and m are 6 bits, kept in 12 bytes per block of 16 rows, as GGUF keeps them
// in 12 per row, so the packed tensor is the GGUF's size: lo byte j holds rows j and
// j + 8 (low nibble first), hi byte j bits 2f..2f+1 the top bits of row 4f + j
// (six_bits16 below unpacks a block's 16 values).
//
// and a block's multipliers are formed in float32, where d * sc is exact, so the
// kernels see exactly the values gguf's dequantisation gives (w = D * (u - off) + M).
// With the half sums xs0, xs1 of a block's activations:
//
//   Q4_K:  sum_k w x = D * xd * p + M * (xd * xs)          (D = d sc, M = -dmin m)
//   Q6_K:  sum_k w x = D0 * xd * (p0 - 32 xs0) + D1 * xd * (p1 - 32 xs1)
//
// Activations: per row and block of 32, xd = max|x| / 127, xq = round-half-even(x / xd)
// (as x * (1 / xd)), xs = sum(xq). With integer dot p = sum(u * xq) of the stored
// unsigned weights u (q, or q + 128 for Q8_0):
//
//   Q4_0:  sum_k w x = d * xd * (p - 8 * xs)
//   Q8_0:  sum_k w x = d * xd * (p - 128 * xs)
//   Q4_1:  sum_k w x = d * xd * p + m * (xd * xs)
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace folio::quant {

constexpr int kGroupRows = 16;
constexpr int kBlock = 32;
constexpr int kSuperBlocks = 8;  // blocks of 32 per K-quant superblock
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;  // ggml type ids

constexpr bool is_k(int64_t fmt) { return fmt == kQ4_K || fmt == kQ6_K; }
constexpr bool is_q4(int64_t fmt) { return fmt != kQ8_0; }  // low four bits as nibbles
constexpr bool has_min(int64_t fmt) { return fmt == kQ4_1 || fmt == kQ4_K; }
constexpr bool split_halves(int64_t fmt) { return fmt == kQ6_K; }  // a scale per 16 k
constexpr int qs_bytes(int64_t fmt) { return fmt == kQ8_0 ? 512 : fmt == kQ6_K ? 384 : 256; }
constexpr int scale_count(int64_t fmt) { return fmt == kQ4_1 ? 32 : 16; }   // fp16 per block
constexpr int k_scale_bytes(int64_t fmt) { return fmt == kQ4_K ? 256 : 288; }  // per superblock
constexpr int32_t offset_of(int64_t fmt) {
  return fmt == kQ4_0 ? 8 : fmt == kQ8_0 ? 128 : fmt == kQ6_K ? 32 : 0;
}
// Scale bytes of one group of 16 rows, B blocks per row.
constexpr int64_t group_scale_bytes(int64_t fmt, int64_t B) {
  return is_k(fmt) ? B / kSuperBlocks * k_scale_bytes(fmt) : B * scale_count(fmt) * 2;
}

// Q4_K's sc (or m) of block i for the group's 16 rows, from its packed 8 lo and 4 hi
// bytes: rows 0-7 in `first`, rows 8-15 in `second`, a byte each (little endian). Done
// in two 64-bit words: the unpacking runs once a block of 16 rows, beside the block's
// 256 bytes of products.
inline void six_bits16(const uint8_t* lo, const uint8_t* hi, uint64_t& first, uint64_t& second) {
  constexpr uint64_t kNibbles = 0x0F0F0F0F0F0F0F0FULL, kPairs = 0x0303030303030303ULL;
  uint64_t l;
  uint32_t h32;
  std::memcpy(&l, lo, sizeof l);
  std::memcpy(&h32, hi, sizeof h32);
  // byte j of (h >> 2f) & 3 is the top of row 4f + j: rows 0-7 take f = 0, 1, rows 8-15 f = 2, 3
  const uint64_t h = h32;
  const uint64_t top_first = (h & kPairs) | (((h >> 2) & kPairs) << 32);
  const uint64_t top_second = ((h >> 4) & kPairs) | (((h >> 6) & kPairs) << 32);
  first = (l & kNibbles) | (top_first << 4);
  second = ((l >> 4) & kNibbles) | (top_second << 4);
}

// Block i's sc and m of a Q4_K scale record (the layout above), 16 bytes each, rows in
// order: sc in sc[0..1], m in m[0..1].
inline void q4_k_block_scales(const uint8_t* rec, int64_t i, uint64_t (&sc)[2], uint64_t (&m)[2]) {
  constexpr int kScLo = 64, kMLo = 128, kScHi = 192, kMHi = 224;
  six_bits16(rec + kScLo + 8 * i, rec + kScHi + 4 * i, sc[0], sc[1]);
  six_bits16(rec + kMLo + 8 * i, rec + kMHi + 4 * i, m[0], m[1]);
}

// Activations quantized per block of 32, row-major like x.
struct QuantizedRows {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;      // [rows][blocks * 32]
  std::vector<float> scale;   // [rows][blocks]   xd
  std::vector<int32_t> sum;   // [rows][blocks]   xs
  std::vector<float> msum;    // [rows][blocks]   xd * xs (Q4_1's min term)
  std::vector<int32_t> sum16; // [rows][blocks][2] xs of each half block (Q6_K)
};

template <typename T>
void quantize_block(const T* x, int8_t* q, float& scale, int32_t& sum, int32_t* halves) {
  float amax = 0.f;
  float v[kBlock];
  for (int i = 0; i < kBlock; ++i) {
    v[i] = static_cast<float>(x[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int32_t s[2] = {0, 0};
  for (int i = 0; i < kBlock; ++i) {
    const int32_t r = static_cast<int32_t>(std::nearbyint(v[i] * id));  // ties to even
    q[i] = static_cast<int8_t>(r);
    s[i / 16] += r;
  }
  scale = d;
  sum = s[0] + s[1];
  halves[0] = s[0];
  halves[1] = s[1];
}

// x [M, K] (rows `ldx` apart, K a multiple of 32) into `out`, rows split over threads.
template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t B = K / kBlock;
  out.rows = M;
  out.blocks = B;
  out.q.resize(static_cast<size_t>(M * K));
  out.scale.resize(static_cast<size_t>(M * B));
  out.sum.resize(static_cast<size_t>(M * B));
  out.msum.resize(static_cast<size_t>(M * B));
  out.sum16.resize(static_cast<size_t>(M * B * 2));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t i = m * B + b;
        quantize_block(x + m * ldx + b * kBlock, out.q.data() + m * K + b * kBlock,
                       out.scale[i], out.sum[i], out.sum16.data() + 2 * i);
        out.msum[i] = out.scale[i] * static_cast<float>(out.sum[i]);
      }
  });
}

// Activations for the int16 route (quant_tiles.h, tile_int16): per row and block of 32,
// xd = max|x| / 32767, xq = round-half-even(x / xd) as int16, xs = sum(xq), held as
// 32-bit pairs in the order the tile takes them, per 8 k: Q4 (0, 2) (4, 6) (1, 3) (5, 7),
// Q8 (0, 2) (1, 3) (4, 6) (5, 7). Each activation moves by at most max|x| / 65534 of its
// block: 256 times less than the int8 routes', 128 times less than bf16's relative step.
struct Int16Rows {  // filled by quantize_rows16 (AVX2, as the route)
  std::vector<int32_t> w;     // [rows][blocks * 16] pairs
  std::vector<float> scale;   // [rows][blocks] xd
  std::vector<int32_t> sum;   // [rows][blocks] xs
  std::vector<float> msum;    // [rows][blocks] xd * xs
};

// A call's activations as its route takes them (quant_linear.cpp prepares them).
struct Activations {
  QuantizedRows xr;          // int8 routes
  Int16Rows x16;             // int16 route
  std::vector<uint32_t> xp;  // bf16 routes: bf16 pairs in tile order [rows][K / 2]
  std::vector<float> xf;     // widening route: x in float32 [rows][K]
  std::vector<float> xsum;   // widening and bf16 routes: x summed per block
};

#if defined(__AVX512F__)
// 16 activations at p as floats (bf16 and fp16 widen exactly; double rounds as a cast).
template <typename T>
inline __m512 load16_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // a float's top half
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {  // double: rounded to float one by one, as static_cast does
    alignas(64) float f[16];
    for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
    return _mm512_load_ps(f);
  }
}

// quantize_block16 below in 16-lane registers, with the same result bit for bit: the
// scalar loop's max was a chain of 32 dependent maxss and its floats went back through
// memory (the int16 route's activations took 1.5-5% of the main thread's samples in a
// batch-1 Q4_1 step on a Zen 4; 29.4 -> 22.7 ns a block here).
// max_ps(|v|, m) keeps m where |v| is NaN, as std::max(m, |v|) does.
template <typename T>
void quantize_block16(const T* x, bool q8_order, int16_t* out, float& scale, int32_t& sum) {
  const __m512 v[2] = {load16_as_float(x), load16_as_float(x + 16)};
  const __m512 a = _mm512_max_ps(_mm512_abs_ps(v[1]),
                                 _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()));
  const float amax = _mm512_reduce_max_ps(a);
  const float d = amax / 32767.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  scale = d;
  // each 8 k in the tile's order (lane t of 8 takes k from[t]), rounded half to even
  const __m512i from = q8_order
      ? _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15)
      : _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  const __m512 idv = _mm512_set1_ps(id);
  const __m512i top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32767);
  __m512i total = _mm512_setzero_si512();
  for (int c = 0; c < 2; ++c) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], idv));
    q = _mm512_max_epi32(_mm512_min_epi32(q, top), bottom);
    total = _mm512_add_epi32(total, q);
    // within int16 after the clamp: narrowing by truncation is exact
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * c),
                        _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(from, q)));
  }
  sum = _mm512_reduce_add_epi32(total);
}
#elif defined(__AVX2__)
template <typename T>
void quantize_block16(const T* x, bool q8_order, int16_t* out, float& scale, int32_t& sum) {
  float v[kBlock];
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) {
    v[i] = static_cast<float>(x[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 32767.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  scale = d;
  // rounded half to even (vcvtps2dq in the default mode) 8 k at a time, lane t taking k
  // from[t] (the tile's order), narrowed to int16
  const __m256i from = q8_order ? _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7)
                                : _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256 idv = _mm256_set1_ps(id);
  const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
  __m256i total = _mm256_setzero_si256();
  for (int c = 0; c < kBlock / 8; ++c) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * c), idv));
    q = _mm256_max_epi32(_mm256_min_epi32(q, top), bottom);
    total = _mm256_add_epi32(total, q);
    const __m256i ordered = _mm256_permutevar8x32_epi32(q, from);
    const __m256i narrow = _mm256_permute4x64_epi64(_mm256_packs_epi32(ordered, ordered), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * c), _mm256_castsi256_si128(narrow));
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b01001110));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b10110001));
  sum = _mm_cvtsi128_si32(t);
}

#endif

#if defined(__AVX2__)
// x [M, K] (rows `ldx` apart, K a multiple of 32) into `out`, rows split over threads.
template <typename T>
void quantize_rows16(const T* x, int64_t ldx, int64_t M, int64_t K, bool q8_order,
                     Int16Rows& out) {
  const int64_t B = K / kBlock;
  out.w.resize(static_cast<size_t>(M * K / 2));
  out.scale.resize(static_cast<size_t>(M * B));
  out.sum.resize(static_cast<size_t>(M * B));
  out.msum.resize(static_cast<size_t>(M * B));
  int16_t* w = reinterpret_cast<int16_t*>(out.w.data());
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t i = m * B + b;
        quantize_block16(x + m * ldx + b * kBlock, q8_order, w + m * K + b * kBlock,
                         out.scale[i], out.sum[i]);
        out.msum[i] = out.scale[i] * static_cast<float>(out.sum[i]);
      }
  });
}
#endif

}  // namespace folio::quant
