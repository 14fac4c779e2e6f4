#include "landmark_logits.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "cuda_check.hpp"
#include "dispatch.cuh"
#include "element_access.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTilesPerCta = 16;
constexpr float kNegativeInfinity = -__builtin_huge_valf();

// T: landmark element type; kRowBytes: bytes of one landmark row (head_dim * sizeof(T)); kG: query heads per KV head
// held in registers (>= dims.group).
template <typename T, int kRowBytes, int kG>
__global__ void __launch_bounds__(kThreads) decode_landmark_logits_kernel(const dims d, const layer_view* views,
                                                                          const int* batch_slots, const int layer,
                                                                          const strided_tensor queries,
                                                                          const int tile_rows, const int tiles,
                                                                          float* logits, float* scores) {
  constexpr int kElements = vector16<T>::elements;
  constexpr int kVectorsPerRow = kRowBytes / 16;
  constexpr int kLanesPerRow = kVectorsPerRow < 32 ? kVectorsPerRow : 32;
  constexpr int kVectorsPerLane = kVectorsPerRow / kLanesPerRow;
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  constexpr int kRowsPerPass = kWarps * kRowsPerWarp;
  constexpr int kUnroll = 8 / kVectorsPerLane;  // rows in flight per lane: 8 (or 4) 16-byte loads
  constexpr int kDims = kRowBytes / static_cast<int>(sizeof(T));
  __shared__ float q_shared[kG][kDims];
  extern __shared__ float tile_logits[];  // [kG][tile_rows]

  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int n = context_chunks_of(view, d);
  int tile = blockIdx.x;
  if (tile * tile_rows >= n) return;

  for (int i = threadIdx.x; i < kG * kDims; i += kThreads) {
    const int g = i / kDims;
    const int e = i - g * kDims;
    float value = 0.0F;
    if (g < d.group) {
      const long long j = static_cast<long long>(h) * d.group + g;
      value = load_any(queries.data, queries.type, b * queries.stride[0] + j * queries.stride[2] + e * queries.stride[3]);
    }
    q_shared[g][e] = value;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / kLanesPerRow;   // row of this lane within the warp's rows
  const int part = lane % kLanesPerRow;  // its 16-byte vectors: part, part + kLanesPerRow, ...
  float q[kG][kVectorsPerLane * kElements];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int k = 0; k < kVectorsPerLane; ++k) {
#pragma unroll
      for (int e = 0; e < kElements; ++e) q[g][k * kElements + e] = q_shared[g][(part + k * kLanesPerRow) * kElements + e];
    }
  }

  const T* head_landmarks = static_cast<const T*>(view->landmarks) + static_cast<long long>(h) * d.max_chunks * kDims;
  const std::uint8_t* head_outliers = view->is_outlier + static_cast<long long>(h) * d.max_chunks;
  const int group = d.group;
  for (; tile * tile_rows < n; tile += gridDim.x) {
    const int first = tile * tile_rows;
    const int rows = min(tile_rows, n - first);
    for (int base = 0; base < tile_rows; base += kRowsPerPass * kUnroll) {
      uint4 raw[kUnroll][kVectorsPerLane];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int row = base + u * kRowsPerPass + warp * kRowsPerWarp + sub;
        const uint4* source = reinterpret_cast<const uint4*>(head_landmarks + static_cast<long long>(first + row) * kDims);
#pragma unroll
        for (int k = 0; k < kVectorsPerLane; ++k) {
          raw[u][k] = row < rows ? __ldg(source + part + k * kLanesPerRow) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int row = base + u * kRowsPerPass + warp * kRowsPerWarp + sub;
        float acc[kG];
#pragma unroll
        for (int g = 0; g < kG; ++g) acc[g] = 0.0F;
#pragma unroll
        for (int k = 0; k < kVectorsPerLane; ++k) {
          float x[kElements];
          vector16<T>::to_floats(raw[u][k], x);
#pragma unroll
          for (int g = 0; g < kG; ++g) {
#pragma unroll
            for (int e = 0; e < kElements; ++e) acc[g] = fmaf(q[g][k * kElements + e], x[e], acc[g]);
          }
        }
        // Sum over the row's lanes: the same butterfly for every row, so equal rows give equal logits.
#pragma unroll
        for (int g = 0; g < kG; ++g) {
#pragma unroll
          for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) {
            acc[g] += __shfl_xor_sync(0xffffffffU, acc[g], offset);
          }
        }
        if (part == 0 && row < tile_rows) {
          const bool live = row < rows && head_outliers[first + row] == 0;
#pragma unroll
          for (int g = 0; g < kG; ++g) tile_logits[g * tile_rows + row] = live ? d.softmax_scale * acc[g] : kNegativeInfinity;
        }
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * rows; i += kThreads) {
      const int g = i / rows;
      const int r = i - g * rows;
      const long long j = static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * group + g;
      logits[j * d.max_chunks + first + r] = tile_logits[g * tile_rows + r];
    }
    // The tile's softmax partial per query head (rows past the context count as -inf, as in chunk_selection.cu).
    for (int g = warp; g < group; g += kWarps) {
      float m = kNegativeInfinity;
      for (int r = lane; r < tile_rows; r += 32) m = fmaxf(m, tile_logits[g * tile_rows + r]);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffU, m, offset));
      float s = 0.0F;
      for (int r = lane; r < tile_rows; r += 32) {
        const float x = tile_logits[g * tile_rows + r];
        s += x == kNegativeInfinity ? 0.0F : expf(x - m);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffU, s, offset);
      if (lane == 0) {
        float* partial = scores + (static_cast<long long>(b) * d.kv_heads + h) * d.max_chunks +
                         (static_cast<long long>(g) * tiles + tile) * 2;
        partial[0] = m;
        partial[1] = s;
      }
    }
    __syncthreads();  // tile_logits is reused by the next tile
  }
}

template <typename T, int kRowBytes, int kG>
void launch_with(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                 const strided_tensor& queries, int tile_rows, int tiles, int multiprocessors, float* logits,
                 float* scores, cudaStream_t stream) {
  // About four resident CTAs per multiprocessor's worth of tiles per CTA; strided tiles keep short contexts spread.
  const long long work = static_cast<long long>(batch) * d.kv_heads * tiles;
  const long long slots = static_cast<long long>(std::max(multiprocessors, 1)) * 4;
  const long long per_cta = std::min<long long>(std::max<long long>((work + slots - 1) / slots, 1), kMaxTilesPerCta);
  const dim3 grid(static_cast<unsigned>((tiles + per_cta - 1) / per_cta), static_cast<unsigned>(d.kv_heads),
                  static_cast<unsigned>(batch));
  const std::size_t shared = static_cast<std::size_t>(kG) * tile_rows * sizeof(float);
  decode_landmark_logits_kernel<T, kRowBytes, kG><<<grid, kThreads, shared, stream>>>(d, views, batch_slots, layer,
                                                                                      queries, tile_rows, tiles,
                                                                                      logits, scores);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

template <typename T, int kRowBytes>
void launch_for_group(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                      const strided_tensor& queries, int tile_rows, int tiles, int multiprocessors, float* logits,
                      float* scores, cudaStream_t stream) {
  if (d.group == 1) {
    launch_with<T, kRowBytes, 1>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors,
                                 logits, scores, stream);
  } else if (d.group == 2) {
    launch_with<T, kRowBytes, 2>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors,
                                 logits, scores, stream);
  } else if (d.group <= 4) {
    launch_with<T, kRowBytes, 4>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors,
                                 logits, scores, stream);
  } else {
    launch_with<T, kRowBytes, 8>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors,
                                 logits, scores, stream);
  }
}

}  // namespace

bool launch_decode_landmark_logits(const dims& d, int kv_type, const layer_view* views, const int* batch_slots,
                                   int layer, int batch, const strided_tensor& queries, int tile_rows, int tiles,
                                   int multiprocessors, float* logits, float* scores, cudaStream_t stream) {
  if (d.group < 1 || d.group > 8 || batch <= 0 || tiles <= 0 || tile_rows <= 0) return false;
  bool launched = false;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int row_bytes = d.head_dim * static_cast<int>(sizeof(T));
    switch (row_bytes) {
      case 128:
        launch_for_group<T, 128>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors,
                                 logits, scores, stream);
        launched = true;
        break;
      case 256:
        launch_for_group<T, 256>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors,
                                 logits, scores, stream);
        launched = true;
        break;
      case 512:
        launch_for_group<T, 512>(d, views, batch_slots, layer, batch, queries, tile_rows, tiles, multiprocessors,
                                 logits, scores, stream);
        launched = true;
        break;
      default: break;
    }
  });
  return launched;
}

}  // namespace shadowkv::cuda
