// Micro-benchmarks (a)–(e) of one layer's decode step, one launcher at a time, on device state laid out exactly as
// the CUDA backend lays it out (device_layout.cuh), for the docs/performance.md shapes:
//
//   select_chunks              (a) landmark scores + top-k + temporal-cache scan (launch_select_chunks), compute stream
//   rebuild_keys               (b) A[rows]·B + RoPE of the missed chunks (launch_rebuild_keys), compute stream
//   fetch_values_zero_copy     (c) the backend's kernel reading missed runs from pinned mapped memory, copy stream
//   fetch_values_batched_copy  (d) end to end: pack the miss lists, copy them to the host, wait, then ONE
//                                  cudaMemcpyBatchAsync of every missed (chunk, head) run, copy stream
//   fetch_values_copy_per_run  (d') the same with one cudaMemcpyAsync per run
//   sparse_attention           (e) exact attention over outliers ∪ local ∪ selected ∪ generated (launch_sparse_attention)
//
// The temporal hit rate is steered exactly: the selection for the benchmark's fixed query is computed once from an
// empty cache; the "previous step" cache of each (sequence, head) then holds round(hit * k) of those chunks and
// k - round(hit * k) other candidate chunks, in shuffled slots. Restoring that cache and selecting again gives the
// step's miss lists, which (b)–(d) read. (a) restores the previous-step cache before every timed launch (untimed).
//
// Each benchmark iteration is one launch (or one end-to-end copy path) timed with CUDA events on its stream; the
// first call of each op is a warm-up (module loading), untimed. Values live in pinned, mapped host memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "chunk_rebuild.cuh"
#include "chunk_selection.cuh"
#include "device_layout.cuh"
#include "sparse_attention.cuh"
#include "value_fetch.cuh"

namespace shadowkv::bench {
namespace {

using cuda::dims;
using cuda::layer_view;
using cuda::step_workspace;
using cuda::strided_tensor;

constexpr double kMinTime = 0.05;  // seconds of measured (manual) time per benchmark
constexpr std::size_t kAlignment = 256;
/// Sub-batch size if the driver refuses one cudaMemcpyBatchAsync of every run (no documented limit; a fallback).
constexpr std::size_t kFallbackBatch = 4096;

std::size_t align_up(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

/// Per (entry, head) of the batch: [count, (slot, chunk) x count] of the step's misses, for the host's copy list.
/// Entry b's layer view is views[batch_slots[b] * num_layers + layer], as in the backend.
__global__ void pack_miss_runs_kernel(const layer_view* views, const int* batch_slots, int num_layers, int layer,
                                      int kv_heads, int budget, step_workspace workspace, int* packed) {
  const int h = static_cast<int>(blockIdx.x);
  const int b = static_cast<int>(blockIdx.y);
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * num_layers + layer;
  const int entry = b * kv_heads + h;
  const int count = workspace.miss_counts[entry];
  int* row = packed + static_cast<long long>(entry) * (1 + 2 * budget);
  if (threadIdx.x == 0) row[0] = count;
  const int* slots = workspace.miss_slots + static_cast<long long>(entry) * budget;
  for (int m = static_cast<int>(threadIdx.x); m < count; m += static_cast<int>(blockDim.x)) {
    const int slot = slots[m];
    row[1 + 2 * m] = slot;
    row[2 + 2 * m] = view->cache_chunks[h * budget + slot];
  }
}

/// One arena per array kind, `stride` bytes (aligned) per sequence.
struct arena {
  device_memory memory;
  std::size_t stride = 0;
  arena() = default;
  arena(std::size_t per_sequence, int batch) : stride(align_up(per_sequence)) {
    memory = device_memory(stride * static_cast<std::size_t>(batch));
  }
  template <typename T = void>
  T* at(int b) const {
    return reinterpret_cast<T*>(memory.get<std::uint8_t>() + stride * static_cast<std::size_t>(b));
  }
};

/// Device state of one shape: B sequences of one layer, prefilled (random data), plus the step workspace.
class kernel_state {
 public:
  explicit kernel_state(const shape& s);
  ~kernel_state() {
    (void)cudaStreamSynchronize(compute_);
    (void)cudaStreamSynchronize(copy_);
    (void)cudaStreamDestroy(compute_);
    (void)cudaStreamDestroy(copy_);
  }
  kernel_state(const kernel_state&) = delete;
  kernel_state& operator=(const kernel_state&) = delete;

  [[nodiscard]] const shape& which() const { return shape_; }
  [[nodiscard]] cudaStream_t compute() const { return compute_; }
  [[nodiscard]] cudaStream_t copy() const { return copy_; }

  /// Puts back the cache of the step before (for `hit`) on the compute stream.
  void restore_previous_step(double hit);
  void select() {
    cuda::launch_select_chunks(d_, cuda::element_bf16, views_.get<layer_view>(), batch_slots_.get<int>(), 0,
                               shape_.batch, query_tensor(), 1, workspace_, 0, compute_);
  }
  /// Leaves the state right after this step's selection at `hit` (miss lists and cache), and measures the hits.
  void ensure_selected(double hit);
  [[nodiscard]] double measured_hit() const { return hits_ + misses_ > 0 ? hits_ / (hits_ + misses_) : 0.0; }
  [[nodiscard]] double misses() const { return misses_; }

  void rebuild() {
    cuda::launch_rebuild_keys(d_, cuda::element_bf16, views_.get<layer_view>(), batch_slots_.get<int>(), 0,
                              shape_.batch, workspace_, inv_freq_.get<float>(), compute_);
  }
  void fetch_zero_copy() {
    cuda::launch_fetch_values(d_, cuda::element_bf16, views_.get<layer_view>(), batch_slots_.get<int>(), 0,
                              shape_.batch, workspace_, fetch_ctas(), 0, copy_);
  }
  /// The backend's value-fetch grid for host values (cuda_backend.cpp, fetch_ctas_for_host_values): a quarter of the
  /// multiprocessors, at least 8.
  static int fetch_ctas() {
    int device = 0;
    int multiprocessors = 0;
    (void)cudaGetDevice(&device);
    (void)cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
    return std::max(8, multiprocessors / 4);
  }
  /// The end-to-end copy path on the copy stream, between timer.start and timer.stop; returns seconds.
  double fetch_by_copies(bool batched, event_timer& timer, std::size_t* api_calls);
  void attend() {
    const long long q_stride = static_cast<long long>(shape::q_heads) * shape::head_dim;
    const strided_tensor q{query_.get(), cuda::element_bf16, {q_stride, shape::head_dim, 1, 0}};
    const strided_tensor out{out_.get(), cuda::element_bf16, {q_stride, shape::head_dim, 1, 0}};
    cuda::launch_sparse_attention(d_, cuda::element_bf16, views_.get<layer_view>(), batch_slots_.get<int>(), 0,
                                  shape_.batch, q, out, workspace_.partial, workspace_.max_splits, compute_);
  }
  /// Both copy paths must leave the cache values exactly as the zero-copy kernel does (checked once per hit rate).
  void verify_copy_path(double hit, bool batched);

  /// Bytes of A rows read, basis read and keys written by the rebuild of `misses` runs.
  [[nodiscard]] double rebuild_bytes() const {
    return misses_ * shape::chunk * (shape::rank * 4.0 + shape::head_dim * 2.0) +
           static_cast<double>(shape_.batch) * shape::kv_heads * shape::rank * shape::head_dim * 4.0;
  }
  /// Tokens each (sequence, KV head) attends to.
  [[nodiscard]] int attended_tokens() const {
    return shape::outliers * shape::chunk + shape_.local_len() + kGenerated + shape_.budget_chunks() * shape::chunk;
  }

 private:
  static constexpr int kGenerated = 1;  // the new token, just appended

  [[nodiscard]] strided_tensor query_tensor() const {
    const long long row = static_cast<long long>(shape::q_heads) * shape::head_dim;
    return {query_.get(), cuda::element_bf16, {row, row, shape::head_dim, 1}};  // [B, 1, Hq, D]
  }
  void build_previous_step(double hit);
  void issue_batch(std::size_t count, std::size_t* api_calls);

  shape shape_;
  dims d_{};
  int max_chunks_ = 0;
  cudaStream_t compute_ = nullptr;
  cudaStream_t copy_ = nullptr;

  arena coefficients_, basis_, context_positions_, landmarks_, is_outlier_, outlier_keys_, outlier_values_,
      exact_keys_, exact_values_, exact_positions_, cache_chunks_, slot_of_chunk_, cache_keys_, cache_values_;
  pinned_memory value_store_;
  std::size_t value_store_stride_ = 0;
  device_memory views_, batch_slots_, inv_freq_, query_, out_;
  device_memory logits_, scores_, selected_, miss_slots_, miss_counts_, counters_, partial_, selection_partials_,
      radix_keys_;
  step_workspace workspace_{};
  std::vector<layer_view> host_views_;

  std::vector<int> selection_;  // [B, Hkv, k] of the fixed query
  struct previous_step {
    double hit;
    device_memory cache_chunks;   // same layout as cache_chunks_
    device_memory slot_of_chunk;  // same layout as slot_of_chunk_
  };
  std::vector<previous_step> previous_;
  double selected_hit_ = -1;
  double hits_ = 0;
  double misses_ = 0;
  std::vector<double> verified_;

  device_memory packed_;
  pinned_memory packed_host_;
  std::vector<void*> copy_targets_;
  std::vector<const void*> copy_sources_;
  std::vector<std::size_t> copy_sizes_;
  std::size_t batch_limit_ = SIZE_MAX;
};

kernel_state::kernel_state(const shape& s) : shape_(s) {
  const int B = s.batch;
  const int Hkv = shape::kv_heads;
  const int D = shape::head_dim;
  const int C = shape::chunk;
  const int k = s.budget_chunks();
  max_chunks_ = s.prompt_chunks();
  const std::size_t width = static_cast<std::size_t>(Hkv) * D;
  const std::size_t tokens = static_cast<std::size_t>(max_chunks_) * C;
  const std::size_t e = shape::element_bytes;

  d_.num_layers = 1;
  d_.q_heads = shape::q_heads;
  d_.kv_heads = Hkv;
  d_.head_dim = D;
  d_.group = shape::q_heads / Hkv;
  d_.chunk = C;
  d_.budget = k;
  d_.cache_slots = k;  // the default cache (K == k): slot stride k below
  d_.max_outliers = shape::outliers;
  d_.rank = shape::rank;
  d_.window = shape::generation_window;
  d_.local_capacity = (shape::local_chunks + 1) * C - 1;
  d_.max_chunks = max_chunks_;
  d_.rotary_dim = D;
  d_.rope_interleaved = 0;
  d_.attention_scaling = 1.0F;
  d_.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));

  check(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  check(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");

  const std::size_t exact_rows = static_cast<std::size_t>(d_.local_capacity + d_.window);
  coefficients_ = arena(tokens * shape::rank * sizeof(float), B);
  basis_ = arena(static_cast<std::size_t>(shape::rank) * width * sizeof(float), B);
  context_positions_ = arena(tokens * sizeof(long long), B);
  landmarks_ = arena(static_cast<std::size_t>(max_chunks_) * width * e, B);
  is_outlier_ = arena(static_cast<std::size_t>(Hkv) * max_chunks_, B);
  outlier_keys_ = arena(static_cast<std::size_t>(shape::outliers) * C * width * e, B);
  outlier_values_ = arena(outlier_keys_.stride, B);
  exact_keys_ = arena(exact_rows * width * e, B);
  exact_values_ = arena(exact_rows * width * e, B);
  exact_positions_ = arena(exact_rows * sizeof(long long), B);
  cache_chunks_ = arena(static_cast<std::size_t>(Hkv) * k * sizeof(int), B);
  slot_of_chunk_ = arena(static_cast<std::size_t>(Hkv) * max_chunks_ * sizeof(int), B);
  cache_keys_ = arena(static_cast<std::size_t>(k) * C * width * e, B);
  cache_values_ = arena(static_cast<std::size_t>(k) * C * width * e, B);
  value_store_stride_ = align_up(tokens * width * e);  // T [max_chunks, Hkv, C, D] per sequence
  value_store_ = pinned_memory(value_store_stride_ * static_cast<std::size_t>(B));

  // Random contents (values through the mapped pointer, as a prefill's copy would leave them).
  std::uint64_t seed = 1;
  auto fill_bf16 = [&](const arena& a) { fill_uniform_bf16(a.memory.get(), a.memory.size() / 2, 1.0F, seed++, compute_); };
  fill_uniform_f32(coefficients_.memory.get<float>(), coefficients_.memory.size() / 4, 1.0F, seed++, compute_);
  fill_uniform_f32(basis_.memory.get<float>(), basis_.memory.size() / 4, 0.1F, seed++, compute_);
  fill_bf16(landmarks_);
  fill_bf16(outlier_keys_);
  fill_bf16(outlier_values_);
  fill_bf16(exact_keys_);
  fill_bf16(exact_values_);
  fill_bf16(cache_keys_);
  fill_bf16(cache_values_);
  fill_uniform_bf16(value_store_.device_pointer(), value_store_.size() / 2, 1.0F, seed++, compute_);
  for (int b = 0; b < B; ++b) {
    fill_iota_i64(context_positions_.at<long long>(b), tokens, compute_);
    fill_iota_i64(exact_positions_.at<long long>(b), exact_rows, compute_);
  }
  check(cudaMemsetAsync(cache_chunks_.memory.get(), 0xff, cache_chunks_.memory.size(), compute_), "cudaMemsetAsync");
  check(cudaMemsetAsync(slot_of_chunk_.memory.get(), 0xff, slot_of_chunk_.memory.size(), compute_), "cudaMemsetAsync");

  // Outliers: 48 distinct chunks per (sequence, head), spread over the context.
  const int n = s.context_chunks();
  std::vector<std::uint8_t> outlier(is_outlier_.memory.size(), 0);
  const int spacing = n / shape::outliers;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hkv; ++h) {
      const int offset = (b * 7 + h * 13) % spacing;
      for (int i = 0; i < shape::outliers; ++i) {
        outlier[is_outlier_.stride * b + static_cast<std::size_t>(h) * max_chunks_ + i * spacing + offset] = 1;
      }
    }
  }
  check(cudaMemcpyAsync(is_outlier_.memory.get(), outlier.data(), outlier.size(), cudaMemcpyHostToDevice, compute_),
        "cudaMemcpyAsync(is_outlier)");

  host_views_.assign(static_cast<std::size_t>(B), layer_view{});
  for (int b = 0; b < B; ++b) {
    layer_view& v = host_views_[static_cast<std::size_t>(b)];
    v.prompt_len = s.seq_len;
    v.context_chunks = n;
    v.outlier_chunks = shape::outliers;
    v.local_len = s.local_len();
    v.generated_exact_len = kGenerated;
    v.ring_head = 0;
    v.last_position = s.seq_len;
    v.basis = basis_.at<float>(b);
    v.coefficients = coefficients_.at<float>(b);
    v.context_positions = context_positions_.at<long long>(b);
    v.landmarks = landmarks_.at(b);
    v.is_outlier = is_outlier_.at<std::uint8_t>(b);
    v.outlier_keys = outlier_keys_.at(b);
    v.outlier_values = outlier_values_.at(b);
    v.exact_keys = exact_keys_.at(b);
    v.exact_values = exact_values_.at(b);
    v.exact_positions = exact_positions_.at<long long>(b);
    v.cache_chunks = cache_chunks_.at<int>(b);
    v.slot_of_chunk = slot_of_chunk_.at<int>(b);
    v.cache_keys = cache_keys_.at(b);
    v.cache_values = cache_values_.at(b);
    v.value_store = static_cast<std::uint8_t*>(value_store_.device_pointer()) + value_store_stride_ * b;
  }
  views_ = device_memory(sizeof(layer_view) * host_views_.size());
  check(cudaMemcpyAsync(views_.get(), host_views_.data(), views_.size(), cudaMemcpyHostToDevice, compute_),
        "cudaMemcpyAsync(views)");
  std::vector<int> slots(static_cast<std::size_t>(B));
  std::iota(slots.begin(), slots.end(), 0);
  batch_slots_ = device_memory(slots.size() * sizeof(int));
  check(cudaMemcpyAsync(batch_slots_.get(), slots.data(), batch_slots_.size(), cudaMemcpyHostToDevice, compute_),
        "cudaMemcpyAsync(batch_slots)");
  std::vector<float> inv_freq(static_cast<std::size_t>(D / 2));
  for (int i = 0; i < D / 2; ++i) {
    inv_freq[static_cast<std::size_t>(i)] =
        static_cast<float>(1.0 / std::pow(shape::rope_theta, 2.0 * i / static_cast<double>(D)));
  }
  inv_freq_ = device_memory(inv_freq.size() * sizeof(float));
  check(cudaMemcpyAsync(inv_freq_.get(), inv_freq.data(), inv_freq_.size(), cudaMemcpyHostToDevice, compute_),
        "cudaMemcpyAsync(inv_freq)");
  const std::size_t q_elements = static_cast<std::size_t>(B) * shape::q_heads * D;
  query_ = device_memory(q_elements * e);
  out_ = device_memory(q_elements * e);
  fill_uniform_bf16(query_.get(), q_elements, 1.0F, seed++, compute_);

  // The step workspace for B sequences, as the backend reserves it.
  const std::size_t lists = static_cast<std::size_t>(B) * Hkv * k * sizeof(int);
  logits_ = device_memory(static_cast<std::size_t>(B) * shape::q_heads * max_chunks_ * sizeof(float));
  scores_ = device_memory(static_cast<std::size_t>(B) * Hkv * max_chunks_ * sizeof(float));
  selected_ = device_memory(lists);
  miss_slots_ = device_memory(lists);
  miss_counts_ = device_memory(static_cast<std::size_t>(B) * Hkv * sizeof(int));
  counters_ = device_memory(4 * sizeof(unsigned long long));
  workspace_.max_splits = cuda::sparse_attention_max_splits(d_);
  partial_ = device_memory(static_cast<std::size_t>(B) * shape::q_heads * workspace_.max_splits * (D + 2) *
                           sizeof(float));
  workspace_.logits = logits_.get<float>();
  workspace_.scores = scores_.get<float>();
  workspace_.selected = selected_.get<int>();
  workspace_.miss_slots = miss_slots_.get<int>();
  workspace_.miss_counts = miss_counts_.get<int>();
  workspace_.counters = counters_.get<unsigned long long>();
  workspace_.partial = partial_.get<float>();
  const cuda::selection_workspace_bytes own = cuda::chunk_selection_workspace(d_, cuda::element_bf16, B);
  selection_partials_ = device_memory(std::max<std::size_t>(own.partials, 1));
  radix_keys_ = device_memory(std::max<std::size_t>(own.radix_keys, 1));
  workspace_.selection_partials = selection_partials_.get<float>();
  workspace_.radix_keys = own.radix_keys > 0 ? radix_keys_.get<unsigned>() : nullptr;
  check(cudaMemsetAsync(counters_.get(), 0, counters_.size(), compute_), "cudaMemsetAsync");
  check(cudaMemsetAsync(miss_counts_.get(), 0, miss_counts_.size(), compute_), "cudaMemsetAsync");

  // The selection of the fixed query (independent of the cache), from an empty cache.
  select();
  selection_.resize(static_cast<std::size_t>(B) * Hkv * k);
  check(cudaMemcpyAsync(selection_.data(), selected_.get(), lists, cudaMemcpyDeviceToHost, compute_),
        "cudaMemcpyAsync(selected)");

  const std::size_t packed_bytes = static_cast<std::size_t>(B) * Hkv * (1 + 2 * static_cast<std::size_t>(k)) * sizeof(int);
  packed_ = device_memory(packed_bytes);
  packed_host_ = pinned_memory(packed_bytes);
  const std::size_t most_runs = static_cast<std::size_t>(B) * Hkv * k;
  copy_targets_.reserve(most_runs);
  copy_sources_.reserve(most_runs);
  copy_sizes_.assign(most_runs, shape::run_bytes());
  check(cudaStreamSynchronize(compute_), "kernel_state set-up");
}

void kernel_state::build_previous_step(double hit) {
  const int B = shape_.batch;
  const int Hkv = shape::kv_heads;
  const int k = shape_.budget_chunks();
  const int n = shape_.context_chunks();
  const int kept = static_cast<int>(std::lround(hit * k));
  std::vector<std::uint8_t> outlier(is_outlier_.memory.size());
  check(cudaMemcpy(outlier.data(), is_outlier_.memory.get(), outlier.size(), cudaMemcpyDeviceToHost),
        "cudaMemcpy(is_outlier)");
  std::vector<int> cache(cache_chunks_.memory.size() / sizeof(int), -1);
  std::vector<int> slot_of(slot_of_chunk_.memory.size() / sizeof(int), -1);
  std::mt19937_64 rng(static_cast<std::uint64_t>(hit * 1000) + 17);
  std::vector<std::uint8_t> taken(static_cast<std::size_t>(max_chunks_));
  std::vector<int> slot_order(static_cast<std::size_t>(k));
  std::uniform_int_distribution<int> any_chunk(0, n - 1);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hkv; ++h) {
      const std::uint8_t* flags = outlier.data() + is_outlier_.stride * b + static_cast<std::size_t>(h) * max_chunks_;
      std::vector<int> selected(selection_.begin() + (static_cast<std::ptrdiff_t>(b) * Hkv + h) * k,
                                selection_.begin() + (static_cast<std::ptrdiff_t>(b) * Hkv + h + 1) * k);
      selected.erase(std::remove(selected.begin(), selected.end(), -1), selected.end());
      std::fill(taken.begin(), taken.end(), 0);
      for (int c : selected) taken[static_cast<std::size_t>(c)] = 1;
      std::shuffle(selected.begin(), selected.end(), rng);
      std::vector<int> previous(selected.begin(), selected.begin() + std::min<std::ptrdiff_t>(kept, static_cast<std::ptrdiff_t>(selected.size())));
      while (static_cast<int>(previous.size()) < k) {  // other candidates, not selected now
        const int c = any_chunk(rng);
        if (taken[static_cast<std::size_t>(c)] != 0 || flags[c] != 0) continue;
        taken[static_cast<std::size_t>(c)] = 1;
        previous.push_back(c);
      }
      std::iota(slot_order.begin(), slot_order.end(), 0);
      std::shuffle(slot_order.begin(), slot_order.end(), rng);
      int* cache_row = cache.data() + (cache_chunks_.stride * b) / sizeof(int) + static_cast<std::size_t>(h) * k;
      int* slot_row = slot_of.data() + (slot_of_chunk_.stride * b) / sizeof(int) + static_cast<std::size_t>(h) * max_chunks_;
      for (int i = 0; i < k; ++i) {
        const int slot = slot_order[static_cast<std::size_t>(i)];
        const int chunk = previous[static_cast<std::size_t>(i)];
        cache_row[slot] = chunk;
        slot_row[chunk] = slot;
      }
    }
  }
  previous_step step{hit, device_memory(cache_chunks_.memory.size()), device_memory(slot_of_chunk_.memory.size())};
  check(cudaMemcpy(step.cache_chunks.get(), cache.data(), step.cache_chunks.size(), cudaMemcpyHostToDevice),
        "cudaMemcpy(previous cache_chunks)");
  check(cudaMemcpy(step.slot_of_chunk.get(), slot_of.data(), step.slot_of_chunk.size(), cudaMemcpyHostToDevice),
        "cudaMemcpy(previous slot_of_chunk)");
  previous_.push_back(std::move(step));
}

void kernel_state::restore_previous_step(double hit) {
  auto found = std::find_if(previous_.begin(), previous_.end(), [hit](const previous_step& p) { return p.hit == hit; });
  if (found == previous_.end()) {
    build_previous_step(hit);
    found = previous_.end() - 1;
  }
  check(cudaMemcpyAsync(cache_chunks_.memory.get(), found->cache_chunks.get(), found->cache_chunks.size(),
                        cudaMemcpyDeviceToDevice, compute_),
        "cudaMemcpyAsync(restore cache_chunks)");
  check(cudaMemcpyAsync(slot_of_chunk_.memory.get(), found->slot_of_chunk.get(), found->slot_of_chunk.size(),
                        cudaMemcpyDeviceToDevice, compute_),
        "cudaMemcpyAsync(restore slot_of_chunk)");
}

void kernel_state::ensure_selected(double hit) {
  if (selected_hit_ == hit) return;
  check(cudaStreamSynchronize(copy_), "cudaStreamSynchronize(copy)");
  restore_previous_step(hit);
  check(cudaMemsetAsync(counters_.get(), 0, counters_.size(), compute_), "cudaMemsetAsync(counters)");
  select();
  unsigned long long counters[4] = {0, 0, 0, 0};
  check(cudaMemcpyAsync(counters, counters_.get(), sizeof counters, cudaMemcpyDeviceToHost, compute_),
        "cudaMemcpyAsync(counters)");
  check(cudaStreamSynchronize(compute_), "selection of the step");
  hits_ = static_cast<double>(counters[0]);
  misses_ = static_cast<double>(counters[1]);
  selected_hit_ = hit;
}

void kernel_state::issue_batch(std::size_t count, std::size_t* api_calls) {
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // small (2 KiB) copies beside the key rebuild
  std::size_t attribute_index = 0;
  std::size_t calls = 0;
  for (std::size_t first = 0; first < count;) {
    const std::size_t piece = std::min(count - first, batch_limit_);
    const cudaError_t status =
        cudaMemcpyBatchAsync(copy_targets_.data() + first, copy_sources_.data() + first, copy_sizes_.data() + first,
                             piece, &attributes, &attribute_index, 1, copy_);
    if (status == cudaErrorInvalidValue && piece > kFallbackBatch) {
      (void)cudaGetLastError();
      batch_limit_ = kFallbackBatch;  // retry in sub-batches; reported through the api_calls counter
      continue;
    }
    check(status, "cudaMemcpyBatchAsync");
    first += piece;
    ++calls;
  }
  *api_calls = calls;
}

double kernel_state::fetch_by_copies(bool batched, event_timer& timer, std::size_t* api_calls) {
  const int B = shape_.batch;
  const int Hkv = shape::kv_heads;
  const int k = shape_.budget_chunks();
  const std::size_t run = shape::run_bytes();
  const std::size_t row = 1 + 2 * static_cast<std::size_t>(k);
  timer.start(copy_);
  pack_miss_runs_kernel<<<dim3(static_cast<unsigned>(Hkv), static_cast<unsigned>(B)), 128, 0, copy_>>>(
      views_.get<layer_view>(), batch_slots_.get<int>(), 1, 0, Hkv, k, workspace_, packed_.get<int>());
  check(cudaGetLastError(), "pack_miss_runs_kernel launch");
  check(cudaMemcpyAsync(packed_host_.get(), packed_.get(), packed_.size(), cudaMemcpyDeviceToHost, copy_),
        "cudaMemcpyAsync(miss lists to host)");
  // The host must see the lists before it can name the copies: this wait is part of the path's cost.
  check(cudaStreamSynchronize(copy_), "cudaStreamSynchronize(miss lists)");
  copy_targets_.clear();
  copy_sources_.clear();
  const int* packed = packed_host_.get<int>();
  const auto* store = value_store_.get<std::uint8_t>();
  for (int b = 0; b < B; ++b) {
    auto* cache = static_cast<std::uint8_t*>(host_views_[static_cast<std::size_t>(b)].cache_values);
    for (int h = 0; h < Hkv; ++h) {
      const int* entry = packed + (static_cast<std::size_t>(b) * Hkv + h) * row;
      for (int m = 0; m < entry[0]; ++m) {
        const int slot = entry[1 + 2 * m];
        const int chunk = entry[2 + 2 * m];
        copy_targets_.push_back(cache + (static_cast<std::size_t>(h) * k + slot) * run);
        copy_sources_.push_back(store + value_store_stride_ * b +
                                (static_cast<std::size_t>(chunk) * Hkv + h) * run);
      }
    }
  }
  const std::size_t count = copy_targets_.size();
  if (batched) {
    if (count > 0) issue_batch(count, api_calls);
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      check(cudaMemcpyAsync(copy_targets_[i], copy_sources_[i], run, cudaMemcpyHostToDevice, copy_),
            "cudaMemcpyAsync(run)");
    }
    *api_calls = count;
  }
  return timer.stop(copy_);
}

void kernel_state::verify_copy_path(double hit, bool batched) {
  const double key = hit + (batched ? 10.0 : 20.0);
  if (std::find(verified_.begin(), verified_.end(), key) != verified_.end()) return;
  ensure_selected(hit);
  const std::size_t bytes = cache_values_.memory.size();
  std::vector<std::uint8_t> by_kernel(bytes);
  std::vector<std::uint8_t> by_copies(bytes);
  check(cudaStreamSynchronize(compute_), "cudaStreamSynchronize(compute)");
  check(cudaMemsetAsync(cache_values_.memory.get(), 0, bytes, copy_), "cudaMemsetAsync(cache_values)");
  fetch_zero_copy();
  check(cudaMemcpyAsync(by_kernel.data(), cache_values_.memory.get(), bytes, cudaMemcpyDeviceToHost, copy_),
        "cudaMemcpyAsync(cache_values)");
  check(cudaMemsetAsync(cache_values_.memory.get(), 0, bytes, copy_), "cudaMemsetAsync(cache_values)");
  event_timer timer;
  std::size_t calls = 0;
  (void)fetch_by_copies(batched, timer, &calls);
  check(cudaMemcpyAsync(by_copies.data(), cache_values_.memory.get(), bytes, cudaMemcpyDeviceToHost, copy_),
        "cudaMemcpyAsync(cache_values)");
  check(cudaStreamSynchronize(copy_), "cudaStreamSynchronize(copy)");
  const bool nonzero = misses_ == 0 ||
                       std::any_of(by_kernel.begin(), by_kernel.end(), [](std::uint8_t x) { return x != 0; });
  if (!nonzero || std::memcmp(by_kernel.data(), by_copies.data(), bytes) != 0) {
    throw std::runtime_error(std::string(batched ? "cudaMemcpyBatchAsync" : "per-run cudaMemcpyAsync") +
                             " left cache_values different from launch_fetch_values (or nothing was fetched)");
  }
  verified_.push_back(key);
}

// --- the per-shape state (one at a time) ----------------------------------------------------------------------------

std::unique_ptr<kernel_state>& current_state() {
  static std::unique_ptr<kernel_state> state;
  return state;
}

kernel_state& state_for(const shape& s) {
  std::unique_ptr<kernel_state>& state = current_state();
  if (!state || !(state->which() == s)) {
    state.reset();
    release_store_state();
    state = std::make_unique<kernel_state>(s);
  }
  return *state;
}

// --- the benchmarks -------------------------------------------------------------------------------------------------

enum class op { select, rebuild, fetch_zero_copy, fetch_batched, fetch_per_run, attention };

void run_op(benchmark::State& bench, const shape& s, double hit, op which) {
  try {
    kernel_state& st = state_for(s);
    const ceilings& limits = measured_ceilings();
    st.ensure_selected(hit);
    event_timer timer;
    op_report r;
    r.hit = st.measured_hit();
    r.misses = st.misses();
    const double value_bytes = st.misses() * static_cast<double>(shape::run_bytes());
    std::size_t api_calls = 0;
    switch (which) {
      case op::select:
        for (auto _ : bench) {
          st.restore_previous_step(hit);  // untimed: it precedes the start event on the same stream
          timer.start(st.compute());
          st.select();
          const double seconds = timer.stop(st.compute());
          bench.SetIterationTime(seconds);
          r.seconds_total += seconds;
        }
        r.bytes_per_iteration = s.landmark_bytes();
        r.ceiling = limits.hbm_copy;
        break;
      case op::rebuild:
        st.rebuild();
        for (auto _ : bench) {
          timer.start(st.compute());
          st.rebuild();
          const double seconds = timer.stop(st.compute());
          bench.SetIterationTime(seconds);
          r.seconds_total += seconds;
        }
        r.bytes_per_iteration = st.rebuild_bytes();
        r.ceiling = limits.hbm_copy;
        bench.counters["TFLOPs"] = benchmark::Counter(
            2.0 * st.misses() * shape::chunk * shape::rank * shape::head_dim * 1e-12 *
                static_cast<double>(bench.iterations()) / std::max(r.seconds_total, 1e-12));
        break;
      case op::fetch_zero_copy:
        st.fetch_zero_copy();
        for (auto _ : bench) {
          timer.start(st.copy());
          st.fetch_zero_copy();
          const double seconds = timer.stop(st.copy());
          bench.SetIterationTime(seconds);
          r.seconds_total += seconds;
        }
        r.bytes_per_iteration = value_bytes;
        r.ceiling = limits.pcie_h2d;
        break;
      case op::fetch_batched:
      case op::fetch_per_run: {
        const bool batched = which == op::fetch_batched;
        st.verify_copy_path(hit, batched);  // also the warm-up
        for (auto _ : bench) {
          const double seconds = st.fetch_by_copies(batched, timer, &api_calls);
          bench.SetIterationTime(seconds);
          r.seconds_total += seconds;
        }
        r.bytes_per_iteration = value_bytes;
        r.ceiling = limits.pcie_h2d;
        bench.counters["api_calls"] = static_cast<double>(api_calls);
        break;
      }
      case op::attention:
        st.attend();
        for (auto _ : bench) {
          timer.start(st.compute());
          st.attend();
          const double seconds = timer.stop(st.compute());
          bench.SetIterationTime(seconds);
          r.seconds_total += seconds;
        }
        r.bytes_per_iteration = 2.0 * s.batch * shape::kv_heads * st.attended_tokens() * shape::head_dim *
                                static_cast<double>(shape::element_bytes);
        r.ceiling = limits.hbm_copy;
        r.hit = -1;
        r.misses = -1;
        break;
    }
    r.floor_seconds = r.bytes_per_iteration / r.ceiling;
    report(bench, r);
  } catch (const std::exception& error) {
    bench.SkipWithError(error.what());
  }
}

void add(const std::string& name, const shape& s, double hit, op which) {
  benchmark::RegisterBenchmark(name.c_str(), [s, hit, which](benchmark::State& bench) { run_op(bench, s, hit, which); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->MinTime(kMinTime);
}

}  // namespace

void release_kernel_state() { current_state().reset(); }

void register_kernel_benchmarks(const shape& s) {
  const struct {
    const char* name;
    op which;
  } ops[] = {{"select_chunks", op::select},
             {"rebuild_keys", op::rebuild},
             {"fetch_values_zero_copy", op::fetch_zero_copy},
             {"fetch_values_batched_copy", op::fetch_batched},
             {"fetch_values_copy_per_run", op::fetch_per_run}};
  for (const auto& o : ops) {
    for (const double hit : design_hit_rates()) add(std::string(o.name) + "/" + s.label() + "/" + hit_label(hit), s, hit, o.which);
  }
  // Attention reads the same tokens whatever the hit rate.
  add("sparse_attention/" + s.label(), s, 0.0, op::attention);
}

}  // namespace shadowkv::bench
