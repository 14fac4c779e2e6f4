// park / resume and save / load (docs/semantics.md, "Fork, park and save"),
// each proven by an equality: a sequence parked and resumed, or saved and
// loaded, continues bit for bit as a copy that was never parked or saved (a
// second store fed the same tokens): decode and extend outputs, selections,
// counters. Plus the refusals, each of which changes nothing, and stats() that
// none of the calls moves.
#include <gtest/gtest.h>
#include <unistd.h>  // getpid

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "shadowkv/errors.hpp"
#include "shadowkv/store.hpp"
#include "store_test_support.hpp"

namespace {

using shadowkv::config;
using shadowkv::kv_store;
using shadowkv::parked_sequence;
using shadowkv_test::mutable_view_of;
using shadowkv_test::random_source;
using shadowkv_test::view_of;

/// Variants of the store whose saved state has other arrays (docs/api.md,
/// "Saved sequences").
enum class variant { plain, two_centroids, lru_cache, fp8_values, float32 };

std::string variant_name(const ::testing::TestParamInfo<variant>& info) {
  switch (info.param) {
    case variant::plain:
      return "plain";
    case variant::two_centroids:
      return "two_centroids";
    case variant::lru_cache:
      return "lru_cache";
    case variant::fp8_values:
      return "fp8_values";
    case variant::float32:
      return "float32";
  }
  return "unknown";
}

/// Two layers, GQA 4/2, D 64, chunks of 8, window 16 (a fold every 8 tokens
/// once full), blocks of 8, 4 slots.
config keeping_config(variant v) {
  config cfg = shadowkv_test::twin_config();
  cfg.max_seq_len = 400;
  cfg.extend_block = 8;
  switch (v) {
    case variant::plain:
      break;
    case variant::two_centroids:
      cfg.chunk_score = shadowkv::chunk_score_rule::two_centroids;
      break;
    case variant::lru_cache:
      cfg.cache_tokens = 2 * cfg.budget;
      break;
    case variant::fp8_values:
      cfg.values_as = shadowkv::value_format::fp8_e4m3;
      break;
    case variant::float32:
      cfg.kv_dtype = shadowkv::dtype::float32;
      break;
  }
  return cfg;
}

/// A sequence: a store and a slot of it.
struct sequence_ref {
  kv_store* store;
  int slot;
};

// Files of the tests: one directory per process (other builds on the host may run these tests at the same time),
// removed when the process ends.
std::filesystem::path temporary_directory() {
  return std::filesystem::path(::testing::TempDir()) / ("shadowkv_test_keeping_" + std::to_string(::getpid()));
}

class temporary_cleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(temporary_directory(), ignored);
  }
};
const ::testing::Environment* const temporary_cleanup_registered =
    ::testing::AddGlobalTestEnvironment(new temporary_cleanup);

std::string temporary_path(const std::string& name) {
  const std::filesystem::path dir = temporary_directory();
  std::filesystem::create_directories(dir);
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string stem = std::string(test->test_suite_name()) + "." + test->name() + "." + name;
  for (char& c : stem) {
    if (c == '/') c = '_';
  }
  return (dir / stem).string();
}

std::vector<char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A store's observable state as one comparable value: active slots, memory
/// report, stats, every sequence's counters.
struct snapshot {
  std::vector<std::int64_t> numbers;
  bool operator==(const snapshot&) const = default;
};

snapshot take_snapshot(const kv_store& s) {
  snapshot out;
  const shadowkv::memory_report m = s.memory();
  const shadowkv::store_stats st = s.stats();
  out.numbers = {m.low_rank_factors, m.landmarks,          m.outliers,        m.exact_tokens,
                 m.value_store,      m.value_store_device, m.selection_cache, m.fold_journal,
                 st.decode_steps,    st.selections,        st.hits,           st.misses,
                 st.chunks_rebuilt,  st.bytes_fetched,     st.folds};
  for (const int slot : s.active_slots()) {
    out.numbers.push_back(slot);
    for (int layer = 0; layer < s.get_config().num_layers; ++layer) {
      const shadowkv::sequence_info info = s.info(layer, slot);
      out.numbers.insert(out.numbers.end(), {info.prompt_len, info.total_len, info.context_chunks,
                                             info.generated_exact_len, info.last_position});
    }
  }
  return out;
}

bool same_stats(const shadowkv::store_stats& x, const shadowkv::store_stats& y) {
  return x.decode_steps == y.decode_steps && x.selections == y.selections && x.hits == y.hits && x.misses == y.misses &&
         x.chunks_rebuilt == y.chunks_rebuilt && x.bytes_fetched == y.bytes_fetched && x.folds == y.folds;
}

/// Helpers of the tests: stores of `cfg_`, their sequences' inputs, and the
/// equalities.
class keeping_base : public ::testing::Test {
 protected:
  std::unique_ptr<kv_store> new_store(const config& cfg) const { return std::make_unique<kv_store>(cfg); }

  /// Prefills `slots` of `s` (every layer) with prompts of 100 and 77 tokens
  /// from `seed`, with a warm-up query.
  void prefill(kv_store& s, const std::vector<int>& slots, std::uint64_t seed) const {
    random_source rng(seed);
    const auto batch = static_cast<std::int64_t>(slots.size());
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      const std::int64_t length = 100;
      const auto keys = rng.normals(static_cast<std::size_t>(batch * length * cfg_.kv_width()));
      const auto values = rng.normals(static_cast<std::size_t>(batch * length * cfg_.kv_width()));
      const auto q_last = rng.normals(static_cast<std::size_t>(batch * cfg_.num_q_heads * cfg_.head_dim));
      shadowkv::prefill_options options;
      options.lengths.assign(slots.size(), length);
      if (slots.size() > 1) options.lengths[1] = 77;
      options.q_last = view_of(q_last, {batch, 1, cfg_.num_q_heads, cfg_.head_dim});
      s.prefill(layer, slots, view_of(keys, {batch, length, cfg_.num_kv_heads, cfg_.head_dim}),
                view_of(values, {batch, length, cfg_.num_kv_heads, cfg_.head_dim}), options);
    }
  }

  /// One extend of `tokens` tokens of every layer on each of `sequences` (one
  /// call per sequence), with the same data for all; returns the outputs
  /// concatenated.
  std::vector<float> extend(const std::vector<sequence_ref>& sequences, std::int64_t tokens, std::uint64_t seed,
                            bool compare) const {
    random_source rng(seed);
    std::vector<float> all;
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      const auto q = rng.normals(static_cast<std::size_t>(tokens * cfg_.num_q_heads * cfg_.head_dim));
      const auto k = rng.normals(static_cast<std::size_t>(tokens * cfg_.kv_width()));
      const auto v = rng.normals(static_cast<std::size_t>(tokens * cfg_.kv_width()));
      std::vector<float> first;
      for (const sequence_ref& ref : sequences) {
        std::vector<float> out(q.size(), -7.0F);
        ref.store->extend(layer, std::vector<int>{ref.slot}, view_of(q, {1, tokens, cfg_.num_q_heads, cfg_.head_dim}),
                          view_of(k, {1, tokens, cfg_.num_kv_heads, cfg_.head_dim}),
                          view_of(v, {1, tokens, cfg_.num_kv_heads, cfg_.head_dim}),
                          mutable_view_of(out, {1, tokens, cfg_.num_q_heads, cfg_.head_dim}));
        EXPECT_TRUE(shadowkv_test::all_finite(out));
        if (compare && !first.empty()) {
          EXPECT_EQ(out, first) << "extend of " << tokens << " tokens, layer " << layer << ", slot " << ref.slot;
        }
        if (first.empty()) first = out;
      }
      all.insert(all.end(), first.begin(), first.end());
    }
    return all;
  }

  /// `steps` decode steps of every layer on each of `sequences` with the same
  /// data; with `compare`, their outputs and selections must agree bit for bit.
  void decode(const std::vector<sequence_ref>& sequences, std::int64_t steps, std::uint64_t seed,
              bool compare = true) const {
    random_source rng(seed);
    for (std::int64_t step = 0; step < steps; ++step) {
      for (int layer = 0; layer < cfg_.num_layers; ++layer) {
        const auto q = rng.normals(static_cast<std::size_t>(cfg_.num_q_heads * cfg_.head_dim));
        const auto k = rng.normals(static_cast<std::size_t>(cfg_.kv_width()));
        const auto v = rng.normals(static_cast<std::size_t>(cfg_.kv_width()));
        std::vector<float> first;
        for (const sequence_ref& ref : sequences) {
          std::vector<float> out(q.size(), -7.0F);
          ref.store->decode(layer, std::vector<int>{ref.slot}, view_of(q, {1, cfg_.num_q_heads, cfg_.head_dim}),
                            view_of(k, {1, cfg_.num_kv_heads, cfg_.head_dim}),
                            view_of(v, {1, cfg_.num_kv_heads, cfg_.head_dim}),
                            mutable_view_of(out, {1, cfg_.num_q_heads, cfg_.head_dim}));
          ASSERT_TRUE(shadowkv_test::all_finite(out));
          if (compare && !first.empty()) {
            ASSERT_EQ(out, first) << "decode step " << step << ", layer " << layer << ", slot " << ref.slot;
            ASSERT_EQ(ref.store->selected_chunks(layer, ref.slot),
                      sequences.front().store->selected_chunks(layer, sequences.front().slot));
          }
          if (first.empty()) first = out;
        }
      }
    }
  }

  /// Removes generation_window tokens from each sequence (undoing folds: the
  /// journal's rows come back) and checks that they agree afterwards.
  void truncate(const std::vector<sequence_ref>& sequences) const {
    const std::int64_t folds_before = sequences[0].store->info(0, sequences[0].slot).context_chunks;
    for (const sequence_ref& ref : sequences) {
      ref.store->truncate(std::vector<int>{ref.slot}, std::vector<std::int64_t>{cfg_.generation_window});
    }
    EXPECT_LT(sequences[0].store->info(0, sequences[0].slot).context_chunks, folds_before) << "no fold was undone";
    for (std::size_t i = 1; i < sequences.size(); ++i) expect_same(sequences[i], sequences[0]);
  }

  /// The same counters, selections and outliers in every layer.
  void expect_same(sequence_ref x, sequence_ref y) const {
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      SCOPED_TRACE("layer " + std::to_string(layer));
      const shadowkv::sequence_info a = x.store->info(layer, x.slot);
      const shadowkv::sequence_info b = y.store->info(layer, y.slot);
      EXPECT_EQ(a.prefilled, b.prefilled);
      EXPECT_EQ(a.prompt_len, b.prompt_len);
      EXPECT_EQ(a.total_len, b.total_len);
      EXPECT_EQ(a.context_chunks, b.context_chunks);
      EXPECT_EQ(a.outlier_chunks, b.outlier_chunks);
      EXPECT_EQ(a.local_len, b.local_len);
      EXPECT_EQ(a.generated_exact_len, b.generated_exact_len);
      EXPECT_EQ(a.last_position, b.last_position);
      EXPECT_EQ(a.values_on, b.values_on);
      EXPECT_EQ(x.store->selected_chunks(layer, x.slot), y.store->selected_chunks(layer, y.slot));
      EXPECT_EQ(x.store->outlier_chunks(layer, x.slot), y.store->outlier_chunks(layer, y.slot));
    }
  }

  /// Equal now, and for a future of decode steps (folds on the way) and extends
  /// (one of several blocks, one of one token): outputs and selections bit for
  /// bit.
  void expect_same_future(const std::vector<sequence_ref>& sequences, std::uint64_t seed) const {
    // Hits and misses (and so the bytes fetched and the chunks rebuilt) depend
    // on the selection cache's slots and their LRU stamps, which no output
    // shows: each store's counters must grow by the same amounts per sequence.
    std::map<kv_store*, std::pair<shadowkv::store_stats, std::int64_t>> before;
    for (const sequence_ref& ref : sequences) {
      auto entry = before.try_emplace(ref.store, ref.store->stats(), 0).first;
      entry->second.second += 1;
    }
    const auto growth = [&](kv_store* store) {
      const shadowkv::store_stats now = store->stats();
      const shadowkv::store_stats& then = before.at(store).first;
      const std::int64_t n = before.at(store).second;
      return std::vector<std::int64_t>{(now.decode_steps - then.decode_steps) / n,
                                       (now.selections - then.selections) / n,
                                       (now.hits - then.hits) / n,
                                       (now.misses - then.misses) / n,
                                       (now.chunks_rebuilt - then.chunks_rebuilt) / n,
                                       (now.bytes_fetched - then.bytes_fetched) / n,
                                       (now.folds - then.folds) / n,
                                       (now.hits - then.hits) % n + (now.misses - then.misses) % n};
    };
    for (std::size_t i = 1; i < sequences.size(); ++i) expect_same(sequences[i], sequences[0]);
    // First a truncate of a window's worth of tokens: it undoes folds from the
    // fold journal as it was kept (later folds would trim the journal's older
    // rows before a later truncate could read them).
    truncate(sequences);
    decode(sequences, 11, seed);
    (void)extend(sequences, 19, seed + 1, true);
    decode(sequences, 3, seed + 2);
    (void)extend(sequences, 1, seed + 3, true);
    truncate(sequences);
    decode(sequences, 9, seed + 4);
    for (std::size_t i = 1; i < sequences.size(); ++i) expect_same(sequences[i], sequences[0]);
    for (const sequence_ref& ref : sequences) {
      EXPECT_EQ(growth(ref.store), growth(sequences[0].store)) << "stats of slot " << ref.slot;
    }
  }
  void expect_same_future(sequence_ref x, sequence_ref y, std::uint64_t seed) const {
    expect_same_future(std::vector<sequence_ref>{x, y}, seed);
  }

  /// Stores `a` and `b` with the same history in slots 0 and 1: prompts, an
  /// extend of 30 tokens (blocks of 8, folds) and 9 decode steps per layer, so
  /// that each sequence has generated tokens, a fold journal and a selection
  /// cache.
  void make_twins() {
    a_ = new_store(cfg_);
    b_ = new_store(cfg_);
    for (kv_store* s : {a_.get(), b_.get()}) {
      ASSERT_EQ(s->add_sequences(2), (std::vector<int>{0, 1}));
      prefill(*s, {0, 1}, 17);
    }
    for (const int slot : {0, 1}) {
      (void)extend({{a_.get(), slot}, {b_.get(), slot}}, 30, 100 + slot, true);
      decode({{a_.get(), slot}, {b_.get(), slot}}, 9, 200 + slot);
    }
    ASSERT_GT(a_->memory().fold_journal, 0);
    ASSERT_GT(a_->stats().folds, 0);
    for (int layer = 0; layer < cfg_.num_layers; ++layer) {
      ASSERT_FALSE(a_->selected_chunks(layer, 0)[0].empty());
      ASSERT_GT(a_->info(layer, 0).generated_exact_len, 0);
    }
  }

  config cfg_;
  std::unique_ptr<kv_store> a_;
  std::unique_ptr<kv_store> b_;
};

class keeping_test : public keeping_base, public ::testing::WithParamInterface<variant> {
 protected:
  void SetUp() override { cfg_ = keeping_config(GetParam()); }
};

TEST_P(keeping_test, park_then_resume_continues_bit_for_bit) {
  make_twins();
  const std::int64_t tokens = a_->info(0, 0).total_len;
  const shadowkv::memory_report before = a_->memory();
  const shadowkv::store_stats stats = a_->stats();
  std::vector<parked_sequence> parked = a_->park(std::vector<int>{0});
  ASSERT_EQ(parked.size(), 1U);
  EXPECT_FALSE(parked[0].empty());
  EXPECT_EQ(parked[0].parked_from(), 0);
  EXPECT_EQ(parked[0].tokens(), tokens);
  // It holds at least what the memory report counted for it (and positions and
  // flags besides).
  const shadowkv::memory_report after = a_->memory();
  EXPECT_GE(parked[0].host_bytes(), before.total() - after.total());
  EXPECT_GT(before.total(), after.total());
  EXPECT_EQ(a_->active_slots(), std::vector<int>{1});
  EXPECT_TRUE(same_stats(a_->stats(), stats));

  // The slot is free: decode there names it parked; another sequence takes it
  // and runs meanwhile.
  try {
    decode({{a_.get(), 0}}, 1, 5, false);
    ADD_FAILURE() << "decode on a parked slot did not throw";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("parked"), std::string::npos) << error.what();
  }
  ASSERT_EQ(a_->add_sequences(1), std::vector<int>{0});
  prefill(*a_, {0}, 99);
  decode({{a_.get(), 0}}, 12, 7, false);
  (void)extend({{a_.get(), 0}}, 13, 8, false);
  // The other live sequence is untouched too.
  expect_same({a_.get(), 1}, {b_.get(), 1});

  EXPECT_EQ(a_->resume(parked), std::vector<int>{2});
  EXPECT_TRUE(parked[0].empty());
  EXPECT_EQ(parked[0].tokens(), 0);
  EXPECT_EQ(parked[0].host_bytes(), 0);
  EXPECT_EQ(a_->active_slots(), (std::vector<int>{0, 1, 2}));
  expect_same_future({a_.get(), 2}, {b_.get(), 0}, 31);
  expect_same_future({a_.get(), 1}, {b_.get(), 1}, 41);
}

TEST_P(keeping_test, park_of_several_and_resume_in_another_order) {
  make_twins();
  std::vector<parked_sequence> parked = a_->park(std::vector<int>{1, 0});
  EXPECT_EQ(parked[0].parked_from(), 1);
  EXPECT_EQ(parked[1].parked_from(), 0);
  EXPECT_TRUE(a_->active_slots().empty());
  EXPECT_EQ(a_->memory().total(), 0);
  // A release of a parked slot is refused like any slot not live, naming it
  // parked.
  try {
    a_->release(std::vector<int>{0});
    ADD_FAILURE() << "release of a parked slot did not throw";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("parked"), std::string::npos) << error.what();
  }
  std::vector<parked_sequence> reversed;
  reversed.push_back(std::move(parked[1]));  // slot 0's sequence first
  reversed.push_back(std::move(parked[0]));
  EXPECT_EQ(a_->resume(reversed), (std::vector<int>{0, 1}));
  expect_same_future({a_.get(), 0}, {b_.get(), 0}, 51);
  expect_same_future({a_.get(), 1}, {b_.get(), 1}, 52);
  // A slot taken again and released no longer names the parked sequence.
  a_->release(std::vector<int>{0});
  try {
    decode({{a_.get(), 0}}, 1, 5, false);
    ADD_FAILURE() << "decode on a released slot did not throw";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_EQ(std::string(error.what()).find("parked"), std::string::npos) << error.what();
  }
}

TEST_P(keeping_test, save_then_load_continues_bit_for_bit) {
  make_twins();
  const std::string path = temporary_path("saved.skv");
  const snapshot before = take_snapshot(*a_);
  a_->save(0, path);
  EXPECT_EQ(take_snapshot(*a_), before);  // save changes nothing
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  // Into the same store (the lowest free slot) and into a new one.
  EXPECT_EQ(a_->load(path), 2);
  const auto c = new_store(cfg_);
  EXPECT_EQ(c->load(path), 0);
  EXPECT_TRUE(same_stats(a_->stats(), b_->stats()));  // the same history, and load moved no counter
  // The copies, the saved sequence (which goes on as it was) and the twin that
  // never saw a save.
  expect_same_future({{b_.get(), 0}, {a_.get(), 2}, {c.get(), 0}, {a_.get(), 0}}, 61);
}

TEST_P(keeping_test, load_into_a_store_of_other_capacity) {
  make_twins();
  const std::string path = temporary_path("saved.skv");
  a_->save(1, path);
  // max_batch and max_seq_len decide no saved byte: a store with one slot and
  // room for fewer tokens loads the file.
  config small = cfg_;
  small.max_batch = 1;
  small.max_seq_len = 300;
  kv_store c(small);
  EXPECT_EQ(c.load(path), 0);
  expect_same_future({&c, 0}, {b_.get(), 1}, 71);
  // One that cannot hold its tokens refuses it (capacity), changing nothing.
  small.max_seq_len = a_->info(0, 1).total_len - 1;
  kv_store d(small);
  EXPECT_THROW((void)d.load(path), shadowkv::capacity_error);
  EXPECT_TRUE(d.active_slots().empty());
}

TEST_P(keeping_test, stats_do_not_move) {
  make_twins();
  const shadowkv::store_stats stats = a_->stats();
  const std::string path = temporary_path("saved.skv");
  std::vector<parked_sequence> parked = a_->park(std::vector<int>{0});
  EXPECT_TRUE(same_stats(a_->stats(), stats));
  (void)a_->resume(parked);
  EXPECT_TRUE(same_stats(a_->stats(), stats));
  a_->save(0, path);
  EXPECT_TRUE(same_stats(a_->stats(), stats));
  (void)a_->load(path);
  EXPECT_TRUE(same_stats(a_->stats(), stats));
}

INSTANTIATE_TEST_SUITE_P(variants, keeping_test,
                         ::testing::Values(variant::plain, variant::two_centroids, variant::lru_cache,
                                           variant::fp8_values, variant::float32),
                         variant_name);

// --- refusals: each a clear error, the store unchanged
// ---------------------------------------------------------------

class keeping_errors : public keeping_base {
 protected:
  void SetUp() override { cfg_ = keeping_config(variant::plain); }
};

TEST_F(keeping_errors, park_and_resume_refusals_change_nothing) {
  make_twins();
  ASSERT_EQ(a_->add_sequences(1), std::vector<int>{2});
  prefill(*a_, {2}, 5);
  const snapshot before = take_snapshot(*a_);
  EXPECT_THROW((void)a_->park(std::vector<int>{}), shadowkv::invalid_argument);
  EXPECT_THROW((void)a_->park(std::vector<int>{3}),
               shadowkv::invalid_argument);  // not live
  EXPECT_THROW((void)a_->park(std::vector<int>{0, 0}),
               shadowkv::invalid_argument);  // repeated
  EXPECT_THROW((void)a_->park(std::vector<int>{0, 4}),
               shadowkv::invalid_argument);  // out of range
  EXPECT_EQ(take_snapshot(*a_), before);
  // A sequence not prefilled in every layer.
  ASSERT_EQ(a_->add_sequences(1), std::vector<int>{3});
  {
    random_source rng(3);
    const auto keys = rng.normals(static_cast<std::size_t>(40 * cfg_.kv_width()));
    a_->prefill(0, std::vector<int>{3}, view_of(keys, {1, 40, cfg_.num_kv_heads, cfg_.head_dim}),
                view_of(keys, {1, 40, cfg_.num_kv_heads, cfg_.head_dim}));
  }
  const snapshot with_three = take_snapshot(*a_);
  try {
    (void)a_->park(std::vector<int>{0, 3});
    ADD_FAILURE() << "park of a sequence without its layer 1 did not throw";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("layer 1 of slot 3"), std::string::npos) << error.what();
  }
  EXPECT_EQ(take_snapshot(*a_), with_three);

  // resume: none given, an empty object, one of another store, one already
  // resumed, no free slot.
  std::vector<parked_sequence> parked = a_->park(std::vector<int>{0});
  const snapshot parked_state = take_snapshot(*a_);
  EXPECT_THROW((void)a_->resume(std::span<parked_sequence>{}), shadowkv::invalid_argument);
  std::vector<parked_sequence> nothing(1);
  EXPECT_THROW((void)a_->resume(nothing), shadowkv::invalid_argument);
  std::vector<parked_sequence> from_b = b_->park(std::vector<int>{1});
  try {
    (void)a_->resume(from_b);
    ADD_FAILURE() << "resume into another store did not throw";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("another store"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(from_b[0].empty());
  // Both objects at once, one of them foreign: nothing resumes.
  std::vector<parked_sequence> mixed;
  mixed.push_back(std::move(parked[0]));
  mixed.push_back(std::move(from_b[0]));
  EXPECT_THROW((void)a_->resume(mixed), shadowkv::invalid_argument);
  EXPECT_FALSE(mixed[0].empty());
  EXPECT_EQ(take_snapshot(*a_), parked_state);
  // No free slot: a capacity error, and the object stays resumable.
  ASSERT_EQ(a_->add_sequences(1), std::vector<int>{0});
  const snapshot full = take_snapshot(*a_);
  EXPECT_THROW((void)a_->resume(std::span(mixed).first(1)), shadowkv::capacity_error);
  EXPECT_EQ(take_snapshot(*a_), full);
  EXPECT_FALSE(mixed[0].empty());
  a_->release(std::vector<int>{0});
  EXPECT_EQ(a_->resume(std::span(mixed).first(1)), std::vector<int>{0});
  EXPECT_THROW((void)a_->resume(std::span(mixed).first(1)),
               shadowkv::invalid_argument);  // resumed already
  EXPECT_EQ(b_->resume(std::span(mixed).subspan(1)), std::vector<int>{1});
  // b parked and resumed its slot 1 as well: both continue as they were.
  kv_store& a = *a_;
  kv_store& b = *b_;
  expect_same_future({&a, 0}, {&b, 0}, 81);
  expect_same_future({&a, 1}, {&b, 1}, 82);
}

/// A saved file of the plain variant's slot 0 after make_twins, and the store
/// that wrote it.
class load_errors : public keeping_base {
 protected:
  void SetUp() override {
    cfg_ = keeping_config(variant::plain);
    make_twins();
    path_ = temporary_path("saved.skv");
    a_->save(0, path_);
    bytes_ = file_bytes(path_);
    ASSERT_GT(bytes_.size(), 1000U);
  }

  /// Loading `bytes` into a_ throws `Error` whose message holds `expected`, and
  /// changes nothing.
  template <typename Error>
  void expect_refused(const std::vector<char>& bytes, const std::string& expected, const std::string& what) {
    SCOPED_TRACE(what);
    const std::string path = temporary_path("bad.skv");
    write_bytes(path, bytes);
    const snapshot before = take_snapshot(*a_);
    try {
      (void)a_->load(path);
      ADD_FAILURE() << "load did not throw";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
    EXPECT_EQ(take_snapshot(*a_), before);
  }

  /// Offset of the first section's bytes: the header's size (magic 8, version
  /// 4, layout, fingerprint, layer count, counters, values_on, section table).
  std::size_t header_size() const {
    std::size_t at = 12;
    const auto u32 = [&](std::size_t offset) {
      std::uint32_t v = 0;
      std::memcpy(&v, bytes_.data() + offset, 4);
      return v;
    };
    at += 4 + u32(at);                     // layout
    at += 4 + u32(at);                     // fingerprint
    const std::uint32_t layers = u32(at);  // layer count
    at += 4 + static_cast<std::size_t>(layers) * 64 + 1;
    const std::uint32_t sections = u32(at);
    at += 4;
    for (std::uint32_t i = 0; i < sections; ++i) at += 4 + u32(at) + 8;
    return at;
  }

  std::string path_;
  std::vector<char> bytes_;
};

TEST_F(load_errors, another_configuration_names_the_field) {
  for (const auto& [field, change] : std::vector<std::pair<std::string, std::function<void(config&)>>>{
           {"rank", [](config& c) { c.rank = 16; }},
           {"chunk_size", [](config& c) { c.chunk_size = 4; }},
           {"dtype", [](config& c) { c.kv_dtype = shadowkv::dtype::float16; }},
           {"generation_window", [](config& c) { c.generation_window = 32; }},
           {"num_layers", [](config& c) { c.num_layers = 3; }},
           {"rope_theta", [](config& c) { c.rope_theta = 500000.0; }},
           {"value_format", [](config& c) { c.values_as = shadowkv::value_format::fp8_e4m3; }},
           {"cache_tokens", [](config& c) { c.cache_tokens = 2 * c.budget; }},
       }) {
    SCOPED_TRACE(field);
    config other = cfg_;
    change(other);
    kv_store c(other);
    try {
      (void)c.load(path_);
      ADD_FAILURE() << "load into another configuration did not throw";
    } catch (const shadowkv::invalid_argument& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("another configuration: " + field + " is"), std::string::npos) << message;
    }
    EXPECT_TRUE(c.active_slots().empty());
  }
}

TEST_F(load_errors, truncated_files) {
  const std::size_t header = header_size();
  ASSERT_LT(header + 100, bytes_.size());
  for (const std::size_t size :
       {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{14}, std::size_t{40}, header / 2, header - 3,
        header, header + 77, bytes_.size() / 2, bytes_.size() - 9, bytes_.size() - 1}) {
    expect_refused<shadowkv::invalid_argument>(std::vector<char>(bytes_.begin(), bytes_.begin() + size), "truncated",
                                               "truncated to " + std::to_string(size) + " bytes");
  }
  // The message of a file cut inside its sections names both sizes.
  expect_refused<shadowkv::invalid_argument>(std::vector<char>(bytes_.begin(), bytes_.end() - 100),
                                             "truncated: expected " + std::to_string(bytes_.size()) +
                                                 " bytes, the file has " + std::to_string(bytes_.size() - 100),
                                             "100 bytes short");
  std::vector<char> longer = bytes_;
  longer.push_back('x');
  expect_refused<shadowkv::invalid_argument>(longer, "corrupted", "a byte too many");
}

TEST_F(load_errors, a_flipped_byte_anywhere) {
  const std::size_t header = header_size();
  std::vector<std::size_t> positions;
  for (std::size_t i = 0; i < header; i += 3) positions.push_back(i);  // every third byte of the header
  for (std::size_t i = header; i < bytes_.size(); i += (bytes_.size() - header) / 61 + 1) positions.push_back(i);
  for (std::size_t i = bytes_.size() - 8; i < bytes_.size(); ++i) positions.push_back(i);  // the checksum
  for (const std::size_t i : positions) {
    std::vector<char> flipped = bytes_;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x10);
    // Any refusal (magic, version, a length, the checksum); past the header's
    // lengths it is the checksum.
    expect_refused<shadowkv::invalid_argument>(flipped, i >= header ? "checksum" : "load",
                                               "byte " + std::to_string(i) + " flipped");
    if (::testing::Test::HasFailure()) return;
  }
}

TEST_F(load_errors, magic_version_and_a_full_store) {
  std::vector<char> magic = bytes_;
  magic[0] = 'X';
  expect_refused<shadowkv::invalid_argument>(magic, "not a saved sequence", "magic");
  std::vector<char> version = bytes_;
  version[8] = 2;
  expect_refused<shadowkv::invalid_argument>(version, "format version 2", "version");
  ASSERT_EQ(a_->add_sequences(2), (std::vector<int>{2, 3}));
  expect_refused<shadowkv::capacity_error>(bytes_, "no free slot", "a full store");
}

TEST_F(load_errors, files_that_cannot_be_read_or_written) {
  const snapshot before = take_snapshot(*a_);
  try {
    (void)a_->load(path_ + ".missing");
    ADD_FAILURE() << "load of a missing file did not throw";
  } catch (const shadowkv::io_error& error) {
    EXPECT_EQ(error.code(), ENOENT);
    EXPECT_EQ(error.path(), path_ + ".missing");
  }
  // A directory that does not exist, and a path that is a directory: nothing is
  // left behind.
  const std::string missing_dir = temporary_path("no_such_dir") + "/saved.skv";
  EXPECT_THROW(a_->save(0, missing_dir), shadowkv::io_error);
  EXPECT_FALSE(std::filesystem::exists(missing_dir));
  EXPECT_FALSE(std::filesystem::exists(missing_dir + ".tmp"));
  const std::string directory = temporary_path("a_directory");
  std::filesystem::create_directories(directory);
  EXPECT_THROW(a_->save(0, directory), shadowkv::io_error);
  EXPECT_TRUE(std::filesystem::is_directory(directory));
  EXPECT_FALSE(std::filesystem::exists(directory + ".tmp"));
  EXPECT_EQ(take_snapshot(*a_), before);
  // save of a slot not live or not prefilled in every layer.
  EXPECT_THROW(a_->save(3, path_), shadowkv::invalid_argument);
  ASSERT_EQ(a_->add_sequences(1), std::vector<int>{2});
  EXPECT_THROW(a_->save(2, path_), shadowkv::invalid_argument);
  EXPECT_EQ(file_bytes(path_), bytes_);  // the earlier file is intact
}

/// Where section `name` of `bytes` lies: (offset, size); (0, 0) when there is none.
std::pair<std::size_t, std::size_t> section_of(const std::vector<char>& bytes, const std::string& name) {
  std::size_t at = 12;
  const auto u32 = [&](std::size_t offset) {
    std::uint32_t v = 0;
    std::memcpy(&v, bytes.data() + offset, 4);
    return v;
  };
  at += 4 + u32(at);
  at += 4 + u32(at);
  at += 4 + static_cast<std::size_t>(u32(at)) * 64 + 1;
  const std::uint32_t sections = u32(at);
  at += 4;
  std::size_t payload = at;
  for (std::uint32_t i = 0; i < sections; ++i) payload += 4 + u32(payload) + 8;  // the table's end
  std::pair<std::size_t, std::size_t> found{0, 0};
  for (std::uint32_t i = 0; i < sections; ++i) {
    const std::string section(bytes.data() + at + 4, u32(at));
    at += 4 + section.size();
    std::int64_t size = 0;
    std::memcpy(&size, bytes.data() + at, 8);
    at += 8;
    if (section == name) found = {payload, static_cast<std::size_t>(size)};
    payload += static_cast<std::size_t>(size);
  }
  return found;
}

/// Rewrites the checksum of `bytes` (FNV-1a 64 of everything before it).
void fix_checksum(std::vector<char>& bytes) {
  std::uint64_t hash = 0xcbf29ce484222325ULL;
  for (std::size_t i = 0; i + 8 < bytes.size(); ++i) {
    hash ^= static_cast<std::uint8_t>(bytes[i]);
    hash *= 0x100000001b3ULL;
  }
  std::memcpy(bytes.data() + bytes.size() - 8, &hash, 8);
}

TEST_F(load_errors, a_consistent_but_crafted_file_is_refused) {
  // A cached chunk id out of range with a matching checksum: read_state's
  // content check refuses it. Find layer0.cache_chunks in the section table and
  // set its first entry to 10^6, then fix the checksum.
  std::vector<char> crafted = bytes_;
  const std::size_t target = section_of(crafted, "layer0.cache_chunks").first;
  ASSERT_GT(target, 0U);
  const std::int64_t huge = 1000000;
  std::memcpy(crafted.data() + target, &huge, 8);
  fix_checksum(crafted);
  expect_refused<shadowkv::invalid_argument>(crafted, "selection cache holds chunk id 1000000", "crafted");
}

TEST_F(load_errors, a_folded_chunk_flagged_as_an_outlier_is_refused) {
  // The outlier flags are a row of every context chunk per KV head in the file, and the prompt part holds the prompt
  // chunks' only: a folded chunk (the last of the row) flagged 1, with a matching checksum, is refused.
  const shadowkv::sequence_info info = a_->info(0, 0);
  ASSERT_GT(info.context_chunks, info.prompt_len / a_->get_config().chunk_size - a_->get_config().local_chunks)
      << "the saved sequence has no folded chunk";
  std::vector<char> crafted = bytes_;
  const auto [offset, size] = section_of(crafted, "layer0.is_outlier");
  ASSERT_GT(size, 0U);
  crafted[offset + size - 1] = 1;
  fix_checksum(crafted);
  expect_refused<shadowkv::invalid_argument>(crafted, "do not match its outlier ids", "a folded outlier");
}

}  // namespace
