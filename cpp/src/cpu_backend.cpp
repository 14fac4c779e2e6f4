#include "cpu_backend.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "capacity.hpp"
#include "factorization.hpp"
#include "growth.hpp"
#include "low_rank_rows.hpp"
#include "lru_selection_cache.hpp"
#include "row_dots.hpp"
#include "shadowkv/chunk_centroids.hpp"
#include "shadowkv/errors.hpp"
#include "fold_rule.hpp"
#include "shadowkv/generated_region.hpp"
#include "tensor_checks.hpp"

namespace shadowkv::detail {
namespace {

// The outlier criterion of a sink chunk: below every cosine, so sinks are picked first (docs/semantics.md).
constexpr double kSinkCosine = -2.0;

float load(const tensor_view& view, std::int64_t offset) noexcept {
  return load_element(view.data, view.float_type, offset);
}

double dot(const float* a, const float* b, std::int64_t n) noexcept {
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) sum += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return sum;
}

double cosine(const float* a, const float* b, std::int64_t n) noexcept {
  const double norms = std::sqrt(dot(a, a, n)) * std::sqrt(dot(b, b, n));
  return dot(a, b, n) / std::max(norms, 1e-30);
}

// Reserves room for `more` elements in `array` (a host_array or std::vector); when it must grow, by `step` elements
// at once, but not past `limit` elements (growth.hpp).
template <typename Array>
void reserve_more(Array& array, std::int64_t more, std::int64_t step, std::int64_t limit) {
  using count = decltype(array.capacity());
  const auto needed = static_cast<std::int64_t>(array.size()) + more;
  array.reserve(static_cast<count>(grown_capacity(static_cast<std::int64_t>(array.capacity()), needed, step, limit)));
}

// Room for one more exact token (key, value, position), doubling: the region holds at most the local window plus the
// generation window (and, reserved before a step's fold, one token more), which bounds the growth.
void reserve_exact_token(cpu_layer_data& d, const layer_state& state, const config& cfg) {
  const std::int64_t width = cfg.kv_width();
  const std::int64_t most = state.local_len + cfg.generation_window + 1;
  reserve_more(d.exact_keys, width, d.exact_keys.capacity(), most * width);
  reserve_more(d.exact_values, width, d.exact_values.capacity(), most * width);
  reserve_more(d.exact_positions, 1, static_cast<std::int64_t>(d.exact_positions.capacity()), most);
}

// Query head `g` of a group of `group` heads as float64, into column g of the interleaved [D, G] block dot_rows reads:
// out[j * group + g] = element j of the head's vector, which starts at element offset `head` of `view`.
void interleave_query(const tensor_view& view, std::int64_t head, std::int64_t g, std::int64_t group, std::int64_t dim,
                      double* out) noexcept {
  const std::int64_t step = view.strides[static_cast<std::size_t>(view.rank - 1)];
  for (std::int64_t j = 0; j < dim; ++j) out[j * group + g] = load(view, head + j * step);
}

}  // namespace

cpu_backend::cpu_backend(const config& cfg) : config_(cfg), rope_(cfg) {
  layers_.resize(static_cast<std::size_t>(cfg.max_batch));
  values_on_.resize(static_cast<std::size_t>(cfg.max_batch), value_place::host);
}

cpu_layer_data& cpu_backend::data(int slot, int layer) {
  return layers_[static_cast<std::size_t>(slot)][static_cast<std::size_t>(layer)];
}

const cpu_layer_data& cpu_backend::data(int slot, int layer) const {
  return layers_[static_cast<std::size_t>(slot)][static_cast<std::size_t>(layer)];
}

void cpu_backend::open_sequence(int slot, value_place values_on) {
  std::vector<cpu_layer_data> fresh(static_cast<std::size_t>(config_.num_layers));
  layers_[static_cast<std::size_t>(slot)] = std::move(fresh);
  values_on_[static_cast<std::size_t>(slot)] = values_on;
}

std::int64_t cpu_backend::value_bytes_per_sequence() const {
  const std::int64_t runs = config_.max_seq_len / config_.chunk_size * config_.num_kv_heads;
  return static_cast<std::int64_t>(config_.num_layers) * runs * config_.value_run_bytes();
}

std::int64_t cpu_backend::default_device_value_budget() const { return std::numeric_limits<std::int64_t>::max(); }

void cpu_backend::close_sequence(int slot) noexcept {
  std::vector<cpu_layer_data>().swap(layers_[static_cast<std::size_t>(slot)]);
}

cpu_layer_data cpu_backend::prefill_one(const batch_entry& entry, const prefill_inputs& inputs) const {
  const layer_state& state = *entry.state;
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const std::int64_t width = config_.kv_width();
  const std::int64_t chunk = config_.chunk_size;
  const std::int64_t length = state.prompt_len;
  const std::int64_t chunks = state.prompt_context_chunks;
  const std::int64_t context_tokens = chunks * chunk;
  const int rank = config_.rank;
  const dtype type = config_.kv_dtype;
  const std::int64_t b = entry.row;

  // The prompt's compressed state (shared by the sequences a fork makes), then the sequence's own part.
  auto prompt = std::make_shared<cpu_prompt_state>();
  cpu_prompt_state& p = *prompt;
  p.chunks = chunks;
  cpu_layer_data out;
  // Positions.
  std::vector<std::int64_t> positions(static_cast<std::size_t>(length));
  for (std::int64_t t = 0; t < length; ++t) {
    positions[static_cast<std::size_t>(t)] =
        inputs.positions.empty() ? t : load_index(inputs.positions, inputs.positions.offset({b, t}));
  }
  // Pre-RoPE keys [S, Hkv*D] for the factorisation, post-RoPE keys rounded to the storage dtype.
  std::vector<float> keys_pre(static_cast<std::size_t>(length * width));
  std::vector<float> keys_post(static_cast<std::size_t>(length * width));
  for (std::int64_t t = 0; t < length; ++t) {
    for (std::int64_t h = 0; h < heads; ++h) {
      float* pre = keys_pre.data() + t * width + h * dim;
      float* post = keys_post.data() + t * width + h * dim;
      for (std::int64_t d = 0; d < dim; ++d) pre[d] = load(inputs.keys, inputs.keys.offset({b, t, h, d}));
      std::copy(pre, pre + dim, post);
      if (inputs.keys_post_rope) {
        rope_.remove(pre, positions[static_cast<std::size_t>(t)]);
      } else {
        rope_.apply(post, positions[static_cast<std::size_t>(t)]);
      }
      for (std::int64_t d = 0; d < dim; ++d) post[d] = round_to(type, post[d]);
    }
  }
  // The store passes finite inputs only; rotating (or un-rotating, times attention_scaling) keys near the float32
  // limit can still overflow. Reject them here, before anything is stored, rather than fail in the eigensolver.
  const auto finite = [](float x) { return std::isfinite(x); };
  SHADOWKV_EXPECTS(std::all_of(keys_pre.begin(), keys_pre.end(), finite) &&
                       std::all_of(keys_post.begin(), keys_post.end(), finite),
                   "keys of slot ", entry.slot, " are too large: applying or removing RoPE overflows float32");
  auto value_at = [&](std::int64_t t, std::int64_t h, std::int64_t d) {
    return load(inputs.values, inputs.values.offset({b, t, h, d}));
  };

  // Low-rank keys.
  // B is rounded to the factor dtype first and A is the projection onto B as held, so that a prefill and a later
  // fold project onto the same basis; A is then rounded too (docs/semantics.md, "Low-rank factors").
  const dtype factor_type = config_.factor_dtype();
  p.basis = host_array(factor_type);
  const std::vector<float> exact_basis =
      leading_right_singular_vectors(keys_pre.data(), length, width, rank, config_.factorization);
  p.basis.append(static_cast<std::int64_t>(exact_basis.size()), exact_basis.data());
  std::vector<float> basis(exact_basis.size());
  p.basis.load(0, p.basis.size(), basis.data());
  const std::vector<float> coefficients =
      project_onto_basis(keys_pre.data(), context_tokens, width, basis.data(), rank);
  p.coefficients = host_array(factor_type);
  p.coefficients.append(static_cast<std::int64_t>(coefficients.size()), coefficients.data());
  p.context_positions.assign(positions.begin(), positions.begin() + context_tokens);

  // Landmarks (means of the stored post-RoPE keys) and each chunk's minimum cosine to its own keys. With
  // chunk_score = two_centroids the landmark serves the outlier rule only and the chunk's two centroids are stored.
  const bool centroids = config_.chunk_score == chunk_score_rule::two_centroids;
  p.landmarks = host_array(type);
  if (centroids) {
    p.centroid_codes.resize(static_cast<std::size_t>(chunks * heads * 2 * dim));
    p.centroid_scales.resize(static_cast<std::size_t>(chunks * heads * 2));
    p.first_counts.resize(static_cast<std::size_t>(chunks * heads));
  } else {
    p.landmarks.resize(chunks * width);
  }
  std::vector<double> centroid_work(static_cast<std::size_t>(2 * dim));
  std::vector<double> min_cosine(static_cast<std::size_t>(chunks * heads));
  std::vector<float> landmark(static_cast<std::size_t>(dim));
  for (std::int64_t c = 0; c < chunks; ++c) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t d = 0; d < dim; ++d) {
        double sum = 0.0;
        for (std::int64_t i = 0; i < chunk; ++i) sum += keys_post[static_cast<std::size_t>((c * chunk + i) * width + h * dim + d)];
        landmark[static_cast<std::size_t>(d)] = round_to(type, static_cast<float>(sum / static_cast<double>(chunk)));
      }
      if (centroids) {
        const float* first_key = keys_post.data() + (c * chunk) * width + h * dim;
        const auto key = [&](int i, int d) { return first_key[static_cast<std::int64_t>(i) * width + d]; };
        const rules::chunk_centroids made =
            rules::two_means(key, static_cast<int>(chunk), static_cast<int>(dim), centroid_work.data(),
                             p.centroid_codes.data() + (c * heads + h) * 2 * dim);
        p.centroid_scales[static_cast<std::size_t>((c * heads + h) * 2)] = made.scale[0];
        p.centroid_scales[static_cast<std::size_t>((c * heads + h) * 2 + 1)] = made.scale[1];
        p.first_counts[static_cast<std::size_t>(c * heads + h)] = made.first_count;
      } else {
        p.landmarks.store((c * heads + h) * dim, dim, landmark.data());
      }
      double lowest = std::numeric_limits<double>::infinity();
      for (std::int64_t i = 0; i < chunk; ++i) {
        lowest = std::min(lowest, cosine(landmark.data(), keys_post.data() + (c * chunk + i) * width + h * dim, dim));
      }
      min_cosine[static_cast<std::size_t>(c * heads + h)] = lowest;
    }
  }

  // Attention sinks: the first sink_chunks chunks rank below any cosine (>= -1), so they are outliers first.
  const std::int64_t sinks = std::min<std::int64_t>(config_.sink_chunks, state.outlier_chunks);
  for (std::int64_t c = 0; c < sinks; ++c) {
    for (std::int64_t h = 0; h < heads; ++h) min_cosine[static_cast<std::size_t>(c * heads + h)] = kSinkCosine;
  }

  // Outliers: per head the chunks with the lowest minimum cosine (ties: smaller id).
  const std::int64_t outliers = state.outlier_chunks;
  p.outliers.assign(static_cast<std::size_t>(heads), {});
  p.is_outlier.assign(static_cast<std::size_t>(heads), std::vector<std::uint8_t>(static_cast<std::size_t>(chunks), 0));
  p.outlier_keys = host_array(type);
  p.outlier_values = host_array(type);
  p.outlier_keys.resize(heads * outliers * chunk * dim);
  p.outlier_values.resize(heads * outliers * chunk * dim);
  std::vector<std::int64_t> order(static_cast<std::size_t>(chunks));
  for (std::int64_t h = 0; h < heads; ++h) {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) {
      return min_cosine[static_cast<std::size_t>(x * heads + h)] < min_cosine[static_cast<std::size_t>(y * heads + h)];
    });
    std::vector<std::int64_t>& ids = p.outliers[static_cast<std::size_t>(h)];
    ids.assign(order.begin(), order.begin() + outliers);
    std::sort(ids.begin(), ids.end());
    for (std::size_t o = 0; o < ids.size(); ++o) {
      const std::int64_t c = ids[o];
      p.is_outlier[static_cast<std::size_t>(h)][static_cast<std::size_t>(c)] = 1;
      for (std::int64_t i = 0; i < chunk; ++i) {
        const std::int64_t t = c * chunk + i;
        const std::int64_t row = (h * outliers + static_cast<std::int64_t>(o)) * chunk + i;
        p.outlier_keys.store(row * dim, dim, keys_post.data() + t * width + h * dim);
        for (std::int64_t d = 0; d < dim; ++d) p.outlier_values.set(row * dim + d, value_at(t, h, d));
      }
    }
  }

  // Value store of all context chunks, chunk-major.
  p.value_store = value_store_array(type, config_.values_as, chunk * dim);
  p.value_store.reserve_runs(chunks * heads);
  std::vector<float> run(static_cast<std::size_t>(chunk * dim));
  for (std::int64_t c = 0; c < chunks; ++c) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t i = 0; i < chunk; ++i) {
        for (std::int64_t d = 0; d < dim; ++d) run[static_cast<std::size_t>(i * dim + d)] = value_at(c * chunk + i, h, d);
      }
      p.value_store.append_run(run.data());
    }
  }

  // The local window, exact.
  out.exact_keys = host_array(type);
  out.exact_values = host_array(type);
  out.exact_keys.resize(state.local_len * width);
  out.exact_values.resize(state.local_len * width);
  for (std::int64_t i = 0; i < state.local_len; ++i) {
    const std::int64_t t = context_tokens + i;
    out.exact_keys.store(i * width, width, keys_post.data() + t * width);
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t d = 0; d < dim; ++d) out.exact_values.set(i * width + h * dim + d, value_at(t, h, d));
    }
    out.exact_positions.push_back(positions[static_cast<std::size_t>(t)]);
  }
  out.last_position = positions.back();
  out.prompt = std::move(prompt);
  // Folded chunks go to the sequence's own arrays, in the prompt's formats.
  out.coefficients = host_array(factor_type);
  out.landmarks = host_array(type);
  out.value_store = value_store_array(type, config_.values_as, chunk * dim);
  out.prompt_last_position = out.last_position;
  out.journal_keys = host_array(type);
  out.journal_values = host_array(type);

  // An empty selection cache of K slots per head.
  const std::int64_t cache_slots = config_.cache_slots();
  out.cache_chunks.assign(static_cast<std::size_t>(heads * cache_slots), -1);
  out.pending_rebuild.assign(static_cast<std::size_t>(heads * cache_slots), 0);
  out.pending_fetch.assign(static_cast<std::size_t>(heads * cache_slots), 0);
  if (cache_slots > config_.budget_chunks()) {
    out.cache_last_used.assign(static_cast<std::size_t>(heads * cache_slots), 0);
    out.cache_selected.assign(static_cast<std::size_t>(heads * cache_slots), 0);
  }
  out.cache_keys = host_array(type);
  out.cache_values = host_array(type);
  out.cache_keys.resize(heads * cache_slots * chunk * dim);
  out.cache_values.resize(heads * cache_slots * chunk * dim);
  return out;
}

void cpu_backend::prefill(int layer, std::span<const batch_entry> entries, const prefill_inputs& inputs) {
  std::vector<cpu_layer_data> prepared;
  prepared.reserve(entries.size());
  for (const batch_entry& entry : entries) prepared.push_back(prefill_one(entry, inputs));
  for (std::size_t i = 0; i < entries.size(); ++i) data(entries[i].slot, layer) = std::move(prepared[i]);
}

void cpu_backend::fold_oldest_generated_chunk(int layer, std::span<const batch_entry> entries) {
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const std::int64_t width = config_.kv_width();
  const std::int64_t chunk = config_.chunk_size;
  const int rank = config_.rank;

  struct folded_chunk {
    std::vector<float> coefficients;  // [C, r]
    std::vector<float> landmark;      // [Hkv, D] (chunk_score = landmark)
    std::vector<float> values;        // [Hkv, C, D]
    std::vector<std::uint8_t> centroid_codes;  // [Hkv, 2, D] (chunk_score = two_centroids)
    std::vector<float> centroid_scales;        // [Hkv, 2]
    std::vector<std::uint8_t> first_counts;    // [Hkv]
  };
  const bool centroids = config_.chunk_score == chunk_score_rule::two_centroids;
  // Phase 1: compute every fold and reserve all destinations (may throw; nothing changed yet).
  std::vector<folded_chunk> folded(entries.size());
  for (std::size_t e = 0; e < entries.size(); ++e) {
    cpu_layer_data& d = data(entries[e].slot, layer);
    const std::int64_t first = entries[e].state->local_len;  // the oldest generated token
    std::vector<float> keys_pre(static_cast<std::size_t>(chunk * width));
    std::vector<float> keys_post(centroids ? static_cast<std::size_t>(chunk * width) : 0);  // as stored
    std::vector<double> sums(static_cast<std::size_t>(width), 0.0);
    folded[e].values.resize(static_cast<std::size_t>(width * chunk));
    for (std::int64_t i = 0; i < chunk; ++i) {
      const std::int64_t token = first + i;
      float* row = keys_pre.data() + i * width;
      d.exact_keys.load(token * width, width, row);
      if (centroids) std::copy(row, row + width, keys_post.data() + i * width);
      for (std::int64_t j = 0; j < width; ++j) sums[static_cast<std::size_t>(j)] += row[j];
      for (std::int64_t h = 0; h < heads; ++h) {
        rope_.remove(row + h * dim, d.exact_positions[static_cast<std::size_t>(token)]);
        d.exact_values.load(token * width + h * dim, dim, folded[e].values.data() + (h * chunk + i) * dim);
      }
    }
    const host_array& held_basis = d.prompt->basis;
    std::vector<float> basis(static_cast<std::size_t>(held_basis.size()));
    held_basis.load(0, held_basis.size(), basis.data());
    folded[e].coefficients = project_onto_basis(keys_pre.data(), chunk, width, basis.data(), rank);
    if (centroids) {
      folded[e].centroid_codes.resize(static_cast<std::size_t>(heads * 2 * dim));
      folded[e].centroid_scales.resize(static_cast<std::size_t>(heads * 2));
      folded[e].first_counts.resize(static_cast<std::size_t>(heads));
      std::vector<double> work(static_cast<std::size_t>(2 * dim));
      for (std::int64_t h = 0; h < heads; ++h) {
        const auto key = [&](int i, int dd) { return keys_post[static_cast<std::size_t>(i * width + h * dim + dd)]; };
        const rules::chunk_centroids made =
            rules::two_means(key, static_cast<int>(chunk), static_cast<int>(dim), work.data(),
                             folded[e].centroid_codes.data() + h * 2 * dim);
        folded[e].centroid_scales[static_cast<std::size_t>(2 * h)] = made.scale[0];
        folded[e].centroid_scales[static_cast<std::size_t>(2 * h + 1)] = made.scale[1];
        folded[e].first_counts[static_cast<std::size_t>(h)] = made.first_count;
      }
    } else {
      folded[e].landmark.resize(static_cast<std::size_t>(width));
      for (std::int64_t j = 0; j < width; ++j) {
        folded[e].landmark[static_cast<std::size_t>(j)] = static_cast<float>(sums[static_cast<std::size_t>(j)] / static_cast<double>(chunk));
      }
    }
    // Room for a generation window's worth of folds at once (one reallocation per W generated tokens, not one per
    // fold), up to the most chunks a sequence can hold.
    const std::int64_t ahead = config_.generation_window / chunk;
    const std::int64_t most = max_chunks_per_sequence(config_) - d.prompt_chunks();  // folded chunks it can hold
    reserve_more(d.coefficients, chunk * rank, ahead * chunk * rank, most * chunk * rank);
    reserve_more(d.context_positions, chunk, ahead * chunk, most * chunk);
    if (centroids) {
      reserve_more(d.centroid_codes, heads * 2 * dim, ahead * heads * 2 * dim, most * heads * 2 * dim);
      reserve_more(d.centroid_scales, heads * 2, ahead * heads * 2, most * heads * 2);
      reserve_more(d.first_counts, heads, ahead * heads, most * heads);
    } else {
      reserve_more(d.landmarks, width, ahead * width, most * width);
    }
    d.value_store.reserve_runs(
        grown_capacity(d.value_store.capacity_runs(), d.value_store.runs() + heads, ahead * heads, most * heads));
    reserve_more(d.journal_keys, chunk * width, ahead * chunk * width, most * chunk * width);
    reserve_more(d.journal_values, chunk * width, ahead * chunk * width, most * chunk * width);
    reserve_more(d.journal_positions, chunk, ahead * chunk, most * chunk);
  }
  // Phase 2: commit (no allocation beyond the reservations above).
  for (std::size_t e = 0; e < entries.size(); ++e) {
    cpu_layer_data& d = data(entries[e].slot, layer);
    const std::int64_t first = entries[e].state->local_len;
    d.coefficients.append(chunk * rank, folded[e].coefficients.data());
    d.context_positions.insert(d.context_positions.end(), d.exact_positions.begin() + first,
                               d.exact_positions.begin() + first + chunk);
    if (centroids) {
      d.centroid_codes.insert(d.centroid_codes.end(), folded[e].centroid_codes.begin(), folded[e].centroid_codes.end());
      d.centroid_scales.insert(d.centroid_scales.end(), folded[e].centroid_scales.begin(),
                               folded[e].centroid_scales.end());
      d.first_counts.insert(d.first_counts.end(), folded[e].first_counts.begin(), folded[e].first_counts.end());
    } else {
      d.landmarks.append(width, folded[e].landmark.data());
    }
    for (std::int64_t h = 0; h < heads; ++h) d.value_store.append_run(folded[e].values.data() + h * chunk * dim);
    // The exact rows go to the fold journal (truncate brings them back), then leave the exact region.
    d.journal_keys.append_copy(d.exact_keys, first * width, chunk * width);
    d.journal_values.append_copy(d.exact_values, first * width, chunk * width);
    d.journal_positions.insert(d.journal_positions.end(), d.exact_positions.begin() + first,
                               d.exact_positions.begin() + first + chunk);
    if (!keep_full_journal_) trim_journal(d);
    d.exact_keys.erase(first * width, chunk * width);
    d.exact_values.erase(first * width, chunk * width);
    d.exact_positions.erase(d.exact_positions.begin() + first, d.exact_positions.begin() + first + chunk);
  }
}

void cpu_backend::append_token(int layer, std::span<const batch_entry> entries, const append_inputs& inputs) {
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const std::int64_t width = config_.kv_width();
  for (const batch_entry& entry : entries) reserve_exact_token(data(entry.slot, layer), *entry.state, config_);
  std::vector<float>& key = workspace_.token_key;
  std::vector<float>& value = workspace_.token_value;
  key.resize(static_cast<std::size_t>(width));
  value.resize(static_cast<std::size_t>(width));
  for (const batch_entry& entry : entries) {
    cpu_layer_data& d = data(entry.slot, layer);
    const std::int64_t position = inputs.positions.empty()
                                      ? d.last_position + 1
                                      : load_index(inputs.positions, inputs.positions.offset({entry.row}));
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t j = 0; j < dim; ++j) {
        key[static_cast<std::size_t>(h * dim + j)] = load(inputs.keys, inputs.keys.offset({entry.row, h, j}));
        value[static_cast<std::size_t>(h * dim + j)] = load(inputs.values, inputs.values.offset({entry.row, h, j}));
      }
      if (!inputs.keys_post_rope) rope_.apply(key.data() + h * dim, position);
    }
    d.exact_keys.append(width, key.data());
    d.exact_values.append(width, value.data());
    d.exact_positions.push_back(position);
    d.last_position = position;
  }
}

void cpu_backend::select_chunks(int layer, std::span<const batch_entry> entries, const tensor_view& queries) {
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const std::int64_t group = config_.group_size();
  const std::int64_t budget_chunks = config_.budget_chunks();
  const std::int64_t cache_slots = config_.cache_slots();
  const std::int64_t tokens = queries.shape[1];
  const double scale = config_.effective_softmax_scale();
  workspace_.queries.resize(static_cast<std::size_t>(dim * group));  // reserved by reserve_decode / reserve_selection
  workspace_.rows.resize(static_cast<std::size_t>(dot_block_rows * dim));

  for (const batch_entry& entry : entries) {
    cpu_layer_data& d = data(entry.slot, layer);
    const std::int64_t chunks = entry.state->context_chunks;
    for (std::int64_t h = 0; h < heads; ++h) {
      std::vector<std::int64_t>& candidates = workspace_.candidates;
      candidates.clear();
      for (std::int64_t c = 0; c < chunks; ++c) {
        if (!d.is_outlier(h, c)) candidates.push_back(c);
      }
      const auto count = static_cast<std::int64_t>(candidates.size());
      // score(c) = max (or mean: config group_score) over the group's query heads of the softmax probability, summed
      // over query tokens. Each query token's logits of all the group's heads come from one pass over the landmarks.
      const bool mean = config_.group_score == group_combine::mean;
      const bool centroids = config_.chunk_score == chunk_score_rule::two_centroids;
      const std::int64_t chunk_size = config_.chunk_size;
      std::vector<double>& score = workspace_.score;
      std::vector<double>& logits = workspace_.logits;            // [G, count]
      std::vector<double>& probability = workspace_.probability;  // [G, count]
      score.assign(static_cast<std::size_t>(count), 0.0);
      logits.resize(static_cast<std::size_t>(group * count));
      probability.assign(static_cast<std::size_t>(group * count), 0.0);
      const auto landmark_at = [&](std::int64_t i, float* room) {
        return d.landmark(candidates[static_cast<std::size_t>(i)], h, heads, dim, room);
      };
      // two_centroids: row 2i + m is candidate i's decoded centroid m (shadowkv/chunk_centroids.hpp).
      const auto centroid_at = [&](std::int64_t row, float* room) {
        const std::int64_t c = candidates[static_cast<std::size_t>(row / 2)];
        const std::uint8_t* codes = d.centroid_codes_of(c, h, row % 2, heads, dim);
        const float centroid_scale = d.centroid_scale_of(c, h, row % 2, heads);
        for (std::int64_t j = 0; j < dim; ++j) room[j] = rules::centroid_element(codes[j], centroid_scale);
        return static_cast<const float*>(room);
      };
      std::vector<double>& pair_logits = workspace_.pair_logits;  // [G, 2 * count]
      if (centroids) pair_logits.resize(static_cast<std::size_t>(group * 2 * count));
      for (std::int64_t t = 0; t < tokens && count > 0; ++t) {
        for (std::int64_t g = 0; g < group; ++g) {
          interleave_query(queries, queries.offset({entry.row, t, h * group + g, 0}), g, group, dim,
                           workspace_.queries.data());
        }
        if (centroids) {
          dot_rows(centroid_at, 2 * count, workspace_.queries.data(), group, dim, workspace_.rows.data(),
                   pair_logits.data(), 2 * count);
          // x = log(w1 exp(s q.c1) + w2 exp(s q.c2)) = logaddexp(s q.c1 + log w1, s q.c2 + log w2).
          for (std::int64_t i = 0; i < count; ++i) {
            const std::int64_t n1 = d.first_count_of(candidates[static_cast<std::size_t>(i)], h, heads);
            const double log_w1 = n1 > 0 ? std::log(static_cast<double>(n1) / static_cast<double>(chunk_size))
                                         : -std::numeric_limits<double>::infinity();
            const double log_w2 = n1 < chunk_size
                                      ? std::log(static_cast<double>(chunk_size - n1) / static_cast<double>(chunk_size))
                                      : -std::numeric_limits<double>::infinity();
            for (std::int64_t g = 0; g < group; ++g) {
              const double a = scale * pair_logits[static_cast<std::size_t>(g * 2 * count + 2 * i)] + log_w1;
              const double b = scale * pair_logits[static_cast<std::size_t>(g * 2 * count + 2 * i + 1)] + log_w2;
              const double top = std::max(a, b);
              logits[static_cast<std::size_t>(g * count + i)] = top + std::log(std::exp(a - top) + std::exp(b - top));
            }
          }
        } else {
          dot_rows(landmark_at, count, workspace_.queries.data(), group, dim, workspace_.rows.data(), logits.data(),
                   count);
        }
        for (std::int64_t g = 0; g < group; ++g) {
          double* head_logits = logits.data() + g * count;
          double* head_probability = probability.data() + g * count;
          double largest = -std::numeric_limits<double>::infinity();
          for (std::int64_t i = 0; i < count; ++i) {
            if (!centroids) head_logits[i] = scale * head_logits[i];  // the centroids' logits are scaled already
            largest = std::max(largest, head_logits[i]);
          }
          double total = 0.0;
          for (std::int64_t i = 0; i < count; ++i) {
            head_logits[i] = std::exp(head_logits[i] - largest);
            total += head_logits[i];
          }
          for (std::int64_t i = 0; i < count; ++i) head_probability[i] += head_logits[i] / total;
        }
      }
      for (std::int64_t g = 0; g < group && count > 0; ++g) {
        const double* head_probability = probability.data() + g * count;
        for (std::int64_t i = 0; i < count; ++i) {
          double& s = score[static_cast<std::size_t>(i)];
          s = mean ? s + head_probability[i] : std::max(s, head_probability[i]);
        }
      }
      if (mean) {
        for (double& s : score) s /= static_cast<double>(group);
      }
      // Top-k by descending score, ties by smaller chunk id (candidates are ascending, so a stable sort keeps it).
      std::vector<std::int64_t>& order = workspace_.order;
      order.resize(static_cast<std::size_t>(count));
      std::iota(order.begin(), order.end(), 0);
      // (stable_sort's buffer comes from a non-throwing allocation; without one it sorts in place.)
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) {
        return score[static_cast<std::size_t>(x)] > score[static_cast<std::size_t>(y)];
      });
      std::vector<std::int64_t>& selected = workspace_.selected;
      selected.clear();
      for (std::int64_t i = 0; i < std::min(budget_chunks, count); ++i) {
        selected.push_back(candidates[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]);
      }
      std::sort(selected.begin(), selected.end());

      std::vector<std::uint8_t>& cached = workspace_.cached;
      if (!d.cache_selected.empty()) {
        // K > k slots: chunks stay until evicted, least recently selected first (lru_selection_cache.hpp).
        const auto first = static_cast<std::size_t>(h * cache_slots);
        const auto slots = static_cast<std::size_t>(cache_slots);
        const lru_cache_slots view{std::span(d.cache_chunks).subspan(first, slots),
                                   std::span(d.cache_last_used).subspan(first, slots),
                                   std::span(d.cache_selected).subspan(first, slots),
                                   std::span(d.pending_rebuild).subspan(first, slots),
                                   std::span(d.pending_fetch).subspan(first, slots)};
        cached.resize(selected.size());
        const std::int64_t hits = assign_lru_slots(selected, d.selection_steps + 1, view, cached);
        stats_.hits += hits;
        stats_.misses += static_cast<std::int64_t>(selected.size()) - hits;
        continue;
      }
      // Temporal cache: selected chunks already in a slot are hits; the others take freed slots.
      std::int64_t* slots = d.cache_chunks.data() + h * budget_chunks;
      std::uint8_t* rebuild = d.pending_rebuild.data() + h * budget_chunks;
      std::uint8_t* fetch = d.pending_fetch.data() + h * budget_chunks;
      cached.assign(selected.size(), 0);
      for (std::int64_t s = 0; s < budget_chunks; ++s) {
        rebuild[s] = 0;
        fetch[s] = 0;
        if (slots[s] < 0) continue;
        const auto found = std::lower_bound(selected.begin(), selected.end(), slots[s]);
        if (found != selected.end() && *found == slots[s]) {
          cached[static_cast<std::size_t>(found - selected.begin())] = 1;
          stats_.hits += 1;
        } else {
          slots[s] = -1;
        }
      }
      std::int64_t free_slot = 0;
      for (std::size_t i = 0; i < selected.size(); ++i) {
        if (cached[i] != 0) continue;
        while (slots[free_slot] >= 0) ++free_slot;
        slots[free_slot] = selected[i];
        rebuild[free_slot] = 1;
        fetch[free_slot] = 1;
        stats_.misses += 1;
      }
    }
    d.selection_steps += 1;
    stats_.selections += 1;
  }
}

void cpu_backend::fetch_values(int layer, std::span<const batch_entry> entries) {
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t run = static_cast<std::int64_t>(config_.chunk_size) * config_.head_dim;
  const std::int64_t cache_slots = config_.cache_slots();
  for (const batch_entry& entry : entries) {
    cpu_layer_data& d = data(entry.slot, layer);
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t s = 0; s < cache_slots; ++s) {
        const std::size_t index = static_cast<std::size_t>(h * cache_slots + s);
        if (d.pending_fetch[index] == 0) continue;
        const std::int64_t c = d.cache_chunks[index];
        d.read_value_run(c, h, heads, d.cache_values, static_cast<std::int64_t>(index) * run);
        d.pending_fetch[index] = 0;
        stats_.bytes_fetched += d.value_store.run_bytes();
      }
    }
  }
}

void cpu_backend::rebuild_keys(int layer, std::span<const batch_entry> entries) {
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const std::int64_t width = config_.kv_width();
  const std::int64_t chunk = config_.chunk_size;
  const std::int64_t cache_slots = config_.cache_slots();
  const std::int64_t rank = config_.rank;
  // Work buffers reserved by reserve_decode / reserve_selection.
  workspace_.gathered.resize(static_cast<std::size_t>(chunk * rank));
  workspace_.rebuilt.resize(static_cast<std::size_t>(chunk * dim));
  float* keys = workspace_.rebuilt.data();
  for (const batch_entry& entry : entries) {
    cpu_layer_data& d = data(entry.slot, layer);
    const host_array& held_basis = d.prompt->basis;
    workspace_.basis.resize(static_cast<std::size_t>(held_basis.size()));
    const float* basis = held_basis.floats(0, held_basis.size(), workspace_.basis.data());
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t s = 0; s < cache_slots; ++s) {
        const auto index = static_cast<std::size_t>(h * cache_slots + s);
        if (d.pending_rebuild[index] == 0) continue;
        const std::int64_t c = d.cache_chunks[index];
        const float* a = d.coefficient_rows(c, chunk, rank, workspace_.gathered.data());
        low_rank_rows(a, chunk, rank, basis + h * dim, width, dim, keys);
        for (std::int64_t i = 0; i < chunk; ++i) {
          float* key = keys + i * dim;
          rope_.apply(key, d.context_position(c, i, chunk));
          d.cache_keys.store(((h * cache_slots + s) * chunk + i) * dim, dim, key);
        }
        d.pending_rebuild[index] = 0;
        stats_.chunks_rebuilt += 1;
      }
    }
  }
}

void cpu_backend::attend(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                         const mutable_tensor_view& out) {
  attend_token(layer, entries, queries, out, 0);
}

void cpu_backend::trim_journal(cpu_layer_data& d) const noexcept {
  const std::int64_t width = config_.kv_width();
  const std::int64_t keep = config_.journal_chunks() * config_.chunk_size;
  const auto rows = static_cast<std::int64_t>(d.journal_positions.size());
  if (rows <= keep) return;
  d.journal_keys.erase(0, (rows - keep) * width);
  d.journal_values.erase(0, (rows - keep) * width);
  d.journal_positions.erase(d.journal_positions.begin(), d.journal_positions.begin() + (rows - keep));
}

void cpu_backend::end_extend(int layer, std::span<const batch_entry> entries) {
  keep_full_journal_ = false;
  for (const batch_entry& entry : entries) trim_journal(data(entry.slot, layer));
}

void cpu_backend::extend_block(int layer, std::span<const batch_entry> entries, const block_inputs& inputs,
                               const mutable_tensor_view& out) {
  std::vector<layer_state> states(entries.size());
  std::vector<batch_entry> local(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    states[i] = *entries[i].state;
    local[i] = {entries[i].slot, entries[i].row, &states[i]};
  }
  try {
    run_block(layer, local, states, inputs, out);
  } catch (...) {
    // All or nothing: put the block's tokens back out (the journal holds the block's folds: reserve_extend).
    std::vector<layer_state> before(entries.size());
    for (std::size_t i = 0; i < entries.size(); ++i) before[i] = *entries[i].state;
    truncate_generated(layer, local, before);
    throw;
  }
}

void cpu_backend::run_block(int layer, std::span<const batch_entry> entries, std::span<layer_state> states,
                            const block_inputs& inputs, const mutable_tensor_view& out) {
  const std::int64_t tokens = inputs.queries.shape[1];
  const auto window = static_cast<std::int64_t>(config_.generation_window);
  const auto chunk = static_cast<std::int64_t>(config_.chunk_size);
  std::vector<std::int64_t> exact_before(entries.size());
  const auto fold = [&](const std::vector<std::size_t>& which) {
    if (which.empty()) return;
    std::vector<batch_entry> due;
    for (const std::size_t i : which) due.push_back(entries[i]);
    fold_oldest_generated_chunk(layer, due);
    for (const std::size_t i : which) {
      const rules::generated_region<std::int64_t> folded = rules::after_fold(
          rules::generated_region<std::int64_t>{states[i].context_chunks, states[i].generated_exact_len, 0}, chunk,
          window);
      states[i].context_chunks = folded.context_chunks;
      states[i].generated_exact_len = folded.exact_len;
    }
  };
  // 1. Fold a full region, as decode does.
  std::vector<std::size_t> due;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    exact_before[i] = states[i].generated_exact_len;
    if (rules::fold_due<std::int64_t>(states[i].generated_exact_len, window)) due.push_back(i);
  }
  fold(due);
  // 2. Append the block's tokens.
  for (std::int64_t t = 0; t < tokens; ++t) {
    const tensor_view positions = inputs.positions.empty() ? tensor_view{} : select_token(inputs.positions, t);
    append_token(layer, entries,
                 append_inputs{select_token(inputs.keys, t), select_token(inputs.values, t), positions,
                               inputs.keys_post_rope});
    for (layer_state& state : states) {
      state.generated_total += 1;
      state.generated_exact_len += 1;
    }
  }
  // 3. One selection with the block's queries; 4. the causal attention of each of them.
  select_chunks(layer, entries, inputs.queries);
  fetch_values(layer, entries);
  rebuild_keys(layer, entries);
  attend_block(layer, entries, inputs.queries, out);
  // 5. Fold down to what `tokens` decode steps leave.
  while (true) {
    due.clear();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::int64_t target = advance_generated(exact_before[i], tokens, window, chunk).generated_exact_len;
      if (states[i].generated_exact_len > target) due.push_back(i);
    }
    if (due.empty()) break;
    fold(due);
  }
}

void cpu_backend::attend_block(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                               const mutable_tensor_view& out) {
  const std::int64_t tokens = queries.shape[1];
  for (std::int64_t t = 0; t < tokens; ++t) {
    attend_token(layer, entries, select_token(queries, t), select_token(out, t), tokens - 1 - t);
  }
}

void cpu_backend::attend_token(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                               const mutable_tensor_view& out, std::int64_t exact_rows_hidden) {
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const std::int64_t width = config_.kv_width();
  const std::int64_t chunk = config_.chunk_size;
  const std::int64_t cache_slots = config_.cache_slots();
  const std::int64_t group = config_.group_size();
  const double scale = config_.effective_softmax_scale();
  workspace_.queries.resize(static_cast<std::size_t>(dim * group));  // reserved by reserve_decode
  workspace_.rows.resize(static_cast<std::size_t>(dot_block_rows * dim));

  for (const batch_entry& entry : entries) {
    const cpu_layer_data& d = data(entry.slot, layer);
    const std::int64_t outlier_rows = entry.state->outlier_chunks * chunk;
    const std::int64_t exact_rows = d.exact_keys.size() / width - exact_rows_hidden;
    for (std::int64_t h = 0; h < heads; ++h) {
      // The union, each token once, as (array, element offset of its key/value row).
      using source = attention_source;
      std::vector<source>& union_rows = workspace_.union_rows;
      union_rows.clear();
      for (std::int64_t i = 0; i < outlier_rows; ++i) {
        union_rows.push_back({&d.prompt->outlier_keys, &d.prompt->outlier_values, (h * outlier_rows + i) * dim});
      }
      for (std::int64_t i = 0; i < exact_rows; ++i) {
        union_rows.push_back({&d.exact_keys, &d.exact_values, i * width + h * dim});
      }
      // The selected chunks in ascending chunk id, whichever slots hold them: the sum's order, and so the output, does
      // not depend on the selection cache's history (docs/semantics.md, Decode 6; truncate relies on it).
      std::vector<std::int64_t>& attended = workspace_.attended_slots;
      attended.clear();
      for (std::int64_t s = 0; s < cache_slots; ++s) {
        if (d.slot_selected(static_cast<std::size_t>(h * cache_slots + s))) attended.push_back(s);
      }
      std::sort(attended.begin(), attended.end(), [&](std::int64_t x, std::int64_t y) {
        return d.cache_chunks[static_cast<std::size_t>(h * cache_slots + x)] <
               d.cache_chunks[static_cast<std::size_t>(h * cache_slots + y)];
      });
      for (const std::int64_t s : attended) {
        for (std::int64_t i = 0; i < chunk; ++i) {
          union_rows.push_back({&d.cache_keys, &d.cache_values, ((h * cache_slots + s) * chunk + i) * dim});
        }
      }
      const auto count = static_cast<std::int64_t>(union_rows.size());
      // Logits of all the group's query heads from one pass over the keys, then each head's softmax.
      std::vector<double>& weights = workspace_.weights;          // [G, count]
      std::vector<double>& accumulator = workspace_.accumulator;  // [G, D]
      std::vector<double>& total = workspace_.total;              // [G]
      weights.resize(static_cast<std::size_t>(group * count));
      accumulator.assign(static_cast<std::size_t>(group * dim), 0.0);
      total.resize(static_cast<std::size_t>(group));
      for (std::int64_t g = 0; g < group; ++g) {
        interleave_query(queries, queries.offset({entry.row, h * group + g, 0}), g, group, dim,
                         workspace_.queries.data());
      }
      const auto key_at = [&](std::int64_t i, float* room) {
        const source& src = union_rows[static_cast<std::size_t>(i)];
        return src.keys->floats(src.offset, dim, room);
      };
      dot_rows(key_at, count, workspace_.queries.data(), group, dim, workspace_.rows.data(), weights.data(), count);
      for (std::int64_t g = 0; g < group; ++g) {
        double* head_weights = weights.data() + g * count;
        double largest = -std::numeric_limits<double>::infinity();
        for (std::int64_t i = 0; i < count; ++i) {
          head_weights[i] = scale * head_weights[i];
          largest = std::max(largest, head_weights[i]);
        }
        double sum = 0.0;
        for (std::int64_t i = 0; i < count; ++i) {
          head_weights[i] = std::exp(head_weights[i] - largest);
          sum += head_weights[i];
        }
        total[static_cast<std::size_t>(g)] = sum;
      }
      // Values: each row read once for all the group's heads, added in the union's order.
      for (std::int64_t i = 0; i < count; ++i) {
        const source& src = union_rows[static_cast<std::size_t>(i)];
        const float* value = src.values->floats(src.offset, dim, workspace_.rows.data());
        for (std::int64_t g = 0; g < group; ++g) {
          const double w = weights[static_cast<std::size_t>(g * count + i)] / total[static_cast<std::size_t>(g)];
          double* head_accumulator = accumulator.data() + g * dim;
          for (std::int64_t j = 0; j < dim; ++j) head_accumulator[j] += w * value[j];
        }
      }
      for (std::int64_t g = 0; g < group; ++g) {
        const std::int64_t q_head = h * group + g;
        for (std::int64_t j = 0; j < dim; ++j) {
          store_element(out.mutable_data(), out.float_type, out.offset({entry.row, q_head, j}),
                        static_cast<float>(accumulator[static_cast<std::size_t>(g * dim + j)]));
        }
      }
    }
  }
}

bool cpu_backend::all_finite(const tensor_view& view) {
  // Any rank up to 4, any strides: walk the view as [1, ..., 1, shape...].
  std::array<std::int64_t, max_tensor_rank> shape{1, 1, 1, 1};
  std::array<std::int64_t, max_tensor_rank> strides{0, 0, 0, 0};
  const int first = max_tensor_rank - view.rank;
  for (int dim = 0; dim < view.rank; ++dim) {
    shape[static_cast<std::size_t>(first + dim)] = view.shape[static_cast<std::size_t>(dim)];
    strides[static_cast<std::size_t>(first + dim)] = view.strides[static_cast<std::size_t>(dim)];
  }
  for (std::int64_t i0 = 0; i0 < shape[0]; ++i0) {
    for (std::int64_t i1 = 0; i1 < shape[1]; ++i1) {
      for (std::int64_t i2 = 0; i2 < shape[2]; ++i2) {
        const std::int64_t base = i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
        for (std::int64_t i3 = 0; i3 < shape[3]; ++i3) {
          if (!std::isfinite(load(view, base + i3 * strides[3]))) return false;
        }
      }
    }
  }
  return true;
}

void cpu_backend::reserve_workspace(std::int64_t chunks, std::int64_t union_rows) {
  const auto width = static_cast<std::size_t>(config_.kv_width());
  const auto dim = static_cast<std::size_t>(config_.head_dim);
  const auto group = static_cast<std::size_t>(config_.group_size());
  const auto budget_chunks = static_cast<std::size_t>(config_.budget_chunks());
  const auto n = static_cast<std::size_t>(chunks);
  cpu_workspace& w = workspace_;
  w.token_key.reserve(width);
  w.token_value.reserve(width);
  w.candidates.reserve(n);
  w.score.reserve(n);
  w.logits.reserve(group * n);
  w.probability.reserve(group * n);
  if (config_.chunk_score == chunk_score_rule::two_centroids) w.pair_logits.reserve(2 * group * n);
  w.order.reserve(n);
  w.selected.reserve(budget_chunks);
  w.cached.reserve(budget_chunks);
  w.queries.reserve(dim * group);
  w.rows.reserve(static_cast<std::size_t>(dot_block_rows) * dim);
  w.gathered.reserve(static_cast<std::size_t>(config_.chunk_size) * static_cast<std::size_t>(config_.rank));
  w.basis.reserve(static_cast<std::size_t>(config_.rank) * width);
  w.rebuilt.reserve(static_cast<std::size_t>(config_.chunk_size) * dim);
  w.union_rows.reserve(static_cast<std::size_t>(union_rows));
  w.weights.reserve(group * static_cast<std::size_t>(union_rows));
  w.accumulator.reserve(group * dim);
  w.total.reserve(group);
  w.attended_slots.reserve(static_cast<std::size_t>(config_.cache_slots()));
}

void cpu_backend::reserve_decode(int layer, std::span<const batch_entry> entries) {
  const std::int64_t chunk = config_.chunk_size;
  std::int64_t chunks = 0;
  std::int64_t union_rows = 0;
  for (const batch_entry& entry : entries) {
    const layer_state& state = *entry.state;  // before the step: at most one fold and one token more
    chunks = std::max(chunks, state.context_chunks + 1);
    const std::int64_t exact_rows = state.local_len + state.generated_exact_len + 1;
    union_rows = std::max(union_rows, state.outlier_chunks * chunk + exact_rows + config_.budget);
  }
  reserve_workspace(chunks, union_rows);
  for (const batch_entry& entry : entries) reserve_exact_token(data(entry.slot, layer), *entry.state, config_);
}

void cpu_backend::reserve_extend(int layer, std::span<const batch_entry> entries,
                                 std::span<const std::int64_t> tokens) {
  const std::int64_t chunk = config_.chunk_size;
  const std::int64_t width = config_.kv_width();
  const std::int64_t rank = config_.rank;
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const std::int64_t window = config_.generation_window;
  const bool centroids = config_.chunk_score == chunk_score_rule::two_centroids;
  std::int64_t chunks = 0;
  std::int64_t union_rows = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const layer_state& state = *entries[i].state;
    const std::int64_t block = std::min<std::int64_t>(config_.extend_block, tokens[i]);
    const std::int64_t folds = advance_generated(state.generated_exact_len, tokens[i], window, chunk).folds;
    chunks = std::max(chunks, state.context_chunks + folds);
    // A block appends up to `block` tokens to a region of at most W - 1 (after its first fold).
    const std::int64_t exact_rows = state.local_len + window + block;
    union_rows = std::max(union_rows, state.outlier_chunks * chunk + exact_rows + config_.budget);
    cpu_layer_data& d = data(entries[i].slot, layer);
    d.exact_keys.reserve(exact_rows * width);
    d.exact_values.reserve(exact_rows * width);
    d.exact_positions.reserve(static_cast<std::size_t>(exact_rows));
    if (folds == 0) continue;
    // Every fold of the call, so that the folds' commits do not reallocate.
    d.coefficients.reserve(d.coefficients.size() + folds * chunk * rank);
    d.context_positions.reserve(d.context_positions.size() + static_cast<std::size_t>(folds * chunk));
    if (centroids) {
      d.centroid_codes.reserve(d.centroid_codes.size() + static_cast<std::size_t>(folds * heads * 2 * dim));
      d.centroid_scales.reserve(d.centroid_scales.size() + static_cast<std::size_t>(folds * heads * 2));
      d.first_counts.reserve(d.first_counts.size() + static_cast<std::size_t>(folds * heads));
    } else {
      d.landmarks.reserve(d.landmarks.size() + folds * width);
    }
    d.value_store.reserve_runs(d.value_store.runs() + folds * heads);
    d.journal_keys.reserve(d.journal_keys.size() + folds * chunk * width);
    d.journal_values.reserve(d.journal_values.size() + folds * chunk * width);
    d.journal_positions.reserve(d.journal_positions.size() + static_cast<std::size_t>(folds * chunk));
  }
  reserve_workspace(chunks + 1, union_rows);
  keep_full_journal_ = true;  // until end_extend: the store may undo the whole call
}

void cpu_backend::reserve_truncate(int layer, std::span<const batch_entry> entries,
                                   std::span<const layer_state> targets) {
  const std::int64_t width = config_.kv_width();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    cpu_layer_data& d = data(entries[i].slot, layer);
    const std::int64_t rows = targets[i].local_len + targets[i].generated_exact_len;
    d.exact_keys.reserve(rows * width);
    d.exact_values.reserve(rows * width);
    d.exact_positions.reserve(static_cast<std::size_t>(rows));
  }
}

void cpu_backend::truncate_generated(int layer, std::span<const batch_entry> entries,
                                     std::span<const layer_state> targets) {
  const std::int64_t chunk = config_.chunk_size;
  const std::int64_t width = config_.kv_width();
  const std::int64_t rank = config_.rank;
  const std::int64_t heads = config_.num_kv_heads;
  const std::int64_t dim = config_.head_dim;
  const bool centroids = config_.chunk_score == chunk_score_rule::two_centroids;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    cpu_layer_data& d = data(entries[i].slot, layer);
    const layer_state& now = *entries[i].state;
    const layer_state& target = targets[i];
    const std::int64_t local = now.local_len;
    // Generated tokens: [0, folded) in the journal, [folded, total) exact. After: [0, kept_folded) and
    // [kept_folded, target total).
    const std::int64_t folded = (now.context_chunks - now.prompt_context_chunks) * chunk;
    const std::int64_t kept_folded = (target.context_chunks - now.prompt_context_chunks) * chunk;
    const std::int64_t undone = now.context_chunks - target.context_chunks;
    // 1. Drop the exact tokens past the target (those still exact).
    const std::int64_t keep_exact = std::max<std::int64_t>(0, target.generated_total - folded);
    d.exact_keys.resize((local + keep_exact) * width);
    d.exact_values.resize((local + keep_exact) * width);
    d.exact_positions.resize(static_cast<std::size_t>(local + keep_exact));
    // 2. Undo the folds past the target, newest first: the chunks leave the compressed store and the journal's rows
    //    up to the target's length come back in front of the exact generated tokens.
    if (undone > 0) {
      // The journal holds the generated tokens [folded - journal rows, folded); the store checked it reaches back
      // to kept_folded.
      const std::int64_t back = std::min(folded, target.generated_total) - kept_folded;
      const std::int64_t first = kept_folded - (folded - static_cast<std::int64_t>(d.journal_positions.size()));
      d.exact_keys.insert_copy(local * width, d.journal_keys, first * width, back * width);
      d.exact_values.insert_copy(local * width, d.journal_values, first * width, back * width);
      d.exact_positions.insert(d.exact_positions.begin() + local, d.journal_positions.begin() + first,
                               d.journal_positions.begin() + first + back);
      d.journal_keys.resize(first * width);
      d.journal_values.resize(first * width);
      d.journal_positions.resize(static_cast<std::size_t>(first));
      const std::int64_t chunks = target.context_chunks;
      const std::int64_t folded_chunks = chunks - d.prompt_chunks();  // the own arrays hold the folded chunks
      d.coefficients.resize(folded_chunks * chunk * rank);
      d.context_positions.resize(static_cast<std::size_t>(folded_chunks * chunk));
      if (centroids) {
        d.centroid_codes.resize(static_cast<std::size_t>(folded_chunks * heads * 2 * dim));
        d.centroid_scales.resize(static_cast<std::size_t>(folded_chunks * heads * 2));
        d.first_counts.resize(static_cast<std::size_t>(folded_chunks * heads));
      } else {
        d.landmarks.resize(folded_chunks * width);
      }
      d.value_store.pop_runs(undone * heads);
      // Undone chunks leave the selection cache; the chunks kept there are unchanged.
      for (std::size_t slot = 0; slot < d.cache_chunks.size(); ++slot) {
        if (d.cache_chunks[slot] < chunks) continue;
        d.cache_chunks[slot] = -1;
        d.pending_rebuild[slot] = 0;
        d.pending_fetch[slot] = 0;
        if (!d.cache_selected.empty()) {
          d.cache_selected[slot] = 0;
          d.cache_last_used[slot] = 0;
        }
      }
    }
    d.last_position = target.generated_total == 0 ? d.prompt_last_position : d.exact_positions.back();
  }
}

void cpu_backend::reserve_selection(int /*layer*/, std::span<const batch_entry> entries) {
  std::int64_t chunks = 0;
  for (const batch_entry& entry : entries) chunks = std::max(chunks, entry.state->context_chunks);
  reserve_workspace(chunks, 0);
}

chunk_ids_per_head cpu_backend::selected_chunks(int layer, int slot) const {
  const cpu_layer_data& d = data(slot, layer);
  const std::int64_t cache_slots = config_.cache_slots();
  chunk_ids_per_head result(static_cast<std::size_t>(config_.num_kv_heads));
  if (d.cache_chunks.empty()) return result;
  for (std::int64_t h = 0; h < config_.num_kv_heads; ++h) {
    for (std::int64_t s = 0; s < cache_slots; ++s) {
      const auto index = static_cast<std::size_t>(h * cache_slots + s);
      if (d.slot_selected(index)) result[static_cast<std::size_t>(h)].push_back(d.cache_chunks[index]);
    }
    std::sort(result[static_cast<std::size_t>(h)].begin(), result[static_cast<std::size_t>(h)].end());
  }
  return result;
}

chunk_ids_per_head cpu_backend::outlier_chunks(int layer, int slot) const {
  const cpu_layer_data& d = data(slot, layer);
  if (!d.prefilled()) return chunk_ids_per_head(static_cast<std::size_t>(config_.num_kv_heads));
  return d.prompt->outliers;
}

std::int64_t cpu_backend::last_position(int layer, int slot) const { return data(slot, layer).last_position; }

// Reports what the containers really hold (not the formulas): the tests compare it with docs/semantics.md. A prompt
// state that several of `layers` share (a fork's family) is counted once, and its bytes once more in `shared`.
memory_report cpu_backend::memory(std::span<const stored_layer> layers) const {
  memory_report report;
  const std::int64_t token_bytes = config_.kv_width() * 2 * static_cast<std::int64_t>(dtype_size(config_.kv_dtype));
  std::unordered_map<const cpu_prompt_state*, int> holders;  // prompt state -> the layers of `layers` holding it
  for (const stored_layer& entry : layers) {
    const cpu_layer_data& d = data(entry.slot, entry.layer);
    if (!d.prefilled()) continue;
    const bool on_device = values_on_[static_cast<std::size_t>(entry.slot)] == value_place::device;
    const cpu_prompt_state& prompt = *d.prompt;
    const int holding = ++holders[&prompt];
    if (holding == 1) {
      report.low_rank_factors += prompt.factor_bytes();
      report.landmarks += prompt.landmark_bytes();
      report.outliers += prompt.outlier_bytes();
      report.value_store += prompt.value_store.bytes();
      (on_device ? report.value_store_device : report.value_store_host) += prompt.value_store.bytes();
    } else if (holding == 2) {
      report.shared += prompt.bytes();
    }
    report.low_rank_factors += d.coefficients.bytes();
    report.landmarks += d.landmarks.bytes() + static_cast<std::int64_t>(d.centroid_codes.size()) +
                        static_cast<std::int64_t>(d.centroid_scales.size() * sizeof(float)) +
                        static_cast<std::int64_t>(d.first_counts.size());
    report.exact_tokens += d.exact_keys.bytes() + d.exact_values.bytes();
    report.value_store += d.value_store.bytes();
    (on_device ? report.value_store_device : report.value_store_host) += d.value_store.bytes();
    report.selection_cache += d.cache_keys.bytes() + d.cache_values.bytes();
    report.fold_journal += d.journal_keys.bytes() + d.journal_values.bytes();
    // Each sequence's tokens, shared or not: what the sequences would take as plain KV caches.
    const auto tokens = static_cast<std::int64_t>(prompt.context_positions.size() + d.context_positions.size() +
                                                  d.exact_positions.size());
    report.full_attention_equivalent += tokens * token_bytes;
  }
  return report;
}

void cpu_backend::fork_sequence(int source, std::span<const int> children, std::span<const layer_state> /*layers*/) {
  // Every child's layers first (copies of the own parts; the prompt states by reference), then the commit, which
  // cannot throw: running out of memory opens no child.
  const std::vector<cpu_layer_data>& from = layers_[static_cast<std::size_t>(source)];
  std::vector<std::vector<cpu_layer_data>> made;
  made.reserve(children.size());
  for (std::size_t i = 0; i < children.size(); ++i) made.push_back(from);
  for (std::size_t i = 0; i < children.size(); ++i) {
    const auto child = static_cast<std::size_t>(children[i]);
    layers_[child] = std::move(made[i]);
    values_on_[child] = values_on_[static_cast<std::size_t>(source)];
  }
}

std::int64_t cpu_backend::forked_value_bytes(std::span<const layer_state> layers) const {
  // A child shares the prompt's value runs: it holds (at capacity) the runs of the chunks it can still fold.
  std::int64_t shared = 0;
  for (const layer_state& state : layers) {
    shared += state.prompt_context_chunks * config_.num_kv_heads * config_.value_run_bytes();
  }
  return value_bytes_per_sequence() - shared;
}

}  // namespace shadowkv::detail
