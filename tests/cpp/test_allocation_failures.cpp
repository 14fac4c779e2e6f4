// Allocation failure inside a call leaves the store unchanged ("no half-applied call"; docs/semantics.md,
// "Capacity and errors") and reaches the caller as std::bad_alloc, never as std::terminate. This executable replaces
// the global operator new with one that can be told to fail. For every call and path — decode (two sequences, a fold,
// the first step of a layer, pre-RoPE k_new with positions), prefill (with and without the warm-up selection, ragged
// lengths, positions, several query tokens), add_sequences, release, fork (of a sequence with a fold journal and a
// full selection cache), park, resume, save (which must leave no file) and load (park, resume and save of a fork's
// family too) — on the default configuration and on each variant that takes other code (fp8 value store,
// "auto"-placed values (device and host), two-centroid chunk scores, a selection cache larger than the budget,
// float32 factors), it counts the allocations of a clean call, then for every k makes the k-th one fail (alone, and
// together with every later one) and checks that the call threw std::bad_alloc (or completed) and that the store still
// equals a twin that never saw the call: memory report, stats, every sequence's counters and selections now, and the
// same decode outputs, bit for bit, for more steps (folds included). A std::terminate anywhere ends the executable,
// which CTest reports as a failure.
#include <gtest/gtest.h>
#include <unistd.h>  // getpid

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <vector>

#include "shadowkv/store.hpp"
#include "store_test_support.hpp"

// --- the injection hook: replaces ::operator new / new[] for this test executable only ------------------------------
namespace fault_injection {

std::atomic<bool> armed{false};
std::atomic<bool> persistent{false};    // every allocation from the k-th on fails, not only the k-th
std::atomic<std::int64_t> countdown{0};  // allocations left before the failing one
std::atomic<std::int64_t> counted{0};    // allocations seen while armed

void arm(std::int64_t k, bool every_later_one) {
  counted = 0;
  countdown = k;
  persistent = every_later_one;
  armed = true;
}

void disarm() { armed = false; }

void* allocate(std::size_t size) {
  if (armed.load(std::memory_order_relaxed)) {
    counted += 1;
    const std::int64_t left = --countdown;
    if (left == 0 || (left < 0 && persistent)) throw std::bad_alloc();
  }
  void* memory = std::malloc(size == 0 ? 1 : size);
  if (memory == nullptr) throw std::bad_alloc();
  return memory;
}

}  // namespace fault_injection

void* operator new(std::size_t size) { return fault_injection::allocate(size); }
void* operator new[](std::size_t size) { return fault_injection::allocate(size); }
// The nothrow forms too (std::stable_sort's temporary buffer uses them): the library's own would behave the same (call
// the throwing form, answer nullptr), but under AddressSanitizer they are its allocator while delete is this free.
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return fault_injection::allocate(size);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t& tag) noexcept { return operator new(size, tag); }
void operator delete(void* memory) noexcept { std::free(memory); }
void operator delete[](void* memory) noexcept { std::free(memory); }
void operator delete(void* memory, std::size_t) noexcept { std::free(memory); }
void operator delete[](void* memory, std::size_t) noexcept { std::free(memory); }
void operator delete(void* memory, const std::nothrow_t&) noexcept { std::free(memory); }
void operator delete[](void* memory, const std::nothrow_t&) noexcept { std::free(memory); }

namespace {

using shadowkv::kv_store;
using shadowkv_test::twins;
using shadowkv_test::view_of;

// An operation under test: given fresh twins, prepares its inputs (allocating freely) and returns the call to make
// on one store.
using operation = std::function<std::function<void(kv_store&)>(twins&)>;

struct operation_case {
  std::string name;
  int warmup_steps;            // 16: layer 0's generated regions are full, so the next decode folds
  shadowkv::config cfg;        // the twins' configuration
  std::int64_t future_steps;   // steps both stores decode afterwards (8 or more cross a fold: window 16, chunk 8)
  operation prepare;
};

std::int64_t allocations_of(const operation_case& op, std::uint64_t seed) {
  twins t(seed, op.warmup_steps, op.cfg);
  const std::function<void(kv_store&)> call = op.prepare(t);
  fault_injection::arm(std::numeric_limits<std::int64_t>::max(), false);
  call(t.subject);
  fault_injection::disarm();
  return fault_injection::counted;
}

void check_every_allocation(const operation_case& op, bool every_later_one) {
  const std::uint64_t seed = 1000 + std::hash<std::string>{}(op.name) % 1000;
  const std::int64_t total = allocations_of(op, seed);
  ASSERT_GT(total, 0) << op.name << " allocates nothing: the test would prove nothing";
  std::int64_t failed_calls = 0;
  for (std::int64_t k = 1; k <= total; ++k) {
    SCOPED_TRACE(op.name + ": allocation " + std::to_string(k) + " of " + std::to_string(total) +
                 (every_later_one ? " and every later one" : "") + " fails (seed " + std::to_string(seed) + ")");
    twins t(seed, op.warmup_steps, op.cfg);
    const std::function<void(kv_store&)> call = op.prepare(t);
    bool failed = false;
    fault_injection::arm(k, every_later_one);
    try {
      call(t.subject);
    } catch (const std::bad_alloc&) {
      failed = true;
    } catch (...) {
      fault_injection::disarm();
      throw;
    }
    fault_injection::disarm();
    if (failed) {
      ++failed_calls;
    } else {
      call(t.twin);  // the failure hit a non-throwing allocation (e.g. stable_sort's buffer): the call completed
    }
    t.expect_same_future(op.future_steps);
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(failed_calls, 0) << op.name << ": no injected failure reached the caller";
}

// --- the calls ------------------------------------------------------------------------------------------------------

operation decode_of_two() {
  return [](twins& t) {
    const shadowkv_test::decode_data d = t.make_decode(2);
    return [&t, d](kv_store& s) { (void)t.decode(s, 0, {0, 1}, d); };
  };
}

operation decode_that_folds() {
  return [](twins& t) {
    EXPECT_EQ(t.twin.info(0, 0).generated_exact_len, t.cfg.generation_window);
    const shadowkv_test::decode_data d = t.make_decode(2);
    return [&t, d](kv_store& s) { (void)t.decode(s, 0, {1, 0}, d); };
  };
}

operation first_decode_of_a_layer() {
  return [](twins& t) {
    const shadowkv_test::decode_data d = t.make_decode(1);
    return [&t, d](kv_store& s) { (void)t.decode(s, 1, {0}, d); };
  };
}

// Pre-RoPE k_new at explicit positions (the store applies RoPE), a fold on the way.
operation decode_pre_rope_with_positions() {
  return [](twins& t) {
    const shadowkv_test::decode_data d = t.make_decode(2);
    std::vector<std::int64_t> positions{t.twin.info(0, 0).last_position + 3, t.twin.info(0, 1).last_position + 1};
    return [&t, d, positions](kv_store& s) {
      const shadowkv::config& c = t.cfg;
      std::vector<float> out(d.q.size());
      shadowkv::decode_options options;
      options.keys_post_rope = false;
      options.positions = shadowkv::make_contiguous_index_view(positions.data(), shadowkv::index_type::int64,
                                                         shadowkv::device{}, {2});
      s.decode(0, std::vector<int>{0, 1}, view_of(d.q, {2, c.num_q_heads, c.head_dim}),
               view_of(d.k, {2, c.num_kv_heads, c.head_dim}), view_of(d.v, {2, c.num_kv_heads, c.head_dim}),
               shadowkv_test::mutable_view_of(out, {2, c.num_q_heads, c.head_dim}), options);
    };
  };
}

operation plain_prefill() {
  return [](twins& t) {
    const shadowkv_test::prefill_data d = t.make_prefill(1, 60);
    return [&t, d](kv_store& s) { t.prefill(s, 1, {1}, 60, d, false); };
  };
}

operation prefill_with_q_last() {
  return [](twins& t) {
    const shadowkv_test::prefill_data d = t.make_prefill(1, 70);
    return [&t, d](kv_store& s) { t.prefill(s, 0, {2}, 70, d, true); };
  };
}

operation prefill_of_two_with_q_last() {
  return [](twins& t) {
    const shadowkv_test::prefill_data d = t.make_prefill(2, 64);
    return [&t, d](kv_store& s) { t.prefill(s, 1, {2, 1}, 64, d, true); };
  };
}

// Right-padded rows (lengths 72 and 37 of S = 72), post-RoPE keys at given positions, and (with `queries`) a warm-up
// selection from two query tokens per row.
operation ragged_prefill(bool queries) {
  return [queries](twins& t) {
    constexpr std::int64_t length = 72;
    const shadowkv::config& c = t.cfg;
    const shadowkv_test::prefill_data d = t.make_prefill(2, length);
    const shadowkv_test::decode_data extra = t.make_decode(2);  // a second query token per row
    std::vector<float> q_last(static_cast<std::size_t>(2 * 2 * c.num_q_heads * c.head_dim));
    const auto per_token = static_cast<std::size_t>(c.num_q_heads * c.head_dim);
    for (std::size_t b = 0; b < 2; ++b) {
      std::copy_n(d.q_last.begin() + static_cast<std::ptrdiff_t>(b * per_token), per_token,
                  q_last.begin() + static_cast<std::ptrdiff_t>(2 * b * per_token));
      std::copy_n(extra.q.begin() + static_cast<std::ptrdiff_t>(b * per_token), per_token,
                  q_last.begin() + static_cast<std::ptrdiff_t>((2 * b + 1) * per_token));
    }
    std::vector<std::int64_t> positions(2 * length);
    for (std::int64_t i = 0; i < 2 * length; ++i) positions[static_cast<std::size_t>(i)] = 5 + i % length;
    return [&t, d, q_last, positions, queries](kv_store& s) {
      const shadowkv::config& cfg = t.cfg;
      shadowkv::prefill_options options;
      options.lengths = {length, 37};
      options.keys_post_rope = true;
      options.positions = shadowkv::make_contiguous_index_view(positions.data(), shadowkv::index_type::int64,
                                                         shadowkv::device{}, {2, length});
      if (queries) options.q_last = view_of(q_last, {2, 2, cfg.num_q_heads, cfg.head_dim});
      s.prefill(1, std::vector<int>{1, 2}, view_of(d.keys, {2, length, cfg.num_kv_heads, cfg.head_dim}),
                view_of(d.values, {2, length, cfg.num_kv_heads, cfg.head_dim}), options);
    };
  };
}

operation add_one_sequence() {
  return [](twins&) { return [](kv_store& s) { (void)s.add_sequences(1); }; };
}

// fork of `slot` into the one free slot (3): every layer of the source must be prefilled, so layer 1 of slot 1 is
// prefilled first when it is the source.
operation fork_of(int slot) {
  return [slot](twins& t) {
    if (slot == 1) t.prefill_both(1, {1}, 77);
    return [slot](kv_store& s) { (void)s.fork(slot); };  // into slot 3 (checked by the state comparison)
  };
}

operation release_slots(std::vector<int> slots) {
  return [slots](twins&) { return [slots](kv_store& s) { s.release(slots); }; };
}

// park of slots 0 and 1 (slot 1's layer 1 prefilled first: park takes sequences prefilled in every layer). The parked
// objects are dropped: the future is the remaining sequences'.
operation park_two() {
  return [](twins& t) {
    t.prefill_both(1, {1}, 77);
    return [](kv_store& s) { (void)s.park(std::vector<int>{0, 1}); };
  };
}

// resume of slots 1 and 0, parked (in that order) on both stores before the call; slot 2 is released first, so that
// the sequences come back into slots 1 and 2 (the future then decodes them against the twin's).
operation resume_two() {
  return [](twins& t) {
    t.prefill_both(1, {1}, 77);
    auto parked = std::make_shared<std::vector<std::vector<shadowkv::parked_sequence>>>();
    t.both([&](kv_store& s) {
      s.release(std::vector<int>{2});
      parked->push_back(s.park(std::vector<int>{1, 0}));
      (void)s.add_sequences(1);  // slot 0 taken by a sequence never prefilled
    });
    return [&t, parked](kv_store& s) {
      std::vector<shadowkv::parked_sequence>& mine = (*parked)[&s == &t.subject ? 0 : 1];
      EXPECT_EQ(s.resume(mine), (std::vector<int>{1, 2}));
    };
  };
}

// park of a fork's child and its source (slot 0 forked into slot 3 first): the parked states keep sharing the prompt
// state, and a failure must leave both sequences in their slots, still sharing it.
operation park_of_a_family() {
  return [](twins& t) {
    t.both([](kv_store& s) { EXPECT_EQ(s.fork(0), std::vector<int>{3}); });
    return [](kv_store& s) { (void)s.park(std::vector<int>{3, 0}); };
  };
}

// resume of a fork's child (slot 0 forked into slot 3, the child then parked on both stores) while its source lives:
// back into slot 3, sharing the source's prompt state again.
operation resume_into_a_family() {
  return [](twins& t) {
    auto parked = std::make_shared<std::vector<std::vector<shadowkv::parked_sequence>>>();
    t.both([&](kv_store& s) {
      EXPECT_EQ(s.fork(0), std::vector<int>{3});
      parked->push_back(s.park(std::vector<int>{3}));
    });
    return [&t, parked](kv_store& s) {
      std::vector<shadowkv::parked_sequence>& mine = (*parked)[&s == &t.subject ? 0 : 1];
      EXPECT_EQ(s.resume(mine), std::vector<int>{3});
    };
  };
}

// Scratch files of save and load: one directory per process (CTest runs the tests of this executable in parallel
// processes, and other builds may run them at the same time), removed when the process ends.
std::filesystem::path scratch_directory() {
  return std::filesystem::path(::testing::TempDir()) / ("shadowkv_allocation_failures_" + std::to_string(::getpid()));
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
  return (scratch_directory() / name).string();
}

// save of slot 0; a failed save leaves no file (nor its temporary).
operation save_slot() {
  return [](twins&) {
    const std::string path = scratch_file("save.skv");
    std::remove(path.c_str());
    return [path](kv_store& s) {
      try {
        s.save(0, path);
      } catch (...) {
        EXPECT_FALSE(std::ifstream(path).good()) << "a failed save left " << path;
        EXPECT_FALSE(std::ifstream(path + ".tmp").good()) << "a failed save left " << path << ".tmp";
        throw;
      }
    };
  };
}

// save of a fork's child (slot 0 forked into slot 3 first): the file holds the shared prompt state too.
operation save_of_a_child() {
  return [](twins& t) {
    t.both([](kv_store& s) { EXPECT_EQ(s.fork(0), std::vector<int>{3}); });
    const std::string path = scratch_file("save_child.skv");
    std::remove(path.c_str());
    return [path](kv_store& s) {
      try {
        s.save(3, path);
      } catch (...) {
        EXPECT_FALSE(std::ifstream(path).good()) << "a failed save left " << path;
        throw;
      }
    };
  };
}

// load of slot 0's saved state (written before the call, with slot 1's layer 1 prefilled: both are loaded in turn
// by the variants) into the free slot 3.
operation load_saved(int slot) {
  return [slot](twins& t) {
    t.prefill_both(1, {1}, 77);
    const std::string path = scratch_file("load.skv");
    t.twin.save(slot, path);
    return [path](kv_store& s) { EXPECT_EQ(s.load(path), 3); };
  };
}

// --- the configurations ---------------------------------------------------------------------------------------------

struct variant {
  std::string name;
  shadowkv::config cfg;
};

std::vector<variant> variants() {
  const shadowkv::config base = shadowkv_test::twin_config();
  std::vector<variant> result;
  shadowkv::config fp8 = base;
  fp8.values_as = shadowkv::value_format::fp8_e4m3;
  result.push_back({"fp8 values", fp8});
  shadowkv::config automatic = base;  // slot 0's values on the "device", the others on the host
  automatic.value_store = shadowkv::value_store_policy::auto_place;
  automatic.device_value_budget = kv_store(base).value_bytes_per_sequence();
  result.push_back({"auto values", automatic});
  shadowkv::config centroids = base;
  centroids.chunk_score = shadowkv::chunk_score_rule::two_centroids;
  result.push_back({"two centroids", centroids});
  shadowkv::config lru = base;  // K = 8 slots for a budget of k = 4 chunks
  lru.cache_tokens = 2 * base.budget;
  result.push_back({"cache larger than budget", lru});
  shadowkv::config factors = base;
  factors.factors_as = shadowkv::factor_format::float32;
  result.push_back({"float32 factors", factors});
  return result;
}

std::vector<operation_case> operations() {
  const shadowkv::config base = shadowkv_test::twin_config();
  std::vector<operation_case> result = {
      {"decode of two sequences", 3, base, 20, decode_of_two()},
      {"decode that folds", 16, base, 20, decode_that_folds()},
      {"first decode of a layer", 3, base, 20, first_decode_of_a_layer()},
      {"decode of pre-RoPE keys at positions", 16, base, 12, decode_pre_rope_with_positions()},
      {"prefill", 3, base, 20, plain_prefill()},
      {"prefill with q_last", 3, base, 20, prefill_with_q_last()},
      {"prefill of two sequences with q_last", 3, base, 20, prefill_of_two_with_q_last()},
      {"ragged prefill with positions", 3, base, 12, ragged_prefill(false)},
      {"ragged prefill with two query tokens", 3, base, 12, ragged_prefill(true)},
      {"add_sequences", 3, base, 20, add_one_sequence()},
      {"release", 3, base, 20, release_slots({2, 1})},
      {"release of a decoded sequence", 3, base, 12, release_slots({0})},
      // 24 steps: the source has folded a chunk (a fold journal) and holds a full selection cache.
      {"fork of a decoded sequence", 24, base, 20, fork_of(0)},
      {"fork", 3, base, 20, fork_of(1)},
      {"park", 3, base, 12, park_two()},
      {"resume", 3, base, 12, resume_two()},
      {"save", 3, base, 12, save_slot()},
      {"load", 3, base, 12, load_saved(0)},
      // A fork's family: the prompt state shared by the slots, and by parked states.
      {"park of a fork's child and its source", 24, base, 12, park_of_a_family()},
      {"resume of a fork's child beside its source", 24, base, 12, resume_into_a_family()},
      {"save of a fork's child", 24, base, 12, save_of_a_child()},
  };
  // Every variant's own code: its prefill (with the warm-up selection, ragged), its decode with a fold, release.
  for (const variant& v : variants()) {
    result.push_back({v.name + ": decode that folds", 16, v.cfg, 10, decode_that_folds()});
    result.push_back({v.name + ": ragged prefill with two query tokens", 3, v.cfg, 10, ragged_prefill(true)});
    result.push_back({v.name + ": add_sequences", 3, v.cfg, 10, add_one_sequence()});
    result.push_back({v.name + ": release", 3, v.cfg, 10, release_slots({0, 2})});
    result.push_back({v.name + ": fork", 24, v.cfg, 10, fork_of(1)});
    result.push_back({v.name + ": load", 16, v.cfg, 10, load_saved(1)});
  }
  return result;
}

class AllocationFailure : public ::testing::TestWithParam<int> {};

TEST_P(AllocationFailure, SingleFailureLeavesTheStoreUnchanged) {
  check_every_allocation(operations()[static_cast<std::size_t>(GetParam())], false);
}

TEST_P(AllocationFailure, PersistentFailureLeavesTheStoreUnchanged) {
  check_every_allocation(operations()[static_cast<std::size_t>(GetParam())], true);
}

INSTANTIATE_TEST_SUITE_P(Operations, AllocationFailure,
                         ::testing::Range(0, static_cast<int>(operations().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = operations()[static_cast<std::size_t>(info.param)].name;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

}  // namespace
