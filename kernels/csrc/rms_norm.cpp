// RMS normalisation fused with the residual add before it, on the CPU.
//
// Per row, with T the activation dtype (the contract of kernels/rms_norm.py's reference):
//
//   x   = T(x + residual)                 the new residual, returned too
//   h   = T(x / sqrt(mean(x^2) + eps))    statistics in float32
//   out = T(weight * h)                   a product of two T values, rounded once
//
// One pass over each row instead of the reference's six torch ops (add, cast, square-
// mean, scale, cast, multiply), each a full pass over the activations with its own
// dispatch. Rows are split over torch's thread pool.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "cpu_vec.h"
#include "kernel_entries.h"

namespace folio {
namespace {

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));  // identity for float
}

// Whole vectors of a row go through cpu_vec.h (the same roundings as the scalar tail:
// c10's conversions), the last hidden % kLanes elements one by one.
template <typename T>
void norm_rows(const T* x, int64_t ldx, const T* res, int64_t ldr, const T* weight,
               T* out, T* res_out, int64_t rows, int64_t hidden, float eps) {
  using vec::kLanes;
  using vec::vf;
  const int64_t whole = vec::kVectorisable<T> ? hidden - hidden % kLanes : 0;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(hidden));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      vf ssv = vec::splat(0.f);
      if (res != nullptr) {
        const T* rr = res + r * ldr;
        T* ro = res_out + r * hidden;
        if constexpr (vec::kVectorisable<T>) {
          for (int64_t i = 0; i < whole; i += kLanes) {
            const vf sum = vec::round_to<T>(vec::load(xr + i) + vec::load(rr + i));
            vec::store(ro + i, sum);
            vec::store(row.data() + i, sum);
            ssv += sum * sum;
          }
        }
        for (int64_t i = whole; i < hidden; ++i) {
          const T sum = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          ro[i] = sum;
          row[i] = static_cast<float>(sum);
        }
      } else {
        if constexpr (vec::kVectorisable<T>) {
          for (int64_t i = 0; i < whole; i += kLanes) {
            const vf v = vec::load(xr + i);
            vec::store(row.data() + i, v);
            ssv += v * v;
          }
        }
        for (int64_t i = whole; i < hidden; ++i) row[i] = static_cast<float>(xr[i]);
      }
      float ss = vec::hsum(ssv);
      for (int64_t i = whole; i < hidden; ++i) ss += row[i] * row[i];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      const vf rv = vec::splat(rstd);
      if constexpr (vec::kVectorisable<T>) {
        for (int64_t i = 0; i < whole; i += kLanes)
          vec::store(o + i, vec::load(weight + i) *
                                vec::round_to<T>(vec::load(row.data() + i) * rv));
      }
      for (int64_t i = whole; i < hidden; ++i)
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(row[i] * rstd));
    }
  });
}

}  // namespace

// Returns (out, new_residual); new_residual is empty when no residual is given.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_in, const at::Tensor& weight,
                                            double eps,
                                            const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2, "rms_norm: x must be [rows, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x_in.size(1),
              "rms_norm: weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x_in.scalar_type(),
              "rms_norm: weight and x must share a dtype");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    TORCH_CHECK(residual->sizes() == x_in.sizes() &&
                    residual->scalar_type() == x_in.scalar_type(),
                "rms_norm: residual must match x");
  }
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor res =
      has_res ? (residual->stride(1) == 1 ? *residual : residual->contiguous()) : at::Tensor();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor res_out = has_res ? at::empty(x.sizes(), x.options()) : at::Tensor();
  const int64_t rows = x.size(0), hidden = x.size(1);
  if (rows == 0) return {out, res_out};  // (an undefined tensor returns as None)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0),
                        has_res ? res.const_data_ptr<scalar_t>() : nullptr,
                        has_res ? res.stride(0) : 0, w.const_data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(),
                        has_res ? res_out.data_ptr<scalar_t>() : nullptr, rows, hidden,
                        static_cast<float>(eps));
  });
  return {out, res_out};
}

void rms_norm_rows(const void* x, const void* residual, const void* weight, void* out,
                   void* residual_out, int64_t rows, int64_t hidden, float eps,
                   at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rms_norm_rows", [&] {
    norm_rows<scalar_t>(static_cast<const scalar_t*>(x), hidden,
                        static_cast<const scalar_t*>(residual), hidden,
                        static_cast<const scalar_t*>(weight), static_cast<scalar_t*>(out),
                        static_cast<scalar_t*>(residual_out), rows, hidden, eps);
  });
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual=None) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("rms_norm", &folio::rms_norm);
}
