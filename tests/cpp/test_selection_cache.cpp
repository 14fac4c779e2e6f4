// A selection cache larger than the budget (config::cache_tokens; docs/semantics.md, Decode 6):
//  * the slot rule itself (lru_selection_cache.hpp): empty slots first, then the least recently selected slot not
//    selected at this step, ties by the lowest index; invariants over a long random sequence of selections;
//  * the store on the CPU backend (the CUDA backend's select kernel is checked against this rule in
//    tests/cuda/test_chunk_selection.cu and its store against this one in test_cuda_parity.py and
//    test_value_cache.py): cache_tokens = 0 and = budget are the same store bit for bit; a larger cache selects the
//    same chunks, attends to exactly them (outputs equal to float rounding), hits at least as often, strictly more
//    on alternating queries; memory_report() counts its slots; release and a new prefill start it cold.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "lru_selection_cache.hpp"
#include "shadowkv/config.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/store.hpp"
#include "store_test_support.hpp"

namespace {

using shadowkv::config;
using shadowkv::kv_store;
using shadowkv::detail::assign_lru_slots;
using shadowkv::detail::lru_cache_slots;
using shadowkv_test::mutable_view_of;
using shadowkv_test::random_source;
using shadowkv_test::view_of;

// ---------------------------------------------------------------------------------------------------------------
// the slot rule
// ---------------------------------------------------------------------------------------------------------------

struct slot_table {
  explicit slot_table(std::size_t capacity)
      : chunk(capacity, -1), last_used(capacity, 0), selected(capacity, 0), rebuild(capacity, 0), fetch(capacity, 0) {}

  std::int64_t place(const std::vector<std::int64_t>& chosen, std::int64_t now) {
    std::vector<std::uint8_t> is_hit(chosen.size());
    return assign_lru_slots(chosen, now, lru_cache_slots{chunk, last_used, selected, rebuild, fetch}, is_hit);
  }

  std::vector<std::int64_t> chunk, last_used;
  std::vector<std::uint8_t> selected, rebuild, fetch;
};

TEST(LruSelectionCache, EmptySlotsFirstThenLeastRecentlySelectedThenLowestIndex) {
  slot_table t(4);
  EXPECT_EQ(t.place({10, 11}, 1), 0);
  EXPECT_EQ(t.chunk, (std::vector<std::int64_t>{10, 11, -1, -1}));
  EXPECT_EQ(t.rebuild, (std::vector<std::uint8_t>{1, 1, 0, 0}));
  EXPECT_EQ(t.fetch, t.rebuild);

  EXPECT_EQ(t.place({11, 12}, 2), 1);  // 11 hits; 12 takes the lowest empty slot, not slot 0 (unselected)
  EXPECT_EQ(t.chunk, (std::vector<std::int64_t>{10, 11, 12, -1}));
  EXPECT_EQ(t.selected, (std::vector<std::uint8_t>{0, 1, 1, 0}));
  EXPECT_EQ(t.rebuild, (std::vector<std::uint8_t>{0, 0, 1, 0}));

  // 13 takes the last empty slot; 14 evicts the least recently selected: slot 0 (step 1) before slots 1, 2 (step 2).
  EXPECT_EQ(t.place({13, 14}, 3), 0);
  EXPECT_EQ(t.chunk, (std::vector<std::int64_t>{14, 11, 12, 13}));
  EXPECT_EQ(t.last_used, (std::vector<std::int64_t>{3, 2, 2, 3}));

  // 11 hits (its slot is then not evictable); 10 evicts slot 2 (step 2; slot 1 is selected at this step).
  EXPECT_EQ(t.place({10, 11}, 4), 1);
  EXPECT_EQ(t.chunk, (std::vector<std::int64_t>{14, 11, 10, 13}));
  EXPECT_EQ(t.selected, (std::vector<std::uint8_t>{0, 1, 1, 0}));

  // Slots 0 and 3 were both last selected at step 3: the tie goes to the lower index.
  EXPECT_EQ(t.place({20}, 5), 0);
  EXPECT_EQ(t.chunk, (std::vector<std::int64_t>{20, 11, 10, 13}));
  EXPECT_EQ(t.selected, (std::vector<std::uint8_t>{1, 0, 0, 0}));

  // A hit on a chunk that is held but was not selected last step (the point of the larger cache).
  EXPECT_EQ(t.place({13, 20}, 6), 2);
  EXPECT_EQ(t.rebuild, (std::vector<std::uint8_t>{0, 0, 0, 0}));
}

TEST(LruSelectionCache, InvariantsOverRandomSelections) {
  const std::uint64_t seed = 9100;
  std::mt19937_64 engine(seed);
  constexpr std::size_t k = 6;
  constexpr std::size_t capacity = 11;
  slot_table t(capacity);
  for (std::int64_t now = 1; now <= 400; ++now) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " step " + std::to_string(now));
    // Correlated selections: k ids drawn from a window over 30 chunks that drifts slowly.
    std::set<std::int64_t> picked;
    std::uniform_int_distribution<std::int64_t> id(now / 20, now / 20 + 29);
    while (picked.size() < k) picked.insert(id(engine));
    const std::vector<std::int64_t> chosen(picked.begin(), picked.end());
    const std::vector<std::int64_t> before = t.chunk;
    const std::vector<std::int64_t> stamps_before = t.last_used;
    std::int64_t expected_hits = 0;
    for (const std::int64_t c : chosen) expected_hits += std::count(before.begin(), before.end(), c);
    ASSERT_EQ(t.place(chosen, now), expected_hits);

    std::multiset<std::int64_t> selected_chunks;
    std::int64_t oldest_kept = INT64_MAX;
    for (std::size_t s = 0; s < capacity; ++s) {
      if (t.selected[s] != 0) {
        selected_chunks.insert(t.chunk[s]);
        EXPECT_EQ(t.last_used[s], now);
        EXPECT_EQ(t.rebuild[s], before[s] == t.chunk[s] ? 0 : 1) << "slot " << s;
      } else {
        EXPECT_EQ(t.chunk[s], before[s]) << "an unselected slot keeps its chunk";
        EXPECT_EQ(t.rebuild[s], 0);
        if (t.chunk[s] >= 0) oldest_kept = std::min(oldest_kept, t.last_used[s]);
      }
    }
    EXPECT_EQ(selected_chunks, std::multiset<std::int64_t>(chosen.begin(), chosen.end()))
        << "the selected slots hold exactly the chosen chunks, each once";
    for (std::size_t s = 0; s < capacity; ++s) {
      if (t.rebuild[s] == 0 || before[s] < 0) continue;
      EXPECT_LE(stamps_before[s], oldest_kept) << "slot " << s << " was evicted before an older unselected one";
      EXPECT_EQ(std::count(t.chunk.begin(), t.chunk.end(), -1), 0) << "evicted while an empty slot was left";
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// the store (CPU backend)
// ---------------------------------------------------------------------------------------------------------------

// Two layers, GQA 4/2, D 64, budget 4 chunks, window 16: folds every 8 steps once the window is full.
config cache_config(std::int64_t cache_tokens) {
  config cfg = shadowkv_test::twin_config();
  cfg.kv_dtype = shadowkv::dtype::float32;
  cfg.max_seq_len = 400;
  cfg.cache_tokens = cache_tokens;
  return cfg;
}

// Stores fed the same seeded data: a ragged batch of three sequences over both layers (one with a warm-up query),
// then decode steps of the whole batch.
class same_history {
 public:
  same_history(std::vector<config> configs, std::uint64_t seed) : rng_(seed), cfg_(configs.front()) {
    for (const config& cfg : configs) stores_.emplace_back(cfg);
    for (kv_store& s : stores_) EXPECT_EQ(s.add_sequences(3), (std::vector<int>{0, 1, 2}));
    const std::int64_t lengths[] = {150, 97, 201};
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      for (int slot = 0; slot < 3; ++slot) prefill(layer, slot, lengths[slot], slot == 0);
    }
  }

  void prefill(int layer, int slot, std::int64_t length, bool with_query) {
    const auto keys = rng_.normals(static_cast<std::size_t>(length * cfg_.kv_width()));
    const auto values = rng_.normals(static_cast<std::size_t>(length * cfg_.kv_width()));
    const auto q_last = rng_.normals(static_cast<std::size_t>(cfg_.num_q_heads * cfg_.head_dim), 3.0F);
    for (kv_store& s : stores_) {
      shadowkv::prefill_options options;
      if (with_query) options.q_last = view_of(q_last, {1, 1, cfg_.num_q_heads, cfg_.head_dim});
      s.prefill(layer, std::vector<int>{slot}, view_of(keys, {1, length, cfg_.num_kv_heads, cfg_.head_dim}),
                view_of(values, {1, length, cfg_.num_kv_heads, cfg_.head_dim}), options);
    }
  }

  /// One step of `layer` for slots {0, 1, 2} with `q` (or fresh random queries); the outputs of every store.
  std::vector<std::vector<float>> step(int layer, std::vector<float> q = {}) {
    constexpr std::int64_t batch = 3;
    if (q.empty()) q = rng_.normals(static_cast<std::size_t>(batch * cfg_.num_q_heads * cfg_.head_dim), 3.0F);
    const auto k = rng_.normals(static_cast<std::size_t>(batch * cfg_.kv_width()));
    const auto v = rng_.normals(static_cast<std::size_t>(batch * cfg_.kv_width()));
    std::vector<std::vector<float>> outputs;
    for (kv_store& s : stores_) {
      std::vector<float> out(q.size(), -1.0F);
      s.decode(layer, std::vector<int>{0, 1, 2}, view_of(q, {batch, cfg_.num_q_heads, cfg_.head_dim}),
               view_of(k, {batch, cfg_.num_kv_heads, cfg_.head_dim}),
               view_of(v, {batch, cfg_.num_kv_heads, cfg_.head_dim}),
               mutable_view_of(out, {batch, cfg_.num_q_heads, cfg_.head_dim}));
      EXPECT_TRUE(shadowkv_test::all_finite(out));
      EXPECT_GT(shadowkv_test::norm(out), 0.05);
      outputs.push_back(std::move(out));
    }
    return outputs;
  }

  std::vector<float> random_queries() {
    return rng_.normals(static_cast<std::size_t>(3 * cfg_.num_q_heads * cfg_.head_dim), 3.0F);
  }

  kv_store& store(std::size_t i) { return stores_[i]; }

 private:
  random_source rng_;
  config cfg_;
  std::vector<kv_store> stores_;
};

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0;
  double base = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    base += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / base);
}

TEST(CacheTokens, ZeroIsACacheOfExactlyTheBudgetBitForBit) {
  const std::uint64_t seed = 9200;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const config base = cache_config(0);
  same_history run({base, cache_config(base.budget)}, seed);
  EXPECT_EQ(run.store(0).get_config().cache_tokens, base.budget) << "0 means the budget";
  EXPECT_EQ(run.store(0).get_config().cache_slots(), base.budget_chunks());
  for (int i = 0; i < 40; ++i) {
    for (int layer = 0; layer < base.num_layers; ++layer) {
      const auto outputs = run.step(layer);
      ASSERT_EQ(outputs[0], outputs[1]) << "step " << i << " layer " << layer;
      for (int slot = 0; slot < 3; ++slot) {
        ASSERT_EQ(run.store(0).selected_chunks(layer, slot), run.store(1).selected_chunks(layer, slot));
      }
    }
  }
  const shadowkv::store_stats a = run.store(0).stats();
  const shadowkv::store_stats b = run.store(1).stats();
  EXPECT_EQ(a.hits, b.hits);
  EXPECT_EQ(a.misses, b.misses);
  EXPECT_EQ(a.folds, b.folds);
  EXPECT_GT(a.folds, 0);
  EXPECT_EQ(run.store(0).memory().selection_cache, run.store(1).memory().selection_cache);
}

TEST(CacheTokens, LargerCacheSelectsAndAttendsTheSameChunksAndHitsMore) {
  const std::uint64_t seed = 9201;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const config base = cache_config(0);
  same_history run({base, cache_config(2 * base.budget), cache_config(4 * base.budget)}, seed);
  // Queries drawn from a small pool, so that selections recur as a decoder's do (and a larger cache has more to hit).
  const std::vector<std::vector<float>> pool = {run.random_queries(), run.random_queries(), run.random_queries()};
  double worst = 0.0;
  for (int i = 0; i < 40; ++i) {
    for (int layer = 0; layer < base.num_layers; ++layer) {
      const auto outputs = run.step(layer, pool[static_cast<std::size_t>(i * 7 + layer) % pool.size()]);
      for (std::size_t s = 1; s < outputs.size(); ++s) {
        worst = std::max(worst, relative_difference(outputs[s], outputs[0]));
        for (int slot = 0; slot < 3; ++slot) {
          ASSERT_EQ(run.store(s).selected_chunks(layer, slot), run.store(0).selected_chunks(layer, slot))
              << "step " << i << " layer " << layer << " slot " << slot;
        }
      }
    }
  }
  // The same chunks in another slot order: the attention sums in another order (float32 outputs).
  EXPECT_LE(worst, 1e-5);
  const shadowkv::store_stats k = run.store(0).stats();
  for (std::size_t s = 1; s < 3; ++s) {
    const shadowkv::store_stats larger = run.store(s).stats();
    EXPECT_EQ(larger.hits + larger.misses, k.hits + k.misses);
    EXPECT_GE(larger.hits, k.hits);
    EXPECT_EQ(larger.chunks_rebuilt, larger.misses);
    EXPECT_EQ(larger.bytes_fetched, larger.misses * base.value_run_bytes());
  }
  EXPECT_GE(run.store(2).stats().hits, run.store(1).stats().hits);
}

TEST(CacheTokens, AlternatingQueriesHitOnlyWithTwiceTheBudget) {
  const std::uint64_t seed = 9202;
  SCOPED_TRACE("seed " + std::to_string(seed));
  config base = cache_config(0);
  base.generation_window = 256;  // no fold: the candidates stay fixed, so two queries select two fixed sets
  config twice = base;
  twice.cache_tokens = 2 * base.budget;
  same_history run({base, twice}, seed);
  const std::vector<float> first = run.random_queries();
  const std::vector<float> second = run.random_queries();
  for (kv_store* s : {&run.store(0), &run.store(1)}) s->reset_stats();
  for (int i = 0; i < 20; ++i) run.step(0, i % 2 == 0 ? first : second);
  const shadowkv::store_stats k = run.store(0).stats();
  const shadowkv::store_stats two_k = run.store(1).stats();
  // With 2k slots both selections stay cached: only the first two steps miss.
  const std::int64_t per_step = 3 * base.num_kv_heads * base.budget_chunks();
  EXPECT_EQ(two_k.hits + two_k.misses, 20 * per_step);
  EXPECT_LE(two_k.misses, 2 * per_step);
  EXPECT_GT(two_k.hits, k.hits) << "k: " << k.hits << " hits, 2k: " << two_k.hits;
}

TEST(CacheTokens, MemoryReportCountsEverySlot) {
  const config base = cache_config(0);
  same_history run({base, cache_config(3 * base.budget)}, 9203);
  const std::int64_t per_chunk = base.chunk_size * base.kv_width() * 2 * 4;  // keys and values, float32
  const std::int64_t layers_and_sequences = base.num_layers * 3;
  EXPECT_EQ(run.store(0).memory().selection_cache, layers_and_sequences * base.budget_chunks() * per_chunk);
  EXPECT_EQ(run.store(1).memory().selection_cache, layers_and_sequences * 3 * base.budget_chunks() * per_chunk);
  EXPECT_EQ(run.store(1).memory().total() - run.store(0).memory().total(),
            layers_and_sequences * 2 * base.budget_chunks() * per_chunk);
}

TEST(CacheTokens, ReleaseAndANewPrefillStartCold) {
  const config base = cache_config(4 * cache_config(0).budget);
  same_history run({base}, 9204);
  for (int i = 0; i < 6; ++i) run.step(0);
  kv_store& store = run.store(0);
  store.release(std::vector<int>{1});
  EXPECT_EQ(store.add_sequences(1), (std::vector<int>{1}));
  store.reset_stats();
  run.prefill(0, 1, 150, /*with_query=*/true);
  const shadowkv::store_stats st = store.stats();
  EXPECT_EQ(st.hits, 0) << "the new sequence's cache must start empty";
  EXPECT_EQ(st.misses, base.num_kv_heads * base.budget_chunks());
}

TEST(CacheTokens, ClampedWithTheBudgetToWhatASequenceCanHold) {
  config cfg = cache_config(0);
  cfg.max_seq_len = 100;                            // 12 whole chunks of 8
  cfg.cache_tokens = std::int64_t{8} * INT_MAX;     // the largest valid value
  kv_store store(cfg);
  EXPECT_EQ(store.get_config().cache_tokens, 96);
  EXPECT_EQ(store.get_config().budget, cfg.budget);
  cfg.budget = 200;
  cfg.cache_tokens = 400;
  kv_store both_clamped(cfg);
  EXPECT_EQ(both_clamped.get_config().budget, 96);
  EXPECT_EQ(both_clamped.get_config().cache_tokens, 96);
}

TEST(CacheTokens, CapacityCheckCountsTheCache) {
  config cfg = cache_config(0);
  cfg.max_seq_len = std::int64_t{1} << 40;
  cfg.head_dim = 1024;
  cfg.cache_tokens = std::int64_t{8} << 30;  // 2^30 slots x 8 tokens x 2 heads x 1024 x keys and values: 128 TiB
  try {
    kv_store store(cfg);
    FAIL() << "expected out_of_memory";
  } catch (const shadowkv::out_of_memory& error) {
    EXPECT_NE(std::string(error.what()).find("cache_tokens"), std::string::npos) << error.what();
  }
  cfg.cache_tokens = 0;
  EXPECT_NO_THROW(kv_store store(cfg));
}

}  // namespace
