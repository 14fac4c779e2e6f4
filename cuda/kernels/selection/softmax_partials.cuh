// Softmax partials (max, sum of exp(x - max)) and their merges, for the chunk selection's normalisers: per tile in
// the landmark logits kernel, per query head in the score merge, over a whole row in the select kernel.
#pragma once

#include <cuda_runtime.h>

#include "common/float_constants.cuh"

namespace shadowkv::cuda::selection {

/// Merges softmax partials (max, sum of exp(x - max)); (-inf, 0) is the empty partial.
__device__ __forceinline__ void merge_partial(float& m, float& s, float other_m, float other_s) {
  const float top = fmaxf(m, other_m);
  if (top == kNegativeInfinity) {
    m = top;
    s = 0.0F;
    return;
  }
  s = s * expf(m - top) + other_s * expf(other_m - top);
  m = top;
}

// Not cub::WarpReduce: its shuffle tree (offsets 1, 2, 4, ...) would round the float sums differently from this one.
__device__ __forceinline__ void warp_merge_partial(float& m, float& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_m = __shfl_xor_sync(0xffffffffU, m, offset);
    const float other_s = __shfl_xor_sync(0xffffffffU, s, offset);
    merge_partial(m, s, other_m, other_s);
  }
}

/// (max, sum exp(x - max)) of row[0, n) over a block of kThreads threads; -inf entries are left out. Called by every
/// thread; `scratch` holds 2 * (kThreads / 32) + 2 floats in shared memory.
/// Not cub::BlockReduce: its reduction tree differs from this fixed one, so the float sums would round differently.
template <int kThreads>
__device__ void block_softmax_partial(const float* row, int n, float* scratch, float& out_m, float& out_s) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps == 32, "warp 0 merges one partial per lane");
  float m = kNegativeInfinity;
  float s = 0.0F;
  for (int c = threadIdx.x; c < n; c += kThreads) {
    const float x = row[c];
    if (x > m) {
      s = s * expf(m - x) + 1.0F;
      m = x;
    } else if (x != kNegativeInfinity) {
      s += expf(x - m);
    }
  }
  warp_merge_partial(m, s);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) {
    scratch[2 * warp] = m;
    scratch[2 * warp + 1] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = scratch[2 * lane];
    s = scratch[2 * lane + 1];
    warp_merge_partial(m, s);
    if (lane == 0) {
      scratch[2 * kWarps] = m;
      scratch[2 * kWarps + 1] = s;
    }
  }
  __syncthreads();
  out_m = scratch[2 * kWarps];
  out_s = scratch[2 * kWarps + 1];
}

}  // namespace shadowkv::cuda::selection
