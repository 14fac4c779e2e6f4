// detail::advance_generated (cpp/src/fold_rule.hpp): the O(1) form of the fold rule that account_replayed_steps uses
// equals running the rule step by step (docs/semantics.md, decode step 1), for every window, chunk size, starting
// state and step count tried, and stays exact for step counts near INT64_MAX.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "fold_rule.hpp"
#include "shadowkv/generated_region.hpp"

namespace {

using shadowkv::detail::advance_generated;
using shadowkv::detail::generated_advance;

// The rule as a decode step applies it: the one-step functions the store and the CUDA kernel call
// (shadowkv/generated_region.hpp), ring included (it must come back to where the region's oldest token is).
generated_advance loop_advance(std::int64_t exact, std::int64_t steps, std::int64_t window, std::int64_t chunk) {
  generated_advance result{0, exact};
  shadowkv::rules::generated_region<std::int64_t> region{0, exact, 0};
  for (std::int64_t s = 0; s < steps; ++s) {
    if (shadowkv::rules::fold_due(region.exact_len, window)) {
      region = shadowkv::rules::after_fold(region, chunk, window);
      result.folds += 1;
    }
    region.exact_len += 1;
  }
  EXPECT_EQ(region.context_chunks, result.folds);
  // The ring moved by `chunk` rows per fold.
  EXPECT_EQ(region.ring_head, (result.folds % window) * chunk % window);
  result.generated_exact_len = region.exact_len;
  return result;
}

TEST(FoldRule, ClosedFormEqualsTheLoop) {
  std::int64_t compared = 0;
  for (const std::int64_t chunk : {1, 2, 3, 8, 16}) {
    for (const std::int64_t multiple : {1, 2, 3, 5}) {
      const std::int64_t window = chunk * multiple;
      for (std::int64_t exact = 0; exact <= window; ++exact) {
        for (std::int64_t steps = 0; steps <= 4 * window + 3 * chunk + 5; ++steps) {
          const generated_advance loop = loop_advance(exact, steps, window, chunk);
          const generated_advance closed = advance_generated(exact, steps, window, chunk);
          ASSERT_EQ(closed.folds, loop.folds)
              << "window " << window << " chunk " << chunk << " exact " << exact << " steps " << steps;
          ASSERT_EQ(closed.generated_exact_len, loop.generated_exact_len)
              << "window " << window << " chunk " << chunk << " exact " << exact << " steps " << steps;
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 10000);
}

TEST(FoldRule, LongRunsMatchTheLoop) {
  // The store's own configurations: window 256 and 16 with chunk 8, thousands of steps from every reachable state.
  for (const std::int64_t window : {16, 256}) {
    for (std::int64_t exact = 0; exact <= window; exact += 5) {
      for (const std::int64_t steps : {1000, 4093, 100000}) {
        const generated_advance loop = loop_advance(exact, steps, window, 8);
        const generated_advance closed = advance_generated(exact, steps, window, 8);
        EXPECT_EQ(closed.folds, loop.folds) << window << " " << exact << " " << steps;
        EXPECT_EQ(closed.generated_exact_len, loop.generated_exact_len) << window << " " << exact << " " << steps;
      }
    }
  }
}

TEST(FoldRule, HugeStepCountsDoNotOverflow) {
  const std::int64_t most = std::numeric_limits<std::int64_t>::max();
  for (const std::int64_t chunk : {1, 8, 1 << 20}) {
    const std::int64_t window = 4 * chunk;
    for (const std::int64_t exact : {std::int64_t{0}, window / 2, window}) {
      const std::int64_t steps = most - exact;  // everything the int64 counters could ever hold
      const generated_advance closed = advance_generated(exact, steps, window, chunk);
      // Invariants: the region ends in (window - chunk, window], and tokens are conserved.
      EXPECT_GT(closed.generated_exact_len, window - chunk);
      EXPECT_LE(closed.generated_exact_len, window);
      EXPECT_EQ(closed.folds * chunk + closed.generated_exact_len, exact + steps);
    }
    // Even INT64_MAX steps from a full region (more than any store can be asked for) stay exact.
    const generated_advance from_full = advance_generated(window, most, window, chunk);
    EXPECT_EQ(from_full.folds, most / chunk + (most % chunk != 0 ? 1 : 0));
    EXPECT_GT(from_full.generated_exact_len, window - chunk);
    EXPECT_LE(from_full.generated_exact_len, window);
  }
}

}  // namespace
