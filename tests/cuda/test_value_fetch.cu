// launch_fetch_values against the rule it implements: for every (entry, head) of the batch and each of its first
// miss_counts misses, the run of C*D values of the missed chunk (value_store[chunk, head], the chunk being
// cache_chunks[head, slot]) lands in buffer slot `slot` of cache_values, byte for byte, or dequantised as
// round_to_T(decode_e4m3(code) * scale) for fp8 stores; nothing else of cache_values changes; counters[3] grows by the
// bytes read (runs, and their scales for fp8). Entries whose values attention reads in place are counted and not
// copied.
//
// Cases cover a grid of one CTA walking everything, more CTAs than items, ragged, full and empty miss lists, entries out
// of slot order, every element type, D = 4 (runs that are not whole 16-byte vectors), 64, 80 and 128, chunk sizes 1 to
// 16, and value stores in device memory and in pinned mapped host memory (the PCIe path).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"
#include "device_layout.cuh"
#include "shadowkv/errors.hpp"
#include "shadowkv/fp8.hpp"
#include "value_fetch.cuh"

namespace {

using shadowkv::cuda::dims;
using shadowkv::cuda::layer_view;
using shadowkv::cuda::step_workspace;
using namespace shadowkv::cuda::testing;

enum class misses { ragged, all, none };

struct fetch_case {
  std::uint64_t seed = 1;
  int batch = 2;
  int kv_heads = 2;
  int head_dim = 128;
  int chunk = 8;
  int budget = 16;      ///< k: miss-list entries per (entry, head)
  int cache_slots = 0;  ///< K (0: the budget)
  int kv_type = shadowkv::cuda::element_bf16;
  bool fp8 = false;
  bool host_store = false;  ///< value store in pinned mapped host memory
  int ctas = 33;
  misses pattern = misses::ragged;

  [[nodiscard]] int slots() const { return cache_slots > 0 ? cache_slots : budget; }
  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "seed=" << seed << " B=" << batch << " Hkv=" << kv_heads << " D=" << head_dim << " C=" << chunk
      << " k=" << budget << " K=" << slots() << " T=" << type_name(kv_type) << (fp8 ? " fp8" : "")
      << (host_store ? " host" : " device") << " ctas=" << ctas
      << (pattern == misses::all ? " all" : (pattern == misses::none ? " none" : " ragged"));
    return s.str();
  }
};

/// Pinned, mapped host memory freed on scope exit.
class host_mapped {
 public:
  explicit host_mapped(std::size_t bytes) {
    if (cudaHostAlloc(&data_, bytes, cudaHostAllocMapped) != cudaSuccess) data_ = nullptr;
  }
  host_mapped(const host_mapped&) = delete;
  host_mapped& operator=(const host_mapped&) = delete;
  host_mapped(host_mapped&& other) noexcept : data_(other.data_) { other.data_ = nullptr; }
  host_mapped& operator=(host_mapped&&) = delete;
  ~host_mapped() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  [[nodiscard]] void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

void run_case(const fetch_case& c) {
  SCOPED_TRACE(c.describe());
  std::mt19937_64 rng(c.seed);
  const int layers = 2;
  const int layer = 1;
  const int sequences = c.batch + 1;  // one slot more than the batch: the slot order is shuffled
  const int max_chunks = c.slots() + 7;
  const std::size_t element = element_bytes(c.kv_type);
  const std::size_t run = static_cast<std::size_t>(c.chunk) * c.head_dim;
  const std::size_t run_bytes = c.fp8 ? run : run * element;
  const std::size_t store_bytes = static_cast<std::size_t>(max_chunks) * c.kv_heads * run_bytes;
  const std::size_t cache_bytes = static_cast<std::size_t>(c.kv_heads) * c.slots() * run * element;

  dims d{};
  d.num_layers = layers;
  d.kv_heads = c.kv_heads;
  d.head_dim = c.head_dim;
  d.chunk = c.chunk;
  d.budget = c.budget;
  d.cache_slots = c.slots();
  d.max_chunks = max_chunks;
  d.value_fp8 = c.fp8 ? 1 : 0;

  // Per sequence: its value store (random bytes, or e4m3 codes other than NaN with scales), its cached chunk ids
  // (distinct, some slots empty) and a sentinel-filled value cache.
  std::vector<std::vector<unsigned char>> stores(sequences, std::vector<unsigned char>(store_bytes));
  std::vector<std::vector<float>> scales(sequences, std::vector<float>(static_cast<std::size_t>(max_chunks) * c.kv_heads));
  std::vector<std::vector<int>> cached(sequences, std::vector<int>(static_cast<std::size_t>(c.kv_heads) * c.slots()));
  std::vector<unsigned char> sentinel(cache_bytes, 0xA5);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.01F, 4.0F);
  std::vector<host_mapped> host_stores;
  std::vector<device_buffer> buffers;
  std::vector<layer_view> views(static_cast<std::size_t>(sequences) * layers);
  for (int s = 0; s < sequences; ++s) {
    for (auto& b : stores[s]) {
      b = static_cast<unsigned char>(byte(rng));
      if (c.fp8 && (b & 0x7F) == 0x7F) b &= 0xFE;  // not a NaN code
    }
    if (!c.fp8 && c.kv_type != shadowkv::cuda::element_f32) {
      // Finite 16-bit values only, so that a byte comparison is a value comparison.
      for (std::size_t i = 0; i < store_bytes; i += 2) stores[s][i + 1] &= 0x3F;
    }
    for (auto& x : scales[s]) x = scale(rng);
    for (int h = 0; h < c.kv_heads; ++h) {
      std::vector<int> ids(max_chunks);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      for (int slot = 0; slot < c.slots(); ++slot) {
        cached[s][static_cast<std::size_t>(h) * c.slots() + slot] = slot % 5 == 4 ? -1 : ids[slot];
      }
    }
    layer_view& view = views[static_cast<std::size_t>(s) * layers + layer];
    buffers.emplace_back(cached[s].size() * sizeof(int));
    CUDA_OK(upload(buffers.back(), cached[s]));
    view.cache_chunks = buffers.back().get<int>();
    buffers.emplace_back(cache_bytes);
    CUDA_OK(upload(buffers.back(), sentinel));
    view.cache_values = buffers.back().get();
    if (c.host_store) {
      host_stores.emplace_back(store_bytes);
      ASSERT_NE(host_stores.back().get(), nullptr);
      std::memcpy(host_stores.back().get(), stores[s].data(), store_bytes);
      CUDA_OK(cudaHostGetDevicePointer(&view.value_store, host_stores.back().get(), 0));
    } else {
      buffers.emplace_back(store_bytes);
      CUDA_OK(upload(buffers.back(), stores[s]));
      view.value_store = buffers.back().get();
    }
    if (c.fp8) {
      buffers.emplace_back(scales[s].size() * sizeof(float));
      CUDA_OK(upload(buffers.back(), scales[s]));
      view.value_scales = buffers.back().get<float>();
    }
  }

  // The batch: entries in shuffled slot order; miss lists of filled slots, distinct, in random order.
  std::vector<int> batch_slots(sequences);
  std::iota(batch_slots.begin(), batch_slots.end(), 0);
  std::shuffle(batch_slots.begin(), batch_slots.end(), rng);
  batch_slots.resize(c.batch);
  std::vector<int> miss_slots(static_cast<std::size_t>(c.batch) * c.kv_heads * c.budget, -7);
  std::vector<int> miss_counts(static_cast<std::size_t>(c.batch) * c.kv_heads, 0);
  unsigned long long expected_bytes = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.kv_heads; ++h) {
      const std::size_t pair = static_cast<std::size_t>(b) * c.kv_heads + h;
      std::vector<int> filled;
      for (int slot = 0; slot < c.slots(); ++slot) {
        if (cached[batch_slots[b]][static_cast<std::size_t>(h) * c.slots() + slot] >= 0) filled.push_back(slot);
      }
      std::shuffle(filled.begin(), filled.end(), rng);
      int count = std::min<int>(static_cast<int>(filled.size()), c.budget);
      if (c.pattern == misses::none) count = 0;
      if (c.pattern == misses::ragged) count = std::uniform_int_distribution<int>(0, count)(rng);
      miss_counts[pair] = count;
      for (int m = 0; m < count; ++m) miss_slots[pair * c.budget + m] = filled[m];
      expected_bytes += static_cast<unsigned long long>(count) * (c.fp8 ? run_bytes + sizeof(float) : run_bytes);
    }
  }

  device_buffer views_d(views.size() * sizeof(layer_view));
  device_buffer slots_d(batch_slots.size() * sizeof(int));
  device_buffer miss_slots_d(miss_slots.size() * sizeof(int));
  device_buffer miss_counts_d(miss_counts.size() * sizeof(int));
  device_buffer counters_d(4 * sizeof(unsigned long long));
  CUDA_OK(upload(views_d, views));
  CUDA_OK(upload(slots_d, batch_slots));
  CUDA_OK(upload(miss_slots_d, miss_slots));
  CUDA_OK(upload(miss_counts_d, miss_counts));
  const std::vector<unsigned long long> counters_start{1, 2, 3, 1000};
  CUDA_OK(upload(counters_d, counters_start));
  step_workspace ws{};
  ws.miss_slots = miss_slots_d.get<int>();
  ws.miss_counts = miss_counts_d.get<int>();
  ws.counters = counters_d.get<unsigned long long>();

  shadowkv::cuda::launch_fetch_values(d, c.kv_type, views_d.get<layer_view>(), slots_d.get<int>(), layer, c.batch, ws,
                                      c.ctas, 0, nullptr);
  CUDA_OK(cudaDeviceSynchronize());

  std::vector<unsigned long long> counters;
  CUDA_OK(download(counters, counters_d.get<unsigned long long>(), 4));
  EXPECT_EQ(counters[0], 1U);
  EXPECT_EQ(counters[1], 2U);
  EXPECT_EQ(counters[2], 3U);
  EXPECT_EQ(counters[3], 1000U + expected_bytes);

  // Every sequence's value cache: the expected bytes are the sentinel except in the missed slots of batch entries.
  std::vector<std::vector<unsigned char>> expected(sequences, sentinel);
  for (int b = 0; b < c.batch; ++b) {
    const int s = batch_slots[b];
    for (int h = 0; h < c.kv_heads; ++h) {
      const std::size_t pair = static_cast<std::size_t>(b) * c.kv_heads + h;
      for (int m = 0; m < miss_counts[pair]; ++m) {
        const int slot = miss_slots[pair * c.budget + m];
        const int chunk = cached[s][static_cast<std::size_t>(h) * c.slots() + slot];
        const std::size_t source_run = static_cast<std::size_t>(chunk) * c.kv_heads + h;
        const std::size_t target = (static_cast<std::size_t>(h) * c.slots() + slot) * run;
        for (std::size_t i = 0; i < run; ++i) {
          if (c.fp8) {
            const float x = shadowkv::fp8::decode_e4m3(stores[s][source_run * run + i]) * scales[s][source_run];
            store_element(c.kv_type, expected[s], target + i, x);
          } else {
            std::memcpy(expected[s].data() + (target + i) * element,
                        stores[s].data() + source_run * run_bytes + i * element, element);
          }
        }
      }
    }
  }
  for (int s = 0; s < sequences; ++s) {
    std::vector<unsigned char> got;
    const auto* cache = static_cast<const unsigned char*>(views[static_cast<std::size_t>(s) * layers + layer].cache_values);
    CUDA_OK(download(got, cache, cache_bytes));
    std::size_t first_difference = cache_bytes;
    for (std::size_t i = 0; i < cache_bytes; ++i) {
      if (got[i] != expected[s][i]) {
        first_difference = i;
        break;
      }
    }
    EXPECT_EQ(first_difference, cache_bytes) << "sequence slot " << s << ": first differing byte " << first_difference
                                             << " (value " << first_difference / element << " of the cache)";
  }
}

TEST(ValueFetch, CopiesEveryMissedRunAndNothingElse) {
  if (!device_present()) GTEST_SKIP() << "no CUDA device";
  using shadowkv::cuda::element_bf16;
  using shadowkv::cuda::element_f16;
  using shadowkv::cuda::element_f32;
  std::vector<fetch_case> cases;
  auto add = [&](fetch_case c) {
    c.seed = 100 + cases.size();
    cases.push_back(c);
  };
  // The step shapes at small scale: bf16 host and device stores, every unit size from 1 to 32 items (budget x heads
  // against the grid's warps), fp8 into each element type.
  for (const bool host : {true, false}) {
    for (const int budget : {16, 64, 256}) {
      for (const int ctas : {1, 4, 33}) {
        add({.batch = 3, .kv_heads = 4, .budget = budget, .host_store = host, .ctas = ctas});
      }
    }
  }
  for (const int type : {element_bf16, element_f16, element_f32}) {
    add({.batch = 5, .kv_heads = 2, .budget = 64, .kv_type = type, .fp8 = true, .host_store = true, .ctas = 3});
    add({.batch = 2, .kv_heads = 3, .head_dim = 80, .chunk = 4, .budget = 9, .kv_type = type, .ctas = 2});
    add({.batch = 2, .kv_heads = 2, .head_dim = 64, .chunk = 1, .budget = 37, .kv_type = type, .fp8 = true,
         .ctas = 1000});
  }
  add({.batch = 4, .kv_heads = 8, .chunk = 16, .budget = 32, .cache_slots = 70, .host_store = true, .ctas = 8,
       .pattern = misses::all});
  add({.batch = 4, .kv_heads = 8, .budget = 32, .fp8 = true, .ctas = 8, .pattern = misses::all});
  add({.batch = 3, .kv_heads = 2, .budget = 32, .ctas = 5, .pattern = misses::none});
  add({.batch = 1, .kv_heads = 2, .budget = 8, .kv_type = element_f32, .ctas = 33});
  // Runs that are not whole 16-byte vectors (the kernel's element-wise path).
  add({.batch = 2, .kv_heads = 3, .head_dim = 4, .chunk = 3, .budget = 11, .ctas = 2});
  add({.batch = 2, .kv_heads = 3, .head_dim = 4, .chunk = 3, .budget = 11, .fp8 = true, .host_store = true, .ctas = 2});
  add({.batch = 6, .kv_heads = 2, .budget = 40, .fp8 = true, .host_store = true, .ctas = 2});
  for (const fetch_case& c : cases) run_case(c);
}

}  // namespace
