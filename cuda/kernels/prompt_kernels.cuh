// Prefill kernels of the CUDA backend (DESIGN.md §2 prefill steps 1–5), one sequence at a time.
// The factorisation itself (Gram/eigensolver or SVD) is cuBLAS/cuSOLVER, called by the backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Reads row `row` of keys [B, S, Hkv, D] (len tokens) into keys_pre (float [len, Hkv*D], un-rotated if
/// `post_rope`) and keys_post (T [len, Hkv*D], rotated if not `post_rope`, rounded to T); positions (int
/// `positions_bits` tensor [B, S], or data == nullptr for 0..len-1) to positions_out [len].
void launch_prepare_prompt_keys(const dims& d, int kv_type, strided_tensor keys, strided_tensor positions,
                                int positions_bits, int row, int len, bool post_rope, const float* inv_freq,
                                float* keys_pre, void* keys_post, long long* positions_out, cudaStream_t stream);

/// Landmarks (mean of each chunk's stored post-RoPE keys, rounded to T) into landmarks [Hkv, max_chunks, D] and each
/// chunk's minimum cosine to its own keys into min_cosine [Hkv, chunks].
void launch_landmarks(const dims& d, int kv_type, const void* keys_post, int chunks, void* landmarks,
                      float* min_cosine, cudaStream_t stream);

/// Per head the `count` chunks with the smallest minimum cosine (ties: smaller id): sets is_outlier
/// [Hkv, max_chunks] (all other entries cleared) and writes their ids ascending to outlier_ids [Hkv, max_outliers].
void launch_pick_outliers(const dims& d, const float* min_cosine, int chunks, int count, std::uint8_t* is_outlier,
                          int* outlier_ids, cudaStream_t stream);

/// Writes the exact data of the prompt into `view`'s arrays: outlier keys/values, the local window (keys, values,
/// positions) and the context positions; packs the context values chunk-major ([chunks, Hkv, C, D] of T) into
/// value_staging (device memory) for the copy to the value store. Values: row `row` of [B, S, Hkv, D].
void launch_scatter_prompt(const dims& d, int kv_type, const void* keys_post, strided_tensor values, int row,
                           int len, int chunks, int outliers, const int* outlier_ids, const long long* positions,
                           layer_view view, void* value_staging, cudaStream_t stream);

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
