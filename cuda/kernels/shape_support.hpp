// The shapes the CUDA kernels take: one table that the kernels' launchers and the backend's construction-time check
// share (so that a store the kernels cannot serve is rejected when it is built, not after a call has changed it).
// Host code only (no device code): the backend includes it from a plain C++ translation unit.
#pragma once

#include <cstdint>

#include "shadowkv/config.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {

/// head_dim values the kernels are instantiated for (chunk_rebuild.cu, sparse_attention.cu dispatch on these).
inline constexpr int kSupportedHeadDims[] = {64, 80, 96, 128, 256};
/// Largest chunk: the key rebuild gathers whole chunks into tiles of this many rows.
inline constexpr int kMaxChunkSize = 64;
/// Largest grid dimension the kernels put KV heads and batch rows on.
inline constexpr int kMaxGridDimension = 65535;

constexpr bool supported_head_dim(int head_dim) {
  for (const int supported : kSupportedHeadDims) {
    if (supported == head_dim) return true;
  }
  return false;
}

/// Throws invalid_argument naming the first field of `cfg` the CUDA kernels cannot serve.
inline void check_kernel_support(const config& cfg) {
  SHADOWKV_EXPECTS(supported_head_dim(cfg.head_dim), "the CUDA backend supports head_dim 64, 80, 96, 128 or 256, got ",
                   cfg.head_dim, " (the CPU backend takes any)");
  SHADOWKV_EXPECTS(cfg.chunk_size <= kMaxChunkSize, "the CUDA backend supports chunk_size up to ", kMaxChunkSize,
                   ", got ", cfg.chunk_size, " (the CPU backend takes any)");
  SHADOWKV_EXPECTS(cfg.num_kv_heads <= kMaxGridDimension, "the CUDA backend supports up to ", kMaxGridDimension,
                   " KV heads, got ", cfg.num_kv_heads);
  SHADOWKV_EXPECTS(cfg.max_batch <= kMaxGridDimension, "the CUDA backend supports max_batch up to ",
                   kMaxGridDimension, ", got ", cfg.max_batch);
}

}  // namespace shadowkv::cuda
