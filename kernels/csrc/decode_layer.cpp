// One Llama decoder layer for a batch of decode rows (one new token per request), in one
// native call:
//
//   h, residual = rms_norm(hidden (+ residual))            input_layernorm
//   q, k, v     = split(linear(h, W_qkv) (+ b_qkv))
//   q, k        = rotate(q, k; cos, sin)                    rotate-half RoPE
//   cache[slot] = k, v                                      this step's keys and values
//   a           = paged_attention_decode(q; cache, block tables, seq lens)
//   h, residual = rms_norm(linear(a, W_o) + residual)      post_attention_layernorm
//   gate, up    = split(linear(h, W_gate_up))
//   out         = linear(T(silu(gate)) * up, W_down)
//
// The spec is LlamaDecoderLayer.forward (worker/models/llama.py) with its torch ops; this
// is the same computation with the same rounding points (T: the activation dtype):
// RoPE rounds each product and then the sum, as `x1 * cos - x2 * sin` does on T tensors;
// SiLU and its product with `up` are torch's own ops. The norms, linear layers and
// attention are the same native kernels the unfused layer calls (kernel_entries.h), so
// what goes away is ~100 torch ops a layer and their Python dispatch, which at batch 1
// cost more than the layer's arithmetic. Each linear layer runs the path the caller
// chose for this row count (worker/models/linear_paths.py).
//
// Scope: the KV cache in the activation dtype or fp8 (an fp8 cache takes keys and values
// as kernels/kv_quant.py quantizes them; int8 caches take the unfused layer), no LoRA, no
// tensor parallelism: the caller checks (worker/models/fused_decode.py).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "kernel_entries.h"
#include "rotary.h"

namespace folio {
namespace {

// Path codes, as worker/models/fused_decode.py encodes linear_paths' names.
enum Path : int64_t {
  kNative = 0, kKernel = 1, kWiden = 2, kInt8 = 3, kBf16Dot = 4, kAmx = 5, kMkldnn = 6,
  kInt16 = 7
};
constexpr int64_t kQuantWidenRoute = 4, kQuantBestInt8Route = 0,  // quant_linear.cpp
    kQuantBf16DotRoute = 5, kQuantAmxRoute = 6, kQuantInt16Route = 7;

// Operand slots in `weights` and fields of `meta` (see the schema at the bottom).
enum Slot { kInNorm, kPostNorm, kQkv, kQkvScales, kQkvBias, kO, kOScales, kGateUp,
            kGateUpScales, kDown, kDownScales, kQkvTail, kQkvTailScales, kNumSlots };
enum Meta { kHeads, kKvHeads, kHeadDim, kLinearMeta, kNumMeta = kLinearMeta + 15 };

using OptTensor = c10::optional<at::Tensor>;

bool has(const OptTensor& t) { return t.has_value() && t->defined(); }

// torch's mkldnn::_linear_pointwise (x, weight prepacked by _reorder_linear_weight,
// bias, no post-op), as worker/models/prepacked.py calls it: through the dispatcher,
// boxed, so no oneDNN header is needed here.
at::Tensor prepacked_linear(const at::Tensor& x, const at::Tensor& packed, const OptTensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, has(bias) ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x @ W.T (+ bias) through `path`, as linear_paths.run_path computes it. A weight with
// scales is packed (qs, scales, fmt, n); otherwise it is a plain [n, k] tensor, and on
// the mkldnn path the scales slot holds its oneDNN copy.
at::Tensor linear(const at::Tensor& x, const OptTensor& w, const OptTensor& scales,
                  const OptTensor& bias, const int64_t* m) {
  const int64_t path = m[0], fmt = m[1], n = m[2];
  if (path == kMkldnn) {
    TORCH_CHECK(has(scales), "decode_layer: the mkldnn path needs the prepacked weight");
    return prepacked_linear(x.contiguous(), *scales, bias);
  }
  if (has(scales)) {
    if (path == kNative)
      return at::linear(x, quant::quant_dequantize(*w, *scales, fmt, n, c10::nullopt,
                                                   x.scalar_type()), bias);
    return quant::quant_linear(x, *w, *scales, fmt, n, bias,
                               path == kInt8      ? kQuantBestInt8Route
                               : path == kBf16Dot ? kQuantBf16DotRoute
                               : path == kAmx     ? kQuantAmxRoute
                               : path == kInt16   ? kQuantInt16Route
                                                  : kQuantWidenRoute);
  }
  if (path == kKernel) return half_linear(x, *w, bias);
  if (path == kAmx) return amx_linear(x, *w, bias);
  if (path == kWiden)
    return at::linear(x.to(at::kFloat), w->to(at::kFloat),
                      has(bias) ? OptTensor(bias->to(at::kFloat)) : OptTensor())
        .to(x.scalar_type());
  return at::linear(x, *w, bias);
}

// A cache element from an activation: the same type as it is, or fp8 as
// kernels/kv_quant.py's quantize_kv stores it (clamped to the format's largest finite
// value, NaN kept, then rounded to nearest even by c10's conversion, scale 1.0).
template <typename C, typename T>
inline C to_cache(T x) {
  if constexpr (std::is_same_v<C, T>) {
    return x;
  } else {
    constexpr float kMax = std::is_same_v<C, c10::Float8_e4m3fn> ? 448.f : 57344.f;
    float v = static_cast<float>(x);
    if (v > kMax) v = kMax;
    else if (v < -kMax) v = -kMax;
    return static_cast<C>(v);
  }
}

// Rotates q into `q_out` [rows, heads, hd] and k into its cache slot; copies v there
// (both converted to the cache's type C).
template <typename T, typename C>
void rope_and_cache(const T* qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                    int64_t hd, const T* cos, const T* sin, const int64_t* slots,
                    T* q_out, C* k_cache, C* v_cache) {
  const int64_t half = hd / 2, ld = (heads + 2 * kv_heads) * hd, kv_row = kv_heads * hd;
  std::vector<T> k_row(std::is_same_v<C, T> ? 0 : static_cast<size_t>(hd));
  for (int64_t t = 0; t < rows; ++t) {
    const T* x = qkv + t * ld;
    const T* c = cos + t * half;
    const T* s = sin + t * half;
    for (int64_t h = 0; h < heads; ++h)
      rope::rotate(x + h * hd, c, s, half, q_out + (t * heads + h) * hd);
    C* k = k_cache + slots[t] * kv_row;
    const T* v = x + (heads + kv_heads) * hd;
    if constexpr (std::is_same_v<C, T>) {
      for (int64_t h = 0; h < kv_heads; ++h)
        rope::rotate(x + (heads + h) * hd, c, s, half, k + h * hd);
      std::memcpy(v_cache + slots[t] * kv_row, v, kv_row * sizeof(T));
    } else {
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope::rotate(x + (heads + h) * hd, c, s, half, k_row.data());
        for (int64_t i = 0; i < hd; ++i) k[h * hd + i] = to_cache<C>(k_row[i]);
      }
      C* vc = v_cache + slots[t] * kv_row;
      for (int64_t i = 0; i < kv_row; ++i) vc[i] = to_cache<C>(v[i]);
    }
  }
}

void check(const at::Tensor& hidden, const std::vector<OptTensor>& w,
           const std::vector<int64_t>& meta, const at::Tensor& kv_cache,
           const at::Tensor& slot_mapping, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(w.size() == kNumSlots, "decode_layer: weights must hold ", kNumSlots, " entries");
  TORCH_CHECK(meta.size() == kNumMeta, "decode_layer: meta must hold ", kNumMeta, " ints");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "decode_layer: hidden must be contiguous [rows, hidden]");
  const int64_t rows = hidden.size(0), hd = meta[kHeadDim], kv_heads = meta[kKvHeads];
  TORCH_CHECK(hd % 2 == 0 && meta[kHeads] > 0 && kv_heads > 0, "decode_layer: bad head shape");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(3) == kv_heads && kv_cache.size(4) == hd,
              "decode_layer: kv_cache must be contiguous [2, blocks, block_size, kv_heads, hd]");
  TORCH_CHECK(kv_cache.scalar_type() == hidden.scalar_type() ||
                  kv_cache.scalar_type() == at::kFloat8_e4m3fn ||
                  kv_cache.scalar_type() == at::kFloat8_e5m2,
              "decode_layer: the KV cache must have the activations' dtype or be fp8");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == rows && slot_mapping.is_contiguous(),
              "decode_layer: slot_mapping must be contiguous int64 [rows]");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == hidden.scalar_type() && t->is_contiguous() &&
                    t->numel() == rows * hd / 2,
                "decode_layer: cos/sin must be contiguous [rows, head_dim / 2] in hidden's dtype");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* s = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "decode_layer: slot_mapping[", t, "] = ", s[t],
                " is outside the cache (", num_slots, " slots)");
}

}  // namespace

// Returns (hidden out, residual): the layer's output before the next layer's norm.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const OptTensor& residual, const std::vector<OptTensor>& w,
    const std::vector<int64_t>& meta, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& cos, const at::Tensor& sin, double eps, double scale,
    std::optional<int64_t> sliding_window) {
  check(hidden, w, meta, kv_cache, slot_mapping, cos, sin);
  const int64_t rows = hidden.size(0), heads = meta[kHeads], kv_heads = meta[kKvHeads],
                hd = meta[kHeadDim];
  const int64_t* lm = meta.data() + kLinearMeta;  // (path, fmt, n) per linear layer

  // The rows' cache slots are written after the q/k/v projection: request their lines
  // for writing now, so that those stores do not wait on memory (at 32 rows they had
  // taken 30 us a layer, one miss after another).
  {
    const int64_t kv_row_bytes = kv_heads * hd * kv_cache.element_size();
    const int64_t plane = kv_cache.size(1) * kv_cache.size(2) * kv_row_bytes;
    const char* base = static_cast<const char*>(kv_cache.const_data_ptr());
    const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t b = 0; b < kv_row_bytes; b += 64) {
        __builtin_prefetch(base + slots[t] * kv_row_bytes + b, 1);
        __builtin_prefetch(base + plane + slots[t] * kv_row_bytes + b, 1);
      }
  }
  auto [h, res] = rms_norm(hidden, *w[kInNorm], eps, residual);
  if (!res.defined()) res = hidden;  // the first layer: the residual is its input
  at::Tensor qkv;
  if (has(w[kQkvTail])) {  // q/k/v rows packed in two formats: the parts side by side
    qkv = at::cat({linear(h, w[kQkv], w[kQkvScales], c10::nullopt, lm),
                   linear(h, w[kQkvTail], w[kQkvTailScales], c10::nullopt, lm + 12)}, 1);
    if (has(w[kQkvBias])) qkv.add_(*w[kQkvBias]);
  } else {
    qkv = linear(h, w[kQkv], w[kQkvScales], w[kQkvBias], lm).contiguous();
  }
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd,
              "decode_layer: qkv width does not match the head shape");
  at::Tensor q = at::empty({rows, heads, hd}, hidden.options());
  const int64_t plane = kv_cache.size(1) * kv_cache.size(2) * kv_heads * hd;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(),
                                  "decode_layer", [&] {
    const auto write = [&](auto* cache) {
      rope_and_cache(qkv.const_data_ptr<scalar_t>(), rows, heads, kv_heads, hd,
                     cos.const_data_ptr<scalar_t>(), sin.const_data_ptr<scalar_t>(),
                     slot_mapping.const_data_ptr<int64_t>(), q.data_ptr<scalar_t>(), cache,
                     cache + plane);
    };
    if (kv_cache.scalar_type() == at::kFloat8_e4m3fn)
      write(kv_cache.data_ptr<c10::Float8_e4m3fn>());
    else if (kv_cache.scalar_type() == at::kFloat8_e5m2)
      write(kv_cache.data_ptr<c10::Float8_e5m2>());
    else
      write(kv_cache.data_ptr<scalar_t>());
  });
  // never in batch-invariant mode (worker/models/fused_decode.py)
  const at::Tensor attn = paged_attention_decode(q, kv_cache, block_tables, seq_lens, scale,
                                                 sliding_window, /*batch_invariant=*/false)
                              .view({rows, heads * hd});
  const at::Tensor o = linear(attn, w[kO], w[kOScales], c10::nullopt, lm + 3);
  std::tie(h, res) = rms_norm(o, *w[kPostNorm], eps, res);
  const at::Tensor gate_up = linear(h, w[kGateUp], w[kGateUpScales], c10::nullopt, lm + 6)
                                 .contiguous();
  // SiLU and product in one pass, with the bits of torch's two ops (silu_and_mul.cpp)
  const at::Tensor act = silu_and_mul(gate_up);
  return {linear(act, w[kDown], w[kDownScales], c10::nullopt, lm + 9), res};
}

// Every layer of a decode step in one call: layer i takes weights[i * kNumSlots, ...),
// meta[i * kNumMeta, ...) and kv_caches[i]. Same results as decode_layer called layer by
// layer; what goes away is a dispatcher round trip and the argument lists' conversion
// per layer, which at batch 1 cost more than a small model's norms and RoPE.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const std::vector<OptTensor>& w, const std::vector<int64_t>& meta,
    const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos,
    const at::Tensor& sin, double eps, double scale, std::optional<int64_t> sliding_window) {
  const auto layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(w.size()) == layers * kNumSlots,
              "decode_layers: weights must hold ", kNumSlots, " entries per layer");
  TORCH_CHECK(static_cast<int64_t>(meta.size()) == layers * kNumMeta,
              "decode_layers: meta must hold ", kNumMeta, " ints per layer");
  at::Tensor h = hidden;
  OptTensor res;
  for (int64_t i = 0; i < layers; ++i) {
    const std::vector<OptTensor> wi(w.begin() + i * kNumSlots, w.begin() + (i + 1) * kNumSlots);
    const std::vector<int64_t> mi(meta.begin() + i * kNumMeta, meta.begin() + (i + 1) * kNumMeta);
    auto [out, r] = decode_layer(h, res, wi, mi, kv_caches[i], slot_mapping, block_tables,
                                 seq_lens, cos, sin, eps, scale, sliding_window);
    h = std::move(out);
    res = std::move(r);
  }
  return {h, res.has_value() ? *res : at::Tensor()};
}

}  // namespace folio

TORCH_LIBRARY_FRAGMENT(folio, m) {
  // weights: input/post-attention norm weights, then per linear layer its weight (or a
  // packed weight's qs) and scales (None for a plain tensor), the qkv bias after qkv's,
  // and last the packed rows of q/k/v that follow qkv's in another format (None if all
  // are in one):
  //   [in_norm, post_norm, qkv, qkv_scales, qkv_bias, o, o_scales, gate_up,
  //    gate_up_scales, down, down_scales, qkv_tail, qkv_tail_scales]
  // meta: [heads, kv_heads, head_dim] then (path, fmt, n) for qkv, o, gate_up, down and
  // qkv_tail (zeros without one).
  m.def("decode_layer(Tensor hidden, Tensor? residual, Tensor?[] weights, int[] meta, "
        "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor cos, Tensor sin, float eps, float scale, int? sliding_window=None) "
        "-> (Tensor, Tensor)");
  // decode_layer for every layer: weights and meta concatenated layer after layer
  m.def("decode_layers(Tensor hidden, Tensor?[] weights, int[] meta, Tensor(a!)[] kv_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor cos, Tensor sin, "
        "float eps, float scale, int? sliding_window=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("decode_layer", &folio::decode_layer);
  m.impl("decode_layers", &folio::decode_layers);
}

// A weight prepacked for oneDNN (the mkldnn path) is an MkldnnCPU tensor, and the
// dispatcher routes a call by its arguments' highest key: the same kernels serve it.
TORCH_LIBRARY_IMPL(folio, MkldnnCPU, m) {
  m.impl("decode_layer", &folio::decode_layer);
  m.impl("decode_layers", &folio::decode_layers);
}
