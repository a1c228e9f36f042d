// SwiGLU's activation, SiLU(gate) * up, in one pass over a fused gate/up projection.
//
// Per element, with T the activation dtype (kernels/silu_and_mul.py's reference):
//
//   act = T(gate / (1 + exp(-gate)))      in float32, as torch's SiLU computes it
//   out = T(act * up)                     a product of two T values, rounded once
//
// torch runs this as two ops (silu, then mul), each a full pass with its own output.
// The exponential is the one torch's vectorised SiLU calls (SLEEF's expf, 1.0-ulp,
// exported by libtorch_cpu), and the tail of a row shorter than torch's vector takes
// std::exp as torch's scalar loop does, so the bits equal torch's two ops: per row, torch
// runs whole pairs of its vectors through SLEEF and the rest through std::exp, and so
// does this kernel (built for the CPU's own vector width, which is the one torch
// dispatches to unless ATEN_CPU_CAPABILITY narrows it). Rows are split over torch's
// thread pool.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "cpu_vec.h"
#include "kernel_entries.h"

#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace folio {
namespace {

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr bool kHasSleef = true;

inline vec::vf exp_sleef(vec::vf x) {
#if defined(__AVX512F__)
  __m512 m;
  std::memcpy(&m, &x, sizeof m);
  m = Sleef_expf16_u10(m);
#else
  __m256 m;
  std::memcpy(&m, &x, sizeof m);
  m = Sleef_expf8_u10(m);
#endif
  std::memcpy(&x, &m, sizeof x);
  return x;
}
#else
constexpr bool kHasSleef = false;
inline vec::vf exp_sleef(vec::vf x) { return x; }  // never called
#endif

// torch's vectorised loops step by two of its Vectorized<T> (one is 64 bytes of T on
// AVX512, 32 on AVX2); what a row leaves over goes through the scalar lambda.
template <typename T>
constexpr int64_t torch_vector_size() {
  return static_cast<int64_t>(2 * vec::kLanes * sizeof(float) / sizeof(T));
}

template <typename T>
inline T silu_times(T g, T u) {
  const float gf = static_cast<float>(g);
  const T act = static_cast<T>(gf / (1.0f + std::exp(-gf)));
  return static_cast<T>(static_cast<float>(act) * static_cast<float>(u));
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t ld, T* out, int64_t rows, int64_t inter) {
  using vec::kLanes;
  using vec::vf;
  const int64_t step = torch_vector_size<T>();
  const int64_t whole = inter - inter % step;
  const vf one = vec::splat(1.0f);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * ld;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < whole; i += kLanes) {
        const vf x = vec::load(g + i);
        const vf act = vec::round_to<T>(x / (one + exp_sleef(-x)));
        vec::store(o + i, act * vec::load(u + i));
      }
      for (int64_t i = whole; i < inter; ++i) o[i] = silu_times(g[i], u[i]);
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be [rows, 2 * intermediate]");
  TORCH_CHECK(gate_up.stride(1) == 1, "silu_and_mul: gate_up's rows must be contiguous");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const auto dtype = gate_up.scalar_type();
  if (!silu_and_mul_takes(dtype)) {
    at::Tensor act = at::silu(gate_up.narrow(1, 0, inter));
    return act.mul_(gate_up.narrow(1, inter, inter));
  }
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  vec::with_element_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(gate_up.const_data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), rows,
                     inter);
  });
  return out;
}

bool silu_and_mul_takes(at::ScalarType dtype) {
  return kHasSleef && (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat);
}

void silu_and_mul_rows(const void* gate_up, void* out, int64_t rows, int64_t inter,
                       at::ScalarType dtype) {
  vec::with_element_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(static_cast<const T*>(gate_up), 2 * inter, static_cast<T*>(out), rows,
                     inter);
  });
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(folio, CPU, m) { m.impl("silu_and_mul", &folio::silu_and_mul); }
