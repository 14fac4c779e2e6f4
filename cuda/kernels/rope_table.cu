#include "rope_table.cuh"

#include <algorithm>

#include "common/element_access.cuh"
#include "cuda_check.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {
namespace {

__global__ void fill_rope_table_kernel(dims d, const float* inv_freq, float2* table, long long positions) {
  const int half = d.rotary_dim / 2;
  const long long entries = positions * half;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < entries;
       e += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long position = e / half;
    const int pair = static_cast<int>(e - position * half);
    double cos_a;
    double sin_a;
    rope_coefficients(inv_freq[pair], position, d.attention_scaling, false, cos_a, sin_a);
    // Non-inverse coefficients are float32 values held in doubles: the float conversion is exact.
    table[e] = make_float2(static_cast<float>(cos_a), static_cast<float>(sin_a));
  }
}

}  // namespace

long long rope_table_positions(const dims& d, long long max_positions) {
  const long long half = d.rotary_dim / 2;
  if (half <= 0 || max_positions <= 0) return 0;
  const long long most = static_cast<long long>(kMaxRopeTableBytes / (sizeof(float2) * static_cast<std::size_t>(half)));
  return std::min(max_positions, most);
}

void launch_fill_rope_table(const dims& d, const float* inv_freq, float2* table, long long positions,
                            cudaStream_t stream) {
  SHADOWKV_EXPECTS(positions >= 0 && d.rotary_dim >= 0 && d.rotary_dim % 2 == 0,
                   "RoPE table: need positions >= 0 and an even rotary_dim >= 0, got ", positions, " and ",
                   d.rotary_dim);
  const long long entries = positions * (d.rotary_dim / 2);
  if (entries == 0) return;
  constexpr int kThreads = 256;
  const long long blocks = std::min<long long>((entries + kThreads - 1) / kThreads, 65535LL * 8);
  fill_rope_table_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(d, inv_freq, table, positions);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
