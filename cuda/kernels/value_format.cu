#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "cuda_check.hpp"
#include "shadowkv/fp8.hpp"
#include "value_format.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;

// One warp per run: the run's largest magnitude (a max, so the order of the reduction does not matter), then each
// lane encodes its strided elements against the shared scale.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_value_runs_kernel(const T* values, long long runs, int run,
                                                                       std::uint8_t* codes, float* scales) {
  const long long r = static_cast<long long>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= runs) return;
  const T* source = values + r * run;
  float amax = 0.0F;
  for (int i = lane; i < run; i += 32) amax = fmaxf(amax, fabsf(to_float(source[i])));
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffU, amax, offset));
  const float scale = fp8::scale_for(amax);
  std::uint8_t* target = codes + r * run;
  for (int i = lane; i < run; i += 32) target[i] = fp8::encode_e4m3(to_float(source[i]) / scale);
  if (lane == 0) scales[r] = scale;
}

}  // namespace

void launch_quantize_value_runs(int kv_type, const void* values, long long runs, int run, std::uint8_t* codes,
                                float* scales, cudaStream_t stream) {
  if (runs <= 0) return;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const long long blocks = (runs + kThreads / 32 - 1) / (kThreads / 32);
    quantize_value_runs_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const T*>(values), runs, run, codes, scales);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
