// decode_e4m3x16 (common/fp8_vectors.cuh, the hardware conversion the two-centroid scores use) against the store's
// rule, fp8::decode_e4m3, for all 256 codes in every position of a 16-byte vector.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/fp8_vectors.cuh"
#include "cuda_test_support.cuh"
#include "shadowkv/fp8.hpp"

namespace {

using namespace shadowkv::cuda::testing;

__global__ void decode_kernel(const uint4* packed, float* out, int vectors) {
  const int v = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (v >= vectors) return;
  float x[16];
  shadowkv::cuda::decode_e4m3x16(packed[v], x);
  for (int i = 0; i < 16; ++i) out[v * 16 + i] = x[i];
}

TEST(Fp8Vectors, EveryCodeInEveryPositionMatchesTheRule) {
  if (!device_present()) GTEST_SKIP() << "no CUDA device: decode_e4m3x16 is not exercised";
  // Vector v holds codes (v + 17 * i) mod 256 at byte i: each code appears at each of the 16 positions.
  constexpr int kVectors = 256;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(kVectors) * 16);
  for (int v = 0; v < kVectors; ++v) {
    for (int i = 0; i < 16; ++i) {
      codes[static_cast<std::size_t>(v) * 16 + i] = static_cast<std::uint8_t>((v + 17 * i) % 256);
    }
  }
  device_buffer packed(codes.size());
  device_buffer out(codes.size() * sizeof(float));
  ASSERT_TRUE(packed.ok() && out.ok());
  CUDA_OK(cudaMemcpy(packed.get(), codes.data(), codes.size(), cudaMemcpyHostToDevice));
  decode_kernel<<<(kVectors + 127) / 128, 128>>>(packed.get<uint4>(), out.get<float>(), kVectors);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got(codes.size());
  CUDA_OK(cudaMemcpy(got.data(), out.get(), got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int checked = 0;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    const float want = shadowkv::fp8::decode_e4m3(codes[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << "code " << int(codes[i]) << " at byte " << i % 16;
      continue;
    }
    ASSERT_EQ(std::memcmp(&got[i], &want, sizeof(float)), 0)
        << "code " << int(codes[i]) << " at byte " << i % 16 << ": got " << got[i] << ", want " << want;
    ++checked;
  }
  EXPECT_EQ(checked, kVectors * 16 - 2 * 16);  // the NaN codes 0x7f and 0xff, once per position
}

}  // namespace
