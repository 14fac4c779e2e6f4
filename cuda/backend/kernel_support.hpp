// The store configurations the CUDA kernels can serve, checked when a CUDA store is built (cuda_backend's
// constructor), from the kernels' own table of shapes (kernels/shape_support.hpp).
#pragma once

#include "shadowkv/config.hpp"
#include "shadowkv/errors.hpp"
#include "shape_support.hpp"

namespace shadowkv::cuda {

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
