// The fp8 value format (shadowkv/fp8.hpp), checked against first principles: the decoded table is the OCP E4M3 set
// (bias 7, subnormals, largest finite 448, one NaN code per sign), and encoding picks the nearest table entry with
// ties to the even code, saturating at +-448 — over every float in a dense sweep and at every midpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "shadowkv/fp8.hpp"

namespace {

using shadowkv::fp8::decode_e4m3;
using shadowkv::fp8::encode_e4m3;

// The finite non-negative e4m3 values by code (0x00 .. 0x7e), from the format's definition.
std::vector<double> positive_table() {
  std::vector<double> values;
  for (int code = 0; code <= 0x7e; ++code) {
    const int exponent = code >> 3;
    const int mantissa = code & 7;
    values.push_back(exponent == 0 ? mantissa * std::ldexp(1.0, -9) : (1.0 + mantissa / 8.0) * std::ldexp(1.0, exponent - 7));
  }
  return values;
}

// Nearest code to |x| by search, ties to the even code; beyond 448 saturates.
int nearest_code(double magnitude, const std::vector<double>& table) {
  if (magnitude >= 448.0) return 0x7e;
  int best = 0;
  for (int code = 1; code < static_cast<int>(table.size()); ++code) {
    const double d_best = std::fabs(table[static_cast<std::size_t>(best)] - magnitude);
    const double d_code = std::fabs(table[static_cast<std::size_t>(code)] - magnitude);
    if (d_code < d_best || (d_code == d_best && (code & 1) == 0)) best = code;
  }
  return best;
}

TEST(Fp8, DecodeIsTheE4M3Table) {
  const std::vector<double> table = positive_table();
  for (int code = 0; code <= 0x7e; ++code) {
    EXPECT_EQ(static_cast<double>(decode_e4m3(static_cast<std::uint8_t>(code))), table[static_cast<std::size_t>(code)]) << code;
    EXPECT_EQ(static_cast<double>(decode_e4m3(static_cast<std::uint8_t>(code | 0x80))), -table[static_cast<std::size_t>(code)]) << code;
  }
  EXPECT_EQ(decode_e4m3(0x7e), 448.0F);
  EXPECT_EQ(decode_e4m3(0x01), std::ldexp(1.0F, -9));
  EXPECT_TRUE(std::isnan(decode_e4m3(0x7f)));
  EXPECT_TRUE(std::isnan(decode_e4m3(0xff)));
}

TEST(Fp8, EncodeRoundTripsEveryCode) {
  for (int code = 0; code <= 0xff; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN
    const float value = decode_e4m3(static_cast<std::uint8_t>(code));
    const std::uint8_t again = encode_e4m3(value);
    if (code == 0x80) {
      EXPECT_EQ(again, 0x80) << "negative zero keeps its sign";
    } else {
      EXPECT_EQ(again, code) << value;
    }
  }
}

TEST(Fp8, EncodeIsNearestWithTiesToEvenOnMidpointsAndASweep) {
  const std::vector<double> table = positive_table();
  std::vector<float> probes;
  for (std::size_t i = 0; i + 1 < table.size(); ++i) {
    const double mid = 0.5 * (table[i] + table[i + 1]);  // exact in float: the table has 4 significant bits
    probes.push_back(static_cast<float>(mid));
    probes.push_back(std::nextafter(static_cast<float>(mid), 0.0F));
    probes.push_back(std::nextafter(static_cast<float>(mid), 1000.0F));
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0F, 9.5F);
  for (int i = 0; i < 200000; ++i) probes.push_back(std::exp2(exponent(rng)));
  for (float x = 0.0F; x < 600.0F; x += 0.0625F) probes.push_back(x);
  probes.push_back(std::numeric_limits<float>::denorm_min());
  probes.push_back(std::numeric_limits<float>::max());
  probes.push_back(std::numeric_limits<float>::infinity());
  for (const float x : probes) {
    const int want = nearest_code(static_cast<double>(x), table);
    ASSERT_EQ(encode_e4m3(x), want) << "x = " << x;
    ASSERT_EQ(encode_e4m3(-x), want | 0x80) << "x = " << -x;
  }
  EXPECT_EQ(encode_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
}

TEST(Fp8, ScaleMapsTheRunMaximumTo448) {
  EXPECT_EQ(shadowkv::fp8::scale_for(0.0F), 1.0F);
  for (const float amax : {1e-30F, 3.0e-3F, 1.0F, 448.0F, 7.5e4F, 3e38F}) {
    const float scale = shadowkv::fp8::scale_for(amax);
    const std::uint8_t code = encode_e4m3(amax / scale);
    EXPECT_EQ(code, 0x7e) << amax;
    EXPECT_NEAR(decode_e4m3(code) * scale, amax, 1e-6 * amax) << amax;
  }
}

}  // namespace
