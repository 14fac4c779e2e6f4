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

// The 2-means is written as steps that are independent of one another within a phase (a pair's distance, a key's
// assignment, a dimension's new centroid element, the encoding), each a sequential sum in a fixed order, so that the
// CPU backend (two_means: the steps in loops) and the CUDA kernels (a warp spreading each phase over its lanes:
// cuda/kernels/common/chunk_centroids_warp.cuh) compute the same bits. Products go through `product`, which the CUDA
// compiler may not fuse into an FMA (the CPU build does not fuse either).

/// a * b, rounded on its own (never fused with a following add).
SHADOWKV_HOST_DEVICE double product(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

/// Pairs (i, j), i < j, in the order the farthest-pair search visits them: i outer, j inner.
SHADOWKV_HOST_DEVICE int pair_count(int chunk) { return chunk * (chunk - 1) / 2; }
SHADOWKV_HOST_DEVICE void pair_of(int p, int chunk, int& i, int& j) {
  i = 0;
  while (p >= chunk - 1 - i) {
    p -= chunk - 1 - i;
    ++i;
  }
  j = i + 1 + p;
}

/// Squared Euclidean distance of keys i and j (float64, dimensions in order).
template <typename Key>
SHADOWKV_HOST_DEVICE double key_distance(const Key& key, int i, int j, int dim) {
  double distance = 0.0;
  for (int d = 0; d < dim; ++d) {
    const double diff = static_cast<double>(key(i, d)) - static_cast<double>(key(j, d));
    distance += product(diff, diff);
  }
  return distance;
}

/// Whether key i is nearer the second centroid than the first (a tie goes to the first).
template <typename Key>
SHADOWKV_HOST_DEVICE bool nearer_second(const Key& key, int i, const double* c1, const double* c2, int dim) {
  double d1 = 0.0;
  double d2 = 0.0;
  for (int d = 0; d < dim; ++d) {
    const double x = static_cast<double>(key(i, d));
    d1 += product(x - c1[d], x - c1[d]);
    d2 += product(x - c2[d], x - c2[d]);
  }
  return d2 < d1;
}

/// Element d of both centroids moved to the mean of their members (`second`: bit i set when key i is in the second
/// cluster, n2 of them); an empty cluster keeps its element.
template <typename Key>
SHADOWKV_HOST_DEVICE void move_centroids(const Key& key, int d, int chunk, std::uint64_t second, int n2, double* c1,
                                         double* c2) {
  const int n1 = chunk - n2;
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

/// |centroid element| as float, for the encoding's amax (a max: any order gives the same value).
SHADOWKV_HOST_DEVICE float encoded_magnitude(double c) {
  const float x = static_cast<float>(c);
  return x < 0.0F ? -x : x;
}

/// The e4m3 code of centroid element c with the centroid's scale.
SHADOWKV_HOST_DEVICE std::uint8_t centroid_code(double c, float scale) {
  return fp8::encode_e4m3(static_cast<float>(c) / scale);
}

/// key(i, d): element d of the chunk's i-th stored key (float), i < chunk, d < dim. work: 2·dim doubles of scratch
/// (the two centroids). codes: 2·dim bytes out, centroid m at [m·dim, (m+1)·dim).
template <typename Key>
SHADOWKV_HOST_DEVICE chunk_centroids two_means(const Key& key, int chunk, int dim, double* work, std::uint8_t* codes) {
  double* c1 = work;
  double* c2 = work + dim;
  // Farthest pair: the largest distance, the first such pair in order.
  int best_i = 0;
  int best_j = chunk > 1 ? 1 : 0;
  double best = -1.0;
  for (int p = 0; p < pair_count(chunk); ++p) {
    int i;
    int j;
    pair_of(p, chunk, i, j);
    const double distance = key_distance(key, i, j, dim);
    if (distance > best) {
      best = distance;
      best_i = i;
      best_j = j;
    }
  }
  for (int d = 0; d < dim; ++d) {
    c1[d] = static_cast<double>(key(best_i, d));
    c2[d] = static_cast<double>(key(best_j, d));
  }
  // Lloyd rounds. Membership is a bit mask (chunk <= kMaxCentroidChunk: config::validate).
  std::uint64_t second = 0;
  int n2 = 0;
  for (int round = 0; round < kLloydRounds; ++round) {
    second = 0;
    n2 = 0;
    for (int i = 0; i < chunk; ++i) {
      if (nearer_second(key, i, c1, c2, dim)) {
        second |= std::uint64_t{1} << i;
        ++n2;
      }
    }
    for (int d = 0; d < dim; ++d) move_centroids(key, d, chunk, second, n2, c1, c2);
  }
  chunk_centroids out{};
  out.first_count = static_cast<std::uint8_t>(chunk - n2);
  for (int m = 0; m < 2; ++m) {
    const double* c = m == 0 ? c1 : c2;
    float amax = 0.0F;
    for (int d = 0; d < dim; ++d) {
      const float x = encoded_magnitude(c[d]);
      amax = x > amax ? x : amax;
    }
    out.scale[m] = fp8::scale_for(amax);
    for (int d = 0; d < dim; ++d) codes[m * dim + d] = centroid_code(c[d], out.scale[m]);
  }
  return out;
}

/// The decoded centroid element: code × scale, as float.
SHADOWKV_HOST_DEVICE float centroid_element(std::uint8_t code, float scale) {
  return fp8::decode_e4m3(code) * scale;
}

}  // namespace shadowkv::rules
