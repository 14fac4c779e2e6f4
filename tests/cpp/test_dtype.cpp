// float <-> bfloat16 / float16 conversions (shadowkv/dtype.hpp): exact round trips, round to nearest even on chosen
// bit patterns, subnormals, overflow to infinity, NaN; plus a seeded property check that every conversion picks the
// nearest representable value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "shadowkv/dtype.hpp"
#include "shadowkv/errors.hpp"

namespace {

using shadowkv::bfloat16_to_float;
using shadowkv::dtype;
using shadowkv::float16_to_float;
using shadowkv::float_to_bfloat16;
using shadowkv::float_to_float16;

float from_bits(std::uint32_t bits) { return shadowkv::detail::bits_float(bits); }
std::uint32_t to_bits(float value) { return shadowkv::detail::float_bits(value); }

std::string hex(std::uint32_t bits) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", bits);
  return text;
}

bool is_bf16_nan(std::uint16_t h) { return (h & 0x7f80U) == 0x7f80U && (h & 0x007fU) != 0; }
bool is_fp16_nan(std::uint16_t h) { return (h & 0x7c00U) == 0x7c00U && (h & 0x03ffU) != 0; }

// ---------------------------------------------------------------------------------------------------------------
// bfloat16
// ---------------------------------------------------------------------------------------------------------------

TEST(Bfloat16, EveryNonNanPatternRoundTripsExactly) {
  int checked = 0;
  for (std::uint32_t h = 0; h <= 0xffffU; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    if (is_bf16_nan(bits)) continue;
    const float value = bfloat16_to_float(bits);
    ASSERT_EQ(to_bits(value), h << 16) << "bf16 " << hex(h);
    ASSERT_EQ(float_to_bfloat16(value), bits) << "bf16 " << hex(h);
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 127);  // 2 signs x (2^7 - 1) non-zero mantissas with the all-ones exponent
}

TEST(Bfloat16, KnownValues) {
  EXPECT_EQ(float_to_bfloat16(1.0F), 0x3f80U);
  EXPECT_EQ(float_to_bfloat16(-2.0F), 0xc000U);
  EXPECT_EQ(float_to_bfloat16(0.0F), 0x0000U);
  EXPECT_EQ(float_to_bfloat16(-0.0F), 0x8000U);
  EXPECT_EQ(float_to_bfloat16(3.140625F), 0x4049U);  // exactly representable
  EXPECT_EQ(bfloat16_to_float(0x4049U), 3.140625F);
}

TEST(Bfloat16, RoundsToNearestEven) {
  // 0x3f80 and 0x3f81 are neighbours; 0x3f808000 lies exactly between them.
  EXPECT_EQ(float_to_bfloat16(from_bits(0x3f808000U)), 0x3f80U) << "tie goes to the even mantissa";
  EXPECT_EQ(float_to_bfloat16(from_bits(0x3f818000U)), 0x3f82U) << "tie goes to the even mantissa";
  EXPECT_EQ(float_to_bfloat16(from_bits(0x3f808001U)), 0x3f81U) << "just above the tie rounds up";
  EXPECT_EQ(float_to_bfloat16(from_bits(0x3f807fffU)), 0x3f80U) << "just below the tie rounds down";
  EXPECT_EQ(float_to_bfloat16(from_bits(0x3f81ffffU)), 0x3f82U);
  EXPECT_EQ(float_to_bfloat16(from_bits(0xbf818000U)), 0xbf82U) << "negative ties also go to even";
  // A carry out of the mantissa bumps the exponent: 1.99999988 rounds to 2.
  EXPECT_EQ(float_to_bfloat16(from_bits(0x3fffffffU)), 0x4000U);
}

TEST(Bfloat16, Subnormals) {
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00010000U)), 0x0001U);  // smallest bf16 subnormal
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00008000U)), 0x0000U);  // half of it: tie to even (zero)
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00018000U)), 0x0002U);  // 1.5 units: tie to even (2)
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00008001U)), 0x0001U);
  EXPECT_EQ(float_to_bfloat16(from_bits(0x00000001U)), 0x0000U);  // smallest float subnormal flushes to +0
  EXPECT_EQ(float_to_bfloat16(from_bits(0x80000001U)), 0x8000U);  // ... and keeps its sign
  EXPECT_EQ(float_to_bfloat16(from_bits(0x007fffffU)), 0x0080U);  // largest subnormal rounds to the smallest normal
  EXPECT_GT(bfloat16_to_float(0x0001U), 0.0F);
  EXPECT_LT(bfloat16_to_float(0x0001U), std::numeric_limits<float>::min());
}

TEST(Bfloat16, OverflowAndInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_bfloat16(inf), 0x7f80U);
  EXPECT_EQ(float_to_bfloat16(-inf), 0xff80U);
  EXPECT_EQ(float_to_bfloat16(std::numeric_limits<float>::max()), 0x7f80U) << "FLT_MAX is above bf16 max + ulp/2";
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7f7f8000U)), 0x7f80U) << "tie above the odd max rounds to infinity";
  EXPECT_EQ(float_to_bfloat16(from_bits(0x7f7f7fffU)), 0x7f7fU) << "just below the tie stays finite";
  EXPECT_EQ(float_to_bfloat16(from_bits(0xff7f8000U)), 0xff80U);
  EXPECT_TRUE(std::isinf(bfloat16_to_float(0x7f80U)));
}

TEST(Bfloat16, NanStaysNan) {
  // Signalling NaNs whose payload lives only in the low 16 bits must not truncate to infinity.
  for (const std::uint32_t bits : {0x7fc00000U, 0x7f800001U, 0x7f80ffffU, 0xff800001U, 0x7fffffffU, 0xffc00000U}) {
    SCOPED_TRACE(hex(bits));
    const std::uint16_t h = float_to_bfloat16(from_bits(bits));
    EXPECT_TRUE(is_bf16_nan(h)) << "got " << hex(h);
    EXPECT_EQ(h & 0x8000U, (bits >> 16) & 0x8000U) << "sign kept";
    EXPECT_TRUE(std::isnan(bfloat16_to_float(h)));
  }
}

// Nearest (ties to even) among the finite neighbours of the returned pattern, for positive finite inputs whose
// result is finite.
TEST(Bfloat16, RandomFloatsRoundToNearest) {
  const std::uint64_t seed = 20240611;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint32_t> bits_dist(0, 0x7f7fffffU);
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t bits = bits_dist(rng);
    const float x = from_bits(bits);
    const std::uint16_t h = float_to_bfloat16(x);
    if (h >= 0x7f80U) continue;  // overflowed to infinity: covered above
    const double error = std::fabs(static_cast<double>(x) - bfloat16_to_float(h));
    for (const int step : {-1, 1}) {
      const int neighbour = static_cast<int>(h) + step;
      if (neighbour < 0 || neighbour >= 0x7f80) continue;
      const double other = std::fabs(static_cast<double>(x) - bfloat16_to_float(static_cast<std::uint16_t>(neighbour)));
      ASSERT_LE(error, other) << "x=" << hex(bits) << " -> " << hex(h) << " but " << hex(neighbour) << " is nearer";
      if (error == other) {
        ASSERT_EQ(h & 1U, 0U) << "tie at x=" << hex(bits) << " must pick the even pattern";
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 190000);
}

// ---------------------------------------------------------------------------------------------------------------
// float16
// ---------------------------------------------------------------------------------------------------------------

TEST(Float16, EveryNonNanPatternRoundTripsExactly) {
  int checked = 0;
  for (std::uint32_t h = 0; h <= 0xffffU; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    if (is_fp16_nan(bits)) continue;
    const float value = float16_to_float(bits);
    ASSERT_EQ(float_to_float16(value), bits) << "fp16 " << hex(h) << " -> " << value;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 1023);  // 2 signs x (2^10 - 1) NaN mantissas
}

TEST(Float16, KnownValues) {
  EXPECT_EQ(float_to_float16(1.0F), 0x3c00U);
  EXPECT_EQ(float_to_float16(-2.0F), 0xc000U);
  EXPECT_EQ(float_to_float16(0.5F), 0x3800U);
  EXPECT_EQ(float_to_float16(65504.0F), 0x7bffU);
  EXPECT_EQ(float_to_float16(0.0F), 0x0000U);
  EXPECT_EQ(float_to_float16(-0.0F), 0x8000U);
  EXPECT_EQ(float16_to_float(0x3555U), 0.333251953125F);
  EXPECT_EQ(float16_to_float(0x0400U), std::ldexp(1.0F, -14));  // smallest normal
  EXPECT_EQ(float16_to_float(0xfbffU), -65504.0F);
}

TEST(Float16, RoundsToNearestEven) {
  const float ulp = std::ldexp(1.0F, -10);  // spacing of fp16 in [1, 2)
  EXPECT_EQ(float_to_float16(1.0F + 0.5F * ulp), 0x3c00U) << "tie goes to the even mantissa";
  EXPECT_EQ(float_to_float16(1.0F + 1.5F * ulp), 0x3c02U) << "tie goes to the even mantissa";
  EXPECT_EQ(float_to_float16(1.0F + 0.5F * ulp + std::ldexp(1.0F, -20)), 0x3c01U) << "above the tie rounds up";
  EXPECT_EQ(float_to_float16(1.0F + 0.5F * ulp - std::ldexp(1.0F, -20)), 0x3c00U) << "below the tie rounds down";
  EXPECT_EQ(float_to_float16(-(1.0F + 1.5F * ulp)), 0xbc02U);
  EXPECT_EQ(float_to_float16(2.0F - 0.5F * ulp), 0x4000U) << "a mantissa carry bumps the exponent";
  EXPECT_EQ(float_to_float16(2.0F - 0.75F * ulp), 0x3fffU);
}

TEST(Float16, Subnormals) {
  const float unit = std::ldexp(1.0F, -24);  // smallest fp16 subnormal
  EXPECT_EQ(float_to_float16(unit), 0x0001U);
  EXPECT_EQ(float_to_float16(-unit), 0x8001U);
  EXPECT_EQ(float_to_float16(0.5F * unit), 0x0000U) << "half a unit: tie to even (zero)";
  EXPECT_EQ(float_to_float16(1.5F * unit), 0x0002U) << "1.5 units: tie to even (2)";
  EXPECT_EQ(float_to_float16(2.5F * unit), 0x0002U) << "2.5 units: tie to even (2)";
  EXPECT_EQ(float_to_float16(0.5F * unit * 1.0001F), 0x0001U);
  EXPECT_EQ(float_to_float16(0.25F * unit), 0x0000U);
  EXPECT_EQ(float_to_float16(1023.0F * unit), 0x03ffU) << "largest subnormal";
  EXPECT_EQ(float_to_float16(1023.5F * unit), 0x0400U) << "tie between the largest subnormal and the smallest normal";
  EXPECT_EQ(float_to_float16(1023.25F * unit), 0x03ffU);
  EXPECT_EQ(float_to_float16(std::numeric_limits<float>::denorm_min()), 0x0000U);
  EXPECT_EQ(float16_to_float(0x0001U), unit);
  EXPECT_EQ(float16_to_float(0x8003U), -3.0F * unit);
  EXPECT_EQ(float16_to_float(0x03ffU), 1023.0F * unit);
}

TEST(Float16, OverflowAndInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_float16(65519.996F), 0x7bffU) << "below max + ulp/2 stays finite";
  EXPECT_EQ(float_to_float16(65520.0F), 0x7c00U) << "max + ulp/2 is a tie above an odd mantissa: infinity";
  EXPECT_EQ(float_to_float16(-65520.0F), 0xfc00U);
  EXPECT_EQ(float_to_float16(1.0e6F), 0x7c00U);
  EXPECT_EQ(float_to_float16(std::numeric_limits<float>::max()), 0x7c00U);
  EXPECT_EQ(float_to_float16(inf), 0x7c00U);
  EXPECT_EQ(float_to_float16(-inf), 0xfc00U);
  EXPECT_TRUE(std::isinf(float16_to_float(0x7c00U)));
  EXPECT_LT(float16_to_float(0xfc00U), 0.0F);
}

TEST(Float16, NanStaysNan) {
  for (const std::uint32_t bits : {0x7fc00000U, 0x7f800001U, 0xff800001U, 0x7fffffffU, 0x7f801000U}) {
    SCOPED_TRACE(hex(bits));
    const std::uint16_t h = float_to_float16(from_bits(bits));
    EXPECT_TRUE(is_fp16_nan(h)) << "got " << hex(h);
    EXPECT_EQ(h & 0x8000U, (bits >> 16) & 0x8000U) << "sign kept";
    EXPECT_TRUE(std::isnan(float16_to_float(h)));
  }
  EXPECT_TRUE(std::isnan(float16_to_float(0x7e00U)));
  EXPECT_TRUE(std::isnan(float16_to_float(0x7c01U)));
}

TEST(Float16, RandomFloatsRoundToNearest) {
  const std::uint64_t seed = 77031;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Positive floats from well below the fp16 subnormals (2^-30) to above its range (2^17).
  std::uniform_int_distribution<std::uint32_t> bits_dist(0x30800000U, 0x48000000U);
  int checked = 0;
  int subnormal = 0;
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t bits = bits_dist(rng);
    const float x = from_bits(bits);
    const std::uint16_t h = float_to_float16(x);
    if (h >= 0x7c00U) {
      ASSERT_GE(x, 65520.0F) << "x=" << hex(bits) << " overflowed too early";
      continue;
    }
    ASSERT_LT(x, 65520.0F) << "x=" << hex(bits) << " should overflow to infinity";
    const double error = std::fabs(static_cast<double>(x) - float16_to_float(h));
    for (const int step : {-1, 1}) {
      const int neighbour = static_cast<int>(h) + step;
      if (neighbour < 0 || neighbour >= 0x7c00) continue;
      const double other = std::fabs(static_cast<double>(x) - float16_to_float(static_cast<std::uint16_t>(neighbour)));
      ASSERT_LE(error, other) << "x=" << hex(bits) << " -> " << hex(h) << " but " << hex(neighbour) << " is nearer";
      if (error == other) {
        ASSERT_EQ(h & 1U, 0U) << "tie at x=" << hex(bits) << " must pick the even pattern";
      }
    }
    if (h < 0x0400U) ++subnormal;
    ++checked;
  }
  EXPECT_GT(checked, 150000);
  EXPECT_GT(subnormal, 1000) << "the sample must reach the subnormal range";
}

// ---------------------------------------------------------------------------------------------------------------
// helpers on top of the conversions
// ---------------------------------------------------------------------------------------------------------------

TEST(Dtype, SizesNamesAndParsing) {
  EXPECT_EQ(shadowkv::dtype_size(dtype::float32), 4U);
  EXPECT_EQ(shadowkv::dtype_size(dtype::float16), 2U);
  EXPECT_EQ(shadowkv::dtype_size(dtype::bfloat16), 2U);
  EXPECT_EQ(shadowkv::dtype_name(dtype::float32), "float32");
  EXPECT_EQ(shadowkv::dtype_name(dtype::float16), "float16");
  EXPECT_EQ(shadowkv::dtype_name(dtype::bfloat16), "bfloat16");
  EXPECT_EQ(shadowkv::parse_dtype("fp32"), dtype::float32);
  EXPECT_EQ(shadowkv::parse_dtype("half"), dtype::float16);
  EXPECT_EQ(shadowkv::parse_dtype("bf16"), dtype::bfloat16);
  for (const dtype type : {dtype::float32, dtype::float16, dtype::bfloat16}) {
    EXPECT_EQ(shadowkv::parse_dtype(shadowkv::dtype_name(type)), type);
  }
  EXPECT_THROW((void)shadowkv::parse_dtype("float64"), shadowkv::invalid_argument);
  EXPECT_THROW((void)shadowkv::parse_dtype(""), shadowkv::invalid_argument);
}

TEST(Dtype, RoundToAndElementAccess) {
  const float x = 1.0F + std::ldexp(1.0F, -9) + std::ldexp(1.0F, -12);  // not representable in bf16 nor fp16
  EXPECT_EQ(shadowkv::round_to(dtype::float32, x), x);
  EXPECT_EQ(shadowkv::round_to(dtype::bfloat16, x), bfloat16_to_float(float_to_bfloat16(x)));
  EXPECT_EQ(shadowkv::round_to(dtype::float16, x), float16_to_float(float_to_float16(x)));
  EXPECT_NE(shadowkv::round_to(dtype::bfloat16, x), x);
  EXPECT_NE(shadowkv::round_to(dtype::float16, x), x);

  std::uint16_t half_buffer[3] = {};
  shadowkv::store_element(half_buffer, dtype::float16, 1, x);
  EXPECT_EQ(half_buffer[0], 0U);
  EXPECT_EQ(half_buffer[1], float_to_float16(x));
  EXPECT_EQ(half_buffer[2], 0U);
  EXPECT_EQ(shadowkv::load_element(half_buffer, dtype::float16, 1), shadowkv::round_to(dtype::float16, x));

  std::uint16_t bf_buffer[2] = {};
  shadowkv::store_element(bf_buffer, dtype::bfloat16, 1, -x);
  EXPECT_EQ(bf_buffer[1], float_to_bfloat16(-x));
  EXPECT_EQ(shadowkv::load_element(bf_buffer, dtype::bfloat16, 1), shadowkv::round_to(dtype::bfloat16, -x));

  float f_buffer[2] = {};
  shadowkv::store_element(f_buffer, dtype::float32, 1, x);
  EXPECT_EQ(f_buffer[1], x);
  EXPECT_EQ(shadowkv::load_element(f_buffer, dtype::float32, 1), x);
}

}  // namespace
