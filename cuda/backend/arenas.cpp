// The CUDA backend's memory: the (slot, layer) arenas and the decode workspace reserved when the store is built, the
// value stores of sequences that join (open_sequence) and leave (close_sequence), and the memory report.
#include <algorithm>
#include <cstdint>

#include "backend_support.hpp"
#include "chunk_selection.cuh"
#include "cuda_backend.hpp"
#include "prompt_kernels.cuh"
#include "rope_table.cuh"
#include "shadowkv/chunk_centroids.hpp"
#include "shadowkv/rope.hpp"
#include "sparse_attention.cuh"

namespace shadowkv::cuda {

using backend_support::align_up;
using backend_support::device_guard;
using backend_support::kWorkspaceCounters;

namespace {

// Positions the key rebuild's RoPE table covers (rope_table.cuh): every position a sequence of the store's capacity
// numbers (0 .. max_seq_len - 1), up to kRopeTableMaxBytes; rows past it compute their coefficients. (Without the
// table every row computed its float64 sine and cosine: docs/performance.md; session 13.)
constexpr std::size_t kRopeTableMaxBytes = std::size_t{256} << 20;
long long rope_table_positions(const dims& d) {
  const std::size_t per_position = rope_table_bytes(d, 1);
  if (per_position == 0) return 0;
  const long long capacity = static_cast<long long>(d.max_chunks) * d.chunk;
  return std::min<long long>(capacity, static_cast<long long>(kRopeTableMaxBytes / per_position));
}

}  // namespace

// Bytes of every array of one (slot, layer), each aligned.
struct cuda_backend::layer_sizes {
  std::size_t basis, coefficients, context_positions, landmarks, centroid_codes, centroid_scales, first_counts,
      is_outlier, outlier, exact, exact_positions, cache_chunks, slot_of_chunk, cache, cache_last_used,
      selection_clock, selected_slots, selection_hint, value_store, value_codes, journal, journal_positions;

  explicit layer_sizes(const dims& d, std::size_t element) {
    const std::size_t width = static_cast<std::size_t>(d.kv_heads) * d.head_dim;
    const std::size_t context_tokens = static_cast<std::size_t>(d.max_chunks) * d.chunk;
    const std::size_t factor = d.factor_bf16 != 0 ? 2 : sizeof(float);
    basis = align_up(static_cast<std::size_t>(d.rank) * width * factor);
    coefficients = align_up(context_tokens * d.rank * factor);
    context_positions = align_up(context_tokens * sizeof(long long));
    // Landmarks, or with two-centroid scores (dims::chunk_centroids) the centroids in their place.
    const bool centroids = d.chunk_centroids != 0;
    const std::size_t head_chunks = static_cast<std::size_t>(d.kv_heads) * d.max_chunks;
    landmarks = centroids ? 0 : align_up(static_cast<std::size_t>(d.max_chunks) * width * element);
    centroid_codes = centroids ? align_up(head_chunks * 2 * d.head_dim) : 0;
    centroid_scales = centroids ? align_up(head_chunks * 2 * sizeof(float)) : 0;
    first_counts = centroids ? align_up(head_chunks) : 0;
    is_outlier = align_up(static_cast<std::size_t>(d.kv_heads) * d.max_chunks);
    outlier = align_up(static_cast<std::size_t>(d.max_outliers) * d.chunk * width * element);
    exact = align_up(static_cast<std::size_t>(d.local_capacity + d.window) * width * element);
    exact_positions = align_up(static_cast<std::size_t>(d.local_capacity + d.window) * sizeof(long long));
    // The selection cache: K = cache_slots slots per head; the LRU state only when K > k (none when K == k, so
    // that the default cache's arena is what it was before larger caches existed).
    cache_chunks = align_up(static_cast<std::size_t>(d.kv_heads) * d.cache_slots * sizeof(int));
    slot_of_chunk = align_up(static_cast<std::size_t>(d.kv_heads) * d.max_chunks * sizeof(int));
    cache = align_up(static_cast<std::size_t>(d.cache_slots) * d.chunk * width * element);
    const bool lru = d.cache_slots > d.budget;
    cache_last_used = lru ? align_up(static_cast<std::size_t>(d.kv_heads) * d.cache_slots * sizeof(long long)) : 0;
    selection_clock = lru ? align_up(static_cast<std::size_t>(d.kv_heads) * sizeof(long long)) : 0;
    selected_slots = lru ? align_up(static_cast<std::size_t>(d.kv_heads) * d.budget * sizeof(int)) : 0;
    selection_hint = align_up(static_cast<std::size_t>(d.kv_heads) * sizeof(unsigned));
    // The fold journal: keys or values of journal_chunks chunks, and their positions.
    const std::size_t journal_rows = static_cast<std::size_t>(d.journal_chunks) * d.chunk;
    journal = align_up(journal_rows * width * element);
    journal_positions = align_up(journal_rows * sizeof(long long));
    // The value store: T [max_chunks, Hkv, C, D], or fp8 codes of the same shape then float scales [max_chunks, Hkv].
    value_codes = align_up(context_tokens * width * (d.value_fp8 != 0 ? 1 : element));
    value_store = value_codes +
                  (d.value_fp8 != 0 ? align_up(static_cast<std::size_t>(d.max_chunks) * d.kv_heads * sizeof(float)) : 0);
  }
  [[nodiscard]] std::size_t device_total() const {
    return basis + coefficients + context_positions + landmarks + centroid_codes + centroid_scales + first_counts +
           is_outlier + 2 * outlier + 2 * exact +
           exact_positions + cache_chunks + slot_of_chunk + 2 * cache + cache_last_used + selection_clock +
           selected_slots + selection_hint + 2 * journal + journal_positions;
  }
};

void cuda_backend::reserve_memory() {
  const config& cfg = config_;
  const std::size_t element = dtype_size(cfg.kv_dtype);
  const layer_sizes sizes(dims_, element);
  const std::size_t layers = static_cast<std::size_t>(cfg.max_batch) * cfg.num_layers;
  arena_ = device_buffer(sizes.device_total() * layers, own_stream_, resources_->device_memory());
  value_layer_bytes_ = sizes.value_store;
  value_codes_bytes_ = sizes.value_codes;
  values_.resize(static_cast<std::size_t>(cfg.max_batch));
  prompt_values_.resize(static_cast<std::size_t>(cfg.max_batch));
  arena_slot_bytes_ = sizes.device_total() * static_cast<std::size_t>(cfg.num_layers);
  values_on_.resize(static_cast<std::size_t>(cfg.max_batch), value_place::host);
  views_ = device_buffer(sizeof(layer_view) * layers, own_stream_, resources_->device_memory());
  host_views_.resize(layers);
  auto* cursor = static_cast<std::uint8_t*>(arena_.data());
  auto take = [&cursor](std::size_t bytes) {
    void* pointer = cursor;
    cursor += bytes;
    return pointer;
  };
  for (std::size_t i = 0; i < layers; ++i) {
    layer_view& v = host_views_[i];
    v = layer_view{};
    v.basis = take(sizes.basis);
    v.coefficients = take(sizes.coefficients);
    v.context_positions = static_cast<long long*>(take(sizes.context_positions));
    v.landmarks = sizes.landmarks > 0 ? take(sizes.landmarks) : nullptr;
    if (dims_.chunk_centroids != 0) {
      v.centroid_codes = static_cast<std::uint8_t*>(take(sizes.centroid_codes));
      v.centroid_scales = static_cast<float*>(take(sizes.centroid_scales));
      v.first_counts = static_cast<std::uint8_t*>(take(sizes.first_counts));
    }
    v.is_outlier = static_cast<std::uint8_t*>(take(sizes.is_outlier));
    v.outlier_keys = take(sizes.outlier);
    v.outlier_values = take(sizes.outlier);
    v.exact_keys = take(sizes.exact);
    v.exact_values = take(sizes.exact);
    v.exact_positions = static_cast<long long*>(take(sizes.exact_positions));
    v.cache_chunks = static_cast<int*>(take(sizes.cache_chunks));
    v.slot_of_chunk = static_cast<int*>(take(sizes.slot_of_chunk));
    v.cache_keys = take(sizes.cache);
    v.cache_values = take(sizes.cache);
    if (dims_.cache_slots > dims_.budget) {
      v.cache_last_used = static_cast<long long*>(take(sizes.cache_last_used));
      v.selection_clock = static_cast<long long*>(take(sizes.selection_clock));
      v.selected_slots = static_cast<int*>(take(sizes.selected_slots));
    }
    v.selection_hint = static_cast<unsigned*>(take(sizes.selection_hint));
    v.journal_keys = take(sizes.journal);
    v.journal_values = take(sizes.journal);
    v.journal_positions = static_cast<long long*>(take(sizes.journal_positions));
    v.value_store = nullptr;  // set when a sequence joins the slot
  }
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(views_.data(), host_views_.data(), sizeof(layer_view) * layers,
                                    cudaMemcpyHostToDevice, own_stream_));

  // Decode workspace for max_batch sequences.
  const std::size_t batch = static_cast<std::size_t>(cfg.max_batch);
  // Room for the key rebuild's partials after the attention's, for the steps that are fused (fuse_step;
  // sparse_attention_partials).
  workspace_.max_splits = sparse_attention_partials(dims_, kv_type_);
  const std::size_t logits = align_up(batch * cfg.num_q_heads * dims_.max_chunks * sizeof(float));
  const std::size_t scores = align_up(batch * cfg.num_kv_heads * dims_.max_chunks * sizeof(float));
  const std::size_t lists = align_up(batch * cfg.num_kv_heads * cfg.budget_chunks() * sizeof(int));
  const std::size_t counts = align_up(batch * cfg.num_kv_heads * sizeof(int));
  const std::size_t counters = align_up(kWorkspaceCounters * sizeof(unsigned long long));
  const std::size_t claims = align_up(2 * sizeof(unsigned));
  const std::size_t partial =
      align_up(batch * cfg.num_q_heads * workspace_.max_splits * (cfg.head_dim + 2) * sizeof(float));
  // The chunk selection's own rows, as it says it needs them (on this device: the radix keys' place depends on its
  // shared memory).
  const selection_workspace_bytes selection = chunk_selection_workspace(dims_, kv_type_, cfg.max_batch);
  const std::size_t selection_partials = align_up(selection.partials);
  const std::size_t radix_keys = align_up(selection.radix_keys);
  const long long table_positions = rope_table_positions(dims_);
  const std::size_t rope_table = align_up(rope_table_bytes(dims_, table_positions));
  workspace_memory_ = device_buffer(logits + scores + 2 * lists + counts + counters + claims + partial +
                                        selection_partials + radix_keys + rope_table,
                                    own_stream_, resources_->device_memory());
  cursor = static_cast<std::uint8_t*>(workspace_memory_.data());
  workspace_.logits = static_cast<float*>(take(logits));
  workspace_.scores = static_cast<float*>(take(scores));
  workspace_.selected = static_cast<int*>(take(lists));
  workspace_.miss_slots = static_cast<int*>(take(lists));
  workspace_.miss_counts = static_cast<int*>(take(counts));
  workspace_.counters = static_cast<unsigned long long*>(take(counters));
  workspace_.hinted_selections = workspace_.counters + 4;
  workspace_.logits_claims = static_cast<unsigned*>(take(claims));
  workspace_.partial = static_cast<float*>(take(partial));
  workspace_.selection_partials = selection_partials > 0 ? static_cast<float*>(take(selection_partials)) : nullptr;
  workspace_.radix_keys = radix_keys > 0 ? static_cast<unsigned*>(take(radix_keys)) : nullptr;
  workspace_.rope_table = rope_table > 0 ? static_cast<const float2*>(take(rope_table)) : nullptr;
  workspace_.rope_table_positions = rope_table > 0 ? table_positions : 0;
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(workspace_.counters, 0, counters, own_stream_));
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(workspace_.logits_claims, 0, claims, own_stream_));
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(workspace_.miss_counts, 0, counts, own_stream_));

  const rope_rotation rope(cfg);
  inv_freq_ = device_buffer(rope.inv_freq().size() * sizeof(float), own_stream_, resources_->device_memory());
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(inv_freq_.data(), rope.inv_freq().data(), rope.inv_freq().size() * sizeof(float),
                                    cudaMemcpyHostToDevice, own_stream_));
  if (workspace_.rope_table != nullptr) {
    launch_build_rope_table(dims_, static_cast<const float*>(inv_freq_.data()),
                            const_cast<float2*>(workspace_.rope_table), workspace_.rope_table_positions, own_stream_);
  }
  batch_slots_ = device_buffer(batch * sizeof(int), own_stream_, resources_->device_memory());
  batch_staging_ = host_buffer(batch * sizeof(int), resources_->host_memory());
  solver_infos_ = device_buffer(batch * sizeof(int), own_stream_, resources_->device_memory());
  solver_infos_host_ = host_buffer(batch * sizeof(int), resources_->host_memory());
  key_stats_ = device_buffer(batch * sizeof(key_stats), own_stream_, resources_->device_memory());
  key_stats_host_ = host_buffer(batch * sizeof(key_stats), resources_->host_memory());
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));

  // value_store="auto" without a budget: what is free now, less a margin for the caller's own work (activations,
  // the model's workspaces): 5% of the device, at least 2 GiB.
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  SHADOWKV_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  const std::size_t margin = std::max<std::size_t>(std::size_t{2} << 30, total_bytes / 20);
  device_margin_ = static_cast<std::int64_t>(margin);
  default_value_budget_ = free_bytes > margin ? static_cast<std::int64_t>(free_bytes - margin) : 0;
}

bool cuda_backend::device_has_room(std::int64_t bytes) const {
  device_guard guard(device_);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  SHADOWKV_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<std::int64_t>(free_bytes) >= bytes + device_margin_;
}

layer_view* cuda_backend::device_view(int slot, int layer) const {
  return static_cast<layer_view*>(views_.data()) + static_cast<std::ptrdiff_t>(slot) * config_.num_layers + layer;
}

std::int64_t cuda_backend::value_bytes_per_sequence() const {
  return static_cast<std::int64_t>(value_layer_bytes_) * config_.num_layers;
}

std::size_t cuda_backend::value_runs_bytes(int chunks) const {
  const std::size_t runs = static_cast<std::size_t>(chunks) * config_.num_kv_heads;
  const std::size_t run_elements = static_cast<std::size_t>(config_.chunk_size) * config_.head_dim;
  if (dims_.value_fp8 == 0) return align_up(runs * run_elements * dtype_size(config_.kv_dtype));
  return value_scales_offset(chunks) + align_up(runs * sizeof(float));
}

std::size_t cuda_backend::value_scales_offset(int chunks) const {
  const std::size_t runs = static_cast<std::size_t>(chunks) * config_.num_kv_heads;
  return align_up(runs * static_cast<std::size_t>(config_.chunk_size) * config_.head_dim);
}

std::int64_t cuda_backend::forked_value_bytes(std::span<const layer_state> layers) const {
  // What allocate_values takes for a child (keeping.cpp): each layer's runs of the chunks it can still fold.
  std::int64_t bytes = 0;
  for (const layer_state& state : layers) {
    bytes += static_cast<std::int64_t>(value_runs_bytes(dims_.max_chunks - static_cast<int>(state.prompt_context_chunks)));
  }
  return bytes;
}

std::shared_ptr<cuda_backend::value_allocation> cuda_backend::allocate_values(value_place where,
                                                                              std::span<const int> own_chunks) const {
  std::size_t bytes = 0;
  if (own_chunks.empty()) {
    bytes = value_layer_bytes_ * static_cast<std::size_t>(config_.num_layers);
  } else {
    for (const int chunks : own_chunks) bytes += value_runs_bytes(chunks);
  }
  bytes = std::max<std::size_t>(bytes, 1);
  auto values = std::make_shared<value_allocation>();
  if (where == value_place::device) {
    values->device = device_buffer(bytes, own_stream_, resources_->device_memory());
  } else {
    values->host = host_buffer(bytes, resources_->host_memory());
  }
  return values;
}

void cuda_backend::open_sequence(int slot, value_place values_on) {
  // Arenas are reserved for every slot when the store is built (prefill initialises a layer's arrays); the value
  // store is allocated here, before anything of the slot changes.
  device_guard guard(device_);
  std::shared_ptr<value_allocation> values = allocate_values(values_on);
  const std::size_t first = static_cast<std::size_t>(slot) * config_.num_layers;
  std::vector<layer_view> views(host_views_.begin() + static_cast<std::ptrdiff_t>(first),
                                host_views_.begin() + static_cast<std::ptrdiff_t>(first + config_.num_layers));
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    std::uint8_t* layer_base = values->base() + static_cast<std::size_t>(layer) * value_layer_bytes_;
    layer_view& view = views[static_cast<std::size_t>(layer)];
    view.value_store = layer_base;
    view.value_scales = dims_.value_fp8 != 0 ? reinterpret_cast<float*>(layer_base + value_codes_bytes_) : nullptr;
    view.shared_value_store = nullptr;
    view.shared_value_scales = nullptr;
    view.shared_value_chunks = 0;
  }
  // The slot's views (fresh counters, the new value store) go to the device before any kernel can read them.
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(device_view(slot, 0), views.data(), views.size() * sizeof(layer_view),
                                    cudaMemcpyHostToDevice, own_stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
  std::copy(views.begin(), views.end(), host_views_.begin() + static_cast<std::ptrdiff_t>(first));
  values_[static_cast<std::size_t>(slot)] = std::move(values);
  prompt_values_[static_cast<std::size_t>(slot)].reset();
  values_on_[static_cast<std::size_t>(slot)] = values_on;
}

void cuda_backend::close_sequence(int slot) noexcept {
  // Kernels of earlier calls may still read the value store: wait for both streams before freeing it (or before
  // dropping this sequence's hold on a value store it shares with a fork family).
  (void)cudaSetDevice(device_);
  (void)cudaStreamSynchronize(stream_);
  (void)cudaStreamSynchronize(copy_stream_);
  values_[static_cast<std::size_t>(slot)].reset();
  prompt_values_[static_cast<std::size_t>(slot)].reset();
  (void)cudaStreamSynchronize(own_stream_);
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    layer_view& view = host_view(slot, layer);
    view.value_store = nullptr;
    view.value_scales = nullptr;
    view.shared_value_store = nullptr;
    view.shared_value_scales = nullptr;
    view.shared_value_chunks = 0;
  }
}

memory_report cuda_backend::memory(std::span<const stored_layer> layers) const {
  // In use by the documented formulas (docs/semantics.md), plus what is reserved for the configured capacity. Of a
  // fork family only the value store's prompt runs are shared (keeping.cpp): counted once per (family, layer), and
  // in `shared` when more than one live sequence reads them.
  memory_report report;
  struct family_layer {
    const value_allocation* family;
    int layer;
    int readers;
    std::int64_t bytes;
    value_place place;
  };
  std::vector<family_layer> families;
  const std::int64_t e = static_cast<std::int64_t>(dtype_size(config_.kv_dtype));
  const std::int64_t width = config_.kv_width();
  const std::int64_t chunk = config_.chunk_size;
  const std::int64_t rank = config_.rank;
  for (const stored_layer& entry : layers) {
    const layer_state* state = entry.state;
    const std::int64_t context_tokens = state->context_chunks * chunk;
    report.low_rank_factors +=
        (context_tokens * rank + rank * width) * static_cast<std::int64_t>(dtype_size(config_.factor_dtype()));
    report.landmarks += dims_.chunk_centroids != 0
                            ? state->context_chunks * config_.num_kv_heads * rules::centroid_bytes(config_.head_dim)
                            : state->context_chunks * width * e;
    report.outliers += state->outlier_chunks * chunk * width * 2 * e;
    report.exact_tokens += (state->local_len + state->generated_exact_len) * width * 2 * e;
    const std::int64_t run_bytes = config_.num_kv_heads * config_.value_run_bytes();
    const std::int64_t own = (state->context_chunks - state->prompt_context_chunks) * run_bytes;
    report.value_store += own;
    (state->values_on == value_place::device ? report.value_store_device : report.value_store_host) += own;
    const auto slot = static_cast<std::size_t>(entry.slot);
    const value_allocation* family = prompt_values_[slot] != nullptr ? prompt_values_[slot].get() : values_[slot].get();
    auto known = std::find_if(families.begin(), families.end(), [&](const family_layer& f) {
      return f.family == family && f.layer == entry.layer;
    });
    if (known == families.end()) {
      families.push_back({family, entry.layer, 1, state->prompt_context_chunks * run_bytes, state->values_on});
    } else {
      ++known->readers;
    }
    report.selection_cache += config_.cache_slots() * chunk * width * 2 * e;
    report.fold_journal += state->journal_chunks * chunk * width * 2 * e;
    report.full_attention_equivalent += state->total_len() * width * 2 * e;
  }
  for (const family_layer& f : families) {
    report.value_store += f.bytes;
    (f.place == value_place::device ? report.value_store_device : report.value_store_host) += f.bytes;
    if (f.readers > 1) report.shared += f.bytes;
  }
  report.device_reserved = static_cast<std::int64_t>(arena_.size() + views_.size() + workspace_memory_.size());
  // Each value store once, however many sequences of a fork family hold it.
  std::vector<const value_allocation*> counted;
  auto count = [&](const std::shared_ptr<value_allocation>& values) {
    if (values == nullptr || std::find(counted.begin(), counted.end(), values.get()) != counted.end()) return;
    counted.push_back(values.get());
    report.device_reserved += static_cast<std::int64_t>(values->device.size());
    report.host_reserved += static_cast<std::int64_t>(values->host.size());
  };
  for (const auto& values : values_) count(values);
  for (const auto& values : prompt_values_) count(values);
  return report;
}

}  // namespace shadowkv::cuda
