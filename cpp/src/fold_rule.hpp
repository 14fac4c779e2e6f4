// The fold rule of docs/semantics.md (decode step 1) applied to many steps at once, in O(1).
//
// One decode step does: "if the exact generated region holds `window` tokens, fold its oldest `chunk` tokens into the
// compressed store; then append the new token". account_replayed_steps must advance the host counters by up to
// max_seq_len such steps, so it uses this closed form instead of a loop (tests/cpp/test_fold_rule.cpp checks that
// they agree).
#pragma once

#include <cstdint>

namespace shadowkv::detail {

/// The effect of a run of decode steps on one sequence's generated region.
struct generated_advance {
  std::int64_t folds = 0;                ///< chunks folded into the compressed store during the run
  std::int64_t generated_exact_len = 0;  ///< exact (unfolded) generated tokens after the run
};

/// The counters after `steps` decode steps that start with `exact_len` exact generated tokens.
/// Preconditions (the store's invariants): 1 <= chunk <= window, 0 <= exact_len <= window, steps >= 0.
/// No intermediate value exceeds max(steps, window), so any step count representable in int64 is exact.
[[nodiscard]] constexpr generated_advance advance_generated(std::int64_t exact_len, std::int64_t steps,
                                                            std::int64_t window, std::int64_t chunk) noexcept {
  // The region fills up without folding first; from then on every `chunk` steps start with one fold
  // (full -> window - chunk + 1 -> ... -> full again).
  const std::int64_t until_full = window - exact_len;
  if (steps <= until_full) return {0, exact_len + steps};
  const std::int64_t after_full = steps - until_full;  // >= 1: the first of these steps folds
  const std::int64_t into_period = after_full % chunk;  // steps since the last fold, 0 meaning a whole period
  const std::int64_t folds = after_full / chunk + (into_period != 0 ? 1 : 0);
  return {folds, window - (into_period != 0 ? chunk - into_period : 0)};
}

}  // namespace shadowkv::detail
