// The attention of an extend block (docs/semantics.md, "Extend", step 4) on the CUDA backend: the s query tokens of
// each entry attend over outliers ∪ local window ∪ the exact generated ring ∪ the selected chunks (from the selection
// cache) ∪ the block's own tokens, causally among those. The block's tokens are read from the caller's tensors (the
// backend appends them to the ring after the attention), so the ring never holds more than its window.
//
// Three kernels around two batched GEMMs of cuBLAS (the backend runs those):
//   gather:  the union of each (entry, KV head) into rows of K and V [B, Hkv, U, D] (the store's type; rows past the
//            entry's union are zero), the queries into Q [B, Hkv, s*G, D] (row t*G + g: token t, query head h*G + g),
//            and the union's length per (entry, head);
//   S = Q·Kᵀ (float32), then softmax: P = softmax(scale * S) per row, token t seeing the union but the block's
//            tokens after t; P in the store's type (as flash attention rounds it), zero where masked;
//   O = P·V (float32), then scatter: O to out [B, s, Hq, D] in out's type.
// Never allocates: the buffers are the backend's extend workspace (block_attention_bytes).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// The extend workspace's arrays for blocks of up to `block` tokens of up to `batch` entries.
struct block_attention_buffers {
  void* keys = nullptr;       ///< T [batch, Hkv, union_rows, D]
  void* values = nullptr;     ///< T [batch, Hkv, union_rows, D]
  void* queries = nullptr;    ///< T [batch, Hkv, block * G, D]
  float* scores = nullptr;    ///< float [batch, Hkv, block * G, union_rows]
  void* probabilities = nullptr;  ///< T [batch, Hkv, block * G, union_rows]
  float* outputs = nullptr;   ///< float [batch, Hkv, block * G, D]
  int* union_lengths = nullptr;  ///< int [batch, Hkv]
  int union_rows = 0;         ///< rows reserved per (entry, head): block_union_rows
  int block = 0;              ///< tokens reserved per entry
};

/// Rows of an (entry, head)'s union with blocks of `block` tokens, rounded up to 8: outliers + local window + ring +
/// selected chunks + the block.
int block_union_rows(const dims& d, int block);

/// Bytes of block_attention_buffers for `batch` entries and blocks of `block` tokens, each array aligned to 256.
std::size_t block_attention_bytes(const dims& d, int kv_type, int batch, int block);

/// Lays the buffers out in `memory` (block_attention_bytes of it).
block_attention_buffers block_attention_layout(const dims& d, int kv_type, int batch, int block, void* memory);

/// Gathers the union and the queries of `batch` entries for a block of `tokens` tokens. `selected` is the step
/// workspace's selected chunk ids [batch, Hkv, k] (ascending, -1 padding) of this block's selection. keys, values:
/// the block's [B, s, Hkv, D]; positions [B, s] (data null: each entry's last position + 1, + 2, ...); keys_post_rope
/// false: the block's keys get RoPE here.
void launch_gather_block_union(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                               int batch, int tokens, const int* selected, strided_tensor queries, strided_tensor keys,
                               strided_tensor values, strided_tensor positions, int positions_bits,
                               bool keys_post_rope, const float* inv_freq, const block_attention_buffers& buffers,
                               cudaStream_t stream);

/// P = softmax(softmax_scale * S) with the causal mask of the block, in the store's type.
void launch_block_softmax(const dims& d, int kv_type, int batch, int tokens, const block_attention_buffers& buffers,
                          cudaStream_t stream);

/// out [B, s, Hq, D] (any float type, strided) from the float32 outputs.
void launch_scatter_block_outputs(const dims& d, int batch, int tokens, const block_attention_buffers& buffers,
                                  strided_tensor out, cudaStream_t stream);

}  // namespace shadowkv::cuda
