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
//
// decode_layers runs a step's layers one after another, each op with its own parallel
// region; at a few rows (up to 8) with quantized weights or 16-bit ones on Folio's
// kernel it runs them all in one (the row stack, below), with the same bits.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FOLIO_SPIN_PAUSE() _mm_pause()
#else
#define FOLIO_SPIN_PAUSE() ((void)0)
#endif

#include "cpu_vec.h"
#include "kernel_entries.h"
#include "quant_pack.h"
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

// quant_linear's route for a quantized weight on `path` (not kNative or kMkldnn).
int64_t quant_route(int64_t path) {
  return path == kInt8      ? kQuantBestInt8Route
         : path == kBf16Dot ? kQuantBf16DotRoute
         : path == kAmx     ? kQuantAmxRoute
         : path == kInt16   ? kQuantInt16Route
                            : kQuantWidenRoute;
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
    return quant::quant_linear(x, *w, *scales, fmt, n, bias, quant_route(path));
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

// Rotates the rows' queries into `q_out` [rows, heads, hd].
template <typename T>
void rotate_queries(const T* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                    const T* cos, const T* sin, T* q_out) {
  const int64_t half = hd / 2, ld = (heads + 2 * kv_heads) * hd;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rope::rotate(qkv + t * ld + h * hd, cos + t * half, sin + t * half, half,
                   q_out + (t * heads + h) * hd);
}

// Rotates the rows' keys into their cache slots and copies their values there (both
// converted to the cache's type C).
template <typename T, typename C>
void write_keys_values(const T* qkv, int64_t rows, int64_t heads, int64_t kv_heads,
                       int64_t hd, const T* cos, const T* sin, const int64_t* slots,
                       C* k_cache, C* v_cache) {
  const int64_t half = hd / 2, ld = (heads + 2 * kv_heads) * hd, kv_row = kv_heads * hd;
  std::vector<T> k_row(std::is_same_v<C, T> ? 0 : static_cast<size_t>(hd));
  for (int64_t t = 0; t < rows; ++t) {
    const T* x = qkv + t * ld;
    const T* c = cos + t * half;
    const T* s = sin + t * half;
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

// The rows' cache slot lines requested for writing: the stores after the q/k/v
// projection then do not wait on memory (at 32 rows they had taken 30 us a layer, one
// miss after another).
void prefetch_slots(const at::Tensor& kv_cache, const int64_t* slots, int64_t rows) {
  const int64_t kv_row_bytes = kv_cache.size(3) * kv_cache.size(4) * kv_cache.element_size();
  const int64_t plane = kv_cache.size(1) * kv_cache.size(2) * kv_row_bytes;
  const char* base = static_cast<const char*>(kv_cache.const_data_ptr());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < kv_row_bytes; b += 64) {
      __builtin_prefetch(base + slots[t] * kv_row_bytes + b, 1);
      __builtin_prefetch(base + plane + slots[t] * kv_row_bytes + b, 1);
    }
}

// Calls f with a null pointer of the cache's element type: the activations' T or fp8.
template <typename T, typename F>
void with_cache_type(const at::Tensor& kv_cache, F&& f) {
  if (kv_cache.scalar_type() == at::kFloat8_e4m3fn)
    f(static_cast<c10::Float8_e4m3fn*>(nullptr));
  else if (kv_cache.scalar_type() == at::kFloat8_e5m2)
    f(static_cast<c10::Float8_e5m2*>(nullptr));
  else
    f(static_cast<T*>(nullptr));
}

// w: the layer's kNumSlots operands, meta: its kNumMeta ints
void check(const at::Tensor& hidden, const OptTensor* w, const int64_t* meta,
           const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& cos,
           const at::Tensor& sin) {
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
    std::optional<int64_t> sliding_window, int64_t v_pass) {
  TORCH_CHECK(w.size() == kNumSlots, "decode_layer: weights must hold ", kNumSlots, " entries");
  TORCH_CHECK(meta.size() == kNumMeta, "decode_layer: meta must hold ", kNumMeta, " ints");
  check(hidden, w.data(), meta.data(), kv_cache, slot_mapping, cos, sin);
  const int64_t rows = hidden.size(0), heads = meta[kHeads], kv_heads = meta[kKvHeads],
                hd = meta[kHeadDim];
  const int64_t* lm = meta.data() + kLinearMeta;  // (path, fmt, n) per linear layer

  prefetch_slots(kv_cache, slot_mapping.const_data_ptr<int64_t>(), rows);
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
    const scalar_t* x = qkv.const_data_ptr<scalar_t>();
    const scalar_t* c = cos.const_data_ptr<scalar_t>();
    const scalar_t* s = sin.const_data_ptr<scalar_t>();
    rotate_queries(x, rows, heads, kv_heads, hd, c, s, q.data_ptr<scalar_t>());
    with_cache_type<scalar_t>(kv_cache, [&](auto* type) {
      using C = std::remove_pointer_t<decltype(type)>;
      C* cache = static_cast<C*>(kv_cache.data_ptr());
      write_keys_values(x, rows, heads, kv_heads, hd, c, s,
                        slot_mapping.const_data_ptr<int64_t>(), cache, cache + plane);
    });
  });
  // never in batch-invariant mode (worker/models/fused_decode.py)
  const at::Tensor attn = paged_attention_decode(q, kv_cache, block_tables, seq_lens, scale,
                                                 sliding_window, /*batch_invariant=*/false,
                                                 v_pass)
                              .view({rows, heads * hd});
  const at::Tensor o = linear(attn, w[kO], w[kOScales], c10::nullopt, lm + 3);
  std::tie(h, res) = rms_norm(o, *w[kPostNorm], eps, res);
  const at::Tensor gate_up = linear(h, w[kGateUp], w[kGateUpScales], c10::nullopt, lm + 6)
                                 .contiguous();
  // SiLU and product in one pass, with the bits of torch's two ops (silu_and_mul.cpp)
  const at::Tensor act = silu_and_mul(gate_up);
  return {linear(act, w[kDown], w[kDownScales], c10::nullopt, lm + 9), res};
}

// ---- the row stack: a few rows, every layer in one parallel region ----------------------
//
// At one decode row each op of a layer is a few microseconds (the default model's linear
// layers 6-33 us at two threads, attention ~20, norms, RoPE and SiLU 1-3 each), and
// decode_layer pays per linear layer ~1.3 us of parallel region and 1.3-2.5 us of serial
// preparation (output allocation, checks, quantizing the activations) while the other
// thread waits: ~15 us of a ~95 us layer (the AVX-512 EPYC, timed inside the op). Here
// one parallel region runs every layer, for up to as many rows as a quantized tile takes
// at once (8). Each thread computes the rows' vector work (norms, RoPE, SiLU, preparing
// the activations) itself, into its own buffers, with the same functions and so the
// same values; the linear layers' row groups and attention's work items are shared out,
// and the threads meet at a barrier wherever one needs the others' output. The same
// kernels and roundings give the same bits as decode_layer. The default Q4_1 model's
// batch-1 step, before / after: 1.25x at 128 prompt tokens, 1.21x at 400 (four
// alternated pairs, benchmarks/decode_checkouts.py; README).

// Threads of one team wait here for each other, spinning (a team holds its cores for
// the whole step; OpenMP's barrier would do, at a higher price per meeting). A meeting
// normally completes within microseconds; past kSpinsBeforeYield pauses (~70 us on a
// Zen 4) the team is taken to share a core with something else and each further try
// yields it. The bound matters when another busy thread (a grammar compile, a client on
// the same machine) takes one of two cores: each of a step's ~180 meetings then costs
// the whole spin before the partner runs (at 65,536 spins, batch-1 steps of 0.3-0.7 s).
class SpinBarrier {
 public:
  void set_size(int n) { size_ = n; }
  void wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < kSpinsBeforeYield) {
        FOLIO_SPIN_PAUSE();
      } else {
        std::this_thread::yield();  // oversubscribed: let the others run
      }
    }
  }

 private:
  static constexpr int kSpinsBeforeYield = 1 << 12;
  std::atomic<int> count_{0}, gen_{0};
  int size_ = 1;
};

// A linear layer of the row stack: quantized (qs, scales) or a 16-bit weight on
// Folio's kernel (half_linear).
struct RowLinear {
  const uint8_t* qs = nullptr;
  const uint8_t* scales = nullptr;
  int64_t fmt = 0, n = 0, k = 0, route = 0;  // route: as quant::row_route resolves it
  const void* half = nullptr;                // the 16-bit weight [n, k], rows ldw apart
  int64_t ldw = 0;
  at::ScalarType half_dtype = at::kBFloat16;
  const float* bias = nullptr;  // qkv's, in float32 (both kernels convert it so), or null
  int64_t groups() const { return (n + quant::kGroupRows - 1) / quant::kGroupRows; }
};

// A layer of the row stack.
struct RowLayer {
  const void* in_norm;
  const void* post_norm;
  RowLinear qkv, o, gate_up, down;
  RowLinear tail;          // q/k/v rows after qkv's in another format (n = 0: none)
  const void* tail_bias;   // with a tail, the qkv bias in the activations' dtype, added
                           // after both parts as decode_layer adds it; else null
  void* cache;             // keys; values plane elements later
};

// The operands of `layers` layers if the row stack takes them, else nothing: 1 to 8
// rows, at least two threads and not already in a parallel region, activations in a
// type every kernel here takes, and every linear layer either quantized, on a route that
// takes a tile of rows by itself (not AMX's tiles of 16, not dequantised), or 16-bit on
// Folio's kernel (not torch's GEMM or oneDNN); q/k/v may be in two formats.
// `qkv_bias` holds the layers' qkv biases as the stack adds them.
std::optional<std::vector<RowLayer>> row_layers(
    const at::Tensor& hidden, const std::vector<OptTensor>& w, const std::vector<int64_t>& meta,
    const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor>& qkv_bias) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  const auto dtype = hidden.scalar_type();
  if (layers == 0 || hidden.dim() != 2 || hidden.size(0) < 1 ||
      hidden.size(0) > quant::row_tile_rows() || at::get_num_threads() < 2 ||
      at::in_parallel_region() || !silu_and_mul_takes(dtype) ||
      !(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat))
    return std::nullopt;
  std::vector<RowLayer> out;
  for (int64_t i = 0; i < layers; ++i) {
    const OptTensor* wi = w.data() + i * kNumSlots;
    const int64_t* mi = meta.data() + i * kNumMeta;
    const int64_t* lm = mi + kLinearMeta;
    // one head shape, MLP width and cache layout for all (the stack plans attention once)
    if (kv_caches[i].sizes() != kv_caches[0].sizes() ||
        kv_caches[i].scalar_type() != kv_caches[0].scalar_type() ||
        !std::equal(mi, mi + kLinearMeta, meta.data()) || lm[8] != meta[kLinearMeta + 8])
      return std::nullopt;
    const bool tail = has(wi[kQkvTail]);
    // slots: qkv 2-3, o 5-6, gate_up 7-8, down 9-10, the tail 11-12 (its meta at lm + 12)
    constexpr int kSlot[5] = {kQkv, kO, kGateUp, kDown, kQkvTail};
    for (int l = 0; l < (tail ? 5 : 4); ++l) {
      const int64_t path = lm[3 * l];
      if (!has(wi[kSlot[l]])) return std::nullopt;
      const bool quantized = has(wi[kSlot[l] + 1]) && path != kMkldnn;
      if (quantized ? path == kNative ||
                          quant::row_route(quant_route(path), lm[3 * l + 1], dtype) < 0
                    : path != kKernel || !half_linear_takes(*wi[kSlot[l]]))
        return std::nullopt;
    }
    check(hidden, wi, mi, kv_caches[i], slot_mapping, cos, sin);  // decode_layer's checks
    const int64_t heads = mi[kHeads], kv_heads = mi[kKvHeads], hd = mi[kHeadDim];
    const int64_t hidden_size = hidden.size(1);
    const int64_t inter = lm[8] / 2;
    const auto linear = [&](int slot, const int64_t* m, int64_t k, int64_t n_want,
                            const float* bias) {
      TORCH_CHECK(m[2] == n_want, "decode_layer: a linear layer's width does not match the "
                  "model's shape");
      RowLinear lin;
      lin.n = m[2];
      lin.k = k;
      lin.bias = bias;
      const at::Tensor& weight = *wi[slot];
      if (m[0] == kKernel && !has(wi[slot + 1])) {  // (the loop above: half_linear_takes)
        TORCH_CHECK(weight.size(0) == lin.n && weight.size(1) == k,
                    "decode_layer: a weight's shape does not match the model's");
        lin.half = weight.const_data_ptr();
        lin.ldw = weight.stride(0);
        lin.half_dtype = weight.scalar_type();
        return lin;
      }
      const at::Tensor& sc = *wi[slot + 1];
      quant::check_quant_weight(k, weight, sc, m[1], m[2]);
      lin.qs = weight.const_data_ptr<uint8_t>();
      lin.scales = static_cast<const uint8_t*>(sc.const_data_ptr());
      lin.fmt = m[1];
      lin.route = quant::row_route(quant_route(m[0]), m[1], dtype);
      return lin;
    };
    const float* bias = nullptr;
    const void* tail_bias = nullptr;
    if (has(wi[kQkvBias])) {
      TORCH_CHECK(wi[kQkvBias]->numel() == (heads + 2 * kv_heads) * hd,
                  "decode_layer: qkv bias does not match the head shape");
      if (tail) {
        qkv_bias.push_back(wi[kQkvBias]->to(dtype).contiguous());
        tail_bias = qkv_bias.back().const_data_ptr();
      } else {
        qkv_bias.push_back(wi[kQkvBias]->to(at::kFloat).contiguous());
        bias = qkv_bias.back().const_data_ptr<float>();
      }
    }
    const int64_t qkv_n = (heads + 2 * kv_heads) * hd, head_n = tail ? lm[2] : qkv_n;
    for (int slot : {kInNorm, kPostNorm})
      TORCH_CHECK(wi[slot]->scalar_type() == dtype && wi[slot]->is_contiguous() &&
                      wi[slot]->numel() == hidden_size,
                  "decode_layer: the norm weights must be contiguous [hidden] in hidden's dtype");
    TORCH_CHECK(head_n > 0 && head_n < qkv_n + (tail ? 0 : 1),
                "decode_layer: qkv width does not match the head shape");
    out.push_back(RowLayer{wi[kInNorm]->const_data_ptr(), wi[kPostNorm]->const_data_ptr(),
                           linear(kQkv, lm, hidden_size, head_n, bias),
                           linear(kO, lm + 3, heads * hd, hidden_size, nullptr),
                           linear(kGateUp, lm + 6, hidden_size, 2 * inter, nullptr),
                           linear(kDown, lm + 9, inter, hidden_size, nullptr),
                           tail ? linear(kQkvTail, lm + 12, hidden_size, qkv_n - head_n, nullptr)
                                : RowLinear{},
                           tail_bias, kv_caches[i].data_ptr()});
  }
  return out;
}

// Every layer of a few rows (row_layers took them), as decode_layers.
template <typename T>
std::tuple<at::Tensor, at::Tensor> decode_layers_stacked(
    const at::Tensor& hidden, const std::vector<RowLayer>& layers,
    const std::vector<int64_t>& meta, const std::vector<at::Tensor>& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& cos, const at::Tensor& sin, double eps, double scale,
    std::optional<int64_t> sliding_window, int64_t v_pass) {
  const int64_t R = hidden.size(0), H = hidden.size(1), heads = meta[kHeads],
                kv_heads = meta[kKvHeads],
                hd = meta[kHeadDim], qkv_n = (heads + 2 * kv_heads) * hd,
                inter = layers[0].gate_up.n / 2;
  const auto dtype = hidden.scalar_type();
  const auto opts = hidden.options();
  // shared: the linear layers' outputs and attention's; `out` ends as the result
  at::Tensor qkv = at::empty({R, qkv_n}, opts), attn = at::empty({R, heads, hd}, opts),
             o = at::empty({R, H}, opts), gate_up = at::empty({R, 2 * inter}, opts),
             out = at::empty({R, H}, opts), res_out = at::empty({R, H}, opts);
  const int team_size = at::get_num_threads();
  // every layer's attention has the same block tables and lengths: planned once
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  TeamAttention attention(attn, kv_caches[0], tables, lens, scale, sliding_window, team_size,
                          v_pass);
  const int64_t plane = kv_caches[0].size(1) * kv_caches[0].size(2) * kv_heads * hd;
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const T* x_in = hidden.const_data_ptr<T>();
  const T* c = cos.const_data_ptr<T>();
  const T* s = sin.const_data_ptr<T>();
  T* qkv_p = qkv.data_ptr<T>();
  T* attn_p = attn.data_ptr<T>();
  T* o_p = o.data_ptr<T>();
  T* gate_up_p = gate_up.data_ptr<T>();
  T* out_p = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  SpinBarrier barrier;

#pragma omp parallel num_threads(team_size)
  {
#pragma omp single
    barrier.set_size(omp_get_num_threads());  // (the single's own barrier publishes it)
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    // this thread's rows: the residual stream, normed activations, queries, SiLU * up
    std::vector<T> res(R * H), h(R * H), q(R * heads * hd), act(R * inter);
    quant::Activations acts;
    std::vector<float> xf;  // the 16-bit kernel's widened rows
    // this thread's row groups of `lin` on x [R, k] into y (rows ldy apart); returns the
    // columns [first, last) it wrote
    const auto linear = [&](const RowLinear& lin, const T* x, T* y, int64_t ldy) {
      const int64_t per = (lin.groups() + nt - 1) / nt;
      const int64_t g0 = std::min(lin.groups(), tid * per);
      const int64_t g1 = std::min(lin.groups(), g0 + per);
      if (lin.half != nullptr) {
        half_prepare_rows(x, R, lin.k, dtype, lin.half_dtype, xf);
        half_row_blocks(xf.data(), R, lin.k, lin.half, lin.ldw, lin.half_dtype, lin.bias, g0,
                        g1, y, ldy, dtype);
      } else {
        quant::prepare_rows(lin.route, lin.fmt, x, R, lin.k, dtype, acts);
        quant::quant_row_groups(acts, R, lin.qs, lin.scales, lin.fmt, lin.k, lin.n, lin.bias,
                                lin.route, g0, g1, y, ldy, dtype);
      }
      return std::make_pair(g0 * quant::kGroupRows,
                            std::min(lin.n, g1 * quant::kGroupRows));
    };
    // a bias in T added as decode_layer's qkv.add_ adds it (rounded once to T) to the
    // columns [first, last) of every row of y [R, qkv_n]
    const auto add_bias = [&](const void* bias, std::pair<int64_t, int64_t> cols, T* y) {
      const T* b = static_cast<const T*>(bias);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = cols.first; j < cols.second; ++j)
          y[r * qkv_n + j] =
              static_cast<T>(static_cast<float>(y[r * qkv_n + j]) + static_cast<float>(b[j]));
    };
    for (size_t i = 0; i < layers.size(); ++i) {
      const RowLayer& L = layers[i];
      if (tid == 0) prefetch_slots(kv_caches[i], slots, R);
      if (i == 0) {  // the first layer: the residual is its input
        rms_norm_rows(x_in, nullptr, L.in_norm, h.data(), nullptr, R, H, feps, dtype);
        std::copy(x_in, x_in + R * H, res.begin());
      } else {
        rms_norm_rows(out_p, res.data(), L.in_norm, h.data(), res.data(), R, H, feps, dtype);
      }
      const auto head_rows = linear(L.qkv, h.data(), qkv_p, qkv_n);
      if (L.tail.n > 0) {
        auto tail_rows = linear(L.tail, h.data(), qkv_p + L.qkv.n, qkv_n);
        if (L.tail_bias != nullptr) {
          add_bias(L.tail_bias, head_rows, qkv_p);
          tail_rows = {tail_rows.first + L.qkv.n, tail_rows.second + L.qkv.n};
          add_bias(L.tail_bias, tail_rows, qkv_p);
        }
      }
      barrier.wait();  // qkv whole
      rotate_queries(qkv_p, R, heads, kv_heads, hd, c, s, q.data());
      if (tid == 0) {
        with_cache_type<T>(kv_caches[i], [&](auto* type) {
          using C = std::remove_pointer_t<decltype(type)>;
          C* cache = static_cast<C*>(L.cache);
          write_keys_values(qkv_p, R, heads, kv_heads, hd, c, s, slots, cache, cache + plane);
        });
        attention.reset();
      }
      barrier.wait();  // this step's key and value in the cache
      attention.work(q.data(), L.cache, attn_p);
      barrier.wait();  // attention whole
      linear(L.o, attn_p, o_p, H);
      barrier.wait();  // o whole
      rms_norm_rows(o_p, res.data(), L.post_norm, h.data(), res.data(), R, H, feps, dtype);
      linear(L.gate_up, h.data(), gate_up_p, 2 * inter);
      barrier.wait();  // gate/up whole
      silu_and_mul_rows(gate_up_p, act.data(), R, inter, dtype);
      linear(L.down, act.data(), out_p, H);
      barrier.wait();  // the layer's output whole
    }
    if (tid == 0) std::copy(res.begin(), res.end(), res_out.data_ptr<T>());
  }
  return {out, res_out};
}

// Every layer of a decode step in one call: layer i takes weights[i * kNumSlots, ...),
// meta[i * kNumMeta, ...) and kv_caches[i]. Same results as decode_layer called layer by
// layer; what goes away is a dispatcher round trip and the argument lists' conversion
// per layer, which at batch 1 cost more than a small model's norms and RoPE.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const std::vector<OptTensor>& w, const std::vector<int64_t>& meta,
    const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos,
    const at::Tensor& sin, double eps, double scale, std::optional<int64_t> sliding_window,
    int64_t v_pass) {
  const auto layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(w.size()) == layers * kNumSlots,
              "decode_layers: weights must hold ", kNumSlots, " entries per layer");
  TORCH_CHECK(static_cast<int64_t>(meta.size()) == layers * kNumMeta,
              "decode_layers: meta must hold ", kNumMeta, " ints per layer");
  std::vector<at::Tensor> qkv_bias;  // the row stack's, as it adds them
  if (auto row = row_layers(hidden, w, meta, kv_caches, slot_mapping, cos, sin, qkv_bias)) {
    std::tuple<at::Tensor, at::Tensor> result;
    vec::with_element_type(hidden.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      result = decode_layers_stacked<T>(hidden, *row, meta, kv_caches, slot_mapping,
                                        block_tables, seq_lens, cos, sin, eps, scale,
                                        sliding_window, v_pass);
    });
    return result;
  }
  at::Tensor h = hidden;
  OptTensor res;
  for (int64_t i = 0; i < layers; ++i) {
    const std::vector<OptTensor> wi(w.begin() + i * kNumSlots, w.begin() + (i + 1) * kNumSlots);
    const std::vector<int64_t> mi(meta.begin() + i * kNumMeta, meta.begin() + (i + 1) * kNumMeta);
    auto [out, r] = decode_layer(h, res, wi, mi, kv_caches[i], slot_mapping, block_tables,
                                 seq_lens, cos, sin, eps, scale, sliding_window, v_pass);
    h = std::move(out);
    res = std::move(r);
  }
  return {h, res.has_value() ? *res : at::Tensor()};
}

// Whether decode_layers runs these operands as the row stack (else layer by layer).
bool decode_layers_stack_takes(const at::Tensor& hidden, const std::vector<OptTensor>& w,
                                 const std::vector<int64_t>& meta,
                                 const std::vector<at::Tensor>& kv_caches,
                                 const at::Tensor& slot_mapping, const at::Tensor& cos,
                                 const at::Tensor& sin) {
  const auto layers = static_cast<int64_t>(kv_caches.size());
  if (static_cast<int64_t>(w.size()) != layers * kNumSlots ||
      static_cast<int64_t>(meta.size()) != layers * kNumMeta)
    return false;
  std::vector<at::Tensor> qkv_bias;
  return row_layers(hidden, w, meta, kv_caches, slot_mapping, cos, sin, qkv_bias).has_value();
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
        "Tensor cos, Tensor sin, float eps, float scale, int? sliding_window=None, "
        "int v_pass=0) -> (Tensor, Tensor)");
  // decode_layer for every layer: weights and meta concatenated layer after layer
  m.def("decode_layers(Tensor hidden, Tensor?[] weights, int[] meta, Tensor(a!)[] kv_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor cos, Tensor sin, "
        "float eps, float scale, int? sliding_window=None, int v_pass=0) -> (Tensor, Tensor)");
  // whether decode_layers runs these operands in one parallel region (the row stack)
  m.def("decode_layers_stack_takes(Tensor hidden, Tensor?[] weights, int[] meta, "
        "Tensor[] kv_caches, Tensor slot_mapping, Tensor cos, Tensor sin) -> bool");
}

TORCH_LIBRARY_IMPL(folio, CPU, m) {
  m.impl("decode_layer", &folio::decode_layer);
  m.impl("decode_layers", &folio::decode_layers);
  m.impl("decode_layers_stack_takes", &folio::decode_layers_stack_takes);
}

// A weight prepacked for oneDNN (the mkldnn path) is an MkldnnCPU tensor, and the
// dispatcher routes a call by its arguments' highest key: the same kernels serve it.
TORCH_LIBRARY_IMPL(folio, MkldnnCPU, m) {
  m.impl("decode_layer", &folio::decode_layer);
  m.impl("decode_layers", &folio::decode_layers);
}
