// The native kernels' entry points, for kernels that call others (decode_layer.cpp)
// without going back through the dispatcher. Each is defined in the file named beside
// it and registered there as folio::<name>; contracts are in the Python wrappers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace folio {

// half_linear.cpp: x @ weight.T (+ bias) for a bf16/fp16 [N, K] row-major weight.
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias);

// amx_linear.cpp: x @ weight.T (+ bias) on AMX tiles for a bf16 [N, K] contiguous weight.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias);

// rms_norm.cpp: (out, new residual); the residual is undefined when none is given.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps,
                                            const c10::optional<at::Tensor>& residual);

// paged_attention_decode.cpp: one query token per request over its paged K/V.
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, std::optional<int64_t> sliding_window,
                                  bool batch_invariant);

// silu_and_mul.cpp: SiLU(gate) * up for gate_up = [gate | up], [rows, 2 * inter].
at::Tensor silu_and_mul(const at::Tensor& gate_up);

namespace quant {
// quant_linear.cpp: x @ W.T (+ bias) for a packed block-quantized W through `route`.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                        int64_t fmt, int64_t n, const c10::optional<at::Tensor>& bias,
                        int64_t route);
// quant_linear.cpp: rows of W (all when `rows` is undefined) dequantised to `dtype`.
at::Tensor quant_dequantize(const at::Tensor& qs, const at::Tensor& scales, int64_t fmt,
                            int64_t n, const c10::optional<at::Tensor>& rows,
                            at::ScalarType dtype);
}  // namespace quant

}  // namespace folio
