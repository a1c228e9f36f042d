// Rotate-half RoPE over one head, with torch's rounding points (kernels/rotary_embedding.py):
// each product is rounded to the activation dtype T, then the sum, as
// `x1 * cos - x2 * sin` does on T tensors. Shared by the fused decode layer and the
// prefill rotation (rotary_embedding.cpp).
#pragma once

#include <cstdint>

#include "cpu_vec.h"

namespace folio::rope {

template <typename T>
inline float r(float v) {  // round to T and back (identity for float)
  return static_cast<float>(static_cast<T>(v));
}

// torch rounds every product before the sum: the compiler must not contract a * b - c * d
// into a fused multiply-add (GCC does by default), or float32 results move by an ulp.
#define FOLIO_NO_FMA __attribute__((optimize("fp-contract=off")))

// out = [x1 * c - x2 * s | x2 * c + x1 * s] over one head of `half` pairs; whole vectors
// through cpu_vec.h, whose stores round as c10's conversions do, the rest one by one.
template <typename T>
FOLIO_NO_FMA inline void rotate(const T* x, const T* c, const T* s, int64_t half, T* out) {
  using vec::kLanes;
  using vec::round_to;
  int64_t i = 0;
  if constexpr (vec::kVectorisable<T>) {
    for (; i + kLanes <= half; i += kLanes) {
      const vec::vf a = vec::load(x + i), b = vec::load(x + half + i), ci = vec::load(c + i),
                    si = vec::load(s + i);
      vec::store(out + i, round_to<T>(a * ci) - round_to<T>(b * si));
      vec::store(out + half + i, round_to<T>(b * ci) + round_to<T>(a * si));
    }
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[i + half], ci = c[i], si = s[i];
    out[i] = static_cast<T>(r<T>(a * ci) - r<T>(b * si));
    out[i + half] = static_cast<T>(r<T>(b * ci) + r<T>(a * si));
  }
}

}  // namespace folio::rope
