// The bf16 tensor-core pieces that the hand-written kernels share (sparse_attention.cu's tensor-core kernel,
// landmark_logits.cu's tensor-core landmark logits): one m16n8k16 MMA with float32 accumulators, and a float32 operand
// split into three bf16 terms so that every product with a bf16 operand is exact.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16): lane l, g = l / 4, t = l % 4. A (16 x 16, row): a[0] = (row g,
// k 2t and 2t + 1), a[1] = (row g + 8, the same k), a[2] = (row g, k 2t + 8 and 2t + 9), a[3] = (row g + 8, those);
// B (16 x 8, col): b0 = (k 2t and 2t + 1, column g), b1 = (k 2t + 8 and 2t + 9, column g); the lower 16 bits hold the
// smaller k. D (16 x 8): d[0], d[1] = (row g, columns 2t, 2t + 1), d[2], d[3] = (row g + 8, the same columns).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace shadowkv::cuda {

constexpr int kBf16Terms = 3;  ///< bf16 terms of a float32 operand (8 + 8 + 8 significand bits)

/// d += a b: m16n8k16, bf16 inputs, float32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Two floats as three packed bf16x2 terms (hi + mid + lo == x exactly for finite x with no subnormal parts): term t
/// holds the x0 part in its low half and the x1 part in its high half.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, unsigned (&terms)[kBf16Terms]) {
#pragma unroll
  for (int t = 0; t < kBf16Terms; ++t) {
    const __nv_bfloat162 part = __floats2bfloat162_rn(x0, x1);
    terms[t] = *reinterpret_cast<const unsigned*>(&part);
    x0 -= __low2float(part);
    x1 -= __high2float(part);
  }
}

}  // namespace shadowkv::cuda
