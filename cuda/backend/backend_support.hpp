// Small helpers the CUDA backend's translation units share (cuda_backend.cpp, arenas.cpp, prefill.cpp,
// decode_step.cpp, pipeline_plan.cpp, inspection.cpp): host code only, nothing a kernel includes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda_check.hpp"
#include "device_layout.cuh"
#include "shadowkv/config.hpp"
#include "shadowkv/tensor_view.hpp"

namespace shadowkv::cuda::backend_support {

/// Every array the backend carves out of one allocation starts at a multiple of this.
inline constexpr std::size_t kAlignment = 256;
/// step_workspace::counters: hits, misses, selections and bytes fetched (selection_stats), then the selections that
/// took the select cluster's hint path (step_workspace::hinted_selections).
inline constexpr std::size_t kWorkspaceCounters = 5;

inline std::size_t align_up(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

inline int element_code(dtype type) {
  switch (type) {
    case dtype::float16: return element_f16;
    case dtype::bfloat16: return element_bf16;
    case dtype::float32: break;
  }
  return element_f32;
}

inline strided_tensor as_strided(const tensor_view& view) {
  strided_tensor result{view.data, element_code(view.float_type), {0, 0, 0, 0}};
  for (int dim = 0; dim < view.rank; ++dim) result.stride[dim] = view.strides[static_cast<std::size_t>(dim)];
  return result;
}

inline int index_bits(const tensor_view& view) { return view.int_type == index_type::int32 ? 32 : 64; }

/// Whether factorize takes the Gram/eigensolver path for a prompt of `rows` tokens (else the exact SVD).
inline bool factorizes_by_gram(const config& cfg, std::int64_t rows) {
  return cfg.factorization == factorization_method::gram || rows < cfg.kv_width();
}

/// Sets the current device for the scope of a call and restores the caller's.
class device_guard {
 public:
  explicit device_guard(int device) {
    SHADOWKV_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != device) SHADOWKV_CUDA_TRY(cudaSetDevice(device));
  }
  ~device_guard() { (void)cudaSetDevice(previous_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace shadowkv::cuda::backend_support
