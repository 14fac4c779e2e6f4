// Decode steps 4 (misses only): rebuild the keys of missed chunks (gather-GEMM A[rows]·B[:, head] + RoPE) on the
// compute stream, and fetch their values from the pinned value store on the copy stream. Both read the miss lists
// that launch_select_chunks wrote into the step workspace.
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Miss lists: workspace.miss_slots holds k = dims::budget entries per (entry, head), slots in [0, K), K =
/// dims::cache_slots the slots per head of cache_chunks, cache_keys and cache_values ([Hkv, K, C, D]).
///
/// Keys of every missed (entry, head, chunk) into its buffer slot of cache_keys, rounded to T: a tensor-core
/// gather-GEMM A[rows of the chunk] · B[:, head] (3xTF32, fp32-accurate), then RoPE at each token's position.
/// The miss lists are read on the device (the grid depends only on batch and dims: graph-capturable); runs on
/// `stream`, allocates nothing. Throws shadowkv::invalid_argument for head_dim not in {64, 80, 96, 128, 256} or
/// chunk_size above 64.
void launch_rebuild_keys(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, const float* inv_freq, cudaStream_t stream);

/// Values of every missed (entry, head, chunk): one contiguous run of C*D elements from the value store (mapped host
/// memory, read by the kernel over PCIe, or device memory) into its buffer slot of cache_values; adds the bytes to
/// counters[3]. A persistent grid of at most `ctas` CTAs (8 warps each) covers every item, whatever the batch: few
/// CTAs leave the multiprocessors to the kernels that run beside the fetch (the key rebuild, a later part's
/// selection); the caller sizes it (cuda_backend: enough bytes in flight for PCIe, more for device values).
/// `priority` is a launch priority (cudaLaunchAttributePriority, as cudaDeviceGetStreamPriorityRange counts: lower is
/// sooner), or 0 for the stream's own.
void launch_fetch_values(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, int ctas, int priority, cudaStream_t stream);

}  // namespace shadowkv::cuda
