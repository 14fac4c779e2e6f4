// fork (docs/semantics.md, "Fork, park and save"), proven by equalities: a child decodes, extends and truncates bit for
// bit as an unshared copy of its source would (a second store whose slots were all fed the source's prompt and
// tokens); source and children evolve independently; releasing the source leaves the children as they were; the
// memory report counts the shared prompt once (checked against the formulas of "Memory report"); bad input changes
// nothing; stats() does not move; the device value budget charges a child only what it does not share. With park /
// resume and save / load: a parked member of a family (child or source) keeps sharing and resumes as its unshared copy
// would; a saved child's file is its unshared copy's, byte for byte, and loads unshared; the memory report and the
// budget while a member is parked.
#include <gtest/gtest.h>
#include <unistd.h>  // getpid

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <system_error>
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

/// Two layers, GQA 4/2, D 64, chunks of 8, window 16 (folds every 8 tokens once full), blocks of 8, four slots.
config fork_config(variant v) { return shadowkv_test::variant_config(v); }

constexpr std::int64_t prompt_len = 100;

using shadowkv_test::make_tokens;
using shadowkv_test::token_data;

/// `d` with its one row repeated `batch` times: every sequence gets the same tokens.
token_data repeated(const token_data& d, std::int64_t batch) {
  token_data out;
  out.batch = batch;
  out.tokens = d.tokens;
  for (std::int64_t b = 0; b < batch; ++b) {
    out.q.insert(out.q.end(), d.q.begin(), d.q.end());
    out.k.insert(out.k.end(), d.k.begin(), d.k.end());
    out.v.insert(out.v.end(), d.v.begin(), d.v.end());
  }
  return out;
}

/// A prompt of one sequence per layer (keys, values and a warm-up query).
struct prompt_data {
  std::vector<std::vector<float>> keys, values, q_last;
};

prompt_data make_prompt(random_source& rng, const config& cfg) {
  prompt_data p;
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    p.keys.push_back(rng.normals(static_cast<std::size_t>(prompt_len * cfg.kv_width())));
    p.values.push_back(rng.normals(static_cast<std::size_t>(prompt_len * cfg.kv_width())));
    p.q_last.push_back(rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim)));
  }
  return p;
}

/// Prefills every layer of `slots` with the same prompt `p`.
void prefill_all(kv_store& s, const config& cfg, const std::vector<int>& slots, const prompt_data& p) {
  const auto batch = static_cast<std::int64_t>(slots.size());
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    std::vector<float> keys, values, q_last;
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto l = static_cast<std::size_t>(layer);
      keys.insert(keys.end(), p.keys[l].begin(), p.keys[l].end());
      values.insert(values.end(), p.values[l].begin(), p.values[l].end());
      q_last.insert(q_last.end(), p.q_last[l].begin(), p.q_last[l].end());
    }
    shadowkv::prefill_options options;
    options.q_last = view_of(q_last, {batch, 1, cfg.num_q_heads, cfg.head_dim});
    s.prefill(layer, slots, view_of(keys, {batch, prompt_len, cfg.num_kv_heads, cfg.head_dim}),
              view_of(values, {batch, prompt_len, cfg.num_kv_heads, cfg.head_dim}), options);
  }
}

std::vector<float> extend(kv_store& s, const config& cfg, int layer, const std::vector<int>& slots, const token_data& d,
                          std::vector<std::int64_t> lengths = {}) {
  std::vector<float> out(d.q.size(), -7.0F);
  shadowkv::extend_options options;
  options.lengths = std::move(lengths);
  s.extend(layer, slots, view_of(d.q, {d.batch, d.tokens, cfg.num_q_heads, cfg.head_dim}),
           view_of(d.k, {d.batch, d.tokens, cfg.num_kv_heads, cfg.head_dim}),
           view_of(d.v, {d.batch, d.tokens, cfg.num_kv_heads, cfg.head_dim}),
           mutable_view_of(out, {d.batch, d.tokens, cfg.num_q_heads, cfg.head_dim}), options);
  return out;
}

/// One decode call of `slots` with token 0 of `d` ([B, 1, ...]).
std::vector<float> decode(kv_store& s, const config& cfg, int layer, const std::vector<int>& slots,
                          const token_data& d) {
  std::vector<float> out(d.q.size(), -7.0F);
  s.decode(layer, slots, view_of(d.q, {d.batch, cfg.num_q_heads, cfg.head_dim}),
           view_of(d.k, {d.batch, cfg.num_kv_heads, cfg.head_dim}),
           view_of(d.v, {d.batch, cfg.num_kv_heads, cfg.head_dim}),
           mutable_view_of(out, {d.batch, cfg.num_q_heads, cfg.head_dim}));
  return out;
}

/// Everything sequence_info says but shares_prompt_with, as numbers.
std::vector<std::int64_t> info_numbers(const kv_store& s, int layer, int slot) {
  const shadowkv::sequence_info i = s.info(layer, slot);
  return {i.prefilled ? 1 : 0,   i.prompt_len,     i.total_len,
          i.context_chunks,      i.outlier_chunks, i.local_len,
          i.generated_exact_len, i.last_position,  static_cast<std::int64_t>(i.values_on)};
}

std::vector<std::int64_t> stats_numbers(const shadowkv::store_stats& st) {
  return {st.decode_steps, st.selections, st.hits, st.misses, st.chunks_rebuilt, st.bytes_fetched, st.folds};
}

std::vector<std::int64_t> memory_numbers(const shadowkv::memory_report& m) {
  return {m.low_rank_factors,
          m.landmarks,
          m.outliers,
          m.exact_tokens,
          m.value_store,
          m.value_store_device,
          m.value_store_host,
          m.selection_cache,
          m.fold_journal,
          m.full_attention_equivalent,
          m.shared};
}

/// The bytes of one sequence's prompt state (all layers) by kind, from docs/semantics.md, "Memory report".
struct prompt_bytes {
  std::int64_t factors = 0, landmarks = 0, outliers = 0, values = 0;
  [[nodiscard]] std::int64_t total() const { return factors + landmarks + outliers + values; }
};

prompt_bytes prompt_formula(const kv_store& s) {
  const config& c = s.get_config();
  const std::int64_t n = std::max<std::int64_t>(0, prompt_len / c.chunk_size - c.local_chunks);
  const std::int64_t outliers = std::min<std::int64_t>(c.outlier_chunks, n);
  const auto e = static_cast<std::int64_t>(shadowkv::dtype_size(c.kv_dtype));
  const auto f = static_cast<std::int64_t>(shadowkv::dtype_size(c.factor_dtype()));
  prompt_bytes p;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    p.factors += (n * c.chunk_size * c.rank + static_cast<std::int64_t>(c.rank) * c.kv_width()) * f;
    p.landmarks += c.chunk_score == shadowkv::chunk_score_rule::two_centroids
                       ? n * c.num_kv_heads * (2 * c.head_dim + 9)
                       : n * c.kv_width() * e;
    p.outliers += outliers * c.chunk_size * c.kv_width() * 2 * e;
    p.values += n * c.num_kv_heads * c.value_run_bytes();
  }
  return p;
}

class fork_test : public ::testing::TestWithParam<variant> {
 protected:
  /// a_: slot 0 fed `prompt` and a history of decode, extend and truncate calls, then forked into slots 1 and 2.
  /// b_: slots 0, 1 and 2 all fed the same prompt and history: unshared copies of a_'s source.
  void make_stores(const config& cfg) {
    cfg_ = cfg;
    a_ = std::make_unique<kv_store>(cfg);
    b_ = std::make_unique<kv_store>(cfg);
    random_source rng(41);
    const prompt_data prompt = make_prompt(rng, cfg);
    ASSERT_EQ(a_->add_sequences(1), std::vector<int>{0});
    ASSERT_EQ(b_->add_sequences(3), (std::vector<int>{0, 1, 2}));
    prefill_all(*a_, cfg, {0}, prompt);
    prefill_all(*b_, cfg, {0, 1, 2}, prompt);
    // The source's history: 30 decode steps and an extend of 13 (folds, so a fold journal), a truncate of 5.
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      for (int step = 0; step < 30; ++step) {
        const token_data d = make_tokens(rng, cfg, 1, 1);
        const std::vector<float> x = decode(*a_, cfg, layer, {0}, d);
        const std::vector<float> y = decode(*b_, cfg, layer, {0, 1, 2}, repeated(d, 3));
        ASSERT_EQ(y, repeated_output(x, 3));
      }
      const token_data d = make_tokens(rng, cfg, 1, 13);
      (void)extend(*a_, cfg, layer, {0}, d);
      (void)extend(*b_, cfg, layer, {0, 1, 2}, repeated(d, 3));
    }
    a_->truncate(std::vector<int>{0}, std::vector<std::int64_t>{5});
    b_->truncate(std::vector<int>{0, 1, 2}, std::vector<std::int64_t>{5, 5, 5});
    ASSERT_GT(a_->memory().fold_journal, 0);
    ASSERT_GT(a_->info(0, 0).context_chunks, a_->info(0, 0).prompt_len / cfg.chunk_size - cfg.local_chunks);
  }

  static std::vector<float> repeated_output(const std::vector<float>& row, int times) {
    std::vector<float> out;
    for (int i = 0; i < times; ++i) out.insert(out.end(), row.begin(), row.end());
    return out;
  }

  /// a_ and b_ agree on `slots`: sequence counters and selections of every layer.
  void expect_same_sequences(const std::vector<int>& slots) {
    for (const int slot : slots) {
      for (int layer = 0; layer < cfg_.num_layers; ++layer) {
        SCOPED_TRACE("slot " + std::to_string(slot) + " layer " + std::to_string(layer));
        EXPECT_EQ(info_numbers(*a_, layer, slot), info_numbers(*b_, layer, slot));
        EXPECT_EQ(a_->selected_chunks(layer, slot), b_->selected_chunks(layer, slot));
        EXPECT_EQ(a_->outlier_chunks(layer, slot), b_->outlier_chunks(layer, slot));
      }
    }
  }

  /// a_'s memory is b_'s less the prompt state its `sharing` holders of one prompt do not duplicate.
  void expect_memory_shared_once(int holders) {
    const prompt_bytes p = prompt_formula(*a_);
    const shadowkv::memory_report x = a_->memory();
    const shadowkv::memory_report y = b_->memory();
    const std::int64_t extra = holders - 1;  // copies b_ holds that a_ does not
    EXPECT_EQ(x.low_rank_factors + extra * p.factors, y.low_rank_factors);
    EXPECT_EQ(x.landmarks + extra * p.landmarks, y.landmarks);
    EXPECT_EQ(x.outliers + extra * p.outliers, y.outliers);
    EXPECT_EQ(x.value_store + extra * p.values, y.value_store);
    EXPECT_EQ(x.value_store_host + extra * p.values, y.value_store_host);
    EXPECT_EQ(x.exact_tokens, y.exact_tokens);
    EXPECT_EQ(x.selection_cache, y.selection_cache);
    EXPECT_EQ(x.fold_journal, y.fold_journal);
    EXPECT_EQ(x.full_attention_equivalent, y.full_attention_equivalent);
    EXPECT_EQ(x.total() + extra * p.total(), y.total());
    EXPECT_EQ(x.shared, holders > 1 ? p.total() : 0);
    EXPECT_EQ(y.shared, 0);
  }

  config cfg_;
  std::unique_ptr<kv_store> a_;
  std::unique_ptr<kv_store> b_;
};

std::vector<int> shares(const kv_store& s, int slot, int layer = 0) { return s.info(layer, slot).shares_prompt_with; }

TEST_P(fork_test, children_decode_extend_and_truncate_as_unshared_copies) {
  make_stores(fork_config(GetParam()));
  const std::vector<std::int64_t> stats_before = stats_numbers(a_->stats());
  const shadowkv::memory_report one = a_->memory();
  ASSERT_EQ(a_->fork(0, 2), (std::vector<int>{1, 2}));
  EXPECT_EQ(stats_numbers(a_->stats()), stats_before) << "fork changed stats()";
  EXPECT_EQ(a_->active_slots(), (std::vector<int>{0, 1, 2}));
  // Every layer of every child equals the source now (b_'s unshared copies), selection cache included.
  expect_same_sequences({0, 1, 2});
  expect_memory_shared_once(3);
  EXPECT_EQ(a_->memory().total(), 3 * one.total() - 2 * prompt_formula(*a_).total());
  for (int layer = 0; layer < cfg_.num_layers; ++layer) {
    EXPECT_EQ(shares(*a_, 0, layer), (std::vector<int>{1, 2}));
    EXPECT_EQ(shares(*a_, 1, layer), (std::vector<int>{0, 2}));
    EXPECT_EQ(shares(*a_, 2, layer), (std::vector<int>{0, 1}));
    EXPECT_TRUE(shares(*b_, 1, layer).empty());
  }
  const shadowkv::store_stats a_at_fork = a_->stats();
  const shadowkv::store_stats b_at_fork = b_->stats();

  // Each sequence gets its own tokens (they evolve independently), through decode, extend and truncate; each equals
  // its unshared copy bit for bit.
  random_source rng(43);
  const std::vector<int> all{0, 1, 2};
  for (int round = 0; round < 3; ++round) {
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      for (int step = 0; step < 12; ++step) {
        SCOPED_TRACE("round " + std::to_string(round) + " layer " + std::to_string(layer) + " step " +
                     std::to_string(step));
        const token_data d = make_tokens(rng, cfg_, 3, 1);
        const std::vector<float> x = decode(*a_, cfg_, layer, all, d);
        ASSERT_TRUE(shadowkv_test::all_finite(x));
        ASSERT_EQ(x, decode(*b_, cfg_, layer, all, d));
        for (const int slot : all) ASSERT_EQ(a_->selected_chunks(layer, slot), b_->selected_chunks(layer, slot));
      }
      const token_data d = make_tokens(rng, cfg_, 3, 19);
      const std::vector<std::int64_t> lengths{19, 6, 11};
      ASSERT_EQ(extend(*a_, cfg_, layer, all, d, lengths), extend(*b_, cfg_, layer, all, d, lengths));
    }
    const std::vector<std::int64_t> removed{3, 9, 0};
    a_->truncate(all, removed);
    b_->truncate(all, removed);
    expect_same_sequences(all);
    expect_memory_shared_once(3);
  }
  // The three sequences now differ from one another.
  EXPECT_NE(a_->info(0, 0).total_len, a_->info(0, 1).total_len);
  // What ran since the fork counts the same in both stores.
  const shadowkv::store_stats a_now = a_->stats();
  const shadowkv::store_stats b_now = b_->stats();
  EXPECT_EQ(a_now.decode_steps - a_at_fork.decode_steps, b_now.decode_steps - b_at_fork.decode_steps);
  EXPECT_EQ(a_now.selections - a_at_fork.selections, b_now.selections - b_at_fork.selections);
  EXPECT_EQ(a_now.hits - a_at_fork.hits, b_now.hits - b_at_fork.hits);
  EXPECT_EQ(a_now.misses - a_at_fork.misses, b_now.misses - b_at_fork.misses);
  EXPECT_EQ(a_now.bytes_fetched - a_at_fork.bytes_fetched, b_now.bytes_fetched - b_at_fork.bytes_fetched);
  EXPECT_EQ(a_now.folds - a_at_fork.folds, b_now.folds - b_at_fork.folds);

  // Releasing the source leaves the children as they were; then one child alone.
  a_->release(std::vector<int>{0});
  b_->release(std::vector<int>{0});
  EXPECT_EQ(shares(*a_, 1), std::vector<int>{2});
  expect_same_sequences({1, 2});
  expect_memory_shared_once(2);
  for (const std::vector<int>& slots : {std::vector<int>{1, 2}, std::vector<int>{2}}) {
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      for (int step = 0; step < 10; ++step) {
        const token_data d = make_tokens(rng, cfg_, static_cast<std::int64_t>(slots.size()), 1);
        ASSERT_EQ(decode(*a_, cfg_, layer, slots, d), decode(*b_, cfg_, layer, slots, d));
        for (const int slot : slots) ASSERT_EQ(a_->selected_chunks(layer, slot), b_->selected_chunks(layer, slot));
      }
    }
    expect_same_sequences(slots);
    if (slots.size() == 2) {
      expect_memory_shared_once(2);
      a_->release(std::vector<int>{1});
      b_->release(std::vector<int>{1});
      EXPECT_TRUE(shares(*a_, 2).empty());
    }
  }
  expect_memory_shared_once(1);
}

TEST_P(fork_test, a_fork_of_a_child_joins_its_family) {
  make_stores(fork_config(GetParam()));
  ASSERT_EQ(a_->fork(0), std::vector<int>{1});
  ASSERT_EQ(a_->fork(1), std::vector<int>{2});
  EXPECT_EQ(shares(*a_, 0), (std::vector<int>{1, 2}));
  EXPECT_EQ(shares(*a_, 2), (std::vector<int>{0, 1}));
  expect_same_sequences({0, 1, 2});
  expect_memory_shared_once(3);
  // A released slot taken by add_sequences holds a new sequence that shares nothing.
  a_->release(std::vector<int>{1});
  ASSERT_EQ(a_->add_sequences(1), std::vector<int>{1});
  EXPECT_TRUE(shares(*a_, 1).empty());
  EXPECT_EQ(shares(*a_, 0), std::vector<int>{2});
}

// --- fork with park / resume and save / load ------------------------------------------------------------------------

// Files of the tests: one directory per process (ctest runs tests in parallel processes), removed when it ends.
std::filesystem::path scratch_directory() {
  return std::filesystem::path(::testing::TempDir()) / ("shadowkv_test_fork_" + std::to_string(::getpid()));
}

class scratch_cleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(scratch_directory(), ignored);
  }
};
const ::testing::Environment* const scratch_cleanup_registered =
    ::testing::AddGlobalTestEnvironment(new scratch_cleanup);

std::string scratch_file(const std::string& name) {
  std::filesystem::create_directories(scratch_directory());
  std::string stem = std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "." + name;
  for (char& c : stem) {
    if (c == '/') c = '_';
  }
  return (scratch_directory() / stem).string();
}

std::vector<char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Bytes of one sequence's prompt state as a parked object's host_bytes counts them (the sections of a saved file,
/// docs/api.md, "Saved sequences"): the memory report's prompt kinds plus the context positions, the outlier ids and
/// the outlier flags.
std::int64_t prompt_section_bytes(const kv_store& s) {
  const config& c = s.get_config();
  const std::int64_t n = std::max<std::int64_t>(0, prompt_len / c.chunk_size - c.local_chunks);
  const std::int64_t outliers = std::min<std::int64_t>(c.outlier_chunks, n);
  return prompt_formula(s).total() +
         c.num_layers * (n * c.chunk_size * 8 + c.num_kv_heads * outliers * 8 + c.num_kv_heads * n);
}

/// Decodes, extends and truncates `slots` of a_ and b_ alike (each sequence its own tokens), expecting the same
/// outputs and selections bit for bit.
void run_alike(kv_store& a, kv_store& b, const config& cfg, const std::vector<int>& slots, std::uint64_t seed) {
  random_source rng(seed);
  const auto batch = static_cast<std::int64_t>(slots.size());
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    for (int step = 0; step < 10; ++step) {
      SCOPED_TRACE("layer " + std::to_string(layer) + " step " + std::to_string(step));
      const token_data d = make_tokens(rng, cfg, batch, 1);
      const std::vector<float> x = decode(a, cfg, layer, slots, d);
      ASSERT_TRUE(shadowkv_test::all_finite(x));
      ASSERT_EQ(x, decode(b, cfg, layer, slots, d));
      for (const int slot : slots) ASSERT_EQ(a.selected_chunks(layer, slot), b.selected_chunks(layer, slot));
    }
    const token_data d = make_tokens(rng, cfg, batch, 17);
    std::vector<std::int64_t> lengths;
    for (std::int64_t i = 0; i < batch; ++i) lengths.push_back(17 - 5 * (i % 3));
    ASSERT_EQ(extend(a, cfg, layer, slots, d, lengths), extend(b, cfg, layer, slots, d, lengths));
  }
  std::vector<std::int64_t> removed;
  for (std::size_t i = 0; i < slots.size(); ++i) removed.push_back(static_cast<std::int64_t>(2 + 3 * (i % 3)));
  a.truncate(slots, removed);
  b.truncate(slots, removed);
}

TEST_P(fork_test, parked_child_and_source_keep_sharing_and_resume_as_unshared_copies) {
  make_stores(fork_config(GetParam()));
  ASSERT_EQ(a_->fork(0, 2), (std::vector<int>{1, 2}));
  const std::vector<int> all{0, 1, 2};
  run_alike(*a_, *b_, cfg_, all, 51);  // the three sequences differ now
  ASSERT_FALSE(HasFatalFailure());
  const std::vector<std::int64_t> stats_before = stats_numbers(a_->stats());

  // A child parked: the two live members share the prompt, and the parked one keeps it (no copy): its host_bytes
  // leave the prompt out while others hold it, and b_'s unshared one counts it.
  std::vector<shadowkv::parked_sequence> child = a_->park(std::vector<int>{1});
  std::vector<shadowkv::parked_sequence> child_copy = b_->park(std::vector<int>{1});
  EXPECT_EQ(shares(*a_, 0), std::vector<int>{2});
  EXPECT_EQ(shares(*a_, 2), std::vector<int>{0});
  expect_memory_shared_once(2);
  const std::int64_t prompt_sections = prompt_section_bytes(*a_);
  EXPECT_EQ(child[0].host_bytes() + prompt_sections, child_copy[0].host_bytes());
  EXPECT_EQ(stats_numbers(a_->stats()), stats_before) << "park changed stats()";
  run_alike(*a_, *b_, cfg_, {0, 2}, 52);  // the live ones go on meanwhile
  ASSERT_FALSE(HasFatalFailure());
  const std::vector<std::int64_t> stats_parked = stats_numbers(a_->stats());

  // The source parked too: the one live child holds the prompt alone (shared with parked states only: not in
  // memory_report's shared), and nothing lists a parked slot.
  std::vector<shadowkv::parked_sequence> source = a_->park(std::vector<int>{0});
  std::vector<shadowkv::parked_sequence> source_copy = b_->park(std::vector<int>{0});
  EXPECT_TRUE(shares(*a_, 2).empty());
  expect_memory_shared_once(1);
  EXPECT_EQ(a_->active_slots(), std::vector<int>{2});
  EXPECT_EQ(source[0].host_bytes() + prompt_sections, source_copy[0].host_bytes());

  // Both back, in the other order (the child into slot 0, the source into slot 1): the family is whole again.
  std::vector<shadowkv::parked_sequence> both;
  both.push_back(std::move(child[0]));
  both.push_back(std::move(source[0]));
  std::vector<shadowkv::parked_sequence> both_copies;
  both_copies.push_back(std::move(child_copy[0]));
  both_copies.push_back(std::move(source_copy[0]));
  ASSERT_EQ(a_->resume(both), (std::vector<int>{0, 1}));
  ASSERT_EQ(b_->resume(both_copies), (std::vector<int>{0, 1}));
  EXPECT_EQ(stats_numbers(a_->stats()), stats_parked) << "park or resume changed stats()";
  for (int layer = 0; layer < cfg_.num_layers; ++layer) {
    EXPECT_EQ(shares(*a_, 0, layer), (std::vector<int>{1, 2}));
    EXPECT_EQ(shares(*a_, 1, layer), (std::vector<int>{0, 2}));
  }
  expect_same_sequences(all);
  expect_memory_shared_once(3);
  run_alike(*a_, *b_, cfg_, all, 53);
  ASSERT_FALSE(HasFatalFailure());
  expect_same_sequences(all);
  expect_memory_shared_once(3);

  // The parked states kept the family's prompt alive: with every other member released, a parked one holds it alone
  // (its host_bytes now count it), and resumes as its unshared copy.
  std::vector<shadowkv::parked_sequence> last = a_->park(std::vector<int>{2});
  std::vector<shadowkv::parked_sequence> last_copy = b_->park(std::vector<int>{2});
  EXPECT_EQ(last[0].host_bytes() + prompt_sections, last_copy[0].host_bytes());
  a_->release(std::vector<int>{0, 1});
  b_->release(std::vector<int>{0, 1});
  EXPECT_EQ(last[0].host_bytes(), last_copy[0].host_bytes());
  EXPECT_EQ(a_->resume(last), std::vector<int>{0});
  EXPECT_EQ(b_->resume(last_copy), std::vector<int>{0});
  EXPECT_TRUE(shares(*a_, 0).empty());
  run_alike(*a_, *b_, cfg_, {0}, 54);
  ASSERT_FALSE(HasFatalFailure());
  expect_same_sequences({0});
  expect_memory_shared_once(1);
}

TEST_P(fork_test, a_saved_child_is_its_unshared_copys_file_and_loads_unshared) {
  make_stores(fork_config(GetParam()));
  ASSERT_EQ(a_->fork(0, 2), (std::vector<int>{1, 2}));
  const std::vector<int> all{0, 1, 2};
  run_alike(*a_, *b_, cfg_, all, 61);
  ASSERT_FALSE(HasFatalFailure());
  // The file stands alone: the shared prompt state is written in full, so a child's file and a source's are their
  // unshared copies', byte for byte.
  for (const int slot : {1, 0}) {
    const std::string shared_file = scratch_file("shared" + std::to_string(slot) + ".skv");
    const std::string unshared_file = scratch_file("unshared" + std::to_string(slot) + ".skv");
    a_->save(slot, shared_file);
    b_->save(slot, unshared_file);
    const std::vector<char> bytes = file_bytes(shared_file);
    ASSERT_FALSE(bytes.empty());
    EXPECT_EQ(bytes, file_bytes(unshared_file)) << "slot " << slot;
  }
  // The child loads unshared (a prompt state of its own, family 0) into its released slot; the family keeps sharing.
  const std::string child_file = scratch_file("shared1.skv");
  a_->release(std::vector<int>{1});
  b_->release(std::vector<int>{1});
  ASSERT_EQ(a_->load(child_file), 1);
  ASSERT_EQ(b_->load(child_file), 1);
  EXPECT_TRUE(shares(*a_, 1).empty());
  EXPECT_EQ(shares(*a_, 0), std::vector<int>{2});
  expect_same_sequences(all);
  expect_memory_shared_once(2);  // the family's prompt once, the loaded child's own once more
  run_alike(*a_, *b_, cfg_, all, 62);
  ASSERT_FALSE(HasFatalFailure());
  expect_same_sequences(all);
  // A fork of the loaded sequence makes a family of its own, apart from the first.
  a_->release(std::vector<int>{2});
  b_->release(std::vector<int>{2});
  ASSERT_EQ(a_->fork(1), std::vector<int>{2});
  EXPECT_EQ(shares(*a_, 1), std::vector<int>{2});
  EXPECT_TRUE(shares(*a_, 0).empty());
}

INSTANTIATE_TEST_SUITE_P(variants, fork_test,
                         shadowkv_test::every_variant(), shadowkv_test::store_variant_name);

// With N children the prompt's bytes are not multiplied: the store holds one prompt state and N + 1 copies of the
// rest (docs/semantics.md, "Memory report").
TEST(fork_memory, n_children_hold_one_prompt) {
  for (int children = 1; children <= 3; ++children) {
    SCOPED_TRACE(std::to_string(children) + " children");
    const config cfg = fork_config(variant::plain);
    kv_store s(cfg);
    random_source rng(7);
    ASSERT_EQ(s.add_sequences(1), std::vector<int>{0});
    prefill_all(s, cfg, {0}, make_prompt(rng, cfg));
    for (int step = 0; step < 20; ++step) (void)decode(s, cfg, 0, {0}, make_tokens(rng, cfg, 1, 1));
    const shadowkv::memory_report one = s.memory();
    const prompt_bytes p = prompt_formula(s);
    ASSERT_EQ(one.shared, 0);
    std::vector<int> expected;
    for (int i = 1; i <= children; ++i) expected.push_back(i);
    ASSERT_EQ(s.fork(0, children), expected);
    const shadowkv::memory_report m = s.memory();
    const std::int64_t copies = children + 1;
    EXPECT_EQ(m.shared, p.total());
    EXPECT_EQ(m.low_rank_factors, copies * one.low_rank_factors - children * p.factors);
    EXPECT_EQ(m.landmarks, copies * one.landmarks - children * p.landmarks);
    EXPECT_EQ(m.outliers, one.outliers);  // outliers are the prompt's only
    EXPECT_EQ(m.value_store, copies * one.value_store - children * p.values);
    EXPECT_EQ(m.exact_tokens, copies * one.exact_tokens);
    EXPECT_EQ(m.selection_cache, copies * one.selection_cache);
    EXPECT_EQ(m.fold_journal, copies * one.fold_journal);
    EXPECT_EQ(m.full_attention_equivalent, copies * one.full_attention_equivalent);
    EXPECT_EQ(m.total(), copies * one.total() - children * p.total());
  }
}

/// A store's observable state as one comparable list: memory, stats, live slots and every sequence's counters.
std::vector<std::int64_t> snapshot(const kv_store& s) {
  std::vector<std::int64_t> out = memory_numbers(s.memory());
  const std::vector<std::int64_t> st = stats_numbers(s.stats());
  out.insert(out.end(), st.begin(), st.end());
  for (const int slot : s.active_slots()) {
    out.push_back(slot);
    for (int layer = 0; layer < s.get_config().num_layers; ++layer) {
      const std::vector<std::int64_t> info = info_numbers(s, layer, slot);
      out.insert(out.end(), info.begin(), info.end());
      for (const int other : shares(s, slot, layer)) out.push_back(1000 + other);
    }
  }
  return out;
}

TEST(fork_errors, bad_input_changes_nothing) {
  const config cfg = fork_config(variant::plain);
  kv_store s(cfg);
  random_source rng(11);
  ASSERT_EQ(s.add_sequences(3), (std::vector<int>{0, 1, 2}));
  const prompt_data prompt = make_prompt(rng, cfg);
  prefill_all(s, cfg, {0}, prompt);
  // Slot 1: layer 0 only. Slot 2: no prompt.
  shadowkv::prefill_options options;
  s.prefill(0, std::vector<int>{1}, view_of(prompt.keys[0], {1, prompt_len, cfg.num_kv_heads, cfg.head_dim}),
            view_of(prompt.values[0], {1, prompt_len, cfg.num_kv_heads, cfg.head_dim}), options);
  (void)decode(s, cfg, 0, {0, 1}, make_tokens(rng, cfg, 2, 1));
  ASSERT_EQ(s.fork(0), std::vector<int>{3});  // a family, so that shares_prompt_with is in the snapshot
  s.release(std::vector<int>{3});
  const std::vector<std::int64_t> before = snapshot(s);
  EXPECT_THROW((void)s.fork(3), shadowkv::invalid_argument);   // released
  EXPECT_THROW((void)s.fork(4), shadowkv::invalid_argument);   // out of range
  EXPECT_THROW((void)s.fork(-1), shadowkv::invalid_argument);  // out of range
  EXPECT_THROW((void)s.fork(1), shadowkv::invalid_argument);   // layer 1 not prefilled
  EXPECT_THROW((void)s.fork(2), shadowkv::invalid_argument);   // no prompt
  EXPECT_THROW((void)s.fork(0, 0), shadowkv::invalid_argument);
  EXPECT_THROW((void)s.fork(0, -3), shadowkv::invalid_argument);
  EXPECT_EQ(snapshot(s), before);
  try {
    (void)s.fork(0, 2);  // one slot is free
    ADD_FAILURE() << "fork into more slots than are free did not throw";
  } catch (const shadowkv::capacity_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("into 2 sequences"), std::string::npos) << message;
    EXPECT_NE(message.find("only 1 of max_batch=4"), std::string::npos) << message;
  }
  try {
    (void)s.fork(1);
    ADD_FAILURE() << "fork of a sequence without every layer did not throw";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("layer 1 of slot 1 has no prompt"), std::string::npos) << error.what();
  }
  EXPECT_EQ(snapshot(s), before);
}

// value_store="auto": a child whose values are on the device is charged only what it does not share (its own runs, at
// capacity); the prompt's runs stay charged to one live sequence of the family, the source until it is released.
TEST(fork_placement, device_budget_charges_what_a_child_does_not_share) {
  config cfg = fork_config(variant::plain);
  cfg.value_store = shadowkv::value_store_policy::auto_place;
  const kv_store plain(fork_config(variant::plain));
  const std::int64_t per_sequence = plain.value_bytes_per_sequence();
  const std::int64_t prompt_runs = prompt_formula(plain).values;
  ASSERT_GT(prompt_runs, 0);
  ASSERT_LT(2 * prompt_runs, per_sequence);
  // Room for a sequence and a child, with prompt_runs / 2 to spare.
  cfg.device_value_budget = 2 * per_sequence - prompt_runs / 2;
  kv_store s(cfg);
  random_source rng(13);
  ASSERT_EQ(s.add_sequences(1), std::vector<int>{0});
  prefill_all(s, cfg, {0}, make_prompt(rng, cfg));
  ASSERT_EQ(s.info(0, 0).values_on, shadowkv::value_place::device);
  ASSERT_EQ(s.fork(0), std::vector<int>{1});
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    EXPECT_EQ(s.info(layer, 1).values_on, shadowkv::value_place::device);
  }
  const shadowkv::memory_report m = s.memory();
  EXPECT_EQ(m.value_store_device, prompt_runs);  // the prompt's runs, once
  EXPECT_EQ(m.value_store_host, 0);
  // prompt_runs / 2 left: no room for a whole sequence...
  ASSERT_EQ(s.add_sequences(1), std::vector<int>{2});
  EXPECT_EQ(s.info(0, 2).values_on, shadowkv::value_place::host);
  // ...nor for another child (per_sequence - prompt_runs): MemoryError, nothing changed.
  const std::vector<std::int64_t> before = snapshot(s);
  EXPECT_THROW((void)s.fork(0), shadowkv::out_of_memory);
  EXPECT_EQ(snapshot(s), before);
  // Releasing the source passes the shared runs' charge to the child, which now holds per_sequence: a new sequence
  // does not fit (it would, had the release given the shared runs' bytes back while the child still holds them).
  s.release(std::vector<int>{0});
  ASSERT_EQ(s.add_sequences(1), std::vector<int>{0});
  EXPECT_EQ(s.info(0, 0).values_on, shadowkv::value_place::host);
  s.release(std::vector<int>{0});
  // Releasing the child, the family's last sequence, gives everything back: one whole sequence fits, not two.
  s.release(std::vector<int>{1});
  ASSERT_EQ(s.add_sequences(2), (std::vector<int>{0, 1}));
  EXPECT_EQ(s.info(0, 0).values_on, shadowkv::value_place::device);
  EXPECT_EQ(s.info(0, 1).values_on, shadowkv::value_place::host);
  // A host sequence forks to the host, whatever the budget.
  prefill_all(s, cfg, {1}, make_prompt(rng, cfg));
  ASSERT_EQ(s.fork(1), std::vector<int>{3});
  EXPECT_EQ(s.info(0, 3).values_on, shadowkv::value_place::host);
}

// value_store="auto" with park and resume: a parked sequence holds no device budget, and the charge of the prompt's
// shared runs moves as release moves it: parking the member that carries them passes it to the lowest live member;
// a resumed member is charged what a child is while a member of its family is live on the device, else a whole value
// store (and it carries the runs). The memory report counts the shared runs once among the live sequences.
TEST(fork_placement, park_and_resume_move_the_shared_runs_charge_as_release_does) {
  config cfg = fork_config(variant::plain);
  cfg.value_store = shadowkv::value_store_policy::auto_place;
  const kv_store plain(fork_config(variant::plain));
  const std::int64_t per_sequence = plain.value_bytes_per_sequence();
  const std::int64_t prompt_runs = prompt_formula(plain).values;
  ASSERT_GT(prompt_runs, 0);
  ASSERT_LT(2 * prompt_runs, per_sequence);
  // Room for a sequence and a child (2 * per_sequence - prompt_runs), with prompt_runs / 2 to spare.
  cfg.device_value_budget = 2 * per_sequence - prompt_runs / 2;
  kv_store s(cfg);
  random_source rng(17);
  ASSERT_EQ(s.add_sequences(1), std::vector<int>{0});
  prefill_all(s, cfg, {0}, make_prompt(rng, cfg));
  ASSERT_EQ(s.fork(0), std::vector<int>{1});
  const std::int64_t own_runs = s.memory().value_store_device - prompt_runs;  // both sequences' folded runs (none)
  const auto on_device = [&](int slot) { return s.info(0, slot).values_on == shadowkv::value_place::device; };

  // The source parked: its charge leaves, but the shared runs' passes to the child (which still reads them), so a new
  // sequence does not fit the device (it would, had the park given back the source's whole value store).
  std::vector<shadowkv::parked_sequence> source = s.park(std::vector<int>{0});
  EXPECT_EQ(s.memory().value_store_device, prompt_runs + own_runs);
  EXPECT_EQ(s.memory().shared, 0);
  ASSERT_EQ(s.add_sequences(1), std::vector<int>{0});
  EXPECT_FALSE(on_device(0));
  s.release(std::vector<int>{0});
  // Resumed beside the child, the source is charged as a child (per_sequence - prompt_runs): it fits.
  ASSERT_EQ(s.resume(source), std::vector<int>{0});
  EXPECT_TRUE(on_device(0));
  EXPECT_EQ(shares(s, 0), std::vector<int>{1});
  EXPECT_EQ(s.memory().value_store_device, prompt_runs + own_runs);
  EXPECT_GT(s.memory().shared, 0);

  // Both parked, then both resumed in one call: the first is charged a whole value store, the second a child's.
  std::vector<shadowkv::parked_sequence> family = s.park(std::vector<int>{1, 0});
  EXPECT_TRUE(s.active_slots().empty());
  // Nothing charged now: two whole sequences would not fit (2 * per_sequence), but one and a child's share do.
  ASSERT_EQ(s.resume(family), (std::vector<int>{0, 1}));
  EXPECT_TRUE(on_device(0) && on_device(1));
  EXPECT_EQ(shares(s, 0), std::vector<int>{1});
  // Room left: prompt_runs / 2, so a new sequence goes to the host.
  ASSERT_EQ(s.add_sequences(1), std::vector<int>{2});
  EXPECT_FALSE(on_device(2));
  s.release(std::vector<int>{2});

  // Both parked, and a whole sequence on the device meanwhile: per_sequence - prompt_runs / 2 left, too little for
  // either parked member alone (no member of the family is live: a whole value store), and MemoryError changes
  // nothing (the objects keep their states).
  family = s.park(std::vector<int>{0, 1});
  ASSERT_EQ(s.add_sequences(1), std::vector<int>{0});
  ASSERT_TRUE(on_device(0));
  EXPECT_THROW((void)s.resume(family), shadowkv::out_of_memory);
  std::vector<shadowkv::parked_sequence> one;
  one.push_back(std::move(family[1]));
  EXPECT_THROW((void)s.resume(one), shadowkv::out_of_memory);
  EXPECT_FALSE(one[0].empty());
  EXPECT_FALSE(family[0].empty());
  EXPECT_EQ(s.active_slots(), std::vector<int>{0});
  // Without it, the two fit in two calls: the first a whole value store, the second (beside it) a child's.
  s.release(std::vector<int>{0});
  ASSERT_EQ(s.resume(one), std::vector<int>{0});
  std::vector<shadowkv::parked_sequence> other;
  other.push_back(std::move(family[0]));
  ASSERT_EQ(s.resume(other), std::vector<int>{1});
  EXPECT_TRUE(on_device(0) && on_device(1));
  EXPECT_EQ(shares(s, 1), std::vector<int>{0});

  // Releasing both gives everything back: one whole sequence fits the device again, not two.
  s.release(std::vector<int>{0, 1});
  ASSERT_EQ(s.add_sequences(2), (std::vector<int>{0, 1}));
  EXPECT_TRUE(on_device(0));
  EXPECT_FALSE(on_device(1));
}

}  // namespace
