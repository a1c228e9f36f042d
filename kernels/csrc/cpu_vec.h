// Small float32 vector toolkit for the CPU kernels: GCC vector extensions (one code
// path; g++ lowers `vf` to zmm, ymm or xmm registers for the target -march), element
// conversion of bf16/fp16 rows to float, and a vectorised exp for softmax.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace folio::vec {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

// kLanes consecutive elements as floats (unaligned loads; bf16/fp16 widened on the way).
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const c10::BFloat16* p) {
  // bf16 is the top half of a float32: zero-extend the bits and shift them up.
  vf v;
#if defined(__AVX512F__)
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  std::memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
  const __m256i w = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  std::memcpy(&v, &w, sizeof v);
#else
  typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t vw __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vw w = __builtin_convertvector(h, vw) << 16;
  std::memcpy(&v, &w, sizeof v);
#endif
  return v;
}

inline vf load(const c10::Half* p) {
  vf v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &f, sizeof v);
#elif defined(__AVX__) && defined(__F16C__)
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &f, sizeof v);
#else
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}

// fp8 (a quantized KV cache, scale 1.0) widens through the fp16 conversion. e5m2 is the
// top byte of an fp16. e4m3fn's sign, exponent and mantissa placed in an fp16's fields
// (s eeee mmm -> s 0eeee mmm0000000) read as the value times 2^(7 - 15): exponent bias
// 7 against fp16's 15, so one multiply by 2^8 restores it, subnormals included (e4m3fn's
// NaN, which the saturating store never writes, would read as a finite number).
inline vf load(const c10::Float8_e5m2* p) {
  c10::Half h[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    const uint16_t bits = static_cast<uint16_t>(p[i].x) << 8;
    std::memcpy(h + i, &bits, sizeof bits);
  }
  return load(h);
}

inline vf load(const c10::Float8_e4m3fn* p) {
  c10::Half h[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    const uint16_t b = p[i].x;
    const uint16_t bits = static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
    std::memcpy(h + i, &bits, sizeof bits);
  }
  return load(h) * 256.f;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// Storing kLanes floats as bf16 / fp16 rounds them as c10's scalar conversions do (to
// nearest, ties to even; a bf16 NaN becomes 0x7FC0), so vector and scalar code agree bit
// for bit.
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline vu bf16_bits(vf v) {  // the bf16 of each lane, in its low 16 bits
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (v != v) ? vu{} + 0x7FC0u : rounded;
}

inline void store(c10::BFloat16* p, vf v) {
  const vh h = __builtin_convertvector(bf16_bits(v), vh);
  std::memcpy(p, &h, sizeof h);
}

inline void store(c10::Half* p, vf v) {
#if defined(__AVX512F__)
  __m512 f;
  std::memcpy(&f, &v, sizeof f);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__AVX__) && defined(__F16C__)
  __m256 f;
  std::memcpy(&f, &v, sizeof f);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<c10::Half>(v[i]);
#endif
}

// The element types load() and store() take.
template <typename T>
constexpr bool kVectorisable = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                               std::is_same_v<T, c10::Half>;

// f(T{}) with T the element type of `dtype` among those: bf16, fp16, else float (the
// caller has checked that dtype is one of the three).
template <typename F>
inline void with_element_type(c10::ScalarType dtype, F&& f) {
  if (dtype == c10::ScalarType::BFloat16)
    f(c10::BFloat16{});
  else if (dtype == c10::ScalarType::Half)
    f(c10::Half{});
  else
    f(float{});
}

// v rounded to T and widened back: what storing it as T and loading it gives.
template <typename T>
inline vf round_to(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const vu u = bf16_bits(v) << 16;
    vf out;
    std::memcpy(&out, &u, sizeof out);
    return out;
  } else {
    T tmp[kLanes];
    store(tmp, v);
    return load(tmp);
  }
}

// x in every lane (x - 0 folds away; x + 0 would not, because of -0).
inline vf splat(float x) { return x - vf{}; }

inline float hsum(vf v) {
  // Fold to 4 lanes by 128-bit quarters (extract + add), then add those.
  v4 acc;
  std::memcpy(&acc, &v, sizeof acc);
  for (int i = 1; i < kLanes / 4; ++i) {
    v4 part;
    std::memcpy(&part, reinterpret_cast<const char*>(&v) + i * sizeof part, sizeof part);
    acc += part;
  }
  return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

// Sums of kLanes vectors at once: returns {hsum(d[0]), ..., hsum(d[kLanes-1])} in
// kLanes-1 shuffle-pair-and-add steps instead of kLanes separate reductions. Each level
// halves the lanes per vector that belong to one input: with groups of W lanes, output
// group i of fold_pair(a, b) is the sum of the two halves of group i of a ++ b.
template <int W, int Off, std::size_t... I>
constexpr vi fold_mask(std::index_sequence<I...>) {
  return vi{static_cast<int32_t>((int(I) / (W / 2)) * W + int(I) % (W / 2) + Off)...};
}

template <int W>
inline vf fold_pair(vf a, vf b) {
  constexpr vi lo = fold_mask<W, 0>(std::make_index_sequence<kLanes>{});
  constexpr vi hi = fold_mask<W, W / 2>(std::make_index_sequence<kLanes>{});
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

template <int W = kLanes>
inline vf transpose_sum(vf* d) {  // d[0..kLanes) is clobbered
  if constexpr (W == 1) {
    return d[0];
  } else {
    constexpr int count = W;  // vectors entering this level (W lanes per input each)
    for (int i = 0; i < count / 2; ++i) d[i] = fold_pair<W>(d[2 * i], d[2 * i + 1]);
    return transpose_sum<W / 2>(d);
  }
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = m > v[i] ? m : v[i];
  return m;
}

// exp(x) for x <= 0 (scores minus their running max). Range reduction x = n*ln2 + r,
// |r| <= ln2/2, a degree-6 polynomial for exp(r) (Cephes expf coefficients), and 2^n
// through the exponent bits. Relative error ~2e-7. x < -87 returns exactly 0, so
// -inf padding contributes nothing.
inline vf exp_nonpos(vf x) {
  const vf zero = splat(0.f);
  const vi too_small = x < -87.f;
  x = too_small ? splat(-87.f) : x;
  const vf t = x * 1.44269504088896341f + 0.5f;
  vf fn = __builtin_convertvector(__builtin_convertvector(t, vi), vf);  // trunc
  fn = fn > t ? fn - 1.f : fn;                                           // floor
  vf r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(fn, vi) + 127) << 23;
  vf pow2n;
  std::memcpy(&pow2n, &bits, sizeof pow2n);
  return too_small ? zero : p * pow2n;
}

// ---- rows of any storage dtype as float ----------------------------------------------

// A row of `n` elements as float: the row itself for float storage, else converted into
// `buf` (room for n floats).
inline const float* row_as_float(const float* src, float* /*buf*/, int64_t /*n*/) {
  return src;
}

inline const float* row_as_float(const c10::BFloat16* src, float* buf, int64_t n) {
  // bf16 is the top half of a float32: widen the bits (a loop g++ vectorises).
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(buf + i, &u, sizeof u);
  }
  return buf;
}

inline const float* row_as_float(const c10::Half* src, float* buf, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(h));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

inline const float* row_as_float(const c10::Float8_e4m3fn* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

inline const float* row_as_float(const c10::Float8_e5m2* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

}  // namespace folio::vec
