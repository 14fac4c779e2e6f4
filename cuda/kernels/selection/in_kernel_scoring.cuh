// The one-kernel fallback of the chunk selection (select_mode::in_kernel): several query tokens when the tile
// partials do not fit in the scores rows. One CTA does what the logits kernel's statistics and accumulate launches do
// for a (sequence, KV head): a warp per chunk, G * Tq passes over the landmarks; slow but exact.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/element_access.cuh"
#include "common/float_constants.cuh"
#include "device_layout.cuh"
#include "selection/softmax_partials.cuh"

namespace shadowkv::cuda::selection {

/// For each query head g of KV head h's group and each token t in order: the logits of chunks [0, n) (-inf for
/// outliers) into token_logits, their softmax, and p_{g,t} added into logits row g of logits_group (-1 for
/// non-candidates). landmarks: T [max_chunks, D] of head h; outlier: [max_chunks] of head h; q_shared: D floats and
/// scratch: block_softmax_partial's, both in shared memory. Called by every thread of a block of kThreads threads.
template <typename T, int kThreads>
__device__ __forceinline__ void accumulate_probabilities_in_kernel(const dims& d, const T* landmarks,
                                                                   const std::uint8_t* outlier, int b, int h, int n,
                                                                   const strided_tensor& queries, int tokens,
                                                                   float* logits_group, float* token_logits,
                                                                   float* q_shared, float* scratch) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int group = d.group;
  const int mc = d.max_chunks;
  for (int g = 0; g < group; ++g) {
    float* accumulated = logits_group + static_cast<long long>(g) * mc;
    for (int t = 0; t < tokens; ++t) {
      __syncthreads();  // q_shared and token_logits are reused
      const long long j = static_cast<long long>(h) * group + g;
      for (int e = tid; e < d.head_dim; e += kThreads) {
        q_shared[e] = load_any(queries.data, queries.type,
                               b * queries.stride[0] + t * queries.stride[1] + j * queries.stride[2] + e * queries.stride[3]);
      }
      __syncthreads();
      for (int c = warp; c < n; c += kWarps) {
        float logit = kNegativeInfinity;
        if (outlier[c] == 0) {  // uniform across the warp
          const T* row = landmarks + static_cast<long long>(c) * d.head_dim;
          float acc = 0.0F;
          for (int e = lane; e < d.head_dim; e += 32) acc = fmaf(q_shared[e], to_float(row[e]), acc);
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffU, acc, offset);
          logit = d.softmax_scale * acc;
        }
        if (lane == 0) token_logits[c] = logit;
      }
      __syncthreads();
      float m;
      float s;
      block_softmax_partial<kThreads>(token_logits, n, scratch, m, s);
      for (int c = tid; c < n; c += kThreads) {
        const float x = token_logits[c];
        if (x == kNegativeInfinity) {
          accumulated[c] = -1.0F;  // non-candidate marker, as the logits kernel's accumulate launch writes it
        } else {
          const float p = expf(x - m) / s;
          accumulated[c] = t == 0 ? p : accumulated[c] + p;
        }
      }
    }
  }
}

}  // namespace shadowkv::cuda::selection
