#include <cuda_bf16.h>

#include <algorithm>

#include "cuda_check.hpp"
#include "factor_format.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) factors_to_bf16_kernel(float* source, long long count,
                                                                   __nv_bfloat16* target, bool round_source) {
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < count; i += stride) {
    const __nv_bfloat16 rounded = __float2bfloat16_rn(source[i]);
    target[i] = rounded;
    if (round_source) source[i] = __bfloat162float(rounded);
  }
}

}  // namespace

void launch_factors_to_bf16(float* source, long long count, void* target, bool round_source, cudaStream_t stream) {
  if (count <= 0) return;
  const long long blocks = std::min<long long>((count + kThreads - 1) / kThreads, 4096);
  factors_to_bf16_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      source, count, static_cast<__nv_bfloat16*>(target), round_source);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
