// Prefill kernels of the CUDA backend (docs/semantics.md prefill steps 1–5), one sequence at a time.
// The factorisation itself (Gram/eigensolver or SVD) is cuBLAS/cuSOLVER, called by the backend.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// What the prompt-key kernel learns about one sequence's keys (device memory; launch_prepare_prompt_keys).
struct key_stats {
  int overflowed;         ///< 1: a key is not finite after RoPE (or its removal) or the rounding to the store's type
  unsigned largest_bits;  ///< float bits of the largest |pre-RoPE key| (non-negative floats order as their bits)
  int gram_exponent;      ///< the scaling of launch_scale_keys_for_gram (0: none)
};

/// Reads row `row` of keys [B, S, Hkv, D] (len tokens) into keys_pre (float [len, Hkv*D], un-rotated if
/// `post_rope`) and keys_post (T [len, Hkv*D], rotated if not `post_rope`, rounded to T); positions (int
/// `positions_bits` tensor [B, S], or data == nullptr for 0..len-1) to positions_out [len]. `*stats` (device) is
/// zeroed, then: `overflowed` set to 1 when a key of either copy is not finite (the inputs are finite, the store
/// checks, so that is RoPE's rotation, or the rounding to T, overflowing: the CPU backend rejects such keys, and so
/// does the CUDA backend, reading the flag with the factorisations' infos); `largest_bits` the float bits of the
/// largest |pre-RoPE key|.
void launch_prepare_prompt_keys(const dims& d, int kv_type, strided_tensor keys, strided_tensor positions,
                                int positions_bits, int row, int len, bool post_rope, const float* inv_freq,
                                float* keys_pre, void* keys_post, long long* positions_out, key_stats* stats,
                                cudaStream_t stream);

/// The CPU backend's Gram scaling (factorization.cpp): when stats->largest_bits' binary exponent e is outside
/// [-40, 40], keys[0, count) *= 2^-e in place; stats->gram_exponent = e (0: nothing changed). Then
/// launch_unscale_coefficients multiplies A (computed from the scaled keys) by 2^e.
void launch_scale_keys_for_gram(float* keys, long long count, key_stats* stats, cudaStream_t stream);
void launch_unscale_coefficients(float* coefficients, long long count, const key_stats* stats, cudaStream_t stream);

/// Landmarks (mean of each chunk's stored post-RoPE keys, rounded to T) into landmarks [Hkv, max_chunks, D] and each
/// chunk's minimum cosine to its own keys into min_cosine [Hkv, chunks].
void launch_landmarks(const dims& d, int kv_type, const void* keys_post, int chunks, void* landmarks,
                      float* min_cosine, cudaStream_t stream);

/// chunk_score two_centroids: each (chunk, head)'s two centroids of its stored post-RoPE keys (keys_post [S, Hkv*D],
/// chunks c < `chunks`) into view's centroid_codes, centroid_scales and first_counts (shadowkv/chunk_centroids.hpp,
/// the CPU backend's bits). A warp per (chunk, head).
void launch_chunk_centroids(const dims& d, int kv_type, const void* keys_post, int chunks, const layer_view& view,
                            cudaStream_t stream);

/// Per head the `count` chunks with the smallest minimum cosine (ties: smaller id; -0 and +0 tie): sets is_outlier
/// [Hkv, max_chunks] (all other entries cleared) and writes their ids ascending to outlier_ids [Hkv, max_outliers]
/// (min(count, chunks) of them; the rest of each row is not written). Throws invalid_argument if count > max_outliers.
void launch_pick_outliers(const dims& d, const float* min_cosine, int chunks, int count, std::uint8_t* is_outlier,
                          int* outlier_ids, cudaStream_t stream);

/// Writes the exact data of the prompt into `view`'s arrays: outlier keys/values, the local window (keys, values,
/// positions) and the context positions; packs the context values chunk-major ([chunks, Hkv, C, D] of T) into
/// value_staging (device memory) for the copy to the value store. Values: row `row` of [B, S, Hkv, D], any strides
/// and element type (16-byte loads when they are the store's type with unit stride over D). Reads view.is_outlier,
/// so launch_pick_outliers of the same prompt must come first on the stream.
void launch_scatter_prompt(const dims& d, int kv_type, const void* keys_post, strided_tensor values, int row,
                           int len, int chunks, int outliers, const int* outlier_ids, const long long* positions,
                           layer_view view, void* value_staging, cudaStream_t stream);

/// How the Gram matrix KᵀK of K [rows, n] (row-major float) is computed as split-K: the rows are cut into `slices`
/// slices of `slice_rows` rows, and for each slice one batched cuBLAS SGEMM computes the blocks (i, j), i >= j, of
/// the lower block triangle (block x block each) into that slice's partial Gram matrix (column-major n x n, float);
/// launch_sum_gram_partials adds the partials in float64, plus the last rows - slices * slice_rows rows (fewer than
/// `slices`) as float64 products. Batch entry e = slice * pairs + pair (a slice's blocks run together and share its
/// rows in L2).
struct gram_split {
  int block;       ///< rows and columns of one Gram block (n = blocks * block)
  int blocks;      ///< block rows (and columns) of the Gram matrix
  int pairs;       ///< blocks of the lower block triangle: blocks * (blocks + 1) / 2
  int slices;      ///< row slices, 0 when rows == 0
  int slice_rows;  ///< rows of each slice
  [[nodiscard]] long long entries() const { return static_cast<long long>(slices) * pairs; }
  [[nodiscard]] int tail_rows(int rows) const { return rows - slices * slice_rows; }
};

/// The split for K [rows, n] on a device of `multiprocessors` SMs: enough batch entries for several waves, slices of
/// at least a few hundred rows. Host function.
gram_split plan_gram_split(int n, int rows, int multiprocessors);

/// Bytes of the partial Gram matrices of `split` (float [slices, n, n]).
std::size_t gram_partial_bytes(const gram_split& split, int n);

/// The pointer arrays of the batched SGEMM of `split` (entries() pointers each): a[e], b[e] = the block rows i and j
/// of the slice's Kᵀ (column-major [n, slice_rows], lda n), c[e] = block (i, j) of the slice's partial (ldc n).
void launch_gram_block_pointers(const float* keys, int n, const gram_split& split, float* partials, const float** a,
                                const float** b, float** c, cudaStream_t stream);

/// gram = the float64 sum of the partials of `split`, plus the tail rows of keys [rows, n] (float64 products), both
/// triangles written (symmetric by construction).
void launch_sum_gram_partials(const float* partials, const float* keys, int rows, int n, const gram_split& split,
                              double* gram, cudaStream_t stream);

/// basis[i, :] = column (reversed ? rank-1-i : i) of the column-major n x n float64 matrix `vectors`, or its row
/// when `rows` (e.g. the rows of Vᵀ from an SVD).
void launch_basis_from_vectors(const double* vectors, int n, int rank, bool reversed, bool rows, float* basis,
                               cudaStream_t stream);

/// Row-major (transposed=false) or column-major (transposed=true) float64 copy of float keys [rows, cols].
void launch_keys_to_double(const float* keys, int rows, int cols, bool column_major, double* out,
                           cudaStream_t stream);

/// Sets the counters of the device layer view after a prefill; last_position = positions[len-1].
void launch_set_prefill_counters(layer_view* view, int prompt_len, int context_chunks, int outlier_chunks,
                                 int local_len, const long long* positions, int len, cudaStream_t stream);

}  // namespace shadowkv::cuda
