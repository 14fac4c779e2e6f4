// Decode step 4 (misses only): rebuild the keys of missed chunks (gather-GEMM A[rows]·B[:, head] + RoPE) on the
// compute stream, from the miss lists that launch_select_chunks wrote into the step workspace. Their values are
// fetched beside it on the copy stream (value_fetch.cuh).
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

}  // namespace shadowkv::cuda
