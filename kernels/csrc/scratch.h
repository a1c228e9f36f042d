// Scratch buffers the kernels keep per thread between calls (the prepared activations),
// so that decode steps allocate nothing. A prefill chunk's rows make them tens of MB
// (2048 rows x 5632 k of a 1B model's down projection: 23 MB of bf16 pairs), which a
// vector would then hold for the life of the worker, above the memory bound decoding
// needs; `release_if_large` lets such a buffer go after its call.
#pragma once

#include <cstddef>

namespace folio {

constexpr std::size_t kScratchKeepBytes = std::size_t(4) << 20;

template <typename V>
void release_if_large(V& v) {
  if (v.capacity() * sizeof(typename V::value_type) > kScratchKeepBytes) V().swap(v);
}

}  // namespace folio
