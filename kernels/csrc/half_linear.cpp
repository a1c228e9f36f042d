// y = x @ W.T for 16-bit (bf16 / fp16) weights on a CPU without 16-bit arithmetic.
//
// Such a CPU (AVX-512F without AVX512-BF16 / AVX512-FP16) has no 16-bit multiply, so
// every product is a float32 one whatever library runs it; the question is only where
// the widening happens. torch's native bf16 GEMM widens small operand tiles inside a
// generic kernel and runs at a fraction of the float32 rate; widening the whole weight
// per call writes and reads a full float32 copy of it. This kernel widens in registers,
// right after loading 16 weights, so the weight is read from memory once, at 2 bytes an
// element: at the few rows of a decode step, which are bound by reading the weight,
// that is half of float32's traffic.
//
// Layout: the usual nn.Linear weight, `[N, K]` row-major (`w[n * ldw + k]`), so every
// output is a dot product along contiguous memory; x is `[M, K]` float32.
//
//   output rows n are cut into blocks of kBlockN = 16; threads split the blocks.
//   per block, for each tile of MR x rows and NR weight rows (MR * NR = 16):
//     acc[MR][NR] (16 registers) += x[m, k:k+16] * w[n, k:k+16]    for k in 0, 16, ...
//     then one transpose-sum folds the 16 accumulators into the 16 outputs.
//   the block's weight rows (16 x K x 2 bytes) come from memory for the first x tile
//   and from L1/L2 for the rest.
//
// All arithmetic is float32 (products and sums); each output is rounded once, to x's
// dtype, as it is stored.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "kernel_entries.h"
#include "scratch.h"

namespace folio {
namespace {

using vec::kLanes;
using vec::vf;

constexpr int kBlockN = 16;  // weight rows per work item (a multiple of every NR)

// 32 consecutive weights of a row as two float vectors, in the order `chunk_order`
// gives x. bf16: interleaving zero halves below the bits of each 128-bit quarter is one
// shuffle per vector (no shift), at the price of a fixed permutation of k; fp16: the
// conversion instruction, in order.
inline void load32(const c10::BFloat16* p, vf& lo, vf& hi) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i bits = _mm512_loadu_si512(p);
  const __m512i lo_i = _mm512_unpacklo_epi16(_mm512_setzero_si512(), bits);
  const __m512i hi_i = _mm512_unpackhi_epi16(_mm512_setzero_si512(), bits);
  std::memcpy(&lo, &lo_i, sizeof lo);
  std::memcpy(&hi, &hi_i, sizeof hi);
#else
  lo = vec::load(p);
  hi = vec::load(p + kLanes);
#endif
}

inline void load32(const c10::Half* p, vf& lo, vf& hi) {
  lo = vec::load(p);
  hi = vec::load(p + kLanes);
}

// Position, within a chunk of 32, of the k that lands in lane `i` of load32's output.
template <typename W>
inline int chunk_order(int i) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    // unpacklo takes words 0-3 of each 128-bit quarter (8 words), unpackhi words 4-7.
    const int half = i / 16, lane = i % 16;
    return (lane / 4) * 8 + half * 4 + lane % 4;
  }
#endif
  return i;
}

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < MR, n < NR, rounded once to O;
// K a multiple of 32, x's rows permuted per chunk of 32 as chunk_order says.
template <int MR, int NR, bool Prefetch, typename W, typename O>
inline void tile(const float* __restrict x, int64_t ldx, const W* __restrict w,
                 int64_t ldw, int64_t K, const float* __restrict bias, O* __restrict y,
                 int64_t ldy) {
  static_assert(MR * NR == kLanes, "one transpose-sum folds the whole tile");
  vf acc[MR * NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR * NR; ++i) acc[i] = vf{};
  for (int64_t k = 0; k < K; k += 2 * kLanes) {
    vf lo[NR], hi[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      load32(w + j * ldw + k, lo[j], hi[j]);  // 64 bytes: one cache line a row
      // The same line of the next block's rows: that block is read from memory next.
      if constexpr (Prefetch) __builtin_prefetch(w + (j + kBlockN) * ldw + k);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf a = vec::load(x + i * ldx + k);
      const vf b = vec::load(x + i * ldx + k + kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        acc[i * NR + j] += a * lo[j];  // two statements: two fused multiply-adds
        acc[i * NR + j] += b * hi[j];
      }
    }
  }
  const vf sums = vec::transpose_sum(acc);  // lane i * NR + j = y[i, j]
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j)
      y[i * ldy + j] = static_cast<O>(sums[i * NR + j] + (bias ? bias[j] : 0.f));
}

// Weight rows per tile of 4, 2 and 1 x rows: MR * NR = kLanes accumulators (16 on
// AVX-512, 8 on AVX2, 4 otherwise), so one transpose-sum folds a tile.
constexpr int kNR4 = kLanes / 4, kNR2 = kLanes / 2, kNR1 = kLanes;
static_assert(kBlockN % kNR1 == 0, "a block is whole tiles");

// Rows [0, M) of x against one block of kBlockN weight rows.
template <typename W, typename O>
void block(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw,
           const float* bias, O* y, int64_t ldy) {
  // The first pass over the block reads it from memory (and prefetches the next
  // block); later passes find it in cache.
  auto at = [&](int n) { return bias ? bias + n : nullptr; };
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    for (int n = 0; n < kBlockN; n += kNR4) {
      if (m == 0) {
        tile<4, kNR4, true>(x, K, w + n * ldw, ldw, K, at(n), y + n, ldy);
      } else {
        tile<4, kNR4, false>(x + m * K, K, w + n * ldw, ldw, K, at(n), y + m * ldy + n, ldy);
      }
    }
  }
  const float* xm = x + m * K;
  O* ym = y + m * ldy;
  const bool first = m == 0;
  auto one_row = [&](const float* xr, O* yr, bool prefetch) {
    for (int n = 0; n < kBlockN; n += kNR1) {
      if (prefetch) tile<1, kNR1, true>(xr, K, w + n * ldw, ldw, K, at(n), yr + n, ldy);
      else tile<1, kNR1, false>(xr, K, w + n * ldw, ldw, K, at(n), yr + n, ldy);
    }
  };
  auto two_rows = [&](bool prefetch) {
    for (int n = 0; n < kBlockN; n += kNR2) {
      if (prefetch) tile<2, kNR2, true>(xm, K, w + n * ldw, ldw, K, at(n), ym + n, ldy);
      else tile<2, kNR2, false>(xm, K, w + n * ldw, ldw, K, at(n), ym + n, ldy);
    }
  };
  switch (M - m) {
    case 1:
      one_row(xm, ym, first);
      break;
    case 2:
      two_rows(first);
      break;
    case 3:  // a 2-row tile and a 1-row tile
      two_rows(first);
      one_row(xm + 2 * K, ym + 2 * ldy, false);
      break;
    default:
      break;
  }
}

template <typename W, typename O>
void run(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw, int64_t N,
         const float* bias, O* y) {
  const int64_t blocks = N / kBlockN;
  // Enough work per thread chunk that forking the pool pays off (~64K multiply-adds).
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, M * K * kBlockN));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      block(x, M, K, w + b * kBlockN * ldw, ldw, bias ? bias + b * kBlockN : nullptr,
            y + b * kBlockN, N);
  });
}

// x [M, K] as float32 into `dst`, each chunk of 32 columns reordered for load32 (one
// pass: widen and permute together).
template <typename W, typename T>
void x_in_chunk_order(const T* src, int64_t M, int64_t K, int64_t ldx, float* dst) {
  int order[2 * kLanes];
  for (int i = 0; i < 2 * kLanes; ++i) order[i] = chunk_order<W>(i);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K; c += 2 * kLanes)
      for (int i = 0; i < 2 * kLanes; ++i)
        dst[m * K + c + i] = static_cast<float>(src[m * ldx + c + order[i]]);
}

template <typename W>
void dispatch(const at::Tensor& x, const at::Tensor& weight, const float* bias,
              at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const W* w = weight.const_data_ptr<W>();
  thread_local std::vector<float> xbuf;  // the caller's thread prepares x
  xbuf.resize(static_cast<size_t>(M * K));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "half_linear",
                                  [&] {
    x_in_chunk_order<W>(x.const_data_ptr<scalar_t>(), M, K, x.stride(0), xbuf.data());
    run(xbuf.data(), M, K, w, weight.stride(0), N, bias, out.data_ptr<scalar_t>());
  });
  release_if_large(xbuf);
}

}  // namespace

// x [M, K] (any floating dtype, rows contiguous), weight [N, K] bf16/fp16 with
// contiguous rows, N a multiple of 16 and K of 32. Returns x @ weight.T (+ bias) in x's
// dtype: float32 products and sums, one rounding of the output.
at::Tensor half_linear(const at::Tensor& x_in, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2, "half_linear: 2-D operands expected");
  TORCH_CHECK(x_in.size(1) == weight.size(1), "half_linear: x is [M, K], weight [N, K]");
  TORCH_CHECK(weight.stride(1) == 1, "half_linear: weight rows must be contiguous");
  TORCH_CHECK(weight.size(0) % kBlockN == 0 && weight.size(1) % (2 * kLanes) == 0,
              "half_linear: N must be a multiple of 16 and K of 32");
  const at::ScalarType wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kBFloat16 || wt == at::kHalf, "half_linear: bf16/fp16 weight");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (out.numel() == 0) return out;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0),
                "half_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  if (wt == at::kBFloat16) {
    dispatch<c10::BFloat16>(x, weight, bp, out);
  } else {
    dispatch<c10::Half>(x, weight, bp, out);
  }
  return out;
}

bool half_linear_takes(const at::Tensor& weight) {
  const at::ScalarType wt = weight.scalar_type();
  return weight.dim() == 2 && weight.stride(1) == 1 && weight.size(0) % kBlockN == 0 &&
         weight.size(1) % (2 * kLanes) == 0 && (wt == at::kBFloat16 || wt == at::kHalf);
}

void half_prepare_rows(const void* x, int64_t rows, int64_t k, at::ScalarType dtype,
                       at::ScalarType weight_dtype, std::vector<float>& buf) {
  buf.resize(static_cast<size_t>(rows * k));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "half_prepare_rows", [&] {
    const scalar_t* xs = static_cast<const scalar_t*>(x);
    if (weight_dtype == at::kBFloat16)
      x_in_chunk_order<c10::BFloat16>(xs, rows, k, k, buf.data());
    else
      x_in_chunk_order<c10::Half>(xs, rows, k, k, buf.data());
  });
}

void half_row_blocks(const float* x, int64_t rows, int64_t k, const void* weight, int64_t ldw,
                     at::ScalarType weight_dtype, const float* bias, int64_t b0, int64_t b1,
                     void* y, int64_t ldy, at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "half_row_blocks", [&] {
    scalar_t* out = static_cast<scalar_t*>(y);
    const auto blocks = [&](auto* w) {  // as run()
      for (int64_t b = b0; b < b1; ++b)
        block(x, rows, k, w + b * kBlockN * ldw, ldw, bias ? bias + b * kBlockN : nullptr,
              out + b * kBlockN, ldy);
    };
    if (weight_dtype == at::kBFloat16)
      blocks(static_cast<const c10::BFloat16*>(weight));
    else
      blocks(static_cast<const c10::Half*>(weight));
  });
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("half_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("half_linear", &folio::half_linear);
}
