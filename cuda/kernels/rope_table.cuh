// RoPE coefficients by position, computed once per store: what the key rebuild reads instead of evaluating a float64
// sincos for every (row, pair) of every rebuilt chunk (chunk_rebuild.cu; docs/performance.md; session 13).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Bytes of a table of `positions` positions for these dims: positions * (rotary_dim / 2) float2.
[[nodiscard]] std::size_t rope_table_bytes(const dims& d, long long positions);

/// Fills table[p * (rotary_dim / 2) + i], p < positions, with the coefficients rope_coefficients gives for
/// (inv_freq[i], p, d.attention_scaling, not inverse) (common/element_access.cuh), as the floats they are: so a
/// rotation by a table entry is bit-identical to rope_pair's. inv_freq: rotary_dim / 2 floats on the device.
void launch_build_rope_table(const dims& d, const float* inv_freq, float2* table, long long positions,
                             cudaStream_t stream);

}  // namespace shadowkv::cuda
