// The shapes the CUDA kernels take: one table that the kernels' launchers and the backend's construction-time check
// (backend/kernel_support.hpp) share, so that a store the kernels cannot serve is rejected when it is built, not after
// a call has changed it. Plain constants: it includes nothing of the store.
#pragma once

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

}  // namespace shadowkv::cuda
