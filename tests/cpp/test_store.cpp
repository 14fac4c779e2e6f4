// kv_store on every backend (shadowkv/store.hpp, docs/semantics.md): each suite is instantiated for the CPU backend and
// for the CUDA backend, whose instances skip where the build has no CUDA backend or no GPU is visible
// (backend_test_support.hpp):
//  * full rank + full budget + float32 storage == float64 full attention written here, over 40 decode steps with
//    folds, for MHA/GQA/MQA, head_dim 64 and 128, ragged batches, explicit positions, both RoPE styles;
//  * the selection and the outliers follow the landmark scores of docs/semantics.md;
//  * every rejected call throws the documented type and leaves the store exactly as a twin that never saw it;
//  * capacity (max_batch, max_seq_len), memory() against the formulas of docs/semantics.md, stats();
//  * a batch prefill of ragged prompts equals prefilling each sequence alone (both factorisations);
//  * two stores driven from two threads at once give what each gives alone (CUDA: they share the device's handles).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "shadowkv/config.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/rope.hpp"
#include "shadowkv/store.hpp"
#include "shadowkv/tensor_view.hpp"
#include "backend_test_support.hpp"
#include "store_test_support.hpp"

namespace {

using shadowkv::config;
using shadowkv::decode_options;
using shadowkv::dtype;
using shadowkv::factorization_method;
using shadowkv::group_combine;
using shadowkv::group_score_name;
using shadowkv::kv_store;
using shadowkv::memory_report;
using shadowkv::mutable_tensor_view;
using shadowkv::prefill_options;
using shadowkv::rope_rotation;
using shadowkv::rope_style;
using shadowkv::sequence_info;
using shadowkv::store_stats;
using shadowkv::tensor_view;

using shape_list = std::initializer_list<std::int64_t>;

// ---------------------------------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------------------------------

// Seeded normals, norms: shared with the reliability tests. Tensors reach the store through `mem`
// (backend_test_support.hpp), in the memory of the backend under test.
using shadowkv_test::all_backends;
using shadowkv_test::all_finite;
using shadowkv_test::backend_case;
using shadowkv_test::backend_memory;
using shadowkv_test::backend_name;
using shadowkv_test::backend_test;
using shadowkv_test::norm;
using shadowkv_test::random_source;

std::vector<int> slot_list(std::initializer_list<int> slots) { return std::vector<int>(slots); }

// Exact (float64) attention over every token a sequence has seen in one layer.
struct reference_sequence {
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<float> keys;    // post-RoPE [T, Hkv, D], exactly as the store was given / computed them
  std::vector<float> values;  // [T, Hkv, D]

  [[nodiscard]] std::int64_t width() const { return static_cast<std::int64_t>(kv_heads) * head_dim; }
  [[nodiscard]] std::int64_t length() const { return static_cast<std::int64_t>(keys.size()) / width(); }

  void append(const float* key, const float* value) {
    keys.insert(keys.end(), key, key + width());
    values.insert(values.end(), value, value + width());
  }

  // q [Hq, D] -> out [Hq, D]; query head j reads KV head j / G.
  [[nodiscard]] std::vector<double> attend(const float* q, int q_heads, double scale) const {
    const int group = q_heads / kv_heads;
    const std::int64_t tokens = length();
    std::vector<double> out(static_cast<std::size_t>(q_heads) * head_dim, 0.0);
    std::vector<double> logits(static_cast<std::size_t>(tokens));
    for (int j = 0; j < q_heads; ++j) {
      const int h = j / group;
      double largest = -std::numeric_limits<double>::infinity();
      for (std::int64_t t = 0; t < tokens; ++t) {
        const float* key = keys.data() + t * width() + static_cast<std::int64_t>(h) * head_dim;
        double dot = 0.0;
        for (int d = 0; d < head_dim; ++d) dot += static_cast<double>(q[j * head_dim + d]) * key[d];
        logits[static_cast<std::size_t>(t)] = scale * dot;
        largest = std::max(largest, logits[static_cast<std::size_t>(t)]);
      }
      double total = 0.0;
      for (double& l : logits) total += (l = std::exp(l - largest));
      for (std::int64_t t = 0; t < tokens; ++t) {
        const float* value = values.data() + t * width() + static_cast<std::int64_t>(h) * head_dim;
        const double w = logits[static_cast<std::size_t>(t)] / total;
        for (int d = 0; d < head_dim; ++d) out[static_cast<std::size_t>(j * head_dim + d)] += w * value[d];
      }
    }
    return out;
  }
};

void expect_same_memory(const memory_report& a, const memory_report& b) {
  EXPECT_EQ(a.low_rank_factors, b.low_rank_factors);
  EXPECT_EQ(a.landmarks, b.landmarks);
  EXPECT_EQ(a.outliers, b.outliers);
  EXPECT_EQ(a.exact_tokens, b.exact_tokens);
  EXPECT_EQ(a.value_store, b.value_store);
  EXPECT_EQ(a.selection_cache, b.selection_cache);
  EXPECT_EQ(a.fold_journal, b.fold_journal);
  EXPECT_EQ(a.full_attention_equivalent, b.full_attention_equivalent);
}

void expect_same_stats(const store_stats& a, const store_stats& b) {
  EXPECT_EQ(a.decode_steps, b.decode_steps);
  EXPECT_EQ(a.selections, b.selections);
  EXPECT_EQ(a.hits, b.hits);
  EXPECT_EQ(a.misses, b.misses);
  EXPECT_EQ(a.chunks_rebuilt, b.chunks_rebuilt);
  EXPECT_EQ(a.bytes_fetched, b.bytes_fetched);
  EXPECT_EQ(a.folds, b.folds);
}

void expect_same_info(const sequence_info& a, const sequence_info& b) {
  EXPECT_EQ(a.prefilled, b.prefilled);
  EXPECT_EQ(a.prompt_len, b.prompt_len);
  EXPECT_EQ(a.total_len, b.total_len);
  EXPECT_EQ(a.context_chunks, b.context_chunks);
  EXPECT_EQ(a.outlier_chunks, b.outlier_chunks);
  EXPECT_EQ(a.local_len, b.local_len);
  EXPECT_EQ(a.generated_exact_len, b.generated_exact_len);
  EXPECT_EQ(a.last_position, b.last_position);
}

// Folds after `steps` decode steps with window W and chunk C (docs/semantics.md, decode step 1).
struct fold_count {
  std::int64_t folds = 0;
  std::int64_t generated_exact = 0;
};
fold_count simulate_folds(std::int64_t steps, std::int64_t window, std::int64_t chunk) {
  fold_count result;
  for (std::int64_t s = 0; s < steps; ++s) {
    if (result.generated_exact == window) {
      result.folds += 1;
      result.generated_exact -= chunk;
    }
    result.generated_exact += 1;
  }
  return result;
}

// ---------------------------------------------------------------------------------------------------------------
// full rank + full budget == full attention
// ---------------------------------------------------------------------------------------------------------------

struct equivalence_case {
  const char* name;
  int q_heads;
  int kv_heads;
  int head_dim;
  std::int64_t len0;  // two ragged prompts in one batch
  std::int64_t len1;
  rope_style rope;
  int rotary_dim;
  factorization_method factorization;
  int num_layers;
  std::int64_t position_offset;  // > 0: explicit positions starting there
  bool prefill_post_rope;        // give the store post-RoPE prompt keys
  bool decode_pre_rope;          // give the store pre-RoPE k_new
  float attention_scaling;
  std::uint64_t seed;
};

void PrintTo(const equivalence_case& c, std::ostream* os) { *os << c.name << " (seed " << c.seed << ")"; }

class FullAttentionEquivalence : public backend_test<std::tuple<backend_case, equivalence_case>> {};

TEST_P(FullAttentionEquivalence, DecodeEqualsFloat64FullAttention) {
  const equivalence_case& p = std::get<1>(GetParam());
  SCOPED_TRACE(std::string(p.name) + " seed=" + std::to_string(p.seed));
  const std::int64_t steps = 40;
  const std::int64_t longest = std::max(p.len0, p.len1);

  config cfg;
  cfg.num_layers = p.num_layers;
  cfg.num_q_heads = p.q_heads;
  cfg.num_kv_heads = p.kv_heads;
  cfg.head_dim = p.head_dim;
  cfg.max_batch = 2;
  cfg.max_seq_len = longest + steps + 8;
  cfg.rope = p.rope;
  cfg.rotary_dim = p.rotary_dim;
  cfg.attention_scaling = p.attention_scaling;
  cfg.rank = p.kv_heads * p.head_dim;  // full rank
  cfg.chunk_size = 8;
  cfg.local_chunks = 2;
  cfg.outlier_chunks = 2;
  cfg.generation_window = 16;  // folds every 8 steps after the first 16
  cfg.budget = ((longest + steps) / cfg.chunk_size + 1) * cfg.chunk_size;  // covers every chunk
  cfg.factorization = p.factorization;
  cfg.kv_dtype = dtype::float32;
  ASSERT_NO_THROW(cfg.validate());

  kv_store store(cfg, where());
  const std::vector<int> slots = store.add_sequences(2);
  ASSERT_EQ(slots, slot_list({0, 1}));
  const rope_rotation rope(cfg);
  const double scale = cfg.effective_softmax_scale();
  const std::int64_t heads = p.kv_heads;
  const std::int64_t dim = p.head_dim;
  const std::int64_t width = heads * dim;
  const std::int64_t lengths[2] = {p.len0, p.len1};
  random_source rng(p.seed);

  // refs[layer][b]
  std::vector<std::vector<reference_sequence>> refs(
      static_cast<std::size_t>(p.num_layers), std::vector<reference_sequence>(2, reference_sequence{p.kv_heads, p.head_dim, {}, {}}));

  for (int layer = 0; layer < p.num_layers; ++layer) {
    std::vector<float> keys_pre = rng.normals(static_cast<std::size_t>(2 * longest * width));
    std::vector<float> values = rng.normals(static_cast<std::size_t>(2 * longest * width));
    // A shared per-channel offset, as real keys have; it makes attention non-uniform.
    const std::vector<float> channel_mean = rng.normals(static_cast<std::size_t>(width), 0.5F);
    std::vector<std::int64_t> positions(static_cast<std::size_t>(2 * longest), -7);
    std::vector<float> keys_post = keys_pre;
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t t = 0; t < longest; ++t) {
        float* pre = keys_pre.data() + (b * longest + t) * width;
        float* post = keys_post.data() + (b * longest + t) * width;
        float* value = values.data() + (b * longest + t) * width;
        if (t >= lengths[b]) {  // right padding: the store must never read it
          std::fill(pre, pre + width, std::numeric_limits<float>::quiet_NaN());
          std::fill(post, post + width, std::numeric_limits<float>::quiet_NaN());
          std::fill(value, value + width, std::numeric_limits<float>::quiet_NaN());
          continue;
        }
        const std::int64_t position = p.position_offset + t;
        positions[static_cast<std::size_t>(b * longest + t)] = position;
        for (std::int64_t j = 0; j < width; ++j) pre[j] += channel_mean[static_cast<std::size_t>(j)];
        std::copy(pre, pre + width, post);
        for (std::int64_t h = 0; h < heads; ++h) rope.apply(post + h * dim, position);
        refs[static_cast<std::size_t>(layer)][static_cast<std::size_t>(b)].append(post, value);
      }
    }
    prefill_options options;
    options.lengths = {p.len0, p.len1};
    options.keys_post_rope = p.prefill_post_rope;
    if (p.position_offset > 0) options.positions = mem.index_view_of(positions, {2, longest});
    const std::vector<float>& given = p.prefill_post_rope ? keys_post : keys_pre;
    store.prefill(layer, slots, mem.view_of(given, {2, longest, heads, dim}),
                  mem.view_of(values, {2, longest, heads, dim}), options);
  }
  EXPECT_EQ(store.info(0, 1).prompt_len, p.len1);

  // CUDA: the keys are factorised through a float32 Gram matrix and eigensolver and rebuilt by float32 (3xTF32) GEMMs,
  // and attention accumulates in float32, where the CPU backend keeps float64 in places.
  const double tolerance = on_cuda() ? 2e-4 : 5e-5;
  double worst = 0.0;
  for (std::int64_t step = 0; step < steps; ++step) {
    for (int layer = 0; layer < p.num_layers; ++layer) {
      SCOPED_TRACE("step=" + std::to_string(step) + " layer=" + std::to_string(layer));
      const std::vector<float> q = rng.normals(static_cast<std::size_t>(2 * p.q_heads * dim));
      std::vector<float> k_pre = rng.normals(static_cast<std::size_t>(2 * width));
      const std::vector<float> v = rng.normals(static_cast<std::size_t>(2 * width));
      std::vector<float> k_post = k_pre;
      std::vector<std::int64_t> positions(2);
      for (std::int64_t b = 0; b < 2; ++b) {
        positions[static_cast<std::size_t>(b)] = p.position_offset + lengths[b] + step;
        for (std::int64_t h = 0; h < heads; ++h) rope.apply(k_post.data() + b * width + h * dim, positions[static_cast<std::size_t>(b)]);
      }
      decode_options options;
      options.keys_post_rope = !p.decode_pre_rope;
      // With an offset, give positions on even steps and rely on "last position + 1" on odd ones.
      if (p.position_offset > 0 && step % 2 == 0) options.positions = mem.index_view_of(positions, {2});
      std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
      store.decode(layer, slots, mem.view_of(q, {2, p.q_heads, dim}),
                   mem.view_of(p.decode_pre_rope ? k_pre : k_post, {2, heads, dim}), mem.view_of(v, {2, heads, dim}),
                   mem.mutable_view_of(out, {2, p.q_heads, dim}), options);
      ASSERT_TRUE(all_finite(out));
      EXPECT_GT(norm(out), 0.1) << "output must be non-trivial";
      for (std::int64_t b = 0; b < 2; ++b) {
        reference_sequence& ref = refs[static_cast<std::size_t>(layer)][static_cast<std::size_t>(b)];
        ref.append(k_post.data() + b * width, v.data() + b * width);
        const std::vector<double> expected = ref.attend(q.data() + b * p.q_heads * dim, p.q_heads, scale);
        for (std::size_t i = 0; i < expected.size(); ++i) {
          const double error = std::fabs(out[static_cast<std::size_t>(b * p.q_heads * dim) + i] - expected[i]);
          worst = std::max(worst, error);
          ASSERT_LT(error, tolerance) << "b=" << b << " element " << i << ": store "
                                 << out[static_cast<std::size_t>(b * p.q_heads * dim) + i] << " vs full attention "
                                 << expected[i];
        }
      }
    }
  }
  {
    std::ostringstream text;
    text << std::scientific << worst;
    RecordProperty("max_abs_error", text.str());
  }

  // Counters after the run: every sequence and layer folded as docs/semantics.md says, and with a full budget
  // every non-outlier context chunk is selected.
  const fold_count folds = simulate_folds(steps, cfg.generation_window, cfg.chunk_size);
  ASSERT_GT(folds.folds, 0);
  EXPECT_EQ(store.stats().folds, folds.folds * 2 * p.num_layers);
  EXPECT_EQ(store.stats().decode_steps, steps * p.num_layers);
  for (int layer = 0; layer < p.num_layers; ++layer) {
    for (std::int64_t b = 0; b < 2; ++b) {
      const sequence_info info = store.info(layer, slots[static_cast<std::size_t>(b)]);
      const std::int64_t prompt_chunks = std::max<std::int64_t>(0, lengths[b] / cfg.chunk_size - cfg.local_chunks);
      EXPECT_TRUE(info.prefilled);
      EXPECT_EQ(info.prompt_len, lengths[b]);
      EXPECT_EQ(info.total_len, lengths[b] + steps);
      EXPECT_EQ(info.context_chunks, prompt_chunks + folds.folds);
      EXPECT_EQ(info.outlier_chunks, std::min<std::int64_t>(cfg.outlier_chunks, prompt_chunks));
      EXPECT_EQ(info.local_len, lengths[b] - prompt_chunks * cfg.chunk_size);
      EXPECT_EQ(info.generated_exact_len, folds.generated_exact);
      EXPECT_EQ(info.last_position, p.position_offset + lengths[b] + steps - 1);
      const auto selected = store.selected_chunks(layer, slots[static_cast<std::size_t>(b)]);
      const auto outliers = store.outlier_chunks(layer, slots[static_cast<std::size_t>(b)]);
      ASSERT_EQ(selected.size(), static_cast<std::size_t>(heads));
      ASSERT_EQ(outliers.size(), static_cast<std::size_t>(heads));
      for (std::int64_t h = 0; h < heads; ++h) {
        EXPECT_EQ(static_cast<std::int64_t>(outliers[static_cast<std::size_t>(h)].size()), info.outlier_chunks);
        std::vector<std::int64_t> everything;
        for (std::int64_t c = 0; c < info.context_chunks; ++c) {
          const auto& o = outliers[static_cast<std::size_t>(h)];
          if (std::find(o.begin(), o.end(), c) == o.end()) everything.push_back(c);
        }
        EXPECT_EQ(selected[static_cast<std::size_t>(h)], everything) << "head " << h;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FullAttentionEquivalence,
    ::testing::Combine(::testing::ValuesIn(all_backends()), ::testing::Values(
        equivalence_case{"mha_d64", 4, 4, 64, 150, 123, rope_style::half_split, 0, factorization_method::gram, 1, 0,
                         false, false, 1.0F, 101},
        equivalence_case{"mha_d128_interleaved_svd", 2, 2, 128, 200, 100, rope_style::interleaved, 0,
                         factorization_method::svd, 1, 0, false, false, 1.0F, 102},
        equivalence_case{"gqa_d64_positions_two_layers", 8, 2, 64, 300, 257, rope_style::half_split, 0,
                         factorization_method::gram, 2, 1000, false, true, 1.0F, 103},
        equivalence_case{"gqa_d128_partial_rotary_post_rope_prompt", 8, 2, 128, 160, 101, rope_style::half_split, 64,
                         factorization_method::svd, 1, 0, true, false, 1.1F, 104},
        equivalence_case{"mqa_d64_tiny_prompt", 4, 1, 64, 120, 5, rope_style::half_split, 0,
                         factorization_method::gram, 1, 0, false, false, 1.0F, 105},
        equivalence_case{"mqa_d128_interleaved", 8, 1, 128, 180, 99, rope_style::interleaved, 0,
                         factorization_method::gram, 1, 0, false, true, 1.0F, 106})),
    [](const ::testing::TestParamInfo<std::tuple<backend_case, equivalence_case>>& info) {
      return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param).name;
    });

// ---------------------------------------------------------------------------------------------------------------
// selection semantics: outliers, landmark scores, top-k, temporal cache statistics
// ---------------------------------------------------------------------------------------------------------------

config selection_config() {
  config cfg;
  cfg.num_layers = 1;
  cfg.num_q_heads = 8;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 2;
  cfg.max_seq_len = 512;
  cfg.rank = 64;
  cfg.chunk_size = 8;
  cfg.budget = 4 * 8;  // 4 chunks
  cfg.outlier_chunks = 3;
  cfg.local_chunks = 2;
  cfg.generation_window = 64;  // no fold in these tests
  cfg.kv_dtype = dtype::float32;
  return cfg;
}

struct selection_data {
  std::int64_t length = 200;
  std::vector<float> keys_pre;
  std::vector<float> keys_post;
  std::vector<float> values;
};

selection_data make_selection_data(const config& cfg, random_source& rng) {
  selection_data data;
  const std::int64_t width = cfg.kv_width();
  data.keys_pre = rng.normals(static_cast<std::size_t>(data.length * width));
  // Per-chunk drifts make landmarks differ clearly between chunks (real keys cluster by position).
  for (std::int64_t t = 0; t < data.length; ++t) {
    const float drift = 0.6F * std::sin(0.37F * static_cast<float>(t / cfg.chunk_size));
    for (std::int64_t j = 0; j < width; ++j) data.keys_pre[static_cast<std::size_t>(t * width + j)] += drift * ((j % 3) - 1.0F);
  }
  data.values = rng.normals(static_cast<std::size_t>(data.length * width));
  data.keys_post = data.keys_pre;
  const rope_rotation rope(cfg);
  for (std::int64_t t = 0; t < data.length; ++t) {
    for (std::int64_t h = 0; h < cfg.num_kv_heads; ++h) rope.apply(data.keys_post.data() + t * width + h * cfg.head_dim, t);
  }
  return data;
}

// Outliers and the top-k selection per KV head, computed here from docs/semantics.md (float32 storage).
// `context_keys` are the post-RoPE keys [tokens, Hkv, D] of the context chunks in chunk order: the prompt's
// `prompt_chunks` chunks first, then folded generated chunks (never outliers).
struct expected_selection {
  std::vector<std::vector<std::int64_t>> outliers;
  std::vector<std::vector<std::int64_t>> selected;
  std::vector<std::vector<double>> min_cosine;  // per head, per prompt chunk: what ranks the outliers (lowest first)
  std::vector<std::vector<double>> score;       // per head, per context chunk: what ranks the selection (NaN: outlier)
};

// `got` equals `want` per head, up to exchanges at the ranking's boundary among chunks whose float64 key (`keys`,
// ranked highest first or lowest first) lies within atol + rtol * |boundary| of the boundary chunk's: with both 0 (the
// CPU backend), exactly.
// The CUDA backend ranks float32 scores (float64 minimum cosines summed in another order), which may order near-ties
// differently than this file's float64 (the rule of tests/python/helpers.py assert_same_selection/_outliers).
void expect_same_chunks(const shadowkv::chunk_ids_per_head& got, const std::vector<std::vector<std::int64_t>>& want,
                        const std::vector<std::vector<double>>& keys, bool highest_first, double atol, double rtol,
                        const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t h = 0; h < want.size(); ++h) {
    if ((atol == 0.0 && rtol == 0.0) || got[h] == want[h]) {
      EXPECT_EQ(got[h], want[h]) << what << " of head " << h;
      continue;
    }
    EXPECT_EQ(got[h].size(), want[h].size()) << what << " of head " << h;
    const std::vector<double>& key = keys[h];
    const double infinity = std::numeric_limits<double>::infinity();
    double boundary = highest_first ? infinity : -infinity;
    for (const std::int64_t c : want[h]) {
      const double k = key[static_cast<std::size_t>(c)];
      boundary = highest_first ? std::min(boundary, k) : std::max(boundary, k);
    }
    const double slack = atol + rtol * std::fabs(boundary);
    std::vector<std::int64_t> exchanged;
    std::set_symmetric_difference(got[h].begin(), got[h].end(), want[h].begin(), want[h].end(),
                                  std::back_inserter(exchanged));
    for (const std::int64_t c : exchanged) {
      const bool known = c >= 0 && static_cast<std::size_t>(c) < key.size();
      EXPECT_TRUE(known && std::fabs(key[static_cast<std::size_t>(c)] - boundary) <= slack)
          << what << " of head " << h << ": chunk " << c << " exchanged, its key "
          << (known ? key[static_cast<std::size_t>(c)] : std::nan("")) << " is not within " << slack
          << " of the boundary " << boundary;
    }
  }
}

expected_selection select_like_semantics(const config& cfg, const std::vector<float>& context_keys,
                                         std::int64_t prompt_chunks, std::int64_t context_chunks,
                                         const std::vector<float>& q) {
  const std::int64_t heads = cfg.num_kv_heads;
  const std::int64_t dim = cfg.head_dim;
  const std::int64_t width = cfg.kv_width();
  const std::int64_t chunk = cfg.chunk_size;
  const std::int64_t n = context_chunks;
  const std::int64_t outlier_count = std::min<std::int64_t>(cfg.outlier_chunks, prompt_chunks);
  const double scale = cfg.effective_softmax_scale();
  const int group = cfg.group_size();
  auto dot = [&](const float* a, const float* b) {
    double s = 0.0;
    for (std::int64_t d = 0; d < dim; ++d) s += static_cast<double>(a[d]) * b[d];
    return s;
  };
  expected_selection result;
  for (std::int64_t h = 0; h < heads; ++h) {
    std::vector<std::vector<float>> landmarks(static_cast<std::size_t>(n), std::vector<float>(static_cast<std::size_t>(dim)));
    std::vector<double> min_cos(static_cast<std::size_t>(prompt_chunks));
    for (std::int64_t c = 0; c < n; ++c) {
      std::vector<float>& l = landmarks[static_cast<std::size_t>(c)];
      for (std::int64_t d = 0; d < dim; ++d) {
        double sum = 0.0;
        for (std::int64_t i = 0; i < chunk; ++i) sum += context_keys[static_cast<std::size_t>((c * chunk + i) * width + h * dim + d)];
        l[static_cast<std::size_t>(d)] = static_cast<float>(sum / static_cast<double>(chunk));
      }
      if (c >= prompt_chunks) continue;
      double lowest = std::numeric_limits<double>::infinity();
      for (std::int64_t i = 0; i < chunk; ++i) {
        const float* key = context_keys.data() + (c * chunk + i) * width + h * dim;
        const double cosine = dot(l.data(), key) / std::max(std::sqrt(dot(l.data(), l.data())) * std::sqrt(dot(key, key)), 1e-30);
        lowest = std::min(lowest, cosine);
      }
      min_cos[static_cast<std::size_t>(c)] = lowest;
    }
    // Attention sinks: the first sink_chunks of the outliers are the prompt's first chunks.
    for (std::int64_t c = 0; c < std::min<std::int64_t>(cfg.sink_chunks, outlier_count); ++c) {
      min_cos[static_cast<std::size_t>(c)] = -2.0;
    }
    std::vector<std::int64_t> order(static_cast<std::size_t>(prompt_chunks));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return min_cos[static_cast<std::size_t>(a)] < min_cos[static_cast<std::size_t>(b)];
    });
    std::vector<std::int64_t> outliers(order.begin(), order.begin() + outlier_count);
    std::sort(outliers.begin(), outliers.end());
    std::vector<std::int64_t> candidates;
    for (std::int64_t c = 0; c < n; ++c) {
      if (!std::binary_search(outliers.begin(), outliers.end(), c)) candidates.push_back(c);
    }
    std::vector<double> score(candidates.size(), 0.0);
    for (int g = 0; g < group; ++g) {
      const float* qj = q.data() + (h * group + g) * dim;
      std::vector<double> logits(candidates.size());
      double largest = -std::numeric_limits<double>::infinity();
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        logits[i] = scale * dot(qj, landmarks[static_cast<std::size_t>(candidates[i])].data());
        largest = std::max(largest, logits[i]);
      }
      double total = 0.0;
      for (double& l : logits) total += (l = std::exp(l - largest));
      for (std::size_t i = 0; i < candidates.size(); ++i) {  // semantics.md Decode 4: the group's mean or max
        const double p = logits[i] / total;
        score[i] = cfg.group_score == group_combine::mean ? score[i] + p / group : std::max(score[i], p);
      }
    }
    std::vector<std::size_t> ranked(candidates.size());
    std::iota(ranked.begin(), ranked.end(), 0);
    std::stable_sort(ranked.begin(), ranked.end(), [&](std::size_t a, std::size_t b) { return score[a] > score[b]; });
    std::vector<std::int64_t> selected;
    for (std::size_t i = 0; i < std::min<std::size_t>(static_cast<std::size_t>(cfg.budget_chunks()), ranked.size()); ++i) {
      selected.push_back(candidates[ranked[i]]);
    }
    std::sort(selected.begin(), selected.end());
    std::vector<double> score_of(static_cast<std::size_t>(n), std::nan(""));
    for (std::size_t i = 0; i < candidates.size(); ++i) score_of[static_cast<std::size_t>(candidates[i])] = score[i];
    result.outliers.push_back(outliers);
    result.selected.push_back(selected);
    result.min_cosine.push_back(min_cos);
    result.score.push_back(score_of);
  }
  return result;
}

expected_selection select_like_semantics(const config& cfg, const selection_data& data, const std::vector<float>& q) {
  const std::int64_t n = std::max<std::int64_t>(0, data.length / cfg.chunk_size - cfg.local_chunks);
  return select_like_semantics(cfg, data.keys_post, n, n, q);
}

class StoreSelection : public backend_test<> {
 protected:
  // Exact on the CPU; on CUDA near-ties may be exchanged (expect_same_chunks): float32 landmark scores, and minimum
  // cosines summed in another order.
  [[nodiscard]] double selection_rtol() const { return on_cuda() ? 1e-4 : 0.0; }
  [[nodiscard]] double outlier_atol() const { return on_cuda() ? 1e-5 : 0.0; }
};
INSTANTIATE_TEST_SUITE_P(Backends, StoreSelection, ::testing::ValuesIn(all_backends()), backend_name);

TEST_P(StoreSelection, OutliersAndTopKFollowLandmarkScores) {
  config cfg = selection_config();
  for (const std::uint64_t seed : {201ULL, 202ULL, 203ULL, 204ULL}) {
    cfg.group_score = seed % 2 == 0 ? group_combine::max : group_combine::mean;  // both rules of semantics.md Decode 4
    SCOPED_TRACE("seed=" + std::to_string(seed) + " group_score=" + group_score_name(cfg.group_score));
    random_source rng(seed);
    const selection_data data = make_selection_data(cfg, rng);
    kv_store store(cfg, where());
    const std::vector<int> slots = store.add_sequences(1);
    store.prefill(0, slots, mem.view_of(data.keys_pre, {1, data.length, cfg.num_kv_heads, cfg.head_dim}),
                  mem.view_of(data.values, {1, data.length, cfg.num_kv_heads, cfg.head_dim}));
    std::vector<std::int64_t> previous_first_head;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step=" + std::to_string(step));
      // Queries aimed at the keys of one context chunk, so that selection has a clear winner.
      std::vector<float> q = rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim), 0.5F);
      const std::int64_t target = 3 + 5 * step;
      for (int j = 0; j < cfg.num_q_heads; ++j) {
        const std::int64_t h = j / cfg.group_size();
        for (int d = 0; d < cfg.head_dim; ++d) {
          q[static_cast<std::size_t>(j * cfg.head_dim + d)] += 0.8F * data.keys_post[static_cast<std::size_t>((target * cfg.chunk_size + 1) * cfg.kv_width() + h * cfg.head_dim + d)];
        }
      }
      const std::vector<float> k = rng.normals(static_cast<std::size_t>(cfg.kv_width()));
      const std::vector<float> v = rng.normals(static_cast<std::size_t>(cfg.kv_width()));
      std::vector<float> out(q.size());
      store.decode(0, slots, mem.view_of(q, {1, cfg.num_q_heads, cfg.head_dim}),
                   mem.view_of(k, {1, cfg.num_kv_heads, cfg.head_dim}),
                   mem.view_of(v, {1, cfg.num_kv_heads, cfg.head_dim}),
                   mem.mutable_view_of(out, {1, cfg.num_q_heads, cfg.head_dim}));
      const expected_selection expected = select_like_semantics(cfg, data, q);
      expect_same_chunks(store.outlier_chunks(0, slots[0]), expected.outliers, expected.min_cosine, false,
                         outlier_atol(), 0.0, "outliers");
      expect_same_chunks(store.selected_chunks(0, slots[0]), expected.selected, expected.score, true, 0.0,
                         selection_rtol(), "selection");
      for (const auto& head : expected.selected) EXPECT_EQ(head.size(), static_cast<std::size_t>(cfg.budget_chunks()));
      EXPECT_NE(expected.selected[0], previous_first_head) << "the queries must move the selection";
      previous_first_head = expected.selected[0];
    }
  }
}

TEST_P(StoreSelection, SameQueryTwiceIsAllHits) {
  const config cfg = selection_config();
  const std::uint64_t seed = 301;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  random_source rng(seed);
  const selection_data data = make_selection_data(cfg, rng);
  const std::int64_t per_step = static_cast<std::int64_t>(cfg.num_kv_heads) * cfg.budget_chunks();  // one slot
  const std::int64_t chunk_value_bytes = static_cast<std::int64_t>(cfg.chunk_size) * cfg.head_dim * 4;

  kv_store store(cfg, where());
  const std::vector<int> slots = store.add_sequences(1);
  store.prefill(0, slots, mem.view_of(data.keys_pre, {1, data.length, cfg.num_kv_heads, cfg.head_dim}),
                mem.view_of(data.values, {1, data.length, cfg.num_kv_heads, cfg.head_dim}));
  EXPECT_EQ(store.stats().selections, 0) << "no q_last: no selection at prefill";
  const std::vector<float> q = rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim));
  auto step = [&]() {
    const std::vector<float> k = rng.normals(static_cast<std::size_t>(cfg.kv_width()));
    const std::vector<float> v = rng.normals(static_cast<std::size_t>(cfg.kv_width()));
    std::vector<float> out(q.size());
    store.decode(0, slots, mem.view_of(q, {1, cfg.num_q_heads, cfg.head_dim}),
                 mem.view_of(k, {1, cfg.num_kv_heads, cfg.head_dim}),
                 mem.view_of(v, {1, cfg.num_kv_heads, cfg.head_dim}),
                 mem.mutable_view_of(out, {1, cfg.num_q_heads, cfg.head_dim}));
    EXPECT_GT(norm(out), 0.0);
  };

  step();
  store_stats first = store.stats();
  EXPECT_EQ(first.decode_steps, 1);
  EXPECT_EQ(first.selections, 1);
  EXPECT_EQ(first.hits, 0);
  EXPECT_EQ(first.misses, per_step) << "a cold cache misses every selected chunk";
  EXPECT_EQ(first.chunks_rebuilt, per_step);
  EXPECT_EQ(first.bytes_fetched, per_step * chunk_value_bytes);
  const auto selected_first = store.selected_chunks(0, slots[0]);

  step();
  const store_stats second = store.stats();
  EXPECT_EQ(second.decode_steps, 2);
  EXPECT_EQ(second.selections, 2);
  EXPECT_EQ(second.hits - first.hits, per_step) << "the same query selects the same chunks: all hits";
  EXPECT_EQ(second.misses - first.misses, 0);
  EXPECT_EQ(second.chunks_rebuilt - first.chunks_rebuilt, 0);
  EXPECT_EQ(second.bytes_fetched - first.bytes_fetched, 0);
  EXPECT_DOUBLE_EQ(second.hit_rate(), 0.5);
  EXPECT_EQ(store.selected_chunks(0, slots[0]), selected_first);

  store.reset_stats();
  const store_stats reset = store.stats();
  EXPECT_EQ(reset.decode_steps, 0);
  EXPECT_EQ(reset.hits + reset.misses + reset.selections + reset.bytes_fetched + reset.folds, 0);
  step();
  EXPECT_EQ(store.stats().hits, per_step);
  EXPECT_DOUBLE_EQ(store.stats().hit_rate(), 1.0);
}

TEST_P(StoreSelection, PrefillQueryWarmsTheCache) {
  const config cfg = selection_config();
  const std::uint64_t seed = 302;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  random_source rng(seed);
  const selection_data data = make_selection_data(cfg, rng);
  const std::int64_t per_step = static_cast<std::int64_t>(cfg.num_kv_heads) * cfg.budget_chunks();
  const std::vector<float> q = rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim));

  kv_store store(cfg, where());
  const std::vector<int> slots = store.add_sequences(1);
  prefill_options options;
  options.q_last = mem.view_of(q, {1, cfg.num_q_heads, cfg.head_dim});
  store.prefill(0, slots, mem.view_of(data.keys_pre, {1, data.length, cfg.num_kv_heads, cfg.head_dim}),
                mem.view_of(data.values, {1, data.length, cfg.num_kv_heads, cfg.head_dim}), options);
  EXPECT_EQ(store.stats().selections, 1);
  EXPECT_EQ(store.stats().misses, per_step);
  EXPECT_EQ(store.stats().decode_steps, 0);
  const expected_selection expected = select_like_semantics(cfg, data, q);
  expect_same_chunks(store.selected_chunks(0, slots[0]), expected.selected, expected.score, true, 0.0, selection_rtol(),
                     "selection");

  const std::vector<float> k = rng.normals(static_cast<std::size_t>(cfg.kv_width()));
  const std::vector<float> v = rng.normals(static_cast<std::size_t>(cfg.kv_width()));
  std::vector<float> out(q.size());
  store.decode(0, slots, mem.view_of(q, {1, cfg.num_q_heads, cfg.head_dim}),
               mem.view_of(k, {1, cfg.num_kv_heads, cfg.head_dim}),
               mem.view_of(v, {1, cfg.num_kv_heads, cfg.head_dim}),
               mem.mutable_view_of(out, {1, cfg.num_q_heads, cfg.head_dim}));
  EXPECT_EQ(store.stats().hits, per_step) << "the first decode step with the prefill's query starts warm";
  EXPECT_EQ(store.stats().misses, per_step);
}

TEST_P(StoreSelection, FoldedChunksAreScoredByTheirLandmarks) {
  config cfg = selection_config();
  cfg.generation_window = 16;
  const std::uint64_t seed = 303;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  random_source rng(seed);
  const selection_data data = make_selection_data(cfg, rng);
  const std::int64_t width = cfg.kv_width();
  const std::int64_t prompt_chunks = data.length / cfg.chunk_size - cfg.local_chunks;
  const rope_rotation rope(cfg);

  kv_store store(cfg, where());
  const std::vector<int> slots = store.add_sequences(1);
  store.prefill(0, slots, mem.view_of(data.keys_pre, {1, data.length, cfg.num_kv_heads, cfg.head_dim}),
                mem.view_of(data.values, {1, data.length, cfg.num_kv_heads, cfg.head_dim}));
  // Context keys in chunk order: the prompt's context chunks, then each folded chunk of generated keys.
  std::vector<float> context(data.keys_post.begin(), data.keys_post.begin() + prompt_chunks * cfg.chunk_size * width);
  std::vector<float> generated;
  const std::int64_t steps = 40;
  std::int64_t folded_chunks_seen = 0;
  for (std::int64_t step = 0; step < steps; ++step) {
    SCOPED_TRACE("step=" + std::to_string(step));
    // Strong generated keys, so that folded chunks compete for selection.
    std::vector<float> k = rng.normals(static_cast<std::size_t>(width), 2.0F);
    for (std::int64_t h = 0; h < cfg.num_kv_heads; ++h) rope.apply(k.data() + h * cfg.head_dim, data.length + step);
    generated.insert(generated.end(), k.begin(), k.end());
    const std::vector<float> v = rng.normals(static_cast<std::size_t>(width));
    std::vector<float> q = rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim));
    std::vector<float> out(q.size());
    store.decode(0, slots, mem.view_of(q, {1, cfg.num_q_heads, cfg.head_dim}),
                 mem.view_of(k, {1, cfg.num_kv_heads, cfg.head_dim}),
                 mem.view_of(v, {1, cfg.num_kv_heads, cfg.head_dim}),
                 mem.mutable_view_of(out, {1, cfg.num_q_heads, cfg.head_dim}));
    const sequence_info info = store.info(0, slots[0]);
    while (prompt_chunks + folded_chunks_seen < info.context_chunks) {  // a fold happened before this step's append
      const auto first = generated.begin() + folded_chunks_seen * cfg.chunk_size * width;
      context.insert(context.end(), first, first + cfg.chunk_size * width);
      folded_chunks_seen += 1;
    }
    const expected_selection expected = select_like_semantics(cfg, context, prompt_chunks, info.context_chunks, q);
    expect_same_chunks(store.selected_chunks(0, slots[0]), expected.selected, expected.score, true, 0.0,
                       selection_rtol(), "selection");
    if (HasFailure()) return;
  }
  EXPECT_EQ(folded_chunks_seen, simulate_folds(steps, cfg.generation_window, cfg.chunk_size).folds);
  // Non-trivial: some folded chunk was selected at least once, for some head, on the last step or before.
  const auto last = store.selected_chunks(0, slots[0]);
  bool folded_selected = false;
  for (const auto& head : last) folded_selected = folded_selected || (!head.empty() && head.back() >= prompt_chunks);
  EXPECT_TRUE(folded_selected) << "the test needs a folded chunk among the selected ones";
}

// ---------------------------------------------------------------------------------------------------------------
// rejected calls leave the store exactly as a twin that never saw them
// ---------------------------------------------------------------------------------------------------------------

config twin_config() {
  config cfg;
  cfg.num_layers = 2;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 4;
  cfg.max_seq_len = 160;
  cfg.rank = 32;
  cfg.chunk_size = 8;
  cfg.budget = 4 * 8;  // 4 chunks
  cfg.outlier_chunks = 2;
  cfg.local_chunks = 2;
  cfg.generation_window = 16;
  cfg.kv_dtype = dtype::bfloat16;
  return cfg;
}

// Two stores fed the same calls; only `subject` receives the bad one.
class twin_stores {
 public:
  // Both stores on mem's device; their tensors in its memory.
  twin_stores(std::uint64_t seed, backend_memory& mem)
      : cfg(twin_config()), subject(cfg, mem.where()), twin(cfg, mem.where()), mem_(mem), rng_(seed) {
    // Slots 0 and 1 live, slot 2 released, slot 3 never added.
    both([](kv_store& s) {
      EXPECT_EQ(s.add_sequences(3), slot_list({0, 1, 2}));
      s.release(slot_list({2}));
    });
    prefill_both(0, {0}, 100, /*with_query=*/true);
    prefill_both(0, {1}, 77);
    prefill_both(1, {0}, 100);
    for (int i = 0; i < 3; ++i) decode_both(0, {0, 1});
  }

  template <typename Call>
  void both(Call&& call) {
    call(subject);
    call(twin);
  }

  void prefill_both(int layer, std::initializer_list<int> slot_init, std::int64_t length, bool with_query = false) {
    const std::vector<int> slots(slot_init);
    const auto batch = static_cast<std::int64_t>(slots.size());
    const std::vector<float> keys = rng_.normals(static_cast<std::size_t>(batch * length * cfg.kv_width()));
    const std::vector<float> values = rng_.normals(static_cast<std::size_t>(batch * length * cfg.kv_width()));
    const std::vector<float> q = rng_.normals(static_cast<std::size_t>(batch * cfg.num_q_heads * cfg.head_dim));
    prefill_options options;
    if (with_query) options.q_last = mem_.view_of(q, {batch, 1, cfg.num_q_heads, cfg.head_dim});
    both([&](kv_store& s) {
      s.prefill(layer, slots, mem_.view_of(keys, {batch, length, cfg.num_kv_heads, cfg.head_dim}),
                mem_.view_of(values, {batch, length, cfg.num_kv_heads, cfg.head_dim}), options);
    });
  }

  // One decode step on both stores with the same data; their outputs must agree bit for bit.
  void decode_both(int layer, const std::vector<int>& slots) {
    const auto batch = static_cast<std::int64_t>(slots.size());
    const std::vector<float> q = rng_.normals(static_cast<std::size_t>(batch * cfg.num_q_heads * cfg.head_dim));
    const std::vector<float> k = rng_.normals(static_cast<std::size_t>(batch * cfg.kv_width()));
    const std::vector<float> v = rng_.normals(static_cast<std::size_t>(batch * cfg.kv_width()));
    std::vector<float> out_subject(q.size(), -1.0F);
    std::vector<float> out_twin(q.size(), -2.0F);
    subject.decode(layer, slots, mem_.view_of(q, {batch, cfg.num_q_heads, cfg.head_dim}),
                   mem_.view_of(k, {batch, cfg.num_kv_heads, cfg.head_dim}),
                   mem_.view_of(v, {batch, cfg.num_kv_heads, cfg.head_dim}),
                   mem_.mutable_view_of(out_subject, {batch, cfg.num_q_heads, cfg.head_dim}));
    twin.decode(layer, slots, mem_.view_of(q, {batch, cfg.num_q_heads, cfg.head_dim}),
                mem_.view_of(k, {batch, cfg.num_kv_heads, cfg.head_dim}),
                mem_.view_of(v, {batch, cfg.num_kv_heads, cfg.head_dim}),
                mem_.mutable_view_of(out_twin, {batch, cfg.num_q_heads, cfg.head_dim}));
    ASSERT_TRUE(all_finite(out_subject));
    EXPECT_GT(norm(out_subject), 0.05);
    ASSERT_EQ(out_subject, out_twin) << "decode output differs from the twin's (layer " << layer << ")";
    decoded_ += 1;
  }
  void decode_both(int layer, std::initializer_list<int> slots) { decode_both(layer, std::vector<int>(slots)); }

  void expect_same_state() {
    EXPECT_EQ(subject.active_slots(), twin.active_slots());
    expect_same_memory(subject.memory(), twin.memory());
    expect_same_stats(subject.stats(), twin.stats());
    for (const int slot : twin.active_slots()) {
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        SCOPED_TRACE("slot=" + std::to_string(slot) + " layer=" + std::to_string(layer));
        expect_same_info(subject.info(layer, slot), twin.info(layer, slot));
        if (twin.info(layer, slot).prefilled) {
          EXPECT_EQ(subject.selected_chunks(layer, slot), twin.selected_chunks(layer, slot));
          EXPECT_EQ(subject.outlier_chunks(layer, slot), twin.outlier_chunks(layer, slot));
        }
      }
    }
  }

  // Same state now, then the same outputs for 20 more steps of every prefilled (layer, slot) with room left
  // (the window of 16 makes them fold on the way).
  void expect_same_future() {
    expect_same_state();
    const std::int64_t steps = 20;
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      std::vector<int> slots;
      for (const int slot : twin.active_slots()) {
        const sequence_info info = twin.info(layer, slot);
        if (info.prefilled && info.total_len + steps <= cfg.max_seq_len) slots.push_back(slot);
      }
      if (slots.empty()) continue;
      for (std::int64_t i = 0; i < steps; ++i) {
        SCOPED_TRACE("continuation step " + std::to_string(i) + " layer " + std::to_string(layer));
        decode_both(layer, slots);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    EXPECT_GE(decoded_, 3 + steps) << "the continuation must decode something";
    expect_same_state();
    EXPECT_GT(twin.stats().folds, 0);
  }

  config cfg;
  kv_store subject;
  kv_store twin;

 private:
  backend_memory& mem_;
  random_source rng_;
  std::int64_t decoded_ = 0;
};

class StoreErrors : public backend_test<> {
 protected:
  // Runs `bad` on the subject only, expects `Exception`, then the twins must agree now and in the future.
  template <typename Exception>
  void expect_rejected(const std::string& what, const std::function<void(kv_store&, const config&)>& bad,
                       const std::function<void(twin_stores&)>& extra_setup = {}) {
    const std::uint64_t seed = 400 + std::hash<std::string>{}(what) % 1000;
    SCOPED_TRACE(what + " seed=" + std::to_string(seed));
    twin_stores stores(seed, mem);
    if (extra_setup) extra_setup(stores);
    try {
      bad(stores.subject, stores.cfg);
      ADD_FAILURE() << what << ": no exception";
    } catch (const Exception& error) {
      EXPECT_NE(std::string(error.what()), "") << "the message must say what is wrong";
    } catch (const std::exception& error) {
      ADD_FAILURE() << what << ": wrong exception type: " << error.what();
    }
    stores.expect_same_future();
  }
};
INSTANTIATE_TEST_SUITE_P(Backends, StoreErrors, ::testing::ValuesIn(all_backends()), backend_name);

// Data for bad calls: right-sized for one sequence unless a test changes a dimension.
struct bad_data {
  std::vector<float> big = std::vector<float>(4 * 200 * 2 * 64, 0.25F);
  std::vector<std::int64_t> ints = std::vector<std::int64_t>(4 * 200, 1);
};

TEST_P(StoreErrors, PrefillWithBadTensorsIsRejected) {
  using shadowkv::invalid_argument;
  static bad_data d;
  auto keys = [this](shape_list s) { return mem.view_of(d.big, s); };
  expect_rejected<invalid_argument>("values length differs", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 59, 2, 64}));
  });
  expect_rejected<invalid_argument>("keys with 3 kv heads", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1}), keys({1, 60, 3, 64}), keys({1, 60, 3, 64}));
  });
  expect_rejected<invalid_argument>("keys with head_dim 32", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 32}), keys({1, 60, 2, 32}));
  });
  expect_rejected<invalid_argument>("batch of 2 for one slot", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1}), keys({2, 60, 2, 64}), keys({2, 60, 2, 64}));
  });
  expect_rejected<invalid_argument>("keys of rank 3", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1}), keys({60, 2, 64}), keys({1, 60, 2, 64}));
  });
  expect_rejected<invalid_argument>("integer keys", [&](kv_store& s, const config&) {
    const tensor_view ints = mem.index_view_of(d.ints, {1, 6, 2, 64});
    s.prefill(1, slot_list({1}), ints, keys({1, 6, 2, 64}));
  });
  expect_rejected<invalid_argument>("missing values", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), tensor_view{});
  });
  expect_rejected<invalid_argument>("keys on another device", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1}), mem.foreign_view_of(d.big, {1, 60, 2, 64}), keys({1, 60, 2, 64}));
  });
  expect_rejected<invalid_argument>("positions of the wrong length", [&](kv_store& s, const config&) {
    prefill_options options;
    options.positions = mem.index_view_of(d.ints, {1, 59});
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}), options);
  });
  expect_rejected<invalid_argument>("float positions", [&](kv_store& s, const config&) {
    prefill_options options;
    options.positions = keys({1, 60});
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}), options);
  });
  expect_rejected<invalid_argument>("q_last with 3 query heads", [&](kv_store& s, const config&) {
    prefill_options options;
    options.q_last = keys({1, 3, 64});
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}), options);
  });
  expect_rejected<invalid_argument>("q_last with no tokens", [&](kv_store& s, const config&) {
    prefill_options options;
    options.q_last = keys({1, 0, 4, 64});
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}), options);
  });
  expect_rejected<invalid_argument>("lengths above S", [&](kv_store& s, const config&) {
    prefill_options options;
    options.lengths = {61};
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}), options);
  });
  expect_rejected<invalid_argument>("lengths of zero", [&](kv_store& s, const config&) {
    prefill_options options;
    options.lengths = {0};
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}), options);
  });
  expect_rejected<invalid_argument>("lengths with two entries for one slot", [&](kv_store& s, const config&) {
    prefill_options options;
    options.lengths = {60, 60};
    s.prefill(1, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}), options);
  });
}

TEST_P(StoreErrors, PrefillWithBadSlotsOrLayersIsRejected) {
  using shadowkv::invalid_argument;
  static bad_data d;
  auto keys = [this](shape_list s) { return mem.view_of(d.big, s); };
  for (const int slot : {3, 2, 4, 9, -1}) {  // never added, released, out of range
    expect_rejected<invalid_argument>("prefill slot " + std::to_string(slot), [&](kv_store& s, const config&) {
      s.prefill(1, slot_list({slot}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}));
    });
  }
  expect_rejected<invalid_argument>("prefill with a valid and a released slot", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1, 2}), keys({2, 60, 2, 64}), keys({2, 60, 2, 64}));
  });
  expect_rejected<invalid_argument>("prefill with a duplicate slot", [&](kv_store& s, const config&) {
    s.prefill(1, slot_list({1, 1}), keys({2, 60, 2, 64}), keys({2, 60, 2, 64}));
  });
  expect_rejected<invalid_argument>("prefill with no slots", [&](kv_store& s, const config&) {
    s.prefill(1, std::vector<int>{}, keys({0, 60, 2, 64}), keys({0, 60, 2, 64}));
  });
  for (const int layer : {2, -1}) {
    expect_rejected<invalid_argument>("prefill layer " + std::to_string(layer), [&](kv_store& s, const config&) {
      s.prefill(layer, slot_list({1}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}));
    });
  }
  expect_rejected<invalid_argument>("second prefill of a layer", [&](kv_store& s, const config&) {
    s.prefill(0, slot_list({0}), keys({1, 60, 2, 64}), keys({1, 60, 2, 64}));
  });
  expect_rejected<invalid_argument>("second prefill of one slot in a batch", [&](kv_store& s, const config&) {
    // slot 1 is fresh in layer 1, slot 0 is not: nothing may be stored for slot 1 either.
    s.prefill(1, slot_list({1, 0}), keys({2, 60, 2, 64}), keys({2, 60, 2, 64}));
  });
}

TEST_P(StoreErrors, PromptLongerThanMaxSeqLenIsCapacityError) {
  static bad_data d;
  auto keys = [this](shape_list s) { return mem.view_of(d.big, s); };
  expect_rejected<shadowkv::capacity_error>("prompt of max_seq_len + 1", [&](kv_store& s, const config& cfg) {
    s.prefill(1, slot_list({1}), keys({1, cfg.max_seq_len + 1, 2, 64}), keys({1, cfg.max_seq_len + 1, 2, 64}));
  });
  expect_rejected<shadowkv::capacity_error>("padded batch with one prompt too long", [&](kv_store& s, const config& cfg) {
    prefill_options options;
    options.lengths = {cfg.max_seq_len + 1};
    s.prefill(1, slot_list({1}), keys({1, cfg.max_seq_len + 1, 2, 64}), keys({1, cfg.max_seq_len + 1, 2, 64}), options);
  });
  // A prompt of exactly max_seq_len is accepted, and the next decode of it is a capacity error.
  expect_rejected<shadowkv::capacity_error>(
      "decode beyond max_seq_len",
      [&](kv_store& s, const config&) {
        std::vector<float> out(2 * 4 * 64);
        s.decode(1, slot_list({0, 1}), keys({2, 4, 64}), keys({2, 2, 64}), keys({2, 2, 64}),
                 mem.mutable_view_of(out, {2, 4, 64}));
      },
      [](twin_stores& t) {
        t.prefill_both(1, {1}, t.cfg.max_seq_len - 1);
        t.decode_both(1, {1});  // now exactly full
        EXPECT_EQ(t.twin.info(1, 1).total_len, t.cfg.max_seq_len);
      });
}

TEST_P(StoreErrors, DecodeWithBadArgumentsIsRejected) {
  using shadowkv::invalid_argument;
  static bad_data d;
  auto t = [this](shape_list s) { return mem.view_of(d.big, s); };
  static std::vector<float> out_data(4 * 4 * 64);
  auto decode = [this](kv_store& s, int layer, std::vector<int> slots, tensor_view q, tensor_view k, tensor_view v,
                       shape_list out_shape, const decode_options& options = {}) {
    s.decode(layer, slots, q, k, v, mem.mutable_view_of(out_data, out_shape), options);
  };
  expect_rejected<invalid_argument>("q with 3 heads", [&](kv_store& s, const config&) {
    decode(s, 0, {0, 1}, t({2, 3, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64});
  });
  expect_rejected<invalid_argument>("k_new with 1 head", [&](kv_store& s, const config&) {
    decode(s, 0, {0, 1}, t({2, 4, 64}), t({2, 1, 64}), t({2, 2, 64}), {2, 4, 64});
  });
  expect_rejected<invalid_argument>("v_new with head_dim 63", [&](kv_store& s, const config&) {
    decode(s, 0, {0, 1}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 63}), {2, 4, 64});
  });
  expect_rejected<invalid_argument>("out of the wrong shape", [&](kv_store& s, const config&) {
    decode(s, 0, {0, 1}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 32});
  });
  expect_rejected<invalid_argument>("q for one sequence, two slots", [&](kv_store& s, const config&) {
    decode(s, 0, {0, 1}, t({1, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64});
  });
  expect_rejected<invalid_argument>("positions of the wrong length", [&](kv_store& s, const config&) {
    decode_options options;
    options.positions = mem.index_view_of(d.ints, {1});
    decode(s, 0, {0, 1}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64}, options);
  });
  expect_rejected<invalid_argument>("float positions", [&](kv_store& s, const config&) {
    decode_options options;
    options.positions = t({2});
    decode(s, 0, {0, 1}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64}, options);
  });
  expect_rejected<invalid_argument>("integer out", [&](kv_store& s, const config&) {
    mutable_tensor_view out;
    static_cast<tensor_view&>(out) = mem.index_view_of(d.ints, {2, 4, 64});
    s.decode(0, slot_list({0, 1}), t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), out);
  });
  for (const int slot : {3, 2, 4, -1}) {  // never added, released, out of range
    expect_rejected<invalid_argument>("decode with slot " + std::to_string(slot), [&](kv_store& s, const config&) {
      decode(s, 0, {0, slot}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64});
    });
  }
  expect_rejected<invalid_argument>("decode with a duplicate slot", [&](kv_store& s, const config&) {
    decode(s, 0, {0, 0}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64});
  });
  expect_rejected<invalid_argument>("decode with no slots", [&](kv_store& s, const config&) {
    decode(s, 0, {}, t({0, 4, 64}), t({0, 2, 64}), t({0, 2, 64}), {0, 4, 64});
  });
  for (const int layer : {2, -1}) {
    expect_rejected<invalid_argument>("decode layer " + std::to_string(layer), [&](kv_store& s, const config&) {
      decode(s, layer, {0, 1}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64});
    });
  }
  expect_rejected<invalid_argument>("decode before prefill of one slot in the batch", [&](kv_store& s, const config&) {
    // layer 1 holds slot 0 only: slot 0 must not receive the token either.
    decode(s, 1, {0, 1}, t({2, 4, 64}), t({2, 2, 64}), t({2, 2, 64}), {2, 4, 64});
  });
}

TEST_P(StoreErrors, ReleaseAndAddWithBadArgumentsAreRejected) {
  using shadowkv::invalid_argument;
  expect_rejected<invalid_argument>("release a slot twice in one call",
                                    [](kv_store& s, const config&) { s.release(slot_list({0, 0})); });
  expect_rejected<invalid_argument>("release a live and a free slot",
                                    [](kv_store& s, const config&) { s.release(slot_list({0, 3})); });
  expect_rejected<invalid_argument>("release a released slot",
                                    [](kv_store& s, const config&) { s.release(slot_list({2})); });
  expect_rejected<invalid_argument>("release nothing", [](kv_store& s, const config&) { s.release(std::vector<int>{}); });
  expect_rejected<shadowkv::capacity_error>("add beyond max_batch",
                                            [](kv_store& s, const config&) { (void)s.add_sequences(3); });
  expect_rejected<invalid_argument>("add zero sequences", [](kv_store& s, const config&) { (void)s.add_sequences(0); });
  expect_rejected<invalid_argument>("inspect a free slot",
                                    [](kv_store& s, const config&) { (void)s.selected_chunks(0, 3); });
  expect_rejected<invalid_argument>("inspect a layer out of range",
                                    [](kv_store& s, const config&) { (void)s.info(2, 0); });
  expect_rejected<invalid_argument>("outliers of a released slot",
                                    [](kv_store& s, const config&) { (void)s.outlier_chunks(0, 2); });
}

TEST_P(StoreErrors, DecodeBeforeAnyPrefill) {
  kv_store store(twin_config(), where());
  const std::vector<int> slots = store.add_sequences(1);
  std::vector<float> data(4 * 64, 0.5F);
  std::vector<float> out(4 * 64);
  EXPECT_THROW(store.decode(0, slots, mem.view_of(data, {1, 4, 64}), mem.view_of(data, {1, 2, 64}),
                            mem.view_of(data, {1, 2, 64}), mem.mutable_view_of(out, {1, 4, 64})),
               shadowkv::invalid_argument);
  EXPECT_FALSE(store.info(0, slots[0]).prefilled);
  EXPECT_EQ(store.info(0, slots[0]).total_len, 0);
  EXPECT_EQ(store.info(0, slots[0]).last_position, -1);
  EXPECT_EQ(store.stats().decode_steps, 0);
  EXPECT_EQ(store.memory().total(), 0);
  // A layer not prefilled has no chunks: one empty list per KV head from every inspection call, on every backend.
  const shadowkv::chunk_ids_per_head empty(static_cast<std::size_t>(twin_config().num_kv_heads));
  EXPECT_EQ(store.selected_chunks(0, slots[0]), empty);
  EXPECT_EQ(store.outlier_chunks(0, slots[0]), empty);
  EXPECT_EQ(store.attended_chunks(0, slots[0]), empty);
}

#ifdef SHADOWKV_TEST_WITH_CUDA
// A CUDA store given no stream reads inputs that the caller queued on the legacy default stream only after they land
// (store.hpp: "inputs must be ready"; a cudaMemcpy from pageable memory returns before its data does). The caller here
// queues ~2 GB of device copies on the legacy stream, then q's real values behind them, and decodes at once: a store
// whose own stream did not wait for the legacy stream would read the stale q (its 0.25 values), and its output would
// not be its twin's, which decoded the same step with q already in place.
TEST(StoreStreams, NoStreamGivenMeansAfterTheLegacyDefaultStream) {
  const shadowkv::device cuda{shadowkv::device_type::cuda, 0};
  if (const std::string why = shadowkv_test::unavailable_reason(cuda); !why.empty()) GTEST_SKIP() << why;
  backend_memory mem(cuda);
  twin_stores stores(4242, mem);
  const config& cfg = stores.cfg;
  random_source rng(4243);
  const std::int64_t batch = 2;
  const std::vector<float> q = rng.normals(static_cast<std::size_t>(batch * cfg.num_q_heads * cfg.head_dim));
  const std::vector<float> k = rng.normals(static_cast<std::size_t>(batch * cfg.kv_width()));
  const std::vector<float> v = rng.normals(static_cast<std::size_t>(batch * cfg.kv_width()));
  std::vector<float> out_twin(q.size(), -1.0F);
  stores.twin.decode(0, slot_list({0, 1}), mem.view_of(q, {batch, cfg.num_q_heads, cfg.head_dim}),
                     mem.view_of(k, {batch, cfg.num_kv_heads, cfg.head_dim}),
                     mem.view_of(v, {batch, cfg.num_kv_heads, cfg.head_dim}),
                     mem.mutable_view_of(out_twin, {batch, cfg.num_q_heads, cfg.head_dim}));

  const std::size_t q_bytes = q.size() * sizeof(float);
  const std::size_t filler_bytes = std::size_t{512} << 20;
  void* q_device = nullptr;
  void* from = nullptr;
  void* to = nullptr;
  ASSERT_EQ(cudaMalloc(&q_device, q_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&from, filler_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&to, filler_bytes), cudaSuccess);
  const std::vector<float> stale(q.size(), 0.25F);
  ASSERT_EQ(cudaMemcpy(q_device, stale.data(), q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const tensor_view k_view = mem.view_of(k, {batch, cfg.num_kv_heads, cfg.head_dim});
  const tensor_view v_view = mem.view_of(v, {batch, cfg.num_kv_heads, cfg.head_dim});
  std::vector<float> out_subject(q.size(), -2.0F);
  {
    auto out = mem.mutable_view_of(out_subject, {batch, cfg.num_q_heads, cfg.head_dim});
    for (int copy = 0; copy < 4; ++copy) {
      ASSERT_EQ(cudaMemcpyAsync(to, from, filler_bytes, cudaMemcpyDeviceToDevice, cudaStreamLegacy), cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(q_device, q.data(), q_bytes, cudaMemcpyHostToDevice, cudaStreamLegacy), cudaSuccess);
    stores.subject.decode(0, slot_list({0, 1}),
                          shadowkv::make_contiguous_view(q_device, dtype::float32, cuda,
                                                         {batch, cfg.num_q_heads, cfg.head_dim}),
                          k_view, v_view, out);
  }
  EXPECT_EQ(cudaFree(q_device), cudaSuccess);
  EXPECT_EQ(cudaFree(from), cudaSuccess);
  EXPECT_EQ(cudaFree(to), cudaSuccess);
  ASSERT_TRUE(all_finite(out_subject));
  EXPECT_EQ(out_subject, out_twin) << "the store read q before the legacy stream's copy of it landed";
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// capacity: slots
// ---------------------------------------------------------------------------------------------------------------

class StoreCapacity : public backend_test<> {};
INSTANTIATE_TEST_SUITE_P(Backends, StoreCapacity, ::testing::ValuesIn(all_backends()), backend_name);

TEST_P(StoreCapacity, AddSequencesBeyondMaxBatchThrowsCapacityError) {
  config cfg = twin_config();
  cfg.max_batch = 3;
  kv_store store(cfg, where());
  EXPECT_THROW((void)store.add_sequences(4), shadowkv::capacity_error);
  EXPECT_TRUE(store.active_slots().empty()) << "a refused add takes no slot";
  EXPECT_EQ(store.add_sequences(2), slot_list({0, 1}));
  EXPECT_THROW((void)store.add_sequences(2), shadowkv::capacity_error);
  EXPECT_EQ(store.active_slots(), slot_list({0, 1}));
  EXPECT_EQ(store.add_sequences(1), slot_list({2}));
  EXPECT_THROW((void)store.add_sequences(1), shadowkv::capacity_error);
  store.release(slot_list({1}));
  EXPECT_EQ(store.active_slots(), slot_list({0, 2}));
  EXPECT_EQ(store.add_sequences(1), slot_list({1})) << "the lowest free slot comes first";
  EXPECT_EQ(store.active_slots(), slot_list({0, 1, 2}));
  EXPECT_THROW((void)store.add_sequences(1), shadowkv::capacity_error);
}

TEST_P(StoreCapacity, ReusedSlotStartsEmpty) {
  const std::uint64_t seed = 501;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  const config cfg = twin_config();
  random_source rng(seed);
  kv_store store(cfg, where());
  const std::vector<int> slots = store.add_sequences(1);
  const std::vector<float> keys = rng.normals(static_cast<std::size_t>(50 * cfg.kv_width()));
  store.prefill(0, slots, mem.view_of(keys, {1, 50, 2, 64}), mem.view_of(keys, {1, 50, 2, 64}));
  EXPECT_GT(store.memory().total(), 0);
  store.release(slots);
  EXPECT_EQ(store.memory().total(), 0);
  EXPECT_EQ(store.memory().full_attention_equivalent, 0);
  EXPECT_EQ(store.add_sequences(1), slots);
  EXPECT_FALSE(store.info(0, slots[0]).prefilled);
  EXPECT_NO_THROW(store.prefill(0, slots, mem.view_of(keys, {1, 50, 2, 64}), mem.view_of(keys, {1, 50, 2, 64})))
      << "a new sequence in a reused slot may be prefilled again";
}

// ---------------------------------------------------------------------------------------------------------------
// memory(): the formulas of docs/semantics.md
// ---------------------------------------------------------------------------------------------------------------

struct memory_expectation {
  std::int64_t prompt_len = 0;
  std::int64_t decode_steps = 0;
};

memory_report expected_memory(const config& cfg, const std::vector<memory_expectation>& layers) {
  const std::int64_t e = static_cast<std::int64_t>(shadowkv::dtype_size(cfg.kv_dtype));
  const std::int64_t width = cfg.kv_width();
  const std::int64_t r = cfg.rank;
  const std::int64_t c = cfg.chunk_size;
  memory_report report;
  for (const memory_expectation& layer : layers) {
    const std::int64_t n = std::max<std::int64_t>(0, layer.prompt_len / c - cfg.local_chunks);
    const fold_count folds = simulate_folds(layer.decode_steps, cfg.generation_window, c);
    const std::int64_t ctx_chunks = n + folds.folds;
    const std::int64_t outliers = std::min<std::int64_t>(cfg.outlier_chunks, n);
    const std::int64_t local = layer.prompt_len - n * c;
    report.low_rank_factors +=
        (ctx_chunks * c * r + r * width) * static_cast<std::int64_t>(shadowkv::dtype_size(cfg.factor_dtype()));
    report.landmarks += ctx_chunks * width * e;
    report.outliers += outliers * c * width * 2 * e;
    report.exact_tokens += (local + folds.generated_exact) * width * 2 * e;
    report.value_store += ctx_chunks * c * width * e;
    report.selection_cache += static_cast<std::int64_t>(cfg.budget_chunks()) * c * width * 2 * e;
    report.fold_journal += folds.folds * c * width * 2 * e;
    report.full_attention_equivalent += (layer.prompt_len + layer.decode_steps) * width * 2 * e;
  }
  return report;
}

class StoreMemory : public backend_test<> {};
INSTANTIATE_TEST_SUITE_P(Backends, StoreMemory, ::testing::ValuesIn(all_backends()), backend_name);

TEST_P(StoreMemory, MatchesDocumentedFormulasAfterPrefillAndFolds) {
  for (const dtype type : {dtype::bfloat16, dtype::float32, dtype::float16}) {
    const std::uint64_t seed = 601;
    SCOPED_TRACE(std::string(shadowkv::dtype_name(type)) + " seed=" + std::to_string(seed));
    config cfg;
    cfg.num_layers = 2;
    cfg.num_q_heads = 4;
    cfg.num_kv_heads = 2;
    cfg.head_dim = 64;
    cfg.max_batch = 3;
    cfg.max_seq_len = 256;
    cfg.rank = 40;
    cfg.chunk_size = 8;
    cfg.budget = 3 * 8;  // 3 chunks
    cfg.outlier_chunks = 2;
    cfg.local_chunks = 2;
    cfg.generation_window = 16;
    cfg.kv_dtype = type;
    random_source rng(seed);
    kv_store store(cfg, where());
    EXPECT_EQ(store.add_sequences(3), slot_list({0, 1, 2}));
    EXPECT_EQ(store.memory().total(), 0) << "nothing is held before a prefill";

    auto prefill = [&](int layer, int slot, std::int64_t length) {
      const std::vector<float> keys = rng.normals(static_cast<std::size_t>(length * cfg.kv_width()));
      const std::vector<float> values = rng.normals(static_cast<std::size_t>(length * cfg.kv_width()));
      store.prefill(layer, slot_list({slot}), mem.view_of(keys, {1, length, 2, 64}),
                    mem.view_of(values, {1, length, 2, 64}));
    };
    auto decode = [&](int layer, const std::vector<int>& slots, int steps) {
      const auto batch = static_cast<std::int64_t>(slots.size());
      for (int i = 0; i < steps; ++i) {
        const std::vector<float> q = rng.normals(static_cast<std::size_t>(batch * 4 * 64));
        const std::vector<float> kv = rng.normals(static_cast<std::size_t>(batch * 2 * 64));
        std::vector<float> out(q.size());
        store.decode(layer, slots, mem.view_of(q, {batch, 4, 64}), mem.view_of(kv, {batch, 2, 64}),
                     mem.view_of(kv, {batch, 2, 64}), mem.mutable_view_of(out, {batch, 4, 64}));
      }
    };
    auto check = [&](const std::vector<memory_expectation>& layers, const char* when) {
      SCOPED_TRACE(when);
      const memory_report got = store.memory();
      const memory_report want = expected_memory(cfg, layers);
      expect_same_memory(got, want);
      EXPECT_EQ(got.total(), want.low_rank_factors + want.landmarks + want.outliers + want.exact_tokens +
                                 want.value_store + want.selection_cache + want.fold_journal);
      EXPECT_GT(got.total(), 0);
    };

    // slot 0: both layers, 100 tokens (10 context chunks); slot 1: layer 0, 37 tokens; slot 2: layer 0, 10 tokens
    // (no context chunk, no outlier).
    prefill(0, 0, 100);
    prefill(1, 0, 100);
    prefill(0, 1, 37);
    prefill(0, 2, 10);
    check({{100, 0}, {100, 0}, {37, 0}, {10, 0}}, "after prefill");
    EXPECT_EQ(store.info(0, 2).context_chunks, 0);

    decode(0, {0, 1, 2}, 30);  // folds at steps 17 and 25 (window 16, chunk 8)
    decode(1, {0}, 9);         // no fold yet
    check({{100, 30}, {100, 9}, {37, 30}, {10, 30}}, "after decode with folds");
    EXPECT_EQ(store.stats().folds, 3 * 2);
    EXPECT_EQ(store.info(0, 2).context_chunks, 2) << "folded chunks are context chunks";

    store.release(slot_list({1}));
    check({{100, 30}, {100, 9}, {10, 30}}, "after releasing slot 1");
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// value placement: value_store = host | device | auto (device memory while device_value_budget lasts, then host)
// ---------------------------------------------------------------------------------------------------------------

namespace placement {

config small_config(shadowkv::value_store_policy policy, std::int64_t budget) {
  config cfg;
  cfg.num_layers = 2;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 4;
  cfg.max_seq_len = 100;  // 12 chunks of 8: the value store holds 96 tokens per layer
  cfg.rank = 32;
  cfg.chunk_size = 8;
  cfg.budget = 2 * 8;  // 2 chunks
  cfg.outlier_chunks = 1;
  cfg.local_chunks = 1;
  cfg.generation_window = 16;
  cfg.kv_dtype = dtype::float32;
  cfg.value_store = policy;
  cfg.device_value_budget = budget;
  return cfg;
}

// Value-store bytes of one sequence at capacity: layers x 96 tokens x Hkv*D x 4 bytes.
constexpr std::int64_t kSequenceValueBytes = 2 * 96 * 128 * 4;

std::vector<shadowkv::value_place> places(const kv_store& store, const std::vector<int>& slots) {
  std::vector<shadowkv::value_place> result;
  for (const int slot : slots) result.push_back(store.info(0, slot).values_on);
  return result;
}

}  // namespace placement

class StorePlacement : public backend_test<> {};
INSTANTIATE_TEST_SUITE_P(Backends, StorePlacement, ::testing::ValuesIn(all_backends()), backend_name);

TEST_P(StorePlacement, AutoFillsTheDeviceBudgetThenTheHostAndReusesFreedBudget) {
  using shadowkv::value_place;
  const config cfg = placement::small_config(shadowkv::value_store_policy::auto_place,
                                             2 * placement::kSequenceValueBytes + 5);
  kv_store store(cfg, where());
  EXPECT_EQ(store.device_value_budget(), 2 * placement::kSequenceValueBytes + 5);
  const std::vector<int> first = store.add_sequences(3);
  EXPECT_EQ(placement::places(store, first),
            (std::vector<value_place>{value_place::device, value_place::device, value_place::host}));
  // Every layer of a sequence is in one place; the report splits the value store by place.
  random_source rng(701);
  const std::vector<float> keys = rng.normals(static_cast<std::size_t>(60 * cfg.kv_width()));
  for (const int slot : first) {
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      store.prefill(layer, slot_list({slot}), mem.view_of(keys, {1, 60, 2, 64}), mem.view_of(keys, {1, 60, 2, 64}));
      EXPECT_EQ(store.info(layer, slot).values_on, store.info(0, slot).values_on);
    }
  }
  const std::int64_t per_sequence = 2 * (60 / 8 - 1) * 8 * 128 * 4;  // 2 layers x 6 context chunks
  memory_report report = store.memory();
  EXPECT_EQ(report.value_store_device, 2 * per_sequence);
  EXPECT_EQ(report.value_store_host, per_sequence);
  EXPECT_EQ(report.value_store, report.value_store_device + report.value_store_host);

  store.release(slot_list({0}));
  EXPECT_EQ(store.add_sequences(1), slot_list({0}));
  EXPECT_EQ(store.info(0, 0).values_on, value_place::device) << "a released sequence's device budget is reused";
  EXPECT_EQ(store.add_sequences(1), slot_list({3}));
  EXPECT_EQ(store.info(0, 3).values_on, value_place::host) << "the budget holds two sequences";
  report = store.memory();
  EXPECT_EQ(report.value_store_device, per_sequence) << "slot 0 is new and not prefilled yet";
  EXPECT_EQ(report.value_store_host, per_sequence);
}

TEST_P(StorePlacement, FixedPoliciesAndTheDefaultBudget) {
  using shadowkv::value_place;
  {
    kv_store store(placement::small_config(shadowkv::value_store_policy::host, -1), where());
    EXPECT_EQ(placement::places(store, store.add_sequences(4)), std::vector<value_place>(4, value_place::host));
  }
  {
    kv_store store(placement::small_config(shadowkv::value_store_policy::device, 0), where());
    EXPECT_EQ(placement::places(store, store.add_sequences(4)), std::vector<value_place>(4, value_place::device))
        << "the budget limits only value_store=auto";
  }
  {
    // The backend's default budget: on the CPU the device is the host's own memory and "auto" puts every sequence
    // there; on CUDA the sequences whose values fit in the free device memory (all four of these on any real GPU).
    kv_store store(placement::small_config(shadowkv::value_store_policy::auto_place, -1), where());
    const std::int64_t fit = std::min<std::int64_t>(4, store.device_value_budget() / store.value_bytes_per_sequence());
    EXPECT_EQ(fit, 4) << "default budget " << store.device_value_budget() << " bytes";
    std::vector<value_place> want(4, value_place::host);
    std::fill_n(want.begin(), fit, value_place::device);
    EXPECT_EQ(placement::places(store, store.add_sequences(4)), want);
  }
  {
    kv_store store(placement::small_config(shadowkv::value_store_policy::auto_place, 0), where());
    EXPECT_EQ(placement::places(store, store.add_sequences(2)), std::vector<value_place>(2, value_place::host));
  }
  EXPECT_THROW(kv_store(placement::small_config(shadowkv::value_store_policy::auto_place, -2), where()),
               shadowkv::invalid_argument);
  EXPECT_EQ(shadowkv::parse_value_store("auto"), shadowkv::value_store_policy::auto_place);
  EXPECT_EQ(shadowkv::value_store_name(shadowkv::value_store_policy::auto_place), "auto");
  EXPECT_THROW((void)shadowkv::parse_value_store("disk"), shadowkv::invalid_argument);
}

TEST_P(StorePlacement, OutputsDoNotDependOnWhereValuesLive) {
  const std::uint64_t seed = 702;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  kv_store on_host(placement::small_config(shadowkv::value_store_policy::host, -1), where());
  kv_store on_device(placement::small_config(shadowkv::value_store_policy::device, -1), where());
  random_source rng(seed);
  const config& cfg = on_host.get_config();
  const std::vector<int> slots_host = on_host.add_sequences(2);
  const std::vector<int> slots_device = on_device.add_sequences(2);
  const std::vector<float> keys = rng.normals(static_cast<std::size_t>(2 * 70 * cfg.kv_width()));
  const std::vector<float> values = rng.normals(keys.size());
  on_host.prefill(0, slots_host, mem.view_of(keys, {2, 70, 2, 64}), mem.view_of(values, {2, 70, 2, 64}));
  on_device.prefill(0, slots_device, mem.view_of(keys, {2, 70, 2, 64}), mem.view_of(values, {2, 70, 2, 64}));
  double norm = 0.0;
  for (int step = 0; step < 20; ++step) {
    const std::vector<float> q = rng.normals(static_cast<std::size_t>(2 * 4 * 64));
    const std::vector<float> kv = rng.normals(static_cast<std::size_t>(2 * 2 * 64));
    std::vector<float> out_host(q.size());
    std::vector<float> out_device(q.size());
    on_host.decode(0, slots_host, mem.view_of(q, {2, 4, 64}), mem.view_of(kv, {2, 2, 64}), mem.view_of(kv, {2, 2, 64}),
                   mem.mutable_view_of(out_host, {2, 4, 64}));
    on_device.decode(0, slots_device, mem.view_of(q, {2, 4, 64}), mem.view_of(kv, {2, 2, 64}),
                     mem.view_of(kv, {2, 2, 64}), mem.mutable_view_of(out_device, {2, 4, 64}));
    ASSERT_EQ(out_host, out_device) << "step " << step;
    for (const float x : out_host) norm += static_cast<double>(x) * x;
  }
  EXPECT_GT(norm, 0.0);
}

// ---------------------------------------------------------------------------------------------------------------
// a batch prefill equals prefilling its sequences one by one
// ---------------------------------------------------------------------------------------------------------------

class StoreBatchPrefill : public backend_test<> {};
INSTANTIATE_TEST_SUITE_P(Backends, StoreBatchPrefill, ::testing::ValuesIn(all_backends()), backend_name);

// Three ragged prompts, right-padded in one tensor with warm-up queries, go to one store in one call per layer and to
// another in one call per sequence; then both decode the same steps of the whole batch. With "svd" the 150- and
// 133-token prompts take the exact SVD and the 97-token one the Gram path (fewer rows than Hkv*D = 128), so one call
// mixes both solvers. (On CUDA a batch call queues every sequence and reads their cuSOLVER infos once, at its end.)
TEST_P(StoreBatchPrefill, EqualsPrefillingEachSequenceAlone) {
  for (const factorization_method method : {factorization_method::gram, factorization_method::svd}) {
    const std::uint64_t seed = method == factorization_method::gram ? 611 : 612;
    SCOPED_TRACE(std::string(method == factorization_method::gram ? "gram" : "svd") + " seed=" + std::to_string(seed));
    config cfg = twin_config();
    cfg.max_seq_len = 200;
    cfg.kv_dtype = dtype::float32;
    cfg.factorization = method;
    random_source rng(seed);
    kv_store batched(cfg, where());
    kv_store alone(cfg, where());
    const std::vector<int> slots = slot_list({0, 1, 2});
    ASSERT_EQ(batched.add_sequences(3), slots);
    ASSERT_EQ(alone.add_sequences(3), slots);
    const std::vector<std::int64_t> lengths = {150, 97, 133};
    const std::int64_t padded = 150;
    const std::int64_t width = cfg.kv_width();
    const std::int64_t query = static_cast<std::int64_t>(cfg.num_q_heads) * cfg.head_dim;
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      const std::vector<float> keys = rng.normals(static_cast<std::size_t>(3 * padded * width));
      const std::vector<float> values = rng.normals(static_cast<std::size_t>(3 * padded * width));
      const std::vector<float> q_last = rng.normals(static_cast<std::size_t>(3 * query), 3.0F);
      prefill_options options;
      options.lengths = lengths;
      options.q_last = mem.view_of(q_last, {3, 1, cfg.num_q_heads, cfg.head_dim});
      batched.prefill(layer, slots, mem.view_of(keys, {3, padded, cfg.num_kv_heads, cfg.head_dim}),
                      mem.view_of(values, {3, padded, cfg.num_kv_heads, cfg.head_dim}), options);
      for (std::size_t b = 0; b < slots.size(); ++b) {
        const std::int64_t length = lengths[b];
        const auto row = [&](const std::vector<float>& data, std::int64_t stride, std::int64_t count) {
          const auto first = data.begin() + static_cast<std::ptrdiff_t>(static_cast<std::int64_t>(b) * stride);
          return std::vector<float>(first, first + static_cast<std::ptrdiff_t>(count));
        };
        const std::vector<float> own_keys = row(keys, padded * width, length * width);
        const std::vector<float> own_values = row(values, padded * width, length * width);
        const std::vector<float> own_query = row(q_last, query, query);
        prefill_options own;
        own.q_last = mem.view_of(own_query, {1, 1, cfg.num_q_heads, cfg.head_dim});
        alone.prefill(layer, std::vector<int>{slots[b]},
                      mem.view_of(own_keys, {1, length, cfg.num_kv_heads, cfg.head_dim}),
                      mem.view_of(own_values, {1, length, cfg.num_kv_heads, cfg.head_dim}), own);
      }
    }
    const auto expect_same_state = [&](const std::string& when) {
      SCOPED_TRACE(when);
      expect_same_memory(batched.memory(), alone.memory());
      expect_same_stats(batched.stats(), alone.stats());
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        for (const int slot : slots) {
          SCOPED_TRACE("layer=" + std::to_string(layer) + " slot=" + std::to_string(slot));
          expect_same_info(batched.info(layer, slot), alone.info(layer, slot));
          EXPECT_EQ(batched.outlier_chunks(layer, slot), alone.outlier_chunks(layer, slot));
          EXPECT_EQ(batched.selected_chunks(layer, slot), alone.selected_chunks(layer, slot));
        }
      }
    };
    expect_same_state("after prefill");
    double total = 0.0;
    for (int step = 0; step < 20; ++step) {  // window 16: the last steps fold
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        const std::vector<float> q = rng.normals(static_cast<std::size_t>(3 * query), 2.0F);
        const std::vector<float> k = rng.normals(static_cast<std::size_t>(3 * width));
        const std::vector<float> v = rng.normals(static_cast<std::size_t>(3 * width));
        std::vector<float> out_batched(q.size(), -1.0F);
        std::vector<float> out_alone(q.size(), -2.0F);
        for (auto [store, out] : {std::pair{&batched, &out_batched}, std::pair{&alone, &out_alone}}) {
          store->decode(layer, slots, mem.view_of(q, {3, cfg.num_q_heads, cfg.head_dim}),
                        mem.view_of(k, {3, cfg.num_kv_heads, cfg.head_dim}),
                        mem.view_of(v, {3, cfg.num_kv_heads, cfg.head_dim}),
                        mem.mutable_view_of(*out, {3, cfg.num_q_heads, cfg.head_dim}));
        }
        ASSERT_TRUE(all_finite(out_batched)) << "step " << step << " layer " << layer;
        // The same kernels on the same data: equal to float rounding (the backends are deterministic).
        for (std::size_t i = 0; i < out_batched.size(); ++i) {
          ASSERT_NEAR(out_batched[i], out_alone[i], 1e-5) << "step " << step << " layer " << layer << " element " << i;
        }
        total += norm(out_batched);
      }
    }
    EXPECT_GT(total, 0.1);
    expect_same_state("after 20 decode steps");
    EXPECT_GT(batched.stats().folds, 0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// two stores, two threads
// ---------------------------------------------------------------------------------------------------------------

namespace threads {

// One store's whole run on `where`: a 2-layer store, one 300-token prompt per layer (pre-RoPE keys: the prefill
// factorises them through cuBLAS/cuSOLVER on CUDA), then 12 decode steps with folds. Returns every step's output.
std::vector<float> run_alone(shadowkv::device where, std::uint64_t seed) {
  config cfg;
  cfg.num_layers = 2;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 1;
  cfg.max_seq_len = 512;
  cfg.rank = 24;
  cfg.chunk_size = 8;
  cfg.budget = 32;
  cfg.outlier_chunks = 2;
  cfg.local_chunks = 2;
  cfg.generation_window = 16;
  cfg.kv_dtype = dtype::float32;
  const std::int64_t prompt = 300;
  const std::int64_t width = cfg.num_kv_heads * cfg.head_dim;
  backend_memory mem(where);
  kv_store store(cfg, where);
  const std::vector<int> slots = store.add_sequences(1);
  random_source rng(seed);
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    const std::vector<float> keys = rng.normals(static_cast<std::size_t>(prompt * width));
    const std::vector<float> values = rng.normals(static_cast<std::size_t>(prompt * width));
    store.prefill(layer, slots, mem.view_of(keys, {1, prompt, cfg.num_kv_heads, cfg.head_dim}),
                  mem.view_of(values, {1, prompt, cfg.num_kv_heads, cfg.head_dim}), prefill_options{});
  }
  std::vector<float> outputs;
  for (int step = 0; step < 12; ++step) {
    for (int layer = 0; layer < cfg.num_layers; ++layer) {
      const std::vector<float> q = rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim), 2.0F);
      const std::vector<float> k = rng.normals(static_cast<std::size_t>(width));
      const std::vector<float> v = rng.normals(static_cast<std::size_t>(width));
      std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
      store.decode(layer, slots, mem.view_of(q, {1, cfg.num_q_heads, cfg.head_dim}),
                   mem.view_of(k, {1, cfg.num_kv_heads, cfg.head_dim}),
                   mem.view_of(v, {1, cfg.num_kv_heads, cfg.head_dim}),
                   mem.mutable_view_of(out, {1, cfg.num_q_heads, cfg.head_dim}), decode_options{});
      outputs.insert(outputs.end(), out.begin(), out.end());
    }
  }
  return outputs;
}

class StoreThreads : public backend_test<backend_case> {};

TEST_P(StoreThreads, TwoStoresOnTwoThreadsGiveWhatEachGivesAlone) {
  const std::vector<float> alone_a = run_alone(where(), 401);
  const std::vector<float> alone_b = run_alone(where(), 402);
  ASSERT_TRUE(all_finite(alone_a));
  ASSERT_GT(norm(alone_a), 0.1);
  std::vector<float> together_a;
  std::vector<float> together_b;
  std::exception_ptr failure_a;
  std::exception_ptr failure_b;
  // Each thread repeats its run so that the two stores' prefills and decodes overlap in time, not just start together.
  std::thread first([&] {
    try {
      for (int round = 0; round < 3; ++round) together_a = run_alone(where(), 401);
    } catch (...) {
      failure_a = std::current_exception();
    }
  });
  std::thread second([&] {
    try {
      for (int round = 0; round < 3; ++round) together_b = run_alone(where(), 402);
    } catch (...) {
      failure_b = std::current_exception();
    }
  });
  first.join();
  second.join();
  if (failure_a) std::rethrow_exception(failure_a);
  if (failure_b) std::rethrow_exception(failure_b);
  ASSERT_EQ(together_a.size(), alone_a.size());
  ASSERT_EQ(together_b.size(), alone_b.size());
  // The same work on the same device: equal to float rounding (the CUDA kernels are deterministic; a handle bound to
  // the other store's stream would read half-written inputs and miss by far more).
  for (std::size_t i = 0; i < alone_a.size(); ++i) {
    ASSERT_NEAR(together_a[i], alone_a[i], 1e-5) << "store A, element " << i;
    ASSERT_NEAR(together_b[i], alone_b[i], 1e-5) << "store B, element " << i;
  }
}
INSTANTIATE_TEST_SUITE_P(Backends, StoreThreads, ::testing::ValuesIn(all_backends()), backend_name);

}  // namespace threads
