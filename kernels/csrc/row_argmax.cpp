// Each row's argmax of a float32, bf16 or fp16 [rows, n] matrix, on the CPU: the
// sampler's greedy pick over a step's logits (worker/sampler.py). 16-bit values widen
// exactly to float, so a 16-bit row gives the index its float32 copy would.
//
// Same answer as torch's x.max(-1).indices: the first index of the row's maximum, a NaN
// counting as larger than any number (the first NaN wins). torch ran 32 rows of a
// 49152-token vocabulary on one thread; here rows are split over the pool, and a row
// takes two passes: its maximum in vector code (the row is then in L2), and the first
// index holding it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace folio {
namespace {

template <typename T>
int64_t argmax_of(const T* x, int64_t n) {
  using vec::kLanes;
  using vec::vf;
  const int64_t whole = n - n % kLanes;
  float best = -INFINITY;
  bool nan = false;
  if (whole > 0) {
    vf m = vec::load(x);
    vf unordered = m != m ? vec::splat(1.f) : vec::splat(0.f);
    for (int64_t i = kLanes; i < whole; i += kLanes) {
      const vf v = vec::load(x + i);
      m = v > m ? v : m;
      unordered = v != v ? vec::splat(1.f) : unordered;
    }
    best = vec::hmax(m);
    nan = vec::hmax(unordered) > 0.f;
  }
  for (int64_t i = whole; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    nan |= std::isnan(v);
    best = v > best ? v : best;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (nan ? std::isnan(v) : v == best) return i;
  }
  return 0;  // n == 0 never reaches here (checked by the caller)
}

}  // namespace

at::Tensor row_argmax(const at::Tensor& x_in) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "row_argmax: x must be a float32, bfloat16 or float16 [rows, n] CPU tensor");
  TORCH_CHECK(x_in.size(1) > 0, "row_argmax: rows must not be empty");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  vec::with_element_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_of(xp + r * n, n);
    });
  });
  return out;
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) { m.def("row_argmax(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(folio, CPU, m) { m.impl("row_argmax", &folio::row_argmax); }
