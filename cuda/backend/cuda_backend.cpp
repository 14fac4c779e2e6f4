// The CUDA backend's construction (its dims from the config, streams and events, then arenas.cpp's reservations) and
// the streams of each call.
#include "cuda_backend.hpp"

#include "backend_support.hpp"
#include "cuda_check.hpp"
#include "cuda_runtime_info.hpp"
#include "kernel_support.hpp"
#include "pipeline_plan.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {

using backend_support::device_guard;
using backend_support::element_code;

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
  dims_.journal_chunks = static_cast<int>(cfg.journal_chunks()) + 1;
  dims_.local_capacity = (cfg.local_chunks + 1) * cfg.chunk_size - 1;
  dims_.max_chunks = static_cast<int>(cfg.max_seq_len / cfg.chunk_size);
  dims_.rotary_dim = cfg.effective_rotary_dim();
  dims_.rope_interleaved = cfg.rope == rope_style::interleaved ? 1 : 0;
  dims_.attention_scaling = cfg.attention_scaling;
  dims_.softmax_scale = cfg.effective_softmax_scale();
  dims_.value_fp8 = cfg.values_as == value_format::fp8_e4m3 ? 1 : 0;
  dims_.factor_bf16 = cfg.factor_dtype() == dtype::bfloat16 ? 1 : 0;
  dims_.group_mean = cfg.group_score == group_combine::mean ? 1 : 0;
  // attention_early and fused_misses are chosen per step (step_dims, fuse_step).

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

  reserve_memory();
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
  prompt_values_.clear();
  values_.clear();
  (void)cudaStreamSynchronize(own_stream_);
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

void cuda_backend::read_back(void* host, const void* device, std::size_t bytes) const {
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, own_stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
}

}  // namespace shadowkv::cuda
