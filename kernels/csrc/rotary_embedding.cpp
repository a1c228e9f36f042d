// Rotate-half RoPE of a step's queries and keys on the CPU (prefill chunks; decode rows
// rotate inside the fused decode layer). The contract is kernels/rotary_embedding.py's
// reference, bit for bit (rotary.h): torch's version is about a dozen ops a layer (chunk,
// eight products, add, subtract, concatenate), each a full pass with its own output.
// Tokens are split over torch's thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "cpu_vec.h"
#include "rotary.h"

namespace folio {
namespace {

// x [tokens, heads, hd] with heads contiguous in a token (any token stride) -> out,
// contiguous; cos/sin [tokens, 1, hd / 2] rows at `ld_angles`.
template <typename T>
void rotate_rows(const T* x, int64_t ld_x, const T* cos, const T* sin, int64_t ld_angles,
                 int64_t tokens, int64_t heads, int64_t hd, T* out) {
  const int64_t half = hd / 2;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * hd, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rope::rotate(x + t * ld_x + h * hd, cos + t * ld_angles, sin + t * ld_angles, half,
                     out + (t * heads + h) * hd);
  });
}

void check_operand(const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "rotary_embedding: ", name, " must be [tokens, heads, head_dim] with each "
              "token's heads contiguous");
  TORCH_CHECK(x.size(0) == cos.size(0) && x.size(2) == 2 * cos.size(2),
              "rotary_embedding: ", name, " and the angles disagree in shape");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type(),
              "rotary_embedding: ", name, " and the angles must share a dtype");
}

at::Tensor rotate_tensor(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotate_rows<scalar_t>(x.const_data_ptr<scalar_t>(), x.stride(0),
                          cos.const_data_ptr<scalar_t>(), sin.const_data_ptr<scalar_t>(),
                          cos.stride(0), x.size(0), x.size(1), x.size(2),
                          out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& query,
                                                    const at::Tensor& key,
                                                    const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  TORCH_CHECK(cos.dim() == 3 && cos.size(1) == 1 && cos.stride(2) == 1 &&
                  cos.sizes() == sin.sizes() && cos.strides() == sin.strides() &&
                  cos.scalar_type() == sin.scalar_type(),
              "rotary_embedding: cos and sin must be [tokens, 1, head_dim / 2] alike");
  check_operand(query, cos, "query");
  check_operand(key, cos, "key");
  return {rotate_tensor(query, cos, sin), rotate_tensor(key, cos, sin)};
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("rotary_embedding(Tensor query, Tensor key, Tensor cos, Tensor sin) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) { m.impl("rotary_embedding", &folio::rotary_embedding); }
