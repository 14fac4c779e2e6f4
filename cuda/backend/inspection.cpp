// Reads of the CUDA backend's device state between calls (the selection cache, outliers, positions, statistics),
// each through the backend's own stream (read_back), and the check of a call's inputs for NaN/Inf.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "backend_support.hpp"
#include "cuda_backend.hpp"
#include "finite_check.cuh"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {

using backend_support::device_guard;
using backend_support::element_code;
using backend_support::kWorkspaceCounters;

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
