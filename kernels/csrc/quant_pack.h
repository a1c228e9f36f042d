// GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) in Folio's packed layout, and the
// per-block int8 quantization of activations the integer kernels multiply them with.
//
// A GGUF stores a weight row by row in blocks of 32 values along K; a Q4_1 block is
//
//   byte  0   2   4                                   20
//        +---+---+------------------------------------+
//        | d | m | qs[16]: byte i = q[i] | q[i+16]<<4  |     w[k] = d * q[k] + m
//        +---+---+------------------------------------+
//
// (Q4_0: no m, w = d * (q - 8); Q8_0: d then 32 signed bytes, w = d * q; d, m fp16.)
// The kernels want 16 weight rows side by side, so that one 64-byte vector holds 4
// consecutive k of 16 rows: each 32-bit lane j is one row, and `vpdpbusd` adds the 4
// products of a lane with the same 4 activations broadcast to every lane. Rows are
// cut into groups of 16 (the last one zero-padded) and the model's layout becomes
//
//   qs     [G][B][chunk][64] u8   G = ceil(N / 16) groups, B = K / 32 blocks
//   scales [G][B][S] fp16         S = 16 (d of the 16 rows) or 32 (d then m, Q4_1)
//
//   Q4 chunk c (4 per block), byte 4j + t (row j of the group, t = 0..3):
//        low nibble  = q[row j, k = 32b + 8c + t]
//        high nibble = q[row j, k = 32b + 8c + 4 + t]
//   Q8 chunk c (8 per block), byte 4j + t = q[row j, k = 32b + 4c + t] + 128 (unsigned)
//
// so unpacking a Q4 chunk is `v & 15` (k 8c..8c+3) and `(v >> 4) & 15` (k 8c+4..8c+7),
// the operands of activation words 2c and 2c+1; a Q8 chunk is used as it is, against
// word c. The bytes are exactly as many as the GGUF's (16 blocks of 20 bytes = 256 +
// 64 for Q4_1); kernels/quant_linear.py packs them and holds the torch reference.
//
// Activations: per row and block of 32, xd = max|x| / 127, xq = round-half-even(x / xd)
// (as x * (1 / xd)), xs = sum(xq). With integer dot p = sum(u * xq) of the stored
// unsigned weights u (q, or q + 128 for Q8_0):
//
//   Q4_0:  sum_k w x = d * xd * (p - 8 * xs)
//   Q8_0:  sum_k w x = d * xd * (p - 128 * xs)
//   Q4_1:  sum_k w x = d * xd * p + m * (xd * xs)
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace folio::quant {

constexpr int kGroupRows = 16;
constexpr int kBlock = 32;
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids

constexpr bool is_q4(int64_t fmt) { return fmt == kQ4_0 || fmt == kQ4_1; }
constexpr int qs_bytes(int64_t fmt) { return is_q4(fmt) ? 256 : 512; }      // per block
constexpr int scale_count(int64_t fmt) { return fmt == kQ4_1 ? 32 : 16; }   // per block
constexpr int32_t offset_of(int64_t fmt) { return fmt == kQ4_0 ? 8 : fmt == kQ8_0 ? 128 : 0; }

// Activations quantized per block of 32, row-major like x.
struct QuantizedRows {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;      // [rows][blocks * 32]
  std::vector<float> scale;   // [rows][blocks]   xd
  std::vector<int32_t> sum;   // [rows][blocks]   xs
  std::vector<float> msum;    // [rows][blocks]   xd * xs (Q4_1's min term)
};

template <typename T>
void quantize_block(const T* x, int8_t* q, float& scale, int32_t& sum) {
  float amax = 0.f;
  float v[kBlock];
  for (int i = 0; i < kBlock; ++i) {
    v[i] = static_cast<float>(x[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int32_t s = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int32_t r = static_cast<int32_t>(std::nearbyint(v[i] * id));  // ties to even
    q[i] = static_cast<int8_t>(r);
    s += r;
  }
  scale = d;
  sum = s;
}

// x [M, K] (rows `ldx` apart, K a multiple of 32) into `out`, rows split over threads.
template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t B = K / kBlock;
  out.rows = M;
  out.blocks = B;
  out.q.resize(static_cast<size_t>(M * K));
  out.scale.resize(static_cast<size_t>(M * B));
  out.sum.resize(static_cast<size_t>(M * B));
  out.msum.resize(static_cast<size_t>(M * B));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t i = m * B + b;
        quantize_block(x + m * ldx + b * kBlock, out.q.data() + m * K + b * kBlock,
                       out.scale[i], out.sum[i]);
        out.msum[i] = out.scale[i] * static_cast<float>(out.sum[i]);
      }
  });
}

}  // namespace folio::quant
