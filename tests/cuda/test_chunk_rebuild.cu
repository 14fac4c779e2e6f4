// launch_rebuild_keys against a float64 host reference of decode step 4 (keys of the missed chunks):
//   key[t, :] = A[t, 0:r] · B[0:r, h*D:(h+1)*D], then RoPE at context_positions[t], rounded to the store's type,
// for every token t of every missed chunk, written to the chunk's buffer slot of cache_keys.
//
// What is compared:
//   * every rebuilt key element against float64 within a bound of the GEMM error, 1e-5 * sum_k |A[t,k] B[k,j]| (the
//     error of an fp32 dot product; rotated pairs add both elements' bounds times attention_scaling), plus the
//     rounding to bf16/fp16 when the store has that type;
//   * every slot not in the (entry, head) miss list, byte for byte against the sentinel it was filled with;
//   * that the rebuilt keys are non-trivial (a norm above zero where there were misses).
// Random data with printed seeds; the configuration of a failing case is printed with it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "chunk_rebuild.cuh"
#include "value_fetch.cuh"
#include "cuda_test_support.cuh"
#include "rope_table.cuh"
#include "device_layout.cuh"
#include "shadowkv/errors.hpp"

namespace {

using shadowkv::cuda::dims;
using shadowkv::cuda::layer_view;
using shadowkv::cuda::step_workspace;

using namespace shadowkv::cuda::testing;

/// Allowed |rebuilt - reference| for one element: the fp32 GEMM/RoPE error bound `gemm_bound` (1e-5 of the absolute
/// products' sum), plus the rounding of the fp32 result to the store's type (half an ulp of the rebuilt value).
double tolerance(int type, double reference, double gemm_bound) {
  const double fp32 = 1e-5 * gemm_bound + 1e-30;
  switch (type) {
    case shadowkv::cuda::element_bf16: return 1.01 * fp32 + std::ldexp(std::fabs(reference), -8);
    case shadowkv::cuda::element_f16: return 1.01 * fp32 + std::ldexp(std::fabs(reference), -11) + std::ldexp(1.0, -25);
    default: return fp32;
  }
}

enum class miss_pattern { none, one, all, ragged };

const char* pattern_name(miss_pattern p) {
  switch (p) {
    case miss_pattern::none: return "none";
    case miss_pattern::one: return "one";
    case miss_pattern::all: return "all";
    default: return "ragged";
  }
}

struct case_config {
  std::uint64_t seed = 0;
  int batch = 1;
  int kv_heads = 1;
  int head_dim = 64;
  int chunk = 8;
  int rank = 48;         ///< 0: full rank, kv_heads * head_dim
  int rotary_dim = 0;    ///< 0: head_dim
  bool interleaved = false;
  float attention_scaling = 1.0F;
  double rope_theta = 10000.0;
  int kv_type = shadowkv::cuda::element_f32;
  int budget = 16;       ///< chunks per head
  int cache_slots = 0;   ///< K, buffer slots per head (0: the budget); miss lists stay k long, slots in [0, K)
  miss_pattern pattern = miss_pattern::ragged;
  bool bf16_factors = false;  ///< A and B held as bf16 (dims::factor_bf16): exact bf16 MMAs instead of 3xTF32
  bool misaligned = false;  ///< A and B start one element past a 16-byte boundary (the kernel's scalar copy path)
  bool graph = false;       ///< capture once, replay with a second set of miss lists
  long long rope_table = 0;  ///< positions of a RoPE table (rope_table.cuh) the rebuild reads; 0: none. With one, the
                             ///< keys are also compared byte for byte with a rebuild without it

  [[nodiscard]] int full_rank() const { return rank > 0 ? rank : kv_heads * head_dim; }
  [[nodiscard]] int slots() const { return cache_slots > 0 ? cache_slots : budget; }
  [[nodiscard]] int rotary() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "seed=" << seed << " B=" << batch << " Hkv=" << kv_heads << " D=" << head_dim << " C=" << chunk
      << " r=" << full_rank() << (rank > 0 ? "" : "(full)") << " rotary=" << rotary()
      << (interleaved ? " interleaved" : " half-split") << " scaling=" << attention_scaling << " theta=" << rope_theta
      << " kv=" << type_name(kv_type) << (bf16_factors ? " factors=bf16" : " factors=f32")
      << " k=" << budget
      << " K=" << slots()
      << " misses=" << pattern_name(pattern)
      << (misaligned ? " misaligned" : "") << (graph ? " graph" : "")
      << (rope_table > 0 ? " rope_table=" + std::to_string(rope_table) : std::string());
    return s.str();
  }
};

/// Host mirror of one (slot, layer) entry and its device buffers.
struct host_entry {
  int slot = 0;
  std::vector<float> coefficients;         // A [max_chunks*C, r] (the values as held: rounded for bf16 factors)
  std::vector<float> basis;                // B [r, Hkv*D]
  std::vector<long long> positions;        // [max_chunks*C]
  std::vector<int> cache_chunks;           // [Hkv, K]
  device_buffer coefficients_device, basis_device, positions_device, cache_chunks_device, cache_keys_device;
};

/// Miss lists [B, Hkv]: at most k distinct slots of [0, K) in random order.
std::vector<std::vector<int>> draw_misses(const case_config& cfg, std::mt19937_64& rng) {
  std::vector<std::vector<int>> lists(static_cast<std::size_t>(cfg.batch) * cfg.kv_heads);
  for (std::size_t i = 0; i < lists.size(); ++i) {
    int count = 0;
    switch (cfg.pattern) {
      case miss_pattern::none: count = 0; break;
      case miss_pattern::one: count = 1; break;
      case miss_pattern::all: count = cfg.budget; break;
      case miss_pattern::ragged:
        // The ends (0, k) often, anything between otherwise: neighbouring (entry, head) pairs differ.
        switch (std::uniform_int_distribution<int>(0, 5)(rng)) {
          case 0: count = 0; break;
          case 1: count = cfg.budget; break;
          default: count = std::uniform_int_distribution<int>(1, cfg.budget)(rng); break;
        }
        break;
    }
    std::vector<int> slots(static_cast<std::size_t>(cfg.slots()));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(static_cast<std::size_t>(count));
    lists[i] = slots;
  }
  return lists;
}

std::vector<float> inv_freq_for(const case_config& cfg) {
  const int rotary = cfg.rotary();
  std::vector<float> inv_freq(static_cast<std::size_t>(rotary / 2));
  for (int i = 0; i < rotary / 2; ++i) {
    inv_freq[static_cast<std::size_t>(i)] =
        static_cast<float>(1.0 / std::pow(cfg.rope_theta, static_cast<double>(2 * i) / rotary));
  }
  return inv_freq;
}

/// Reference key row (float64) and its error bounds, for token `token` of head h of entry e.
void reference_row(const case_config& cfg, const host_entry& e, const std::vector<float>& inv_freq, int h,
                   long long token, std::vector<double>& key, std::vector<double>& bound) {
  const int D = cfg.head_dim;
  const int r = cfg.full_rank();
  const std::size_t width = static_cast<std::size_t>(cfg.kv_heads) * D;
  std::vector<double> sum(static_cast<std::size_t>(D), 0.0);
  std::vector<double> magnitude(static_cast<std::size_t>(D), 0.0);
  const float* a = e.coefficients.data() + static_cast<std::size_t>(token) * r;
  for (int k = 0; k < r; ++k) {
    const double ak = a[k];
    const float* brow = e.basis.data() + static_cast<std::size_t>(k) * width + static_cast<std::size_t>(h) * D;
    for (int x = 0; x < D; ++x) {
      const double p = ak * static_cast<double>(brow[x]);
      sum[static_cast<std::size_t>(x)] += p;
      magnitude[static_cast<std::size_t>(x)] += std::fabs(p);
    }
  }
  key = sum;
  bound = magnitude;
  // RoPE as the CPU backend defines it: float32 angle, cos/sin of it, attention_scaling on both.
  const int half = cfg.rotary() / 2;
  const float position = static_cast<float>(e.positions[static_cast<std::size_t>(token)]);
  for (int i = 0; i < half; ++i) {
    const float angle = position * inv_freq[static_cast<std::size_t>(i)];
    const double c = std::cos(static_cast<double>(angle)) * cfg.attention_scaling;
    const double s = std::sin(static_cast<double>(angle)) * cfg.attention_scaling;
    const int first = cfg.interleaved ? 2 * i : i;
    const int second = cfg.interleaved ? 2 * i + 1 : i + half;
    const double x1 = sum[static_cast<std::size_t>(first)];
    const double x2 = sum[static_cast<std::size_t>(second)];
    key[static_cast<std::size_t>(first)] = x1 * c - x2 * s;
    key[static_cast<std::size_t>(second)] = x2 * c + x1 * s;
    const double pair_bound = static_cast<double>(cfg.attention_scaling) *
                              (magnitude[static_cast<std::size_t>(first)] +
                               magnitude[static_cast<std::size_t>(second)]);
    bound[static_cast<std::size_t>(first)] = pair_bound;
    bound[static_cast<std::size_t>(second)] = pair_bound;
  }
}

constexpr unsigned char kSentinel = 0xA5;

void run_case(const case_config& cfg) {
  SCOPED_TRACE(cfg.describe());
  std::printf("[ chunk_rebuild ] %s\n", cfg.describe().c_str());
  std::mt19937_64 rng(cfg.seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);

  const int B = cfg.batch;
  const int Hkv = cfg.kv_heads;
  const int D = cfg.head_dim;
  const int C = cfg.chunk;
  const int k = cfg.budget;
  const int K = cfg.slots();
  const int r = cfg.full_rank();
  const int width = Hkv * D;
  const int max_chunks = K + 13;  // more chunks than slots: cache_chunks is a proper subset, in random order
  const std::size_t tokens = static_cast<std::size_t>(max_chunks) * C;
  const int num_layers = 3;
  const int layer = 2;
  const int slots = B + 2;
  const int max_batch = B + 1;
  ASSERT_LE(r, width);

  dims d{};
  d.num_layers = num_layers;
  d.q_heads = Hkv;
  d.kv_heads = Hkv;
  d.head_dim = D;
  d.group = 1;
  d.chunk = C;
  d.budget = k;
  d.cache_slots = K;
  d.max_outliers = 0;
  d.rank = r;
  d.window = C;
  d.local_capacity = 0;
  d.max_chunks = max_chunks;
  d.rotary_dim = cfg.rotary();
  d.rope_interleaved = cfg.interleaved ? 1 : 0;
  d.attention_scaling = cfg.attention_scaling;
  d.softmax_scale = 1.0F;

  // Entries on a shuffled subset of the slots, never the identity order (exercises slot * num_layers + layer).
  std::vector<int> slot_order(static_cast<std::size_t>(slots));
  std::iota(slot_order.begin(), slot_order.end(), 0);
  do {
    std::shuffle(slot_order.begin(), slot_order.end(), rng);
  } while (slot_order[0] == 0);
  const std::vector<int> batch_slots(slot_order.begin(), slot_order.begin() + B);

  const std::size_t key_elements = static_cast<std::size_t>(Hkv) * K * C * D;
  const std::size_t key_bytes = key_elements * element_bytes(cfg.kv_type);
  const std::size_t pad = cfg.misaligned ? 1 : 0;  // factor elements
  const int factor_type = cfg.bf16_factors ? shadowkv::cuda::element_bf16 : shadowkv::cuda::element_f32;
  const std::size_t factor_bytes = element_bytes(factor_type);
  d.factor_bf16 = cfg.bf16_factors ? 1 : 0;
  std::vector<host_entry> entries(static_cast<std::size_t>(B));
  std::vector<layer_view> views(static_cast<std::size_t>(slots) * num_layers);
  std::memset(views.data(), 0, views.size() * sizeof(layer_view));
  // Column scales of A decay like singular values; B has unit-variance rows spread over the width.
  std::vector<float> column_scale(static_cast<std::size_t>(r));
  for (int c = 0; c < r; ++c) column_scale[static_cast<std::size_t>(c)] = 4.0F / (1.0F + static_cast<float>(c) / 16.0F);
  const float basis_scale = 1.0F / std::sqrt(static_cast<float>(std::min(width, 256)));
  for (int b = 0; b < B; ++b) {
    host_entry& e = entries[static_cast<std::size_t>(b)];
    e.slot = batch_slots[static_cast<std::size_t>(b)];
    e.coefficients.resize(tokens * r);
    for (std::size_t i = 0; i < e.coefficients.size(); ++i) {
      e.coefficients[i] = round_through(factor_type, normal(rng) * column_scale[i % static_cast<std::size_t>(r)]);
    }
    e.basis.resize(static_cast<std::size_t>(r) * width);
    for (float& x : e.basis) x = round_through(factor_type, normal(rng) * basis_scale);
    e.positions.resize(tokens);
    const long long offset = std::uniform_int_distribution<long long>(0, 200000)(rng);
    for (std::size_t t = 0; t < tokens; ++t) {
      // Mostly increasing positions, some far apart (large angles).
      e.positions[t] = offset + static_cast<long long>(t) +
                       (t % 7 == 3 ? std::uniform_int_distribution<long long>(0, 1000000)(rng) : 0);
    }
    e.cache_chunks.resize(static_cast<std::size_t>(Hkv) * K);
    for (int h = 0; h < Hkv; ++h) {
      std::vector<int> ids(static_cast<std::size_t>(max_chunks));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::copy_n(ids.begin(), K, e.cache_chunks.begin() + static_cast<std::ptrdiff_t>(h) * K);
    }

    e.coefficients_device = device_buffer((e.coefficients.size() + pad) * factor_bytes);
    e.basis_device = device_buffer((e.basis.size() + pad) * factor_bytes);
    e.positions_device = device_buffer(e.positions.size() * sizeof(long long));
    e.cache_chunks_device = device_buffer(e.cache_chunks.size() * sizeof(int));
    e.cache_keys_device = device_buffer(key_bytes);
    ASSERT_TRUE(e.coefficients_device.ok() && e.basis_device.ok() && e.positions_device.ok() &&
                e.cache_chunks_device.ok() && e.cache_keys_device.ok());
    auto* coefficients = e.coefficients_device.get<unsigned char>() + pad * factor_bytes;
    auto* basis = e.basis_device.get<unsigned char>() + pad * factor_bytes;
    const auto upload_factors = [&](unsigned char* target, const std::vector<float>& values) {
      std::vector<unsigned char> bytes(values.size() * factor_bytes);
      for (std::size_t i = 0; i < values.size(); ++i) store_element(factor_type, bytes, i, values[i]);
      return cudaMemcpy(target, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    };
    CUDA_OK(upload_factors(coefficients, e.coefficients));
    CUDA_OK(upload_factors(basis, e.basis));
    CUDA_OK(cudaMemcpy(e.positions_device.get(), e.positions.data(), e.positions.size() * sizeof(long long),
                       cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(e.cache_chunks_device.get(), e.cache_chunks.data(), e.cache_chunks.size() * sizeof(int),
                       cudaMemcpyHostToDevice));

    layer_view& view = views[static_cast<std::size_t>(e.slot) * num_layers + layer];
    view.context_chunks = max_chunks;
    view.basis = basis;
    view.coefficients = coefficients;
    view.context_positions = e.positions_device.get<long long>();
    view.cache_chunks = e.cache_chunks_device.get<int>();
    view.cache_keys = e.cache_keys_device.get();
  }

  const std::vector<float> inv_freq = inv_freq_for(cfg);
  device_buffer views_device(views.size() * sizeof(layer_view));
  device_buffer slots_device(batch_slots.size() * sizeof(int));
  device_buffer inv_freq_device(std::max<std::size_t>(inv_freq.size(), 1) * sizeof(float));
  device_buffer miss_slots_device(static_cast<std::size_t>(max_batch) * Hkv * k * sizeof(int));
  device_buffer miss_counts_device(static_cast<std::size_t>(max_batch) * Hkv * sizeof(int));
  ASSERT_TRUE(views_device.ok() && slots_device.ok() && inv_freq_device.ok() && miss_slots_device.ok() &&
              miss_counts_device.ok());
  CUDA_OK(cudaMemcpy(views_device.get(), views.data(), views.size() * sizeof(layer_view), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(slots_device.get(), batch_slots.data(), batch_slots.size() * sizeof(int),
                     cudaMemcpyHostToDevice));
  if (!inv_freq.empty()) {
    CUDA_OK(cudaMemcpy(inv_freq_device.get(), inv_freq.data(), inv_freq.size() * sizeof(float),
                       cudaMemcpyHostToDevice));
  }
  step_workspace ws{};
  ws.miss_slots = miss_slots_device.get<int>();
  ws.miss_counts = miss_counts_device.get<int>();

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaGraphExec_t graph_exec = nullptr;
  device_buffer rope_table(shadowkv::cuda::rope_table_bytes(d, cfg.rope_table));
  ASSERT_TRUE(rope_table.ok());
  if (cfg.rope_table > 0) {
    ASSERT_NO_THROW(shadowkv::cuda::launch_build_rope_table(d, inv_freq_device.get<float>(), rope_table.get<float2>(),
                                                            cfg.rope_table, stream));
    ws.rope_table = rope_table.get<float2>();
    ws.rope_table_positions = cfg.rope_table;
  }

  const int rounds = cfg.graph ? 2 : 1;
  for (int round = 0; round < rounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // Miss lists; the unused tail of each list and the rows of the unused batch entry hold garbage slot ids.
    const std::vector<std::vector<int>> misses = draw_misses(cfg, rng);
    std::vector<int> miss_slots(static_cast<std::size_t>(max_batch) * Hkv * k, 0x55555555);
    std::vector<int> miss_counts(static_cast<std::size_t>(max_batch) * Hkv, 0x55555555);
    for (int i = 0; i < B * Hkv; ++i) {
      const std::vector<int>& list = misses[static_cast<std::size_t>(i)];
      miss_counts[static_cast<std::size_t>(i)] = static_cast<int>(list.size());
      std::copy(list.begin(), list.end(), miss_slots.begin() + static_cast<std::ptrdiff_t>(i) * k);
    }
    CUDA_OK(cudaMemcpy(miss_slots_device.get(), miss_slots.data(), miss_slots.size() * sizeof(int),
                       cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(miss_counts_device.get(), miss_counts.data(), miss_counts.size() * sizeof(int),
                       cudaMemcpyHostToDevice));
    for (const host_entry& e : entries) CUDA_OK(cudaMemset(e.cache_keys_device.get(), kSentinel, key_bytes));

    if (!cfg.graph) {
      ASSERT_NO_THROW(shadowkv::cuda::launch_rebuild_keys(d, cfg.kv_type, views_device.get<layer_view>(),
                                                          slots_device.get<int>(), layer, B, ws,
                                                          inv_freq_device.get<float>(), stream));
    } else {
      if (graph_exec == nullptr) {
        // The launch's one-time attribute setup runs outside the capture (as the backend's first uncaptured step).
        ASSERT_NO_THROW(shadowkv::cuda::launch_rebuild_keys(d, cfg.kv_type, views_device.get<layer_view>(),
                                                            slots_device.get<int>(), layer, B, ws,
                                                            inv_freq_device.get<float>(), stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        for (const host_entry& e : entries) CUDA_OK(cudaMemset(e.cache_keys_device.get(), kSentinel, key_bytes));
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        ASSERT_NO_THROW(shadowkv::cuda::launch_rebuild_keys(d, cfg.kv_type, views_device.get<layer_view>(),
                                                            slots_device.get<int>(), layer, B, ws,
                                                            inv_freq_device.get<float>(), stream));
        cudaGraph_t graph = nullptr;
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));
        CUDA_OK(cudaGraphDestroy(graph));
      }
      CUDA_OK(cudaGraphLaunch(graph_exec, stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaGetLastError());

    std::size_t compared = 0;
    std::size_t failures = 0;
    std::size_t untouched_failures = 0;
    double worst_ratio = 0.0;
    double reference_norm = 0.0;
    double rebuilt_norm = 0.0;
    std::vector<double> key;
    std::vector<double> bound;
    for (int b = 0; b < B; ++b) {
      const host_entry& e = entries[static_cast<std::size_t>(b)];
      std::vector<unsigned char> keys(key_bytes);
      CUDA_OK(cudaMemcpy(keys.data(), e.cache_keys_device.get(), key_bytes, cudaMemcpyDeviceToHost));
      for (int h = 0; h < Hkv; ++h) {
        const std::vector<int>& list = misses[static_cast<std::size_t>(b) * Hkv + h];
        std::vector<char> missed(static_cast<std::size_t>(K), 0);
        for (int s : list) missed[static_cast<std::size_t>(s)] = 1;
        for (int s = 0; s < K; ++s) {
          const std::size_t row0 = (static_cast<std::size_t>(h) * K + s) * C;  // first key row of the slot
          if (missed[static_cast<std::size_t>(s)] == 0) {
            const unsigned char* bytes = keys.data() + row0 * D * element_bytes(cfg.kv_type);
            const std::size_t count = static_cast<std::size_t>(C) * D * element_bytes(cfg.kv_type);
            if (std::any_of(bytes, bytes + count, [](unsigned char x) { return x != kSentinel; })) {
              if (untouched_failures < 5) {
                ADD_FAILURE() << "slot not in the miss list was written: entry " << b << " (slot " << e.slot
                              << ") head " << h << " buffer slot " << s;
              }
              ++untouched_failures;
            }
            continue;
          }
          const int chunk = e.cache_chunks[static_cast<std::size_t>(h) * K + s];
          for (int j = 0; j < C; ++j) {
            const long long token = static_cast<long long>(chunk) * C + j;
            reference_row(cfg, e, inv_freq, h, token, key, bound);
            for (int x = 0; x < D; ++x) {
              const double want = key[static_cast<std::size_t>(x)];
              const double got = load_element(cfg.kv_type, keys.data(), (row0 + j) * D + x);
              const double allowed = tolerance(cfg.kv_type, want, bound[static_cast<std::size_t>(x)]);
              const double error = std::fabs(got - want);
              reference_norm += want * want;
              rebuilt_norm += got * got;
              ++compared;
              worst_ratio = std::max(worst_ratio, error / allowed);
              if (!(error <= allowed)) {
                if (failures < 5) {
                  ADD_FAILURE() << "entry " << b << " (slot " << e.slot << ") head " << h << " buffer slot " << s
                                << " chunk " << chunk << " row " << j << " (position "
                                << e.positions[static_cast<std::size_t>(token)] << ") dim " << x << ": got " << got
                                << ", want " << want << " (error " << error << ", allowed " << allowed << ")";
                }
                ++failures;
              }
            }
          }
        }
      }
    }
    EXPECT_EQ(failures, 0U) << failures << " of " << compared << " key elements outside the tolerance";
    EXPECT_EQ(untouched_failures, 0U) << untouched_failures << " slots outside the miss lists were written";
    if (compared > 0) {
      EXPECT_GT(reference_norm, 0.0);
      EXPECT_GT(rebuilt_norm, 0.0) << "the rebuilt keys are all zero";
    }
    std::printf("[ chunk_rebuild ]   round %d: %zu elements compared, worst error / tolerance %.3g\n", round,
                compared, worst_ratio);

    if (cfg.rope_table > 0) {
      // The same rebuild without the table: every byte of every entry's keys equal (the table holds the coefficients
      // rope_coefficients computes, and rows past it compute theirs).
      std::vector<std::vector<unsigned char>> with_table;
      for (const host_entry& e : entries) {
        with_table.emplace_back(key_bytes);
        CUDA_OK(cudaMemcpy(with_table.back().data(), e.cache_keys_device.get(), key_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemset(e.cache_keys_device.get(), kSentinel, key_bytes));
      }
      step_workspace without = ws;
      without.rope_table = nullptr;
      without.rope_table_positions = 0;
      ASSERT_NO_THROW(shadowkv::cuda::launch_rebuild_keys(d, cfg.kv_type, views_device.get<layer_view>(),
                                                          slots_device.get<int>(), layer, B, without,
                                                          inv_freq_device.get<float>(), stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      std::size_t differing = 0;
      for (int b = 0; b < B; ++b) {
        std::vector<unsigned char> keys(key_bytes);
        CUDA_OK(cudaMemcpy(keys.data(), entries[static_cast<std::size_t>(b)].cache_keys_device.get(), key_bytes,
                           cudaMemcpyDeviceToHost));
        for (std::size_t i = 0; i < key_bytes; ++i) differing += keys[i] != with_table[static_cast<std::size_t>(b)][i];
      }
      EXPECT_EQ(differing, 0U) << differing << " key bytes differ between the rebuilds with and without the RoPE table";
    }
  }
  if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaStreamDestroy(stream));
}

class ChunkRebuild : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!device_present()) GTEST_SKIP() << "no CUDA device: launch_rebuild_keys is not exercised";
  }
};

constexpr int kTypes[] = {shadowkv::cuda::element_f32, shadowkv::cuda::element_bf16, shadowkv::cuda::element_f16};

/// Chunks per head giving a few 64-row tiles per (entry, head), so that several groups and splits are exercised.
int budget_for(int chunk) { return std::max(2, 200 / chunk); }

TEST_F(ChunkRebuild, HeadDimsChunksRanksAndTypes) {
  // Every D x C x rank x type; the other parameters rotate with the case index so that each value of each occurs
  // with many of the others.
  const int kv_heads[] = {1, 2, 8};
  const miss_pattern patterns[] = {miss_pattern::ragged, miss_pattern::ragged, miss_pattern::all,
                                   miss_pattern::ragged, miss_pattern::one};
  const float scalings[] = {1.0F, 0.75F, 1.25F, 1.0F};
  int index = 0;
  for (int head_dim : {64, 80, 96, 128, 256}) {
    for (int chunk : {1, 8, 16}) {
      for (int rank : {48, 160, 0}) {
        for (int type : kTypes) {
          case_config cfg;
          cfg.seed = 0xC0FFEEULL + 7919ULL * static_cast<std::uint64_t>(index);
          cfg.head_dim = head_dim;
          cfg.chunk = chunk;
          cfg.kv_heads = kv_heads[index % 3];
          cfg.rank = rank;
          if (rank > cfg.kv_heads * head_dim) cfg.rank = 0;  // 160 > 1 * 64, 1 * 80, 1 * 96, 1 * 128: full instead
          cfg.batch = (index / 3) % 2 == 0 ? 1 : 3;
          cfg.rotary_dim = index % 2 == 0 ? 0 : head_dim / 2;
          cfg.interleaved = (index / 2) % 2 == 1;
          cfg.attention_scaling = scalings[index % 4];
          cfg.rope_theta = index % 3 == 1 ? 500000.0 : 10000.0;
          cfg.kv_type = type;
          cfg.budget = budget_for(chunk);
          cfg.pattern = patterns[index % 5];
          cfg.bf16_factors = (index / 5) % 2 == 1;
          run_case(cfg);
          if (HasFatalFailure()) return;
          ++index;
        }
      }
    }
  }
}

TEST_F(ChunkRebuild, MissPatterns) {
  // Zero misses, one, every slot, ragged counts across (entry, head); one to eight heads, one or three entries.
  std::uint64_t seed = 101;
  for (miss_pattern pattern : {miss_pattern::none, miss_pattern::one, miss_pattern::all, miss_pattern::ragged}) {
    for (int kv_heads : {1, 2, 8}) {
      for (int batch : {1, 3}) {
        case_config cfg;
        cfg.seed = seed++;
        cfg.batch = batch;
        cfg.kv_heads = kv_heads;
        cfg.head_dim = 128;
        cfg.chunk = 8;
        cfg.rank = kv_heads == 1 ? 0 : 160;  // one head: full rank 128
        cfg.kv_type = shadowkv::cuda::element_bf16;
        cfg.budget = 40;
        cfg.pattern = pattern;
        cfg.bf16_factors = batch == 3;
        run_case(cfg);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(ChunkRebuild, RopeVariants) {
  // Full and partial rotary dims, half-split and interleaved pairs, attention scaling below, at and above one.
  std::uint64_t seed = 201;
  for (int head_dim : {80, 256}) {
    for (bool partial : {false, true}) {
      for (bool interleaved : {false, true}) {
        for (float scaling : {1.0F, 0.7F, 1.3F}) {
          case_config cfg;
          cfg.seed = seed++;
          cfg.batch = 2;
          cfg.kv_heads = 2;
          cfg.head_dim = head_dim;
          cfg.chunk = 8;
          cfg.rank = 160;
          cfg.rotary_dim = partial ? head_dim / 2 : 0;
          cfg.interleaved = interleaved;
          cfg.attention_scaling = scaling;
          cfg.rope_theta = 500000.0;
          cfg.kv_type = shadowkv::cuda::element_f32;
          cfg.budget = 24;
          cfg.pattern = miss_pattern::ragged;
          run_case(cfg);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST_F(ChunkRebuild, RanksOffTheVectorPath) {
  // Ranks that are no multiple of 4 (A rows not 16-byte aligned: 4-byte copies) and a rank tail in every K tile.
  std::uint64_t seed = 301;
  for (int rank : {1, 3, 33, 97, 130}) {
    for (int head_dim : {64, 96}) {
      case_config cfg;
      cfg.seed = seed++;
      cfg.batch = 2;
      cfg.kv_heads = 3;  // width 192 / 288: room for rank 130
      cfg.head_dim = head_dim;
      cfg.chunk = 8;
      cfg.rank = rank;
      cfg.kv_type = rank % 2 == 0 ? shadowkv::cuda::element_f32 : shadowkv::cuda::element_f16;
      cfg.bf16_factors = head_dim == 96;  // bf16 rows of a rank off 8: element-wise loads
      cfg.budget = 20;
      cfg.pattern = miss_pattern::ragged;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(ChunkRebuild, MisalignedFactors) {
  // A and B one element past a 16-byte boundary: both operands take the scalar copy path, for both factor formats.
  std::uint64_t seed = 401;
  for (int type : kTypes) {
    for (bool bf16_factors : {false, true}) {
      case_config cfg;
      cfg.seed = seed++;
      cfg.batch = 3;
      cfg.kv_heads = 2;
      cfg.head_dim = 128;
      cfg.chunk = 8;
      cfg.rank = 160;
      cfg.kv_type = type;
      cfg.bf16_factors = bf16_factors;
      cfg.budget = 24;
      cfg.misaligned = true;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(ChunkRebuild, OddChunkSizes) {
  // C = 3 and 5: a tile of 63 / 60 rows; C = 64: one chunk per tile.
  std::uint64_t seed = 501;
  for (int chunk : {3, 5, 64}) {
    case_config cfg;
    cfg.seed = seed++;
    cfg.batch = 2;
    cfg.kv_heads = 2;
    cfg.head_dim = 64;
    cfg.chunk = chunk;
    cfg.rank = 48;
    cfg.kv_type = shadowkv::cuda::element_bf16;
    cfg.budget = budget_for(chunk);
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkRebuild, LargeBudgetsAndFullWidth) {
  {
    // 1024 chunks per head, all missed: 128 tiles per (entry, head), more than the splits of the grid.
    case_config cfg;
    cfg.seed = 601;
    cfg.batch = 1;
    cfg.kv_heads = 2;
    cfg.head_dim = 128;
    cfg.chunk = 8;
    cfg.rank = 160;
    cfg.kv_type = shadowkv::cuda::element_bf16;
    cfg.budget = 1024;
    cfg.pattern = miss_pattern::all;
    run_case(cfg);
  }
  {
    // C = 1 with 1024 chunks: 64 chunks per tile.
    case_config cfg;
    cfg.seed = 602;
    cfg.batch = 3;
    cfg.kv_heads = 1;
    cfg.head_dim = 64;
    cfg.chunk = 1;
    cfg.rank = 48;
    cfg.kv_type = shadowkv::cuda::element_f32;
    cfg.budget = 1024;
    cfg.pattern = miss_pattern::ragged;
    run_case(cfg);
  }
  {
    // Full rank of a 2048-wide layer (Hkv = 8, D = 256): 64 K tiles.
    case_config cfg;
    cfg.seed = 603;
    cfg.batch = 1;
    cfg.kv_heads = 8;
    cfg.head_dim = 256;
    cfg.chunk = 16;
    cfg.rank = 0;
    cfg.rotary_dim = 128;
    cfg.kv_type = shadowkv::cuda::element_f32;
    cfg.budget = 12;
    cfg.pattern = miss_pattern::ragged;
    run_case(cfg);
  }
}

TEST_F(ChunkRebuild, CapturedInGraph) {
  // One graph, replayed with new miss lists: the grid does not depend on the miss counts (with a RoPE table for bf16).
  std::uint64_t seed = 701;
  for (int type : kTypes) {
    case_config cfg;
    cfg.seed = seed++;
    cfg.batch = 3;
    cfg.kv_heads = 2;
    cfg.head_dim = type == shadowkv::cuda::element_f32 ? 128 : 96;  // 128: more than 48 KiB of shared memory
    cfg.chunk = 8;
    cfg.rank = 160;
    cfg.kv_type = type;
    cfg.budget = 32;
    cfg.graph = true;
    cfg.rope_table = type == shadowkv::cuda::element_bf16 ? 300000 : 0;  // the table's pointer, captured
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkRebuild, LargerCacheSlotStride) {
  // A cache of K = 2..4 x k slots per head: miss lists of at most k slots anywhere in [0, K), rows at a K-slot head
  // stride; every other slot must stay untouched.
  std::uint64_t seed = 801;
  for (int type : kTypes) {
    for (int multiple : {2, 4}) {
      case_config cfg;
      cfg.seed = seed++;
      cfg.batch = 3;
      cfg.kv_heads = 3;
      cfg.head_dim = multiple == 2 ? 128 : 64;
      cfg.chunk = 8;
      cfg.rank = 96;
      cfg.kv_type = type;
      cfg.budget = 12;
      cfg.cache_slots = multiple * cfg.budget;
      cfg.pattern = miss_pattern::ragged;
      cfg.graph = multiple == 4;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(ChunkRebuild, ManyGroupsPerCta) {
  // 320 (entry, head) pairs: splits_for gives one split on any GPU of up to 160 SMs, so each CTA takes every group of
  // its pair in turn (up to 5 here), the next group's row tables and K tiles 0 and 1 loading during this group's
  // epilogue, with double-buffered tables and the epilogue tile over stage 2. (The other cases have about one group a
  // CTA on an H200: splits_for spreads the groups of a few pairs over 2 x 132 CTAs.) Ragged counts: CTAs with none, one
  // and several groups, and a last group of fewer rows. Ranks of 5, 3 and 2 K tiles: the first main-loop iteration
  // refills stage 2 (the previous group's sC) at 5 and 3, not at 2.
  struct shape {
    int head_dim;
    int chunk;
    int rank;
    int budget;  // 5 groups when every chunk is missed
    int kv_type;
    bool bf16_factors;
    miss_pattern pattern;
  };
  const shape shapes[] = {
      {128, 8, 160, 40, shadowkv::cuda::element_bf16, true, miss_pattern::ragged},  // as docs/performance.md
      {64, 16, 96, 20, shadowkv::cuda::element_f32, false, miss_pattern::all},
      {96, 3, 33, 105, shadowkv::cuda::element_f16, false, miss_pattern::ragged},  // 63-row groups, 4-byte A copies
  };
  std::uint64_t seed = 901;
  for (const shape& s : shapes) {
    case_config cfg;
    cfg.seed = seed++;
    cfg.batch = 2;
    cfg.kv_heads = 160;
    cfg.head_dim = s.head_dim;
    cfg.chunk = s.chunk;
    cfg.rank = s.rank;
    cfg.rotary_dim = s.head_dim == 96 ? 64 : 0;
    cfg.interleaved = s.head_dim == 64;
    cfg.kv_type = s.kv_type;
    cfg.bf16_factors = s.bf16_factors;
    cfg.budget = s.budget;
    cfg.pattern = s.pattern;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkRebuild, RopeTableGivesTheSameKeys) {
  // The store's RoPE table (rope_table.cuh), covering positions [0, 300000) of test positions that reach ~1.3e6: rows
  // in and past it in one rebuild. Keys within the float64 reference's tolerance and byte-identical to a rebuild
  // without the table: the default shape (bf16, bf16 factors, D = 128, several groups a CTA), an odd number of pairs
  // per position (8-byte copies), interleaved pairs with attention scaling, one K tile, and float32 factors at D = 128
  // (whose shared memory has no room for the coefficients: the table is not read); half-split at D = 96 and 256 and
  // interleaved with a partial rotary_dim (the rotation in the accumulators, rope_in_registers; the rebuild without
  // the table rotates over sC, so the byte comparison checks one against the other).
  struct shape {
    int kv_heads;
    int head_dim;
    int rotary_dim;
    bool interleaved;
    float scaling;
    int rank;
    int kv_type;
    bool bf16_factors;
    int budget;
  };
  const shape shapes[] = {
      {160, 128, 0, false, 1.0F, 160, shadowkv::cuda::element_bf16, true, 40},
      {2, 96, 38, false, 1.0F, 96, shadowkv::cuda::element_f16, false, 24},
      {3, 64, 0, true, 1.3F, 48, shadowkv::cuda::element_f32, false, 24},
      {2, 80, 0, false, 0.7F, 20, shadowkv::cuda::element_bf16, true, 16},
      {2, 128, 0, false, 1.0F, 160, shadowkv::cuda::element_bf16, false, 24},
      {2, 96, 0, false, 1.0F, 96, shadowkv::cuda::element_bf16, true, 24},
      {2, 256, 0, false, 0.9F, 160, shadowkv::cuda::element_f32, true, 24},
      {2, 128, 64, true, 1.1F, 160, shadowkv::cuda::element_f16, true, 24},
  };
  std::uint64_t seed = 1001;
  for (const shape& s : shapes) {
    case_config cfg;
    cfg.seed = seed++;
    cfg.batch = 2;
    cfg.kv_heads = s.kv_heads;
    cfg.head_dim = s.head_dim;
    cfg.chunk = 8;
    cfg.rank = s.rank;
    cfg.rotary_dim = s.rotary_dim;
    cfg.interleaved = s.interleaved;
    cfg.attention_scaling = s.scaling;
    cfg.rope_theta = 500000.0;
    cfg.kv_type = s.kv_type;
    cfg.bf16_factors = s.bf16_factors;
    cfg.budget = s.budget;
    cfg.pattern = miss_pattern::ragged;
    cfg.rope_table = 300000;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkRebuild, Bf16FactorsOnBf16Mma) {
  // bf16 factors on the bf16 MMAs (ldmatrix operands): every head dim (the ldmatrix.trans rows of B are 2 (D + 8)
  // bytes apart), every key type, ranks on and off the 16-byte copy path and with a K tile's tail (rank 37:
  // zero-filled columns inside a k-block of 16), A and B off their 16-byte alignment, several groups a CTA, chunks of
  // 1 and 16.
  std::uint64_t seed = 2024;
  int index = 0;
  for (const int head_dim : {64, 80, 96, 128, 256}) {
    for (const int rank : {37, 160}) {
      case_config cfg;
      cfg.seed = seed++;
      cfg.batch = 2;
      cfg.kv_heads = 3;  // rank 160 <= 3 x 64
      cfg.head_dim = head_dim;
      cfg.chunk = index % 3 == 0 ? 16 : (index % 3 == 1 ? 8 : 1);
      cfg.rank = rank;
      cfg.kv_type = kTypes[index % 3];
      cfg.bf16_factors = true;
      cfg.misaligned = index % 4 == 3;
      cfg.budget = 5 * 64 / cfg.chunk;  // five groups when every chunk is missed
      cfg.pattern = index % 2 == 0 ? miss_pattern::all : miss_pattern::ragged;
      cfg.rope_theta = 500000.0;
      run_case(cfg);
      if (HasFatalFailure()) return;
      ++index;
    }
  }
}

TEST(ChunkRebuildArguments, RejectsUnsupportedShapes) {
  // Checked before anything touches the device: runs without a GPU too.
  dims d{};
  d.num_layers = 1;
  d.q_heads = 2;
  d.kv_heads = 2;
  d.group = 1;
  d.head_dim = 128;
  d.chunk = 8;
  d.budget = 8;
  d.cache_slots = 8;
  d.rank = 16;
  d.max_chunks = 16;
  d.rotary_dim = 128;
  d.attention_scaling = 1.0F;
  const step_workspace ws{};
  EXPECT_NO_THROW(shadowkv::cuda::launch_rebuild_keys(d, 0, nullptr, nullptr, 0, 0, ws, nullptr, nullptr));
  for (int head_dim : {32, 48, 112, 160, 512}) {
    dims bad = d;
    bad.head_dim = head_dim;
    bad.rotary_dim = head_dim;
    EXPECT_THROW(shadowkv::cuda::launch_rebuild_keys(bad, 0, nullptr, nullptr, 0, 1, ws, nullptr, nullptr),
                 shadowkv::invalid_argument)
        << "head_dim " << head_dim;
  }
  for (int chunk : {0, 65, 128}) {
    dims bad = d;
    bad.chunk = chunk;
    EXPECT_THROW(shadowkv::cuda::launch_rebuild_keys(bad, 0, nullptr, nullptr, 0, 1, ws, nullptr, nullptr),
                 shadowkv::invalid_argument)
        << "chunk " << chunk;
  }
  dims bad = d;
  bad.rank = 0;
  EXPECT_THROW(shadowkv::cuda::launch_rebuild_keys(bad, 0, nullptr, nullptr, 0, 1, ws, nullptr, nullptr),
               shadowkv::invalid_argument);
  EXPECT_THROW(shadowkv::cuda::launch_rebuild_keys(d, 0, nullptr, nullptr, 0, -1, ws, nullptr, nullptr),
               shadowkv::invalid_argument);
  EXPECT_THROW(shadowkv::cuda::launch_rebuild_keys(d, 9, nullptr, nullptr, 0, 1, ws, nullptr, nullptr),
               shadowkv::invalid_argument);
  bad = d;
  bad.cache_slots = 7;  // fewer slots than the budget
  EXPECT_THROW(shadowkv::cuda::launch_rebuild_keys(bad, 0, nullptr, nullptr, 0, 1, ws, nullptr, nullptr),
               shadowkv::invalid_argument);
  EXPECT_THROW(shadowkv::cuda::launch_fetch_values(bad, 0, nullptr, nullptr, 0, 1, ws, 1, 0, nullptr),
               shadowkv::invalid_argument);
}

}  // namespace
