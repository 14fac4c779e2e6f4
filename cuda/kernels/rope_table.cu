#include "rope_table.cuh"

#include <algorithm>

#include "common/element_access.cuh"
#include "cuda_check.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) build_rope_table_kernel(const float* inv_freq, int half, float scaling,
                                                                    long long entries, float2* table) {
  for (long long e = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; e < entries;
       e += static_cast<long long>(gridDim.x) * kThreads) {
    const long long position = e / half;
    const int pair = static_cast<int>(e - position * half);
    double cos_a;
    double sin_a;
    rope_coefficients(inv_freq[pair], position, scaling, false, cos_a, sin_a);
    // Not inverse: both are floats widened to double (rope_coefficients), so these casts are exact.
    table[e] = make_float2(static_cast<float>(cos_a), static_cast<float>(sin_a));
  }
}

}  // namespace

std::size_t rope_table_bytes(const dims& d, long long positions) {
  return positions > 0 && d.rotary_dim >= 2
             ? static_cast<std::size_t>(positions) * static_cast<std::size_t>(d.rotary_dim / 2) * sizeof(float2)
             : 0;
}

void launch_build_rope_table(const dims& d, const float* inv_freq, float2* table, long long positions,
                             cudaStream_t stream) {
  SHADOWKV_EXPECTS(positions >= 0, "RoPE table: positions must be >= 0, got ", positions);
  const int half = d.rotary_dim / 2;
  const long long entries = positions * half;
  if (entries <= 0) return;
  SHADOWKV_EXPECTS(inv_freq != nullptr && table != nullptr, "RoPE table: null inv_freq or table");
  const long long blocks = std::min<long long>((entries + kThreads - 1) / kThreads, 132LL * 16);
  build_rope_table_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(inv_freq, half, d.attention_scaling,
                                                                                 entries, table);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
