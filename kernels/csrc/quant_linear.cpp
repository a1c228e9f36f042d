// y = x @ W.T for GGUF block-quantized W (Q4_0, Q4_1, Q8_0) kept quantized in memory,
// in the packed layout of quant_pack.h, computed by one of the routes of quant_tiles.h:
//
//   route 1  int8 dot products, AVX512-VNNI          (built when -march=native has it)
//   route 2  int8 dot products, AVX2 vpmaddubsw      (built on any AVX2 CPU)
//   route 3  int8 dot products, plain C++            (always built)
//   route 4  widening to float32 FMAs                (always built)
//   route 0  the best int8 route built here (1, else 2, else 3)
//
// Work split: threads take groups of 16 weight rows; each group meets the activation
// rows MR = 8 at a time, so its weights (about 6-15 KB for the default model's rows) are
// read from memory once and from L1 for the other rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "quant_tiles.h"

namespace folio::quant {
namespace {

constexpr int kMR = 8;
enum Route : int64_t { kBestInt8 = 0, kVnni512 = 1, kAvx2 = 2, kScalar = 3, kWiden = 4 };

std::vector<int64_t> built_routes() {
  std::vector<int64_t> routes;
#ifdef FOLIO_QUANT_VNNI512
  routes.push_back(kVnni512);
#endif
#ifdef FOLIO_QUANT_AVX2
  routes.push_back(kAvx2);
#endif
  routes.push_back(kScalar);
  routes.push_back(kWiden);
  return routes;
}

// Everything a tile needs besides its group and first row.
struct Operands {
  const uint8_t* qs;
  const c10::Half* scales;
  int64_t B;                   // blocks per row
  const QuantizedRows* xr;     // int8 routes
  const float* xf;             // widening route: float32 x [M][K]
};

template <int64_t Fmt, int MR>
void tile(int64_t route, const Operands& o, int64_t g, int64_t m0, float* acc) {
  const uint8_t* qs = o.qs + g * o.B * qs_bytes(Fmt);
  const c10::Half* sc = o.scales + g * o.B * scale_count(Fmt);
  switch (route) {
#ifdef FOLIO_QUANT_VNNI512
    case kVnni512: return tile_vnni512<Fmt, MR>(qs, sc, o.B, *o.xr, m0, acc);
#endif
#ifdef FOLIO_QUANT_AVX2
    case kAvx2: return tile_avx2<Fmt, MR>(qs, sc, o.B, *o.xr, m0, acc);
#endif
    case kWiden: return tile_widen<Fmt, MR>(qs, sc, o.B, o.xf, o.B * kBlock, m0, acc);
    default: return tile_scalar<Fmt, MR>(qs, sc, o.B, *o.xr, m0, acc);
  }
}

template <int64_t Fmt, int MR = kMR>
void tile_rows(int rows, int64_t route, const Operands& o, int64_t g, int64_t m0, float* acc) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<Fmt, MR - 1>(rows, route, o, g, m0, acc);
  }
  tile<Fmt, MR>(route, o, g, m0, acc);
}

template <typename O>
void store(const float* acc, int rows, int cols, const float* bias, O* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j)
      y[r * ldy + j] = static_cast<O>(acc[r * kGroupRows + j] + (bias ? bias[j] : 0.f));
}

template <int64_t Fmt, typename O>
void run(int64_t route, const Operands& o, int64_t M, int64_t N, const float* bias, O* y) {
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  const int64_t work = std::max<int64_t>(1, M * o.B * kBlock * kGroupRows);
  const int64_t grain = std::max<int64_t>(1, 65536 / work);  // ~64K multiply-adds a chunk
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMR * kGroupRows];
    for (int64_t g = begin; g < end; ++g) {
      const int cols = static_cast<int>(std::min<int64_t>(kGroupRows, N - g * kGroupRows));
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, M - m0));
        tile_rows<Fmt>(rows, route, o, g, m0, acc);
        store(acc, rows, cols, bias ? bias + g * kGroupRows : nullptr,
              y + m0 * N + g * kGroupRows, N);
      }
    }
  });
}

template <typename O>
void run_format(int64_t fmt, int64_t route, const Operands& o, int64_t M, int64_t N,
                const float* bias, O* y) {
  if (fmt == kQ4_0) return run<kQ4_0>(route, o, M, N, bias, y);
  if (fmt == kQ4_1) return run<kQ4_1>(route, o, M, N, bias, y);
  return run<kQ8_0>(route, o, M, N, bias, y);
}

void check_operands(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                    int64_t fmt, int64_t n, int64_t route) {
  TORCH_CHECK(fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0,
              "quant_linear: format must be Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "quant_linear: x must be [M, K] float");
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(2) == qs_bytes(fmt),
              "quant_linear: qs must be contiguous uint8 [groups, blocks, chunk bytes]");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous() && scales.size(2) == scale_count(fmt) &&
                  scales.size(0) == qs.size(0) && scales.size(1) == qs.size(1),
              "quant_linear: scales must be contiguous fp16 [groups, blocks, 16 or 32]");
  TORCH_CHECK(x.size(1) == qs.size(1) * kBlock, "quant_linear: x is [M, K], K = 32 * blocks");
  TORCH_CHECK(n > (qs.size(0) - 1) * kGroupRows && n <= qs.size(0) * kGroupRows,
              "quant_linear: n does not match the number of row groups");
  const auto routes = built_routes();
  TORCH_CHECK(route == kBestInt8 || std::find(routes.begin(), routes.end(), route) != routes.end(),
              "quant_linear: route ", route, " is not built for this CPU");
}

// x [M, K] float32/bf16/fp16; returns x @ W.T (+ bias) [M, n] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& scales,
                        int64_t fmt, int64_t n, const c10::optional<at::Tensor>& bias,
                        int64_t route) {
  check_operands(x_in, qs, scales, fmt, n, route);
  if (route == kBestInt8) route = built_routes().front();
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  at::Tensor bias_f, xf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "quant_linear: bias must be [n]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  thread_local QuantizedRows xr;  // the caller's thread prepares x
  Operands o{qs.const_data_ptr<uint8_t>(), scales.const_data_ptr<c10::Half>(), qs.size(1),
             &xr, nullptr};
  if (route == kWiden) {
    xf = x.to(at::kFloat).contiguous();
    o.xf = xf.const_data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear", [&] {
    if (route != kWiden) quantize_rows(x.const_data_ptr<scalar_t>(), x.stride(0), M, K, xr);
    run_format(fmt, route, o, M, n, bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr,
               out.data_ptr<scalar_t>());
  });
  return out;
}

std::vector<int64_t> quant_routes() { return built_routes(); }

}  // namespace
}  // namespace folio::quant

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("quant_linear(Tensor x, Tensor qs, Tensor scales, int fmt, int n, Tensor? bias=None, "
        "int route=0) -> Tensor");
  m.def("quant_routes() -> int[]", &folio::quant::quant_routes);
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("quant_linear", &folio::quant::quant_linear);
}
