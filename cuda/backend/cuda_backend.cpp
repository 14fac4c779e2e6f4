#include "cuda_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "chunk_rebuild.cuh"
#include "chunk_selection.cuh"
#include "cuda_check.hpp"
#include "cuda_runtime_info.hpp"
#include "generated_tokens.cuh"
#include "prompt_kernels.cuh"
#include "rope_table.cuh"
#include "shadowkv/chunk_centroids.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/generated_region.hpp"
#include "shadowkv/rope.hpp"
#include "sparse_attention.cuh"
#include "factor_format.cuh"
#include "value_fetch.cuh"
#include "value_format.cuh"
#include "shape_support.hpp"
#include "finite_check.cuh"

namespace shadowkv::cuda {
namespace {

// A two-way measurement knob (bench/step_benchmark.py; bench/NOTES.md): false when the environment variable `name` is
// unset, empty or `usual` (the default), true when it is `other`; any other text is rejected, naming both.
bool knob_is(const char* name, const char* usual, const char* other) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0' || std::strcmp(text, usual) == 0) return false;
  SHADOWKV_EXPECTS(std::strcmp(text, other) == 0, name, " must be '", usual, "' or '", other, "', got '", text, "'");
  return true;
}

// CTAs of the value fetch: the environment variable `name` when it is set (a measurement knob for
// bench/step_benchmark.py; bench/NOTES.md), else `fallback`.
int fetch_ctas_setting(const char* name, int fallback) {
  if (const char* text = std::getenv(name); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    SHADOWKV_EXPECTS(*end == '\0' && value >= 1 && value <= 65535, name, " must be an integer in [1, 65535], got '",
                     text, "'");
    return static_cast<int>(value);
  }
  return fallback;
}

// When values cross PCIe: a quarter of the multiprocessors (33 on an H200), 8 warps each with 2 KiB of loads in flight
// a warp: ~0.5 MiB in flight, ~4x what 55 GB/s at ~2 us of latency needs, on a quarter of the SMs (the rest run the
// key rebuild and later parts' selection beside it). SHADOWKV_FETCH_CTAS overrides it.
int fetch_ctas_for_host_values(int multiprocessors) {
  return fetch_ctas_setting("SHADOWKV_FETCH_CTAS", std::max(8, multiprocessors / 4));
}

// The launch priority of a fetch across PCIe: the device's greatest (SHADOWKV_FETCH_PRIORITY=high, the default) or the
// stream's own (normal). The fetch is the step's critical path at large batch, and a kernel launched beside others
// waits for SM room: with equal priorities the block scheduler places every pending CTA of the kernels launched before
// it first (a key rebuild of three waves, a later part's logits), so a part's fetch could start hundreds of µs after
// its selection. With the greatest priority its 33 CTAs take the first room that frees. Kernel nodes keep the priority
// in a CUDA graph instantiated with cudaGraphInstantiateFlagUseNodePriority (PyTorch's CUDAGraph does so). A
// measurement knob for bench/step_benchmark.py's +np (bench/NOTES.md, session 13).
int fetch_priority_for_host_values() {
  if (knob_is("SHADOWKV_FETCH_PRIORITY", "high", "normal")) return 0;
  int least = 0;
  int greatest = 0;
  SHADOWKV_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return greatest;
}

// Positions the key rebuild's RoPE table covers (rope_table.cuh): every position a sequence of the store's capacity
// numbers by default (0 .. max_seq_len - 1), up to kRopeTableMaxBytes; rows past it compute their coefficients. 0 with
// SHADOWKV_ROPE_TABLE=off (no table: every row computes them, as before the table), a measurement knob for
// bench/step_benchmark.py's +rt0 (bench/NOTES.md, session 13).
constexpr std::size_t kRopeTableMaxBytes = std::size_t{256} << 20;
long long rope_table_positions(const dims& d) {
  const bool on = !knob_is("SHADOWKV_ROPE_TABLE", "on", "off");
  const std::size_t per_position = rope_table_bytes(d, 1);
  if (!on || per_position == 0) return 0;
  const long long capacity = static_cast<long long>(d.max_chunks) * d.chunk;
  return std::min<long long>(capacity, static_cast<long long>(kRopeTableMaxBytes / per_position));
}

// When every value of the batch is in device memory: twice the multiprocessors (a gather from HBM needs more in flight
// than one across PCIe). SHADOWKV_DEVICE_FETCH_CTAS overrides it.
int fetch_ctas_for_device_values(int multiprocessors) {
  return fetch_ctas_setting("SHADOWKV_DEVICE_FETCH_CTAS", 2 * multiprocessors);
}

// How attention reads the selected values of a sequence whose values live in device memory (bf16/f16/f32): "gather"
// (the default: the fetch copies the misses into the selection cache, device to device, and attention reads the
// cache) or "in_place" (attention reads them from the value store; no copy). SHADOWKV_DEVICE_VALUES picks one (a
// measurement knob for bench/step_benchmark.py's +ip; bench/NOTES.md).
bool device_values_in_place() { return knob_is("SHADOWKV_DEVICE_VALUES", "gather", "in_place"); }

// How the batch is split into decode pipeline parts: "tapered" (the default: the first and last parts half the size of
// the others, e.g. 6/12/6 of 24: the first part's selection is all the fetch waits for, and the last part's attention
// is all that runs after it) or "even" (equal parts). Measured on the H200 with the fetch at the greatest priority
// (bench/NOTES.md, session 13; B = 24 and 48 at hit 0.04, then B = 24 and 48 at hit 0.61, graph replay): tapered 2.158 / 2.171 / 0.950 / 0.957 ms
// against even 2.175 / 2.167 / 0.971 / 0.966, and eager 2.094 / 2.114 / 0.979 / 0.972 against 2.270 / 2.148 / 1.019 /
// 1.004. SHADOWKV_PIPELINE_SPLIT picks one (a measurement knob for bench/step_benchmark.py's +ev).
bool tapered_pipeline_split() { return !knob_is("SHADOWKV_PIPELINE_SPLIT", "tapered", "even"); }

// Which kernel runs the sparse attention where both can: "mma" (the default: the tensor-core kernel for bf16 keys
// and values with head_dim <= 128) or "fma" (the CUDA-core kernel for every shape). SHADOWKV_ATTENTION picks one (a
// measurement knob for bench/step_benchmark.py's +fma; bench/NOTES.md).
bool attention_on_fma() { return knob_is("SHADOWKV_ATTENTION", "mma", "fma"); }

// Whether a decode landmark-logits launch beside the value fetch (a pipeline part after the first) takes half of its
// tiles from a shared pool: "on" (the default) or "off" (every tile in fixed shares, as before session 17).
// SHADOWKV_LOGITS_POOL picks one (a measurement knob for bench/step_benchmark.py's +lp0; bench/NOTES.md, session 17).
bool logits_pooled() { return !knob_is("SHADOWKV_LOGITS_POOL", "on", "off"); }

// Whether a select cluster (small batches) starts from the hint its previous selection of the same (sequence, layer,
// head) left: "on" (the default; the keys at or above the hint ranked alone when more than k and at most 2048 of them
// lie there, skipping the radix passes over every chunk and their cluster merges) or "off" (always the full radix
// select). Both select the same chunks. SHADOWKV_SELECT_HINT picks one (a measurement knob for
// bench/step_benchmark.py's +sh0; bench/NOTES.md, session 18).
bool select_hint_setting() { return !knob_is("SHADOWKV_SELECT_HINT", "on", "off"); }

// How the decode landmark logits ask L2 to keep the landmarks they stream: "evict_first" (the default: every landmark
// is read once a step, so its lines are the first to go, and the logits the select reads next, the tables and the
// selection cache stay) or "normal" (as plain loads). SHADOWKV_LANDMARK_L2 picks one (a measurement knob for
// bench/step_benchmark.py's +le0).
bool landmark_evict_first_setting() { return !knob_is("SHADOWKV_LANDMARK_L2", "evict_first", "normal"); }

// Who writes the tensor-core decode logits and their tiles' maxima: "lean" (the default: each warp, from its MMA
// registers, as it computes its rows, so that a tile's epilogue only sums the exponentials; the epilogue's warps are
// the last ones, away from thread 0's tile issue) or "full" (the tile's epilogue, a warp a query head, as the lanes'
// FMA path does). Both store the same logits and partials, bit for bit. SHADOWKV_LOGITS_EPILOGUE picks one (a
// measurement knob for bench/step_benchmark.py's +ep0).
bool logits_lean_epilogue_setting() { return !knob_is("SHADOWKV_LOGITS_EPILOGUE", "lean", "full"); }

// Which arithmetic sums the decode landmark logits: "auto" (the default: bf16 landmark rows of 64 or 128 elements on
// m16n8k16 MMAs over bulk-copied tiles, q in three bf16 terms, when the batch has many tiles; the lanes' FMAs else),
// "fma" (the lanes' FMAs over q in float32, for every shape) or "mma" (the MMAs wherever they serve the shape). Both
// form every product exactly and add in float32. SHADOWKV_LOGITS picks one (a measurement knob for
// bench/step_benchmark.py's +lf and +lm; bench/NOTES.md, session 16). Returns dims::logits_arithmetic.
int logits_arithmetic_setting() {
  const char* text = std::getenv("SHADOWKV_LOGITS");
  if (text == nullptr || *text == '\0' || std::strcmp(text, "auto") == 0) return 0;
  if (std::strcmp(text, "fma") == 0) return 1;
  SHADOWKV_EXPECTS(std::strcmp(text, "mma") == 0, "SHADOWKV_LOGITS must be 'auto', 'fma' or 'mma', got '", text, "'");
  return 2;
}

// CTAs per (sequence, KV head) of the select kernel: "auto" (the default: the planner's choice, clusters of up to 8 when
// the batch leaves multiprocessors idle; selection_plan.cuh) or 1, 2, 4, 8 (forced where clusters may run).
// SHADOWKV_SELECT_CLUSTER picks one (a measurement knob for bench/step_benchmark.py's +sc1; bench/NOTES.md). Returns
// dims::select_cluster.
int select_cluster_setting() {
  const char* text = std::getenv("SHADOWKV_SELECT_CLUSTER");
  if (text == nullptr || *text == '\0' || std::strcmp(text, "auto") == 0) return 0;
  for (const int ctas : {1, 2, 4, 8}) {
    if (std::strcmp(text, std::to_string(ctas).c_str()) == 0) return ctas;
  }
  SHADOWKV_EXPECTS(false, "SHADOWKV_SELECT_CLUSTER must be 'auto', '1', '2', '4' or '8', got '", text, "'");
  return 0;
}

// Whether the decode step's kernels overlap their launch with the tail of the kernel before them (programmatic dependent
// launch; common/dependent_launch.cuh): "on" (the default) or "off". SHADOWKV_PROGRAMMATIC_LAUNCH picks one (a
// measurement knob for bench/step_benchmark.py's +pl0; bench/NOTES.md).
bool programmatic_launch_setting() { return !knob_is("SHADOWKV_PROGRAMMATIC_LAUNCH", "on", "off"); }

// The key rebuild's tensor-core instruction for bf16 factors: "bf16" (the default: m16n8k16 bf16 MMAs fed by ldmatrix,
// half as many MMAs as TF32 and one shared-memory instruction for what took eight loads and conversions) or "tf32"
// (each bf16 factor widened to tf32, m16n8k8 TF32 MMAs, as before). Both form every product exactly and add in fp32;
// only the tensor core's order of accumulation inside a K tile differs. SHADOWKV_REBUILD_MMA picks one (a measurement
// knob for bench/step_benchmark.py's +mt; bench/NOTES.md, session 15). Float32 factors always take 3xTF32.
bool rebuild_mma_tf32() { return knob_is("SHADOWKV_REBUILD_MMA", "bf16", "tf32"); }

// How the CTAs of a select cluster merge their radix histograms: "scatter" (the default: each CTA sums its own slice of
// the bins over the cluster's ranks, then every CTA reads the summed slices: 2 x bins loads a CTA) or "all" (every CTA
// sums every bin over every rank: ranks x bins loads a CTA, as before). The distributed shared memory's throughput
// bounds the merge (bench/NOTES.md, session 14). SHADOWKV_SELECT_MERGE picks one (a measurement knob for
// bench/step_benchmark.py's +sma).
bool select_merge_all() { return knob_is("SHADOWKV_SELECT_MERGE", "scatter", "all"); }

// Where the key rebuild applies RoPE: "registers" (the default: in the MMA accumulators where every thread holds both
// dims of its pairs, with the store's RoPE table; chunk_rebuild.cu, rope_in_registers) or "shared" (always over the
// results in shared memory, a thread a pair, as before). The same rotation either way. SHADOWKV_REBUILD_ROPE picks one
// (a measurement knob for bench/step_benchmark.py's +rs; bench/NOTES.md, session 15).
bool rebuild_rope_shared() { return knob_is("SHADOWKV_REBUILD_ROPE", "registers", "shared"); }

// Whether the key rebuild lets the tensor-core attention start early, to walk its rows and stage q beside the rebuild
// (dims::attention_early): "auto" (the default: up to kEarlyAttentionMaxBatch sequences a call), "on" or "off".
// SHADOWKV_ATTENTION_EARLY picks one (a measurement knob; bench/NOTES.md, session 20). 1: on, 0: auto, -1: off.
int attention_early_setting() {
  const char* text = std::getenv("SHADOWKV_ATTENTION_EARLY");
  if (text == nullptr || *text == '\0' || std::strcmp(text, "auto") == 0) return 0;
  if (std::strcmp(text, "on") == 0) return 1;
  SHADOWKV_EXPECTS(std::strcmp(text, "off") == 0, "SHADOWKV_ATTENTION_EARLY must be 'auto', 'on' or 'off', got '",
                   text, "'");
  return -1;
}

// Whether a decode step's key rebuild also attends over the rows it rebuilds while the attention walks the others
// (dims::fused_misses; chunk_rebuild.cuh's miss_attention): "auto" (the default: steps of up to
// kFusedMissesMaxBatch sequences, one, whose values are all in device memory, where the shapes allow it), "on" (every such step, whatever its batch) or "off". SHADOWKV_FUSED_MISSES picks one (a measurement knob;
// bench/NOTES.md, session 23).
// 1: on, 0: auto, -1: off.
int fused_misses_setting() {
  const char* text = std::getenv("SHADOWKV_FUSED_MISSES");
  if (text == nullptr || *text == '\0' || std::strcmp(text, "auto") == 0) return 0;
  if (std::strcmp(text, "on") == 0) return 1;
  SHADOWKV_EXPECTS(std::strcmp(text, "off") == 0, "SHADOWKV_FUSED_MISSES must be 'auto', 'on' or 'off', got '", text,
                   "'");
  return -1;
}

// The CTAs the tensor-core attention's split count aims for (dims::attention_ctas): SHADOWKV_ATTENTION_CTAS, a number
// from 1 to 4096; unset: the kernel's constant (two a multiprocessor of an H200).
int attention_ctas_setting() {
  const char* text = std::getenv("SHADOWKV_ATTENTION_CTAS");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  SHADOWKV_EXPECTS(end != text && *end == '\0' && value >= 1 && value <= 4096,
                   "SHADOWKV_ATTENTION_CTAS must be a number from 1 to 4096, got '", text, "'");
  return static_cast<int>(value);
}

// First entry of part p of `count` parts of `batch` entries: weights 1 each ("even"), or 1, 2, ..., 2, 1 ("tapered",
// three parts or more); a tapered split that would leave a part empty falls back to the even one.
int part_start(int p, int count, int batch, bool tapered) {
  if (tapered && count >= 3) {
    const long long total = 2LL * (count - 1);  // the weights' sum
    const auto start = [&](int q) {
      const long long weight = q == 0 ? 0 : 2LL * q - 1;  // weights of parts 0 .. q-1 (q <= count - 1)
      return static_cast<int>((q == count ? total : weight) * batch / total);
    };
    bool all_filled = true;
    for (int q = 0; q < count; ++q) all_filled = all_filled && start(q + 1) > start(q);
    if (all_filled) return start(p);
  }
  return static_cast<int>(static_cast<long long>(p) * batch / count);
}

constexpr std::size_t kAlignment = 256;
/// step_workspace::counters: hits, misses, selections and bytes fetched (selection_stats), then the selections that
/// took the select cluster's hint path (step_workspace::hinted_selections).
constexpr std::size_t kWorkspaceCounters = 5;

std::size_t align_up(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

int element_code(dtype type) {
  switch (type) {
    case dtype::float16: return element_f16;
    case dtype::bfloat16: return element_bf16;
    case dtype::float32: break;
  }
  return element_f32;
}

strided_tensor as_strided(const tensor_view& view) {
  strided_tensor result{view.data, element_code(view.float_type), {0, 0, 0, 0}};
  for (int dim = 0; dim < view.rank; ++dim) result.stride[dim] = view.strides[static_cast<std::size_t>(dim)];
  return result;
}

int index_bits(const tensor_view& view) { return view.int_type == index_type::int32 ? 32 : 64; }

// Whether factorize takes the Gram/eigensolver path for a prompt of `rows` tokens (else the exact SVD).
bool factorizes_by_gram(const config& cfg, std::int64_t rows) {
  return cfg.factorization == factorization_method::gram || rows < cfg.kv_width();
}

// Sets the current device for the scope of a call and restores the caller's.
class device_guard {
 public:
  explicit device_guard(int device) {
    SHADOWKV_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != device) SHADOWKV_CUDA_TRY(cudaSetDevice(device));
  }
  ~device_guard() { (void)cudaSetDevice(previous_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace

// Bytes of every array of one (slot, layer), each aligned.
struct cuda_backend::layer_sizes {
  std::size_t basis, coefficients, context_positions, landmarks, centroid_codes, centroid_scales, first_counts,
      is_outlier, outlier, exact, exact_positions, cache_chunks, slot_of_chunk, cache, cache_last_used,
      selection_clock, selected_slots, selection_hint, value_store, value_codes;

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
    // The value store: T [max_chunks, Hkv, C, D], or fp8 codes of the same shape then float scales [max_chunks, Hkv].
    value_codes = align_up(context_tokens * width * (d.value_fp8 != 0 ? 1 : element));
    value_store = value_codes +
                  (d.value_fp8 != 0 ? align_up(static_cast<std::size_t>(d.max_chunks) * d.kv_heads * sizeof(float)) : 0);
  }
  [[nodiscard]] std::size_t device_total() const {
    return basis + coefficients + context_positions + landmarks + centroid_codes + centroid_scales + first_counts +
           is_outlier + 2 * outlier + 2 * exact +
           exact_positions + cache_chunks + slot_of_chunk + 2 * cache + cache_last_used + selection_clock +
           selected_slots + selection_hint;
  }
};

cuda_backend::cuda_backend(const config& cfg, int device_index)
    : config_(cfg), device_(device_index), kv_type_(element_code(cfg.kv_dtype)) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  SHADOWKV_EXPECTS(device_index >= 0 && device_index < count, "device cuda:", device_index,
                   " is not available: this machine has ", count, " CUDA device(s)");
  check_kernel_support(cfg);
  shadowkv::detail::check_cuda_architecture(device_index);  // a GPU the build has no code for: ValueError, now
  device_guard guard(device_);

  dims_.num_layers = cfg.num_layers;
  dims_.q_heads = cfg.num_q_heads;
  dims_.kv_heads = cfg.num_kv_heads;
  dims_.head_dim = cfg.head_dim;
  dims_.group = cfg.group_size();
  dims_.chunk = cfg.chunk_size;
  dims_.budget = static_cast<int>(cfg.budget_chunks());  // chunks (validate(): fits an int)
  dims_.chunk_centroids = cfg.chunk_score == chunk_score_rule::two_centroids ? 1 : 0;
  dims_.cache_slots = static_cast<int>(cfg.cache_slots());  // K >= k (validate(): fits an int; clamped like k)
  dims_.max_outliers = cfg.outlier_chunks;
  dims_.rank = cfg.rank;
  dims_.window = cfg.generation_window;
  dims_.local_capacity = (cfg.local_chunks + 1) * cfg.chunk_size - 1;
  dims_.max_chunks = static_cast<int>(cfg.max_seq_len / cfg.chunk_size);
  dims_.rotary_dim = cfg.effective_rotary_dim();
  dims_.rope_interleaved = cfg.rope == rope_style::interleaved ? 1 : 0;
  dims_.attention_scaling = cfg.attention_scaling;
  dims_.softmax_scale = cfg.effective_softmax_scale();
  dims_.value_fp8 = cfg.values_as == value_format::fp8_e4m3 ? 1 : 0;
  dims_.factor_bf16 = cfg.factor_dtype() == dtype::bfloat16 ? 1 : 0;
  dims_.group_mean = cfg.group_score == group_combine::mean ? 1 : 0;
  dims_.attention_fma = attention_on_fma() ? 1 : 0;
  dims_.select_cluster = select_cluster_setting();
  dims_.programmatic_launch = programmatic_launch_setting() ? 1 : 0;
  dims_.rebuild_mma_tf32 = rebuild_mma_tf32() ? 1 : 0;
  dims_.select_merge_all = select_merge_all() ? 1 : 0;
  dims_.rebuild_rope_shared = rebuild_rope_shared() ? 1 : 0;
  dims_.logits_arithmetic = logits_arithmetic_setting();
  dims_.logits_pooled = logits_pooled() ? 1 : 0;
  dims_.select_hint = select_hint_setting() ? 1 : 0;
  dims_.landmark_evict_first = landmark_evict_first_setting() ? 1 : 0;
  attention_early_ = attention_early_setting();
  dims_.attention_ctas = attention_ctas_setting();
  dims_.logits_lean_epilogue = logits_lean_epilogue_setting() ? 1 : 0;
  fused_misses_ = fused_misses_setting();

  // The store's own stream (calls given no stream) is ordered after the legacy default stream, where a caller's
  // cudaMemcpy of an input may still be landing when it returns (from pageable memory it returns once the data is
  // staged): "inputs must be ready" (store.hpp) then covers everything the caller queued there. The copy stream only
  // ever waits for events of the store's own work.
  own_stream_ = make_stream(/*with_legacy_stream=*/true);
  copy_stream_ = make_stream();
  for (event_handle& event : part_selected_events_) event = make_event();
  for (event_handle& event : part_fetched_events_) event = make_event();
  fetched_event_ = make_event();
  logits_done_event_ = make_event();
  appended_event_ = make_event();
  splits_done_event_ = make_event();
  folded_event_ = make_event();
  values_ready_event_ = make_event();
  resources_ = device_resources::shared(device_index);
  stream_ = own_stream_;
  fetch_ctas_host_ = fetch_ctas_for_host_values(resources_->multiprocessors());
  fetch_ctas_device_ = fetch_ctas_for_device_values(resources_->multiprocessors());
  fetch_priority_host_ = fetch_priority_for_host_values();
  values_in_place_ = device_values_in_place();
  tapered_split_ = tapered_pipeline_split();

  // Reserve everything up front.
  const std::size_t element = dtype_size(cfg.kv_dtype);
  const layer_sizes sizes(dims_, element);
  const std::size_t layers = static_cast<std::size_t>(cfg.max_batch) * cfg.num_layers;
  arena_ = device_buffer(sizes.device_total() * layers, own_stream_, resources_->device_memory());
  value_layer_bytes_ = sizes.value_store;
  value_codes_bytes_ = sizes.value_codes;
  device_values_.resize(static_cast<std::size_t>(cfg.max_batch));
  host_values_.resize(static_cast<std::size_t>(cfg.max_batch));
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
    v.value_store = nullptr;  // set when a sequence joins the slot
  }
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(views_.data(), host_views_.data(), sizeof(layer_view) * layers,
                                    cudaMemcpyHostToDevice, own_stream_));

  // Decode workspace for max_batch sequences.
  const std::size_t batch = static_cast<std::size_t>(cfg.max_batch);
  // Room for the key rebuild's partials after the attention's where steps may be fused (sparse_attention_partials;
  // fuse_step finds no room otherwise).
  const bool may_fuse = fused_misses_ > 0 || (fused_misses_ == 0 && kFusedMissesMaxBatch > 0);
  workspace_.max_splits =
      may_fuse ? sparse_attention_partials(dims_, kv_type_) : sparse_attention_max_splits(dims_);
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

cuda_backend::~cuda_backend() {
  (void)cudaSetDevice(device_);
  (void)cudaStreamSynchronize(own_stream_);
  (void)cudaStreamSynchronize(copy_stream_);
  arena_.release(own_stream_);
  views_.release(own_stream_);
  workspace_memory_.release(own_stream_);
  inv_freq_.release(own_stream_);
  batch_slots_.release(own_stream_);
  solver_infos_.release(own_stream_);
  key_stats_.release(own_stream_);
  for (device_buffer& values : device_values_) values.release(own_stream_);
  (void)cudaStreamSynchronize(own_stream_);
  host_values_.clear();
  // The handles destroy themselves (members declared before the buffers, so destroyed after them).
}

void cuda_backend::use_stream(std::optional<stream_view> stream) {
  SHADOWKV_CUDA_TRY(cudaSetDevice(device_));
  caller_stream_ = stream.has_value();
  stream_ = caller_stream_ ? reinterpret_cast<cudaStream_t>(stream->handle()) : own_stream_;
}

bool cuda_backend::capturing() const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  SHADOWKV_CUDA_TRY(cudaStreamIsCapturing(stream_, &status));
  return status != cudaStreamCaptureStatusNone;
}

void cuda_backend::finish_call() {
  fused_step_ = false;
  prefilling_ = false;
  launch_queued_append(false);  // (none is left by a call that reached its attention)
  join_append();
  join_fetch();
  if (!caller_stream_) SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
}

layer_view* cuda_backend::device_view(int slot, int layer) const {
  return static_cast<layer_view*>(views_.data()) + static_cast<std::ptrdiff_t>(slot) * config_.num_layers + layer;
}

std::int64_t cuda_backend::value_bytes_per_sequence() const {
  return static_cast<std::int64_t>(value_layer_bytes_) * config_.num_layers;
}

void cuda_backend::open_sequence(int slot, value_place values_on) {
  // Arenas are reserved for every slot when the store is built (prefill initialises a layer's arrays); the value
  // store is allocated here, before anything of the slot changes.
  device_guard guard(device_);
  const std::size_t bytes = value_layer_bytes_ * static_cast<std::size_t>(config_.num_layers);
  device_buffer on_device;
  host_buffer on_host;
  std::uint8_t* base = nullptr;
  if (values_on == value_place::device) {
    on_device = device_buffer(bytes, own_stream_, resources_->device_memory());
    base = static_cast<std::uint8_t*>(on_device.data());
  } else {
    on_host = host_buffer(bytes, resources_->host_memory());
    base = static_cast<std::uint8_t*>(on_host.device_pointer());
  }
  const std::size_t first = static_cast<std::size_t>(slot) * config_.num_layers;
  std::vector<layer_view> views(host_views_.begin() + static_cast<std::ptrdiff_t>(first),
                                host_views_.begin() + static_cast<std::ptrdiff_t>(first + config_.num_layers));
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    std::uint8_t* layer_base = base + static_cast<std::size_t>(layer) * value_layer_bytes_;
    views[static_cast<std::size_t>(layer)].value_store = layer_base;
    views[static_cast<std::size_t>(layer)].value_scales =
        dims_.value_fp8 != 0 ? reinterpret_cast<float*>(layer_base + value_codes_bytes_) : nullptr;
    views[static_cast<std::size_t>(layer)].values_in_place =
        values_in_place_ && values_on == value_place::device && dims_.value_fp8 == 0 ? 1 : 0;
  }
  // The slot's views (fresh counters, the new value store) go to the device before any kernel can read them.
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(device_view(slot, 0), views.data(), views.size() * sizeof(layer_view),
                                    cudaMemcpyHostToDevice, own_stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
  std::copy(views.begin(), views.end(), host_views_.begin() + static_cast<std::ptrdiff_t>(first));
  device_values_[static_cast<std::size_t>(slot)] = std::move(on_device);
  host_values_[static_cast<std::size_t>(slot)] = std::move(on_host);
  values_on_[static_cast<std::size_t>(slot)] = values_on;
}

void cuda_backend::close_sequence(int slot) noexcept {
  // Kernels of earlier calls may still read the value store: wait for both streams before freeing it.
  (void)cudaSetDevice(device_);
  (void)cudaStreamSynchronize(stream_);
  (void)cudaStreamSynchronize(copy_stream_);
  device_values_[static_cast<std::size_t>(slot)].release(own_stream_);
  (void)cudaStreamSynchronize(own_stream_);
  host_values_[static_cast<std::size_t>(slot)] = host_buffer();
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    host_view(slot, layer).value_store = nullptr;
    host_view(slot, layer).value_scales = nullptr;
  }
}

void cuda_backend::upload_batch(std::span<const batch_entry> entries) {
  std::vector<int> slots(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) slots[i] = entries[i].slot;
  batch_size_ = static_cast<std::int64_t>(entries.size());
  if (slots == uploaded_slots_) return;
  // The staging buffer may still be read by an earlier copy, and the slot list by the kernels on either stream (the
  // append, fetch and fold of a call that failed before stream_ joined them): wait for both streams.
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(copy_stream_));
  std::copy(slots.begin(), slots.end(), static_cast<int*>(batch_staging_.data()));
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(batch_slots_.data(), batch_staging_.data(), slots.size() * sizeof(int),
                                    cudaMemcpyHostToDevice, stream_));
  uploaded_slots_ = slots;
}

void cuda_backend::gram_matrix(const float* keys_pre, int rows, double* gram,
                               const device_resources::library_lease& libraries) {
  // Gram matrix KᵀK in float64, as the CPU backend's. It is split-K (prompt_kernels.cuh, gram_split): one batched
  // SGEMM computes the lower block triangle of each row slice's partial KᵀK in float32, a kernel adds the partials in
  // float64. One SYRK over all rows left a 1024 x 1024 output of a few dozen tiles to 132 SMs for 6 ms; the split
  // fills the GPU, skips the upper blocks, and sums fewer float32 terms per element than one SYRK (more accurate, not
  // less). (Row-major K[rows, n] is the column-major matrix Kᵀ[n, rows]; block (i, j) of a slice is Kᵀ_i · Kᵀ_jᵀ.)
  const int n = static_cast<int>(config_.kv_width());
  const gram_split split = plan_gram_split(n, rows, resources_->multiprocessors());
  const std::size_t entries = static_cast<std::size_t>(split.entries());
  device_buffer partials(std::max<std::size_t>(1, gram_partial_bytes(split, n)), stream_, resources_->device_memory());
  device_buffer pointers(std::max<std::size_t>(1, 3 * entries * sizeof(void*)), stream_, resources_->device_memory());
  auto** a_blocks = static_cast<const float**>(pointers.data());
  const float** b_blocks = a_blocks + entries;
  auto** c_blocks = static_cast<float**>(static_cast<void*>(b_blocks + entries));
  if (entries > 0) {
    launch_gram_block_pointers(keys_pre, n, split, static_cast<float*>(partials.data()), a_blocks, b_blocks, c_blocks,
                               stream_);
    const float one = 1.0F;
    const float zero = 0.0F;
    SHADOWKV_CUBLAS_TRY(cublasSgemmBatched(libraries.cublas(), CUBLAS_OP_N, CUBLAS_OP_T, split.block, split.block,
                                           split.slice_rows, &one, a_blocks, n, b_blocks, n, &zero, c_blocks, n,
                                           static_cast<int>(entries)));
  }
  // The sum writes the lower block triangle only (FILL_MODE_LOWER is all the eigensolver reads); the upper blocks are
  // zeroed so that no byte of the matrix is undefined: compute-sanitizer's initcheck reported one uninitialised
  // 8-byte read inside cuSOLVER's tridiagonal reduction (sytrd4_gpu) at 4e838fb. 8 MB at n = 1024: a few µs.
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(gram, 0, static_cast<std::size_t>(n) * n * sizeof(double), stream_));
  launch_sum_gram_partials(static_cast<const float*>(partials.data()), keys_pre, rows, n, split, gram, stream_);
  partials.release(stream_);
  pointers.release(stream_);
}

void cuda_backend::solve_gram_matrices(double* grams, int count, int* infos,
                                       const device_resources::library_lease& libraries) {
  // All eigenpairs of each matrix (cuSOLVER's batched solver has no index range); the basis takes the last `rank`
  // columns. Measured on the H200 (bench/NOTES.md, session 10): ~9.7 ms a 1024 x 1024 matrix, as Dsyevdx's top 160.
  const std::int64_t n = config_.kv_width();
  device_buffer eigenvalues(static_cast<std::size_t>(n) * count * sizeof(double), stream_, resources_->device_memory());
  std::size_t device_bytes = 0;
  std::size_t host_bytes = 0;
  SHADOWKV_CUSOLVER_TRY(cusolverDnXsyevBatched_bufferSize(
      libraries.cusolver(), libraries.cusolver_params(), CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n,
      CUDA_R_64F, grams, n, CUDA_R_64F, eigenvalues.data(), CUDA_R_64F, &device_bytes, &host_bytes, count));
  device_buffer device_work(std::max<std::size_t>(1, device_bytes), stream_, resources_->device_memory());
  std::vector<std::byte> host_work(std::max<std::size_t>(1, host_bytes));
  SHADOWKV_CUSOLVER_TRY(cusolverDnXsyevBatched(libraries.cusolver(), libraries.cusolver_params(),
                                               CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, grams,
                                               n, CUDA_R_64F, eigenvalues.data(), CUDA_R_64F, device_work.data(),
                                               device_bytes, host_work.data(), host_bytes, infos, count));
  // The infos stay on the device: the call reads every sequence's at once, after the last factorisation
  // (check_factorizations). Note that cuSOLVER's dense eigensolvers return only once the stream has drained, their
  // own work included (XsyevBatched, syevdx, syevd, syevj, gesvd; measured on the H200, bench/NOTES.md): the host
  // waits here once a group of sequences, and no ordering of our own calls removes that wait.
  eigenvalues.release(stream_);
  device_work.release(stream_);
}

void cuda_backend::svd_basis(const float* keys_pre, int rows, float* basis, int* info,
                             const device_resources::library_lease& libraries) {
  // Exact SVD of K (rows >= n): column-major float64 copy, cuSOLVER gesvd, B = the leading rows of Vᵀ.
  const int n = static_cast<int>(config_.kv_width());
  device_buffer matrix(static_cast<std::size_t>(rows) * n * sizeof(double), stream_, resources_->device_memory());
  device_buffer singular(static_cast<std::size_t>(n) * sizeof(double), stream_, resources_->device_memory());
  device_buffer vt(static_cast<std::size_t>(n) * n * sizeof(double), stream_, resources_->device_memory());
  launch_keys_to_double(keys_pre, rows, n, true, static_cast<double*>(matrix.data()), stream_);
  int lwork = 0;
  SHADOWKV_CUSOLVER_TRY(cusolverDnDgesvd_bufferSize(libraries.cusolver(), rows, n, &lwork));
  device_buffer work(static_cast<std::size_t>(lwork) * sizeof(double), stream_, resources_->device_memory());
  SHADOWKV_CUSOLVER_TRY(cusolverDnDgesvd(libraries.cusolver(), 'N', 'A', rows, n, static_cast<double*>(matrix.data()), rows,
                                         static_cast<double*>(singular.data()), nullptr, rows,
                                         static_cast<double*>(vt.data()), n, static_cast<double*>(work.data()), lwork,
                                         nullptr, info));
  // Vᵀ is column-major [n, n]: the i-th right singular vector is row i of Vᵀ.
  launch_basis_from_vectors(static_cast<const double*>(vt.data()), n, config_.rank, false, true, basis, stream_);
}

cuda_backend::prompt_keys cuda_backend::prepare_keys(const batch_entry& entry, std::size_t index,
                                                     const prefill_inputs& inputs) {
  const int len = static_cast<int>(entry.state->prompt_len);
  const std::size_t width = static_cast<std::size_t>(config_.kv_width());
  prompt_keys keys{
      device_buffer(len * width * sizeof(float), stream_, resources_->device_memory()),
      device_buffer(len * width * dtype_size(config_.kv_dtype), stream_, resources_->device_memory()),
      device_buffer(static_cast<std::size_t>(len) * sizeof(long long), stream_, resources_->device_memory())};
  launch_prepare_prompt_keys(dims_, kv_type_, as_strided(inputs.keys),
                             inputs.positions.empty() ? strided_tensor{nullptr, 0, {0, 0, 0, 0}}
                                                      : strided_tensor{inputs.positions.data, 0,
                                                                       {inputs.positions.strides[0],
                                                                        inputs.positions.strides[1], 0, 0}},
                             inputs.positions.empty() ? 64 : index_bits(inputs.positions), static_cast<int>(entry.row),
                             len, inputs.keys_post_rope, static_cast<const float*>(inv_freq_.data()),
                             static_cast<float*>(keys.pre_rope.data()), keys.post_rope.data(),
                             static_cast<long long*>(keys.positions.data()), stats_of(index), stream_);
  // Keys whose largest magnitude the float32 Gram matrix cannot square: scaled by a power of two, as on the CPU
  // backend (A is scaled back in prefill_one); nothing happens, but a launch that reads one word, for all other keys.
  launch_scale_keys_for_gram(static_cast<float*>(keys.pre_rope.data()), static_cast<long long>(len) * config_.kv_width(),
                             stats_of(index), stream_);
  return keys;
}

void cuda_backend::prefill_gram_group(int layer, std::span<const batch_entry> entries, std::size_t first,
                                      std::size_t end, const prefill_inputs& inputs,
                                      const device_resources::library_lease& libraries) {
  const std::size_t n = static_cast<std::size_t>(config_.kv_width());
  const std::size_t matrix = n * n;
  device_buffer grams(matrix * (end - first) * sizeof(double), stream_, resources_->device_memory());
  auto* gram = static_cast<double*>(grams.data());
  // Each sequence's keys are prepared twice: here for its Gram matrix, and again in prefill_one for A = K·Bᵀ, the
  // landmarks and the scatter (a pass at HBM speed, ~0.3 ms at 122K tokens), so that no group holds every prompt's
  // float32 keys (500 MB a sequence at 122K) across its eigensolve.
  for (std::size_t b = first; b < end; ++b) {
    prompt_keys keys = prepare_keys(entries[b], b, inputs);
    gram_matrix(static_cast<const float*>(keys.pre_rope.data()), static_cast<int>(entries[b].state->prompt_len),
                gram + matrix * (b - first), libraries);
    keys.release(stream_);
  }
  try {
    solve_gram_matrices(gram, static_cast<int>(end - first), static_cast<int*>(solver_infos_.data()) + first,
                        libraries);
  } catch (const cuda_error&) {
    // Keys that overflowed under RoPE make a Gram matrix of infinities, on which cuSOLVER may fail outright: the
    // caller's error is the keys, as on the CPU backend.
    reject_overflowed_keys(entries, first, end);
    throw;
  }
  // After the call's last factorisation every info is final and the stream has drained (cuSOLVER returns only then):
  // reading them here costs a copy, where a read at the end of the call would also wait for the last group's
  // A = K·Bᵀ, landmarks and scatter, which otherwise run on while the caller queues its next work.
  if (end == entries.size()) check_factorizations(entries);
  // Eigenvalues ascend: the leading `rank` vectors are the last columns of each matrix.
  const std::size_t leading = (n - static_cast<std::size_t>(config_.rank)) * n;
  for (std::size_t b = first; b < end; ++b) {
    prefill_one(layer, entries, b, inputs, libraries, gram + matrix * (b - first) + leading);
  }
  grams.release(stream_);
}

void cuda_backend::prefill_one(int layer, std::span<const batch_entry> entries, std::size_t index,
                               const prefill_inputs& inputs, const device_resources::library_lease& libraries,
                               const double* eigenvectors) {
  const batch_entry& entry = entries[index];
  const layer_state& state = *entry.state;
  const int len = static_cast<int>(state.prompt_len);
  const int chunks = static_cast<int>(state.prompt_context_chunks);
  const int outliers = static_cast<int>(state.outlier_chunks);
  const std::size_t width = static_cast<std::size_t>(config_.kv_width());
  const std::size_t element = dtype_size(config_.kv_dtype);
  const layer_view& view = host_view(entry.slot, layer);

  // All workspace first (the key preparation writes only its own buffers and key_stats): an allocation failure
  // leaves the layer untouched.
  prompt_keys keys = prepare_keys(entry, index, inputs);
  device_buffer& keys_pre = keys.pre_rope;
  device_buffer& keys_post = keys.post_rope;
  device_buffer& positions = keys.positions;
  device_buffer min_cosine(std::max<std::size_t>(1, static_cast<std::size_t>(config_.num_kv_heads) * chunks) * sizeof(float),
                           stream_, resources_->device_memory());
  device_buffer outlier_ids(std::max<std::size_t>(1, static_cast<std::size_t>(config_.num_kv_heads) * config_.outlier_chunks) *
                                sizeof(int), stream_, resources_->device_memory());
  // Two-centroid scores keep no landmarks, but the outlier rule needs them: computed into a scratch copy of the
  // layout ([Hkv, max_chunks, D]).
  device_buffer scratch_landmarks;
  if (dims_.chunk_centroids != 0 && chunks > 0) {
    scratch_landmarks = device_buffer(static_cast<std::size_t>(dims_.max_chunks) * width * element, stream_,
                                      resources_->device_memory());
  }
  void* landmarks = dims_.chunk_centroids != 0 ? scratch_landmarks.data() : view.landmarks;
  // bf16 factors are computed in float32 and rounded once: B first (the projection uses B as held), then A.
  const bool bf16_factors = dims_.factor_bf16 != 0;
  const int context_tokens = chunks * config_.chunk_size;
  const std::size_t basis_elements = static_cast<std::size_t>(config_.rank) * width;
  const std::size_t coefficient_elements = static_cast<std::size_t>(context_tokens) * config_.rank;
  device_buffer basis32;
  device_buffer coefficients32;
  if (bf16_factors) {
    basis32 = device_buffer(basis_elements * sizeof(float), stream_, resources_->device_memory());
    coefficients32 = device_buffer(std::max<std::size_t>(1, coefficient_elements) * sizeof(float), stream_,
                                   resources_->device_memory());
  }
  auto* basis = static_cast<float*>(bf16_factors ? basis32.data() : view.basis);
  auto* coefficients = static_cast<float*>(bf16_factors ? coefficients32.data() : view.coefficients);
  const std::size_t value_bytes = static_cast<std::size_t>(chunks) * config_.chunk_size * width * element;
  // The prompt's values are packed chunk-major in the store's dtype: straight into a device value store, else into a
  // device staging buffer. fp8 quantizes that into the store's layout (codes, scales) — in place on the device, or
  // into a second staging buffer — and a host value store then takes one copy of the codes and one of the scales.
  const bool values_on_device = values_on_[static_cast<std::size_t>(entry.slot)] == value_place::device;
  const bool fp8 = dims_.value_fp8 != 0;
  const long long runs = static_cast<long long>(chunks) * config_.num_kv_heads;
  const std::size_t code_bytes = static_cast<std::size_t>(runs) * config_.chunk_size * config_.head_dim;
  device_buffer value_staging;
  if (!values_on_device || fp8) {
    value_staging = device_buffer(std::max<std::size_t>(1, value_bytes), stream_, resources_->device_memory());
  }
  device_buffer fp8_staging;
  if (fp8 && !values_on_device) fp8_staging = device_buffer(value_layer_bytes_, stream_, resources_->device_memory());
  void* value_target = values_on_device && !fp8 ? view.value_store : value_staging.data();
  auto* codes_target = static_cast<std::uint8_t*>(values_on_device ? view.value_store : fp8_staging.data());
  float* scales_target = values_on_device ? view.value_scales
                                          : reinterpret_cast<float*>(static_cast<std::uint8_t*>(fp8_staging.data()) +
                                                                     value_codes_bytes_);

  if (eigenvectors != nullptr) {
    // Gram path (prefill_gram_group): the group's eigensolve has run and the call's infos are checked.
    launch_basis_from_vectors(eigenvectors, static_cast<int>(width), config_.rank, true, false, basis, stream_);
  } else {
    try {
      svd_basis(static_cast<const float*>(keys_pre.data()), len, basis,
                static_cast<int*>(solver_infos_.data()) + index, libraries);
    } catch (const cuda_error&) {
      reject_overflowed_keys(entries, index, index + 1);  // as in prefill_gram_group
      throw;
    }
    // After the call's last factorisation every info is final and the stream has drained (cuSOLVER returns only
    // then); see prefill_gram_group.
    if (index + 1 == entries.size()) check_factorizations(entries);
  }
  if (bf16_factors) {
    launch_factors_to_bf16(basis, static_cast<long long>(basis_elements), view.basis, true, stream_);
  }
  if (chunks > 0) {
    // A = K_ctx · Bᵀ: column-major Aᵀ[r, ctx] = (Bᵀ as column-major [width, r])ᵀ · Kᵀ[width, ctx].
    const float one = 1.0F;
    const float zero = 0.0F;
    SHADOWKV_CUBLAS_TRY(cublasSgemm(libraries.cublas(), CUBLAS_OP_T, CUBLAS_OP_N, config_.rank, context_tokens,
                                    static_cast<int>(width), &one, basis, static_cast<int>(width),
                                    static_cast<const float*>(keys_pre.data()), static_cast<int>(width), &zero,
                                    coefficients, config_.rank));
    // From keys scaled for the Gram matrix (launch_scale_keys_for_gram): back to the keys' own scale.
    launch_unscale_coefficients(coefficients, static_cast<long long>(config_.rank) * context_tokens, stats_of(index),
                                stream_);
    if (bf16_factors) {
      launch_factors_to_bf16(coefficients, static_cast<long long>(coefficient_elements), view.coefficients, false,
                             stream_);
    }
  }
  launch_landmarks(dims_, kv_type_, keys_post.data(), chunks, landmarks, static_cast<float*>(min_cosine.data()),
                   stream_);
  if (dims_.chunk_centroids != 0) launch_chunk_centroids(dims_, kv_type_, keys_post.data(), chunks, view, stream_);
  const int sinks = std::min(config_.sink_chunks, outliers);
  if (sinks > 0) {
    // Attention sinks rank below every cosine: each byte 0xC0 makes the float 0xC0C0C0C0 = -6.02 (docs/semantics.md).
    SHADOWKV_CUDA_TRY(cudaMemset2DAsync(min_cosine.data(), static_cast<std::size_t>(chunks) * sizeof(float), 0xC0,
                                        static_cast<std::size_t>(sinks) * sizeof(float),
                                        static_cast<std::size_t>(config_.num_kv_heads), stream_));
  }
  launch_pick_outliers(dims_, static_cast<const float*>(min_cosine.data()), chunks, outliers, view.is_outlier,
                       static_cast<int*>(outlier_ids.data()), stream_);
  launch_scatter_prompt(dims_, kv_type_, keys_post.data(), as_strided(inputs.values), static_cast<int>(entry.row), len,
                        chunks, outliers, static_cast<const int*>(outlier_ids.data()),
                        static_cast<const long long*>(positions.data()), view, value_target, stream_);
  if (fp8) {
    launch_quantize_value_runs(kv_type_, value_staging.data(), runs, config_.chunk_size * config_.head_dim,
                               codes_target, scales_target, stream_);
  }
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.cache_chunks, 0xff,
                                    static_cast<std::size_t>(config_.num_kv_heads) * config_.cache_slots() * sizeof(int),
                                    stream_));
  if (view.cache_last_used != nullptr) {
    // K > k: the cache starts empty, with its LRU clock at zero (as the CPU backend's fresh cpu_layer_data).
    SHADOWKV_CUDA_TRY(cudaMemsetAsync(
        view.cache_last_used, 0,
        static_cast<std::size_t>(config_.num_kv_heads) * config_.cache_slots() * sizeof(long long), stream_));
    SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.selection_clock, 0,
                                      static_cast<std::size_t>(config_.num_kv_heads) * sizeof(long long), stream_));
    SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.selected_slots, 0xff,
                                      static_cast<std::size_t>(config_.num_kv_heads) * config_.budget_chunks() *
                                          sizeof(int),
                                      stream_));
  }
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.slot_of_chunk, 0xff,
                                    static_cast<std::size_t>(config_.num_kv_heads) * dims_.max_chunks * sizeof(int),
                                    stream_));
  // No hint from an earlier sequence of the slot (any hint would select the same; this one starts on the full path).
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(view.selection_hint, 0, static_cast<std::size_t>(config_.num_kv_heads) * sizeof(unsigned),
                                    stream_));
  launch_set_prefill_counters(device_view(entry.slot, layer), len, chunks, outliers,
                              static_cast<int>(state.local_len), static_cast<const long long*>(positions.data()), len,
                              stream_);
  // Values to the pinned value store on the copy stream, overlapping whatever the caller does next.
  if (!values_on_device && value_bytes > 0) {
    SHADOWKV_CUDA_TRY(cudaEventRecord(values_ready_event_, stream_));
    SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, values_ready_event_, 0));
    const host_buffer& store = host_values_[static_cast<std::size_t>(entry.slot)];
    auto* host_target = static_cast<std::uint8_t*>(store.data()) +
                        (static_cast<std::uint8_t*>(view.value_store) -
                         static_cast<std::uint8_t*>(store.device_pointer()));
    if (fp8) {
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_target, fp8_staging.data(), code_bytes, cudaMemcpyDeviceToHost,
                                        copy_stream_));
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_target + value_codes_bytes_,
                                        static_cast<std::uint8_t*>(fp8_staging.data()) + value_codes_bytes_,
                                        static_cast<std::size_t>(runs) * sizeof(float), cudaMemcpyDeviceToHost,
                                        copy_stream_));
      fp8_staging.release(copy_stream_);
    } else {
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_target, value_staging.data(), value_bytes, cudaMemcpyDeviceToHost,
                                        copy_stream_));
    }
  }
  value_staging.release(values_on_device ? stream_ : copy_stream_);
  keys_pre.release(stream_);
  keys_post.release(stream_);
  positions.release(stream_);
  min_cosine.release(stream_);
  outlier_ids.release(stream_);
  scratch_landmarks.release(stream_);
}

void cuda_backend::prefill(int layer, std::span<const batch_entry> entries, const prefill_inputs& inputs) {
  device_guard guard(device_);
  prefilling_ = true;  // its selection (with q_last) is not followed by an attention: no fused rebuild (fuse_step)
  // The device's cuBLAS/cuSOLVER handles, bound to this call's stream, for the whole call (another store on the same
  // device waits for them; device_resources.hpp).
  const device_resources::library_lease libraries = resources_->libraries(stream_);
  // No sequence waits for its own factorisation: each leaves its cuSOLVER info in its own int of solver_infos_, and
  // the host reads them all once, after the call's last factorisation. So the layers are written whatever the infos
  // say: until the store commits them (after this returns) nothing reads a layer's device arrays, and a later prefill
  // of it rewrites them all. A failed call puts the counters back as well (forget_prefill). Consecutive sequences
  // factorised by their Gram matrices share one batched eigensolve (kEigensolveGroup at most): cuSOLVER's host wait
  // comes once a group, not once a sequence.
  try {
    std::size_t first = 0;
    while (first < entries.size()) {
      const auto by_gram = [&](std::size_t b) { return factorizes_by_gram(config_, entries[b].state->prompt_len); };
      if (!by_gram(first)) {
        prefill_one(layer, entries, first, inputs, libraries, nullptr);
        ++first;
        continue;
      }
      std::size_t end = first + 1;
      while (end < entries.size() && end - first < kEigensolveGroup && by_gram(end)) ++end;
      prefill_gram_group(layer, entries, first, end, inputs, libraries);
      first = end;
    }
  } catch (...) {
    forget_prefill(layer, entries);
    throw;
  }
}

key_stats* cuda_backend::stats_of(std::size_t index) const {
  return static_cast<key_stats*>(key_stats_.data()) + index;
}

void cuda_backend::reject_overflowed_keys(std::span<const batch_entry> entries, std::size_t first, std::size_t end) {
  auto* stats = static_cast<key_stats*>(key_stats_host_.data());
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(stats + first, stats_of(first), (end - first) * sizeof(key_stats),
                                    cudaMemcpyDeviceToHost, stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  for (std::size_t b = first; b < end; ++b) {
    // The CPU backend's words (cpu_backend.cpp), so that both backends reject the same keys alike.
    SHADOWKV_EXPECTS(stats[b].overflowed == 0, "keys of slot ", entries[b].slot,
                     " are too large: applying or removing RoPE overflows float32");
  }
}

void cuda_backend::check_factorizations(std::span<const batch_entry> entries) {
  reject_overflowed_keys(entries, 0, entries.size());  // first: such keys make the infos meaningless
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(solver_infos_host_.data(), solver_infos_.data(), entries.size() * sizeof(int),
                                    cudaMemcpyDeviceToHost, stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  const auto* infos = static_cast<const int*>(solver_infos_host_.data());
  for (std::size_t b = 0; b < entries.size(); ++b) {
    if (infos[b] == 0) continue;
    const batch_entry& entry = entries[b];
    const std::int64_t rows = entry.state->prompt_len;
    const std::int64_t n = config_.kv_width();
    throw cuda_error(factorizes_by_gram(config_, rows)
                         ? shadowkv::detail::format_message("cusolverDnXsyevBatched failed on the ", n, "x", n,
                                                            " Gram matrix of slot ", entry.slot, " (row ", entry.row,
                                                            " of the batch; info=", infos[b], ")")
                         : shadowkv::detail::format_message("cusolverDnDgesvd failed on a ", rows, "x", n,
                                                            " key matrix of slot ", entry.slot, " (row ", entry.row,
                                                            " of the batch; info=", infos[b], ")"));
  }
}

void cuda_backend::forget_prefill(int layer, std::span<const batch_entry> entries) noexcept {
  // The store does not commit a failed prefill, so its layers' arrays stay unread; but their counters are what
  // outlier_chunks and last_position read, and the store answers outlier_chunks for a layer not prefilled too. Wait
  // for what the call queued, then put back the views open_sequence uploaded (fresh counters, the same pointers).
  (void)cudaStreamSynchronize(stream_);
  for (const batch_entry& entry : entries) {
    (void)cudaMemcpyAsync(device_view(entry.slot, layer), &host_view(entry.slot, layer), sizeof(layer_view),
                          cudaMemcpyHostToDevice, own_stream_);
  }
  (void)cudaStreamSynchronize(own_stream_);
}

void cuda_backend::fold_oldest_generated_chunk(int /*layer*/, std::span<const batch_entry> /*entries*/) {
  // The device folds a full ring at the end of the step that filled it (attend: after the attention's split kernel,
  // beside its combine), by the same rule, so that neither the fold nor the append waits in front of this step's
  // selection. The store calls this at the start of the next step, when its counters say a ring is full: append_token
  // (which the store calls next, with the whole batch) launches the fold again over that batch first, a no-op on the
  // device for every ring that is not full, i.e. unless the step that filled it did not reach its end. (Launched here,
  // over `entries`, a subset of the batch in a ragged one, it would upload another slot list, and each upload waits
  // for both streams.) Not while a graph is captured: its replays fold at the end of each replayed step.
  if (!capturing()) fold_requested_ = true;
}

void cuda_backend::append_token(int layer, std::span<const batch_entry> entries, const append_inputs& inputs) {
  prefilling_ = false;  // a decode call (a prefill that failed before its finish_call may have left it set)
  upload_batch(entries);
  if (fold_requested_) {  // fold_oldest_generated_chunk
    fold_requested_ = false;
    join_append();  // an append of a call that failed before its attention still writes the counters this reads
    launch_fold_generated(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                          static_cast<const int*>(batch_slots_.data()), layer, static_cast<int>(entries.size()),
                          static_cast<const float*>(inv_freq_.data()), stream_);
  }
  // Queued, not launched: select_chunks launches it on the copy stream once the first part's landmark logits are
  // done, beside the select kernel (the logits' one-wave grid fills every multiprocessor, and a CTA of the append
  // beside it made one of theirs wait: logits 17.0 -> 18.3 µs at B = 1, bench/NOTES.md session 20). Nothing of the
  // selection reads the generated region; the attention waits for the append (attend). The inputs stay valid: the
  // append is launched within this decode call (select_chunks, else attend or finish_call).
  queued_append_ = queued_append{layer,
                                 static_cast<int>(entries.size()),
                                 as_strided(inputs.keys),
                                 as_strided(inputs.values),
                                 inputs.positions.empty()
                                     ? strided_tensor{nullptr, 0, {0, 0, 0, 0}}
                                     : strided_tensor{inputs.positions.data, 0, {inputs.positions.strides[0], 0, 0, 0}},
                                 inputs.positions.empty() ? 64 : index_bits(inputs.positions),
                                 inputs.keys_post_rope};
}

void cuda_backend::launch_queued_append(bool beside_select) {
  if (!queued_append_.has_value()) return;
  const queued_append append = *queued_append_;
  queued_append_.reset();
  cudaStream_t stream = stream_;
  if (beside_select) {  // logits_done_event_ follows the caller's work on stream_ too (k_new, v_new)
    SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, logits_done_event_, 0));
    stream = copy_stream_;
  }
  launch_append_generated(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                          static_cast<const int*>(batch_slots_.data()), append.layer, append.batch, append.keys,
                          append.values, append.positions, append.positions_bits, append.keys_post_rope,
                          static_cast<const float*>(inv_freq_.data()), stream);
  if (beside_select) {
    SHADOWKV_CUDA_TRY(cudaEventRecord(appended_event_, copy_stream_));
    append_pending_ = true;
  }
}

std::vector<cuda_backend::batch_part> cuda_backend::pipeline_parts(std::span<const batch_entry> entries) const {
  const int batch = static_cast<int>(entries.size());
  // The backend's choice: kDefaultPipelineParts parts from kPipelineFromBatch sequences when values cross PCIe, else
  // one, split tapered (tapered_pipeline_split). Measured on the H200 (bench/NOTES.md, 1dbd902: attention part by part; B=24, S=122880, hit 0.61, eager /
  // graph replay): 1 part 1.371 / 1.235 ms, 2 parts 1.104 / 0.989, 3 parts 1.087 / 0.989, 4 parts 1.117 / 1.025,
  // 6 parts 1.271 / 1.077 (each part adds ~65 µs of latency-bound score and select kernels to the compute stream);
  // device values have no PCIe transfer to hide. fp8 values (half the bytes) are bound by the compute stream, where each
  // part costs its own logits and select launches: two parts (bench/NOTES.md session 14; B = 24, hit 0.61, graph:
  // 0.760 / 0.753 ms in two runs against 0.788 / 0.793 with three; at hit 0.04 three stay ahead, 1.274 / 1.289
  // against 1.325 / 1.311).
  int count = config_.decode_pipeline_parts;
  if (count <= 0) {
    const int parts = dims_.value_fp8 != 0 ? kDefaultPipelinePartsFp8 : kDefaultPipelineParts;
    count = batch >= kPipelineFromBatch && any_host_values(entries) ? parts : 1;
  }
  count = std::clamp(count, 1, std::max(1, batch));
  std::vector<batch_part> parts(static_cast<std::size_t>(count));
  for (int p = 0; p < count; ++p) {
    parts[static_cast<std::size_t>(p)].first = part_start(p, count, batch, tapered_split_);
    parts[static_cast<std::size_t>(p)].count =
        part_start(p + 1, count, batch, tapered_split_) - part_start(p, count, batch, tapered_split_);
  }
  return parts;
}

step_workspace cuda_backend::workspace_from(int first) const {
  const long long b = first;
  step_workspace part = workspace_;
  part.logits += b * config_.num_q_heads * dims_.max_chunks;
  part.scores += b * config_.num_kv_heads * dims_.max_chunks;
  part.selected += b * config_.num_kv_heads * config_.budget_chunks();
  part.miss_slots += b * config_.num_kv_heads * config_.budget_chunks();
  part.miss_counts += b * config_.num_kv_heads;
  part.partial += b * config_.num_q_heads * workspace_.max_splits * (config_.head_dim + 2);
  return part;
}

void cuda_backend::select_chunks(int layer, std::span<const batch_entry> entries, const tensor_view& queries) {
  try {
    select_parts(layer, entries, queries);
  } catch (...) {
    launch_queued_append(false);  // while this call's inputs are valid
    throw;
  }
}

void cuda_backend::select_parts(int layer, std::span<const batch_entry> entries, const tensor_view& queries) {
  join_fetch();  // a call that failed after its fetch was queued: the selection below rewrites what it reads
  fused_step_ = false;
  upload_batch(entries);
  parts_ = pipeline_parts(entries);
  const strided_tensor all_queries = as_strided(queries);
  // [B, L, Hq, D] -> the first query token's [B, Hq, D], for a fused step's key rebuild (miss_attention).
  selection_queries_ = all_queries;
  selection_queries_.stride[1] = all_queries.stride[2];
  selection_queries_.stride[2] = all_queries.stride[3];
  const std::size_t element = dtype_size(queries.float_type);
  for (std::size_t p = 0; p < parts_.size(); ++p) {
    const batch_part& part = parts_[p];
    strided_tensor part_queries = all_queries;
    part_queries.data = static_cast<const std::uint8_t*>(all_queries.data) +
                        static_cast<std::ptrdiff_t>(part.first) * all_queries.stride[0] * static_cast<std::ptrdiff_t>(element);
    // After the first part, an earlier part's fetch may hold up to its CTAs (one each on as many multiprocessors)
    // while this part's landmark logits run: the one-wave logits grid leaves room for them.
    const int beside = p == 0 ? 0 : fetch_ctas(entries.subspan(parts_[p - 1].first, parts_[p - 1].count));
    const bool append_after = p == 0 && queued_append_.has_value();
    launch_select_chunks(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                         static_cast<const int*>(batch_slots_.data()) + part.first, layer, part.count, part_queries,
                         static_cast<int>(queries.shape[1]), workspace_from(part.first), beside, stream_,
                         append_after ? static_cast<cudaEvent_t>(logits_done_event_) : nullptr);
    SHADOWKV_CUDA_TRY(cudaEventRecord(part_selected_events_[p], stream_));
    if (append_after) launch_queued_append(true);
  }
}

void cuda_backend::fetch_values(int layer, std::span<const batch_entry> entries) {
  // A fused step (fuse_step, decided here for rebuild_keys and attend) launches no fetch: its key rebuild copies the
  // missed values into the selection cache itself, from the shared memory its attention over them reads, and counts
  // their bytes.
  fused_step_ = fuse_step(entries);
  if (fused_step_) return;
  for (std::size_t p = 0; p < parts_.size(); ++p) {
    const batch_part& part = parts_[p];
    SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, part_selected_events_[p], 0));
    launch_fetch_values(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                        static_cast<const int*>(batch_slots_.data()) + part.first, layer, part.count,
                        workspace_from(part.first), fetch_ctas(entries.subspan(part.first, part.count)),
                        any_host_values(entries.subspan(part.first, part.count)) ? fetch_priority_host_ : 0,
                        copy_stream_);
    if (p + 1 < parts_.size()) SHADOWKV_CUDA_TRY(cudaEventRecord(part_fetched_events_[p], copy_stream_));
  }
  SHADOWKV_CUDA_TRY(cudaEventRecord(fetched_event_, copy_stream_));
  fetch_pending_ = true;
}

bool cuda_backend::any_host_values(std::span<const batch_entry> entries) const {
  return std::any_of(entries.begin(), entries.end(), [&](const batch_entry& entry) {
    return values_on_[static_cast<std::size_t>(entry.slot)] != value_place::device;
  });
}

int cuda_backend::fetch_ctas(std::span<const batch_entry> entries) const {
  return any_host_values(entries) ? fetch_ctas_host_ : fetch_ctas_device_;
}

dims cuda_backend::step_dims(int batch) const {
  dims d = dims_;
  d.attention_early = attention_early_ > 0 || (attention_early_ == 0 && batch <= kEarlyAttentionMaxBatch) ? 1 : 0;
  return d;
}

bool cuda_backend::fuse_step(std::span<const batch_entry> entries) const {
  if (fused_misses_ < 0 || prefilling_ || parts_.size() != 1 || any_host_values(entries)) return false;
  if (fused_misses_ == 0 && static_cast<int>(entries.size()) > kFusedMissesMaxBatch) return false;
  dims d = dims_;
  d.fused_misses = 1;
  return sparse_attention_fuses(d, kv_type_, workspace_.max_splits);
}

void cuda_backend::rebuild_keys(int layer, std::span<const batch_entry> entries) {
  const int batch = static_cast<int>(entries.size());
  dims d = step_dims(batch);
  if (fused_step_) {  // decided by fetch_values, which the store calls first
    // The rebuild attends over the missed rows (its partials after the attention's splits) and releases the attention
    // at its start: the attention then walks the other rows beside it (attend).
    d.fused_misses = 1;
    d.attention_early = 1;
    const miss_attention attention{selection_queries_, workspace_.partial,
                                   sparse_attention_splits(d, kv_type_, batch, workspace_.max_splits),
                                   workspace_.max_splits};
    launch_rebuild_keys(d, kv_type_, static_cast<layer_view*>(views_.data()),
                        static_cast<const int*>(batch_slots_.data()), layer, batch, workspace_,
                        static_cast<const float*>(inv_freq_.data()), stream_, &attention);
    return;
  }
  launch_rebuild_keys(d, kv_type_, static_cast<layer_view*>(views_.data()),
                      static_cast<const int*>(batch_slots_.data()), layer, batch, workspace_,
                      static_cast<const float*>(inv_freq_.data()), stream_);
  // No wait for the fetch here: attention waits for each part's values (attend), and finish_call (or the next
  // select_chunks, after a failed call) joins the whole fetch.
}

void cuda_backend::join_append() {
  if (!append_pending_) return;
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, appended_event_, 0));
  append_pending_ = false;
}

void cuda_backend::join_fetch() {
  if (!fetch_pending_) return;
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, fetched_event_, 0));
  fetch_pending_ = false;
}

void cuda_backend::attend(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                          const mutable_tensor_view& out) {
  // Part by part, each as soon as its values are in: the attention of the earlier parts runs while the later parts'
  // values still cross PCIe, so only the last part's attention follows the fetch. The split count is chosen per part
  // (sparse_attention.cu): a part's outputs equal the whole batch's up to the rounding of the split combine.
  const strided_tensor all_queries = as_strided(queries);
  const strided_tensor all_out = as_strided(out);
  const auto query_element = static_cast<std::ptrdiff_t>(dtype_size(queries.float_type));
  const auto out_element = static_cast<std::ptrdiff_t>(dtype_size(out.float_type));
  const std::vector<batch_part> one_part{batch_part{0, static_cast<int>(entries.size())}};
  const std::vector<batch_part>& parts = parts_.empty() ? one_part : parts_;
  // Whether a ring is full after this step's append (the store's counters already count it), so that the step ends
  // with a fold; while a graph is captured the counters stand still, and every replay checks on the device.
  const bool fold_after = capturing() || std::any_of(entries.begin(), entries.end(), [&](const batch_entry& entry) {
                            return rules::fold_due<std::int64_t>(entry.state->generated_exact_len,
                                                                 config_.generation_window);
                          });
  launch_queued_append(false);  // (when no selection launched it)
  join_append();                // the new tokens' rows
  // A fused step (rebuild_keys): the attention reads no slot this step missed, so it does not wait for their values;
  // stream_ joins the fetch after it.
  const bool fused = fused_step_ && parts.size() == 1;
  fused_step_ = false;
  dims d = step_dims(static_cast<int>(entries.size()));
  if (fused) {
    d.fused_misses = 1;
    d.attention_early = 1;
  }
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const batch_part& part = parts[p];
    // The last part waits for the whole fetch (fetched_event_ follows its fetch), the others for their own; a fused
    // step's part waits for none.
    if (p + 1 == parts.size() && !fused) {
      join_fetch();
    } else if (fetch_pending_ && !fused) {
      SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, part_fetched_events_[p], 0));
    }
    strided_tensor part_queries = all_queries;
    strided_tensor part_out = all_out;
    part_queries.data = static_cast<const std::uint8_t*>(all_queries.data) +
                        static_cast<std::ptrdiff_t>(part.first) * all_queries.stride[0] * query_element;
    part_out.data = static_cast<const std::uint8_t*>(all_out.data) +
                    static_cast<std::ptrdiff_t>(part.first) * all_out.stride[0] * out_element;
    const bool last = p + 1 == parts.size();
    const step_workspace part_workspace = workspace_from(part.first);
    launch_sparse_attention(d, kv_type_, static_cast<const layer_view*>(views_.data()),
                            static_cast<const int*>(batch_slots_.data()) + part.first, layer, part.count,
                            part_queries, part_out, part_workspace.partial, workspace_.max_splits, stream_,
                            last && fold_after ? static_cast<cudaEvent_t>(splits_done_event_) : nullptr,
                            fused ? part_workspace.miss_slots : nullptr, fused ? part_workspace.miss_counts : nullptr);
  }
  if (fused) join_fetch();
  // Full rings are folded now, for the next step's selection (fold_oldest_generated_chunk), on the copy stream
  // beside the last combine: after the split kernels, nothing of this step reads the generated region or the
  // context arrays. stream_ waits for it before the call ends (the caller's next work, and a graph's capture, see
  // one stream again). Eager steps that fill no ring launch nothing here (the fold would find nothing to do).
  if (!fold_after) return;
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(copy_stream_, splits_done_event_, 0));
  launch_fold_generated(dims_, kv_type_, static_cast<layer_view*>(views_.data()),
                        static_cast<const int*>(batch_slots_.data()), layer, static_cast<int>(entries.size()),
                        static_cast<const float*>(inv_freq_.data()), copy_stream_);
  SHADOWKV_CUDA_TRY(cudaEventRecord(folded_event_, copy_stream_));
  SHADOWKV_CUDA_TRY(cudaStreamWaitEvent(stream_, folded_event_, 0));
}

chunk_ids_per_head cuda_backend::selected_chunks(int layer, int slot) const {
  device_guard guard(device_);
  const layer_view& view = host_view(slot, layer);
  const auto slots = static_cast<std::size_t>(config_.cache_slots());
  const auto listed = static_cast<std::size_t>(config_.budget_chunks());
  std::vector<int> chunks(static_cast<std::size_t>(config_.num_kv_heads) * slots);
  // K > k: the selection is the listed slots (the others hold chunks selected earlier); K == k: every filled slot.
  const bool lru = view.selected_slots != nullptr;
  std::vector<int> selected(lru ? static_cast<std::size_t>(config_.num_kv_heads) * listed : 0);
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  read_back(chunks.data(), view.cache_chunks, chunks.size() * sizeof(int));
  if (lru) read_back(selected.data(), view.selected_slots, selected.size() * sizeof(int));
  chunk_ids_per_head result(static_cast<std::size_t>(config_.num_kv_heads));
  for (int h = 0; h < config_.num_kv_heads; ++h) {
    const auto row = static_cast<std::size_t>(h);
    if (lru) {
      for (std::size_t e = 0; e < listed; ++e) {
        const int s = selected[row * listed + e];
        if (s >= 0) result[row].push_back(chunks[row * slots + static_cast<std::size_t>(s)]);
      }
    } else {
      for (std::size_t s = 0; s < slots; ++s) {
        const int c = chunks[row * slots + s];
        if (c >= 0) result[row].push_back(c);
      }
    }
    std::sort(result[static_cast<std::size_t>(h)].begin(), result[static_cast<std::size_t>(h)].end());
  }
  return result;
}

chunk_ids_per_head cuda_backend::outlier_chunks(int layer, int slot) const {
  device_guard guard(device_);
  const layer_view& view = host_view(slot, layer);
  layer_view counters{};
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  read_back(&counters, device_view(slot, layer), sizeof(layer_view));
  std::vector<std::uint8_t> flags(static_cast<std::size_t>(config_.num_kv_heads) * dims_.max_chunks);
  read_back(flags.data(), view.is_outlier, flags.size());
  chunk_ids_per_head result(static_cast<std::size_t>(config_.num_kv_heads));
  for (int h = 0; h < config_.num_kv_heads; ++h) {
    for (int c = 0; c < counters.context_chunks; ++c) {
      if (flags[static_cast<std::size_t>(h) * dims_.max_chunks + c] != 0) result[static_cast<std::size_t>(h)].push_back(c);
    }
  }
  return result;
}

std::int64_t cuda_backend::last_position(int layer, int slot) const {
  device_guard guard(device_);
  layer_view counters{};
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  read_back(&counters, device_view(slot, layer), sizeof(layer_view));
  return counters.last_position;
}

memory_report cuda_backend::memory(std::span<const layer_state* const> states) const {
  // In use by the documented formulas (docs/semantics.md), plus what is reserved for the configured capacity.
  memory_report report;
  const std::int64_t e = static_cast<std::int64_t>(dtype_size(config_.kv_dtype));
  const std::int64_t width = config_.kv_width();
  const std::int64_t chunk = config_.chunk_size;
  const std::int64_t rank = config_.rank;
  for (const layer_state* state : states) {
    const std::int64_t context_tokens = state->context_chunks * chunk;
    report.low_rank_factors +=
        (context_tokens * rank + rank * width) * static_cast<std::int64_t>(dtype_size(config_.factor_dtype()));
    report.landmarks += dims_.chunk_centroids != 0
                            ? state->context_chunks * config_.num_kv_heads * rules::centroid_bytes(config_.head_dim)
                            : state->context_chunks * width * e;
    report.outliers += state->outlier_chunks * chunk * width * 2 * e;
    report.exact_tokens += (state->local_len + state->generated_exact_len) * width * 2 * e;
    const std::int64_t values = state->context_chunks * config_.num_kv_heads * config_.value_run_bytes();
    report.value_store += values;
    (state->values_on == value_place::device ? report.value_store_device : report.value_store_host) += values;
    report.selection_cache += config_.cache_slots() * chunk * width * 2 * e;
    report.full_attention_equivalent += state->total_len() * width * 2 * e;
  }
  report.device_reserved = static_cast<std::int64_t>(arena_.size() + views_.size() + workspace_memory_.size());
  for (const device_buffer& values : device_values_) report.device_reserved += static_cast<std::int64_t>(values.size());
  for (const host_buffer& values : host_values_) report.host_reserved += static_cast<std::int64_t>(values.size());
  return report;
}

store_stats cuda_backend::selection_stats() const {
  device_guard guard(device_);
  unsigned long long counters[4] = {0, 0, 0, 0};
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(copy_stream_));
  read_back(counters, workspace_.counters, sizeof(counters));
  store_stats stats;
  stats.hits = static_cast<std::int64_t>(counters[0]);
  stats.misses = static_cast<std::int64_t>(counters[1]);
  stats.selections = static_cast<std::int64_t>(counters[2]);
  stats.chunks_rebuilt = stats.misses;
  stats.bytes_fetched = static_cast<std::int64_t>(counters[3]);
  return stats;
}

void cuda_backend::reset_selection_stats() noexcept {
  (void)cudaSetDevice(device_);
  (void)cudaStreamSynchronize(stream_);
  (void)cudaStreamSynchronize(copy_stream_);
  (void)cudaMemsetAsync(workspace_.counters, 0, kWorkspaceCounters * sizeof(unsigned long long), own_stream_);
  (void)cudaStreamSynchronize(own_stream_);
}

void cuda_backend::read_back(void* host, const void* device, std::size_t bytes) const {
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, own_stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
}

// --- non-finite inputs (docs/semantics.md, "Non-finite inputs") ----------------------------------------------------

bool cuda_backend::all_finite(const tensor_view& view) {
  return !find_non_finite(std::span<const tensor_view>(&view, 1)).has_value();
}

std::optional<std::size_t> cuda_backend::find_non_finite(std::span<const tensor_view> views) {
  if (views.empty()) return std::nullopt;
  device_guard guard(device_);
  // The answer is read on the host, and a wait would end a capture: the store checks no decode input while a graph
  // is recorded, and a prefill cannot be captured (it reads its factorisations' infos, and cuSOLVER waits too).
  SHADOWKV_EXPECTS(!capturing(), "inputs cannot be checked for NaN/Inf while the call's stream is being captured "
                   "into a CUDA graph (prefill is not capturable)");
  if (finite_flags_.data() == nullptr) {
    device_buffer flags(kFiniteFlags * sizeof(int), own_stream_, resources_->device_memory());
    host_buffer copy(kFiniteFlags * sizeof(int), resources_->host_memory());
    SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));  // allocated before stream_ uses it
    finite_flags_ = std::move(flags);
    finite_flags_host_ = std::move(copy);
  }
  auto* flags = static_cast<int*>(finite_flags_.data());
  const auto* answers = static_cast<const int*>(finite_flags_host_.data());
  std::array<finite_check_view, kFiniteFlags> batch{};
  for (std::size_t first = 0; first < views.size(); first += kFiniteFlags) {
    const std::size_t count = std::min<std::size_t>(kFiniteFlags, views.size() - first);
    for (std::size_t i = 0; i < count; ++i) {
      const tensor_view& view = views[first + i];
      finite_check_view& target = batch[i];
      target.data = view.data;
      target.type = element_code(view.float_type);
      target.rank = view.rank;
      for (int dim = 0; dim < view.rank; ++dim) {
        target.shape[dim] = view.shape[static_cast<std::size_t>(dim)];
        target.stride[dim] = view.strides[static_cast<std::size_t>(dim)];
      }
    }
    const std::size_t bytes = count * sizeof(int);
    SHADOWKV_CUDA_TRY(cudaMemsetAsync(flags, 0, bytes, stream_));
    launch_find_non_finite(batch.data(), static_cast<int>(count), flags, stream_);
    SHADOWKV_CUDA_TRY(cudaMemcpyAsync(finite_flags_host_.data(), flags, bytes, cudaMemcpyDeviceToHost, stream_));
    // The answer decides whether the call may write anything, so the host waits for it (and for the caller's work
    // queued before it on this stream). A prefill waits for its factorisations anyway (cuSOLVER does, and then the
    // read of their infos); at decode this is the wait that check_finite="auto" leaves out on this backend.
    SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream_));
    for (std::size_t i = 0; i < count; ++i) {
      if (answers[i] != 0) return first + i;
    }
  }
  return std::nullopt;
}

}  // namespace shadowkv::cuda
