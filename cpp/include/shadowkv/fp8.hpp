// The fp8 value format (value_format = fp8_e4m3): one rule, compiled for the host (CPU backend, tests) and for the
// device (CUDA kernels), so that both backends store and read back the same bits.
//
// A (chunk, KV head) run of C x D values is stored as C x D e4m3 codes (OCP FP8 E4M3: bias 7, no infinities,
// largest finite 448) and one float32 scale, amax / 448 (1 when the run is all zeros):
//   code  = e4m3(v / scale), round to nearest even, saturating at +-448;
//   value = decode(code) * scale, then rounded to the store's dtype where it is read.
// The values quantized are the store-dtype values (what a non-fp8 store would hold). The conversions are written out
// in integer and exact float arithmetic (no device intrinsics), so host and device agree bit for bit.
#pragma once

#include <cstdint>

#include "shadowkv/host_device.hpp"

namespace shadowkv::fp8 {

inline constexpr float kE4M3Max = 448.0F;

/// Scale of a run whose largest magnitude is `amax` (>= 0): amax / 448, or 1 for an all-zero run.
SHADOWKV_HOST_DEVICE float scale_for(float amax) { return amax > 0.0F ? amax / kE4M3Max : 1.0F; }

namespace detail {
SHADOWKV_HOST_DEVICE std::uint32_t bits_of(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  return __builtin_bit_cast(std::uint32_t, value);
#endif
}
SHADOWKV_HOST_DEVICE float float_of(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return __builtin_bit_cast(float, bits);
#endif
}
}  // namespace detail

/// float -> e4m3 code: round to nearest even, saturating to +-448 (finite input; NaN maps to the NaN code).
SHADOWKV_HOST_DEVICE std::uint8_t encode_e4m3(float value) {
  const std::uint32_t bits = detail::bits_of(value);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80U);
  const std::uint32_t magnitude = bits & 0x7fffffffU;
  if (magnitude > 0x7f800000U) return static_cast<std::uint8_t>(sign | 0x7fU);  // NaN
  if (magnitude >= 0x43e00000U) return static_cast<std::uint8_t>(sign | 0x7eU);  // >= 448: saturate
  if (magnitude < 0x3c800000U) {
    // Below 2^-6: subnormal codes, one unit = 2^-9. Round |x| * 2^9 (exact) to nearest even by integer rounding of
    // the float's bits: |x| * 2^9 < 8 here, so its mantissa is shifted right by 23 - (exponent - 127) places.
    const std::uint32_t exponent = magnitude >> 23;                  // biased exponent of |x|
    if (exponent < 127 - 9 - 1) return sign;                         // |x| < 2^-10: rounds to 0
    const std::uint32_t mantissa = (magnitude & 0x7fffffU) | 0x800000U;
    const std::uint32_t shift = 23U - (exponent - 127U + 9U);        // 21..24 (|x| * 2^9 in [2^-1, 8))
    const std::uint32_t kept = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1U << shift) - 1U);
    const std::uint32_t half = 1U << (shift - 1U);
    const std::uint32_t rounded = kept + ((rest > half || (rest == half && (kept & 1U) != 0U)) ? 1U : 0U);
    return static_cast<std::uint8_t>(sign | rounded);  // 8 becomes 0x08: the smallest normal, as it should
  }
  // Normal: keep 3 mantissa bits, round to nearest even; a carry moves into the exponent field.
  const std::uint32_t rebased = magnitude - ((127U - 7U) << 23);  // exponent bias 127 -> 7
  const std::uint32_t rest = rebased & 0xfffffU;
  std::uint32_t code = rebased >> 20;
  if (rest > 0x80000U || (rest == 0x80000U && (code & 1U) != 0U)) code += 1U;
  if (code > 0x7eU) code = 0x7eU;  // 448 < |x| < 464 rounded up past 448: saturate
  return static_cast<std::uint8_t>(sign | code);
}

/// e4m3 code -> float (exact).
SHADOWKV_HOST_DEVICE float decode_e4m3(std::uint8_t code) {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80U) << 24;
  const std::uint32_t exponent = (code >> 3) & 0xfU;
  const std::uint32_t mantissa = code & 0x7U;
  if (exponent == 0xfU && mantissa == 0x7U) return detail::float_of(sign | 0x7fc00000U);  // NaN
  if (exponent == 0) {
    const float value = static_cast<float>(mantissa) * 0.001953125F;  // 2^-9
    return sign != 0 ? -value : value;
  }
  return detail::float_of(sign | ((exponent + 120U) << 23) | (mantissa << 20));
}

}  // namespace shadowkv::fp8
