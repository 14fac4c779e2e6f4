// Landmark (or two-centroid) logits of one decode step (one query token), streamed through shared memory by one
// wave of CTAs.
//
// The same outputs as kernel 1 of chunk_selection.cu in its decode mode (kLogits with tile partials), which stages
// whole tiles per CTA in shared memory and measured ~3x the landmark bytes' time at HBM speed on an H200 (B=8: 176 µs
// for 60 µs of bytes). Here one wave of CTAs splits the batch's live tiles evenly; each lane streams its own slices
// of landmark rows into a private cp.async ring two batches ahead (the bytes in flight cost no registers), reads q
// from shared memory as broadcasts, and sums a row over its 4-16 lanes with a reduce-scatter of shuffles; one block
// barrier per tile hands the tile's logits to the epilogue (coalesced writes and the tile's softmax partial) while
// the next copies are in flight.
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Writes softmax_scale * q_j·L[c] (-inf for outliers) to logits [B, Hq, max_chunks] for chunks c < context_chunks,
/// and each tile's softmax partial (max, sum exp) per query head j of KV head h to partials row (b, h) of
/// [G][tiles][2] floats (step_workspace::selection_partials; tiles of `tile_rows` chunks). With two-centroid scores
/// (dims::chunk_centroids) the logit is the two-centroid one (shadowkv/chunk_centroids.hpp), read from rows of 2·D
/// e4m3 codes. Returns false, launching nothing, for shapes it does not cover: a row (landmark, or codes) of other
/// than 128, 256 or 512 bytes, or more than 8 query heads per KV head. The grid (one wave: the CTAs that fit on
/// `multiprocessors`, less `beside_ctas` that another kernel may hold meanwhile) depends on dims, batch and the
/// device only. With `beside_ctas` > 0 and `claims` (step_workspace::logits_claims, two
/// counters that are zero and are left zero) the CTAs take half of the tiles in fixed shares and claim the rest.
bool launch_decode_landmark_logits(const dims& d, int kv_type, const layer_view* views, const int* batch_slots,
                                   int layer, int batch, const strided_tensor& queries, int tile_rows, int tiles,
                                   int multiprocessors, int beside_ctas, float* logits, float* partials,
                                   unsigned* claims, cudaStream_t stream);

}  // namespace shadowkv::cuda
