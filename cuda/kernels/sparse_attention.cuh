// Exact decode attention over the sparse union of one (sequence, layer) — split-KV, GQA-aware (DESIGN.md §2 step 5).
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

/// q: [B, Hq, D] (strides in q.stride[0..2]); out: [B, Hq, D] written in out.type. T = the store's element type
/// (element_type code `kv_type`). `splits_done`, when not null, is recorded on the stream between the split kernel
/// and the combine: after it, nothing of this launch reads the layer views or their arrays. Never allocates; throws
/// shadowkv::cuda_error on a launch failure.
void launch_sparse_attention(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                             int batch, strided_tensor q, strided_tensor out, float* partial, int max_splits,
                             cudaStream_t stream, cudaEvent_t splits_done = nullptr);

}  // namespace shadowkv::cuda
