// Exact decode attention over the sparse union of one (sequence, layer) — split-KV, GQA-aware (docs/semantics.md step 5).
//
// For entry b (slot = batch_slots[b]) and KV head h the tokens are, each once:
//   outlier rows [0, outlier_chunks*C) of outlier_keys/values[h],
//   exact rows [0, local_len) of exact_keys/values[h] (the local window),
//   ring rows generated_row(view, d, i), i < generated_exact_len (generated tokens, the newest included),
//   rows [s*C, (s+1)*C) of cache_keys/values[h] ([K*C, D] per head, K = dims::cache_slots) for every buffer slot
//   s with cache_chunks[h*k + s] >= 0 when K == k, or every slot s = selected_slots[h*k + e] >= 0 (the selected
//   ones) when K > k.
// Query head j (j / G == h) gets softmax(softmax_scale * q_j·Kᵀ) V. Accumulation in float32.
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Splits (partials per query head) the launcher uses for `batch` sequences; workspace.partial must hold
/// batch * Hq * max_splits * (D + 2) floats.
int sparse_attention_max_splits(const dims& d);

/// Whether a step with these dims and element type can be fused (dims::fused_misses): the tensor-core kernel serves
/// it, the values are not fp8, the group is at most kMissAttentionMaxGroup, k and K fit the kernel's shared slot
/// list, and max_splits leaves room for the key rebuild's partials (rebuild_max_groups) after one split at least.
bool sparse_attention_fuses(const dims& d, int kv_type, int max_splits);

/// Partials per query head a workspace needs so that steps with these dims can be fused where sparse_attention_fuses
/// allows it: sparse_attention_max_splits plus the key rebuild's groups (rebuild_max_groups), or the former alone
/// where no step can be fused.
int sparse_attention_partials(const dims& d, int kv_type);

/// Split CTAs per (entry, KV head) that launch_sparse_attention takes for these arguments: the first partial index
/// of the key rebuild's groups in a fused step (miss_attention::first_split).
int sparse_attention_splits(const dims& d, int kv_type, int batch, int max_splits);

/// q: [B, Hq, D] (strides in q.stride[0..2]); out: [B, Hq, D] written in out.type. T = the store's element type
/// (element_type code `kv_type`). `splits_done`, when not null, is recorded on the stream between the split kernel
/// and the combine: after it, nothing of this launch reads the layer views or their arrays. Never allocates; throws
/// shadowkv::cuda_error on a launch failure.
/// With dims::fused_misses: a fused step (sparse_attention_fuses must hold). The split kernel then walks only the
/// rows of the slots not in the miss lists `miss_slots` / `miss_counts` (the launch's part of step_workspace's), and
/// waits for the key rebuild (the kernel before it, which attended over the missed rows: miss_attention) only at its
/// end; the combine merges the rebuild's partials after the splits'.
void launch_sparse_attention(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                             int batch, strided_tensor q, strided_tensor out, float* partial, int max_splits,
                             cudaStream_t stream, cudaEvent_t splits_done = nullptr, const int* miss_slots = nullptr,
                             const int* miss_counts = nullptr);

}  // namespace shadowkv::cuda
