// Loading and storing keys/values of the store's element type (float, __half, __nv_bfloat16) as float, and
// reading caller tensors whose element type is only known at run time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

/// Element `offset` of a caller tensor, as float.
__device__ __forceinline__ float load_any(const void* data, int type, long long offset) {
  switch (type) {
    case element_f16: return __half2float(static_cast<const __half*>(data)[offset]);
    case element_bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[offset]);
    default: return static_cast<const float*>(data)[offset];
  }
}

/// Writes `value` as element `offset` of a caller tensor (rounded to nearest even).
__device__ __forceinline__ void store_any(void* data, int type, long long offset, float value) {
  switch (type) {
    case element_f16: static_cast<__half*>(data)[offset] = __float2half_rn(value); return;
    case element_bf16: static_cast<__nv_bfloat16*>(data)[offset] = __float2bfloat16_rn(value); return;
    default: static_cast<float*>(data)[offset] = value; return;
  }
}

/// Rounds through T (the store's element type).
template <typename T>
__device__ __forceinline__ float round_through(float v) {
  return to_float(from_float<T>(v));
}

/// Integer element `offset` of an int32/int64 tensor (type 32 or 64 in `bits`).
__device__ __forceinline__ long long load_index_any(const void* data, int bits, long long offset) {
  return bits == 32 ? static_cast<long long>(static_cast<const int*>(data)[offset])
                    : static_cast<const long long*>(data)[offset];
}

/// The float64 cos/sin of RoPE for (inv_freq, position, scaling), exactly as the CPU backend: float32 angle,
/// accurately evaluated cos/sin, attention_scaling on cos/sin (divided out when inverting). Separate from the rotation
/// so that one token's coefficients can serve all heads (prompt_kernels.cu).
__device__ __forceinline__ void rope_coefficients(float inv_freq, long long position, float scaling, bool inverse,
                                                  double& cos_a, double& sin_a) {
  const float angle = static_cast<float>(position) * inv_freq;
  double s;
  double c;
  sincos(static_cast<double>(angle), &s, &c);
  if (inverse) {
    cos_a = c / scaling;
    sin_a = -s / scaling;
  } else {
    cos_a = static_cast<double>(static_cast<float>(c) * scaling);
    sin_a = static_cast<double>(static_cast<float>(s) * scaling);
  }
}

/// Rotates (x1, x2) by precomputed coefficients (rope_coefficients), in float64, rounded to float.
__device__ __forceinline__ void rotate_pair(float& x1, float& x2, double cos_a, double sin_a) {
  const double a = x1;
  const double b = x2;
  x1 = static_cast<float>(a * cos_a - b * sin_a);
  x2 = static_cast<float>(b * cos_a + a * sin_a);
}

/// Rotates the pair (x1, x2) of rotary index i to `position` (inverse: un-rotates), exactly as the CPU backend.
__device__ __forceinline__ void rope_pair(float& x1, float& x2, float inv_freq, long long position, float scaling,
                                          bool inverse) {
  double cos_a;
  double sin_a;
  rope_coefficients(inv_freq, position, scaling, inverse, cos_a, sin_a);
  rotate_pair(x1, x2, cos_a, sin_a);
}

/// Dimension paired with rotary index i: (first, second).
__device__ __forceinline__ void rope_dims(const dims& d, int i, int& first, int& second) {
  if (d.rope_interleaved) {
    first = 2 * i;
    second = 2 * i + 1;
  } else {
    first = i;
    second = i + d.rotary_dim / 2;
  }
}

/// Element `dim` of a caller's key row (element type `type`, the row's element `base`, dims `stride` apart) as the
/// store keeps it: post-RoPE, rotated here to `position` when the caller gave it pre-RoPE (`keys_post_rope` false).
__device__ __forceinline__ float caller_key_element(const void* data, int type, long long base, long long stride,
                                                    int dim, const dims& d, const float* inv_freq, long long position,
                                                    bool keys_post_rope) {
  if (keys_post_rope || dim >= d.rotary_dim) return load_any(data, type, base + dim * stride);
  const int pair = d.rope_interleaved ? dim / 2 : dim % (d.rotary_dim / 2);
  int first;
  int second;
  rope_dims(d, pair, first, second);
  float x1 = load_any(data, type, base + first * stride);
  float x2 = load_any(data, type, base + second * stride);
  rope_pair(x1, x2, inv_freq[pair], position, d.attention_scaling, false);
  return dim == first ? x1 : x2;
}

/// 16 bytes of T as floats.
template <typename T>
struct vector16;
template <>
struct vector16<float> {
  static constexpr int elements = 4;
  __device__ __forceinline__ static void to_floats(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  }
};
template <>
struct vector16<__half> {
  static constexpr int elements = 8;
  __device__ __forceinline__ static void to_floats(const uint4& raw, float* out) {
    const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};
template <>
struct vector16<__nv_bfloat16> {
  static constexpr int elements = 8;
  // A bfloat16 is the top half of the float with the same value: one shift or mask per element (the intrinsic
  // __bfloat1622float2 costs three instructions a pair).
  __device__ __forceinline__ static void to_floats(const uint4& raw, float* out) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000U);
    }
  }
};

/// Context chunks of a (sequence, layer) as kernels may index them: clamped to [0, max_chunks].
__device__ __forceinline__ int context_chunks_of(const layer_view* view, const dims& d) {
  const int n = view->context_chunks;
  return n < 0 ? 0 : (n > d.max_chunks ? d.max_chunks : n);
}

}  // namespace shadowkv::cuda
