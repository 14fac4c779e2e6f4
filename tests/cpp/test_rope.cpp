// RoPE as the store applies and removes it (shadowkv/rope.hpp, docs/semantics.md "RoPE").
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "shadowkv/config.hpp"
#include "shadowkv/rope.hpp"

namespace {

using shadowkv::config;
using shadowkv::rope_rotation;
using shadowkv::rope_style;

config rope_config(int head_dim, int rotary_dim, rope_style style, double theta = 10000.0, float scaling = 1.0F) {
  config cfg;
  cfg.head_dim = head_dim;
  cfg.rotary_dim = rotary_dim;
  cfg.rope = style;
  cfg.rope_theta = theta;
  cfg.attention_scaling = scaling;
  cfg.rank = 1;
  return cfg;
}

std::vector<float> random_vector(std::mt19937_64& rng, int n) {
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  return worst;
}

// The pairs (first, second) of rotary frequency i.
std::pair<int, int> pair_of(rope_style style, int rotary_dim, int i) {
  return style == rope_style::half_split ? std::pair{i, i + rotary_dim / 2} : std::pair{2 * i, 2 * i + 1};
}

struct rope_case {
  const char* name;
  int head_dim;
  int rotary_dim;  // 0: head_dim
  rope_style style;
  float scaling;
};

void PrintTo(const rope_case& c, std::ostream* os) { *os << c.name; }

class RopeCases : public ::testing::TestWithParam<rope_case> {};

TEST_P(RopeCases, ApplyThenRemoveIsIdentity) {
  const rope_case& param = GetParam();
  const std::uint64_t seed = 1234 + static_cast<std::uint64_t>(param.head_dim) * 7 + static_cast<std::uint64_t>(param.style);
  SCOPED_TRACE(std::string(param.name) + " seed=" + std::to_string(seed));
  const config cfg = rope_config(param.head_dim, param.rotary_dim, param.style, 10000.0, param.scaling);
  const rope_rotation rope(cfg);
  std::mt19937_64 rng(seed);
  for (const std::int64_t position : {0LL, 1LL, 17LL, 999LL, 4096LL, 131071LL}) {
    SCOPED_TRACE("position=" + std::to_string(position));
    const std::vector<float> original = random_vector(rng, param.head_dim);
    std::vector<float> x = original;
    rope.apply(x.data(), position);
    if (position > 0) {
      EXPECT_GT(max_abs_diff(x, original), 1e-3) << "apply must change the vector";
    }
    rope.remove(x.data(), position);
    EXPECT_LT(max_abs_diff(x, original), 1e-6 * 4);
    // remove then apply is the identity too.
    rope.remove(x.data(), position);
    rope.apply(x.data(), position);
    EXPECT_LT(max_abs_diff(x, original), 2e-6 * 4);
  }
}

TEST_P(RopeCases, DimsPastRotaryAreUntouchedAndPairsScaleByAttentionScaling) {
  const rope_case& param = GetParam();
  const std::uint64_t seed = 99 + static_cast<std::uint64_t>(param.rotary_dim);
  SCOPED_TRACE(std::string(param.name) + " seed=" + std::to_string(seed));
  const config cfg = rope_config(param.head_dim, param.rotary_dim, param.style, 10000.0, param.scaling);
  const rope_rotation rope(cfg);
  const int rotary = cfg.effective_rotary_dim();
  EXPECT_EQ(rope.rotary_dim(), rotary);
  std::mt19937_64 rng(seed);
  const std::vector<float> original = random_vector(rng, param.head_dim);
  std::vector<float> x = original;
  rope.apply(x.data(), 321);
  for (int d = rotary; d < param.head_dim; ++d) EXPECT_EQ(x[static_cast<std::size_t>(d)], original[static_cast<std::size_t>(d)]) << "dim " << d;
  for (int i = 0; i < rotary / 2; ++i) {
    const auto [first, second] = pair_of(param.style, rotary, i);
    const double before = std::hypot(original[static_cast<std::size_t>(first)], original[static_cast<std::size_t>(second)]);
    const double after = std::hypot(x[static_cast<std::size_t>(first)], x[static_cast<std::size_t>(second)]);
    EXPECT_NEAR(after, before * param.scaling, 2e-6 * (1.0 + before)) << "pair " << i;
  }
  rope.remove(x.data(), 321);
  for (int d = rotary; d < param.head_dim; ++d) EXPECT_EQ(x[static_cast<std::size_t>(d)], original[static_cast<std::size_t>(d)]) << "dim " << d;
}

TEST_P(RopeCases, ApplyMatchesFloat64Rotation) {
  const rope_case& param = GetParam();
  const std::uint64_t seed = 4242;
  SCOPED_TRACE(std::string(param.name) + " seed=" + std::to_string(seed));
  const config cfg = rope_config(param.head_dim, param.rotary_dim, param.style, 500000.0, param.scaling);
  const rope_rotation rope(cfg);
  const int rotary = cfg.effective_rotary_dim();
  std::mt19937_64 rng(seed);
  for (const std::int64_t position : {3LL, 250LL, 77777LL}) {
    const std::vector<float> original = random_vector(rng, param.head_dim);
    std::vector<float> x = original;
    rope.apply(x.data(), position);
    for (int i = 0; i < rotary / 2; ++i) {
      const auto [first, second] = pair_of(param.style, rotary, i);
      const float angle = static_cast<float>(position) * rope.inv_freq()[static_cast<std::size_t>(i)];  // float32 product
      const double c = std::cos(static_cast<double>(angle)) * param.scaling;
      const double s = std::sin(static_cast<double>(angle)) * param.scaling;
      const double x1 = original[static_cast<std::size_t>(first)];
      const double x2 = original[static_cast<std::size_t>(second)];
      EXPECT_NEAR(x[static_cast<std::size_t>(first)], x1 * c - x2 * s, 2e-6 * (1.0 + std::fabs(x1) + std::fabs(x2)));
      EXPECT_NEAR(x[static_cast<std::size_t>(second)], x2 * c + x1 * s, 2e-6 * (1.0 + std::fabs(x1) + std::fabs(x2)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Styles, RopeCases,
    ::testing::Values(rope_case{"half_d64", 64, 0, rope_style::half_split, 1.0F},
                      rope_case{"interleaved_d64", 64, 0, rope_style::interleaved, 1.0F},
                      rope_case{"half_d128_partial32", 128, 32, rope_style::half_split, 1.0F},
                      rope_case{"interleaved_d80_partial40", 80, 40, rope_style::interleaved, 1.0F},
                      rope_case{"half_d128_scaled", 128, 0, rope_style::half_split, 1.25F},
                      rope_case{"interleaved_d96_partial64_scaled", 96, 64, rope_style::interleaved, 0.8F}),
    [](const ::testing::TestParamInfo<rope_case>& info) { return std::string(info.param.name); });

// Hand-computed: head_dim 4, inv_freq {1, 0.5}, position 1: angles 1 and 0.5 rad, x = (1, 2, 3, 4).
TEST(Rope, HalfSplitMatchesHandComputedRotation) {
  config cfg = rope_config(4, 0, rope_style::half_split);
  cfg.inv_freq = {1.0F, 0.5F};
  const rope_rotation rope(cfg);
  std::vector<float> x = {1.0F, 2.0F, 3.0F, 4.0F};
  rope.apply(x.data(), 1);
  // pairs (0, 2) at 1 rad and (1, 3) at 0.5 rad: (x1 cos - x2 sin, x2 cos + x1 sin)
  EXPECT_NEAR(x[0], -1.9841106485555495, 1e-6);
  EXPECT_NEAR(x[1], -0.1625370306360665, 1e-6);
  EXPECT_NEAR(x[2], 2.4623779024123156, 1e-6);
  EXPECT_NEAR(x[3], 4.469181324769897, 1e-6);
}

TEST(Rope, InterleavedMatchesHandComputedRotation) {
  config cfg = rope_config(4, 0, rope_style::interleaved);
  cfg.inv_freq = {1.0F, 0.5F};
  const rope_rotation rope(cfg);
  std::vector<float> x = {1.0F, 2.0F, 3.0F, 4.0F};
  rope.apply(x.data(), 1);
  // pairs (0, 1) at 1 rad and (2, 3) at 0.5 rad
  EXPECT_NEAR(x[0], -1.1426396637476532, 1e-6);
  EXPECT_NEAR(x[1], 1.922075596544176, 1e-6);
  EXPECT_NEAR(x[2], 0.7150455312543063, 1e-6);
  EXPECT_NEAR(x[3], 4.9486068633741, 1e-6);
}

TEST(Rope, AttentionScalingMultipliesTheRotation) {
  config cfg = rope_config(4, 0, rope_style::half_split, 10000.0, 2.0F);
  cfg.inv_freq = {1.0F, 0.5F};
  const rope_rotation rope(cfg);
  std::vector<float> x = {1.0F, 2.0F, 3.0F, 4.0F};
  rope.apply(x.data(), 1);
  EXPECT_NEAR(x[0], 2.0 * -1.9841106485555495, 2e-6);
  EXPECT_NEAR(x[3], 2.0 * 4.469181324769897, 2e-6);
  rope.remove(x.data(), 1);
  EXPECT_NEAR(x[0], 1.0, 1e-6);
  EXPECT_NEAR(x[1], 2.0, 1e-6);
  EXPECT_NEAR(x[2], 3.0, 1e-6);
  EXPECT_NEAR(x[3], 4.0, 1e-6);
}

TEST(Rope, PositionZeroIsIdentityWithoutScaling) {
  const rope_rotation rope(rope_config(64, 0, rope_style::half_split));
  std::mt19937_64 rng(5);
  const std::vector<float> original = random_vector(rng, 64);
  std::vector<float> x = original;
  rope.apply(x.data(), 0);
  EXPECT_EQ(x, original);
}

TEST(Rope, AngleUsesFloat32Position) {
  // docs/semantics.md: a = float32(p) * inv_freq. 2^24 + 1 is not a float32: it rounds to 2^24.
  const rope_rotation rope(rope_config(64, 0, rope_style::half_split));
  std::mt19937_64 rng(6);
  const std::vector<float> original = random_vector(rng, 64);
  std::vector<float> a = original;
  std::vector<float> b = original;
  rope.apply(a.data(), (1LL << 24) + 1);
  rope.apply(b.data(), 1LL << 24);
  EXPECT_EQ(a, b);
}

TEST(Rope, DefaultInvFreqValues) {
  const std::vector<float> f = shadowkv::default_inv_freq(10000.0, 64);
  ASSERT_EQ(f.size(), 32U);
  EXPECT_EQ(f[0], 1.0F);
  EXPECT_NEAR(f[1], 0.7498942093324559, 1e-7);
  for (std::size_t i = 0; i < f.size(); ++i) {
    EXPECT_EQ(f[i], static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / 64.0))) << "i=" << i;
    if (i > 0) {
      EXPECT_LT(f[i], f[i - 1]);
    }
  }
  const std::vector<float> llama = shadowkv::default_inv_freq(500000.0, 128);
  ASSERT_EQ(llama.size(), 64U);
  EXPECT_NEAR(llama[63] / 2.455140791131609e-06, 1.0, 1e-6);
  // A partial rotary dim uses rotary_dim as the exponent's denominator.
  const std::vector<float> partial = shadowkv::default_inv_freq(10000.0, 32);
  ASSERT_EQ(partial.size(), 16U);
  EXPECT_NEAR(partial[1], std::pow(10000.0, -2.0 / 32.0), 1e-7);
}

TEST(Rope, RotationTakesInvFreqFromConfig) {
  config cfg = rope_config(64, 32, rope_style::half_split, 10000.0);
  EXPECT_EQ(rope_rotation(cfg).inv_freq(), shadowkv::default_inv_freq(10000.0, 32));
  cfg.inv_freq.assign(16, 0.0F);
  for (int i = 0; i < 16; ++i) cfg.inv_freq[static_cast<std::size_t>(i)] = 0.01F * static_cast<float>(i + 1);
  const rope_rotation rope(cfg);
  EXPECT_EQ(rope.inv_freq(), cfg.inv_freq);
  EXPECT_EQ(rope.rotary_dim(), 32);
  // With inv_freq[0] = 0.01 and position 100 the first pair turns by exactly float(100) * 0.01f rad.
  std::vector<float> x(64, 0.0F);
  x[0] = 1.0F;
  rope.apply(x.data(), 100);
  const double angle = static_cast<double>(100.0F * 0.01F);
  EXPECT_NEAR(x[0], std::cos(angle), 1e-7);
  EXPECT_NEAR(x[16], std::sin(angle), 1e-7);
}

}  // namespace
