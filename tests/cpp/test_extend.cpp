// extend and truncate (docs/semantics.md, "Extend" and "Truncate"), each proven by an equality with the decode path:
// extend of one token is decode; extend with extend_block = 1 is one decode per token; after extend a sequence holds
// the decode path's state; after truncate a sequence decodes as one that never saw the removed tokens. Plus exactness
// at full rank and budget, and bad input that changes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "shadowkv/errors.hpp"
#include "shadowkv/store.hpp"
#include "store_test_support.hpp"

namespace {

using shadowkv::config;
using shadowkv::kv_store;
using shadowkv_test::mutable_view_of;
using shadowkv_test::random_source;
using shadowkv_test::view_of;

using variant = shadowkv_test::store_variant;

/// One layer (two for truncate), GQA 4/2, D 64, window 16 (folds every 8 tokens once full), blocks of 8.
config extend_config(variant v, int layers = 1) {
  config cfg = shadowkv_test::variant_config(v);
  cfg.num_layers = layers;
  return cfg;
}

using shadowkv_test::make_tokens;
using shadowkv_test::token_data;

/// Token t of row b of `data` (whose rows hold `per_row` floats each over `tokens` tokens), as one row.
std::vector<float> token_rows(const std::vector<float>& data, std::int64_t batch, std::int64_t tokens, std::int64_t t,
                              std::int64_t per_token, const std::vector<std::int64_t>& rows) {
  std::vector<float> out;
  for (const std::int64_t b : rows) {
    (void)batch;
    const auto first = data.begin() + (b * tokens + t) * per_token;
    out.insert(out.end(), first, first + per_token);
  }
  return out;
}

class extend_test : public ::testing::TestWithParam<variant> {
 protected:
  /// Two stores of `cfg` with the same two prompts (lengths 100 and 77) prefilled in every layer, with a warm query.
  void make_stores(const config& cfg) {
    cfg_ = cfg;
    a_ = std::make_unique<kv_store>(cfg);
    b_ = std::make_unique<kv_store>(cfg);
    random_source rng(17);
    for (kv_store* s : {a_.get(), b_.get()}) ASSERT_EQ(s->add_sequences(2), (std::vector<int>{0, 1}));
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      const std::int64_t length = 100;
      const auto keys = rng.normals(static_cast<std::size_t>(2 * length * cfg.kv_width()));
      const auto values = rng.normals(static_cast<std::size_t>(2 * length * cfg.kv_width()));
      const auto q_last = rng.normals(static_cast<std::size_t>(2 * cfg.num_q_heads * cfg.head_dim));
      for (kv_store* s : {a_.get(), b_.get()}) {
        shadowkv::prefill_options options;
        options.lengths = {100, 77};
        options.q_last = view_of(q_last, {2, 1, cfg.num_q_heads, cfg.head_dim});
        s->prefill(layer, slots_, view_of(keys, {2, length, cfg.num_kv_heads, cfg.head_dim}),
                   view_of(values, {2, length, cfg.num_kv_heads, cfg.head_dim}), options);
      }
    }
  }

  /// extend on `s` with `d` (lengths optional); returns out [B, T, Hq, D].
  std::vector<float> extend(kv_store& s, int layer, const token_data& d, std::vector<std::int64_t> lengths = {}) {
    std::vector<float> out(d.q.size(), -7.0F);
    shadowkv::extend_options options;
    options.lengths = std::move(lengths);
    s.extend(layer, slots_, view_of(d.q, {d.batch, d.tokens, cfg_.num_q_heads, cfg_.head_dim}),
             view_of(d.k, {d.batch, d.tokens, cfg_.num_kv_heads, cfg_.head_dim}),
             view_of(d.v, {d.batch, d.tokens, cfg_.num_kv_heads, cfg_.head_dim}),
             mutable_view_of(out, {d.batch, d.tokens, cfg_.num_q_heads, cfg_.head_dim}), options);
    return out;
  }

  /// Token t of `d` as one decode call on `s` for the sequences in `rows`; returns out [rows, Hq, D].
  std::vector<float> decode_token(kv_store& s, int layer, const token_data& d, std::int64_t t,
                                  const std::vector<std::int64_t>& rows) {
    const std::int64_t q_width = static_cast<std::int64_t>(cfg_.num_q_heads) * cfg_.head_dim;
    const auto q = token_rows(d.q, d.batch, d.tokens, t, q_width, rows);
    const auto k = token_rows(d.k, d.batch, d.tokens, t, cfg_.kv_width(), rows);
    const auto v = token_rows(d.v, d.batch, d.tokens, t, cfg_.kv_width(), rows);
    const auto n = static_cast<std::int64_t>(rows.size());
    std::vector<int> slots;
    for (const std::int64_t b : rows) slots.push_back(slots_[static_cast<std::size_t>(b)]);
    std::vector<float> out(q.size(), -7.0F);
    s.decode(layer, slots, view_of(q, {n, cfg_.num_q_heads, cfg_.head_dim}),
             view_of(k, {n, cfg_.num_kv_heads, cfg_.head_dim}), view_of(v, {n, cfg_.num_kv_heads, cfg_.head_dim}),
             mutable_view_of(out, {n, cfg_.num_q_heads, cfg_.head_dim}));
    return out;
  }

  /// Feeds `d` to `s` one decode call per token (ragged: row b takes lengths[b] tokens); returns [B, T, Hq, D]
  /// with the rows past a length at -7.
  std::vector<float> decode_loop(kv_store& s, int layer, const token_data& d, std::vector<std::int64_t> lengths = {}) {
    if (lengths.empty()) lengths.assign(static_cast<std::size_t>(d.batch), d.tokens);
    const std::int64_t q_width = static_cast<std::int64_t>(cfg_.num_q_heads) * cfg_.head_dim;
    std::vector<float> out(d.q.size(), -7.0F);
    for (std::int64_t t = 0; t < d.tokens; ++t) {
      std::vector<std::int64_t> rows;
      for (std::int64_t b = 0; b < d.batch; ++b) {
        if (t < lengths[static_cast<std::size_t>(b)]) rows.push_back(b);
      }
      if (rows.empty()) break;
      const auto step = decode_token(s, layer, d, t, rows);
      for (std::size_t i = 0; i < rows.size(); ++i) {
        std::copy(step.begin() + static_cast<std::ptrdiff_t>(i) * q_width,
                  step.begin() + static_cast<std::ptrdiff_t>(i + 1) * q_width,
                  out.begin() + (rows[i] * d.tokens + t) * q_width);
      }
    }
    return out;
  }

  /// `journal`: also the fold journal's bytes (after a truncate it may hold fewer rows than the other store's).
  void expect_same_sequences(int layers, bool journal = true) {
    for (int layer = 0; layer < layers; ++layer) {
      for (const int slot : slots_) {
        SCOPED_TRACE("layer " + std::to_string(layer) + " slot " + std::to_string(slot));
        const shadowkv::sequence_info x = a_->info(layer, slot);
        const shadowkv::sequence_info y = b_->info(layer, slot);
        EXPECT_EQ(x.total_len, y.total_len);
        EXPECT_EQ(x.context_chunks, y.context_chunks);
        EXPECT_EQ(x.generated_exact_len, y.generated_exact_len);
        EXPECT_EQ(x.last_position, y.last_position);
        EXPECT_EQ(a_->outlier_chunks(layer, slot), b_->outlier_chunks(layer, slot));
      }
    }
    const shadowkv::memory_report x = a_->memory();
    const shadowkv::memory_report y = b_->memory();
    EXPECT_EQ(x.low_rank_factors, y.low_rank_factors);
    EXPECT_EQ(x.landmarks, y.landmarks);
    EXPECT_EQ(x.exact_tokens, y.exact_tokens);
    EXPECT_EQ(x.value_store, y.value_store);
    if (journal) {
      EXPECT_EQ(x.fold_journal, y.fold_journal);
    }
    EXPECT_EQ(x.full_attention_equivalent, y.full_attention_equivalent);
  }

  /// Both stores decode `steps` more tokens of every layer: outputs and selections must agree bit for bit.
  void expect_same_future(int layers, std::int64_t steps, std::uint64_t seed, bool journal = true) {
    random_source rng(seed);
    for (int layer = 0; layer < layers; ++layer) {
      const token_data d = make_tokens(rng, cfg_, 2, steps);
      for (std::int64_t t = 0; t < steps; ++t) {
        SCOPED_TRACE("continuation step " + std::to_string(t) + " layer " + std::to_string(layer));
        const auto x = decode_token(*a_, layer, d, t, {0, 1});
        const auto y = decode_token(*b_, layer, d, t, {0, 1});
        ASSERT_TRUE(shadowkv_test::all_finite(x));
        EXPECT_GT(shadowkv_test::norm(x), 0.05);
        ASSERT_EQ(x, y);
        for (const int slot : slots_) ASSERT_EQ(a_->selected_chunks(layer, slot), b_->selected_chunks(layer, slot));
      }
    }
    expect_same_sequences(layers, journal);
  }

  config cfg_;
  std::unique_ptr<kv_store> a_;
  std::unique_ptr<kv_store> b_;
  std::vector<int> slots_{0, 1};
};

TEST_P(extend_test, one_token_is_decode_bit_for_bit) {
  make_stores(extend_config(GetParam()));
  random_source rng(3);
  for (int step = 0; step < 40; ++step) {  // crosses the window of 16 several times: folds included
    SCOPED_TRACE("step " + std::to_string(step));
    const token_data d = make_tokens(rng, cfg_, 2, 1);
    const auto x = extend(*a_, 0, d);
    const auto y = decode_loop(*b_, 0, d);
    ASSERT_EQ(x, y);
    for (const int slot : slots_) ASSERT_EQ(a_->selected_chunks(0, slot), b_->selected_chunks(0, slot));
  }
  const shadowkv::store_stats x = a_->stats();
  const shadowkv::store_stats y = b_->stats();
  EXPECT_EQ(x.decode_steps, y.decode_steps);
  EXPECT_EQ(x.hits, y.hits);
  EXPECT_EQ(x.misses, y.misses);
  EXPECT_EQ(x.folds, y.folds);
  EXPECT_GT(x.folds, 0);
  expect_same_sequences(1);
}

TEST_P(extend_test, blocks_of_one_token_are_decode_calls) {
  config cfg = extend_config(GetParam());
  cfg.extend_block = 1;
  make_stores(cfg);
  random_source rng(5);
  for (const std::int64_t tokens : {37, 5, 20}) {
    const token_data d = make_tokens(rng, cfg_, 2, tokens);
    const std::vector<std::int64_t> lengths{tokens, tokens - 3};
    const auto x = extend(*a_, 0, d, lengths);
    const auto y = decode_loop(*b_, 0, d, lengths);
    ASSERT_EQ(x, y) << "T = " << tokens;
  }
  const shadowkv::store_stats x = a_->stats();
  const shadowkv::store_stats y = b_->stats();
  EXPECT_EQ(x.decode_steps, y.decode_steps);
  EXPECT_EQ(x.selections, y.selections);
  EXPECT_EQ(x.hits, y.hits);
  EXPECT_EQ(x.misses, y.misses);
  EXPECT_EQ(x.bytes_fetched, y.bytes_fetched);
  EXPECT_EQ(x.folds, y.folds);
  expect_same_sequences(1);
  expect_same_future(1, 12, 99);
}

TEST_P(extend_test, leaves_the_state_of_the_decode_path) {
  make_stores(extend_config(GetParam()));
  random_source rng(7);
  // Ragged blocks: 45 and 30 tokens in blocks of 8 (a fold in the middle of blocks, and after them), then 3 and 11.
  for (const auto& lengths : std::vector<std::vector<std::int64_t>>{{45, 30}, {3, 11}}) {
    const std::int64_t tokens = std::max(lengths[0], lengths[1]);
    const token_data d = make_tokens(rng, cfg_, 2, tokens);
    const auto x = extend(*a_, 0, d, lengths);
    (void)decode_loop(*b_, 0, d, lengths);
    // Padded rows are not written; the others are non-trivial.
    const std::int64_t q_width = static_cast<std::int64_t>(cfg_.num_q_heads) * cfg_.head_dim;
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t t = 0; t < tokens; ++t) {
        const float first = x[static_cast<std::size_t>((b * tokens + t) * q_width)];
        if (t >= lengths[static_cast<std::size_t>(b)]) {
          EXPECT_EQ(first, -7.0F);
        } else {
          EXPECT_TRUE(std::isfinite(first));
        }
      }
    }
  }
  EXPECT_EQ(a_->stats().folds, b_->stats().folds);
  expect_same_sequences(1);
  expect_same_future(1, 20, 11);
}

TEST_P(extend_test, truncate_equals_never_seeing_the_tokens) {
  make_stores(extend_config(GetParam(), 2));
  random_source rng(13);
  // a: 30 tokens by extend and 9 by decode in both layers (3 folds with a window of 16), then truncate 16 of slot 0
  // (undoes 2 folds: the journal's limit, W / C) and 13 of slot 1 (1 fold). b: 23 and 26 tokens by decode.
  const token_data first = make_tokens(rng, cfg_, 2, 30);
  const token_data second = make_tokens(rng, cfg_, 2, 9);
  for (int layer = 0; layer < 2; ++layer) {
    (void)extend(*a_, layer, first);
    (void)decode_loop(*a_, layer, second);
    (void)decode_loop(*b_, layer, first, {23, 26});
  }
  EXPECT_GT(a_->memory().fold_journal, 0);
  // Undoing 3 folds is more than the journal holds: refused, nothing changes.
  const auto journal = a_->memory().fold_journal;
  EXPECT_THROW(a_->truncate(slots_, std::vector<std::int64_t>{25, 1}), shadowkv::invalid_argument);
  EXPECT_EQ(a_->memory().fold_journal, journal);
  EXPECT_EQ(a_->info(1, 0).total_len, 139);
  a_->truncate(slots_, std::vector<std::int64_t>{16, 13});
  expect_same_sequences(2, false);
  expect_same_future(2, 24, 21, false);
}

TEST_P(extend_test, truncate_of_every_generated_token_returns_to_the_prompt) {
  make_stores(extend_config(GetParam()));
  random_source rng(19);
  const token_data d = make_tokens(rng, cfg_, 2, 10);
  (void)extend(*a_, 0, d, {10, 4});
  a_->truncate(slots_, std::vector<std::int64_t>{10, 4});
  EXPECT_EQ(a_->info(0, 0).last_position, 99);
  EXPECT_EQ(a_->info(0, 1).last_position, 76);
  EXPECT_EQ(a_->info(0, 0).generated_exact_len, 0);
  expect_same_sequences(1);
  expect_same_future(1, 20, 23);
}

TEST_P(extend_test, is_exact_at_full_rank_and_budget) {
  if (GetParam() != variant::float32) GTEST_SKIP() << "checked in float32 storage";
  config cfg = extend_config(GetParam());
  cfg.rank = static_cast<int>(cfg.kv_width());
  cfg.budget = 400;
  cfg.cache_tokens = 0;
  cfg.max_batch = 1;
  const std::int64_t prompt = 90;
  const std::int64_t tokens = 37;
  random_source rng(23);
  kv_store store(cfg);
  ASSERT_EQ(store.add_sequences(1), std::vector<int>{0});
  const auto keys = rng.normals(static_cast<std::size_t>(prompt * cfg.kv_width()));
  const auto values = rng.normals(static_cast<std::size_t>(prompt * cfg.kv_width()));
  shadowkv::prefill_options options;
  options.keys_post_rope = true;
  store.prefill(0, std::vector<int>{0}, view_of(keys, {1, prompt, cfg.num_kv_heads, cfg.head_dim}),
                view_of(values, {1, prompt, cfg.num_kv_heads, cfg.head_dim}), options);
  const token_data d = make_tokens(rng, cfg, 1, tokens);
  std::vector<float> out(d.q.size());
  store.extend(0, std::vector<int>{0}, view_of(d.q, {1, tokens, cfg.num_q_heads, cfg.head_dim}),
               view_of(d.k, {1, tokens, cfg.num_kv_heads, cfg.head_dim}),
               view_of(d.v, {1, tokens, cfg.num_kv_heads, cfg.head_dim}),
               mutable_view_of(out, {1, tokens, cfg.num_q_heads, cfg.head_dim}));
  // Causal full attention over prompt + new tokens, in double.
  const std::int64_t dim = cfg.head_dim;
  const std::int64_t group = cfg.num_q_heads / cfg.num_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  double worst = 0.0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t j = 0; j < cfg.num_q_heads; ++j) {
      const std::int64_t h = j / group;
      const float* q = d.q.data() + (t * cfg.num_q_heads + j) * dim;
      std::vector<double> logits;
      std::vector<const float*> value_rows;
      for (std::int64_t i = 0; i < prompt + t + 1; ++i) {
        const float* key = i < prompt ? keys.data() + (i * cfg.num_kv_heads + h) * dim
                                      : d.k.data() + ((i - prompt) * cfg.num_kv_heads + h) * dim;
        value_rows.push_back(i < prompt ? values.data() + (i * cfg.num_kv_heads + h) * dim
                                        : d.v.data() + ((i - prompt) * cfg.num_kv_heads + h) * dim);
        double dot = 0.0;
        for (std::int64_t e = 0; e < dim; ++e) dot += static_cast<double>(q[e]) * key[e];
        logits.push_back(scale * dot);
      }
      double top = -std::numeric_limits<double>::infinity();
      for (const double x : logits) top = std::max(top, x);
      double total = 0.0;
      for (double& x : logits) total += (x = std::exp(x - top));
      for (std::int64_t e = 0; e < dim; ++e) {
        double expected = 0.0;
        for (std::size_t i = 0; i < logits.size(); ++i) expected += logits[i] / total * value_rows[i][e];
        const float got = out[static_cast<std::size_t>((t * cfg.num_q_heads + j) * dim + e)];
        worst = std::max(worst, std::fabs(expected - got));
      }
    }
  }
  EXPECT_LT(worst, 2e-4) << "extend at full rank and budget differs from causal full attention";
  EXPECT_GT(shadowkv_test::norm(out), 0.1);
}

INSTANTIATE_TEST_SUITE_P(variants, extend_test,
                         shadowkv_test::every_variant(), shadowkv_test::store_variant_name);

/// A store, its bytes, counters and sequences as one comparable snapshot.
struct snapshot {
  std::vector<std::int64_t> numbers;
  bool operator==(const snapshot&) const = default;
};

snapshot take_snapshot(const kv_store& s) {
  snapshot out;
  const shadowkv::memory_report m = s.memory();
  const shadowkv::store_stats st = s.stats();
  out.numbers = {m.low_rank_factors, m.landmarks, m.exact_tokens, m.value_store, m.fold_journal,
                 st.decode_steps, st.selections, st.hits, st.misses, st.folds};
  for (const int slot : s.active_slots()) {
    for (int layer = 0; layer < s.get_config().num_layers; ++layer) {
      const shadowkv::sequence_info info = s.info(layer, slot);
      out.numbers.insert(out.numbers.end(), {info.total_len, info.context_chunks, info.generated_exact_len,
                                             info.last_position});
    }
  }
  return out;
}

TEST(extend_errors, bad_input_changes_nothing) {
  config cfg = extend_config(variant::plain, 2);
  cfg.max_seq_len = 140;
  kv_store store(cfg);
  random_source rng(29);
  ASSERT_EQ(store.add_sequences(3), (std::vector<int>{0, 1, 2}));
  const std::vector<int> slots{0, 1};
  const auto keys = rng.normals(static_cast<std::size_t>(2 * 100 * cfg.kv_width()));
  store.prefill(0, slots, view_of(keys, {2, 100, cfg.num_kv_heads, cfg.head_dim}),
                view_of(keys, {2, 100, cfg.num_kv_heads, cfg.head_dim}));
  const auto call = [&](const std::vector<int>& which, std::int64_t tokens, std::vector<std::int64_t> lengths,
                        int layer = 0) {
    const auto batch = static_cast<std::int64_t>(which.size());
    const token_data d = make_tokens(rng, cfg, batch, tokens);
    std::vector<float> out(d.q.size());
    shadowkv::extend_options options;
    options.lengths = std::move(lengths);
    store.extend(layer, which, view_of(d.q, {batch, tokens, cfg.num_q_heads, cfg.head_dim}),
                 view_of(d.k, {batch, tokens, cfg.num_kv_heads, cfg.head_dim}),
                 view_of(d.v, {batch, tokens, cfg.num_kv_heads, cfg.head_dim}),
                 mutable_view_of(out, {batch, tokens, cfg.num_q_heads, cfg.head_dim}), options);
  };
  call(slots, 12, {});
  const snapshot before = take_snapshot(store);
  EXPECT_THROW(call(slots, 0, {}), shadowkv::invalid_argument);                 // T = 0
  EXPECT_THROW(call(slots, 4, {4, 5}), shadowkv::invalid_argument);             // a length beyond T
  EXPECT_THROW(call(slots, 4, {0, 4}), shadowkv::invalid_argument);             // a length of 0
  EXPECT_THROW(call(slots, 4, {4}), shadowkv::invalid_argument);                // lengths of another batch
  EXPECT_THROW(call(slots, 29, {}), shadowkv::capacity_error);                  // past max_seq_len (112 + 29 > 140)
  EXPECT_THROW(call({0, 3}, 4, {}), shadowkv::invalid_argument);                // a slot not live
  EXPECT_THROW(call({0, 2}, 4, {}), shadowkv::invalid_argument);                // a layer not prefilled
  EXPECT_THROW(call(slots, 4, {}, 1), shadowkv::invalid_argument);              // layer 1 not prefilled
  EXPECT_EQ(take_snapshot(store), before);

  // truncate: into the prompt, negative, a slot not live, a layer not prefilled (layer 1), a count per slot missing.
  EXPECT_THROW(store.truncate(std::vector<int>{0}, std::vector<std::int64_t>{13}), shadowkv::invalid_argument);
  EXPECT_THROW(store.truncate(std::vector<int>{0}, std::vector<std::int64_t>{-1}), shadowkv::invalid_argument);
  EXPECT_THROW(store.truncate(std::vector<int>{3}, std::vector<std::int64_t>{1}), shadowkv::invalid_argument);
  EXPECT_THROW(store.truncate(slots, std::vector<std::int64_t>{1}), shadowkv::invalid_argument);
  EXPECT_EQ(take_snapshot(store), before);
  // Layer 1 is not prefilled: truncate needs every layer to hold the tokens.
  EXPECT_THROW(store.truncate(std::vector<int>{0}, std::vector<std::int64_t>{2}), shadowkv::invalid_argument);
  EXPECT_EQ(take_snapshot(store), before);
  // Nothing to remove is fine anywhere; slot 2 has no prompt.
  store.truncate(std::vector<int>{0, 2}, std::vector<std::int64_t>{0, 0});
  EXPECT_EQ(take_snapshot(store), before);
}

}  // namespace
