// Element types the store accepts and stores, with exact float <-> bfloat16/float16 conversions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace shadowkv {

/// Floating-point element types of keys, values and queries.
enum class dtype : std::uint8_t { float32, float16, bfloat16 };

/// Bytes per element of `type`.
constexpr std::size_t dtype_size(dtype type) noexcept { return type == dtype::float32 ? 4 : 2; }

/// "float32", "float16" or "bfloat16".
std::string_view dtype_name(dtype type) noexcept;

/// Parses "float32"/"fp32", "float16"/"fp16"/"half", "bfloat16"/"bf16"; throws invalid_argument otherwise.
dtype parse_dtype(std::string_view name);

namespace detail {

inline std::uint32_t float_bits(float value) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float bits_float(std::uint32_t bits) noexcept {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace detail

/// float -> bfloat16 bits, round to nearest even; NaN stays NaN.
inline std::uint16_t float_to_bfloat16(float value) noexcept {
  const std::uint32_t bits = detail::float_bits(value);
  if ((bits & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((bits >> 16) | 0x40U);
  const std::uint32_t rounding = 0x7fffU + ((bits >> 16) & 1U);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

inline float bfloat16_to_float(std::uint16_t bits) noexcept {
  return detail::bits_float(static_cast<std::uint32_t>(bits) << 16);
}

/// float -> IEEE binary16 bits, round to nearest even, with subnormals, overflow to infinity and NaN.
inline std::uint16_t float_to_float16(float value) noexcept {
  const std::uint32_t bits = detail::float_bits(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000U);
  const std::uint32_t magnitude = bits & 0x7fffffffU;
  if (magnitude > 0x7f800000U) return static_cast<std::uint16_t>(sign | 0x7e00U);
  if (magnitude >= 0x477ff000U) return static_cast<std::uint16_t>(sign | 0x7c00U);  // rounds to >= 65520
  if (magnitude < 0x38800000U) {                                                    // result is subnormal or 0
    const float scaled = detail::bits_float(magnitude) * 16777216.0F;  // * 2^24: one unit = 2^-24
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(scaled)));
  }
  const std::uint32_t rebased = magnitude - 0x38000000U;  // exponent bias 127 -> 15
  const std::uint32_t rounding = 0xfffU + ((rebased >> 13) & 1U);
  return static_cast<std::uint16_t>(sign | ((rebased + rounding) >> 13));
}

inline float float16_to_float(std::uint16_t half) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000U) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1fU;
  const std::uint32_t mantissa = half & 0x3ffU;
  if (exponent == 0) {
    const float value = static_cast<float>(mantissa) * 5.9604644775390625e-08F;  // 2^-24
    return sign != 0 ? -value : value;
  }
  if (exponent == 0x1f) return detail::bits_float(sign | 0x7f800000U | (mantissa << 13));
  return detail::bits_float(sign | ((exponent + 112U) << 23) | (mantissa << 13));
}

/// Rounds `value` to the nearest value representable in `type` (identity for float32).
inline float round_to(dtype type, float value) noexcept {
  switch (type) {
    case dtype::bfloat16: return bfloat16_to_float(float_to_bfloat16(value));
    case dtype::float16: return float16_to_float(float_to_float16(value));
    case dtype::float32: break;
  }
  return value;
}

/// Reads element `index` of a buffer of `type` as float.
inline float load_element(const void* data, dtype type, std::int64_t index) noexcept {
  switch (type) {
    case dtype::bfloat16: return bfloat16_to_float(static_cast<const std::uint16_t*>(data)[index]);
    case dtype::float16: return float16_to_float(static_cast<const std::uint16_t*>(data)[index]);
    case dtype::float32: break;
  }
  return static_cast<const float*>(data)[index];
}

/// Writes `value` (rounded to nearest even) as element `index` of a buffer of `type`.
inline void store_element(void* data, dtype type, std::int64_t index, float value) noexcept {
  switch (type) {
    case dtype::bfloat16: static_cast<std::uint16_t*>(data)[index] = float_to_bfloat16(value); return;
    case dtype::float16: static_cast<std::uint16_t*>(data)[index] = float_to_float16(value); return;
    case dtype::float32: break;
  }
  static_cast<float*>(data)[index] = value;
}

}  // namespace shadowkv
