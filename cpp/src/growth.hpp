// How the CPU backend's per-sequence arrays grow: the exact region gains a row per decode step, the factors, landmarks
// and value store a chunk per fold. Reserving exactly what the next step needs reallocated and copied the whole array
// every time (every decode step copied the exact region; every fold copied the whole value store and A). Growing in
// steps copies each array once per step of growth instead, and never past what the array can ever hold; what
// memory_report() counts (the elements held) is unchanged.
#pragma once

#include <algorithm>
#include <cstdint>

namespace shadowkv::detail {

/// The capacity to reserve so that `needed` elements fit: `capacity` when they already do (nothing to reserve), else
/// `capacity + step` but no more than `limit` (the most the array can ever hold), and never less than `needed`.
[[nodiscard]] constexpr std::int64_t grown_capacity(std::int64_t capacity, std::int64_t needed, std::int64_t step,
                                                    std::int64_t limit) noexcept {
  if (needed <= capacity) return capacity;
  return std::max(needed, std::min(capacity + step, limit));
}

}  // namespace shadowkv::detail
