// Pipeline planning of the CUDA backend: the decode batch's parts, the value fetch's CTAs and priority, and which
// steps release the attention early or fuse the misses' attention into the key rebuild. Each choice is made from the
// batch, the shapes and the device; the measurements that decided them are cited at each (docs/performance.md).
#include "pipeline_plan.hpp"

#include <algorithm>

#include "backend_support.hpp"
#include "cuda_backend.hpp"
#include "environment.hpp"
#include "sparse_attention.cuh"

namespace shadowkv::cuda {

// A quarter of the multiprocessors, 8 warps each with 2 KiB of loads in flight a warp: ~0.5 MiB in flight, ~4x what
// 55 GB/s at ~2 us of latency needs, on a quarter of the SMs (the rest run the key rebuild and later parts' selection
// beside it). A zero-copy PCIe read keeps its warp resident: a grid on every multiprocessor slowed the key rebuild
// beside it 2.6x (docs/performance.md).
int fetch_ctas_for_host_values(int multiprocessors) {
  return fetch_ctas_from_environment().value_or(std::max(8, multiprocessors / 4));
}

// A gather from HBM needs more in flight than one across PCIe.
int fetch_ctas_for_device_values(int multiprocessors) { return 2 * multiprocessors; }

// The fetch is the step's critical path at large batch, and a kernel launched beside others waits for SM room: with
// equal priorities the block scheduler places every pending CTA of the kernels launched before it first (a key rebuild
// of three waves, a later part's logits), so a part's fetch could start hundreds of µs after its selection. With the
// greatest priority its 33 CTAs take the first room that frees. Kernel nodes keep the priority in a CUDA graph
// instantiated with cudaGraphInstantiateFlagUseNodePriority (PyTorch's CUDAGraph does so). Measured against the
// stream's own priority in docs/performance.md; session 13.
int fetch_priority_for_host_values() {
  int least = 0;
  int greatest = 0;
  SHADOWKV_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return greatest;
}

// Tapered: the first and last parts half the size of the others (e.g. 6/12/6 of 24): the first part's selection is
// all the fetch waits for, and the last part's attention is all that runs after it. Measured on the H200 with the
// fetch at the greatest priority (docs/performance.md; session 13; B = 24 and 48 at hit 0.04, then B = 24 and 48 at hit
// 0.61, graph replay): tapered 2.158 / 2.171 / 0.950 / 0.957 ms against even 2.175 / 2.167 / 0.971 / 0.966, and eager
// 2.094 / 2.114 / 0.979 / 0.972 against 2.270 / 2.148 / 1.019 / 1.004.
int part_start(int p, int count, int batch) {
  if (count >= 3) {
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

std::vector<cuda_backend::batch_part> cuda_backend::pipeline_parts(std::span<const batch_entry> entries) const {
  const int batch = static_cast<int>(entries.size());
  // The backend's choice: kDefaultPipelineParts parts from kPipelineFromBatch sequences when values cross PCIe, else
  // one, split tapered (part_start). Measured on the H200 (docs/performance.md, 1dbd902: attention part by part; B=24,
  // S=122880, hit 0.61, eager / graph replay): 1 part 1.371 / 1.235 ms, 2 parts 1.104 / 0.989, 3 parts 1.087 / 0.989,
  // 4 parts 1.117 / 1.025, 6 parts 1.271 / 1.077 (each part adds ~65 µs of latency-bound score and select kernels to
  // the compute stream); device values have no PCIe transfer to hide. fp8 values (half the bytes) are bound by the
  // compute stream, where each part costs its own logits and select launches: two parts (docs/performance.md; session 14;
  // B = 24, hit 0.61, graph: 0.760 / 0.753 ms in two runs against 0.788 / 0.793 with three; at hit 0.04 three stay
  // ahead, 1.274 / 1.289 against 1.325 / 1.311).
  int count = config_.decode_pipeline_parts;
  if (count <= 0) {
    const int parts = dims_.value_fp8 != 0 ? kDefaultPipelinePartsFp8 : kDefaultPipelineParts;
    count = batch >= kPipelineFromBatch && any_host_values(entries) ? parts : 1;
  }
  count = std::clamp(count, 1, std::max(1, batch));
  std::vector<batch_part> parts(static_cast<std::size_t>(count));
  for (int p = 0; p < count; ++p) {
    parts[static_cast<std::size_t>(p)].first = part_start(p, count, batch);
    parts[static_cast<std::size_t>(p)].count = part_start(p + 1, count, batch) - part_start(p, count, batch);
  }
  return parts;
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
  d.attention_early = batch <= kEarlyAttentionMaxBatch ? 1 : 0;
  return d;
}

bool cuda_backend::fuse_step(std::span<const batch_entry> entries) const {
  if (prefilling_ || extending_ || parts_.size() != 1 || any_host_values(entries)) return false;
  if (static_cast<int>(entries.size()) > kFusedMissesMaxBatch) return false;
  dims d = dims_;
  d.fused_misses = 1;
  return sparse_attention_fuses(d, kv_type_, workspace_.max_splits);
}

}  // namespace shadowkv::cuda
