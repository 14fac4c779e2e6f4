// Helpers of the reliability tests (test_store_reliability.cpp, test_allocation_failures.cpp): views of host vectors,
// seeded data, and "twins" — two stores fed the same history, of which only the subject receives the call under test;
// afterwards both must report the same state and decode the same outputs bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "shadowkv/config.hpp"
#include "shadowkv/store.hpp"
#include "shadowkv/tensor_view.hpp"

namespace shadowkv_test {

using shape_list = std::initializer_list<std::int64_t>;

inline shadowkv::tensor_view view_of(const std::vector<float>& data, shape_list shape) {
  return shadowkv::make_contiguous_view(data.data(), shadowkv::dtype::float32, shadowkv::device{}, shape);
}

inline shadowkv::mutable_tensor_view mutable_view_of(std::vector<float>& data, shape_list shape) {
  return shadowkv::make_contiguous_output_view(data.data(), shadowkv::dtype::float32, shadowkv::device{}, shape);
}

class random_source {
 public:
  explicit random_source(std::uint64_t seed) : engine_(seed) {}
  std::vector<float> normals(std::size_t count, float scale = 1.0F) {
    std::vector<float> out(count);
    for (float& v : out) v = scale * normal_(engine_);
    return out;
  }

 private:
  std::mt19937_64 engine_;
  std::normal_distribution<float> normal_{0.0F, 1.0F};
};

inline bool all_finite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
}

inline double norm(const std::vector<float>& x) {
  double sum = 0.0;
  for (const float v : x) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

/// Two layers, GQA 4/2, D 64, window 16 (folds every 8 steps once full), bfloat16 storage.
inline shadowkv::config twin_config() {
  shadowkv::config cfg;
  cfg.num_layers = 2;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 4;
  cfg.max_seq_len = 200;
  cfg.rank = 32;
  cfg.chunk_size = 8;
  cfg.budget = 4 * 8;  // 4 chunks
  cfg.outlier_chunks = 2;
  cfg.local_chunks = 2;
  cfg.generation_window = 16;
  cfg.kv_dtype = shadowkv::dtype::bfloat16;
  return cfg;
}

/// Variants of the store that change what a fold, a selection or the value store holds: the tests of each sequence
/// operation (extend, truncate, fork, park, save) run on every one.
enum class store_variant { plain, two_centroids, lru_cache, fp8_values, float32 };

inline std::string store_variant_name(const ::testing::TestParamInfo<store_variant>& info) {
  switch (info.param) {
    case store_variant::plain: return "plain";
    case store_variant::two_centroids: return "two_centroids";
    case store_variant::lru_cache: return "lru_cache";
    case store_variant::fp8_values: return "fp8_values";
    case store_variant::float32: return "float32";
  }
  return "unknown";
}

/// twin_config() with room for 400 tokens, extend blocks of 8 and the variant's setting.
inline shadowkv::config variant_config(store_variant v) {
  shadowkv::config cfg = twin_config();
  cfg.max_seq_len = 400;
  cfg.extend_block = 8;
  switch (v) {
    case store_variant::plain: break;
    case store_variant::two_centroids: cfg.chunk_score = shadowkv::chunk_score_rule::two_centroids; break;
    case store_variant::lru_cache: cfg.cache_tokens = 2 * cfg.budget; break;
    case store_variant::fp8_values: cfg.values_as = shadowkv::value_format::fp8_e4m3; break;
    case store_variant::float32: cfg.kv_dtype = shadowkv::dtype::float32; break;
  }
  return cfg;
}

/// Every variant, for INSTANTIATE_TEST_SUITE_P(..., every_variant(), store_variant_name).
inline auto every_variant() {
  return ::testing::Values(store_variant::plain, store_variant::two_centroids, store_variant::lru_cache,
                           store_variant::fp8_values, store_variant::float32);
}

/// Inputs of `tokens` new tokens for each of `batch` sequences (extend): q [B, T, Hq, D], k and v [B, T, Hkv, D].
struct token_data {
  std::int64_t batch = 0;
  std::int64_t tokens = 0;
  std::vector<float> q, k, v;
};

inline token_data make_tokens(random_source& rng, const shadowkv::config& cfg, std::int64_t batch,
                              std::int64_t tokens) {
  token_data d;
  d.batch = batch;
  d.tokens = tokens;
  d.q = rng.normals(static_cast<std::size_t>(batch * tokens * cfg.num_q_heads * cfg.head_dim));
  d.k = rng.normals(static_cast<std::size_t>(batch * tokens * cfg.kv_width()));
  d.v = rng.normals(static_cast<std::size_t>(batch * tokens * cfg.kv_width()));
  return d;
}

/// Random inputs of one prefill or decode call, shared by both twins.
struct prefill_data {
  std::vector<float> keys, values, q_last;
};
struct decode_data {
  std::vector<float> q, k, v;
};

class twins {
 public:
  /// Slots 0 and 1 live (layer 0 of both prefilled, slot 0 with a warm-up query; layer 1 of slot 0 prefilled), slot 2
  /// added and never prefilled; then `warmup_steps` decode steps of layer 0 on slots {0, 1}.
  explicit twins(std::uint64_t seed, int warmup_steps = 3, shadowkv::config base = twin_config())
      : cfg(base), subject(cfg), twin(cfg), rng_(seed) {
    both([](shadowkv::kv_store& s) { EXPECT_EQ(s.add_sequences(3), (std::vector<int>{0, 1, 2})); });
    prefill_both(0, {0}, 100, /*with_query=*/true);
    prefill_both(0, {1}, 77);
    prefill_both(1, {0}, 100);
    for (int i = 0; i < warmup_steps; ++i) decode_both(0, {0, 1});
  }

  template <typename Call>
  void both(Call&& call) {
    call(subject);
    call(twin);
  }

  prefill_data make_prefill(std::int64_t batch, std::int64_t length) {
    prefill_data d;
    d.keys = rng_.normals(static_cast<std::size_t>(batch * length * cfg.kv_width()));
    d.values = rng_.normals(static_cast<std::size_t>(batch * length * cfg.kv_width()));
    d.q_last = rng_.normals(static_cast<std::size_t>(batch * cfg.num_q_heads * cfg.head_dim));
    return d;
  }

  void prefill(shadowkv::kv_store& s, int layer, const std::vector<int>& slots, std::int64_t length,
               const prefill_data& d, bool with_query) const {
    const auto batch = static_cast<std::int64_t>(slots.size());
    shadowkv::prefill_options options;
    if (with_query) options.q_last = view_of(d.q_last, {batch, 1, cfg.num_q_heads, cfg.head_dim});
    s.prefill(layer, slots, view_of(d.keys, {batch, length, cfg.num_kv_heads, cfg.head_dim}),
              view_of(d.values, {batch, length, cfg.num_kv_heads, cfg.head_dim}), options);
  }

  void prefill_both(int layer, const std::vector<int>& slots, std::int64_t length, bool with_query = false) {
    const prefill_data d = make_prefill(static_cast<std::int64_t>(slots.size()), length);
    both([&](shadowkv::kv_store& s) { prefill(s, layer, slots, length, d, with_query); });
  }

  decode_data make_decode(std::int64_t batch) {
    decode_data d;
    d.q = rng_.normals(static_cast<std::size_t>(batch * cfg.num_q_heads * cfg.head_dim));
    d.k = rng_.normals(static_cast<std::size_t>(batch * cfg.kv_width()));
    d.v = rng_.normals(static_cast<std::size_t>(batch * cfg.kv_width()));
    return d;
  }

  std::vector<float> decode(shadowkv::kv_store& s, int layer, const std::vector<int>& slots,
                            const decode_data& d) const {
    const auto batch = static_cast<std::int64_t>(slots.size());
    std::vector<float> out(d.q.size(), -1.0F);
    s.decode(layer, slots, view_of(d.q, {batch, cfg.num_q_heads, cfg.head_dim}),
             view_of(d.k, {batch, cfg.num_kv_heads, cfg.head_dim}), view_of(d.v, {batch, cfg.num_kv_heads, cfg.head_dim}),
             mutable_view_of(out, {batch, cfg.num_q_heads, cfg.head_dim}));
    return out;
  }

  /// One decode step on both stores with the same data; the outputs must agree bit for bit.
  void decode_both(int layer, const std::vector<int>& slots) {
    const decode_data d = make_decode(static_cast<std::int64_t>(slots.size()));
    const std::vector<float> a = decode(subject, layer, slots, d);
    const std::vector<float> b = decode(twin, layer, slots, d);
    ASSERT_TRUE(all_finite(a));
    EXPECT_GT(norm(a), 0.05);
    ASSERT_EQ(a, b) << "decode output differs from the twin's (layer " << layer << ")";
  }

  void expect_same_state() {
    EXPECT_EQ(subject.active_slots(), twin.active_slots());
    const shadowkv::memory_report ma = subject.memory();
    const shadowkv::memory_report mb = twin.memory();
    EXPECT_EQ(ma.low_rank_factors, mb.low_rank_factors);
    EXPECT_EQ(ma.landmarks, mb.landmarks);
    EXPECT_EQ(ma.outliers, mb.outliers);
    EXPECT_EQ(ma.exact_tokens, mb.exact_tokens);
    EXPECT_EQ(ma.value_store, mb.value_store);
    EXPECT_EQ(ma.selection_cache, mb.selection_cache);
    EXPECT_EQ(ma.full_attention_equivalent, mb.full_attention_equivalent);
    const shadowkv::store_stats sa = subject.stats();
    const shadowkv::store_stats sb = twin.stats();
    EXPECT_EQ(sa.decode_steps, sb.decode_steps);
    EXPECT_EQ(sa.selections, sb.selections);
    EXPECT_EQ(sa.hits, sb.hits);
    EXPECT_EQ(sa.misses, sb.misses);
    EXPECT_EQ(sa.chunks_rebuilt, sb.chunks_rebuilt);
    EXPECT_EQ(sa.bytes_fetched, sb.bytes_fetched);
    EXPECT_EQ(sa.folds, sb.folds);
    for (const int slot : twin.active_slots()) {
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        SCOPED_TRACE("slot=" + std::to_string(slot) + " layer=" + std::to_string(layer));
        const shadowkv::sequence_info a = subject.info(layer, slot);
        const shadowkv::sequence_info b = twin.info(layer, slot);
        EXPECT_EQ(a.prefilled, b.prefilled);
        EXPECT_EQ(a.prompt_len, b.prompt_len);
        EXPECT_EQ(a.total_len, b.total_len);
        EXPECT_EQ(a.context_chunks, b.context_chunks);
        EXPECT_EQ(a.outlier_chunks, b.outlier_chunks);
        EXPECT_EQ(a.local_len, b.local_len);
        EXPECT_EQ(a.generated_exact_len, b.generated_exact_len);
        EXPECT_EQ(a.last_position, b.last_position);
        if (b.prefilled) {
          EXPECT_EQ(subject.selected_chunks(layer, slot), twin.selected_chunks(layer, slot));
          EXPECT_EQ(subject.outlier_chunks(layer, slot), twin.outlier_chunks(layer, slot));
        }
      }
    }
  }

  /// Same state now, then the same outputs for `steps` more steps of every prefilled (layer, slot) with room left
  /// (the window of 16 makes them fold on the way).
  void expect_same_future(std::int64_t steps = 20) {
    expect_same_state();
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      std::vector<int> slots;
      for (const int slot : twin.active_slots()) {
        const shadowkv::sequence_info info = twin.info(layer, slot);
        if (info.prefilled && info.total_len + steps <= cfg.max_seq_len) slots.push_back(slot);
      }
      for (std::int64_t i = 0; i < steps && !slots.empty(); ++i) {
        SCOPED_TRACE("continuation step " + std::to_string(i) + " layer " + std::to_string(layer));
        decode_both(layer, slots);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    expect_same_state();
  }

  shadowkv::config cfg;
  shadowkv::kv_store subject;
  shadowkv::kv_store twin;

 private:
  random_source rng_;
};

}  // namespace shadowkv_test
