// launch_select_chunks against a CPU model that follows cpu_backend::select_chunks (float64 scores, ties to the
// smaller chunk id) and its temporal-cache rules. Random configurations with printed seeds; each runs two or more
// decode steps in a row (different queries, the context possibly grown) so that hits, frees and misses all occur.
//
// What is compared:
//   * scores (workspace.scores) against float64 within a relative tolerance;
//   * the selection exactly against the top-k of the GPU's own float scores (radix select, tie order, compaction);
//   * the selection against the float64 top-k: any difference must be a near-tie at the k-th score;
//   * planted exact ties (copied landmarks): equal scores bit for bit, and the smaller id wins;
//   * cache_chunks, slot_of_chunk, miss_slots, miss_counts exactly against the cache rules applied to the GPU's
//     selection, plus the invariants (slot_of_chunk inverse of cache_chunks, cached set == selected set);
//   * with a cache larger than the budget (K > k, the LRU rule of cpp/src/lru_selection_cache.hpp, transcribed in
//     apply_lru_rule below because the CUDA tests compile as C++17): also cache_last_used, selection_clock and
//     selected_slots exactly, and the listed slots' chunks == the selection;
//   * counters (hits, misses, selections; the bytes counter untouched).
// Chunk scores by landmarks, or by two centroids (dims::chunk_centroids, shadowkv/chunk_centroids.hpp): random e4m3
// codes, scales and first-cluster counts, the float64 logit log(w1 e^(s q.c1) + w2 e^(s q.c2)) in the model.
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
#include <iterator>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "chunk_selection.cuh"
#include "cuda_test_support.cuh"
#include "device_layout.cuh"
#include "selection/select_kernel.cuh"
#include "selection/selection_plan.cuh"
#include "shadowkv/errors.hpp"
#include "shadowkv/fp8.hpp"

namespace {

using shadowkv::cuda::dims;
using shadowkv::cuda::layer_view;
using shadowkv::cuda::step_workspace;
using shadowkv::cuda::strided_tensor;

using namespace shadowkv::cuda::testing;

constexpr int kChunk = 8;  ///< dims::chunk: tokens a chunk (the two-centroid weights are n1 / kChunk)

struct case_config {
  std::uint64_t seed = 0;
  int batch = 1;
  int kv_heads = 1;
  int group = 1;
  int head_dim = 64;
  int max_chunks = 64;
  int budget = 8;
  int cache_slots = 0;  ///< K; 0: the budget (K == k)
  int steps = 2;        ///< decode steps; the context grows before the second and stays from then on
  int tokens = 1;
  int kv_type = shadowkv::cuda::element_bf16;
  int q_type = shadowkv::cuda::element_f32;
  int max_context = 64;       ///< first-step contexts drawn in [0, max_context]
  int max_outliers = 8;       ///< per head, drawn in [0, max_outliers]
  float query_scale = 2.0F;   ///< logits have about this standard deviation
  double tie_fraction = 0.1;  ///< chunks whose landmark copies an earlier chunk's (planted exact ties)
  bool equal_landmarks = false;
  bool warm_cache = false;       ///< first step starts from a random consistent cache
  bool fresh_second = false;     ///< second step's queries unrelated to the first's (else a small perturbation)
  bool graph = false;            ///< capture the launch once in a CUDA graph and replay it for both steps
  bool two_centroids = false;    ///< chunks scored by two e4m3 centroids (dims::chunk_centroids), not landmarks
  int beside = 0;                ///< launch_select_chunks' beside_ctas: > 0 gives the decode logits their tile pool
  unsigned empty_entries = 0;    ///< bit b: entry b has no context at either step (besides the seed's last-entry rule)
  /// layer_view::selection_hint: 0 none (null: no hint path), 1 zeroed at the start and then kept by the
  /// select clusters (their hint path from the second step), 2 random values at the start (stale hints of any kind)
  int hints = 1;

  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "seed=" << seed << " B=" << batch << " Hkv=" << kv_heads << " G=" << group << " D=" << head_dim
      << " max_chunks=" << max_chunks << " k=" << budget << " K=" << (cache_slots > 0 ? cache_slots : budget)
      << " steps=" << steps << " Tq=" << tokens << " kv=" << type_name(kv_type)
      << " q=" << type_name(q_type) << " max_context=" << max_context << " outliers<=" << max_outliers
      << " qscale=" << query_scale << " ties=" << tie_fraction << (equal_landmarks ? " equal_landmarks" : "")
      << (warm_cache ? " warm" : "") << (fresh_second ? " fresh_second" : "") << (graph ? " graph" : "")
      << (two_centroids ? " two_centroids" : "") << " beside=" << beside << " empty_entries=0x" << std::hex
      << empty_entries << std::dec << " hints=" << hints;
    return s.str();
  }
};

/// Host mirror of one (slot, layer) entry.
struct host_entry {
  int slot = 0;
  int context[2] = {0, 0};           // context_chunks at step 0 and step 1
  std::vector<float> landmarks;      // [Hkv, max_chunks, D], rounded through kv_type (empty with two centroids)
  std::vector<std::uint8_t> centroid_codes;  // two centroids only: [Hkv, max_chunks, 2 * D], centroid 1 then 2
  std::vector<float> centroid_scales;        // two centroids only: [Hkv, max_chunks, 2]
  std::vector<std::uint8_t> first_counts;    // two centroids only: [Hkv, max_chunks], n1 in [0, kChunk]
  std::vector<std::uint8_t> outlier; // [Hkv, max_chunks]
  std::vector<int> cache;            // [Hkv, K] model state
  std::vector<int> slot_of;          // [Hkv, max_chunks] model state
  std::vector<long long> last_used;  // [Hkv, K] model state (K > k only)
  std::vector<long long> clock;      // [Hkv] model state (K > k only)
  struct tie { int head, first, second; };
  std::vector<tie> ties;
  device_buffer landmarks_device, outlier_device, cache_device, slot_of_device;
  device_buffer codes_device, scales_device, counts_device;  // two centroids only
  device_buffer last_used_device, clock_device, selected_slots_device;  // K > k only
  device_buffer hint_device;  // [Hkv] layer_view::selection_hint (case_config::hints > 0)
};

/// cpp/src/lru_selection_cache.hpp's assign_lru_slots for one head (K = cache.size() slots), with slot_of kept as
/// the inverse of cache. `chosen`: ascending chunk ids; `now`: this selection's number. Returns the filled slots in
/// the misses' ascending chunk order; `selected_now` gets the slots of this selection.
std::vector<int> apply_lru_rule(const std::vector<int>& chosen, long long now, int* cache, int* slot_of,
                                long long* last_used, int capacity, std::vector<char>& selected_now, int& hits) {
  selected_now.assign(static_cast<std::size_t>(capacity), 0);
  hits = 0;
  std::vector<char> is_hit(chosen.size(), 0);
  for (int s = 0; s < capacity; ++s) {
    if (cache[s] < 0) continue;
    const auto found = std::lower_bound(chosen.begin(), chosen.end(), cache[s]);
    if (found == chosen.end() || *found != cache[s]) continue;
    is_hit[static_cast<std::size_t>(found - chosen.begin())] = 1;
    selected_now[static_cast<std::size_t>(s)] = 1;
    last_used[s] = now;
    ++hits;
  }
  std::vector<int> filled;
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    if (is_hit[i] != 0) continue;
    int victim = -1;
    for (int s = 0; s < capacity && victim < 0; ++s) {
      if (cache[s] < 0) victim = s;
    }
    if (victim < 0) {
      for (int s = 0; s < capacity; ++s) {
        if (selected_now[static_cast<std::size_t>(s)] != 0) continue;
        if (victim < 0 || last_used[s] < last_used[victim]) victim = s;
      }
    }
    if (cache[victim] >= 0) slot_of[cache[victim]] = -1;
    cache[victim] = chosen[i];
    slot_of[chosen[i]] = victim;
    selected_now[static_cast<std::size_t>(victim)] = 1;
    last_used[victim] = now;
    filled.push_back(victim);
  }
  return filled;
}

/// The exact values of the 256 e4m3 codes (NaN at the two NaN codes, which the test never draws).
const double* e4m3_values() {
  static const std::vector<double> values = [] {
    std::vector<double> v(256);
    for (int code = 0; code < 256; ++code) {
      v[static_cast<std::size_t>(code)] = shadowkv::fp8::decode_e4m3(static_cast<std::uint8_t>(code));
    }
    return v;
  }();
  return values.data();
}

/// float64 two-centroid logit of chunk c of head h: log(w1 e^(s q.c1) + w2 e^(s q.c2)) with w1 = n1 / C, w2 = 1 - w1
/// and c_m = decode(code) * scale_m; a zero weight drops its term (n1 = 0 or C: one centroid's logit).
double centroid_logit(const case_config& cfg, const host_entry& e, int h, int c, const float* query, double scale) {
  const int D = cfg.head_dim;
  const double* value = e4m3_values();
  const std::size_t chunk = static_cast<std::size_t>(h) * cfg.max_chunks + c;
  const std::uint8_t* codes = e.centroid_codes.data() + chunk * 2 * D;
  const int n1 = e.first_counts[chunk];
  double term[2];
  for (int m = 0; m < 2; ++m) {
    const int members = m == 0 ? n1 : kChunk - n1;
    if (members == 0) {
      term[m] = -INFINITY;
      continue;
    }
    double dot = 0.0;
    for (int x = 0; x < D; ++x) dot += static_cast<double>(query[x]) * value[codes[m * D + x]];
    term[m] = scale * dot * static_cast<double>(e.centroid_scales[chunk * 2 + m]) +
              std::log(static_cast<double>(members) / kChunk);
  }
  const double top = std::max(term[0], term[1]);
  return top + std::log(std::exp(term[0] - top) + std::exp(term[1] - top));
}

/// float64 scores as cpu_backend::select_chunks computes them; -1 for chunks that are not candidates.
std::vector<double> reference_scores(const case_config& cfg, const host_entry& e, int h, int n, int b,
                                     const std::vector<float>& q /* [Tq, B, Hq, D] */, double scale) {
  const int D = cfg.head_dim;
  const int Hq = cfg.kv_heads * cfg.group;
  std::vector<double> score(static_cast<std::size_t>(n), -1.0);
  std::vector<int> candidates;
  for (int c = 0; c < n; ++c) {
    if (e.outlier[static_cast<std::size_t>(h) * cfg.max_chunks + c] == 0) candidates.push_back(c);
  }
  if (candidates.empty()) return score;
  for (int c : candidates) score[static_cast<std::size_t>(c)] = 0.0;
  std::vector<double> logits(candidates.size());
  std::vector<double> probability(candidates.size());
  for (int g = 0; g < cfg.group; ++g) {
    const int j = h * cfg.group + g;
    std::fill(probability.begin(), probability.end(), 0.0);
    for (int t = 0; t < cfg.tokens; ++t) {
      const float* query = q.data() + ((static_cast<std::size_t>(t) * cfg.batch + b) * Hq + j) * D;
      double largest = -INFINITY;
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        if (cfg.two_centroids) {
          logits[i] = centroid_logit(cfg, e, h, candidates[i], query, scale);
          largest = std::max(largest, logits[i]);
          continue;
        }
        const float* landmark = e.landmarks.data() + (static_cast<std::size_t>(h) * cfg.max_chunks + candidates[i]) * D;
        double dot = 0.0;
        for (int x = 0; x < D; ++x) dot += static_cast<double>(query[x]) * static_cast<double>(landmark[x]);
        logits[i] = scale * dot;
        largest = std::max(largest, logits[i]);
      }
      double total = 0.0;
      for (double& logit : logits) {
        logit = std::exp(logit - largest);
        total += logit;
      }
      for (std::size_t i = 0; i < candidates.size(); ++i) probability[i] += logits[i] / total;
    }
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      double& s = score[static_cast<std::size_t>(candidates[i])];
      s = std::max(s, probability[i]);
    }
  }
  return score;
}

/// Top `take` chunk ids by descending score (ties to the smaller id), returned ascending.
template <typename Score>
std::vector<int> top_k(const std::vector<Score>& score, const std::vector<int>& candidates, int take) {
  std::vector<int> order = candidates;
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return score[static_cast<std::size_t>(x)] > score[static_cast<std::size_t>(y)];
  });
  order.resize(static_cast<std::size_t>(take));
  std::sort(order.begin(), order.end());
  return order;
}

double tolerance(double value) { return 1e-4 * std::fabs(value) + 1e-30; }

/// Two-centroid data of head h's chunks [0, n) (later chunks stay zero). Codes are never NaN (0x7f, 0xff): half of
/// the centroids are normal values encoded with the fp8 rule's scale (codes up to +-448), the others any non-NaN byte
/// (subnormals, both zeros, every exponent). Each scale is then u / rms(decoded codes), u uniform in [0.5, 2], so that
/// s * q.c has a standard deviation of about u * query_scale, as a landmark logit has about query_scale. n1 is 0 or C
/// a fifth of the time each (one centroid's logit alone), else uniform in [1, C - 1]. Planted ties copy an earlier
/// chunk's codes, scales and n1; equal_landmarks copies chunk 0's to every chunk.
void draw_centroids(const case_config& cfg, host_entry& e, int h, int n, std::mt19937_64& rng) {
  const std::size_t D = static_cast<std::size_t>(cfg.head_dim);
  const std::size_t first = static_cast<std::size_t>(h) * cfg.max_chunks;  // (head h, chunk 0) of the arrays
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const double* value = e4m3_values();
  auto copy_chunk = [&](int from, int to) {
    const std::size_t source = first + static_cast<std::size_t>(from);
    const std::size_t target = first + static_cast<std::size_t>(to);
    std::copy_n(e.centroid_codes.begin() + static_cast<std::ptrdiff_t>(source * 2 * D), 2 * D,
                e.centroid_codes.begin() + static_cast<std::ptrdiff_t>(target * 2 * D));
    e.centroid_scales[target * 2] = e.centroid_scales[source * 2];
    e.centroid_scales[target * 2 + 1] = e.centroid_scales[source * 2 + 1];
    e.first_counts[target] = e.first_counts[source];
  };
  std::vector<float> values(D);
  for (int c = 0; c < n; ++c) {
    if (cfg.equal_landmarks && c > 0) {
      copy_chunk(0, c);
      continue;
    }
    if (!cfg.equal_landmarks && c > 0 && unit(rng) < cfg.tie_fraction) {
      const int source = uniform(0, c - 1);
      copy_chunk(source, c);
      e.ties.push_back({h, source, c});
      continue;
    }
    const std::size_t chunk = first + static_cast<std::size_t>(c);
    for (std::size_t m = 0; m < 2; ++m) {
      std::uint8_t* codes = e.centroid_codes.data() + (chunk * 2 + m) * D;
      if (unit(rng) < 0.5) {
        float amax = 0.0F;
        for (float& x : values) {
          x = normal(rng);
          amax = std::max(amax, std::fabs(x));
        }
        const float base = shadowkv::fp8::scale_for(amax);
        for (std::size_t x = 0; x < D; ++x) codes[x] = shadowkv::fp8::encode_e4m3(values[x] / base);
      } else {
        for (std::size_t x = 0; x < D; ++x) {
          int code = 0x7f;
          while (code == 0x7f || code == 0xff) code = uniform(0, 255);
          codes[x] = static_cast<std::uint8_t>(code);
        }
      }
      double squares = 0.0;
      for (std::size_t x = 0; x < D; ++x) squares += value[codes[x]] * value[codes[x]];
      const double rms = std::sqrt(squares / static_cast<double>(D));
      const double u = std::uniform_real_distribution<double>(0.5, 2.0)(rng);
      e.centroid_scales[chunk * 2 + m] = static_cast<float>(rms > 0.0 ? u / rms : u);
    }
    const double weights = unit(rng);
    e.first_counts[chunk] =
        static_cast<std::uint8_t>(weights < 0.2 ? 0 : (weights < 0.4 ? kChunk : uniform(1, kChunk - 1)));
  }
}

/// Runs the case's steps against the model; `hinted` (if given) gets the selections that took the select cluster's
/// hint path (ASSERT_ needs a void function).
void run_case(const case_config& cfg, unsigned long long* hinted = nullptr) {
  SCOPED_TRACE(cfg.describe());
  std::printf("[ chunk_selection ] %s\n", cfg.describe().c_str());
  std::mt19937_64 rng(cfg.seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  const int B = cfg.batch;
  const int Hkv = cfg.kv_heads;
  const int G = cfg.group;
  const int Hq = Hkv * G;
  const int D = cfg.head_dim;
  const int mc = cfg.max_chunks;
  const int k = cfg.budget;
  const int K = cfg.cache_slots > 0 ? cfg.cache_slots : k;  // slots per head
  const bool lru = K > k;
  ASSERT_TRUE(!lru || K <= mc) << "a cache larger than the budget holds at most max_chunks slots";
  const int Tq = cfg.tokens;
  const int num_layers = 2;
  const int layer = 1;
  const int slots = B + 1;
  const int max_batch = B + 1;

  dims d{};
  d.num_layers = num_layers;
  d.q_heads = Hq;
  d.kv_heads = Hkv;
  d.head_dim = D;
  d.group = G;
  d.chunk = kChunk;
  d.budget = k;
  d.cache_slots = K;
  d.max_outliers = std::max(1, cfg.max_outliers);
  d.rank = 1;
  d.window = 8;
  d.local_capacity = 0;
  d.max_chunks = mc;
  d.rotary_dim = D;
  d.rope_interleaved = 0;
  d.attention_scaling = 1.0F;
  d.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  d.chunk_centroids = cfg.two_centroids ? 1 : 0;

  // Entries on a shuffled subset of the slots (exercises slot * num_layers + layer indexing).
  std::vector<int> slot_order(static_cast<std::size_t>(slots));
  std::iota(slot_order.begin(), slot_order.end(), 0);
  std::shuffle(slot_order.begin(), slot_order.end(), rng);
  std::vector<int> batch_slots(slot_order.begin(), slot_order.begin() + B);

  std::vector<host_entry> entries(static_cast<std::size_t>(B));
  std::vector<layer_view> views(static_cast<std::size_t>(slots) * num_layers);
  std::memset(views.data(), 0, views.size() * sizeof(layer_view));
  for (int b = 0; b < B; ++b) {
    host_entry& e = entries[static_cast<std::size_t>(b)];
    e.slot = batch_slots[static_cast<std::size_t>(b)];
    e.context[0] = std::min(mc, uniform(0, cfg.max_context));
    if (B > 1 && b == B - 1 && cfg.seed % 3 == 0) e.context[0] = 0;  // an empty entry beside full ones
    e.context[1] = std::min(mc, e.context[0] + uniform(0, 3));
    if (b < 32 && (cfg.empty_entries >> b & 1U) != 0) e.context[0] = e.context[1] = 0;
    const int n = e.context[1];

    e.landmarks.assign(cfg.two_centroids ? 0 : static_cast<std::size_t>(Hkv) * mc * D, 0.0F);
    std::vector<unsigned char> bytes(e.landmarks.size() * element_bytes(cfg.kv_type), 0);
    e.outlier.assign(static_cast<std::size_t>(Hkv) * mc, 0);
    if (cfg.two_centroids) {
      e.centroid_codes.assign(static_cast<std::size_t>(Hkv) * mc * 2 * D, 0);
      e.centroid_scales.assign(static_cast<std::size_t>(Hkv) * mc * 2, 0.0F);
      e.first_counts.assign(static_cast<std::size_t>(Hkv) * mc, 0);
    }
    for (int h = 0; h < Hkv; ++h) {
      if (cfg.two_centroids) {
        draw_centroids(cfg, e, h, n, rng);
      } else {
        float* head = e.landmarks.data() + static_cast<std::size_t>(h) * mc * D;
        std::vector<float> common(static_cast<std::size_t>(D));
        for (float& x : common) x = normal(rng);
        for (int c = 0; c < n; ++c) {
          float* row = head + static_cast<std::size_t>(c) * D;
          if (cfg.equal_landmarks) {
            std::copy(common.begin(), common.end(), row);
          } else if (c > 0 && std::uniform_real_distribution<double>(0.0, 1.0)(rng) < cfg.tie_fraction) {
            const int source = uniform(0, c - 1);
            std::copy(head + static_cast<std::size_t>(source) * D, head + static_cast<std::size_t>(source + 1) * D,
                      row);
            e.ties.push_back({h, source, c});
          } else {
            for (int x = 0; x < D; ++x) row[x] = normal(rng);
          }
          for (int x = 0; x < D; ++x) row[x] = round_through(cfg.kv_type, row[x]);
        }
      }
      // Outliers: distinct random chunks of the final context.
      const int outliers = std::min(n, uniform(0, cfg.max_outliers));
      std::vector<int> ids(static_cast<std::size_t>(n));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      for (int i = 0; i < outliers; ++i) e.outlier[static_cast<std::size_t>(h) * mc + ids[static_cast<std::size_t>(i)]] = 1;
    }
    for (std::size_t i = 0; i < e.landmarks.size(); ++i) store_element(cfg.kv_type, bytes, i, e.landmarks[i]);

    // Cache: empty, or a random consistent state over the first step's context (K > k: with random stamps, ties
    // included, older than the clock; empty slots stamped 0 as after a prefill).
    e.cache.assign(static_cast<std::size_t>(Hkv) * K, -1);
    e.slot_of.assign(static_cast<std::size_t>(Hkv) * mc, -1);
    e.last_used.assign(lru ? static_cast<std::size_t>(Hkv) * K : 0, 0);
    e.clock.assign(lru ? static_cast<std::size_t>(Hkv) : 0, 0);
    if (cfg.warm_cache) {
      for (int h = 0; h < Hkv; ++h) {
        // Chunks past a short context too (slots the kernel must free as not selectable).
        const int range = std::max(e.context[0], std::min(mc, 16));
        std::vector<int> ids(static_cast<std::size_t>(range));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<int> slot_ids(static_cast<std::size_t>(K));
        std::iota(slot_ids.begin(), slot_ids.end(), 0);
        std::shuffle(slot_ids.begin(), slot_ids.end(), rng);
        const int count = uniform(std::min(K, range) / 2, std::min(K, range));
        if (lru) e.clock[static_cast<std::size_t>(h)] = uniform(1, 12);
        for (int i = 0; i < count; ++i) {
          const int c = ids[static_cast<std::size_t>(i)];
          const int s = slot_ids[static_cast<std::size_t>(i)];
          e.cache[static_cast<std::size_t>(h) * K + s] = c;
          e.slot_of[static_cast<std::size_t>(h) * mc + c] = s;
          if (lru) {
            e.last_used[static_cast<std::size_t>(h) * K + s] = uniform(1, static_cast<int>(e.clock[static_cast<std::size_t>(h)]));
          }
        }
      }
    }

    e.landmarks_device = device_buffer(bytes.size());
    e.outlier_device = device_buffer(e.outlier.size());
    e.cache_device = device_buffer(e.cache.size() * sizeof(int));
    e.slot_of_device = device_buffer(e.slot_of.size() * sizeof(int));
    ASSERT_TRUE(e.landmarks_device.ok() && e.outlier_device.ok() && e.cache_device.ok() && e.slot_of_device.ok());
    if (cfg.two_centroids) {
      e.codes_device = device_buffer(e.centroid_codes.size());
      e.scales_device = device_buffer(e.centroid_scales.size() * sizeof(float));
      e.counts_device = device_buffer(e.first_counts.size());
      ASSERT_TRUE(e.codes_device.ok() && e.scales_device.ok() && e.counts_device.ok());
      CUDA_OK(upload(e.codes_device, e.centroid_codes));
      CUDA_OK(upload(e.scales_device, e.centroid_scales));
      CUDA_OK(upload(e.counts_device, e.first_counts));
    } else {
      CUDA_OK(upload(e.landmarks_device, bytes));
    }
    CUDA_OK(upload(e.outlier_device, e.outlier));
    CUDA_OK(upload(e.cache_device, e.cache));
    CUDA_OK(upload(e.slot_of_device, e.slot_of));
    if (lru) {
      e.last_used_device = device_buffer(e.last_used.size() * sizeof(long long));
      e.clock_device = device_buffer(e.clock.size() * sizeof(long long));
      e.selected_slots_device = device_buffer(static_cast<std::size_t>(Hkv) * k * sizeof(int));
      ASSERT_TRUE(e.last_used_device.ok() && e.clock_device.ok() && e.selected_slots_device.ok());
      CUDA_OK(upload(e.last_used_device, e.last_used));
      CUDA_OK(upload(e.clock_device, e.clock));
      CUDA_OK(cudaMemset(e.selected_slots_device.get(), 0x55, static_cast<std::size_t>(Hkv) * k * sizeof(int)));
    }

    layer_view& view = views[static_cast<std::size_t>(e.slot) * num_layers + layer];
    view.context_chunks = e.context[0];
    if (cfg.two_centroids) {
      view.landmarks = nullptr;  // centroid mode has no landmarks: a kernel that reads them would fault
      view.centroid_codes = e.codes_device.get<std::uint8_t>();
      view.centroid_scales = e.scales_device.get<float>();
      view.first_counts = e.counts_device.get<std::uint8_t>();
    } else {
      view.landmarks = e.landmarks_device.get();
    }
    view.is_outlier = e.outlier_device.get<std::uint8_t>();
    view.cache_chunks = e.cache_device.get<int>();
    view.slot_of_chunk = e.slot_of_device.get<int>();
    if (lru) {
      view.cache_last_used = e.last_used_device.get<long long>();
      view.selection_clock = e.clock_device.get<long long>();
      view.selected_slots = e.selected_slots_device.get<int>();
    }
    if (cfg.hints > 0) {
      std::vector<unsigned> hints(static_cast<std::size_t>(Hkv), 0U);
      if (cfg.hints == 2) {
        for (unsigned& x : hints) x = static_cast<unsigned>(rng());
      }
      e.hint_device = device_buffer(hints.size() * sizeof(unsigned));
      ASSERT_TRUE(e.hint_device.ok());
      CUDA_OK(upload(e.hint_device, hints));
      view.selection_hint = e.hint_device.get<unsigned>();
    }
  }

  device_buffer views_device(views.size() * sizeof(layer_view));
  device_buffer slots_device(batch_slots.size() * sizeof(int));
  ASSERT_TRUE(views_device.ok() && slots_device.ok());
  CUDA_OK(upload(views_device, views));
  CUDA_OK(upload(slots_device, batch_slots));

  // Workspace, reserved for max_batch > B and poisoned so that stale contents cannot pass for results.
  device_buffer logits(static_cast<std::size_t>(max_batch) * Hq * std::max(mc, 1) * sizeof(float));
  device_buffer scores(static_cast<std::size_t>(max_batch) * Hkv * std::max(mc, 1) * sizeof(float));
  device_buffer selected(static_cast<std::size_t>(max_batch) * Hkv * k * sizeof(int));
  device_buffer miss_slots(static_cast<std::size_t>(max_batch) * Hkv * k * sizeof(int));
  device_buffer miss_counts(static_cast<std::size_t>(max_batch) * Hkv * sizeof(int));
  device_buffer counters(5 * sizeof(unsigned long long));
  ASSERT_TRUE(logits.ok() && scores.ok() && selected.ok() && miss_slots.ok() && miss_counts.ok() && counters.ok());
  CUDA_OK(cudaMemset(logits.get(), 0x7f, static_cast<std::size_t>(max_batch) * Hq * std::max(mc, 1) * sizeof(float)));
  CUDA_OK(cudaMemset(scores.get(), 0x7f, static_cast<std::size_t>(max_batch) * Hkv * std::max(mc, 1) * sizeof(float)));
  CUDA_OK(cudaMemset(selected.get(), 0x55, static_cast<std::size_t>(max_batch) * Hkv * k * sizeof(int)));
  CUDA_OK(cudaMemset(miss_slots.get(), 0x55, static_cast<std::size_t>(max_batch) * Hkv * k * sizeof(int)));
  CUDA_OK(cudaMemset(miss_counts.get(), 0x55, static_cast<std::size_t>(max_batch) * Hkv * sizeof(int)));
  const std::vector<unsigned long long> counters_start = {0, 0, 0, 777, 0};
  CUDA_OK(upload(counters, counters_start));
  step_workspace ws{};
  ws.logits = logits.get<float>();
  ws.scores = scores.get<float>();
  ws.selected = selected.get<int>();
  ws.miss_slots = miss_slots.get<int>();
  ws.miss_counts = miss_counts.get<int>();
  ws.counters = counters.get<unsigned long long>();
  ws.hinted_selections = ws.counters + 4;
  // The selection's own rows, as its query sizes them (poisoned too).
  const shadowkv::cuda::selection_workspace_bytes own = shadowkv::cuda::chunk_selection_workspace(d, cfg.kv_type,
                                                                                                  max_batch);
  device_buffer selection_partials(std::max<std::size_t>(own.partials, 1));
  device_buffer radix_keys(std::max<std::size_t>(own.radix_keys, 1));
  ASSERT_TRUE(selection_partials.ok() && radix_keys.ok());
  CUDA_OK(cudaMemset(selection_partials.get(), 0x7f, std::max<std::size_t>(own.partials, 1)));
  CUDA_OK(cudaMemset(radix_keys.get(), 0x55, std::max<std::size_t>(own.radix_keys, 1)));
  ws.selection_partials = selection_partials.get<float>();
  ws.radix_keys = own.radix_keys > 0 ? radix_keys.get<unsigned>() : nullptr;
  // The logits' tile pool: zero, and zero again after every launch.
  device_buffer claims(2 * sizeof(unsigned));
  ASSERT_TRUE(claims.ok());
  CUDA_OK(cudaMemset(claims.get(), 0, 2 * sizeof(unsigned)));
  ws.logits_claims = claims.get<unsigned>();
  // max_chunks = 70000 cannot keep its radix keys in shared memory on any device this runs on.
  if (mc >= 70000) EXPECT_GT(own.radix_keys, 0U) << "the radix keys should need the workspace at max_chunks " << mc;

  // Queries: buffer [Tq, B, Hq, D + pad] so that the strides are not those of a dense [B, Tq, Hq, D].
  const int padded_dim = D + 3;
  const std::size_t query_elements = static_cast<std::size_t>(Tq) * B * Hq * padded_dim;
  device_buffer queries_device(query_elements * element_bytes(cfg.q_type));
  ASSERT_TRUE(queries_device.ok());
  std::vector<float> q_first(static_cast<std::size_t>(Tq) * B * Hq * D);
  for (float& x : q_first) x = normal(rng) * cfg.query_scale;

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaGraphExec_t graph_exec = nullptr;
  unsigned long long expected_hits = 0;
  unsigned long long expected_misses = 0;
  std::size_t ambiguous = 0;
  std::size_t hits_seen = 0;

  for (int step = 0; step < cfg.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<float> q(q_first.size());
    for (std::size_t i = 0; i < q.size(); ++i) {
      float x = q_first[i];
      if (step >= 1) x = cfg.fresh_second ? normal(rng) * cfg.query_scale : x + 0.1F * cfg.query_scale * normal(rng);
      q[i] = round_through(cfg.q_type, x);
    }
    std::vector<unsigned char> q_bytes(query_elements * element_bytes(cfg.q_type), 0);
    for (int t = 0; t < Tq; ++t) {
      for (int b = 0; b < B; ++b) {
        for (int j = 0; j < Hq; ++j) {
          for (int x = 0; x < D; ++x) {
            const std::size_t dense = ((static_cast<std::size_t>(t) * B + b) * Hq + j) * D + x;
            const std::size_t strided = ((static_cast<std::size_t>(t) * B + b) * Hq + j) * padded_dim + x;
            store_element(cfg.q_type, q_bytes, strided, q[dense]);
          }
        }
      }
    }
    CUDA_OK(upload(queries_device, q_bytes));
    if (step == 1) {
      for (const host_entry& e : entries) {
        const std::size_t index = static_cast<std::size_t>(e.slot) * num_layers + layer;
        CUDA_OK(cudaMemcpy(views_device.get<unsigned char>() + index * sizeof(layer_view) + offsetof(layer_view, context_chunks),
                           &e.context[1], sizeof(int), cudaMemcpyHostToDevice));
      }
    }

    strided_tensor queries{};
    queries.data = queries_device.get();
    queries.type = cfg.q_type;
    queries.stride[0] = static_cast<long long>(Hq) * padded_dim;
    queries.stride[1] = static_cast<long long>(B) * Hq * padded_dim;
    queries.stride[2] = padded_dim;
    queries.stride[3] = 1;
    if (!cfg.graph) {
      ASSERT_NO_THROW(shadowkv::cuda::launch_select_chunks(d, cfg.kv_type, views_device.get<layer_view>(),
                                                            slots_device.get<int>(), layer, B, queries, Tq, ws,
                                                            cfg.beside, stream));
    } else {
      // One graph for all steps: the context length changes on the device only.
      if (step == 0) {
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        ASSERT_NO_THROW(shadowkv::cuda::launch_select_chunks(d, cfg.kv_type, views_device.get<layer_view>(),
                                                              slots_device.get<int>(), layer, B, queries, Tq, ws,
                                                              cfg.beside, stream));
        cudaGraph_t graph = nullptr;
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));
        CUDA_OK(cudaGraphDestroy(graph));
      }
      CUDA_OK(cudaGraphLaunch(graph_exec, stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<unsigned> claims_after;
    CUDA_OK(download(claims_after, ws.logits_claims, 2));
    EXPECT_EQ(claims_after[0], 0U) << "step " << step << ": the tile pool's claim counter was not reset";
    EXPECT_EQ(claims_after[1], 0U) << "step " << step << ": the tile pool's done counter was not reset";

    std::vector<float> gpu_scores_all;
    std::vector<int> gpu_selected_all;
    std::vector<int> gpu_miss_slots_all;
    std::vector<int> gpu_miss_counts;
    CUDA_OK(download(gpu_scores_all, ws.scores, static_cast<std::size_t>(B) * Hkv * mc));
    CUDA_OK(download(gpu_selected_all, ws.selected, static_cast<std::size_t>(B) * Hkv * k));
    CUDA_OK(download(gpu_miss_slots_all, ws.miss_slots, static_cast<std::size_t>(B) * Hkv * k));
    CUDA_OK(download(gpu_miss_counts, ws.miss_counts, static_cast<std::size_t>(B) * Hkv));

    for (int b = 0; b < B; ++b) {
      host_entry& e = entries[static_cast<std::size_t>(b)];
      const int n = e.context[std::min(step, 1)];
      std::vector<int> gpu_cache;
      std::vector<int> gpu_slot_of;
      std::vector<long long> gpu_last_used;
      std::vector<long long> gpu_clock;
      std::vector<int> gpu_selected_slots;
      CUDA_OK(download(gpu_cache, e.cache_device.get<int>(), e.cache.size()));
      CUDA_OK(download(gpu_slot_of, e.slot_of_device.get<int>(), e.slot_of.size()));
      if (lru) {
        CUDA_OK(download(gpu_last_used, e.last_used_device.get<long long>(), e.last_used.size()));
        CUDA_OK(download(gpu_clock, e.clock_device.get<long long>(), e.clock.size()));
        CUDA_OK(download(gpu_selected_slots, e.selected_slots_device.get<int>(), static_cast<std::size_t>(Hkv) * k));
      }
      for (int h = 0; h < Hkv; ++h) {
        SCOPED_TRACE("entry " + std::to_string(b) + " (slot " + std::to_string(e.slot) + ") head " +
                     std::to_string(h) + " context " + std::to_string(n));
        const std::size_t row = static_cast<std::size_t>(b) * Hkv + h;
        const std::vector<double> cpu = reference_scores(cfg, e, h, n, b, q, static_cast<double>(d.softmax_scale));
        std::vector<int> candidates;
        for (int c = 0; c < n; ++c) {
          if (cpu[static_cast<std::size_t>(c)] >= 0.0) candidates.push_back(c);
        }
        const int take = std::min(k, static_cast<int>(candidates.size()));
        std::vector<float> gpu(gpu_scores_all.begin() + static_cast<std::ptrdiff_t>(row * mc),
                               gpu_scores_all.begin() + static_cast<std::ptrdiff_t>(row * mc + n));

        // Scores.
        int score_errors = 0;
        for (int c : candidates) {
          const double expected = cpu[static_cast<std::size_t>(c)];
          const double got = gpu[static_cast<std::size_t>(c)];
          if (!(std::fabs(got - expected) <= tolerance(expected)) && ++score_errors <= 5) {
            ADD_FAILURE() << "score of chunk " << c << ": gpu " << got << " cpu " << expected;
          }
        }

        // Selection: ascending ids, -1 padding.
        const int* sel_begin = gpu_selected_all.data() + row * k;
        std::vector<int> sel(sel_begin, sel_begin + take);
        for (int i = take; i < k; ++i) ASSERT_EQ(sel_begin[i], -1) << "padding at " << i << " (take " << take << ")";
        ASSERT_TRUE(std::is_sorted(sel.begin(), sel.end()) &&
                    std::adjacent_find(sel.begin(), sel.end()) == sel.end())
            << "selection not strictly ascending";
        // Exactly the top-k of the GPU's own scores (radix select, tie order, compaction).
        ASSERT_EQ(sel, top_k(gpu, candidates, take));
        // Against float64: differences only at near-ties with the k-th score.
        const std::vector<int> expected_sel = top_k(cpu, candidates, take);
        if (sel != expected_sel) {
          std::vector<int> order = candidates;
          std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return cpu[static_cast<std::size_t>(x)] > cpu[static_cast<std::size_t>(y)]; });
          const double boundary = cpu[static_cast<std::size_t>(order[static_cast<std::size_t>(take - 1)])];
          std::vector<int> difference;
          std::set_symmetric_difference(sel.begin(), sel.end(), expected_sel.begin(), expected_sel.end(),
                                        std::back_inserter(difference));
          for (int c : difference) {
            EXPECT_LE(std::fabs(cpu[static_cast<std::size_t>(c)] - boundary), 2.0 * tolerance(boundary))
                << "chunk " << c << " selected differently and is no near-tie: score " << cpu[static_cast<std::size_t>(c)]
                << ", k-th score " << boundary;
          }
          ambiguous += difference.size();
        }
        // Planted exact ties.
        std::vector<char> is_selected(static_cast<std::size_t>(std::max(n, 1)), 0);
        for (int c : sel) is_selected[static_cast<std::size_t>(c)] = 1;
        for (const host_entry::tie& tie : e.ties) {
          if (tie.head != h || tie.second >= n) continue;
          if (cpu[static_cast<std::size_t>(tie.first)] < 0.0 || cpu[static_cast<std::size_t>(tie.second)] < 0.0) continue;
          EXPECT_EQ(gpu[static_cast<std::size_t>(tie.first)], gpu[static_cast<std::size_t>(tie.second)])
              << "copied landmark " << tie.second << " of " << tie.first << " scored differently";
          if (is_selected[static_cast<std::size_t>(tie.second)] != 0) {
            EXPECT_TRUE(is_selected[static_cast<std::size_t>(tie.first)] != 0)
                << "tie " << tie.first << " = " << tie.second << " broken towards the larger id";
          }
        }
        if (cfg.equal_landmarks) {
          EXPECT_EQ(sel, std::vector<int>(candidates.begin(), candidates.begin() + take));
        }

        // Cache rules applied to the GPU's selection.
        int* cache = e.cache.data() + static_cast<std::size_t>(h) * K;
        int* slot_of = e.slot_of.data() + static_cast<std::size_t>(h) * mc;
        int hits = 0;
        std::vector<int> expected_misses_list;
        std::vector<char> selected_now;
        if (lru) {
          const long long now = ++e.clock[static_cast<std::size_t>(h)];
          expected_misses_list = apply_lru_rule(sel, now, cache, slot_of,
                                                e.last_used.data() + static_cast<std::size_t>(h) * K, K, selected_now,
                                                hits);
        } else {
          for (int s = 0; s < k; ++s) {
            const int old = cache[s];
            if (old < 0) continue;
            if (old < n && is_selected[static_cast<std::size_t>(old)] != 0) {
              ++hits;
            } else {
              slot_of[old] = -1;
              cache[s] = -1;
            }
          }
          int free_slot = 0;
          for (int c : sel) {
            if (slot_of[c] >= 0) continue;
            while (cache[free_slot] >= 0) ++free_slot;
            cache[free_slot] = c;
            slot_of[c] = free_slot;
            expected_misses_list.push_back(free_slot);
          }
        }
        expected_hits += static_cast<unsigned long long>(hits);
        expected_misses += expected_misses_list.size();
        hits_seen += static_cast<std::size_t>(hits);
        ASSERT_EQ(hits + static_cast<int>(expected_misses_list.size()), take);
        ASSERT_EQ(gpu_miss_counts[row], static_cast<int>(expected_misses_list.size()));
        const std::vector<int> got_misses(gpu_miss_slots_all.begin() + static_cast<std::ptrdiff_t>(row * k),
                                          gpu_miss_slots_all.begin() + static_cast<std::ptrdiff_t>(row * k) +
                                              static_cast<std::ptrdiff_t>(expected_misses_list.size()));
        ASSERT_EQ(got_misses, expected_misses_list);
        for (std::size_t m = expected_misses_list.size(); m < static_cast<std::size_t>(k); ++m) {
          ASSERT_EQ(gpu_miss_slots_all[row * k + m], -1) << "miss list padding at " << m;
        }
        const std::vector<int> got_cache(gpu_cache.begin() + static_cast<std::ptrdiff_t>(h) * K,
                                         gpu_cache.begin() + static_cast<std::ptrdiff_t>(h + 1) * K);
        ASSERT_EQ(got_cache, std::vector<int>(cache, cache + K));
        const std::vector<int> got_slot_of(gpu_slot_of.begin() + static_cast<std::ptrdiff_t>(h) * mc,
                                           gpu_slot_of.begin() + static_cast<std::ptrdiff_t>(h + 1) * mc);
        ASSERT_EQ(got_slot_of, std::vector<int>(slot_of, slot_of + mc));

        // Invariants, on the device's state.
        std::vector<int> cached;
        for (int s = 0; s < K; ++s) {
          const int c = got_cache[static_cast<std::size_t>(s)];
          if (c < 0) continue;
          if (!lru || selected_now[static_cast<std::size_t>(s)] != 0) cached.push_back(c);
          ASSERT_TRUE(c < mc && got_slot_of[static_cast<std::size_t>(c)] == s) << "slot " << s << " holds " << c;
        }
        for (int c = 0; c < mc; ++c) {
          const int s = got_slot_of[static_cast<std::size_t>(c)];
          if (s >= 0) ASSERT_TRUE(s < K && got_cache[static_cast<std::size_t>(s)] == c) << "chunk " << c;
        }
        std::sort(cached.begin(), cached.end());
        ASSERT_EQ(cached, sel) << "cached (K > k: selected-now) chunks differ from the selected ones";
        if (lru) {
          const std::size_t first = static_cast<std::size_t>(h) * K;
          const std::vector<long long> got_stamps(gpu_last_used.begin() + static_cast<std::ptrdiff_t>(first),
                                                  gpu_last_used.begin() + static_cast<std::ptrdiff_t>(first + K));
          ASSERT_EQ(got_stamps, std::vector<long long>(e.last_used.begin() + static_cast<std::ptrdiff_t>(first),
                                                       e.last_used.begin() + static_cast<std::ptrdiff_t>(first + K)));
          ASSERT_EQ(gpu_clock[static_cast<std::size_t>(h)], e.clock[static_cast<std::size_t>(h)]);
          // The slots attention reads: this selection's, ascending, -1 padding to k.
          std::vector<int> expected_list;
          for (int s = 0; s < K; ++s) {
            if (selected_now[static_cast<std::size_t>(s)] != 0) expected_list.push_back(s);
          }
          expected_list.resize(static_cast<std::size_t>(k), -1);
          const std::vector<int> got_list(gpu_selected_slots.begin() + static_cast<std::ptrdiff_t>(h) * k,
                                          gpu_selected_slots.begin() + static_cast<std::ptrdiff_t>(h + 1) * k);
          ASSERT_EQ(got_list, expected_list);
        }
      }
    }
  }

  std::vector<unsigned long long> counters_end;
  CUDA_OK(download(counters_end, ws.counters, 5));
  EXPECT_EQ(counters_end[0], expected_hits);
  EXPECT_EQ(counters_end[1], expected_misses);
  EXPECT_EQ(counters_end[2], static_cast<unsigned long long>(cfg.steps) * static_cast<unsigned long long>(B));
  EXPECT_EQ(counters_end[3], 777ULL);
  if (hinted != nullptr) *hinted = counters_end[4];
  if (cfg.hints == 0) EXPECT_EQ(counters_end[4], 0ULL) << "a hint path without hints";
  std::printf("[ chunk_selection ]   hits %llu misses %llu, %zu selections differ from float64 at near-ties, %llu by "
              "the hint path\n",
              expected_hits, expected_misses, ambiguous, counters_end[4]);
  (void)hits_seen;
  if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaStreamDestroy(stream));
}

case_config random_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int> values) {
    std::vector<int> v(values);
    return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
  };
  case_config cfg;
  cfg.seed = seed;
  cfg.batch = pick({1, 2, 3, 4});
  cfg.kv_heads = pick({1, 2, 3, 5, 8});
  cfg.group = pick({1, 4});
  cfg.head_dim = pick({64, 128});
  cfg.kv_type = pick({0, 1, 2});
  cfg.q_type = pick({0, 1, 2});
  cfg.tokens = pick({1, 1, 1, 3});
  cfg.max_context = pick({0, 40, 300, 1500, 3000});
  cfg.max_chunks = cfg.max_context + pick({3, 17, 250});
  cfg.budget = pick({1, 5, 64, 256, 1024, 2048});
  cfg.max_outliers = pick({0, 4, 48});
  cfg.query_scale = static_cast<float>(pick({1, 2, 4, 8})) * 0.75F;
  cfg.tie_fraction = pick({0, 1, 3}) * 0.1;
  cfg.warm_cache = pick({0, 1}) != 0;
  cfg.fresh_second = pick({0, 0, 1}) != 0;
  return cfg;
}

class ChunkSelection : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!device_present()) GTEST_SKIP() << "no CUDA device: launch_select_chunks is not exercised";
  }
};

TEST_F(ChunkSelection, RandomConfigurations) {
  for (std::uint64_t i = 0; i < 24; ++i) {
    run_case(random_case(0x5e1ec7ULL + 7919ULL * i));
    if (HasFatalFailure()) return;
  }
}

// A cache larger than the budget (K = 2..4 x k slots, the LRU rule): contexts below, near and far above K chunks so
// that empty slots, hits of chunks selected several steps ago and evictions by age (ties to the lower index: warm
// caches draw stamps from a small range) all occur; 6 to 10 steps carry the state (stamps, clock) from step to step.
case_config random_lru_case(std::uint64_t seed) {
  case_config cfg = random_case(seed);
  std::mt19937_64 rng(seed ^ 0x1a2b3c4dULL);
  auto pick = [&](std::initializer_list<int> values) {
    std::vector<int> v(values);
    return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
  };
  cfg.budget = pick({1, 3, 8, 16, 64, 300});
  cfg.cache_slots = cfg.budget * pick({2, 3, 4});
  cfg.max_context = std::max(1, cfg.cache_slots * pick({1, 2, 2, 4, 8}) / 2);
  cfg.max_chunks = std::max(cfg.cache_slots, cfg.max_context + pick({3, 17, 250}));
  cfg.steps = pick({6, 8, 10});
  cfg.fresh_second = pick({0, 1}) != 0;
  return cfg;
}

TEST_F(ChunkSelection, LargerCacheRandomConfigurations) {
  for (std::uint64_t i = 0; i < 24; ++i) {
    run_case(random_lru_case(0x17a0ULL + 7919ULL * i));
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkSelection, ClustersRankLikeTheModel) {
  // The select kernel in the planner's clusters (select_cluster_kernel, plan_select_cluster: 8 CTAs a head when the
  // rows' clusters fit on the device at once, 4 where the GPCs hold fewer clusters of 8, else one CTA) that split the
  // chunks: contexts of a few thousand chunks (slices of several passes of 1024 threads; a cluster of 8 leaves the
  // last CTAs an empty slice at the shortest contexts), planted ties at the threshold, one and three query tokens, 6
  // and 15 rows (batch x KV heads), the default cache and one of 3 x the budget (run by the cluster's first CTA), a
  // graph replay.
  for (const int batch : {2, 5}) {
    for (const int tokens : {1, 3}) {
      case_config cfg;
      cfg.seed = 0xc105ULL + static_cast<std::uint64_t>(batch * 10 + tokens);
      cfg.batch = batch;
      cfg.kv_heads = 3;
      cfg.group = 4;
      cfg.head_dim = 128;
      cfg.max_chunks = 6000;
      cfg.max_context = 5500;
      cfg.budget = 300;
      cfg.max_outliers = 48;
      cfg.tokens = tokens;
      cfg.tie_fraction = 0.3;
      cfg.warm_cache = tokens == 1;
      run_case(cfg);
      if (HasFatalFailure()) return;
      cfg.cache_slots = 3 * cfg.budget;
      cfg.steps = 6;
      cfg.graph = tokens == 1;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(ChunkSelection, HintPathSelectsWhatTheFullRadixSelectDoes) {
  // A select cluster starts from the hint its previous selection left (select_kernel.cu): when more than k and at most
  // 2048 radix keys lie at or above it, it ranks those alone. Every step is checked against the model as in every
  // case; here the steps are many and close (each query a small perturbation of the last), so that the hint path runs,
  // with planted ties at the threshold, the default cache and one of 3 x the budget, a graph replay, budgets with
  // room for 2k keys under the 2048 and one without (1200), and random stale hints at the start. The planner puts
  // these 6 rows of 9000 chunks in clusters of 8 on an H100 or H200. With no hint array nothing takes the path. (At
  // k = 1200 the next hint's count, 2k, is past the 2048: the path runs only when the scores drop enough to bring it
  // under.)
  unsigned long long hinted_total = 0;
  for (const int budget : {64, 300, 1200}) {
    for (const int hints : {0, 1, 2}) {
      case_config cfg;
      cfg.seed = 0x4157ULL + static_cast<std::uint64_t>(8 * 100 + budget + hints);
      cfg.batch = 2;
      cfg.kv_heads = 3;
      cfg.group = 4;
      cfg.head_dim = 128;
      cfg.max_chunks = 9000;
      cfg.max_context = 8500;
      cfg.budget = budget;
      cfg.max_outliers = 48;
      cfg.tie_fraction = 0.3;
      cfg.warm_cache = true;
      cfg.steps = 5;
      cfg.hints = hints;
      unsigned long long hinted = 0;
      run_case(cfg, &hinted);
      if (HasFatalFailure()) return;
      if (hints == 0) EXPECT_EQ(hinted, 0ULL) << cfg.describe();
      if (hints == 1 && budget != 1200) {
        // Steps 2-4 at least of the entries with a context above 2k (the first step has no hint yet).
        EXPECT_GT(hinted, 0ULL) << cfg.describe() << ": the hint path never ran";
      }
      hinted_total += hinted;
      cfg.cache_slots = 3 * budget;
      cfg.graph = true;
      run_case(cfg, &hinted);
      if (HasFatalFailure()) return;
      if (hints == 0) EXPECT_EQ(hinted, 0ULL) << cfg.describe();
      hinted_total += hinted;
    }
  }
  std::printf("[ chunk_selection ] %llu selections by the hint path\n", hinted_total);
}

TEST_F(ChunkSelection, LargerCacheShapes) {
  // K above the 1024 threads of the select CTA (several slots a thread), K = max_chunks (the clamp), eviction keys
  // in the radix-key workspace (max_chunks 70000: the per-chunk keys do not fit in shared memory), several query tokens,
  // an empty context (every slot keeps its chunk, none is selected), and graph replays (the clock advances on the
  // device).
  case_config wide = random_lru_case(81);
  wide.budget = 700;
  wide.cache_slots = 2100;
  wide.max_context = 5000;
  wide.max_chunks = 5003;
  wide.warm_cache = true;
  run_case(wide);
  if (HasFatalFailure()) return;
  case_config full = random_lru_case(82);
  full.budget = 10;
  full.cache_slots = 40;
  full.max_context = 40;
  full.max_chunks = 40;
  run_case(full);
  if (HasFatalFailure()) return;
  for (int tokens : {1, 3}) {
    case_config large = random_lru_case(83 + tokens);
    large.batch = 2;
    large.kv_heads = 2;
    large.group = 4;
    large.head_dim = 64;
    large.max_chunks = 70000;
    large.max_context = 2500;
    large.budget = 300;
    large.cache_slots = 1200;
    large.tokens = tokens;
    large.warm_cache = true;
    run_case(large);
    if (HasFatalFailure()) return;
  }
  case_config empty = random_lru_case(86);
  empty.batch = 3;
  empty.max_context = 0;
  empty.max_chunks = 64;
  empty.budget = 8;
  empty.cache_slots = 32;
  empty.warm_cache = true;
  run_case(empty);
  if (HasFatalFailure()) return;
  for (int tokens : {1, 3}) {
    case_config graph = random_lru_case(87 + tokens);
    graph.batch = 2;
    graph.kv_heads = 2;
    graph.group = 4;
    graph.head_dim = 128;
    graph.max_chunks = 16384;
    graph.max_context = 3000;
    graph.budget = 64;
    graph.cache_slots = 256;
    graph.tokens = tokens;
    graph.fresh_second = true;
    graph.graph = true;
    run_case(graph);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkSelection, EqualLandmarksTieToSmallerIds) {
  case_config cfg = random_case(11);
  cfg.equal_landmarks = true;
  cfg.max_context = 900;
  cfg.max_chunks = 1000;
  cfg.budget = 100;
  run_case(cfg);
  cfg.tokens = 3;
  cfg.seed = 12;
  run_case(cfg);
}

TEST_F(ChunkSelection, EmptyContextFreesEverySlot) {
  case_config cfg;
  cfg.seed = 21;
  cfg.batch = 3;
  cfg.kv_heads = 2;
  cfg.group = 4;
  cfg.max_context = 0;
  cfg.max_chunks = 32;
  cfg.budget = 16;
  cfg.warm_cache = true;  // slots hold chunks that the empty context cannot select: all are freed
  run_case(cfg);
}

TEST_F(ChunkSelection, GroupsAndHeadDims) {
  // Head blocks of the logits kernel (G = 3 masked, G = 12 two blocks, G = 16 with one KV head), odd row sizes
  // (D = 80, D = 36 in f16: rows that are no multiple of 16 bytes), wide rows (D = 256 f32: 32 rows a tile, 4 threads
  // a row; D = 512 f32: 16 rows, more than 48 KiB of shared memory).
  const int shapes[][4] = {{3, 64, 2, 1}, {12, 128, 2, 2}, {16, 64, 1, 2}, {4, 80, 3, 2},
                           {4, 36, 2, 1}, {2, 256, 2, 0}, {8, 512, 1, 0}, {4, 96, 2, 0}};
  std::uint64_t seed = 31;
  for (const auto& shape : shapes) {
    for (int tokens : {1, 3}) {
      case_config cfg = random_case(seed);
      cfg.seed = seed++;
      cfg.group = shape[0];
      cfg.head_dim = shape[1];
      cfg.kv_heads = shape[2];
      cfg.kv_type = shape[3];
      cfg.tokens = tokens;
      cfg.batch = 2;
      cfg.max_context = 700;
      cfg.max_chunks = 777;
      cfg.budget = 64;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(ChunkSelection, SmallAndLargeChunkCapacity) {
  // max_chunks = 6 with G = 4: more tile partials (2 * G * tiles) than chunks (they once shared the scores rows and
  // fell back to slower modes; their own workspace rows now), one and three tokens.
  for (int tokens : {1, 3}) {
    case_config small = random_case(40 + tokens);
    small.group = 4;
    small.max_chunks = 6;
    small.max_context = 6;
    small.budget = 3;
    small.tokens = tokens;
    run_case(small);
  }
  // Per-chunk keys in shared memory with the opt-in limit: 8259 chunks (a 66072-token capacity at chunk 8: 33 KiB of
  // keys that with the kernel's 17 KiB of static arrays pass the 48 KiB default, the launch that failed at S = 65536),
  // and the largest count the old 8 KiB margin let through (its keys plus the static arrays exceed the opt-in limit,
  // so the keys move to the workspace).
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  for (const int chunks : {8259, (optin - 8 * 1024 - 256) / 4}) {
    for (int tokens : {1, 3}) {
      SCOPED_TRACE("max_chunks " + std::to_string(chunks) + ", tokens " + std::to_string(tokens));
      case_config mid = random_case(50 + tokens);
      mid.batch = 2;
      mid.kv_heads = 2;
      mid.group = 4;
      mid.head_dim = 64;
      mid.max_chunks = chunks;
      mid.max_context = 1200;
      mid.budget = 100;
      mid.tokens = tokens;
      run_case(mid);
    }
  }
  // max_chunks = 70000: the per-chunk keys do not fit in shared memory and live in the radix-key workspace.
  for (int tokens : {1, 3}) {
    case_config large = random_case(42 + tokens);
    large.batch = 2;
    large.kv_heads = 2;
    large.group = 4;
    large.head_dim = 64;
    large.max_chunks = 70000;
    large.max_context = 2500;
    large.budget = 300;
    large.tokens = tokens;
    run_case(large);
  }
}

TEST_F(ChunkSelection, LongRaggedContextsGiveEachCtaSeveralTiles) {
  // The decode logits kernel runs one wave of CTAs, each over a contiguous share of the batch's live tiles: with
  // contexts of up to 60000 chunks a share holds several tiles, crosses heads and sequences (q restaged within the
  // share) and ends inside partial tiles of ragged lengths. G = 8 also takes the 80-register instantiations.
  const int shapes[][3] = {{4, 128, 2}, {8, 64, 1}};  // group, head_dim, kv type (bf16, f16)
  std::uint64_t seed = 71;
  for (const auto& shape : shapes) {
    case_config cfg = random_case(seed);
    cfg.seed = seed++;
    cfg.batch = 4;
    cfg.kv_heads = 2;
    cfg.group = shape[0];
    cfg.head_dim = shape[1];
    cfg.kv_type = shape[2];
    cfg.tokens = 1;
    cfg.max_chunks = 60000;
    cfg.max_context = 60000;
    cfg.budget = 256;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkSelection, TensorCoreAndLaneLogitsBothMatchTheModel) {
  // bf16 landmark rows of 64 and 128 elements take the tensor-core decode logits (bulk-copied tiles, q in three bf16
  // terms, 16 rows a warp) where the planner finds at least 16 tiles a multiprocessor (launch_decode_landmark_logits:
  // here 3 x 2 x 469 tiles of 60000 chunks, on up to 175 multiprocessors), and the lanes' FMAs where it does not
  // (71 tiles of 9000 chunks). Each against the float64 model (scores within the tolerance, selections equal up to
  // near-ties, planted ties bit-equal and won by the smaller id): every group size of the head tiles (G = 3, 5 and 6
  // masked, G = 8 with two quads of heads), float32 and bf16 queries, long ragged contexts whose CTAs cross heads and
  // sequences and end inside partial batches.
  const int shapes[][3] = {{1, 64, 0}, {2, 128, 2}, {3, 128, 0}, {4, 128, 0}, {4, 64, 2}, {5, 128, 0},
                           {6, 64, 0}, {8, 128, 2}};  // group, head_dim, query type
  std::uint64_t seed = 97;
  for (const auto& shape : shapes) {
    for (const int max_chunks : {60000, 9000}) {
      case_config cfg = random_case(seed);
      cfg.seed = seed++;
      cfg.batch = 3;
      cfg.kv_heads = 2;
      cfg.group = shape[0];
      cfg.head_dim = shape[1];
      cfg.kv_type = shadowkv::cuda::element_bf16;
      cfg.q_type = shape[2];
      cfg.tokens = 1;
      cfg.max_chunks = max_chunks;
      cfg.max_context = 9000;
      cfg.budget = 256;
      cfg.tie_fraction = 0.2;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(ChunkSelection, TensorCoreTileSharesCrossHeadsAndEmptyEntries) {
  // The tensor-core decode logits' shares of many tiles a CTA that cross heads and entries: 132 CTAs (a launch beside
  // 250 others) over ~1500 live tiles of 16 ragged entries, two heads each (the planner's tensor cores: 16 x 2 x 94
  // tiles), with empty entries between full ones (one alone, two side by side, the first), so that thread 0's
  // descriptors inside the tile loop (not only the first ones, a lane each) land on every kind of boundary.
  std::uint64_t seed = 811;
  for (const unsigned empty : {0x188U, 0x1U | 0x6000U}) {
    case_config cfg = random_case(seed);
    cfg.seed = seed++;
    cfg.batch = 16;
    cfg.kv_heads = 2;
    cfg.group = 4;
    cfg.head_dim = 128;
    cfg.kv_type = shadowkv::cuda::element_bf16;
    cfg.tokens = 1;
    cfg.max_chunks = 12000;
    cfg.max_context = 12000;
    cfg.budget = 256;
    cfg.beside = 250;
    cfg.empty_entries = empty;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkSelection, PooledLogitTilesMatchTheModel) {
  // A launch beside another kernel (beside_ctas > 0) takes half of the decode logits' tiles in fixed shares and the
  // rest from the pool, kClaimTiles at a time; every tile must still be computed once, whichever CTA claims it: long
  // ragged contexts (claims that cross heads and sequences, CTAs with no fixed tile), tensor cores (60000 chunks of
  // capacity: 4 x 2 x 469 tiles) and FMA lanes (9000: 4 x 2 x 71), a graph replayed for both steps (the counters
  // reset by the last CTA).
  std::uint64_t seed = 301;
  for (const int max_chunks : {60000, 9000}) {
    for (const int beside : {40, 250}) {
      for (const bool graph : {false, true}) {
        case_config cfg = random_case(seed);
        cfg.seed = seed++;
        cfg.batch = 4;
        cfg.kv_heads = 2;
        cfg.group = 4;
        cfg.head_dim = 128;
        cfg.kv_type = shadowkv::cuda::element_bf16;
        cfg.tokens = 1;
        cfg.max_chunks = max_chunks;
        cfg.max_context = 9000;
        cfg.budget = 256;
        cfg.beside = beside;
        cfg.graph = graph;
        run_case(cfg);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(ChunkSelection, BudgetBeyondCandidates) {
  case_config cfg = random_case(51);
  cfg.max_context = 200;
  cfg.max_chunks = 260;
  cfg.budget = 1024;  // more slots than candidates: every candidate is selected
  cfg.warm_cache = true;
  run_case(cfg);
}

// What the planner asks the device (select_clusters_at_once): at least one cluster of each size, and no more than
// the multiprocessors hold at one CTA an SM.
TEST_F(ChunkSelection, ClustersAtOnceIsWhatTheMultiprocessorsHold) {
  int multiprocessors = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (const int cluster : {2, 4, 8}) {
    const int at_once = shadowkv::cuda::selection::select_clusters_at_once(cluster);
    EXPECT_GE(at_once, 1) << "cluster " << cluster;
    EXPECT_LE(at_once, multiprocessors / cluster) << "cluster " << cluster;
  }
  EXPECT_THROW(shadowkv::cuda::selection::select_clusters_at_once(3), std::invalid_argument);
}

TEST_F(ChunkSelection, CapturedInGraph) {
  // max_chunks = 16384: the select kernel needs > 48 KiB of dynamic shared memory, raised while capturing.
  for (int tokens : {1, 3}) {
    case_config cfg = random_case(61 + tokens);
    cfg.batch = 2;
    cfg.kv_heads = 2;
    cfg.group = 4;
    cfg.head_dim = 128;
    cfg.max_chunks = 16384;
    cfg.max_context = 3000;
    cfg.budget = 256;
    cfg.tokens = tokens;
    cfg.graph = true;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

TEST_F(ChunkSelection, TwoCentroidScores) {
  // Two-centroid logits (dims::chunk_centroids) through both logit kernels: one query token takes the streaming decode
  // kernel (landmark_logits.cu) where it covers the shape (rows of 2 * D = 128, 256 or 512 code bytes, G <= 8), the
  // tiled kernel (selection/landmark_scoring.cu) otherwise: two tokens, D = 80 and 96 (rows of 160 and 192 bytes, the
  // decode kernel's fallback) and G = 12. The landmarks' type plays no part in the codes (the tiled kernel still
  // dispatches on it).
  const int bf16 = shadowkv::cuda::element_bf16;
  const int f32 = shadowkv::cuda::element_f32;
  const int f16 = shadowkv::cuda::element_f16;
  const int shapes[][5] = {  // group, head_dim, kv heads, kv type, batch
      {1, 64, 3, bf16, 4}, {2, 128, 2, f32, 3}, {4, 256, 1, bf16, 2}, {8, 128, 2, bf16, 1}, {8, 64, 1, f32, 2},
      {1, 256, 2, f32, 3}, {2, 64, 1, f16, 4},  {4, 80, 2, f32, 2},   {2, 96, 3, bf16, 1},  {12, 64, 1, bf16, 2}};
  std::uint64_t seed = 0xce27;
  for (const auto& shape : shapes) {
    for (int tokens : {1, 2}) {
      case_config cfg = random_case(seed);
      cfg.seed = seed++;
      cfg.two_centroids = true;
      cfg.group = shape[0];
      cfg.head_dim = shape[1];
      cfg.kv_heads = shape[2];
      cfg.kv_type = shape[3];
      cfg.batch = shape[4];
      cfg.tokens = tokens;
      cfg.max_context = 300;
      cfg.max_chunks = 333;
      cfg.budget = std::min(cfg.budget, 64);  // 1, 5 or 64 of up to 300 chunks
      cfg.warm_cache = cfg.seed % 2 == 0;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
  // Several tiles a head (700 chunks: 6 of the decode kernel's 128-chunk tiles at 256-byte rows, 11 of 64 at 512),
  // and contexts up to the capacity (max_context = max_chunks: a last tile that ends at max_chunks).
  const int long_shapes[][6] = {  // group, head_dim, kv heads, kv type, batch, max_chunks (= max_context)
      {4, 128, 3, bf16, 4, 700}, {2, 256, 2, f32, 3, 700}, {4, 128, 2, bf16, 2, 3000}, {2, 256, 2, f32, 2, 3000}};
  for (const auto& shape : long_shapes) {
    for (int tokens : {1, 2}) {
      case_config cfg = random_case(seed);
      cfg.seed = seed++;
      cfg.two_centroids = true;
      cfg.group = shape[0];
      cfg.head_dim = shape[1];
      cfg.kv_heads = shape[2];
      cfg.kv_type = shape[3];
      cfg.batch = shape[4];
      cfg.max_chunks = shape[5];
      cfg.max_context = shape[5];
      cfg.tokens = tokens;
      cfg.budget = 64;
      cfg.warm_cache = tokens == 1;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
  // More live tiles than the decode kernel's one wave of CTAs (a few an SM: about 500 on an H200): 12 heads of up to
  // 313 tiles of 128 chunks, about 1900 live, so a CTA's share holds several tiles and crosses heads and sequences.
  {
    case_config cfg = random_case(seed);
    cfg.seed = seed++;
    cfg.two_centroids = true;
    cfg.batch = 4;
    cfg.kv_heads = 3;
    cfg.group = 2;
    cfg.head_dim = 64;
    cfg.kv_type = bf16;
    cfg.tokens = 1;
    cfg.max_chunks = 40000;
    cfg.max_context = 40000;
    cfg.budget = 256;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
  // Captured once in a CUDA graph and replayed (the context grows on the device only).
  for (int tokens : {1, 2}) {
    case_config cfg = random_case(seed);
    cfg.seed = seed++;
    cfg.two_centroids = true;
    cfg.batch = 2;
    cfg.kv_heads = 2;
    cfg.group = 4;
    cfg.head_dim = 128;
    cfg.kv_type = bf16;
    cfg.tokens = tokens;
    cfg.max_chunks = 4096;
    cfg.max_context = 3000;
    cfg.budget = 256;
    cfg.fresh_second = true;
    cfg.graph = true;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
  // Every chunk the same (codes, scales and n1): equal scores, the smallest ids win.
  for (int tokens : {1, 2}) {
    case_config cfg = random_case(seed);
    cfg.seed = seed++;
    cfg.two_centroids = true;
    cfg.equal_landmarks = true;
    cfg.group = 2;
    cfg.head_dim = 128;
    cfg.tokens = tokens;
    cfg.max_context = 900;
    cfg.max_chunks = 1000;
    cfg.budget = 100;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
  // A cache larger than the budget (the LRU rule) over several steps: the selection after the logits is unchanged.
  {
    case_config cfg = random_lru_case(seed);
    cfg.seed = seed++;
    cfg.two_centroids = true;
    cfg.tokens = 1;
    run_case(cfg);
  }
}

// The planner's shapes for a Llama-3-8B layer at 122880 tokens: 8 KV heads of 4 query heads, chunks of 8, a budget
// of 256 chunks and as many cache slots.
dims llama_122k_select_dims() {
  dims d{};
  d.kv_heads = 8;
  d.group = 4;
  d.budget = 256;
  d.cache_slots = 256;
  d.max_chunks = 15360;  // 122880 tokens of chunk 8
  return d;
}

// Argument checks happen before any CUDA call, so they run without a device too.
// The select clusters keep their slices' radix keys, and the first CTA the head's cache, in shared memory
// (selection_plan.cuh, cluster_shared_layout): the planner takes a cluster only where that fits beside the kernel's
// static arrays, and the layout's parts do not overlap.
TEST(SelectClusterPlan, TakesAClusterOnlyWhereItsSharedMemoryFits) {
  namespace sel = shadowkv::cuda::selection;
  dims d = llama_122k_select_dims();
  const sel::device_limits h200{227 * 1024, 132};
  const long long room = h200.optin_shared - sel::kClusterStaticShared;
  EXPECT_EQ(sel::plan_select_cluster(d, 1, h200, true), 8);
  const sel::cluster_shared_layout layout = sel::cluster_shared_layout_for(d, 8);
  EXPECT_LE(layout.bytes, room);
  EXPECT_GE(static_cast<long long>(layout.slice_capacity) * 8, d.max_chunks);
  EXPECT_EQ(layout.slice_capacity % 32, 0);
  EXPECT_GE(layout.slice_keys, 4LL * d.group);
  EXPECT_GE(layout.cache_chunks, layout.slice_keys + 4LL * layout.slice_capacity);
  EXPECT_GE(layout.selected_ids, layout.cache_chunks + 4LL * d.budget);
  EXPECT_GE(layout.free_slots, layout.selected_ids + 4LL * d.budget);
  EXPECT_GE(layout.miss_chunks, layout.free_slots + 4LL * d.budget);
  EXPECT_GE(layout.selected_bits, layout.miss_chunks + 4LL * d.budget);
  EXPECT_GE(layout.cached_bits, layout.selected_bits + 4LL * layout.bitmap_words);
  EXPECT_GE(layout.bytes, layout.cached_bits + 4LL * layout.bitmap_words);
  EXPECT_GE(32LL * layout.bitmap_words, d.max_chunks);
  // K > k: no cache state in shared memory, only the slices.
  dims lru = d;
  lru.cache_slots = 512;
  EXPECT_EQ(sel::cluster_shared_layout_for(lru, 8).bitmap_words, 0);
  EXPECT_LT(sel::cluster_shared_layout_for(lru, 8).bytes, layout.bytes);
  // 4M tokens: the slices of 8 CTAs no longer fit, so one CTA a head.
  d.max_chunks = 1 << 19;
  EXPECT_GT(sel::cluster_shared_layout_for(d, 8).bytes, room);
  EXPECT_EQ(sel::plan_select_cluster(d, 1, h200, true), 1);
}

// A cluster sits in one GPC, so the device may hold fewer clusters of 8 at once than multiprocessors / 8: then the
// planner does not take clusters of 8 whose rows would wait for a second wave, but clusters of 4 where those fit.
TEST(SelectClusterPlan, TakesClustersOfEightOnlyWhereTheGpcsHoldThemAllAtOnce) {
  namespace sel = shadowkv::cuda::selection;
  dims d = llama_122k_select_dims();
  sel::device_limits limits{227 * 1024, 132, {0, 0}};  // not known: 132 / 8 = 16 clusters of 8, 33 of 4
  EXPECT_EQ(sel::resident_clusters(limits, 8), 16);
  EXPECT_EQ(sel::resident_clusters(limits, 4), 33);
  EXPECT_EQ(sel::plan_select_cluster(d, 1, limits, true), 8);
  EXPECT_EQ(sel::plan_select_cluster(d, 2, limits, true), 8);   // 16 rows
  EXPECT_EQ(sel::plan_select_cluster(d, 3, limits, true), 1);   // 24 x 8 CTAs > 132
  limits.clusters_at_once[1] = 16;
  limits.clusters_at_once[0] = 32;
  EXPECT_EQ(sel::plan_select_cluster(d, 2, limits, true), 8);
  limits.clusters_at_once[1] = 15;  // a GPC of fewer than 16 SMs
  EXPECT_EQ(sel::resident_clusters(limits, 8), 15);
  EXPECT_EQ(sel::plan_select_cluster(d, 1, limits, true), 8);
  EXPECT_EQ(sel::plan_select_cluster(d, 2, limits, true), 4);
  limits.clusters_at_once[0] = 15;  // nor clusters of 4: one CTA a head
  EXPECT_EQ(sel::plan_select_cluster(d, 2, limits, true), 1);
}

TEST(ChunkSelectionArguments, RejectsInvalidArguments) {
  dims d{};
  d.num_layers = 1;
  d.q_heads = 4;
  d.kv_heads = 2;
  d.group = 2;
  d.head_dim = 64;
  d.budget = 8;
  d.cache_slots = 8;
  d.max_chunks = 16;
  strided_tensor q{};
  q.type = shadowkv::cuda::element_f32;
  const step_workspace ws{};
  EXPECT_NO_THROW(shadowkv::cuda::launch_select_chunks(d, 0, nullptr, nullptr, 0, 0, q, 1, ws, 0, nullptr));
  // No tile-partial rows in the workspace (not sized by chunk_selection_workspace): a clear error, nothing launched.
  EXPECT_THROW(shadowkv::cuda::launch_select_chunks(d, 0, nullptr, nullptr, 0, 1, q, 1, ws, 0, nullptr),
               shadowkv::invalid_argument);
  EXPECT_THROW(shadowkv::cuda::launch_select_chunks(d, 0, nullptr, nullptr, 0, 1, q, 0, ws, 0, nullptr),
               shadowkv::invalid_argument);
  dims bad = d;
  bad.q_heads = 5;
  EXPECT_THROW(shadowkv::cuda::launch_select_chunks(bad, 0, nullptr, nullptr, 0, 1, q, 1, ws, 0, nullptr),
               shadowkv::invalid_argument);
  q.type = 7;
  EXPECT_THROW(shadowkv::cuda::launch_select_chunks(d, 0, nullptr, nullptr, 0, 1, q, 1, ws, 0, nullptr),
               shadowkv::invalid_argument);
  q.type = shadowkv::cuda::element_f32;
  EXPECT_THROW(shadowkv::cuda::launch_select_chunks(d, 9, nullptr, nullptr, 0, 1, q, 1, ws, 0, nullptr),
               shadowkv::invalid_argument);
  for (const int slots : {0, 7, 17}) {  // below the budget, or a larger cache than max_chunks
    dims bad_cache = d;
    bad_cache.cache_slots = slots;
    EXPECT_THROW(shadowkv::cuda::launch_select_chunks(bad_cache, 0, nullptr, nullptr, 0, 1, q, 1, ws, 0, nullptr),
                 shadowkv::invalid_argument)
        << "cache_slots " << slots;
  }
}

}  // namespace
