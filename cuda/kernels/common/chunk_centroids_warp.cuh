// One warp computes one (chunk, KV head)'s two centroids by the rule of shadowkv/chunk_centroids.hpp, each phase of
// the 2-means spread over its lanes (pairs, keys, dimensions), every sum still sequential in the rule's order: the
// same bits as the CPU backend's rules::two_means. Used by the prefill (prompt_kernels.cu) and the fold
// (generated_tokens.cu).
#pragma once

#include <cstdint>

#include "shadowkv/chunk_centroids.hpp"
#include "shadowkv/fp8.hpp"

namespace shadowkv::cuda {

/// Where one (chunk, head)'s encoded centroids go: 2·D codes, 2 scales, the first cluster's count.
struct centroid_target {
  std::uint8_t* codes;
  float* scales;
  std::uint8_t* first_count;
};

/// All 32 lanes of the warp call it with the same arguments. key(i, d) as in rules::two_means (chunk <=
/// rules::kMaxCentroidChunk); work: 2·dim doubles of shared memory that only this warp uses.
template <typename Key>
__device__ void two_means_warp(const Key& key, int chunk, int dim, double* work, const centroid_target& out) {
  constexpr unsigned kAll = 0xffffffffU;
  const int lane = static_cast<int>(threadIdx.x & 31U);
  double* c1 = work;
  double* c2 = work + dim;
  // Farthest pair: each lane its pairs in order (the first of equal distances kept), then across lanes the largest
  // distance, ties to the smaller pair index: the rule's first pair in order with the largest distance.
  double best = -1.0;
  int best_pair = -1;
  for (int p = lane; p < rules::pair_count(chunk); p += 32) {
    int i;
    int j;
    rules::pair_of(p, chunk, i, j);
    const double distance = rules::key_distance(key, i, j, dim);
    if (distance > best) {
      best = distance;
      best_pair = p;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const double other = __shfl_xor_sync(kAll, best, offset);
    const int other_pair = __shfl_xor_sync(kAll, best_pair, offset);
    if (other > best || (other == best && other_pair >= 0 && (best_pair < 0 || other_pair < best_pair))) {
      best = other;
      best_pair = other_pair;
    }
  }
  int best_i = 0;
  int best_j = chunk > 1 ? 1 : 0;
  if (best_pair >= 0) rules::pair_of(best_pair, chunk, best_i, best_j);
  for (int d = lane; d < dim; d += 32) {
    c1[d] = static_cast<double>(key(best_i, d));
    c2[d] = static_cast<double>(key(best_j, d));
  }
  __syncwarp();
  // Lloyd rounds: a lane per key (two at chunk > 32), then a lane per dimension.
  int n2 = 0;
  for (int round = 0; round < rules::kLloydRounds; ++round) {
    const bool low = lane < chunk && rules::nearer_second(key, lane, c1, c2, dim);
    const bool high = lane + 32 < chunk && rules::nearer_second(key, lane + 32, c1, c2, dim);
    const std::uint64_t second = static_cast<std::uint64_t>(__ballot_sync(kAll, low)) |
                                 static_cast<std::uint64_t>(__ballot_sync(kAll, high)) << 32;
    n2 = __popcll(second);
    __syncwarp();  // every lane has read the centroids before any moves them
    for (int d = lane; d < dim; d += 32) rules::move_centroids(key, d, chunk, second, n2, c1, c2);
    __syncwarp();
  }
  if (lane == 0) *out.first_count = static_cast<std::uint8_t>(chunk - n2);
  for (int m = 0; m < 2; ++m) {
    const double* c = m == 0 ? c1 : c2;
    float amax = 0.0F;
    for (int d = lane; d < dim; d += 32) {
      const float x = rules::encoded_magnitude(c[d]);
      amax = x > amax ? x : amax;
    }
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kAll, amax, offset));
    const float scale = fp8::scale_for(amax);
    if (lane == 0) out.scales[m] = scale;
    for (int d = lane; d < dim; d += 32) out.codes[m * dim + d] = rules::centroid_code(c[d], scale);
  }
  __syncwarp();  // the caller may reuse `work`
}

}  // namespace shadowkv::cuda
