// The native kernels' entry points, for kernels that call others (decode_layer.cpp)
// without going back through the dispatcher. Each is defined in the file named beside
// it and registered there as folio::<name>; contracts are in the Python wrappers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace folio {

// half_linear.cpp: x @ weight.T (+ bias) for a bf16/fp16 [N, K] row-major weight.
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias);

// half_linear.cpp, half_linear a thread's share at a time: whether it takes `weight`;
// x [rows, k] widened into `buf` as it reads x; the weight's blocks [b0, b1) of 16 rows
// into y [rows, ldy] (+ bias, float32), rounded to `dtype` as half_linear rounds them.
bool half_linear_takes(const at::Tensor& weight);
void half_prepare_rows(const void* x, int64_t rows, int64_t k, at::ScalarType dtype,
                       at::ScalarType weight_dtype, std::vector<float>& buf);
void half_row_blocks(const float* x, int64_t rows, int64_t k, const void* weight, int64_t ldw,
                     at::ScalarType weight_dtype, const float* bias, int64_t b0, int64_t b1,
                     void* y, int64_t ldy, at::ScalarType dtype);

// amx_linear.cpp: x @ weight.T (+ bias) on AMX tiles for a bf16 [N, K] contiguous weight.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias);

// rms_norm.cpp: (out, new residual); the residual is undefined when none is given.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps,
                                            const c10::optional<at::Tensor>& residual);

// paged_attention_decode.cpp: one query token per request over its paged K/V; v_pass:
// 0 widened, 1 paired (a bf16 cache under bf16 queries, built with AVX512-BF16).
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, std::optional<int64_t> sliding_window,
                                  bool batch_invariant, int64_t v_pass);

// paged_attention_decode.cpp: one decode call's attention shared out among a team of
// threads that each call work() (decode_layer.cpp's one-row stack, which runs a step's
// layers in one parallel region). The operands are checked and the work items planned
// once, when it is built: every layer of a step has the same block tables and lengths,
// which must outlive it. Between two layers' work(), after every thread has returned
// from the first, one thread calls reset() before any calls the second. Same results
// as paged_attention_decode (not batch-invariant) at `team_size` threads.
class TeamAttention {
 public:
  TeamAttention(const at::Tensor& query, const at::Tensor& kv_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                std::optional<int64_t> sliding_window, int64_t team_size, int64_t v_pass);
  ~TeamAttention();
  void reset();
  // query [rows, heads, hd] in the query's dtype, cache as kv_cache, out like query
  void work(const void* query, const void* cache, void* out);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// silu_and_mul.cpp: SiLU(gate) * up for gate_up = [gate | up], [rows, 2 * inter].
at::Tensor silu_and_mul(const at::Tensor& gate_up);
// silu_and_mul.cpp: whether the native kernel takes `dtype` (else torch's ops run), and
// the kernel on contiguous rows of a dtype it takes, in place of tensors.
bool silu_and_mul_takes(at::ScalarType dtype);
void silu_and_mul_rows(const void* gate_up, void* out, int64_t rows, int64_t inter,
                       at::ScalarType dtype);

// rms_norm.cpp: rms_norm on contiguous rows of `dtype` in place of tensors (`residual`
// and `residual_out` null together: no residual; they may be the same rows).
void rms_norm_rows(const void* x, const void* residual, const void* weight, void* out,
                   void* residual_out, int64_t rows, int64_t hidden, float eps,
                   at::ScalarType dtype);

namespace quant {
struct Activations;  // quant_pack.h

// quant_linear.cpp, quant_linear on up to row_tile_rows() rows (one tile a row group),
// a thread's share at a time:
//  * row_route: the route quant_linear runs for `route` (its codes, 0: the best int8
//    one) on activations of `dtype` in format `fmt`, or -1 where it cannot run so (AMX:
//    tiles of 16 rows; a route not built for this CPU);
//  * prepare_rows: x [rows, k] as that route takes it, into `a` (each thread its own);
//  * quant_row_groups: the weight's row groups [g0, g1) (16 rows each) from `a`:
//    y[r, j] (+ bias[j], float32, y's rows ldy apart) in `dtype` for the rows j < n of
//    those groups, the same values as quant_linear's.
int64_t row_route(int64_t route, int64_t fmt, at::ScalarType dtype);
int64_t row_tile_rows();
void prepare_rows(int64_t route, int64_t fmt, const void* x, int64_t rows, int64_t k,
                  at::ScalarType dtype, Activations& a);
void quant_row_groups(const Activations& a, int64_t rows, const uint8_t* qs,
                      const uint8_t* scales, int64_t fmt, int64_t k, int64_t n,
                      const float* bias, int64_t route, int64_t g0, int64_t g1, void* y,
                      int64_t ldy, at::ScalarType dtype);
// quant_linear.cpp: quant_linear's checks of a packed weight for rows of k inputs.
void check_quant_weight(int64_t k, const at::Tensor& qs, const at::Tensor& scales,
                        int64_t fmt, int64_t n);

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
