// Prefill kernels (see prompt_kernels.cuh), one sequence at a time. At S = 122880, Hkv 8, D 128, bf16 a layer's
// prompt is 251 MB of keys and 251 MB of values, so every kernel here is written against its bytes:
//   prepare_prompt_keys  tiles of tokens x heads through shared memory, 16-byte loads and stores, cos/sin once per
//                        (token, pair) for all heads of the tile: reads the keys, writes float keys_pre and T keys_post;
//   landmarks            a warp per (chunk, head), the chunk's keys in registers: reads keys_post once;
//   pick_outliers        a 1024-thread radix select per head (O(chunks), not O(count * chunks));
//   scatter_prompt       a thread per 16-byte vector: values to the chunk-major staging buffer, keys read only for
//                        outlier chunks and the local window;
//   Gram matrix          split-K pointers for one batched cuBLAS SGEMM, and the float64 sum of its partials.
// The arithmetic that decides selections (means, cosines, the outlier order) is the CPU backend's: see each kernel.
#include <cfloat>
#include <climits>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/chunk_centroids_warp.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/ordered_compaction.cuh"
#include "cuda_check.hpp"
#include "prompt_kernels.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kPrepareThreads = 256;
constexpr int kPrepareTileFloats = 4096;   // one tile's keys as float (two copies: 32 KiB of shared memory)
constexpr int kPrepareMaxTileTokens = 16;
constexpr int kLandmarkWarps = 8;          // (chunk, head) items per CTA: with Hkv 8, one chunk's 8 rows
constexpr int kLandmarkGroup = 8;          // keys of a chunk in registers at once
constexpr int kPickThreads = 1024;         // one CTA per head: only Hkv CTAs run, so make each wide
constexpr int kPickBins = 256;             // 8-bit radix digits
constexpr int kScatterThreads = 256;
constexpr int kGramThreads = 256;

// Gram split-K: batch entries for about this many waves of one CTA per SM (fewer waves leave a partly idle last
// wave: the cost of the split is only the partials' memory and a float64 sum over them).
constexpr int kGramWaves = 6;
constexpr int kGramMinSliceRows = 512;  // shorter slices spend more on each CTA's prologue than they gain

// --- prepare_prompt_keys ------------------------------------------------------------------------------------------
// A CTA takes a tile of `tile_tokens` tokens x `tile_heads` heads (whole rows of D): 16-byte loads of the caller's
// keys into shared memory as float, the rotation of each (token, pair) with cos/sin evaluated once for all the
// tile's heads (the float64 sincos was the kernel's main arithmetic when every (token, head, dim) computed its own),
// then 16-byte stores of both outputs, whose tile rows are contiguous runs of tile_heads * D elements.

/// 16 bytes of a caller tensor of runtime element type `type` as floats (4 or 8 of them).
__device__ __forceinline__ int vector_to_floats(const uint4& raw, int type, float* out) {
  switch (type) {
    case element_f16: vector16<__half>::to_floats(raw, out); return 8;
    case element_bf16: vector16<__nv_bfloat16>::to_floats(raw, out); return 8;
    default: vector16<float>::to_floats(raw, out); return 4;
  }
}

template <typename T>
__global__ void __launch_bounds__(kPrepareThreads)
    prepare_prompt_keys_kernel(dims d, strided_tensor keys, strided_tensor positions, int positions_bits, int row,
                               int len, int tile_tokens, int tile_heads, bool vector_source, bool post_rope,
                               const float* inv_freq, float* keys_pre, T* keys_post, long long* positions_out,
                               key_stats* stats) {
  extern __shared__ __align__(16) float prepare_shared[];
  const int head_dim = d.head_dim;
  const int run = tile_heads * head_dim;  // floats of one token's row in the tile
  float* original = prepare_shared;       // [tile_tokens][run]: the keys as given
  float* rotated = original + tile_tokens * run;
  auto* token_position = reinterpret_cast<long long*>(rotated + tile_tokens * run);
  const int t0 = blockIdx.x * tile_tokens;
  const int h0 = blockIdx.y * tile_heads;
  const int tokens = min(tile_tokens, len - t0);
  const int heads = min(tile_heads, d.kv_heads - h0);
  const int used = heads * head_dim;  // floats of a token's row that this CTA owns

  for (int i = threadIdx.x; i < tokens; i += blockDim.x) {
    const long long position = positions.data == nullptr
                                   ? t0 + i
                                   : load_index_any(positions.data, positions_bits,
                                                    row * positions.stride[0] + (t0 + i) * positions.stride[1]);
    token_position[i] = position;
    if (blockIdx.y == 0) positions_out[t0 + i] = position;
  }
  if (vector_source) {
    const int bytes = keys.type == element_f32 ? 4 : 2;
    const int per_vector = 16 / bytes;
    const int per_row = head_dim / per_vector;
    for (int i = threadIdx.x; i < tokens * heads * per_row; i += blockDim.x) {
      const int v = i % per_row;
      const int rest = i / per_row;
      const int hh = rest % heads;
      const int tt = rest / heads;
      const long long offset =
          row * keys.stride[0] + (t0 + tt) * keys.stride[1] + (h0 + hh) * keys.stride[2] + v * per_vector;
      const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const char*>(keys.data) + offset * bytes);
      float values[8];
      vector_to_floats(raw, keys.type, values);
      float4* out = reinterpret_cast<float4*>(original + tt * run + hh * head_dim + v * per_vector);
      out[0] = make_float4(values[0], values[1], values[2], values[3]);
      if (per_vector == 8) out[1] = make_float4(values[4], values[5], values[6], values[7]);
    }
  } else {
    for (int i = threadIdx.x; i < tokens * used; i += blockDim.x) {
      const int tt = i / used;
      const int e = i - tt * used;
      const int hh = e / head_dim;
      const int dim = e - hh * head_dim;
      original[tt * run + e] = load_any(keys.data, keys.type,
                                        row * keys.stride[0] + (t0 + tt) * keys.stride[1] +
                                            (h0 + hh) * keys.stride[2] + dim * keys.stride[3]);
    }
  }
  __syncthreads();

  const int half = d.rotary_dim / 2;
  for (int task = threadIdx.x; task < tokens * half; task += blockDim.x) {
    const int tt = task / half;
    const int pair = task - tt * half;
    double cos_a;
    double sin_a;
    rope_coefficients(inv_freq[pair], token_position[tt], d.attention_scaling, post_rope, cos_a, sin_a);
    int first;
    int second;
    rope_dims(d, pair, first, second);
    for (int hh = 0; hh < heads; ++hh) {
      const int base = tt * run + hh * head_dim;
      float x1 = original[base + first];
      float x2 = original[base + second];
      rotate_pair(x1, x2, cos_a, sin_a);
      rotated[base + first] = x1;
      rotated[base + second] = x2;
    }
  }
  __syncthreads();

  // Pre-RoPE is the rotated copy when the caller's keys are post-RoPE, and the other way round; dims past
  // rotary_dim are the keys as given in both (their `rotated` entries were never written).
  const long long width = static_cast<long long>(d.kv_heads) * head_dim;
  float largest = 0.0F;  // of this thread's pre-RoPE keys (the ones the factorisation reads)
  for (int i = threadIdx.x; i < tokens * (used / 4); i += blockDim.x) {
    const int tt = i / (used / 4);
    const int e = (i - tt * (used / 4)) * 4;
    const int rotary_here = post_rope ? d.rotary_dim - e % head_dim : 0;  // leading dims of the four from `rotated`
    const float4 given = *reinterpret_cast<const float4*>(original + tt * run + e);
    float4 value = given;
    if (rotary_here > 0) {
      const float4 turned = *reinterpret_cast<const float4*>(rotated + tt * run + e);
      value.x = turned.x;
      value.y = rotary_here > 1 ? turned.y : given.y;
      value.z = rotary_here > 2 ? turned.z : given.z;
      value.w = rotary_here > 3 ? turned.w : given.w;
    }
    *reinterpret_cast<float4*>(keys_pre + (t0 + tt) * width + static_cast<long long>(h0) * head_dim + e) = value;
    // The inputs are finite (the store checks them first), so a non-finite key here is RoPE's overflow.
    if (!(isfinite(value.x) && isfinite(value.y) && isfinite(value.z) && isfinite(value.w))) stats->overflowed = 1;
    largest = fmaxf(largest, fmaxf(fmaxf(fabsf(value.x), fabsf(value.y)), fmaxf(fabsf(value.z), fabsf(value.w))));
  }
  // Non-negative floats order as their bits: one atomicMax a warp.
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffU, largest, offset));
  if ((threadIdx.x & 31) == 0 && largest > 0.0F) atomicMax(&stats->largest_bits, __float_as_uint(largest));
  constexpr int kOut = vector16<T>::elements;
  for (int i = threadIdx.x; i < tokens * (used / kOut); i += blockDim.x) {
    const int tt = i / (used / kOut);
    const int e = (i - tt * (used / kOut)) * kOut;
    const int rotary_here = post_rope ? 0 : d.rotary_dim - e % head_dim;
    __align__(16) T out[kOut];
#pragma unroll
    for (int k = 0; k < kOut; ++k) {
      out[k] = from_float<T>((k < rotary_here ? rotated : original)[tt * run + e + k]);
      if (!isfinite(to_float(out[k]))) stats->overflowed = 1;  // overflowed in the rotation or in the rounding to T
    }
    *reinterpret_cast<uint4*>(keys_post + (t0 + tt) * width + static_cast<long long>(h0) * head_dim + e) =
        *reinterpret_cast<const uint4*>(out);
  }
}

// --- keys scaled for the Gram matrix --------------------------------------------------------------------------------
// The CPU backend's rule (cpp/src/factorization.cpp, rescaled_for_gram): when the largest magnitude is outside
// [2^-41, 2^40) the float32 Gram matrix could overflow or lose its small entries, so the keys are scaled by 2^-e
// (exact), e = that magnitude's binary exponent (frexp). Here the pre-RoPE keys are scaled in place (they feed the
// factorisation and A = K·Bᵀ only), and A is scaled back by 2^e afterwards, also exact: A equals the product of the
// keys as given but for entries 2^126 times smaller than the largest, which become subnormal on the way.

__device__ __forceinline__ int gram_exponent(unsigned largest_bits) {
  const float largest = __uint_as_float(largest_bits);
  if (largest == 0.0F) return 0;
  int exponent = 0;
  (void)frexpf(largest, &exponent);
  return exponent >= -40 && exponent <= 40 ? 0 : exponent;
}

__global__ void scale_keys_for_gram_kernel(float* keys, long long count, key_stats* stats) {
  const int exponent = gram_exponent(stats->largest_bits);
  if (blockIdx.x == 0 && threadIdx.x == 0) stats->gram_exponent = exponent;
  if (exponent == 0) return;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    keys[i] = ldexpf(keys[i], -exponent);
  }
}

__global__ void unscale_coefficients_kernel(float* coefficients, long long count, const key_stats* stats) {
  const int exponent = stats->gram_exponent;
  if (exponent == 0) return;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    coefficients[i] = ldexpf(coefficients[i], exponent);
  }
}

// --- landmarks ----------------------------------------------------------------------------------------------------
// A warp per (chunk, head); lane l owns dims l, l + 32, ... (kDims of them), so each key row is read by coalesced
// warp loads and a group of kLandmarkGroup keys (all of a C = 8 chunk) is in flight at once, kept in registers for
// the cosines. The mean is each dim's float64 sum over the chunk's keys in ascending order (the CPU's sum, exactly),
// the dot products and norms are float64 as before; only their summation order across dims differs (a shuffle
// tree), as it did with the old block reduction.

/// One halving exchange of warp_sum_pairs: lanes with bit 2 * kKeep set keep the upper kKeep values, the others the
/// lower ones, each adding its partner's copy.
template <int kKeep>
__device__ __forceinline__ void halve_across_lanes(double (&v)[2 * kLandmarkGroup], int lane) {
  constexpr int kOffset = 2 * kKeep;
  const bool upper = (lane & kOffset) != 0;
#pragma unroll
  for (int k = 0; k < kKeep; ++k) {
    const double low = v[k];
    const double high = v[k + kKeep];
    v[k] = (upper ? high : low) + __shfl_xor_sync(0xffffffffU, upper ? low : high, kOffset);
  }
}

/// Sums v[0..16) over the warp with 18 shuffles instead of 80: three halving exchanges leave each lane with two of
/// the 16 values summed over 8 lanes, two more steps finish them. v[2k], v[2k + 1] end up (in v[0], v[1]) on the
/// lanes whose bits 4..2 spell k (key_of_lane).
__device__ __forceinline__ void warp_sum_pairs(double (&v)[2 * kLandmarkGroup], int lane) {
  static_assert(kLandmarkGroup == 8, "three halving steps take 16 values to 2");
  halve_across_lanes<8>(v, lane);
  halve_across_lanes<4>(v, lane);
  halve_across_lanes<2>(v, lane);
#pragma unroll
  for (int offset = 2; offset > 0; offset /= 2) {
    v[0] += __shfl_xor_sync(0xffffffffU, v[0], offset);
    v[1] += __shfl_xor_sync(0xffffffffU, v[1], offset);
  }
}

__device__ __forceinline__ int key_of_lane(int lane) {
  return (((lane >> 4) & 1) << 2) | (((lane >> 3) & 1) << 1) | ((lane >> 2) & 1);
}

__device__ __forceinline__ double warp_sum(double value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffU, value, offset);
  return value;
}

template <typename T, int kDims>
__global__ void __launch_bounds__(kLandmarkWarps * 32)
    landmarks_kernel(dims d, const T* keys_post, T* landmarks, float* min_cosine, int chunks) {
  const int lane = threadIdx.x % 32;
  const long long item = static_cast<long long>(blockIdx.x) * kLandmarkWarps + threadIdx.x / 32;
  if (item >= static_cast<long long>(chunks) * d.kv_heads) return;  // whole warps
  const int c = static_cast<int>(item / d.kv_heads);
  const int h = static_cast<int>(item - static_cast<long long>(c) * d.kv_heads);
  const long long width = static_cast<long long>(d.kv_heads) * d.head_dim;
  const T* chunk_keys = keys_post + static_cast<long long>(c) * d.chunk * width + static_cast<long long>(h) * d.head_dim;
  const int groups = (d.chunk + kLandmarkGroup - 1) / kLandmarkGroup;

  float key[kLandmarkGroup][kDims];
  auto load_group = [&](int g) {
#pragma unroll
    for (int i = 0; i < kLandmarkGroup; ++i) {
      const int k = g * kLandmarkGroup + i;
#pragma unroll
      for (int j = 0; j < kDims; ++j) {
        const int dim = lane + 32 * j;
        key[i][j] = k < d.chunk && dim < d.head_dim ? to_float(chunk_keys[k * width + dim]) : 0.0F;
      }
    }
  };

  double sum[kDims];
#pragma unroll
  for (int j = 0; j < kDims; ++j) sum[j] = 0.0;
  for (int g = 0; g < groups; ++g) {
    load_group(g);
#pragma unroll
    for (int i = 0; i < kLandmarkGroup; ++i) {
      if (g * kLandmarkGroup + i < d.chunk) {
#pragma unroll
        for (int j = 0; j < kDims; ++j) sum[j] += key[i][j];
      }
    }
  }
  float mean[kDims];
  double own = 0.0;
  T* landmark = landmarks + (static_cast<long long>(h) * d.max_chunks + c) * d.head_dim;
#pragma unroll
  for (int j = 0; j < kDims; ++j) {
    const int dim = lane + 32 * j;
    mean[j] = dim < d.head_dim ? round_through<T>(static_cast<float>(sum[j] / d.chunk)) : 0.0F;
    if (dim < d.head_dim) landmark[dim] = from_float<T>(mean[j]);
    own += static_cast<double>(mean[j]) * mean[j];
  }
  const double landmark_norm = sqrt(warp_sum(own));

  double lowest = DBL_MAX;
  for (int g = 0; g < groups; ++g) {
    if (groups > 1) load_group(g);  // one group (C <= 8): still in registers
    double part[2 * kLandmarkGroup];
#pragma unroll
    for (int i = 0; i < kLandmarkGroup; ++i) {
      double dot = 0.0;
      double norm = 0.0;
#pragma unroll
      for (int j = 0; j < kDims; ++j) {
        dot += static_cast<double>(mean[j]) * key[i][j];
        norm += static_cast<double>(key[i][j]) * key[i][j];
      }
      part[2 * i] = dot;
      part[2 * i + 1] = norm;
    }
    warp_sum_pairs(part, lane);
    if (g * kLandmarkGroup + key_of_lane(lane) < d.chunk) {
      lowest = fmin(lowest, part[0] / fmax(landmark_norm * sqrt(part[1]), 1e-30));
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) lowest = fmin(lowest, __shfl_xor_sync(0xffffffffU, lowest, offset));
  if (lane == 0) min_cosine[static_cast<long long>(h) * chunks + c] = static_cast<float>(lowest);
}

// --- pick_outliers ------------------------------------------------------------------------------------------------
// One CTA of 1024 threads per head takes the `count` smallest (min_cosine, id) pairs in lexicographic order — the
// old kernel's rule (count rounds of an argmin, ties to the smaller id) and the CPU's (stable sort ascending) — by an
// MSB-first radix select over order-preserving keys (four 8-bit digits, shared histograms with warp-aggregated
// atomics: the cosines share a few exponents, so most of a warp hits one bin), then an ordered compaction that takes
// everything below the threshold key and the first ties in ascending id, writing the ids ascending.

/// Unsigned key with the order of the float comparison `<`: -0 and +0 are one key (they compare equal, so the id
/// decides, as before); NaN sorts after every number (a NaN never compared below anything). min_cosine is never NaN
/// (fmin drops NaN cosines), so the last rule only keeps the kernel defined.
__device__ __forceinline__ unsigned ascending_key(float value) {
  if (value != value) return 0xffffffffU;
  const unsigned bits = value == 0.0F ? 0U : __float_as_uint(value);
  return (bits & 0x80000000U) != 0 ? ~bits : bits | 0x80000000U;
}

__global__ void __launch_bounds__(kPickThreads)
    pick_outliers_kernel(dims d, const float* min_cosine, int chunks, int count, std::uint8_t* is_outlier,
                         int* outlier_ids) {
  static_assert(kPickThreads == kOrderedPassThreads, "ordered_pass (ordered_compaction.cuh) needs 1024 threads");
  __shared__ unsigned histogram[kPickBins];
  __shared__ unsigned found[3];  // digit, items below its bin, items in its bin
  __shared__ unsigned warp_totals[2 * kOrderedPassWarps];
  const int h = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  std::uint8_t* flags = is_outlier + static_cast<long long>(h) * d.max_chunks;
  const float* values = min_cosine + static_cast<long long>(h) * chunks;
  int* ids = outlier_ids + static_cast<long long>(h) * d.max_outliers;
  for (int c = chunks + threadIdx.x; c < d.max_chunks; c += kPickThreads) flags[c] = 0;

  // Taken: (key & mask) < prefix, or == prefix for the first need_ties in id order. With nothing to decide
  // (take 0 or every chunk) mask 0 makes every chunk a tie.
  const int take = max(0, min(count, chunks));
  unsigned prefix = 0;
  unsigned mask = 0;
  unsigned need_ties = static_cast<unsigned>(take);
  if (take > 0 && take < chunks) {
    unsigned remaining = static_cast<unsigned>(take);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < kPickBins; i += kPickThreads) histogram[i] = 0;
      __syncthreads();
      for (int base = 0; base < chunks; base += kPickThreads) {  // the same trip count for every thread
        const int c = base + static_cast<int>(threadIdx.x);
        const unsigned key = c < chunks ? ascending_key(values[c]) : 0U;
        const bool counted = c < chunks && (key & mask) == prefix;
        const unsigned bin = counted ? (key >> shift) & (kPickBins - 1) : kPickBins;
        const unsigned peers = __match_any_sync(0xffffffffU, bin);
        if (counted && lane == __ffs(peers) - 1) atomicAdd(&histogram[bin], static_cast<unsigned>(__popc(peers)));
      }
      __syncthreads();
      if (warp == 0) {
        // Lane l owns bins 8l..8l+7: the bin where the count from the bottom reaches `remaining`.
        constexpr int kPerLane = kPickBins / 32;
        unsigned bins[kPerLane];
        unsigned local = 0;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          bins[k] = histogram[kPerLane * lane + k];
          local += bins[k];
        }
        unsigned inclusive = local;
#pragma unroll
        for (int offset = 1; offset < 32; offset *= 2) {
          const unsigned other = __shfl_up_sync(0xffffffffU, inclusive, offset);
          if (lane >= offset) inclusive += other;
        }
        unsigned before = inclusive - local;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          if (before < remaining && before + bins[k] >= remaining) {
            found[0] = static_cast<unsigned>(kPerLane * lane + k);
            found[1] = before;
            found[2] = bins[k];
          }
          before += bins[k];
        }
      }
      __syncthreads();
      prefix |= found[0] << shift;
      mask |= static_cast<unsigned>(kPickBins - 1) << shift;
      remaining -= found[1];
      if (found[2] == remaining) break;  // the whole bin is taken: no tie to break below this digit
    }
    need_ties = remaining;
  }

  // Ordered compaction (ordered_compaction.cuh): the chunks strictly below the k-th key, then the first need_ties of
  // its ties in ascending id, written ascending; every chunk's flag set.
  auto classify = [&](int c) -> unsigned {
    const unsigned key = ascending_key(values[c]) & mask;
    return (key < prefix ? 1U : 0U) | (key == prefix ? 2U : 0U);
  };
  ordered_pass(chunks, warp_totals, classify, [&](int c, unsigned f, unsigned below_before, unsigned ties_before) {
    const bool taken = (f & 1U) != 0 || ((f & 2U) != 0 && ties_before < need_ties);
    flags[c] = taken ? 1 : 0;
    if (taken) ids[below_before + min(ties_before, need_ties)] = c;
  });
}

// --- scatter_prompt -----------------------------------------------------------------------------------------------
// A thread per 16-byte vector of one (token, head) row: grid (len * D / elements, Hkv). Every context token's value
// goes to the chunk-major staging buffer (a (C, Hkv) transpose of rows: reads and writes are whole rows of D);
// outlier chunks (is_outlier, written by pick_outliers just before) and the local window also get keys and values
// into their exact arrays; keys_post is read only for those rows.

template <typename T>
__global__ void __launch_bounds__(kScatterThreads)
    scatter_prompt_kernel(dims d, const T* keys_post, strided_tensor values, bool vector_values, int row, int len,
                          int chunks, int outliers, const int* outlier_ids, const long long* positions,
                          layer_view view, T* value_staging) {
  constexpr int kElements = vector16<T>::elements;
  const int per_row = d.head_dim / kElements;
  const int h = blockIdx.y;
  const long long index = static_cast<long long>(blockIdx.x) * kScatterThreads + threadIdx.x;
  if (index >= static_cast<long long>(len) * per_row) return;
  const int t = static_cast<int>(index / per_row);
  const int dim = static_cast<int>(index - static_cast<long long>(t) * per_row) * kElements;
  const long long source = row * values.stride[0] + t * values.stride[1] + h * values.stride[2];
  uint4 value;
  if (vector_values) {
    value = *reinterpret_cast<const uint4*>(static_cast<const T*>(values.data) + source + dim);
  } else {
    __align__(16) T elements[kElements];
#pragma unroll
    for (int k = 0; k < kElements; ++k) {
      elements[k] = from_float<T>(load_any(values.data, values.type, source + (dim + k) * values.stride[3]));
    }
    value = *reinterpret_cast<const uint4*>(elements);
  }
  const long long width = static_cast<long long>(d.kv_heads) * d.head_dim;
  const long long key_at = t * width + static_cast<long long>(h) * d.head_dim + dim;
  const int context_tokens = chunks * d.chunk;
  if (t < context_tokens) {
    const int c = t / d.chunk;
    const int i = t - c * d.chunk;
    *reinterpret_cast<uint4*>(value_staging + ((static_cast<long long>(c) * d.kv_heads + h) * d.chunk + i) * d.head_dim +
                              dim) = value;
    if (h == 0 && dim == 0) view.context_positions[t] = positions[t];
    if (view.is_outlier[static_cast<long long>(h) * d.max_chunks + c] == 0) return;
    // Its rank among the head's outliers: ids are ascending.
    const int* ids = outlier_ids + static_cast<long long>(h) * d.max_outliers;
    int lo = 0;
    int hi = outliers;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (ids[mid] < c) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    if (lo < outliers && ids[lo] == c) {
      const long long out_row = (static_cast<long long>(h) * d.max_outliers + lo) * d.chunk + i;
      *reinterpret_cast<uint4*>(static_cast<T*>(view.outlier_keys) + out_row * d.head_dim + dim) =
          *reinterpret_cast<const uint4*>(keys_post + key_at);
      *reinterpret_cast<uint4*>(static_cast<T*>(view.outlier_values) + out_row * d.head_dim + dim) = value;
    }
  } else {
    const int local = t - context_tokens;
    const long long exact_row = static_cast<long long>(h) * (d.local_capacity + d.window) + local;
    *reinterpret_cast<uint4*>(static_cast<T*>(view.exact_keys) + exact_row * d.head_dim + dim) =
        *reinterpret_cast<const uint4*>(keys_post + key_at);
    *reinterpret_cast<uint4*>(static_cast<T*>(view.exact_values) + exact_row * d.head_dim + dim) = value;
    if (h == 0 && dim == 0) view.exact_positions[local] = positions[t];
  }
}

// --- Gram matrix, split-K ----------------------------------------------------------------------------------------

__global__ void gram_block_pointers_kernel(const float* keys, int n, gram_split split, float* partials,
                                           const float** a, const float** b, float** c) {
  const long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= static_cast<long long>(split.slices) * split.pairs) return;
  const int slice = static_cast<int>(e / split.pairs);
  const int pair = static_cast<int>(e - static_cast<long long>(slice) * split.pairs);
  // pair = i (i + 1) / 2 + j with j <= i: the lower block triangle row by row.
  int i = static_cast<int>((sqrt(8.0 * pair + 1.0) - 1.0) / 2.0);
  while (i * (i + 1) / 2 > pair) --i;
  while ((i + 1) * (i + 2) / 2 <= pair) ++i;
  const int j = pair - i * (i + 1) / 2;
  const float* rows = keys + static_cast<long long>(slice) * split.slice_rows * n;
  a[e] = rows + static_cast<long long>(i) * split.block;
  b[e] = rows + static_cast<long long>(j) * split.block;
  c[e] = partials + static_cast<long long>(slice) * n * n + static_cast<long long>(j) * split.block * n +
         static_cast<long long>(i) * split.block;
}

// Grid (ceil(n / 256), n): column `col`, rows >= col (the lower triangle, where every partial was computed); each
// element is written to both triangles.
__global__ void sum_gram_partials_kernel(const float* partials, int slices, const float* tail, int tail_rows, int n,
                                         double* gram) {
  const int col = blockIdx.y;
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= n || row < col) return;
  const long long plane = static_cast<long long>(n) * n;
  const long long at = static_cast<long long>(col) * n + row;
  double sum = 0.0;
#pragma unroll 4
  for (int p = 0; p < slices; ++p) sum += static_cast<double>(partials[p * plane + at]);
  for (int r = 0; r < tail_rows; ++r) {
    const float* key = tail + static_cast<long long>(r) * n;
    sum += static_cast<double>(key[row]) * static_cast<double>(key[col]);
  }
  gram[at] = sum;
  gram[static_cast<long long>(row) * n + col] = sum;
}

__global__ void basis_from_vectors_kernel(const double* vectors, int n, int rank, bool reversed, bool rows,
                                          float* basis) {
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(rank) * n) return;
  const int i = static_cast<int>(index / n);
  const int j = static_cast<int>(index % n);
  const int column = reversed ? rank - 1 - i : i;
  const long long source = rows ? static_cast<long long>(j) * n + column : static_cast<long long>(column) * n + j;
  basis[index] = static_cast<float>(vectors[source]);
}

__global__ void keys_to_double_kernel(const float* keys, int rows, int cols, bool column_major, double* out) {
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(rows) * cols) return;
  const long long r = index / cols;
  const long long c = index % cols;
  out[column_major ? r + c * rows : index] = static_cast<double>(keys[index]);
}

__global__ void set_prefill_counters_kernel(layer_view* view, int prompt_len, int context_chunks, int outlier_chunks,
                                            int local_len, const long long* positions, int len) {
  view->prompt_len = prompt_len;
  view->context_chunks = context_chunks;
  view->outlier_chunks = outlier_chunks;
  view->local_len = local_len;
  view->generated_exact_len = 0;
  view->ring_head = 0;
  view->last_position = positions[len - 1];
  view->journal_head = 0;
  view->journal_count = 0;
}

unsigned blocks_for(long long count, int threads) { return static_cast<unsigned>((count + threads - 1) / threads); }

constexpr int kMaxGramColumns = 65535;  // the sum's grid.y

// The vector kernels move whole 16-byte vectors of a head's row: D * sizeof(T) a multiple of 16 for every T, and at
// most 8 dims per lane in the landmarks. Every head_dim of shape_support.hpp qualifies.
void check_vector_rows(const dims& d) {
  SHADOWKV_EXPECTS(d.head_dim % 16 == 0 && d.head_dim >= 16 && d.head_dim <= 256,
                   "the prompt kernels take head_dim a multiple of 16 in [16, 256], got ", d.head_dim);
}

// Whether every (row, t, h) row of D elements of a caller tensor [B, S, H, D] is a run of whole, aligned 16-byte
// vectors (unit stride over D, every row start a multiple of 16 bytes).
bool rows_are_vectors(const strided_tensor& t, int row, int head_dim) {
  const long long per_vector = t.type == element_f32 ? 4 : 8;
  return t.stride[3] == 1 && head_dim % per_vector == 0 && (row * t.stride[0]) % per_vector == 0 &&
         t.stride[1] % per_vector == 0 && t.stride[2] % per_vector == 0 &&
         reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0;
}


constexpr int kCentroidWarps = 8;  // (chunk, head) items per CTA of chunk_centroids_kernel

/// Element d of key i of one (chunk, head) of the prompt's stored keys [S, Hkv*D].
template <typename T>
struct prompt_chunk_keys {
  const T* first;  ///< the chunk's first key of the head
  long long width;
  SHADOWKV_HOST_DEVICE float operator()(int i, int d) const { return to_float(first[i * width + d]); }
};

template <typename T>
__global__ void __launch_bounds__(kCentroidWarps * 32)
    chunk_centroids_kernel(dims d, const T* keys_post, int chunks, std::uint8_t* codes, float* scales,
                           std::uint8_t* counts) {
  extern __shared__ double centroid_work[];  // [kCentroidWarps][2 * D]
  const int warp = static_cast<int>(threadIdx.x / 32);
  const long long item = static_cast<long long>(blockIdx.x) * kCentroidWarps + warp;
  if (item >= static_cast<long long>(chunks) * d.kv_heads) return;  // the whole warp
  const int c = static_cast<int>(item / d.kv_heads);
  const int h = static_cast<int>(item % d.kv_heads);
  const long long width = static_cast<long long>(d.kv_heads) * d.head_dim;
  const prompt_chunk_keys<T> key{keys_post + static_cast<long long>(c) * d.chunk * width + h * d.head_dim, width};
  const long long at = static_cast<long long>(h) * d.max_chunks + c;
  two_means_warp(key, d.chunk, d.head_dim, centroid_work + warp * 2 * d.head_dim,
                 centroid_target{codes + at * 2 * d.head_dim, scales + at * 2, counts + at});
}

}  // namespace

void launch_prepare_prompt_keys(const dims& d, int kv_type, strided_tensor keys, strided_tensor positions,
                                int positions_bits, int row, int len, bool post_rope, const float* inv_freq,
                                float* keys_pre, void* keys_post, long long* positions_out, key_stats* stats,
                                cudaStream_t stream) {
  check_vector_rows(d);
  SHADOWKV_EXPECTS(stats != nullptr, "prepare_prompt_keys: null key_stats");
  SHADOWKV_CUDA_TRY(cudaMemsetAsync(stats, 0, sizeof(key_stats), stream));
  if (len == 0) return;
  const int tile_heads = std::min(d.kv_heads, std::max(1, kPrepareTileFloats / d.head_dim));
  const int tile_tokens = std::clamp(kPrepareTileFloats / (tile_heads * d.head_dim), 1, kPrepareMaxTileTokens);
  const std::size_t shared =
      2 * static_cast<std::size_t>(tile_tokens) * tile_heads * d.head_dim * sizeof(float) + tile_tokens * sizeof(long long);
  const dim3 grid(blocks_for(len, tile_tokens), blocks_for(d.kv_heads, tile_heads));
  const bool vector_source = rows_are_vectors(keys, row, d.head_dim);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    prepare_prompt_keys_kernel<T><<<grid, kPrepareThreads, shared, stream>>>(
        d, keys, positions, positions_bits, row, len, tile_tokens, tile_heads, vector_source, post_rope, inv_freq,
        keys_pre, static_cast<T*>(keys_post), positions_out, stats);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_landmarks(const dims& d, int kv_type, const void* keys_post, int chunks, void* landmarks,
                      float* min_cosine, cudaStream_t stream) {
  check_vector_rows(d);
  if (chunks == 0) return;
  const unsigned grid = blocks_for(static_cast<long long>(chunks) * d.kv_heads, kLandmarkWarps);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto launch = [&](auto kernel) {
      kernel<<<grid, kLandmarkWarps * 32, 0, stream>>>(d, static_cast<const T*>(keys_post), static_cast<T*>(landmarks),
                                                       min_cosine, chunks);
    };
    // Dims per lane: ceil(D / 32), rounded up to an instantiated count.
    if (d.head_dim <= 64) {
      launch(landmarks_kernel<T, 2>);
    } else if (d.head_dim <= 96) {
      launch(landmarks_kernel<T, 3>);
    } else if (d.head_dim <= 128) {
      launch(landmarks_kernel<T, 4>);
    } else {
      launch(landmarks_kernel<T, 8>);
    }
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_chunk_centroids(const dims& d, int kv_type, const void* keys_post, int chunks, const layer_view& view,
                            cudaStream_t stream) {
  SHADOWKV_EXPECTS(d.chunk >= 1 && d.chunk <= rules::kMaxCentroidChunk, "two-centroid scores: chunk_size ", d.chunk,
                   " is not in [1, ", rules::kMaxCentroidChunk, "]");
  if (chunks == 0) return;
  const std::size_t shared = static_cast<std::size_t>(kCentroidWarps) * 2 * d.head_dim * sizeof(double);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    chunk_centroids_kernel<T><<<blocks_for(static_cast<long long>(chunks) * d.kv_heads, kCentroidWarps),
                                kCentroidWarps * 32, shared, stream>>>(d, static_cast<const T*>(keys_post), chunks,
                                                                       view.centroid_codes, view.centroid_scales,
                                                                       view.first_counts);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_pick_outliers(const dims& d, const float* min_cosine, int chunks, int count, std::uint8_t* is_outlier,
                          int* outlier_ids, cudaStream_t stream) {
  SHADOWKV_EXPECTS(count <= d.max_outliers, "launch_pick_outliers: count ", count, " exceeds max_outliers ",
                   d.max_outliers);
  pick_outliers_kernel<<<d.kv_heads, kPickThreads, 0, stream>>>(d, min_cosine, chunks, count, is_outlier,
                                                                outlier_ids);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_scatter_prompt(const dims& d, int kv_type, const void* keys_post, strided_tensor values, int row,
                           int len, int chunks, int outliers, const int* outlier_ids, const long long* positions,
                           layer_view view, void* value_staging, cudaStream_t stream) {
  check_vector_rows(d);
  if (len == 0) return;
  const bool vector_values = values.type == kv_type && rows_are_vectors(values, row, d.head_dim);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int per_row = d.head_dim / vector16<T>::elements;
    const dim3 grid(blocks_for(static_cast<long long>(len) * per_row, kScatterThreads), d.kv_heads);
    scatter_prompt_kernel<T><<<grid, kScatterThreads, 0, stream>>>(d, static_cast<const T*>(keys_post), values,
                                                                   vector_values, row, len, chunks, outliers,
                                                                   outlier_ids, positions, view,
                                                                   static_cast<T*>(value_staging));
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

gram_split plan_gram_split(int n, int rows, int multiprocessors) {
  SHADOWKV_EXPECTS(n >= 1 && rows >= 0 && multiprocessors >= 1, "plan_gram_split: n ", n, ", rows ", rows,
                   ", multiprocessors ", multiprocessors);
  gram_split split{};
  // Blocks of 64..128 (a multiple of 16) when one divides n (every supported head_dim gives one): the lower block
  // triangle is then 56-62% of the full product; else one block, the full n x n.
  split.block = n;
  for (int block = 128; block >= 64; block -= 16) {
    if (n % block == 0) {
      split.block = block;
      break;
    }
  }
  split.blocks = n / split.block;
  split.pairs = split.blocks * (split.blocks + 1) / 2;
  if (rows == 0) return split;  // slices 0: the sum writes zeros
  const long long wanted = (static_cast<long long>(kGramWaves) * multiprocessors + split.pairs - 1) / split.pairs;
  const long long most = std::max(1, rows / kGramMinSliceRows);
  split.slices = static_cast<int>(std::clamp<long long>(wanted, 1, most));
  split.slice_rows = rows / split.slices;
  return split;
}

std::size_t gram_partial_bytes(const gram_split& split, int n) {
  return static_cast<std::size_t>(split.slices) * n * n * sizeof(float);
}

void launch_gram_block_pointers(const float* keys, int n, const gram_split& split, float* partials, const float** a,
                                const float** b, float** c, cudaStream_t stream) {
  if (split.entries() == 0) return;
  gram_block_pointers_kernel<<<blocks_for(split.entries(), kGramThreads), kGramThreads, 0, stream>>>(
      keys, n, split, partials, a, b, c);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_sum_gram_partials(const float* partials, const float* keys, int rows, int n, const gram_split& split,
                              double* gram, cudaStream_t stream) {
  SHADOWKV_EXPECTS(n <= kMaxGramColumns, "launch_sum_gram_partials: n ", n, " exceeds ", kMaxGramColumns);
  const int tail_rows = split.tail_rows(rows);
  const float* tail = keys + static_cast<long long>(split.slices) * split.slice_rows * n;
  sum_gram_partials_kernel<<<dim3(blocks_for(n, kGramThreads), n), kGramThreads, 0, stream>>>(
      partials, split.slices, tail, tail_rows, n, gram);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_basis_from_vectors(const double* vectors, int n, int rank, bool reversed, bool rows, float* basis,
                               cudaStream_t stream) {
  basis_from_vectors_kernel<<<blocks_for(static_cast<long long>(rank) * n, 256), 256, 0, stream>>>(
      vectors, n, rank, reversed, rows, basis);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_keys_to_double(const float* keys, int rows, int cols, bool column_major, double* out,
                           cudaStream_t stream) {
  keys_to_double_kernel<<<blocks_for(static_cast<long long>(rows) * cols, 256), 256, 0, stream>>>(keys, rows, cols,
                                                                                                 column_major, out);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_scale_keys_for_gram(float* keys, long long count, key_stats* stats, cudaStream_t stream) {
  if (count <= 0) return;
  scale_keys_for_gram_kernel<<<static_cast<unsigned>(std::min<long long>(blocks_for(count, 256), 1024)), 256, 0,
                               stream>>>(keys, count, stats);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_unscale_coefficients(float* coefficients, long long count, const key_stats* stats, cudaStream_t stream) {
  if (count <= 0) return;
  unscale_coefficients_kernel<<<static_cast<unsigned>(std::min<long long>(blocks_for(count, 256), 1024)), 256, 0,
                                stream>>>(coefficients, count, stats);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_set_prefill_counters(layer_view* view, int prompt_len, int context_chunks, int outlier_chunks,
                                 int local_len, const long long* positions, int len, cudaStream_t stream) {
  set_prefill_counters_kernel<<<1, 1, 0, stream>>>(view, prompt_len, context_chunks, outlier_chunks, local_len,
                                                   positions, len);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
