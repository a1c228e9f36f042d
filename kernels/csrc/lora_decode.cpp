// LoRA of a decode-sized step on the CPU: every token's shrink and expand for one fused
// projection in one call.
//
//   xa[t]          = x[t] @ A[s]                            s = slot[t]; -1: row untouched
//   y[t, cols_j]   = T(y[t, cols_j] + xa[t, jR:(j+1)R] @ B[s][:, cols_j])   per slice j
//
// A is the worker's store [S, in, K] (K = slices * R, row i of a slot holds the K
// weights input i feeds), B its store [S, R, out]; both in the slots' dtype W, the
// activations x, y in T. Products and sums in float32; xa stays float32; each y element
// is rounded once.
//
// At decode a step holds a few rows per adapter, and the torch path costs a handful of
// small ops per projection (gather, batched GEMMs, scatter, add), whose dispatch
// outweighs the arithmetic. Here the rows are grouped by slot, and
//   shrink: per slot (threads split the slots), for each input i, one A row (K weights,
//           read once) is scaled by x[t, i] into each of the slot's accumulators;
//   expand: per tile of 64 output columns within one slice (threads split the tiles),
//           for each slot and each of its rows, R rows of B's tile (L1-resident after
//           the slot's first row) are scaled by xa and summed in registers.
// So each slot's A and B are read from memory once per call.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"

namespace folio {
namespace {

using vec::kLanes;
using vec::vf;

constexpr int64_t kTile = 4 * kLanes;  // output columns per expand work item

struct ColumnTile {
  int64_t slice, begin, end;
};

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(src[c]);
}

template <typename T, typename W>
void lora_rows(T* y, int64_t ldy, const T* x, int64_t ldx, const W* a, const W* b,
               const std::vector<std::vector<int64_t>>& rows_of, int64_t in, int64_t K,
               int64_t rank, int64_t out, const std::vector<int64_t>& widths) {
  std::vector<int64_t> used;
  int64_t max_row = 0;
  for (int64_t s = 0; s < static_cast<int64_t>(rows_of.size()); ++s) {
    if (rows_of[s].empty()) continue;
    used.push_back(s);
    max_row = std::max(max_row, rows_of[s].back() + 1);
  }
  if (used.empty()) return;
  const int64_t Kp = (K + kLanes - 1) / kLanes * kLanes;  // whole vectors per row
  std::vector<float> xa(static_cast<size_t>(max_row * Kp), 0.f);

  at::parallel_for(0, static_cast<int64_t>(used.size()), 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> a_row(static_cast<size_t>(Kp), 0.f);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t s = used[u];
      const W* as = a + s * in * K;
      for (int64_t i = 0; i < in; ++i) {
        const float* ai = vec::row_as_float(as + i * K, a_row.data(), K);
        if (ai != a_row.data()) {  // float storage: copy so the padded tail stays 0
          std::copy(ai, ai + K, a_row.data());
        }
        for (int64_t r : rows_of[s]) {
          const vf xi = vec::splat(static_cast<float>(x[r * ldx + i]));
          float* acc = xa.data() + r * Kp;
          for (int64_t k = 0; k < Kp; k += kLanes)
            vec::store(acc + k, vec::load(acc + k) + xi * vec::load(a_row.data() + k));
        }
      }
    }
  });

  std::vector<ColumnTile> tiles;
  for (int64_t j = 0, col = 0; j < static_cast<int64_t>(widths.size()); col += widths[j++])
    for (int64_t c = col; c < col + widths[j]; c += kTile)
      tiles.push_back({j, c, std::min(c + kTile, col + widths[j])});

  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> b_tile(static_cast<size_t>(rank * kTile), 0.f);
    float acc[kTile];
    float y_row[kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const ColumnTile& tile = tiles[t];
      const int64_t width = tile.end - tile.begin;
      for (int64_t s : used) {
        // this slot's B rows for the tile, as float, zero-padded to whole vectors
        const W* bs = b + s * rank * out + tile.begin;
        for (int64_t k = 0; k < rank; ++k) {
          float* dst = b_tile.data() + k * kTile;
          const float* src = vec::row_as_float(bs + k * out, dst, width);
          if (src != dst) std::copy(src, src + width, dst);
          std::fill(dst + width, dst + kTile, 0.f);
        }
        for (int64_t r : rows_of[s]) {
          const float* xr = xa.data() + r * Kp + tile.slice * rank;
          vf v0 = vec::splat(0.f), v1 = v0, v2 = v0, v3 = v0;
          for (int64_t k = 0; k < rank; ++k) {
            const vf c = vec::splat(xr[k]);
            const float* bk = b_tile.data() + k * kTile;
            v0 += c * vec::load(bk);
            v1 += c * vec::load(bk + kLanes);
            v2 += c * vec::load(bk + 2 * kLanes);
            v3 += c * vec::load(bk + 3 * kLanes);
          }
          vec::store(acc, v0);
          vec::store(acc + kLanes, v1);
          vec::store(acc + 2 * kLanes, v2);
          vec::store(acc + 3 * kLanes, v3);
          T* yr = y + r * ldy + tile.begin;
          for (int64_t c = 0; c < width; ++c)
            y_row[c] = static_cast<float>(yr[c]) + acc[c];
          store_row(yr, y_row, width);
        }
      }
    }
  });
}

// Calls fn with a value of the C++ type of `dtype` (float32, bfloat16 or float16).
template <typename Fn>
void with_dtype(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "lora_decode: float32, bfloat16 or float16, not ", dtype);
  }
}

// y [T, out] (rows contiguous), x [T, in], a [S, in, K], b [S, rank, out] contiguous,
// token_slots [T] int32; slice_widths tile y's columns in order.
void lora_decode(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& token_slots, int64_t rank, at::IntArrayRef slice_widths) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_decode: y [T, out], x [T, in], a [S, in, K], b [S, rank, out]");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "lora_decode: rows must be contiguous");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "lora_decode: contiguous stores");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == b.scalar_type(),
              "lora_decode: x and y share a dtype, and so do a and b");
  const int64_t rows = y.size(0), out = y.size(1), in = x.size(1), K = a.size(2);
  const int64_t num_slots = a.size(0);
  TORCH_CHECK(x.size(0) == rows && a.size(1) == in && b.size(0) == num_slots &&
                  b.size(1) == rank && b.size(2) == out && token_slots.numel() == rows,
              "lora_decode: shapes disagree");
  int64_t total = 0;
  for (int64_t w : slice_widths) total += w;
  TORCH_CHECK(total == out && static_cast<int64_t>(slice_widths.size()) * rank == K,
              "lora_decode: slices must tile y's columns and a's K");
  const at::Tensor slots = token_slots.to(at::kInt).contiguous();
  const int32_t* sp = slots.data_ptr<int32_t>();
  std::vector<std::vector<int64_t>> rows_of(static_cast<size_t>(num_slots));
  for (int64_t r = 0; r < rows; ++r) {
    if (sp[r] < 0) continue;
    TORCH_CHECK(sp[r] < num_slots, "lora_decode: slot out of range");
    rows_of[sp[r]].push_back(r);
  }
  const std::vector<int64_t> widths(slice_widths.begin(), slice_widths.end());
  with_dtype(y.scalar_type(), [&](auto y_type) {
    using T = decltype(y_type);
    with_dtype(a.scalar_type(), [&](auto w_type) {
      using W = decltype(w_type);
      lora_rows<T, W>(y.data_ptr<T>(), y.stride(0), x.data_ptr<T>(), x.stride(0),
                      a.data_ptr<W>(), b.data_ptr<W>(), rows_of, in, K, rank, out, widths);
    });
  });
}

}  // namespace
}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  m.def("lora_decode(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor token_slots, "
        "int rank, int[] slice_widths) -> ()");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("lora_decode", &folio::lora_decode);
}
