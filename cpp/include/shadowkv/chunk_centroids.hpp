// The two-centroid chunk score (config::chunk_score = two_centroids; docs/semantics.md, "Chunk scores"): per
// (chunk, KV head) a 2-means of the chunk's C stored post-RoPE keys, kept as two e4m3 centroids with a float32 scale
// each and the number of keys in the first cluster; a query's score of the chunk is
//   log(w1 · exp(s · q·ĉ1) + w2 · exp(s · q·ĉ2)),  w1 = n1 / C, w2 = 1 - w1,  ĉ = the decoded centroids,
// in place of s · q·L (L the landmark, the keys' mean). Written once for the CPU backend and the CUDA kernels.
//
// The 2-means (float64 throughout): the first two centroids are the two keys farthest apart (squared Euclidean
// distance; the first such pair (i, j), i < j, in order); then kLloydRounds rounds of: assign each key to the nearer
// centroid (a tie goes to the first), move each centroid to the mean of its keys (an empty cluster keeps its
// centroid). n1 counts the first cluster's keys in the last assignment. Each centroid is rounded to float32, then
// stored as e4m3 codes with the scale of fp8::scale_for (the value store's fp8 rule).
#pragma once

#include <cstdint>

#include "shadowkv/fp8.hpp"
#include "shadowkv/host_device.hpp"

namespace shadowkv::rules {

inline constexpr int kLloydRounds = 8;
/// Largest chunk the two-centroid rule takes (cluster membership is a 64-bit mask).
inline constexpr int kMaxCentroidChunk = 64;

/// Bytes of one (chunk, KV head): 2·D codes, 2 float32 scales, the count byte.
SHADOWKV_HOST_DEVICE constexpr long long centroid_bytes(long long head_dim) { return 2 * head_dim + 2 * 4 + 1; }

/// One (chunk, head) of the two-centroid score, encoded.
struct chunk_centroids {
  float scale[2];
  std::uint8_t first_count;  ///< n1: keys in the first cluster
};

/// key(i, d): element d of the chunk's i-th stored key (float), i < chunk, d < dim. work: 2·dim doubles of scratch
/// (the two centroids). codes: 2·dim bytes out, centroid m at [m·dim, (m+1)·dim).
template <typename Key>
SHADOWKV_HOST_DEVICE chunk_centroids two_means(const Key& key, int chunk, int dim, double* work, std::uint8_t* codes) {
  double* c1 = work;
  double* c2 = work + dim;
  // Farthest pair.
  int best_i = 0;
  int best_j = chunk > 1 ? 1 : 0;
  double best = -1.0;
  for (int i = 0; i < chunk; ++i) {
    for (int j = i + 1; j < chunk; ++j) {
      double distance = 0.0;
      for (int d = 0; d < dim; ++d) {
        const double diff = static_cast<double>(key(i, d)) - static_cast<double>(key(j, d));
        distance += diff * diff;
      }
      if (distance > best) {
        best = distance;
        best_i = i;
        best_j = j;
      }
    }
  }
  for (int d = 0; d < dim; ++d) {
    c1[d] = static_cast<double>(key(best_i, d));
    c2[d] = static_cast<double>(key(best_j, d));
  }
  // Lloyd rounds. Membership is a bit mask (chunk <= kMaxCentroidChunk: config::validate).
  std::uint64_t second = 0;
  for (int round = 0; round < kLloydRounds; ++round) {
    second = 0;
    int n2 = 0;
    for (int i = 0; i < chunk; ++i) {
      double d1 = 0.0;
      double d2 = 0.0;
      for (int d = 0; d < dim; ++d) {
        const double x = static_cast<double>(key(i, d));
        d1 += (x - c1[d]) * (x - c1[d]);
        d2 += (x - c2[d]) * (x - c2[d]);
      }
      if (d2 < d1) {
        second |= std::uint64_t{1} << i;
        ++n2;
      }
    }
    const int n1 = chunk - n2;
    for (int d = 0; d < dim; ++d) {
      double s1 = 0.0;
      double s2 = 0.0;
      for (int i = 0; i < chunk; ++i) {
        const double x = static_cast<double>(key(i, d));
        if (((second >> i) & 1U) != 0) {
          s2 += x;
        } else {
          s1 += x;
        }
      }
      if (n1 > 0) c1[d] = s1 / n1;
      if (n2 > 0) c2[d] = s2 / n2;
    }
  }
  int n2 = 0;
  for (int i = 0; i < chunk; ++i) n2 += static_cast<int>((second >> i) & 1U);
  chunk_centroids out{};
  out.first_count = static_cast<std::uint8_t>(chunk - n2);
  for (int m = 0; m < 2; ++m) {
    const double* c = m == 0 ? c1 : c2;
    float amax = 0.0F;
    for (int d = 0; d < dim; ++d) {
      const float x = static_cast<float>(c[d]);
      amax = x < 0.0F ? (-x > amax ? -x : amax) : (x > amax ? x : amax);
    }
    out.scale[m] = fp8::scale_for(amax);
    for (int d = 0; d < dim; ++d) codes[m * dim + d] = fp8::encode_e4m3(static_cast<float>(c[d]) / out.scale[m]);
  }
  return out;
}

/// The decoded centroid element: code × scale, as float.
SHADOWKV_HOST_DEVICE float centroid_element(std::uint8_t code, float scale) {
  return fp8::decode_e4m3(code) * scale;
}

}  // namespace shadowkv::rules
