// y = x @ W.T for GGUF block-quantized W (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) kept quantized,
// in the packed layout of quant_pack.h, computed by one of the routes of quant_tiles.h:
//
//   route 1  int8 dot products, AVX512-VNNI          (built when -march=native has it)
//   route 2  int8 dot products, AVX2 vpmaddubsw      (built on any AVX2 CPU)
//   route 3  int8 dot products, plain C++            (always built)
//   route 4  widening to float32 FMAs                (always built)
//   route 5  bf16 pairs into `vdpbf16ps`              (built when -march=native has
//            AVX512-BF16; Q4_0/Q4_1/Q4_K/Q6_K with bf16 activations, else route 4)
//   route 6  route 5 on AMX tiles, `tdpbf16ps`       (built when -march=native has
//            AMX-BF16 and the kernel grants this process the tile state; every
//            format (Q8_0 converted to bf16, exactly) with bf16 activations, else
//            route 4)
//   route 7  int16 activations, AVX2 vpmaddwd         (built on any AVX2 CPU; Q4_0, Q4_1,
//            Q4_K and Q8_0, else route 4)
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

#include "kernel_entries.h"
#include "scratch.h"
#include "quant_tiles.h"

namespace folio::quant {
namespace {

#ifndef FOLIO_QUANT_MR
#define FOLIO_QUANT_MR 8
#endif
constexpr int kMR = FOLIO_QUANT_MR;  // activation rows per tile
enum Route : int64_t {
  kBestInt8 = 0, kVnni512 = 1, kAvx2 = 2, kScalar = 3, kWiden = 4, kBf16Dot = 5, kAmx = 6,
  kInt16 = 7
};

// The routes built for this CPU, best int8 route first; fixed for the process (AMX's
// permission is asked once), so listed once: the row stack asks per layer a step.
const std::vector<int64_t>& built_routes() {
  static const std::vector<int64_t> built = [] {
    std::vector<int64_t> routes;
#ifdef FOLIO_QUANT_VNNI512
    routes.push_back(kVnni512);
#endif
#ifdef FOLIO_QUANT_AVX2
    routes.push_back(kAvx2);
#endif
    routes.push_back(kScalar);
    routes.push_back(kWiden);
#ifdef FOLIO_QUANT_AVX2
    routes.push_back(kInt16);
#endif
#ifdef FOLIO_QUANT_BF16DOT
    routes.push_back(kBf16Dot);
#endif
#ifdef FOLIO_QUANT_AMX
    if (amx_permitted()) routes.push_back(kAmx);
#endif
    return routes;
  }();
  return built;
}

// Everything a tile needs besides its group and first row.
struct Operands {
  const uint8_t* qs;
  const uint8_t* scales;       // fp16 per block, or the K-quants' records (quant_pack.h)
  int64_t B;                   // blocks per row
  const QuantizedRows* xr;     // int8 routes
  const float* xf;             // widening route: float32 x [M][K]
  const float* xsum;           // widening and bf16 routes: x summed per block [M][B]
                               // (Q6_K: per half block, [M][B][2])
  const uint32_t* xp;          // bf16 route: x's bf16 pairs in tile order [M][K / 2]
  const Int16Rows* x16;        // int16 route
};

template <int64_t Fmt, int MR>
void tile(int64_t route, const Operands& o, int64_t g, int64_t m0, float* acc, bool ahead) {
  const uint8_t* qs = o.qs + g * o.B * qs_bytes(Fmt);
  const uint8_t* sc = o.scales + g * group_scale_bytes(Fmt, o.B);
  switch (route) {
#ifdef FOLIO_QUANT_VNNI512
    case kVnni512:
      return tile_vnni512<Fmt, MR>(qs, sc, o.B, *o.xr, m0, acc,
                                   ahead ? qs + o.B * qs_bytes(Fmt) : nullptr);
#endif
#ifdef FOLIO_QUANT_AVX2
    case kAvx2: return tile_avx2<Fmt, MR>(qs, sc, o.B, *o.xr, m0, acc);
    case kInt16:
      if constexpr (Fmt != kQ6_K) return tile_int16<Fmt, MR>(qs, sc, o.B, *o.x16, m0, acc);
      return;  // never chosen for Q6_K (quant_linear)
#endif
    case kWiden: return tile_widen<Fmt, MR>(qs, sc, o.B, o.xf, o.B * kBlock, o.xsum, m0, acc);
#ifdef FOLIO_QUANT_BF16DOT
    case kBf16Dot:
      if constexpr (is_q4(Fmt))
        return tile_bf16dot<Fmt, MR>(qs, sc, o.B, o.xp, o.B * kBlock / 2, o.xsum, m0, acc);
      return;  // never chosen for other formats (quant_linear)
#endif
    default: return tile_scalar<Fmt, MR>(qs, sc, o.B, *o.xr, m0, acc);
  }
}

template <int64_t Fmt, int MR = kMR>
void tile_rows(int rows, int64_t route, const Operands& o, int64_t g, int64_t m0, float* acc,
               bool ahead) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<Fmt, MR - 1>(rows, route, o, g, m0, acc, ahead);
  }
  tile<Fmt, MR>(route, o, g, m0, acc, ahead);
}

// x's sums per block of 32 (Q6_K: per half block, its scales' unit), [M][B] or
// [M][B][2], into `out`, in float32 in k order; returns out's data.
template <typename T>
const float* block_sums(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t fmt,
                        std::vector<float>& out) {
  const int64_t span = fmt == kQ6_K ? kBlock / 2 : kBlock, parts = K / span;
  out.resize(static_cast<size_t>(M * parts));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < parts; ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < span; ++k) s += static_cast<float>(x[m * ldx + i * span + k]);
      out[m * parts + i] = s;
    }
  return out.data();
}

// Rows [0, rows) of a [rows][ldb] float buffer, columns [0, cols), into y (+ bias).
template <typename O>
void store(const float* buf, int64_t ldb, int64_t rows, int64_t cols, const float* bias,
           O* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      y[r * ldy + j] = static_cast<O>(buf[r * ldb + j] + (bias ? bias[j] : 0.f));
}

// Groups [g0, g1) against all M rows: tiles land in `buf` [M][span], which is then
// written out row by row. Storing each tile straight into y would keep M rows of y
// open at once, N apart: for the LM head (N = 49152, a multiple of 4096) those lines
// all fall in a few cache sets and evict each other, which measured 2.5x slower at 64
// rows; written row by row, each line of y is written once, whole.
template <int64_t Fmt, typename O>
void run_groups(int64_t route, const Operands& o, int64_t M, int64_t N, int64_t g0,
                int64_t g1, const float* bias, O* y, std::vector<float>& buf) {
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  const int64_t span = (g1 - g0) * kGroupRows;
  buf.resize(static_cast<size_t>(M * span));
  bool done = false;  // the AMX route takes all M rows of a group at once
#ifdef FOLIO_QUANT_AMX
  if (route == kAmx) {
    thread_local std::vector<float> rows_out, scales;
    thread_local std::vector<uint32_t> tiles;
    rows_out.resize(static_cast<size_t>(M * kGroupRows));
    for (int64_t g = g0; g < g1; ++g) {
      group_amx<Fmt>(o.qs + g * o.B * qs_bytes(Fmt), o.scales + g * group_scale_bytes(Fmt, o.B),
                     o.B, o.xp, o.B * kBlock / 2, o.xsum, M, rows_out.data(), tiles, scales);
      store(rows_out.data(), kGroupRows, M, kGroupRows, nullptr,
            buf.data() + (g - g0) * kGroupRows, span);
    }
    done = true;
  }
#endif
  alignas(64) float acc[kMR * kGroupRows];
  for (int64_t g = g0; g < g1 && !done; ++g) {
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, M - m0));
      // the last tile of a group that had others prefetches the next group: re-reading
      // this one from cache stops the hardware prefetcher (Q8_0 ran at half speed)
      const bool ahead = m0 > 0 && m0 + kMR >= M && g + 1 < groups;
      tile_rows<Fmt>(rows, route, o, g, m0, acc, ahead);
      store(acc, kGroupRows, rows, kGroupRows, nullptr,
            buf.data() + m0 * span + (g - g0) * kGroupRows, span);
    }
  }
  const int64_t cols = std::min(span, N - g0 * kGroupRows);
  store(buf.data(), span, M, cols, bias ? bias + g0 * kGroupRows : nullptr,
        y + g0 * kGroupRows, N);
}

template <int64_t Fmt, typename O>
void run(int64_t route, const Operands& o, int64_t M, int64_t N, const float* bias, O* y) {
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  // one tile of rows: groups go straight out; more: 4 groups (64 columns) at a time;
  // AMX: 2, so that a 576-row layer's 36 groups split evenly between two threads
  const int64_t per_item = route == kAmx ? 2 : M > kMR ? 4 : 1;
  const int64_t items = (groups + per_item - 1) / per_item;
  const int64_t work = std::max<int64_t>(1, M * o.B * kBlock * kGroupRows * per_item);
  const int64_t grain = std::max<int64_t>(1, 65536 / work);  // ~64K multiply-adds a chunk
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
#ifdef FOLIO_QUANT_AMX
    if (route == kAmx) amx_configure<Fmt>();
#endif
    for (int64_t i = begin; i < end; ++i)
      run_groups<Fmt>(route, o, M, N, i * per_item, std::min(groups, (i + 1) * per_item),
                      bias, y, buf);
#ifdef FOLIO_QUANT_AMX
    if (route == kAmx) _tile_release();
#endif
  });
}

template <typename O>
void run_format(int64_t fmt, int64_t route, const Operands& o, int64_t M, int64_t N,
                const float* bias, O* y) {
  if (fmt == kQ4_0) return run<kQ4_0>(route, o, M, N, bias, y);
  if (fmt == kQ4_1) return run<kQ4_1>(route, o, M, N, bias, y);
  if (fmt == kQ4_K) return run<kQ4_K>(route, o, M, N, bias, y);
  if (fmt == kQ6_K) return run<kQ6_K>(route, o, M, N, bias, y);
  return run<kQ8_0>(route, o, M, N, bias, y);
}

// The packed weight against K inputs (x's row length) and `route`.
void check_weight(int64_t K, const at::Tensor& qs, const at::Tensor& scales, int64_t fmt,
                  int64_t n, int64_t route) {
  TORCH_CHECK(fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0 || fmt == kQ4_K || fmt == kQ6_K,
              "quant_linear: format must be Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12) or Q6_K (14)");
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(2) == qs_bytes(fmt),
              "quant_linear: qs must be contiguous uint8 [groups, blocks, chunk bytes]");
  if (is_k(fmt)) {
    TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kByte &&
                    scales.is_contiguous() && scales.size(2) == k_scale_bytes(fmt) &&
                    scales.size(0) == qs.size(0) && scales.size(1) * kSuperBlocks == qs.size(1),
                "quant_linear: K-quant scales must be contiguous uint8 [groups, blocks / 8, ",
                k_scale_bytes(fmt), "]");
  } else {
    TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kHalf &&
                    scales.is_contiguous() && scales.size(2) == scale_count(fmt) &&
                    scales.size(0) == qs.size(0) && scales.size(1) == qs.size(1),
                "quant_linear: scales must be contiguous fp16 [groups, blocks, 16 or 32]");
  }
  TORCH_CHECK(K == qs.size(1) * kBlock, "quant_linear: x is [M, K], K = 32 * blocks");
  TORCH_CHECK(n > (qs.size(0) - 1) * kGroupRows && n <= qs.size(0) * kGroupRows,
              "quant_linear: n does not match the number of row groups");
  const auto& routes = built_routes();
  TORCH_CHECK(route == kBestInt8 || std::find(routes.begin(), routes.end(), route) != routes.end(),
              "quant_linear: route ", route, " is not built for this CPU");
}

void check_operands(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                    int64_t fmt, int64_t n, int64_t route) {
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "quant_linear: x must be [M, K] float");
  check_weight(x.size(1), qs, scales, fmt, n, route);
}

// The route that `route` runs for x of `dtype` in format `fmt`: the best int8 route for
// 0; the bf16 routes take bf16 activations (vdpbf16ps: not Q8_0) and the int16 route not
// Q6_K, each computing the same product as the widening route, which runs instead.
int64_t resolve_route(int64_t route, int64_t fmt, at::ScalarType dtype) {
  if (route == kBestInt8) route = built_routes().front();
  if ((route == kBf16Dot || route == kAmx) && dtype != at::kBFloat16) route = kWiden;
  if (route == kBf16Dot && fmt == kQ8_0) route = kWiden;
  if (route == kInt16 && fmt == kQ6_K) route = kWiden;
  return route;
}

// x [M, K] (rows ldx apart) as `route` takes it, into `a`; the Operands over it.
template <typename T>
Operands prepare(int64_t route, int64_t fmt, const T* x, int64_t ldx, int64_t M, int64_t K,
                 const uint8_t* qs, const uint8_t* scales, Activations& a) {
  Operands o{qs, scales, K / kBlock, &a.xr, nullptr, nullptr, nullptr, &a.x16};
  if (route == kBf16Dot || route == kAmx) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {  // (resolve_route: bf16 only)
      // per chunk of 8 k the pairs (0, 2), (1, 3), (4, 6), (5, 7), low half first
      // (quant_tiles.h, tile_bf16dot); the block sums in float32, as the widening
      // route's. AMX tiles take 16 rows at a time: the rows past M are zero.
      const int64_t padded = route == kAmx ? (M + 15) / 16 * 16 : M;
      a.xp.resize(static_cast<size_t>(padded * K / 2));
      std::fill(a.xp.begin() + M * K / 2, a.xp.end(), 0u);
      constexpr int kLow[4] = {0, 1, 4, 5};
      for (int64_t m = 0; m < M; ++m) {
        const T* row = x + m * ldx;
        for (int64_t c = 0; c < K / 8; ++c)
          for (int p = 0; p < 4; ++p)
            a.xp[m * K / 2 + 4 * c + p] =
                row[8 * c + kLow[p]].x | (static_cast<uint32_t>(row[8 * c + kLow[p] + 2].x) << 16);
      }
      o.xp = a.xp.data();
      o.xsum = block_sums(x, ldx, M, K, fmt, a.xsum);
    }
  } else if (route == kWiden) {
    if constexpr (std::is_same_v<T, float>) {
      if (ldx == K) o.xf = x;  // already what the route reads
    }
    if (o.xf == nullptr) {
      a.xf.resize(static_cast<size_t>(M * K));
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) a.xf[m * K + k] = static_cast<float>(x[m * ldx + k]);
      o.xf = a.xf.data();
    }
    o.xsum = block_sums(o.xf, K, M, K, fmt, a.xsum);
#ifdef FOLIO_QUANT_AVX2
  } else if (route == kInt16) {
    quantize_rows16(x, ldx, M, K, fmt == kQ8_0, a.x16);
#endif
  } else {  // the int8 routes
    quantize_rows(x, ldx, M, K, a.xr);
  }
  return o;
}

}  // namespace

// x [M, K] float32/bf16/fp16; returns x @ W.T (+ bias) [M, n] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& scales,
                        int64_t fmt, int64_t n, const c10::optional<at::Tensor>& bias,
                        int64_t route) {
  check_operands(x_in, qs, scales, fmt, n, route);
  route = resolve_route(route, fmt, x_in.scalar_type());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "quant_linear: bias must be [n]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  thread_local Activations acts;  // the caller's thread prepares x
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear", [&] {
    const Operands o = prepare(route, fmt, x.const_data_ptr<scalar_t>(), x.stride(0), M, K,
                               qs.const_data_ptr<uint8_t>(),
                               static_cast<const uint8_t*>(scales.const_data_ptr()), acts);
    run_format(fmt, route, o, M, n, bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr,
               out.data_ptr<scalar_t>());
  });
  release_if_large(acts.xp);
  release_if_large(acts.xf);
  release_if_large(acts.xsum);
  release_if_large(acts.xr.q);
  release_if_large(acts.x16.w);
  return out;
}

// Row `row` of the weight as floats: D * (u - offset) + M, u as stored.
template <int64_t Fmt, typename O>
void dequantize_row(const uint8_t* qs, const uint8_t* sc, int64_t B, int64_t row, O* out) {
  const int64_t g = row / kGroupRows;
  const int j = static_cast<int>(row % kGroupRows);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* q = qs + (g * B + b) * qs_bytes(Fmt);
    alignas(64) float D[2][16], M[2][16];
    block_scales<Fmt>(sc + g * group_scale_bytes(Fmt, B), b, D, M);
    for (int k = 0; k < kBlock; ++k) {
      const float w = static_cast<float>(stored_at<Fmt>(q, j, k) - offset_of(Fmt)) *
                      D[split_halves(Fmt) ? k / 16 : 0][j];
      out[b * kBlock + k] = static_cast<O>(has_min(Fmt) ? w + M[0][j] : w + 0.f);
    }
  }
}

// The weight's rows `rows` (all rows when undefined) as `dtype`: embedding lookups and
// the dequantise-then-GEMM path. Same values as kernels/quant_linear.py's dequantize.
at::Tensor quant_dequantize(const at::Tensor& qs, const at::Tensor& scales, int64_t fmt,
                            int64_t n, const c10::optional<at::Tensor>& rows_in,
                            at::ScalarType dtype) {
  check_weight(qs.size(1) * kBlock, qs, scales, fmt, n, kBestInt8);
  const int64_t B = qs.size(1);
  const at::Tensor rows = rows_in.has_value() && rows_in->defined()
                              ? rows_in->to(at::kLong).contiguous().view(-1)
                              : at::arange(n, at::kLong);
  const int64_t* r = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < n, "quant_dequantize: row ", r[i], " out of range");
  at::Tensor out = at::empty({rows.numel(), B * kBlock}, at::TensorOptions().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quant_dequantize", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const uint8_t* q = qs.const_data_ptr<uint8_t>();
    const uint8_t* sc = static_cast<const uint8_t*>(scales.const_data_ptr());
    at::parallel_for(0, rows.numel(), 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* row_out = o + i * B * kBlock;
        if (fmt == kQ4_0) dequantize_row<kQ4_0>(q, sc, B, r[i], row_out);
        else if (fmt == kQ4_1) dequantize_row<kQ4_1>(q, sc, B, r[i], row_out);
        else if (fmt == kQ4_K) dequantize_row<kQ4_K>(q, sc, B, r[i], row_out);
        else if (fmt == kQ6_K) dequantize_row<kQ6_K>(q, sc, B, r[i], row_out);
        else dequantize_row<kQ8_0>(q, sc, B, r[i], row_out);
      }
    });
  });
  return out;
}

std::vector<int64_t> quant_routes() { return built_routes(); }

void check_quant_weight(int64_t k, const at::Tensor& qs, const at::Tensor& scales,
                        int64_t fmt, int64_t n) {
  check_weight(k, qs, scales, fmt, n, kBestInt8);
}

int64_t row_route(int64_t route, int64_t fmt, at::ScalarType dtype) {
  const auto& routes = built_routes();
  if (route != kBestInt8 && std::find(routes.begin(), routes.end(), route) == routes.end())
    return -1;
  route = resolve_route(route, fmt, dtype);
  return route == kAmx ? -1 : route;  // (AMX: whole tiles of 16 rows)
}

void prepare_rows(int64_t route, int64_t fmt, const void* x, int64_t rows, int64_t k,
                  at::ScalarType dtype, Activations& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "prepare_rows", [&] {
    const scalar_t* xs = static_cast<const scalar_t*>(x);
    const Operands o = prepare(route, fmt, xs, k, rows, k, nullptr, nullptr, a);
    if (route == kWiden && o.xf == static_cast<const void*>(xs))  // keep a copy: x changes
      a.xf.assign(o.xf, o.xf + rows * k);
  });
}

namespace {
template <int64_t Fmt, typename O>
void row_groups(const Operands& o, int rows, int64_t n, const float* bias, int64_t route,
                int64_t g0, int64_t g1, O* y, int64_t ldy) {
  alignas(64) float acc[kMR * kGroupRows];
  for (int64_t g = g0; g < g1; ++g) {
    tile_rows<Fmt>(rows, route, o, g, 0, acc, false);
    // the roundings of run_groups at up to kMR rows (one tile a group): the tile into a
    // float buffer (+ 0.f), then (+ bias, or + 0.f) into y
    const int64_t cols = std::min<int64_t>(kGroupRows, n - g * kGroupRows);
    for (int r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        const float v = acc[r * kGroupRows + j] + 0.f;
        y[r * ldy + g * kGroupRows + j] =
            static_cast<O>(v + (bias ? bias[g * kGroupRows + j] : 0.f));
      }
  }
}
}  // namespace

void quant_row_groups(const Activations& a, int64_t rows, const uint8_t* qs,
                      const uint8_t* scales, int64_t fmt, int64_t k, int64_t n,
                      const float* bias, int64_t route, int64_t g0, int64_t g1, void* y,
                      int64_t ldy, at::ScalarType dtype) {
  TORCH_CHECK(rows >= 1 && rows <= kMR, "quant_row_groups: 1 to ", kMR, " rows");
  const Operands o{qs,          scales,          k / kBlock,    &a.xr,
                   a.xf.data(), a.xsum.data(),   a.xp.data(),   &a.x16};
  const int m = static_cast<int>(rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quant_row_groups", [&] {
    scalar_t* out = static_cast<scalar_t*>(y);
    if (fmt == kQ4_0) row_groups<kQ4_0>(o, m, n, bias, route, g0, g1, out, ldy);
    else if (fmt == kQ4_1) row_groups<kQ4_1>(o, m, n, bias, route, g0, g1, out, ldy);
    else if (fmt == kQ4_K) row_groups<kQ4_K>(o, m, n, bias, route, g0, g1, out, ldy);
    else if (fmt == kQ6_K) row_groups<kQ6_K>(o, m, n, bias, route, g0, g1, out, ldy);
    else row_groups<kQ8_0>(o, m, n, bias, route, g0, g1, out, ldy);
  });
}

int64_t row_tile_rows() { return kMR; }

}  // namespace folio::quant

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("quant_linear(Tensor x, Tensor qs, Tensor scales, int fmt, int n, Tensor? bias=None, "
        "int route=0) -> Tensor");
  m.def("quant_routes() -> int[]", &folio::quant::quant_routes);
  m.def("quant_dequantize(Tensor qs, Tensor scales, int fmt, int n, Tensor? rows, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("quant_linear", &folio::quant::quant_linear);
  m.impl("quant_dequantize", &folio::quant::quant_dequantize);
}
