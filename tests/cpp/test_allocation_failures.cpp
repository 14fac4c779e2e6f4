// Allocation failure inside a call leaves the store unchanged ("no half-applied call"; docs/semantics.md,
// "Capacity and errors"). This executable replaces the global operator new with one that can be told to fail: for
// decode (with and without a fold), prefill (with and without the warm-up selection), add_sequences and release, it
// counts the allocations of a clean call, then for every k makes the k-th one fail (alone, and together with every
// later one) and checks that the store still equals a twin that never saw the call, now and for 20 more steps.
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <new>
#include <string>
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

// An operation under test: given fresh twins, prepares its inputs (allocating freely) and returns the call to make
// on one store.
using operation = std::function<std::function<void(kv_store&)>(twins&)>;

struct operation_case {
  const char* name;
  int warmup_steps;  // 16: layer 0's generated regions are full, so the next decode folds
  operation prepare;
};

std::int64_t allocations_of(const operation_case& op, std::uint64_t seed) {
  twins t(seed, op.warmup_steps);
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
    SCOPED_TRACE(std::string(op.name) + ": allocation " + std::to_string(k) + " of " + std::to_string(total) +
                 (every_later_one ? " and every later one" : "") + " fails (seed " + std::to_string(seed) + ")");
    twins t(seed, op.warmup_steps);
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
    t.expect_same_future();
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(failed_calls, 0) << op.name << ": no injected failure reached the caller";
}

std::vector<operation_case> operations() {
  return {
      {"decode of two sequences", 3,
       [](twins& t) {
         const shadowkv_test::decode_data d = t.make_decode(2);
         return [&t, d](kv_store& s) { (void)t.decode(s, 0, {0, 1}, d); };
       }},
      {"decode that folds", 16,
       [](twins& t) {
         EXPECT_EQ(t.twin.info(0, 0).generated_exact_len, t.cfg.generation_window);
         const shadowkv_test::decode_data d = t.make_decode(2);
         return [&t, d](kv_store& s) { (void)t.decode(s, 0, {1, 0}, d); };
       }},
      {"first decode of a layer", 3,
       [](twins& t) {
         const shadowkv_test::decode_data d = t.make_decode(1);
         return [&t, d](kv_store& s) { (void)t.decode(s, 1, {0}, d); };
       }},
      {"prefill", 3,
       [](twins& t) {
         const shadowkv_test::prefill_data d = t.make_prefill(1, 60);
         return [&t, d](kv_store& s) { t.prefill(s, 1, {1}, 60, d, false); };
       }},
      {"prefill with q_last", 3,
       [](twins& t) {
         const shadowkv_test::prefill_data d = t.make_prefill(1, 70);
         return [&t, d](kv_store& s) { t.prefill(s, 0, {2}, 70, d, true); };
       }},
      {"prefill of two sequences with q_last", 3,
       [](twins& t) {
         const shadowkv_test::prefill_data d = t.make_prefill(2, 64);
         return [&t, d](kv_store& s) { t.prefill(s, 1, {2, 1}, 64, d, true); };
       }},
      {"add_sequences", 3, [](twins&) { return [](kv_store& s) { (void)s.add_sequences(1); }; }},
      {"release", 3, [](twins&) { return [](kv_store& s) { s.release(std::vector<int>{2, 1}); }; }},
  };
}

class AllocationFailure : public ::testing::TestWithParam<int> {};

TEST_P(AllocationFailure, SingleFailureLeavesTheStoreUnchanged) {
  check_every_allocation(operations()[static_cast<std::size_t>(GetParam())], false);
}

TEST_P(AllocationFailure, PersistentFailureLeavesTheStoreUnchanged) {
  check_every_allocation(operations()[static_cast<std::size_t>(GetParam())], true);
}

INSTANTIATE_TEST_SUITE_P(Operations, AllocationFailure, ::testing::Range(0, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = operations()[static_cast<std::size_t>(info.param)].name;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

}  // namespace
