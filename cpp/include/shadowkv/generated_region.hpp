// The exact generated region of one (sequence, layer) and its fold rule (docs/semantics.md, Decode step 1), written
// once for the store's host counters (store.cpp) and the CUDA kernel that folds and appends on the device
// (generated_tokens.cu). detail::advance_generated (cpp/src/fold_rule.hpp) is the closed form of many steps of it
// (tests/cpp/test_fold_rule.cpp checks that they agree).
//
// The region holds `exact_len` <= window generated tokens after the prompt's exact rows; the CUDA backend keeps them
// in a ring of `window` rows whose oldest row is `ring_head` (the CPU backend keeps them in order: its ring head is
// always 0). A decode step first folds the oldest `chunk` tokens into one more compressed context chunk when the
// region is full, then appends the new token.
#pragma once

#include "shadowkv/host_device.hpp"

namespace shadowkv::rules {

/// Counters of a generated region (I: the integer type of the caller's counters).
template <typename I>
struct generated_region {
  I context_chunks;  ///< compressed context chunks (prompt chunks + folded ones)
  I exact_len;       ///< exact generated tokens
  I ring_head;       ///< ring row of the oldest exact generated token
};

/// Whether this step folds before it appends: the region holds a whole window.
template <typename I>
SHADOWKV_HOST_DEVICE constexpr bool fold_due(I exact_len, I window) {
  return exact_len == window;
}

/// The region after folding its oldest `chunk` tokens into context chunk `context_chunks` (the new last one).
template <typename I>
SHADOWKV_HOST_DEVICE constexpr generated_region<I> after_fold(generated_region<I> region, I chunk, I window) {
  return {region.context_chunks + 1, region.exact_len - chunk, (region.ring_head + chunk) % window};
}

/// Ring row (0 .. window - 1) of the generated token `i` places after the oldest; i = exact_len is where the next
/// token is appended.
template <typename I>
SHADOWKV_HOST_DEVICE constexpr I ring_row(I ring_head, I i, I window) {
  return (ring_head + i) % window;
}

}  // namespace shadowkv::rules
