// Sixteen e4m3 codes (one 16-byte vector) to floats, with integer operations: a code's sign bit and its seven
// magnitude bits, moved to bits 31 and 20..26 of a float, make the float of (the code's value) * 2^-120 — for the
// subnormal codes too (they become float subnormals) — and one multiply by 2^120 makes it exact. Three integer
// operations a code (byte to the top, arithmetic shift right by 4, one mask) and the multiply, where the hardware
// conversion (cvt.rn.f16x2.e4m3x2, then half to float) takes 1.5 conversions a code at a quarter of the integer rate
// (bench/NOTES.md, session 9). The floats equal fp8::decode_e4m3's bit for bit for every code but the two NaN codes,
// 0x7f and 0xff, which give +-480 here (the store's encoder never writes them: it saturates at 448). Checked over all
// 256 codes in every byte position by tests/cuda/test_fp8_vectors.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/element_access.cuh"

namespace shadowkv::cuda {

/// The code in bits 24..31 of `top` (the bits below are ignored) as a float.
__device__ __forceinline__ float decode_e4m3_at_top(unsigned top) {
  // Arithmetic shift: the sign fills bits 27..31, the magnitude lands in 20..26; the mask keeps bit 31 and 20..26.
  const unsigned bits = static_cast<unsigned>(static_cast<int>(top) >> 4) & 0x87F00000U;
  return __uint_as_float(bits) * 0x1p120F;
}

/// x[i] = the value of byte i of `packed` (little-endian: byte 0 is the low byte of packed.x).
__device__ __forceinline__ void decode_e4m3x16(const uint4& packed, float (&x)[16]) {
  const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    x[4 * w + 0] = decode_e4m3_at_top(words[w] << 24);
    x[4 * w + 1] = decode_e4m3_at_top(words[w] << 16);
    x[4 * w + 2] = decode_e4m3_at_top(words[w] << 8);
    x[4 * w + 3] = decode_e4m3_at_top(words[w]);
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
