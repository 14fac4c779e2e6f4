// RoPE coefficients by position, computed once per backend: the key rebuild reads a missed row's (cos, sin) pairs
// from it instead of evaluating a float64 sincos per (row, pair) — that evaluation was ~40% of the rebuild kernel at
// B=8 (bench/NOTES.md, "Rebuild epilogue"). The entries are exactly rope_coefficients' (float32-rounded cos and sin
// times attention_scaling), so a key rotated with them equals one rotated with the formula bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// [positions, rotary_dim / 2] (cos, sin) of positions 0 .. positions - 1; a position outside it (a caller's own
/// positions past max_seq_len, or negative) is rotated by the formula. positions == 0: no table.
struct rope_table {
  const float2* coefficients = nullptr;
  long long positions = 0;
};

/// Largest table the backend builds (bytes); longer max_seq_len leaves the later positions to the formula.
inline constexpr std::size_t kMaxRopeTableBytes = std::size_t{256} << 20;

/// Positions a table for `max_positions` positions covers: all of them within kMaxRopeTableBytes (0 without RoPE).
long long rope_table_positions(const dims& d, long long max_positions);

/// Fills table[p * (rotary_dim / 2) + i] for p < positions with the non-inverse coefficients of (inv_freq[i], p,
/// attention_scaling) (element_access.cuh, rope_coefficients). Enqueues one kernel on `stream`; allocates nothing.
void launch_fill_rope_table(const dims& d, const float* inv_freq, float2* table, long long positions,
                            cudaStream_t stream);

}  // namespace shadowkv::cuda
