// One group of 16 packed weight rows (quant_pack.h) against MR activation rows: the
// tile every quantized route computes, into acc[MR][16] float32 (lane j = row j).
//
//   int8 routes (activations quantized per block, integer dot products per block):
//     tile_vnni512  AVX512-VNNI: one `vpdpbusd` per 4 k of 16 rows
//     tile_avx2     AVX2: `vpmaddubsw` + `vpmaddwd` per 4 k of 8 rows, for CPUs
//                   without VNNI (Q8_0 through the sign trick, see below)
//     tile_scalar   plain C++, any CPU
//   int16 route (activations rounded to int16 per block, 2^-16 of the block's largest):
//     tile_int16    AVX2: `vpmaddwd` per 2 k of 8 rows (Q4_0, Q4_1, Q4_K, Q8_0);
//                   AVX-512: 16 rows, `vpdpwssd` with VNNI
//   widening route (float32 activations, weights widened in registers):
//     tile_widen    GCC vector extensions, 16 float lanes (zmm, 2 ymm or 4 xmm)
//   bf16 route (bf16 activations, 4-bit weights as bf16 pairs, AVX512-BF16):
//     tile_bf16dot  one `vdpbf16ps` per 2 k of 16 rows
//
// Per block the integer routes add  d * xd * (p - off * xs) [+ m * xd * xs]  to each
// output (the identities in quant_pack.h; Q6_K per half block); the order of float
// additions is the same whatever MR is, so a row's result does not depend on the rows
// beside it. `sc` is the group's scale bytes (fp16 per block, or the K-quants'
// superblock records, quant_pack.h).
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "quant_pack.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace folio::quant {

// A vector of packed weights loaded once. Left alone, GCC folds the load into every
// instruction that uses the value (a 4-bit chunk feeds 4 masks or shifts: 4 loads of
// the same 64 bytes), and at one activation row the load ports, not the arithmetic,
// then bounded the tiles on a Zen 4: a Q4_1 block of 16 rows took 10.7 ns on the int16
// route and 7.3 ns with one load (11.3 and 9.6 on the bf16 route, Q8_0's int16 11.1
// and 8.9; benchmarks/quant_tile_ab.py's harness, one thread, weights in L2). The empty
// asm pins the value in a register, which the folding cannot see through.
#if defined(__AVX512F__)
inline __m512i load_once(const uint8_t* p) {
  __m512i v = _mm512_loadu_si512(p);
  __asm__("" : "+v"(v));
  return v;
}
#endif
#if defined(__AVX2__)
inline __m256i load_once256(const uint8_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __asm__("" : "+x"(v));
  return v;
}
#endif

// The 16 fp16 values at p as floats.
inline void halves_to_float(const c10::Half* p, float* out) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  for (int h = 0; h < 2; ++h)
    _mm256_storeu_ps(out + 8 * h,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h))));
#else
  for (int i = 0; i < kGroupRows; ++i) out[i] = static_cast<float>(p[i]);
#endif
}

// The 16 bytes at p (int8 if Signed, else uint8) as floats, exactly. GCC turns neither
// a scalar loop nor a vector conversion of bytes into the widening instructions.
template <bool Signed>
inline void bytes_to_float(const uint8_t* p, float* out) {
#if defined(__AVX512F__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  _mm512_storeu_ps(out, _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(v)
                                                  : _mm512_cvtepu8_epi32(v)));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h));
    _mm256_storeu_ps(out + 8 * h, _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(v)
                                                            : _mm256_cvtepu8_epi32(v)));
  }
#else
  for (int i = 0; i < 16; ++i)
    out[i] = Signed ? static_cast<float>(static_cast<int8_t>(p[i])) : static_cast<float>(p[i]);
#endif
}

// At one activation row a tile streams its weights once, doing little arithmetic per
// byte, and the hardware prefetchers alone kept one core to about 6-7 GB/s on an AMX Xeon
// (a model's 672 MB of Q4_K_M weights read at 12 GB/s by two threads, against 25 GB/s
// for a plain sum): a block 2 KB ahead is requested with each block (8 Q4 blocks; past
// the group's end it is the next group's, past the tensor's end a harmless miss).
// 2 KB measured best of 1, 2, 3 and 4 KB (20 GB/s).
constexpr int kPrefetchBytes = 2048;

template <int64_t Fmt>
inline void prefetch_ahead(const uint8_t* q) {
  for (int l = 0; l < qs_bytes(Fmt); l += 64) __builtin_prefetch(q + kPrefetchBytes + l);
}

inline int32_t word_at(const int8_t* p) {  // 4 int8 as one 32-bit word (to broadcast)
  int32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

// Block b's multipliers for the 16 rows, w = D * (u - offset) + M. Only what the format
// has is written: D[1] (the second half block of 16 k) for Q6_K, M for Q4_1 and Q4_K.
// Products of an fp16 d and a 6- or 8-bit integer are exact in float32.
template <int64_t Fmt>
inline void block_scales(const uint8_t* sc, int64_t b, float (&D)[2][16], float (&M)[2][16]) {
  if constexpr (!is_k(Fmt)) {
    const c10::Half* s = reinterpret_cast<const c10::Half*>(sc) + b * scale_count(Fmt);
    halves_to_float(s, D[0]);
    if constexpr (Fmt == kQ4_1) halves_to_float(s + 16, M[0]);
  } else {
    const uint8_t* rec = sc + (b / kSuperBlocks) * k_scale_bytes(Fmt);
    const int i = static_cast<int>(b % kSuperBlocks);
#if defined(__AVX512F__)
    // in registers: GCC turned the loops below into scalar multiplies and shuffles
    // (about 80 cycles a block, more than a Q4_K block's own products at one row)
    const auto bytes16 = [](const uint8_t* p, bool is_signed) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
    };
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    if constexpr (Fmt == kQ4_K) {
      uint64_t sc[2], m[2];
      q4_k_block_scales(rec, i, sc, m);
      const auto widen = [](const uint64_t (&v)[2]) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_set_epi64x(static_cast<long long>(v[1]), static_cast<long long>(v[0]))));
      };
      const __m512 dmin =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
      _mm512_store_ps(D[0], _mm512_mul_ps(dv, widen(sc)));
      const __m512 dm = _mm512_mul_ps(dmin, widen(m));
      _mm512_store_ps(M[0], _mm512_castsi512_ps(_mm512_xor_si512(  // -(dmin m)
                                _mm512_castps_si512(dm), _mm512_set1_epi32(INT32_MIN))));
    } else {
      for (int h = 0; h < 2; ++h)
        _mm512_store_ps(D[h], _mm512_mul_ps(dv, bytes16(rec + 32 + 32 * i + 16 * h, true)));
    }
#else
    alignas(64) float d[16];
    halves_to_float(reinterpret_cast<const c10::Half*>(rec), d);
    // per block of 16 rows, not per weight, but a scalar loop here had cost the K-quant
    // tiles about a third of their time at batch 1
    alignas(64) float s[16];
    if constexpr (Fmt == kQ4_K) {
      alignas(64) float dmin[16], m[16];
      alignas(16) uint64_t sc6[2], m6[2];
      q4_k_block_scales(rec, i, sc6, m6);
      halves_to_float(reinterpret_cast<const c10::Half*>(rec + 32), dmin);
      bytes_to_float<false>(reinterpret_cast<const uint8_t*>(sc6), s);
      bytes_to_float<false>(reinterpret_cast<const uint8_t*>(m6), m);
      for (int j = 0; j < kGroupRows; ++j) {
        D[0][j] = d[j] * s[j];
        M[0][j] = -(dmin[j] * m[j]);
      }
    } else {
      for (int h = 0; h < 2; ++h) {
        bytes_to_float<true>(rec + 32 + 32 * i + 16 * h, s);
        for (int j = 0; j < kGroupRows; ++j) D[h][j] = d[j] * s[j];
      }
    }
#endif
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FOLIO_QUANT_VNNI512 1

template <int64_t Fmt, int MR>
inline void tile_vnni512(const uint8_t* qs, const uint8_t* sc, int64_t B,
                         const QuantizedRows& xr, int64_t m0, float* out,
                         const uint8_t* ahead = nullptr) {
  const int64_t K = B * kBlock;
  // A 4-bit format's high nibbles can stay in place (16 q): their chain's sum is then
  // 16x, shifted back once per row and block, exactly (a multiple of 16, far inside
  // int32). That trades the block's 4 shifts for MR of them: a gain at a few rows
  // (Q4_0, Q4_1 and Q4_K at one row, weights in L2: 2-6%), not at 8.
  constexpr bool high_in_place = is_q4(Fmt) && !split_halves(Fmt) && MR <= 4;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i w[8];  // operand i pairs with activation word i (k = 4i .. 4i+3)
    const uint8_t* q = qs + b * qs_bytes(Fmt);
    if constexpr (high_in_place) {
      const __m512i low4 = _mm512_set1_epi8(15), high4 = _mm512_set1_epi8(-16);
      for (int c = 0; c < 4; ++c) {
        const __m512i v = load_once(q + 64 * c);
        w[2 * c] = _mm512_and_si512(v, low4);
        w[2 * c + 1] = _mm512_and_si512(v, high4);
      }
    } else if constexpr (is_q4(Fmt)) {
      const __m512i low4 = _mm512_set1_epi8(15);
      for (int c = 0; c < 4; ++c) {
        const __m512i v = load_once(q + 64 * c);
        w[2 * c] = _mm512_and_si512(v, low4);
        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      if constexpr (Fmt == kQ6_K) {  // top bits: field f of plane h to bits 4-5 of w[4h + f]
        const __m512i top = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; ++h) {
          const __m512i v = load_once(q + 256 + 64 * h);
          w[4 * h] = _mm512_or_si512(w[4 * h], _mm512_and_si512(_mm512_slli_epi16(v, 4), top));
          w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), top));
          w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_and_si512(v, top));
          w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), top));
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(q + 64 * c);
    }
    if (ahead != nullptr)  // the next group's block: re-reading this one stops the prefetcher
      for (int c = 0; c < qs_bytes(Fmt) / 64; ++c) __builtin_prefetch(ahead + b * qs_bytes(Fmt) + 64 * c);
    else if constexpr (MR == 1)
      prefetch_ahead<Fmt>(q);
    __m512 d, mins = _mm512_setzero_ps(), d1 = _mm512_setzero_ps();
    if constexpr (is_k(Fmt)) {
      alignas(64) float D[2][16], M[2][16];
      block_scales<Fmt>(sc, b, D, M);
      d = _mm512_load_ps(D[0]);
      if constexpr (Fmt == kQ4_K) mins = _mm512_load_ps(M[0]);
      if constexpr (split_halves(Fmt)) d1 = _mm512_load_ps(D[1]);
    } else {
      const c10::Half* s = reinterpret_cast<const c10::Half*>(sc) + b * scale_count(Fmt);
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      if constexpr (Fmt == kQ4_1)
        mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t row = m0 + r, i = row * B + b;
      const int8_t* x = xr.q.data() + row * K + b * kBlock;
      const __m512 xd = _mm512_set1_ps(xr.scale[i]);
      if constexpr (split_halves(Fmt)) {
        // four chains: words 0-3 (k 0-15) and 4-7 (k 16-31), each half under its scale
        __m512i p[4];
        for (int c = 0; c < 4; ++c)
          p[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[(c / 2) * 4 + c % 2],
                                     _mm512_set1_epi32(word_at(x + 4 * ((c / 2) * 4 + c % 2))));
        for (int c = 0; c < 4; ++c) {
          const int k = (c / 2) * 4 + c % 2 + 2;
          p[c] = _mm512_dpbusd_epi32(p[c], w[k], _mm512_set1_epi32(word_at(x + 4 * k)));
        }
        const __m512i p0 = _mm512_sub_epi32(_mm512_add_epi32(p[0], p[1]),
                                            _mm512_set1_epi32(offset_of(Fmt) * xr.sum16[2 * i]));
        const __m512i p1 = _mm512_sub_epi32(_mm512_add_epi32(p[2], p[3]),
                                            _mm512_set1_epi32(offset_of(Fmt) * xr.sum16[2 * i + 1]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(d, xd), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(d1, xd), acc[r]);
        continue;
      }
      // two chains of four dot products each: half the latency of one chain (p0 takes
      // a 4-bit format's low nibbles, p1 its high ones)
      __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(word_at(x)));
      __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(word_at(x + 4)));
      for (int k = 2; k < 8; k += 2) {
        p0 = _mm512_dpbusd_epi32(p0, w[k], _mm512_set1_epi32(word_at(x + 4 * k)));
        p1 = _mm512_dpbusd_epi32(p1, w[k + 1], _mm512_set1_epi32(word_at(x + 4 * k + 4)));
      }
      if constexpr (high_in_place) p1 = _mm512_srai_epi32(p1, 4);
      __m512i p = _mm512_add_epi32(p0, p1);
      if constexpr (offset_of(Fmt) != 0)
        p = _mm512_sub_epi32(p, _mm512_set1_epi32(offset_of(Fmt) * xr.sum[i]));
      const __m512 scale = _mm512_mul_ps(d, xd);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[r]);
      if constexpr (has_min(Fmt))
        acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xr.msum[i]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kGroupRows, acc[r]);
}
#endif

#if defined(__AVX2__)
#define FOLIO_QUANT_AVX2 1

// 8 lanes of sum(u[4l..4l+3] * s[4l..4l+3]) added to acc: u unsigned, s signed bytes,
// with every pair sum within int16 (vpmaddubsw saturates).
inline __m256i dot4_avx2(__m256i acc, __m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Rows 8h .. 8h+7 of the group (bytes 32h .. 32h+31 of every chunk).
template <int64_t Fmt, int MR>
inline void tile_avx2_half(const uint8_t* qs, const uint8_t* sc, int64_t B,
                           const QuantizedRows& xr, int64_t m0, int h, float* out) {
  const int64_t K = B * kBlock;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m256i w[8];
    const uint8_t* q = qs + b * qs_bytes(Fmt) + 32 * h;
    if constexpr (is_q4(Fmt)) {
      const __m256i low4 = _mm256_set1_epi8(15);
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load_once256(q + 64 * c);
        w[2 * c] = _mm256_and_si256(v, low4);
        w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      if constexpr (Fmt == kQ6_K) {  // as in tile_vnni512
        const __m256i top = _mm256_set1_epi8(0x30);
        for (int p = 0; p < 2; ++p) {
          const __m256i v = load_once256(q + 256 + 64 * p);
          w[4 * p] = _mm256_or_si256(w[4 * p], _mm256_and_si256(_mm256_slli_epi16(v, 4), top));
          w[4 * p + 1] = _mm256_or_si256(w[4 * p + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), top));
          w[4 * p + 2] = _mm256_or_si256(w[4 * p + 2], _mm256_and_si256(v, top));
          w[4 * p + 3] = _mm256_or_si256(w[4 * p + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), top));
        }
      }
    } else {  // back to signed q: products up to 255 * 127 would saturate int16 pairs
      for (int c = 0; c < 8; ++c)
        w[c] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c)),
                                _mm256_set1_epi8(static_cast<char>(0x80)));
    }
    __m256 d, mins = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
    if constexpr (is_k(Fmt)) {
      alignas(64) float D[2][16], M[2][16];
      block_scales<Fmt>(sc, b, D, M);
      d = _mm256_load_ps(D[0] + 8 * h);
      if constexpr (Fmt == kQ4_K) mins = _mm256_load_ps(M[0] + 8 * h);
      if constexpr (split_halves(Fmt)) d1 = _mm256_load_ps(D[1] + 8 * h);
    } else {
      const c10::Half* s = reinterpret_cast<const c10::Half*>(sc) + b * scale_count(Fmt) + 8 * h;
      d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
      if constexpr (Fmt == kQ4_1)
        mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t row = m0 + r, i = row * B + b;
      const int8_t* x = xr.q.data() + row * K + b * kBlock;
      const __m256 xd = _mm256_set1_ps(xr.scale[i]);
      __m256i p[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // k 0-15, 16-31
      for (int k = 0; k < 8; ++k) {
        const __m256i xb = _mm256_set1_epi32(word_at(x + 4 * k));
        if constexpr (is_q4(Fmt)) {  // u <= 63: pair sums within int16
          p[k / 4] = dot4_avx2(p[k / 4], w[k], xb);
        } else {  // sign trick: |q| * (x with q's sign) = q * x, pairs within int16
          p[k / 4] = dot4_avx2(p[k / 4], _mm256_abs_epi8(w[k]), _mm256_sign_epi8(xb, w[k]));
        }
      }
      if constexpr (split_halves(Fmt)) {
        const __m256i p0 = _mm256_sub_epi32(p[0], _mm256_set1_epi32(offset_of(Fmt) * xr.sum16[2 * i]));
        const __m256i p1 = _mm256_sub_epi32(p[1], _mm256_set1_epi32(offset_of(Fmt) * xr.sum16[2 * i + 1]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(d, xd), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(d1, xd), acc[r]);
        continue;
      }
      __m256i pb = _mm256_add_epi32(p[0], p[1]);
      if constexpr (Fmt == kQ4_0)
        pb = _mm256_sub_epi32(pb, _mm256_set1_epi32(offset_of(Fmt) * xr.sum[i]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pb), _mm256_mul_ps(d, xd), acc[r]);
      if constexpr (has_min(Fmt))
        acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xr.msum[i]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * kGroupRows + 8 * h, acc[r]);
}

template <int64_t Fmt, int MR>
inline void tile_avx2(const uint8_t* qs, const uint8_t* sc, int64_t B,
                      const QuantizedRows& xr, int64_t m0, float* out) {
  tile_avx2_half<Fmt, MR>(qs, sc, B, xr, m0, 0, out);
  tile_avx2_half<Fmt, MR>(qs, sc, B, xr, m0, 1, out);
}

// The int16 route (Q4_0, Q4_1, Q4_K, Q8_0; quant_pack.h, Int16Rows): activations
// rounded to int16 per block of 32, then one `vpmaddwd` multiplies a 16-bit pair of 8
// rows by a pair of activations and sums it into int32, exactly. A Q4 lane's halves
// hold k (0, 4, 1, 5) and (2, 6, 3, 7) of its chunk as nibbles at bits 0, 4, 8, 12, so
// masking gives the pair (k0, k2) as is, (k4, k6) times 16 and (k1, k3) times 256, and a
// 16-bit shift by 12 gives (k5, k7): four instructions for 8 k of 8 rows where widening
// takes eight conversions and eight multiply-adds. Each scale of 2 sums apart and comes
// off with an exact arithmetic shift per block (its products are all multiples of it;
// the largest sum, 4 x 2 x 3840 x 32767, stays under 2^31). A Q8 lane's (k0, k2) is a
// mask of its bytes and (k1, k3) a shift by 8. Per block, as the int8 routes:
// d * xd * (p - off * xs) [+ m * xd * xs].
//
// With AVX-512 (BW) the same sums run on all 16 rows at once (one 64-byte chunk per
// vector, `vpdpwssd` fusing the multiply and the sum where VNNI is there): the integer
// sums and the float operations per row are the AVX2 form's, so are the results, bit for bit.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i pairs_dot16(__m512i acc, __m512i w, int32_t x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(x));
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(x)));
#endif
}

template <int64_t Fmt, int MR>
inline void tile_int16(const uint8_t* qs, const uint8_t* sc, int64_t B, const Int16Rows& xr,
                       int64_t m0, float* out) {
  static_assert(Fmt != kQ6_K, "Q6_K takes the widening route");
  constexpr int64_t kWords = kBlock / 2;  // 32-bit activation pairs per block
  const int64_t W = B * kWords;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i m1 = _mm512_set1_epi32(0x000F000F), m16 = _mm512_set1_epi32(0x00F000F0),
                m256 = _mm512_set1_epi32(0x0F000F00), m8 = _mm512_set1_epi32(0x00FF00FF);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* q = qs + b * qs_bytes(Fmt);
    if constexpr (MR == 1) prefetch_ahead<Fmt>(q);
    alignas(64) float D[2][16], M[2][16];
    block_scales<Fmt>(sc, b, D, M);
    const __m512 d = _mm512_load_ps(D[0]);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * B + b;
      const int32_t* xw = xr.w.data() + (m0 + r) * W + b * kWords;
      __m512i p;
      if constexpr (is_q4(Fmt)) {
        __m512i a1 = _mm512_setzero_si512(), a16 = a1, a256 = a1;
        for (int c = 0; c < 4; ++c) {
          const __m512i v = load_once(q + 64 * c);
          const int32_t* x = xw + 4 * c;
          a1 = pairs_dot16(a1, _mm512_and_si512(v, m1), x[0]);
          a16 = pairs_dot16(a16, _mm512_and_si512(v, m16), x[1]);
          a256 = pairs_dot16(a256, _mm512_and_si512(v, m256), x[2]);
          a1 = pairs_dot16(a1, _mm512_srli_epi16(v, 12), x[3]);
        }
        p = _mm512_add_epi32(a1, _mm512_add_epi32(_mm512_srai_epi32(a16, 4),
                                                  _mm512_srai_epi32(a256, 8)));
      } else {
        __m512i a0 = _mm512_setzero_si512(), a1 = a0;
        for (int c = 0; c < 8; ++c) {
          const __m512i v = load_once(q + 64 * c);
          const int32_t* x = xw + 2 * c;
          a0 = pairs_dot16(a0, _mm512_and_si512(v, m8), x[0]);
          a1 = pairs_dot16(a1, _mm512_srli_epi16(v, 8), x[1]);
        }
        p = _mm512_add_epi32(a0, a1);
      }
      if constexpr (offset_of(Fmt) != 0)
        p = _mm512_sub_epi32(p, _mm512_set1_epi32(offset_of(Fmt) * xr.sum[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, _mm512_set1_ps(xr.scale[i])),
                               acc[r]);
      if constexpr (has_min(Fmt))
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(M[0]), _mm512_set1_ps(xr.msum[i]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kGroupRows, acc[r]);
}
#else
template <int64_t Fmt, int MR>
inline void tile_int16(const uint8_t* qs, const uint8_t* sc, int64_t B, const Int16Rows& xr,
                       int64_t m0, float* out) {
  static_assert(Fmt != kQ6_K, "Q6_K takes the widening route");
  constexpr int64_t kWords = kBlock / 2;  // 32-bit activation pairs per block
  const int64_t W = B * kWords;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i m1 = _mm256_set1_epi32(0x000F000F), m16 = _mm256_set1_epi32(0x00F000F0),
                m256 = _mm256_set1_epi32(0x0F000F00), m8 = _mm256_set1_epi32(0x00FF00FF);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* q = qs + b * qs_bytes(Fmt);
    if constexpr (MR == 1) prefetch_ahead<Fmt>(q);
    alignas(64) float D[2][16], M[2][16];
    block_scales<Fmt>(sc, b, D, M);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * B + b;
      const int32_t* xw = xr.w.data() + (m0 + r) * W + b * kWords;
      const __m256 xd = _mm256_set1_ps(xr.scale[i]);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* qh = q + 32 * h;
        __m256i p;
        if constexpr (is_q4(Fmt)) {
          __m256i a1 = _mm256_setzero_si256(), a16 = a1, a256 = a1;
          for (int c = 0; c < 4; ++c) {
            const __m256i v = load_once256(qh + 64 * c);
            const int32_t* x = xw + 4 * c;
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_and_si256(v, m1), _mm256_set1_epi32(x[0])));
            a16 = _mm256_add_epi32(a16, _mm256_madd_epi16(_mm256_and_si256(v, m16), _mm256_set1_epi32(x[1])));
            a256 = _mm256_add_epi32(a256, _mm256_madd_epi16(_mm256_and_si256(v, m256), _mm256_set1_epi32(x[2])));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_srli_epi16(v, 12), _mm256_set1_epi32(x[3])));
          }
          p = _mm256_add_epi32(a1, _mm256_add_epi32(_mm256_srai_epi32(a16, 4),
                                                    _mm256_srai_epi32(a256, 8)));
        } else {
          __m256i a0 = _mm256_setzero_si256(), a1 = a0;
          for (int c = 0; c < 8; ++c) {
            const __m256i v = load_once256(qh + 64 * c);
            const int32_t* x = xw + 2 * c;
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_and_si256(v, m8), _mm256_set1_epi32(x[0])));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_srli_epi16(v, 8), _mm256_set1_epi32(x[1])));
          }
          p = _mm256_add_epi32(a0, a1);
        }
        if constexpr (offset_of(Fmt) != 0)
          p = _mm256_sub_epi32(p, _mm256_set1_epi32(offset_of(Fmt) * xr.sum[i]));
        const __m256 d = _mm256_load_ps(D[0] + 8 * h);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, xd), acc[r][h]);
        if constexpr (has_min(Fmt))
          acc[r][h] = _mm256_fmadd_ps(_mm256_load_ps(M[0] + 8 * h), _mm256_set1_ps(xr.msum[i]),
                                      acc[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kGroupRows + 8 * h, acc[r][h]);
}
#endif  // AVX-512 BW
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define FOLIO_QUANT_BF16DOT 1

// The bf16 route, for Q4_0, Q4_1, Q4_K and Q6_K with bf16 activations: a 16-bit lane
// holding a value u < 128 in its low bits, or-ed with 0x4300, is the bf16 of 128 + u
// (exponent 2^7, the last of 7 mantissa bits worth 1), so a `vpternlogd` or two turn two
// values of a row into a bf16 pair and one `vdpbf16ps` multiplies 16 rows x 2 k into
// float32. Products of two bf16 are exact in float32, as in the widening route; per
// block (Q6_K: half block) the offset comes off with the activations' sum:
//
//   sum_k w_k x_k = D * (sum_k (128 + u_k) x_k - (128 + offset) * xs) + M * xs
//
// A Q4 chunk's lane j holds bytes t = 0..3 of row j (low nibble k = 8c + t, high nibble
// 8c + 4 + t); the four pairs it gives, by shifting 0, 8, 4 and 12, are k (0, 2), (1, 3),
// (4, 6), (5, 7) of the chunk (low half, high half), so the activations are taken as
// bf16 pairs in that order (`xp` [rows][k / 2] 32-bit words, quant_linear.cpp). Q6_K ors
// each pair's two top bits in from its plane (bits 2f of byte t for k = 16h + 4f + t),
// shifted to bits 4-5 of each half. Against the widening route: about half the vector
// instructions per weight.

// The four bf16 pair vectors of Q4 chunk c (k (0, 2), (1, 3), (4, 6), (5, 7) of the
// chunk, lane j = row j), each 16-bit half the bf16 of 128 + u; for Q6_K `plane` is the
// chunk's top-bit plane shifted right by 2f (f = 2 (c % 2)).
template <int64_t Fmt>
inline void bf16_pairs(const uint8_t* q, int c, const __m512i& plane, __m512i (&pair)[4]) {
  const __m512i low = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
  const __m512i v = load_once(q + 64 * c);
  pair[0] = _mm512_ternarylogic_epi32(v, low, magic, 0xEA);  // (v & low) | magic
  pair[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 8), low, magic, 0xEA);
  pair[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 4), low, magic, 0xEA);
  pair[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 12), low, magic, 0xEA);
  if constexpr (Fmt == kQ6_K) {  // | (top bits & 0x30): 0xF8 is a | (b & c)
    const __m512i top = _mm512_set1_epi32(0x00300030);
    pair[0] = _mm512_ternarylogic_epi32(pair[0], _mm512_slli_epi32(plane, 4), top, 0xF8);
    pair[1] = _mm512_ternarylogic_epi32(pair[1], _mm512_srli_epi32(plane, 4), top, 0xF8);
    pair[2] = _mm512_ternarylogic_epi32(pair[2], _mm512_slli_epi32(plane, 2), top, 0xF8);
    pair[3] = _mm512_ternarylogic_epi32(pair[3], _mm512_srli_epi32(plane, 6), top, 0xF8);
  }
}

// Every chunk's pairs of one block, in order: f(c, pair) for c = 0..3.
template <int64_t Fmt, typename F>
inline void block_bf16_pairs(const uint8_t* q, F&& f) {
  __m512i pair[4];
  if constexpr (Fmt == kQ6_K) {
    for (int h = 0; h < 2; ++h) {
      const __m512i plane = load_once(q + 256 + 64 * h);
      bf16_pairs<Fmt>(q, 2 * h, plane, pair);  // fields 0, 1
      f(2 * h, pair);
      bf16_pairs<Fmt>(q, 2 * h + 1, _mm512_srli_epi32(plane, 4), pair);  // fields 2, 3
      f(2 * h + 1, pair);
    }
  } else {
    for (int c = 0; c < 4; ++c) {
      bf16_pairs<Fmt>(q, c, _mm512_setzero_si512(), pair);  // no plane
      f(c, pair);
    }
  }
}

template <int64_t Fmt, int MR>
inline void tile_bf16dot(const uint8_t* qs, const uint8_t* sc, int64_t B, const uint32_t* xp,
                         int64_t ldxp, const float* xsum, int64_t m0, float* out) {
  static_assert(is_q4(Fmt), "values of at most 6 bits");
  constexpr int H = split_halves(Fmt) ? 2 : 1;  // parts of a block under one scale
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint32_t* xb = xp + m0 * ldxp + b * (kBlock / 2);
    constexpr int C = MR * H <= 8 ? 2 : 1;  // chains per part, within 16 accumulators
    __m512 part[MR][H][C];                    // per half block
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < C; ++i) part[r][h][i] = _mm512_setzero_ps();
    if constexpr (MR == 1) prefetch_ahead<Fmt>(qs + b * qs_bytes(Fmt));
    block_bf16_pairs<Fmt>(qs + b * qs_bytes(Fmt), [&](int c, const __m512i (&pair)[4]) {
      const int h = H == 2 ? c / 2 : 0;
      for (int p = 0; p < 4; ++p)
        for (int r = 0; r < MR; ++r)
          part[r][h][p % C] = _mm512_dpbf16_ps(
              part[r][h][p % C], (__m512bh)pair[p],
              (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * ldxp + 4 * c + p])));
    });
    alignas(64) float D[2][16], M[2][16];
    block_scales<Fmt>(sc, b, D, M);
    const __m512 mn = has_min(Fmt) ? _mm512_load_ps(M[0]) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < H; ++h) {
        const float xs = xsum[((m0 + r) * B + b) * H + h];
        const __m512 chains = C == 2 ? _mm512_add_ps(part[r][h][0], part[r][h][C - 1])
                                     : part[r][h][0];
        const __m512 sum = _mm512_sub_ps(chains, _mm512_set1_ps((128.f + offset_of(Fmt)) * xs));
        acc[r] = _mm512_fmadd_ps(sum, _mm512_load_ps(D[h]), acc[r]);
        if constexpr (has_min(Fmt)) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs), acc[r]);
      }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kGroupRows, acc[r]);
}

#ifdef FOLIO_AMX
#define FOLIO_QUANT_AMX 1

// The AMX route: the bf16 route's pairs as tiles (and Q8_0's values converted to bf16).
// One block of a group's 16 weight rows is exactly one B tile (16 bf16 pairs along k x
// 16 rows: pair vector r of the block is tile row r) and 16 activation rows of `xp` are
// one A tile, so one `tdpbf16ps` does the
// block's 16 x 16 x 32 products (exact in float32, summed in float32 as the hardware
// orders them), and the per-block fix-up is the bf16 route's. Q6_K multiplies each half
// block (8 pairs) separately, as its scales are per 16 k.
//
// Tiles, Q4_0/Q4_1/Q4_K: two blocks at a time, tmm0 / tmm5 C [16 x 16 floats], tmm1 /
// tmm6 A [16 x 16 pairs], tmm2 / tmm7 B [16 pairs x 16] (two chains the hardware can
// overlap). Q6_K: tmm3 A [16 x 8 pairs], tmm4 / tmm6 B of each half [8 pairs x 16],
// tmm0 / tmm5 C.

// Loads the tile shapes for Fmt; each thread, before its first tile op of a call (the
// registers' shapes are per thread, and torch's own AMX GEMMs load theirs).
template <int64_t Fmt>
inline void amx_configure() {
  static const TileConfig config = [] {
    TileConfig c;
    if constexpr (split_halves(Fmt)) {
      for (int t : {0, 5}) c.shape(t, 16, 64);
      c.shape(3, 16, 32);
      for (int t : {4, 6}) c.shape(t, 8, 64);
    } else {
      for (int t : {0, 1, 2, 5, 6, 7}) c.shape(t, 16, 64);
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// A Q8_0 block's 16 B-tile rows: chunk c (k 4c..4c+3 of each row, as u = q + 128) gives
// rows 2c (k 4c, 4c + 2) and 2c + 1 (k 4c + 1, 4c + 3), the pairs of `xp`'s order, each
// value the bf16 of q itself (|q| <= 128: exact).
inline void q8_bf16_rows(const uint8_t* q, uint32_t* w) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const auto to_bf16 = [](const __m512i& v) {  // 32 int16 -> 32 bf16, in order
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  };
  for (int c = 0; c < 8; ++c) {
    const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * c), flip);  // q, signed
    _mm512_storeu_si512(w + (2 * c) * kGroupRows, to_bf16(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8)));
    _mm512_storeu_si512(w + (2 * c + 1) * kGroupRows, to_bf16(_mm512_srai_epi16(v, 8)));
  }
}

// Rows [0, M) of x against one group of 16 weight rows, into out [M][16]. `xp` holds
// M rounded up to 16 rows, the rows past M zero. The group's blocks are turned into B
// tiles once (`tiles`, B KB: L2-resident for any model's k), then each 16 rows of x
// meet all of them with their sums in registers.
template <int64_t Fmt>
inline void group_amx(const uint8_t* qs, const uint8_t* sc, int64_t B, const uint32_t* xp,
                      int64_t ldxp, const float* xsum, int64_t M, float* out,
                      std::vector<uint32_t>& tiles, std::vector<float>& scales) {
  constexpr int H = split_halves(Fmt) ? 2 : 1;
  constexpr int kTile = (kBlock / 2) * kGroupRows;  // 32-bit words per B tile
  const int64_t stride = ldxp * static_cast<int64_t>(sizeof(uint32_t));
  // per block and part: D, then E = M - (128 + offset) D, so that a part's sums p add
  // D p + E xs (M: Q4_1's and Q4_K's per-block minimum, else 0). Q8_0's tiles hold q
  // itself: no offset, no E.
  constexpr bool kHasE = is_q4(Fmt);
  constexpr float kOff = kHasE ? 128.f + offset_of(Fmt) : 0.f;
  tiles.resize(static_cast<size_t>(B * kTile));
  scales.resize(static_cast<size_t>(B * 2 * H * kGroupRows));
  for (int64_t b = 0; b < B; ++b) {
    uint32_t* w = tiles.data() + b * kTile;
    if constexpr (Fmt == kQ8_0) {
      q8_bf16_rows(qs + b * qs_bytes(Fmt), w);
    } else {
      block_bf16_pairs<Fmt>(qs + b * qs_bytes(Fmt), [&](int c, const __m512i (&pair)[4]) {
        for (int p = 0; p < 4; ++p) _mm512_storeu_si512(w + (4 * c + p) * kGroupRows, pair[p]);
      });
    }
    alignas(64) float D[2][16], Mn[2][16];
    block_scales<Fmt>(sc, b, D, Mn);
    float* s = scales.data() + b * 2 * H * kGroupRows;
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < kGroupRows; ++j) {
        s[2 * h * kGroupRows + j] = D[h][j];
        s[(2 * h + 1) * kGroupRows + j] = (has_min(Fmt) ? Mn[0][j] : 0.f) - kOff * D[h][j];
      }
  }
  alignas(64) float part[2][2][16][kGroupRows];  // [slot][block or half]
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - m0);
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    // a part's sums into acc: D p + E xs (the rows past M hold zeros: their xs stay 0)
    const auto add = [&](int64_t b, int h, const float (&p)[16][kGroupRows]) {
      const float* s = scales.data() + (b * 2 * H + 2 * h) * kGroupRows;
      const __m512 d = _mm512_loadu_ps(s), e = _mm512_loadu_ps(s + kGroupRows);
      for (int r = 0; r < 16; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(p[r]), d, acc[r]);
        if constexpr (kHasE) {
          const float xs = r < rows ? xsum[((m0 + r) * B + b) * H + h] : 0.f;
          acc[r] = _mm512_fmadd_ps(e, _mm512_set1_ps(xs), acc[r]);
        }
      }
    };
    // Tile products of `step` blocks from b on into buf: two blocks (Q6_K: the two
    // halves of one), one C tile each. They are issued one step ahead of the fix-ups
    // that read them, so a tile store has landed in L1 before its rows are loaded.
    constexpr int64_t step = H == 1 ? 2 : 1;
    const uint32_t* a = xp + m0 * ldxp;
    const auto issue = [&](int64_t b, float (&buf)[2][16][kGroupRows]) {
      const uint32_t* w = tiles.data() + b * kTile;
      const uint32_t* ab = a + b * (kBlock / 2);
      _tile_zero(0);
      if constexpr (H == 1) {
        _tile_loadd(2, w, 64);
        _tile_loadd(1, ab, stride);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, buf[0], 64);
        if (b + 1 < B) {
          _tile_zero(5);
          _tile_loadd(7, w + kTile, 64);
          _tile_loadd(6, ab + kBlock / 2, stride);
          _tile_dpbf16ps(5, 6, 7);
          _tile_stored(5, buf[1], 64);
        }
      } else {
        _tile_zero(5);
        _tile_loadd(4, w, 64);
        _tile_loadd(6, w + 8 * kGroupRows, 64);
        _tile_loadd(3, ab, stride);
        _tile_dpbf16ps(0, 3, 4);
        _tile_loadd(3, ab + 8, stride);
        _tile_dpbf16ps(5, 3, 6);
        _tile_stored(0, buf[0], 64);
        _tile_stored(5, buf[1], 64);
      }
    };
    issue(0, part[0]);
    for (int64_t b = 0; b < B; b += step) {
      const int slot = static_cast<int>((b / step) & 1);
      if (b + step < B) issue(b + step, part[slot ^ 1]);
      for (int i = 0; i < 2; ++i) {
        if constexpr (H == 1) {
          if (b + i < B) add(b + i, 0, part[slot][i]);
        } else {
          add(b, i, part[slot][i]);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(out + (m0 + r) * kGroupRows, acc[r]);
  }
}
#endif
#endif

// The stored unsigned value of row j, k-th element of block b's chunk data.
template <int64_t Fmt>
inline int32_t stored_at(const uint8_t* q, int j, int k) {
  if constexpr (is_q4(Fmt)) {
    const uint8_t byte = q[64 * (k / 8) + 4 * j + k % 4];
    int32_t u = (k % 8) < 4 ? byte & 15 : byte >> 4;
    if constexpr (Fmt == kQ6_K)  // k = 16h + 4f + t: bits 2f of plane h, byte 4j + t
      u |= ((q[256 + 64 * (k / 16) + 4 * j + k % 4] >> (2 * ((k % 16) / 4))) & 3) << 4;
    return u;
  } else {
    return q[64 * (k / 4) + 4 * j + k % 4];
  }
}

template <int64_t Fmt, int MR>
inline void tile_scalar(const uint8_t* qs, const uint8_t* sc, int64_t B,
                        const QuantizedRows& xr, int64_t m0, float* out) {
  const int64_t K = B * kBlock;
  float acc[MR][kGroupRows] = {};
  for (int64_t b = 0; b < B; ++b) {  // each output still sums its blocks in order
    alignas(64) float D[2][16], M[2][16];
    block_scales<Fmt>(sc, b, D, M);
    const uint8_t* q = qs + b * qs_bytes(Fmt);
    for (int r = 0; r < MR; ++r) {
      const int64_t row = m0 + r, i = row * B + b;
      const int8_t* x = xr.q.data() + row * K + b * kBlock;
      for (int j = 0; j < kGroupRows; ++j) {
        float& a = acc[r][j];
        int32_t p[2] = {0, 0};
        for (int k = 0; k < kBlock; ++k) p[k / 16] += stored_at<Fmt>(q, j, k) * x[k];
        if constexpr (split_halves(Fmt)) {
          for (int h = 0; h < 2; ++h)
            a = std::fma(static_cast<float>(p[h] - offset_of(Fmt) * xr.sum16[2 * i + h]),
                         D[h][j] * xr.scale[i], a);
          continue;
        }
        const int32_t pb = p[0] + p[1] - offset_of(Fmt) * xr.sum[i];
        a = std::fma(static_cast<float>(pb), D[0][j] * xr.scale[i], a);
        if constexpr (has_min(Fmt)) a = std::fma(M[0][j], xr.msum[i], a);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kGroupRows; ++j) out[r * kGroupRows + j] = acc[r][j];
}

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// Widening: each 32-bit lane of a chunk holds 4 (Q8) or 8 (Q4) k of one row; shifting
// and masking gives one k of all 16 rows as integers u, widened to float. Per block the
// weight is d * u + mn (mn = m for Q4_1, -8d or -128d undoing the others' offset), so
//
//   sum_k w_k x_k = d * sum_k u_k x_k + mn * sum_k x_k
//
// and only u * x is summed per k; xsum [rows][blocks] holds the blocks' sum_k x_k. With
// few rows one chain of dependent FMAs per row would bound the tile by FMA latency, not
// by reading the weights, so each row sums its block in P independent partial sums
// (about 8 chains in all: two FMA ports, four cycles each).
//
// A 4-bit (or Q6_K's 6-bit) value is not shifted down before it is widened: `v & (mask
// << s)` is u * 2^s, which converts to float exactly (at most 6 significant bits), and
// its activation is taken times 2^-s instead (per block, in `xs`). Both scalings are
// exact, so every product is the same float as u * x, bit for bit (unless |x| < 2^-98,
// where x * 2^-s would lose bits): one instruction less per k of 16 rows. Only a Q4
// lane's top nibble is still shifted without AVX-512 (`v >> 28`, no mask): AVX2 has
// no unsigned conversion, and so every value it converts stays positive as a signed
// int32. Measured (benchmarks/quant_tile_ab.py, one thread): with AVX-512 1.3x faster
// for Q4_K/Q4_1/Q4_0 and 1.1x for Q6_K; with AVX2 1.15x for Q4_1/Q4_0, 1.08x for Q4_K.
// Q8_0 measured no faster (its shifts were fewer) and still shifts.
// x is float32 [rows][ldx].
template <int64_t Fmt, int MR>
inline void tile_widen(const uint8_t* qs, const uint8_t* sc, int64_t B, const float* x,
                       int64_t ldx, const float* xsum, int64_t m0, float* out) {
  constexpr int P = MR >= 8 ? 1 : MR >= 4 ? 2 : 4;  // MR * P chains (MR = 1: 8 measured no faster)
  constexpr int per_chunk = is_q4(Fmt) ? 8 : 4;
  constexpr int chunks = kBlock / per_chunk;
  constexpr int H = split_halves(Fmt) ? 2 : 1;  // parts of a block under one scale
  constexpr bool kInPlace = is_q4(Fmt);  // values widened where they sit (see above)
  // where k's value sits in its 32-bit lane: byte k % 4 (Q4: the high nibble of k % 8 >= 4)
  constexpr auto bit_of = [](int k) {
    return is_q4(Fmt) && Fmt != kQ6_K ? 8 * (k % 4) + 4 * ((k % 8) / 4) : 8 * (k % 4);
  };
#if defined(__AVX512F__)
  constexpr int kTop = -1;  // none: vcvtudq2ps takes the top nibble where it sits
#else
  constexpr int kTop = 28;  // a Q4 lane's top nibble, shifted down (a sign bit otherwise)
#endif
  constexpr auto place_of = [bit_of](int k) {  // the power of two k's value is widened at
    return bit_of(k) == kTop ? 0 : bit_of(k);
  };
  // 2^-place_of(k) for the 32 k of a block, built at compile time (a loop here divided
  // 32 times per group of 16 rows: 6% of a 512-wide layer's tile on AVX2)
  struct Unshift { alignas(64) float v[kBlock]; };
  static constexpr Unshift unshift = [place_of] {
    Unshift u{};
    for (int k = 0; k < kBlock; ++k) u.v[k] = 1.f / static_cast<float>(1u << place_of(k));
    return u;
  }();
  alignas(64) float xs[MR][kBlock];
  // Without AVX-512 the sums per block go to `out` through memory: a v16f array held
  // across the loop over blocks went through general registers there (two ymm halves,
  // stored and rebuilt with vmovq/vpinsrq every block; 1.2x slower). With AVX-512 a v16f
  // is one zmm and stays in registers, as measured there.
#if defined(__AVX512F__)
  constexpr bool kAccInRegisters = true;
#else
  constexpr bool kAccInRegisters = false;
#endif
  v16f acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = v16f{};
  if constexpr (!kAccInRegisters) std::memset(out, 0, sizeof(float) * MR * kGroupRows);
  for (int64_t b = 0; b < B; ++b) {
    alignas(64) float D[2][16], M[2][16];
    block_scales<Fmt>(sc, b, D, M);
    const uint8_t* q = qs + b * qs_bytes(Fmt);
    if constexpr (MR == 1) prefetch_ahead<Fmt>(q);
    const float* xb = x + m0 * ldx + b * kBlock;
    // through a laundered pointer, so that each scaled x is read back as the broadcast
    // operand of its FMA (GCC had kept them in registers and broadcast them with vpermd)
    const float* xsp = xs[0];
    if constexpr (kInPlace) {
      for (int r = 0; r < MR; ++r)
        for (int k = 0; k < kBlock; ++k) xs[r][k] = xb[r * ldx + k] * unshift.v[k];
      asm("" : "+r"(xsp));
    }
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      v16f d, mn{};
      std::memcpy(&d, D[h], sizeof d);
      if constexpr (has_min(Fmt)) std::memcpy(&mn, M[0], sizeof mn);
      if constexpr (offset_of(Fmt) != 0) mn -= d * static_cast<float>(offset_of(Fmt));  // w = d u + mn
      v16f part[MR][P];
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < P; ++i) part[r][i] = v16f{};
      // one chunk's 8 (Q4) or 4 (Q8) k; Q6_K's chunk c takes fields f, f + 1 of its plane
      const auto chunk = [&](int c, const v16u& v, const v16u& top, int f) {
        v16u bytes[2];
        if constexpr (Fmt == kQ6_K) {
          // whole 6-bit values per byte, four k a lane, as the integer routes build them:
          // k = 8c + t = 16(c/2) + 4f + t%4, so field f + t/4 of the plane
          bytes[0] = (v & 0x0F0F0F0Fu) | (((top >> (2 * f)) & 0x03030303u) << 4);
          bytes[1] = ((v >> 4) & 0x0F0F0F0Fu) | (((top >> (2 * f + 2)) & 0x03030303u) << 4);
        }
#pragma GCC unroll 8
        for (int t = 0; t < per_chunk; ++t) {
          const int k = per_chunk * c + t;
          const v16u lane = Fmt == kQ6_K ? bytes[t / 4] : v;
          const uint32_t mask = is_q4(Fmt) && Fmt != kQ6_K ? 15u : 255u;
          if constexpr (kInPlace) {
            const v16u field = bit_of(t) == kTop ? lane >> kTop : lane & (mask << bit_of(t));
            v16f wk;
            if constexpr (kTop < 0) wk = __builtin_convertvector(field, v16f);
            else wk = __builtin_convertvector(__builtin_convertvector(field, v16i), v16f);
            for (int r = 0; r < MR; ++r) part[r][t % P] += wk * xsp[r * kBlock + k];
          } else {
            const v16u u = (lane >> bit_of(t)) & mask;
            const v16f wk = __builtin_convertvector(__builtin_convertvector(u, v16i), v16f);
            for (int r = 0; r < MR; ++r) part[r][t % P] += wk * xb[r * ldx + k];
          }
        }
      };
      if constexpr (Fmt == kQ6_K) {
        static_assert(chunks / H % 2 == 0, "a half block's chunks come in pairs");
        // chunks pair up on one 64-byte slice of the plane; literal field numbers keep
        // every shift a constant (a count that varied with c went through general
        // registers on AVX2). Unrolled whole: kept as a loop, GCC held the partial sums
        // in memory between iterations on AVX2 and moved them through general
        // registers, which took Q6_K's tile to 3.4x Q4_K's time there.
#pragma GCC unroll 4
        for (int c = h * chunks / H; c < (h + 1) * chunks / H; c += 2) {
          v16u v, next, top;
          std::memcpy(&v, q + 64 * c, sizeof v);
          std::memcpy(&next, q + 64 * (c + 1), sizeof next);
          std::memcpy(&top, q + 256 + 64 * (c / 2), sizeof top);
          chunk(c, v, top, 0);
          chunk(c + 1, next, top, 2);
        }
      } else {
        for (int c = h * chunks / H; c < (h + 1) * chunks / H; ++c) {
          v16u v, top{};
          std::memcpy(&v, q + 64 * c, sizeof v);
          chunk(c, v, top, 0);
        }
      }
      for (int r = 0; r < MR; ++r) {
        v16f sum = part[r][0];
        for (int i = 1; i < P; ++i) sum += part[r][i];
        const v16f add = sum * d + mn * xsum[((m0 + r) * B + b) * H + h];
        if constexpr (kAccInRegisters) {
          acc[r] += add;
        } else {
          v16f a;
          std::memcpy(&a, out + r * kGroupRows, sizeof a);
          a += add;
          std::memcpy(out + r * kGroupRows, &a, sizeof a);
        }
      }
    }
  }
  if constexpr (kAccInRegisters)
    for (int r = 0; r < MR; ++r) std::memcpy(out + r * kGroupRows, &acc[r], sizeof acc[r]);
}

}  // namespace folio::quant
