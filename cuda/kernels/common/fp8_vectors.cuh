// Sixteen e4m3 codes (one 16-byte vector) to floats with the hardware conversion: cvt.rn.f16x2.e4m3x2 turns two codes
// into two halves in one instruction on sm_89 and later (cuda_fp8.h falls back to its portable rule elsewhere). Every
// e4m3 value is a half exactly, so the floats equal fp8::decode_e4m3's for every code but the two NaN codes (a NaN
// either way; the store's encoder never writes them). Checked over all 256 codes by tests/cuda/test_fp8_vectors.cu.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/element_access.cuh"

namespace shadowkv::cuda {

/// x[i] = the value of byte i of `packed` (little-endian: byte 0 is the low byte of packed.x).
__device__ __forceinline__ void decode_e4m3x16(const uint4& packed, float (&x)[16]) {
  const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((words[w] >> (16 * p)) & 0xFFFFU);
      const __half2 halves(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));  // .x: the low byte
      const float2 f = __half22float2(halves);
      x[4 * w + 2 * p] = f.x;
      x[4 * w + 2 * p + 1] = f.y;
    }
  }
}

/// One e4m3 code as the element of a row (the two-centroid codes of dims::chunk_centroids): a kernel templated on
/// the element type reads rows of codes through vector16<e4m3_code>, 16 codes a 16-byte vector.
struct e4m3_code {
  std::uint8_t bits;
};
static_assert(sizeof(e4m3_code) == 1, "one byte a code");

template <>
struct vector16<e4m3_code> {
  static constexpr int elements = 16;
  __device__ __forceinline__ static void to_floats(const uint4& raw, float* out) {
    decode_e4m3x16(raw, *reinterpret_cast<float(*)[16]>(out));
  }
};

}  // namespace shadowkv::cuda
