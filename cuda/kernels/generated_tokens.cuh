// Decode step 0–1 on the device: fold the oldest generated chunk when the ring is full, then append the new token
// (docs/semantics.md "Decode" 0–2). One CTA per entry; the counters in the layer view advance on the device.
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Dynamic shared memory the launcher needs (the folded chunk's pre-RoPE keys).
std::size_t advance_generated_shared_bytes(const dims& d);

/// Step 1 alone: folds the oldest generated chunk of each entry whose ring is full (rules::fold_due), if its arena has
/// room; entries with nothing to fold return at once.
void launch_fold_generated(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                           const float* inv_freq, cudaStream_t stream);

/// Step 2 alone: appends the new token of each entry whose ring is not full (one left full had no room to fold: the
/// entry stays as it is). k_new, v_new: [B, Hkv, D]; positions: int tensor [B] of `positions_bits` bits, or
/// data == nullptr for each sequence's last position + 1. keys_post_rope=false applies RoPE to k_new first.
void launch_append_generated(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer,
                             int batch, strided_tensor k_new, strided_tensor v_new, strided_tensor positions,
                             int positions_bits, bool keys_post_rope, const float* inv_freq, cudaStream_t stream);

/// An extend block's appends (docs/semantics.md, "Extend"): for each of `tokens` tokens of keys, values [B, s, Hkv, D]
/// and positions [B, s] (data == nullptr: last position + 1), step 1 then step 2; then step 1 once more (a decode
/// step that fills the ring ends with its fold). One launch, a CTA per entry.
void launch_append_block(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         int tokens, strided_tensor keys, strided_tensor values, strided_tensor positions,
                         int positions_bits, bool keys_post_rope, const float* inv_freq, cudaStream_t stream);

/// Truncate of one (slot, layer) whose device view is `view`: undo its folds past `kept_chunks` context chunks (their
/// exact rows back from the fold journal, which holds them: dims::journal_chunks is one more than the host's limit,
/// for a ring the device folded early), keep `exact` exact generated tokens, free the undone chunks' cache slots and set
/// the last position (docs/semantics.md, "Truncate").
void launch_truncate_generated(const dims& d, int kv_type, layer_view* view, int kept_chunks, int exact,
                               cudaStream_t stream);

/// Steps 1 and 2 in stream order: launch_fold_generated, then launch_append_generated (same arguments).
void launch_advance_generated(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer,
                              int batch, strided_tensor k_new, strided_tensor v_new, strided_tensor positions,
                              int positions_bits, bool keys_post_rope, const float* inv_freq, cudaStream_t stream);

}  // namespace shadowkv::cuda
