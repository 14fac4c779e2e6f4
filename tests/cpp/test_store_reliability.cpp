// Reliability of kv_store (issue "no crash, no hang, no half-applied call"; docs/semantics.md, docs/errors.md):
//  * account_replayed_steps: rejected on a backend without graph replay; on one with replay, a step count past
//    max_seq_len (up to INT64_MAX) is a capacity error at once, and the counters follow the fold rule;
//  * threads: concurrent calls are serialised (exact counters, outputs of some serial order);
//  * non-finite inputs are rejected before anything changes; huge finite keys factorise;
//  * configurations that cannot be served are rejected at construction, naming the bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "capacity.hpp"
#include "cpu_backend.hpp"
#include "shadowkv/backend.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/store.hpp"
#include "store_test_support.hpp"

namespace {

using shadowkv::config;
using shadowkv::kv_store;
using shadowkv::sequence_info;
using shadowkv_test::decode_data;
using shadowkv_test::mutable_view_of;
using shadowkv_test::random_source;
using shadowkv_test::twins;
using shadowkv_test::view_of;

// The reproducer: 1 layer, Hq 4, Hkv 2, D 64, max_seq_len 200, rank 32, budget 24 tokens, 2 outlier and
// 2 local chunks, window 16, float32.
config replay_config() {
  config cfg;
  cfg.num_layers = 1;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 2;
  cfg.max_seq_len = 200;
  cfg.rank = 32;
  cfg.chunk_size = 8;
  cfg.budget = 24;
  cfg.outlier_chunks = 2;
  cfg.local_chunks = 2;
  cfg.generation_window = 16;
  cfg.kv_dtype = shadowkv::dtype::float32;
  return cfg;
}

void prefill_random(kv_store& store, int slot, std::int64_t length, std::uint64_t seed) {
  const config& cfg = store.get_config();
  random_source rng(seed);
  const std::vector<float> keys = rng.normals(static_cast<std::size_t>(length * cfg.kv_width()));
  const std::vector<float> values = rng.normals(static_cast<std::size_t>(length * cfg.kv_width()));
  store.prefill(0, std::vector<int>{slot}, view_of(keys, {1, length, cfg.num_kv_heads, cfg.head_dim}),
                view_of(values, {1, length, cfg.num_kv_heads, cfg.head_dim}));
}

std::vector<float> decode_one(kv_store& store, int layer, int slot, const decode_data& d) {
  const config& cfg = store.get_config();
  std::vector<float> out(d.q.size(), -1.0F);
  store.decode(layer, std::vector<int>{slot}, view_of(d.q, {1, cfg.num_q_heads, cfg.head_dim}),
               view_of(d.k, {1, cfg.num_kv_heads, cfg.head_dim}), view_of(d.v, {1, cfg.num_kv_heads, cfg.head_dim}),
               mutable_view_of(out, {1, cfg.num_q_heads, cfg.head_dim}));
  return out;
}

decode_data random_step(const config& cfg, random_source& rng) {
  return {rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim)),
          rng.normals(static_cast<std::size_t>(cfg.kv_width())), rng.normals(static_cast<std::size_t>(cfg.kv_width()))};
}

void expect_same_info(const sequence_info& a, const sequence_info& b) {
  EXPECT_EQ(a.prefilled, b.prefilled);
  EXPECT_EQ(a.prompt_len, b.prompt_len);
  EXPECT_EQ(a.total_len, b.total_len);
  EXPECT_EQ(a.context_chunks, b.context_chunks);
  EXPECT_EQ(a.local_len, b.local_len);
  EXPECT_EQ(a.generated_exact_len, b.generated_exact_len);
  EXPECT_EQ(a.last_position, b.last_position);
}

// ---------------------------------------------------------------------------------------------------------------
// account_replayed_steps
// ---------------------------------------------------------------------------------------------------------------

TEST(ReplayAccounting, RejectedOnTheCpuBackendAndLaterDecodesAreSound) {
  kv_store store(replay_config());
  kv_store twin(replay_config());
  for (kv_store* s : {&store, &twin}) {
    ASSERT_EQ(s->add_sequences(1), std::vector<int>{0});
    prefill_random(*s, 0, 60, 11);
  }
  const sequence_info before = store.info(0, 0);
  try {
    store.account_replayed_steps(0, std::vector<int>{0}, 20);
    ADD_FAILURE() << "account_replayed_steps was accepted by the CPU backend";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("replay"), std::string::npos) << error.what();
  }
  expect_same_info(store.info(0, 0), before);
  EXPECT_EQ(store.stats().decode_steps, 0);
  EXPECT_EQ(store.stats().folds, 0);
  // 30 decodes (they fold): the store still equals one that never saw the call.
  random_source rng(12);
  for (int step = 0; step < 30; ++step) {
    const decode_data d = random_step(store.get_config(), rng);
    const std::vector<float> out = decode_one(store, 0, 0, d);
    ASSERT_TRUE(shadowkv_test::all_finite(out)) << "step " << step;
    ASSERT_EQ(out, decode_one(twin, 0, 0, d)) << "step " << step;
  }
  EXPECT_EQ(store.info(0, 0).total_len, 90);
  expect_same_info(store.info(0, 0), twin.info(0, 0));
}

// The CPU backend, claiming graph replay: lets the store's accounting be tested without a GPU. (Its data do not
// advance with the counters, so these tests never decode after accounting.)
class replay_capable_backend final : public shadowkv::detail::cpu_backend {
 public:
  using cpu_backend::cpu_backend;
  [[nodiscard]] bool supports_replay() const override { return true; }
};

kv_store replay_capable_store(const config& cfg) {
  return kv_store(cfg, [](const config& effective) { return std::make_unique<replay_capable_backend>(effective); });
}

// The fold rule run step by step, as decode applies it.
struct loop_counters {
  std::int64_t folds = 0;
  std::int64_t exact = 0;
};
loop_counters run_fold_rule(std::int64_t exact, std::int64_t steps, std::int64_t window, std::int64_t chunk) {
  loop_counters c{0, exact};
  for (std::int64_t s = 0; s < steps; ++s) {
    if (c.exact == window) {
      c.folds += 1;
      c.exact -= chunk;
    }
    c.exact += 1;
  }
  return c;
}

TEST(ReplayAccounting, StepCountsPastCapacityFailAtOnceAndChangeNothing) {
  kv_store store = replay_capable_store(replay_config());
  ASSERT_EQ(store.add_sequences(2), (std::vector<int>{0, 1}));
  prefill_random(store, 0, 60, 21);
  prefill_random(store, 1, 40, 22);
  const sequence_info before0 = store.info(0, 0);
  const sequence_info before1 = store.info(0, 1);
  const std::int64_t max_len = store.get_config().max_seq_len;
  const auto started = std::chrono::steady_clock::now();
  for (const std::int64_t steps : {std::numeric_limits<std::int64_t>::max(),
                                   std::numeric_limits<std::int64_t>::max() - 59, max_len - 60 + 1,
                                   std::int64_t{1} << 62}) {
    SCOPED_TRACE("steps=" + std::to_string(steps));
    EXPECT_THROW(store.account_replayed_steps(0, std::vector<int>{1, 0}, steps), shadowkv::capacity_error);
    expect_same_info(store.info(0, 0), before0);
    expect_same_info(store.info(0, 1), before1);
    EXPECT_EQ(store.stats().decode_steps, 0);
    EXPECT_EQ(store.stats().folds, 0);
  }
  EXPECT_THROW(store.account_replayed_steps(0, std::vector<int>{0}, -1), shadowkv::invalid_argument);
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(1)) << "the rejection must not loop";

  // Exactly up to capacity is accepted, in O(1), with the loop's counters.
  const std::int64_t steps = max_len - 60;
  store.account_replayed_steps(0, std::vector<int>{0}, steps);
  const sequence_info after = store.info(0, 0);
  const loop_counters expected = run_fold_rule(0, steps, 16, 8);
  EXPECT_EQ(after.total_len, max_len);
  EXPECT_EQ(after.generated_exact_len, expected.exact);
  EXPECT_EQ(after.context_chunks, before0.context_chunks + expected.folds);
  EXPECT_EQ(store.stats().folds, expected.folds);
  EXPECT_EQ(store.stats().decode_steps, steps);
  expect_same_info(store.info(0, 1), before1);
  EXPECT_THROW(store.account_replayed_steps(0, std::vector<int>{0}, 1), shadowkv::capacity_error);
}

TEST(ReplayAccounting, CountersFollowTheFoldRuleAcrossCalls) {
  kv_store store = replay_capable_store(replay_config());
  ASSERT_EQ(store.add_sequences(1), std::vector<int>{0});
  prefill_random(store, 0, 60, 31);
  const std::int64_t prompt_chunks = store.info(0, 0).context_chunks;
  loop_counters expected;
  std::int64_t total = 0;
  for (const std::int64_t steps : {0, 1, 7, 8, 9, 16, 3, 33, 0, 24}) {
    store.account_replayed_steps(0, std::vector<int>{0}, steps);
    const loop_counters next = run_fold_rule(expected.exact, steps, 16, 8);
    expected = {expected.folds + next.folds, next.exact};
    total += steps;
    const sequence_info info = store.info(0, 0);
    EXPECT_EQ(info.total_len, 60 + total);
    EXPECT_EQ(info.generated_exact_len, expected.exact) << "after " << total << " steps";
    EXPECT_EQ(info.context_chunks, prompt_chunks + expected.folds) << "after " << total << " steps";
    EXPECT_EQ(store.stats().folds, expected.folds);
    EXPECT_EQ(store.stats().decode_steps, total);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// threads
// ---------------------------------------------------------------------------------------------------------------

constexpr int thread_count = 4;
constexpr int calls_per_thread = 50;

TEST(StoreThreads, ConcurrentDecodesOfDifferentSlotsEqualSerialRuns) {
  config cfg = replay_config();
  cfg.max_batch = thread_count;
  cfg.max_seq_len = 60 + calls_per_thread;
  kv_store shared(cfg);
  kv_store serial(cfg);
  std::vector<std::vector<decode_data>> inputs(thread_count);
  for (kv_store* s : {&shared, &serial}) {
    ASSERT_EQ(s->add_sequences(thread_count), (std::vector<int>{0, 1, 2, 3}));
    for (int slot = 0; slot < thread_count; ++slot) prefill_random(*s, slot, 60, 40 + static_cast<std::uint64_t>(slot));
  }
  for (int slot = 0; slot < thread_count; ++slot) {
    random_source rng(50 + static_cast<std::uint64_t>(slot));
    for (int i = 0; i < calls_per_thread; ++i) inputs[static_cast<std::size_t>(slot)].push_back(random_step(cfg, rng));
  }
  std::vector<std::vector<std::vector<float>>> outputs(thread_count);
  std::vector<std::thread> threads;
  for (int slot = 0; slot < thread_count; ++slot) {
    threads.emplace_back([&, slot] {
      for (const decode_data& d : inputs[static_cast<std::size_t>(slot)]) {
        outputs[static_cast<std::size_t>(slot)].push_back(decode_one(shared, 0, slot, d));
        (void)shared.stats();  // readers interleave with writers
        (void)shared.info(0, (slot + 1) % thread_count);
        (void)shared.memory();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(shared.stats().decode_steps, thread_count * calls_per_thread);
  for (int slot = 0; slot < thread_count; ++slot) {
    for (int i = 0; i < calls_per_thread; ++i) {
      ASSERT_EQ(outputs[static_cast<std::size_t>(slot)][static_cast<std::size_t>(i)],
                decode_one(serial, 0, slot, inputs[static_cast<std::size_t>(slot)][static_cast<std::size_t>(i)]))
          << "slot " << slot << " call " << i;
    }
    expect_same_info(shared.info(0, slot), serial.info(0, slot));
    EXPECT_EQ(shared.selected_chunks(0, slot), serial.selected_chunks(0, slot));
  }
  EXPECT_EQ(shared.stats().hits, serial.stats().hits);
  EXPECT_EQ(shared.stats().misses, serial.stats().misses);
  EXPECT_EQ(shared.stats().folds, serial.stats().folds);
}

TEST(StoreThreads, ConcurrentDecodesOfOneSlotFollowASerialOrder) {
  // Every call gets the same inputs, so every serial order gives the same outputs: the concurrent run must produce
  // exactly the serial run's outputs (as a multiset) and end in its state.
  config cfg = replay_config();
  cfg.max_seq_len = 60 + thread_count * calls_per_thread;
  kv_store shared(cfg);
  kv_store serial(cfg);
  for (kv_store* s : {&shared, &serial}) {
    ASSERT_EQ(s->add_sequences(1), std::vector<int>{0});
    prefill_random(*s, 0, 60, 61);
  }
  random_source rng(62);
  const decode_data d = random_step(cfg, rng);
  std::vector<std::vector<std::vector<float>>> outputs(thread_count);
  std::vector<std::thread> threads;
  for (int t = 0; t < thread_count; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < calls_per_thread; ++i) outputs[static_cast<std::size_t>(t)].push_back(decode_one(shared, 0, 0, d));
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::vector<float>> concurrent;
  for (const auto& list : outputs) concurrent.insert(concurrent.end(), list.begin(), list.end());
  std::vector<std::vector<float>> expected;
  for (int i = 0; i < thread_count * calls_per_thread; ++i) expected.push_back(decode_one(serial, 0, 0, d));
  std::sort(concurrent.begin(), concurrent.end());
  std::sort(expected.begin(), expected.end());
  EXPECT_TRUE(concurrent == expected) << "the concurrent outputs are not those of a serial run";
  EXPECT_EQ(shared.info(0, 0).total_len, 60 + thread_count * calls_per_thread);
  expect_same_info(shared.info(0, 0), serial.info(0, 0));
  EXPECT_EQ(shared.stats().decode_steps, thread_count * calls_per_thread);
  EXPECT_EQ(shared.stats().folds, serial.stats().folds);
  EXPECT_EQ(shared.stats().hits, serial.stats().hits);
  EXPECT_EQ(shared.selected_chunks(0, 0), serial.selected_chunks(0, 0));
}

TEST(StoreThreads, ConcurrentAddAndReleaseKeepSlotsConsistent) {
  config cfg = replay_config();
  cfg.max_batch = 8;
  kv_store store(cfg);
  std::vector<std::thread> threads;
  for (int t = 0; t < thread_count; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        const std::vector<int> slots = store.add_sequences(2);  // 4 threads x 2 slots <= max_batch: never full
        store.release(slots);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(store.active_slots().empty());
  EXPECT_EQ(store.add_sequences(8).size(), 8U);
}

// ---------------------------------------------------------------------------------------------------------------
// non-finite and huge inputs
// ---------------------------------------------------------------------------------------------------------------

template <typename Call>
void expect_rejected_and_unchanged(const std::string& what, const char* expected_text, Call&& bad) {
  SCOPED_TRACE(what);
  twins t(700 + std::hash<std::string>{}(what) % 100);
  try {
    bad(t);
    ADD_FAILURE() << what << ": accepted";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(expected_text), std::string::npos) << error.what();
  }
  t.expect_same_future();
}

TEST(NonFiniteInputs, PrefillRejectsNanOrInfInValidTokens) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  expect_rejected_and_unchanged("NaN key", "slot 1", [&](twins& t) {
    shadowkv_test::prefill_data d = t.make_prefill(1, 60);
    d.keys[5 * 128 + 3] = nan;
    t.prefill(t.subject, 1, {1}, 60, d, false);
  });
  expect_rejected_and_unchanged("Inf value in the last token", "values", [&](twins& t) {
    shadowkv_test::prefill_data d = t.make_prefill(1, 60);
    d.values.back() = -inf;
    t.prefill(t.subject, 1, {1}, 60, d, false);
  });
  expect_rejected_and_unchanged("NaN in q_last", "q_last", [&](twins& t) {
    shadowkv_test::prefill_data d = t.make_prefill(1, 60);
    d.q_last[7] = nan;
    t.prefill(t.subject, 1, {1}, 60, d, true);
  });
  expect_rejected_and_unchanged("Inf key in the second row of a batch", "slot 2", [&](twins& t) {
    shadowkv_test::prefill_data d = t.make_prefill(2, 60);
    d.keys[(60 + 59) * 128] = inf;
    t.prefill(t.subject, 1, {1, 2}, 60, d, false);
  });
}

TEST(NonFiniteInputs, PaddingMayHoldAnything) {
  twins t(710);
  shadowkv_test::prefill_data d = t.make_prefill(1, 50);
  std::fill(d.keys.begin() + 40 * 128, d.keys.end(), std::numeric_limits<float>::quiet_NaN());
  std::fill(d.values.begin() + 40 * 128, d.values.end(), std::numeric_limits<float>::infinity());
  shadowkv::prefill_options options;
  options.lengths = {40};
  t.both([&](kv_store& s) {
    s.prefill(1, std::vector<int>{1}, view_of(d.keys, {1, 50, 2, 64}), view_of(d.values, {1, 50, 2, 64}), options);
  });
  EXPECT_EQ(t.subject.info(1, 1).prompt_len, 40);
  t.expect_same_future();
}

TEST(NonFiniteInputs, DecodeRejectsNanOrInfInQueryOrToken) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  expect_rejected_and_unchanged("NaN q", "q (slot 1", [&](twins& t) {
    decode_data d = t.make_decode(2);
    d.q[4 * 64 + 1] = nan;
    (void)t.decode(t.subject, 0, {0, 1}, d);
  });
  expect_rejected_and_unchanged("Inf k_new", "k_new", [&](twins& t) {
    decode_data d = t.make_decode(2);
    d.k[0] = inf;
    (void)t.decode(t.subject, 0, {0, 1}, d);
  });
  expect_rejected_and_unchanged("NaN v_new", "v_new", [&](twins& t) {
    decode_data d = t.make_decode(1);
    d.v.back() = nan;
    (void)t.decode(t.subject, 1, {0}, d);
  });
}

// The CPU backend, counting the store's finiteness questions and claiming (if asked) that its check waits for a
// device, as the CUDA backend's does: check_finite's policy is tested without a GPU.
class counting_finite_backend final : public shadowkv::detail::cpu_backend {
 public:
  counting_finite_backend(const config& cfg, bool waits, int* questions)
      : cpu_backend(cfg), waits_(waits), questions_(questions) {}
  [[nodiscard]] std::optional<std::size_t> find_non_finite(std::span<const shadowkv::tensor_view> views) override {
    ++*questions_;
    return cpu_backend::find_non_finite(views);
  }
  [[nodiscard]] bool finite_check_waits() const override { return waits_; }

 private:
  bool waits_;
  int* questions_;
};

// Decodes slots {0, 1} in one call; returns out [2, Hq, D].
std::vector<float> decode_pair(kv_store& store, const decode_data& d) {
  const config& cfg = store.get_config();
  std::vector<float> out(d.q.size(), -1.0F);
  store.decode(0, std::vector<int>{0, 1}, view_of(d.q, {2, cfg.num_q_heads, cfg.head_dim}),
               view_of(d.k, {2, cfg.num_kv_heads, cfg.head_dim}), view_of(d.v, {2, cfg.num_kv_heads, cfg.head_dim}),
               mutable_view_of(out, {2, cfg.num_q_heads, cfg.head_dim}));
  return out;
}

TEST(NonFiniteInputs, CheckFiniteDecidesWhetherDecodeInputsAreChecked) {
  using shadowkv::finite_check;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const bool waits : {false, true}) {
    for (const finite_check check : {finite_check::automatic, finite_check::prefill, finite_check::always}) {
      const bool checked = check == finite_check::always || (check == finite_check::automatic && !waits);
      SCOPED_TRACE("check_finite=" + shadowkv::finite_check_name(check) + (waits ? ", check waits" : ", check free"));
      config cfg = replay_config();
      cfg.check_finite = check;
      int questions = 0;
      kv_store store(cfg, [&](const config& effective) {
        return std::make_unique<counting_finite_backend>(effective, waits, &questions);
      });
      kv_store twin(replay_config());
      for (kv_store* s : {&store, &twin}) ASSERT_EQ(s->add_sequences(2), (std::vector<int>{0, 1}));

      // Prefill inputs are checked whatever the policy: one question for keys and values together.
      random_source rng(730);
      std::vector<float> keys = rng.normals(60 * 128);
      const std::vector<float> values = rng.normals(60 * 128);
      keys[31 * 128 + 77] = nan;
      EXPECT_THROW(store.prefill(0, std::vector<int>{0}, view_of(keys, {1, 60, 2, 64}), view_of(values, {1, 60, 2, 64})),
                   shadowkv::invalid_argument);
      EXPECT_FALSE(store.info(0, 0).prefilled);
      keys[31 * 128 + 77] = 0.25F;
      questions = 0;
      for (kv_store* s : {&store, &twin}) {
        for (const int slot : {0, 1}) {
          s->prefill(0, std::vector<int>{slot}, view_of(keys, {1, 60, 2, 64}), view_of(values, {1, 60, 2, 64}));
        }
      }
      EXPECT_EQ(questions, 2) << "one question per prefill call";

      // Decode: one question per call where checked, none where not.
      decode_data d{rng.normals(2 * 256), rng.normals(2 * 128), rng.normals(2 * 128)};
      questions = 0;
      EXPECT_EQ(decode_pair(store, d), decode_pair(twin, d));
      EXPECT_EQ(questions, checked ? 1 : 0);

      // A NaN in slot 1's query: rejected where checked; else slot 1's output is NaN and slot 0 is not affected, now
      // and for 20 more steps (a fold on the way).
      decode_data poisoned{rng.normals(2 * 256), rng.normals(2 * 128), rng.normals(2 * 128)};
      decode_data clean = poisoned;
      poisoned.q[256 + 3] = nan;
      poisoned.k[128 + 64] = nan;
      if (checked) {
        try {
          (void)decode_pair(store, poisoned);
          ADD_FAILURE() << "accepted";
        } catch (const shadowkv::invalid_argument& error) {
          EXPECT_NE(std::string(error.what()).find("q (slot 1, row 1)"), std::string::npos) << error.what();
        }
        expect_same_info(store.info(0, 1), twin.info(0, 1));
        EXPECT_EQ(store.stats().decode_steps, twin.stats().decode_steps);
        continue;
      }
      const std::vector<float> out = decode_pair(store, poisoned);
      const std::vector<float> expected = decode_pair(twin, clean);
      EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + 256), std::vector<float>(expected.begin(), expected.begin() + 256));
      EXPECT_FALSE(shadowkv_test::all_finite(std::vector<float>(out.begin() + 256, out.end())));
      for (int step = 0; step < 20; ++step) {
        const decode_data next = random_step(cfg, rng);
        ASSERT_EQ(decode_one(store, 0, 0, next), decode_one(twin, 0, 0, next)) << "step " << step;
      }
      // Slot 1 keeps its NaN key (attended while exact): its outputs stay NaN.
      const std::vector<float> after = decode_one(store, 0, 1, random_step(cfg, rng));
      EXPECT_FALSE(shadowkv_test::all_finite(after));
      expect_same_info(store.info(0, 0), twin.info(0, 0));
    }
  }
}

TEST(HugeInputs, FiniteHugeKeysFactoriseAndDecode) {
  for (const auto method : {shadowkv::factorization_method::gram, shadowkv::factorization_method::svd}) {
    for (const float scale : {1e20F, 1e30F, 1e-30F}) {
      SCOPED_TRACE("scale=" + std::to_string(scale) + (method == shadowkv::factorization_method::svd ? " svd" : " gram"));
      config cfg = replay_config();
      cfg.factorization = method;
      kv_store store(cfg);
      ASSERT_EQ(store.add_sequences(1), std::vector<int>{0});
      random_source rng(81);
      std::vector<float> keys = rng.normals(60 * 128);
      for (float& k : keys) k *= scale;
      const std::vector<float> values = rng.normals(60 * 128);
      ASSERT_NO_THROW(store.prefill(0, std::vector<int>{0}, view_of(keys, {1, 60, 2, 64}), view_of(values, {1, 60, 2, 64})));
      for (int step = 0; step < 20; ++step) {
        decode_data d = random_step(cfg, rng);
        for (float& k : d.k) k *= scale;
        const std::vector<float> out = decode_one(store, 0, 0, d);
        ASSERT_TRUE(shadowkv_test::all_finite(out)) << "step " << step;
        EXPECT_GT(shadowkv_test::norm(out), 0.05);
      }
    }
  }
}

TEST(HugeInputs, KeysThatOverflowUnderRopeAreRejected) {
  twins t(720);
  shadowkv_test::prefill_data d = t.make_prefill(1, 60);
  for (std::size_t i = 0; i < d.keys.size(); ++i) d.keys[i] = (i % 2 == 0 ? 3.0e38F : -3.0e38F);
  try {
    t.prefill(t.subject, 1, {1}, 60, d, false);
    ADD_FAILURE() << "accepted";
  } catch (const shadowkv::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find("too large"), std::string::npos) << error.what();
  }
  t.expect_same_future();
}

// ---------------------------------------------------------------------------------------------------------------
// configurations that cannot be served
// ---------------------------------------------------------------------------------------------------------------

TEST(Capacity, BudgetBeyondMaxSeqLenIsClampedAndServes) {
  config cfg = replay_config();
  cfg.budget = std::int64_t{8} * INT_MAX;  // the budget = 8 * (2**31 - 1) tokens
  kv_store store(cfg);
  EXPECT_EQ(store.get_config().budget, 200);  // max_seq_len / chunk_size = 25 chunks of 8
  EXPECT_EQ(store.get_config().budget_chunks(), 200 / 8);
  ASSERT_EQ(store.add_sequences(1), std::vector<int>{0});
  prefill_random(store, 0, 60, 91);
  random_source rng(92);
  const std::vector<float> out = decode_one(store, 0, 0, random_step(cfg, rng));
  EXPECT_TRUE(shadowkv_test::all_finite(out));
  EXPECT_EQ(store.memory().selection_cache, std::int64_t{25} * 8 * 128 * 2 * 4);
  // The clamp changes no output: every candidate is selected, as with a budget of exactly the capacity.
  const std::int64_t candidates = store.info(0, 0).context_chunks - store.info(0, 0).outlier_chunks;
  for (const auto& head : store.selected_chunks(0, 0)) EXPECT_EQ(static_cast<std::int64_t>(head.size()), candidates);
}

template <typename Exception>
std::string message_of(const config& cfg, std::int64_t host_bytes) {
  try {
    shadowkv::detail::check_capacity(shadowkv::detail::effective_config(cfg), host_bytes);
  } catch (const Exception& error) {
    return error.what();
  } catch (const std::exception& error) {
    ADD_FAILURE() << "wrong exception type: " << error.what();
    return {};
  }
  ADD_FAILURE() << "accepted";
  return {};
}

TEST(Capacity, ChunkLargerThanMaxSeqLenIsRejected) {
  config cfg = replay_config();
  cfg.chunk_size = 1 << 30;
  cfg.generation_window = 1 << 30;
  cfg.budget = cfg.chunk_size;  // one chunk
  ASSERT_NO_THROW(cfg.validate());
  EXPECT_THROW(kv_store{cfg}, shadowkv::invalid_argument);
  EXPECT_NE(message_of<shadowkv::invalid_argument>(cfg, 1LL << 40).find("chunk_size"), std::string::npos);
}

TEST(Capacity, FixedCostsBeyondHostMemoryNameTheBytes) {
  const std::int64_t host = std::int64_t{1} << 30;
  config cfg = replay_config();
  cfg.max_batch = INT_MAX;
  std::string message = message_of<shadowkv::out_of_memory>(cfg, host);
  EXPECT_NE(message.find("max_batch"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(std::int64_t{INT_MAX} * 64)), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(host)), std::string::npos) << message;

  cfg = replay_config();
  cfg.num_layers = INT_MAX;
  message = message_of<shadowkv::out_of_memory>(cfg, host);
  EXPECT_NE(message.find("num_layers"), std::string::npos) << message;

  cfg = replay_config();  // one chunk as long as the sequence: a 1 GiB selection cache per prefill
  cfg.max_seq_len = std::int64_t{1} << 20;
  cfg.chunk_size = 1 << 20;
  cfg.generation_window = 1 << 20;
  cfg.budget = cfg.chunk_size;  // one chunk
  message = message_of<shadowkv::out_of_memory>(cfg, host);
  EXPECT_NE(message.find("selection cache"), std::string::npos) << message;
  EXPECT_NE(message.find("bytes"), std::string::npos) << message;

  // The same configurations fit a host that is large enough.
  cfg = replay_config();
  cfg.max_batch = INT_MAX;
  EXPECT_NO_THROW(shadowkv::detail::check_capacity(cfg, std::int64_t{1} << 40));
}

TEST(Capacity, MaxBatchBeyondThisHostIsAMemoryErrorAtConstruction) {
  config cfg = replay_config();
  cfg.max_batch = INT_MAX;
  if (shadowkv::detail::physical_host_bytes() >= std::int64_t{INT_MAX} * 64) {
    GTEST_SKIP() << "this host could hold the slot tables of max_batch = INT_MAX";
  }
  try {
    kv_store store(cfg);
    ADD_FAILURE() << "constructed";
  } catch (const shadowkv::out_of_memory& error) {
    EXPECT_NE(std::string(error.what()).find("bytes"), std::string::npos) << error.what();
  }
}

TEST(Capacity, SizesBeyondInt64OrLapackAreRejected) {
  config cfg = replay_config();
  cfg.max_seq_len = std::int64_t{1} << 62;
  EXPECT_NE(message_of<shadowkv::invalid_argument>(cfg, shadowkv::detail::saturated_bytes).find("overflow"),
            std::string::npos);
  EXPECT_THROW(kv_store{cfg}, shadowkv::invalid_argument);

  cfg = replay_config();
  cfg.num_q_heads = 1 << 22;
  cfg.num_kv_heads = 1 << 22;
  cfg.head_dim = 1024;
  cfg.rank = 1;
  ASSERT_NO_THROW(cfg.validate());
  EXPECT_NE(message_of<shadowkv::invalid_argument>(cfg, shadowkv::detail::saturated_bytes).find("LAPACK"),
            std::string::npos);
}

TEST(Capacity, SaturatingArithmetic) {
  using shadowkv::detail::saturated_bytes;
  using shadowkv::detail::saturating_add;
  using shadowkv::detail::saturating_mul;
  EXPECT_EQ(saturating_mul(1LL << 31, 1LL << 31), 1LL << 62);
  EXPECT_EQ(saturating_mul(1LL << 32, 1LL << 31), saturated_bytes);
  EXPECT_EQ(saturating_mul(0, saturated_bytes), 0);
  EXPECT_EQ(saturating_add(saturated_bytes - 1, 1), saturated_bytes);
  EXPECT_EQ(saturating_add(saturated_bytes, 5), saturated_bytes);
  EXPECT_EQ(saturating_add(40, 2), 42);
}

}  // namespace
