// Decode step 4 (misses only): rebuild the keys of missed chunks (gather-GEMM A[rows]·B[:, head] + RoPE) on the
// compute stream, from the miss lists that launch_select_chunks wrote into the step workspace. Their values are
// fetched beside it on the copy stream (value_fetch.cuh).
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// The key rebuild's share of a decode step's attention (dims::fused_misses): after a CTA has stored the keys of a
/// group of missed chunks (rebuild_group_rows rows), it attends over those rows, with the values read from the value
/// store where they are (device memory), for the KV head's G query heads, and writes each head's split partial
/// (max in log2 units, sum, unnormalised accumulator: sparse_attention.cu's format) as split first_split + g of
/// `partial`, g = the group's index in the head's miss list (its first entry / chunks per group). The attention's
/// combine merges ceil(misses / chunks per group) such partials after the attention's own first_split.
struct miss_attention {
  strided_tensor q;  ///< [B, Hq, D]: q.stride[0] the entry, [1] the query head, [2] the dim
  float* partial;    ///< step_workspace::partial
  int first_split;   ///< the attention's split count (partials 0 .. first_split - 1 are its own)
  int max_splits;    ///< the partials' stride per query head (step_workspace::max_splits)
};

/// Chunks a rebuild group holds (floor(64 / C): 64 rows at most) and the most groups a (sequence, KV head) can miss
/// in one step (ceil(k / chunks per group)): the partials a fused step adds per query head.
int rebuild_group_chunks(const dims& d);
int rebuild_max_groups(const dims& d);

/// Largest GQA group (query heads per KV head) the rebuild's attention serves.
constexpr int kMissAttentionMaxGroup = 16;

/// Miss lists: workspace.miss_slots holds k = dims::budget entries per (entry, head), slots in [0, K), K =
/// dims::cache_slots the slots per head of cache_chunks, cache_keys and cache_values ([Hkv, K, C, D]).
///
/// Keys of every missed (entry, head, chunk) into its buffer slot of cache_keys, rounded to T: a tensor-core
/// gather-GEMM A[rows of the chunk] · B[:, head] (3xTF32, fp32-accurate), then RoPE at each token's position.
/// The miss lists are read on the device (the grid depends only on batch and dims: graph-capturable); runs on
/// `stream`, allocates nothing. Throws shadowkv::invalid_argument for head_dim not in {64, 80, 96, 128, 256} or
/// chunk_size above 64. With `attend` (dims::fused_misses set): also the attention over the rebuilt rows
/// (miss_attention; bf16 keys, values in device memory and not fp8, head_dim <= 128, G <= kMissAttentionMaxGroup,
/// else shadowkv::invalid_argument), and the value fetch's work for those rows (launch_fetch_values, which a fused
/// step does not launch): their values into their slots of cache_values, their
/// bytes added to counters[3].
void launch_rebuild_keys(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, const float* inv_freq, cudaStream_t stream,
                         const miss_attention* attend = nullptr);

}  // namespace shadowkv::cuda
