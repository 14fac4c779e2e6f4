// The two-centroid rule (shadowkv/chunk_centroids.hpp) on hand-made chunks: identical keys, two separated groups,
// the farthest-pair start with its tie rule, and the encoded bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "shadowkv/chunk_centroids.hpp"
#include "shadowkv/fp8.hpp"

namespace {

using shadowkv::rules::centroid_element;
using shadowkv::rules::chunk_centroids;
using shadowkv::rules::two_means;

struct chunk_keys {
  int chunk;
  int dim;
  std::vector<float> data;  // [chunk, dim]
  float operator()(int i, int d) const { return data[static_cast<std::size_t>(i * dim + d)]; }
};

std::vector<float> decoded(const std::vector<std::uint8_t>& codes, const chunk_centroids& c, int m, int dim) {
  std::vector<float> out(static_cast<std::size_t>(dim));
  for (int d = 0; d < dim; ++d) out[static_cast<std::size_t>(d)] = centroid_element(codes[static_cast<std::size_t>(m * dim + d)], c.scale[m]);
  return out;
}

TEST(ChunkCentroids, IdenticalKeysAreOneCluster) {
  const int chunk = 8;
  const int dim = 4;
  chunk_keys keys{chunk, dim, {}};
  for (int i = 0; i < chunk; ++i) keys.data.insert(keys.data.end(), {1.5F, -0.25F, 3.0F, 0.0F});
  std::vector<double> work(2 * dim);
  std::vector<std::uint8_t> codes(2 * dim);
  const chunk_centroids made = two_means(keys, chunk, dim, work.data(), codes.data());
  EXPECT_EQ(made.first_count, chunk) << "every distance ties: every key stays in the first cluster";
  EXPECT_FLOAT_EQ(made.scale[0], 3.0F / 448.0F);
  const std::vector<float> first = decoded(codes, made, 0, dim);
  for (int d = 0; d < dim; ++d) {
    const float x = keys(0, d);
    const float expected = shadowkv::fp8::decode_e4m3(shadowkv::fp8::encode_e4m3(x / made.scale[0])) * made.scale[0];
    EXPECT_EQ(first[static_cast<std::size_t>(d)], expected) << d;
  }
}

TEST(ChunkCentroids, TwoGroupsGiveTheirMeans) {
  // Keys 0-2 near (+4, +2), keys 3-7 near (-4, -2); the farthest pair is (0, j) with j in the second group.
  const int chunk = 8;
  const int dim = 2;
  chunk_keys keys{chunk, dim,
                  {4.0F, 2.0F, 4.1F, 2.0F, 3.9F, 2.1F, -4.0F, -2.0F, -4.2F, -2.0F, -4.0F, -1.9F, -3.9F, -2.1F, -4.1F,
                   -2.2F}};
  std::vector<double> work(2 * dim);
  std::vector<std::uint8_t> codes(2 * dim);
  const chunk_centroids made = two_means(keys, chunk, dim, work.data(), codes.data());
  EXPECT_EQ(made.first_count, 3);
  const std::vector<float> first = decoded(codes, made, 0, dim);
  const std::vector<float> second = decoded(codes, made, 1, dim);
  // The means (4.0, 2.0333) and (-4.04, -2.04), then e4m3 (3 mantissa bits: within 1/16 relative).
  EXPECT_NEAR(first[0], 4.0F, 4.0F / 16);
  EXPECT_NEAR(first[1], 2.0333F, 2.04F / 16);
  EXPECT_NEAR(second[0], -4.04F, 4.04F / 16);
  EXPECT_NEAR(second[1], -2.04F, 2.04F / 16);
  // Exactly what the rule says: the float32 mean of each group, encoded with its own scale.
  const float mean_x = static_cast<float>((4.0 + 4.1 + 3.9) / 3.0);
  EXPECT_EQ(first[0], shadowkv::fp8::decode_e4m3(shadowkv::fp8::encode_e4m3(mean_x / made.scale[0])) * made.scale[0]);
}

TEST(ChunkCentroids, FarthestPairTiesGoToTheFirstPair) {
  // Keys on a line at 0, 1, 2, 3: the farthest pair is (0, 3) only; with keys 0, 0, 1, 1 every cross pair ties and
  // (0, 2) is first: cluster one starts at key 0 and keeps keys 0 and 1.
  const int dim = 1;
  chunk_keys keys{4, dim, {0.0F, 0.0F, 1.0F, 1.0F}};
  std::vector<double> work(2 * dim);
  std::vector<std::uint8_t> codes(2 * dim);
  const chunk_centroids made = two_means(keys, 4, dim, work.data(), codes.data());
  EXPECT_EQ(made.first_count, 2);
  EXPECT_EQ(decoded(codes, made, 0, dim)[0], 0.0F);
  EXPECT_EQ(decoded(codes, made, 1, dim)[0], 1.0F);
}

TEST(ChunkCentroids, BytesPerChunkAndHead) { EXPECT_EQ(shadowkv::rules::centroid_bytes(128), 2 * 128 + 9); }

}  // namespace
