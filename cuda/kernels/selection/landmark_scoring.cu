// Kernel 1 of the chunk selection: tiled landmark logits and their softmax partials (see chunk_selection.cu, step 1).
#include "selection/landmark_scoring.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/dependent_launch.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/phase_stamps.cuh"
#include "common/fp8_vectors.cuh"
#include "common/float_constants.cuh"
#include "common/per_device_cache.hpp"
#include "cuda_check.hpp"
#include "selection/softmax_partials.cuh"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda::selection {
namespace {

constexpr int kLogitTileBudget = 36 * 1024;  // bytes of one staged tile (two are in flight): 3 CTAs per SM resident
constexpr int kMaxTilesPerCta = 16;

/// What the kernel writes. Decode: logits (the logits and the tile partials). Several query tokens, for each group
/// of tokens in order: statistics (the tile partials of each token of the group, a partials row per token), then
/// accumulate (recomputes the logits, normalises them with the merged partials and adds p_{j,t} into logits row j:
/// the probabilities summed over tokens). int-sized: it travels in a kernel argument.
enum class logit_mode : int { logits, statistics, accumulate };

/// Rows of row_bytes (a multiple of 16) contiguous in global memory: fully coalesced 16-byte copies that bypass
/// registers. The caller commits them.
__device__ __forceinline__ void stage_rows_async(unsigned char* buffer, const unsigned char* source, int rows,
                                                 int row_bytes, const logit_geometry& geo) {
  const int per_row = row_bytes / 16;
  for (int i = threadIdx.x; i < rows * per_row; i += kLogitThreads) {
    const int r = i / per_row;
    const int v = i - r * per_row;
    copy_async<16>(buffer + r * geo.row_stride + v * 16, source + static_cast<long long>(r) * row_bytes + v * 16);
  }
}

template <typename T>
__device__ __forceinline__ void stage_tile(unsigned char* buffer, const T* source, int rows, int head_dim,
                                           const logit_geometry& geo, bool async_copy) {
  constexpr int kElements = vector16<T>::elements;
  const int row_bytes = head_dim * static_cast<int>(sizeof(T));
  if (async_copy) {
    stage_rows_async(buffer, reinterpret_cast<const unsigned char*>(source), rows, row_bytes, geo);
  } else {
    const int padded = geo.vectors * kElements;
    for (int i = threadIdx.x; i < rows * padded; i += kLogitThreads) {
      const int r = i / padded;
      const int e = i - r * padded;
      reinterpret_cast<T*>(buffer + r * geo.row_stride)[e] =
          e < head_dim ? source[static_cast<long long>(r) * head_dim + e] : from_float<T>(0.0F);
    }
  }
  commit_async_copies();
}

/// Grid (ceil(tiles / tiles_per_cta), Hkv, B): CTA x takes tiles x, x + gridDim.x, ... below context_chunks, so a
/// short context still spreads over all CTAs. Two staging buffers: the next tile's copy is in flight while the
/// current one is computed.
///
/// kCentroids (dims::chunk_centroids): a row is a chunk's 2·D e4m3 codes (centroid 1, then 2; plan_logits with 2-byte
/// elements), the first half of the parts sharing a row sums q·c1, the second half q·c2, and the row's logit is
/// log(w1 e^(s q·ĉ1) + w2 e^(s q·ĉ2)) with ĉ = code values times the centroid's scale (shadowkv/chunk_centroids.hpp).
template <typename T, int kHeadBlock, bool kCentroids>
__global__ void __launch_bounds__(kLogitThreads) landmark_logits_kernel(const dims d, const layer_view* views,
                                                                        const int* batch_slots, const int layer,
                                                                        const strided_tensor queries,
                                                                        const logit_geometry geo, const logit_mode mode,
                                                                        const int first_token, const int token_count,
                                                                        float* logits, float* partials) {
  start_phase_stamps(stamped_kernel::logits);
  wait_for_prior_grids();  // common/dependent_launch.cuh: nothing before the previous kernel is done
  phase_stamp(stamped_kernel::logits, 1);
  constexpr int kElements = vector16<T>::elements;
  extern __shared__ __align__(16) unsigned char logit_shared[];
  __shared__ float warp_partials[kLogitThreads / 32][kHeadBlock][2];
  // accumulate: (max, sum exp) of each token's logits per head
  __shared__ float token_stats[kScoringTokenGroup][kHeadBlock][2];

  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int n = context_chunks_of(view, d);
  const int tile_stride = gridDim.x;
  int tile = blockIdx.x;
  if (tile * geo.tile_rows >= n) return;
  // Query floats per head: the landmark row's elements, or one centroid's D.
  const int padded = kCentroids ? (d.head_dim + 15) / 16 * 16 : geo.vectors * kElements;
  const long long stage_bytes = static_cast<long long>(geo.tile_rows) * geo.row_stride;

  auto stage = [&](int index) { return logit_shared + (index & 1) * stage_bytes; };
  float* q_shared = reinterpret_cast<float*>(logit_shared + 2 * stage_bytes);
  float* part_sums = q_shared + kHeadBlock * padded;  // [parts][kHeadBlock][tile_rows], only when parts > 1

  const T* head_landmarks = kCentroids ? nullptr
                                        : static_cast<const T*>(view->landmarks) +
                                              static_cast<long long>(h) * d.max_chunks * d.head_dim;
  const long long head_first = static_cast<long long>(h) * d.max_chunks;  // (head, chunk 0) of the per-chunk arrays
  const std::uint8_t* head_codes = kCentroids ? view->centroid_codes + head_first * 2 * d.head_dim : nullptr;
  const std::uint8_t* head_outliers = view->is_outlier + head_first;
  const int row_bytes = d.head_dim * static_cast<int>(sizeof(T));
  const bool async_copy = row_bytes % 16 == 0 && (reinterpret_cast<std::uintptr_t>(head_landmarks) & 15U) == 0;
  // Tile t into staging buffer `buffer` (centroid codes: 2·D bytes a row, a multiple of 16, 16-byte aligned).
  auto stage_rows = [&](unsigned char* buffer, int t, int count) {
    if constexpr (kCentroids) {
      stage_rows_async(buffer, head_codes + static_cast<long long>(t) * geo.tile_rows * 2 * d.head_dim, count,
                       2 * d.head_dim, geo);
      commit_async_copies();
    } else {
      stage_tile(buffer, head_landmarks + static_cast<long long>(t) * geo.tile_rows * d.head_dim, count, d.head_dim,
                 geo, async_copy);
    }
  };

  const int r = threadIdx.x % geo.tile_rows;
  const int part = threadIdx.x / geo.tile_rows;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  auto rows_of = [&](int t) { return min(geo.tile_rows, n - t * geo.tile_rows); };
  auto outlier_of = [&](int t) {
    return part == 0 && r < rows_of(t) && head_outliers[t * geo.tile_rows + r] != 0;
  };
  auto stage_q = [&](int g0, int token) {
    for (int i = threadIdx.x; i < kHeadBlock * padded; i += kLogitThreads) {
      const int gi = i / padded;
      const int e = i - gi * padded;
      float value = 0.0F;
      if (g0 + gi < d.group && e < d.head_dim) {
        const long long j = static_cast<long long>(h) * d.group + g0 + gi;
        value = load_any(queries.data, queries.type,
                         b * queries.stride[0] + token * queries.stride[1] + j * queries.stride[2] + e * queries.stride[3]);
      }
      q_shared[i] = value;
    }
  };
  const int used_tiles = (n + geo.tile_rows - 1) / geo.tile_rows;
  // The partials row of the group's k-th token: rows of all entries for token 0 of the group, then for token 1, ...
  auto partials_of = [&](int k) {
    return partials +
           ((static_cast<long long>(k) * gridDim.z + b) * d.kv_heads + h) * partial_row_floats(d, geo);
  };

  stage_rows(stage(0), tile, rows_of(tile));
  bool outlier = outlier_of(tile);
  const bool single_block = d.group <= kHeadBlock;
  // One token with one block of heads: q is staged once; otherwise for each (head block, token) of each tile.
  const bool restage = !single_block || token_count > 1;
  if (!restage) stage_q(0, first_token);

  for (int i = 0;; ++i) {
    const int next = tile + tile_stride;
    const bool has_next = next * geo.tile_rows < n;
    bool next_outlier = false;
    if (has_next) {
      stage_rows(stage(i + 1), next, rows_of(next));
      next_outlier = outlier_of(next);
      wait_async_copies<1>();
    } else {
      wait_async_copies<0>();
    }
    __syncthreads();
    phase_stamp(stamped_kernel::logits, 40);

    const int rows = rows_of(tile);
    const bool owner = part == 0 && r < rows;  // the thread that writes row r's results
    const unsigned char* row = stage(i) + r * geo.row_stride;
    for (int g0 = 0; g0 < d.group; g0 += kHeadBlock) {
     for (int k = 0; k < token_count; ++k) {
      const int token = first_token + k;
      float* const head_partials = partials_of(k);
      if (restage) {
        if (g0 > 0 || k > 0) __syncthreads();  // q_shared, part_sums and warp_partials of the previous round are read
        stage_q(g0, token);
        __syncthreads();
      }
      if (mode == logit_mode::accumulate && (i == 0 || !single_block)) {
        // This token's normaliser per head: merge the partials that the statistics launch left.
        for (int gi = warp; gi < kHeadBlock; gi += kLogitThreads / 32) {
          float m = kNegativeInfinity;
          float s = 0.0F;
          if (g0 + gi < d.group) {
            const float* partial = head_partials + static_cast<long long>(g0 + gi) * geo.tiles * 2;
            for (int t = lane; t < used_tiles; t += 32) merge_partial(m, s, partial[2 * t], partial[2 * t + 1]);
          }
          warp_merge_partial(m, s);
          if (lane == 0) {
            token_stats[k][gi][0] = m;
            token_stats[k][gi][1] = s;
          }
        }
        __syncthreads();
      }
      float acc[kHeadBlock];
#pragma unroll
      for (int gi = 0; gi < kHeadBlock; ++gi) acc[gi] = 0.0F;
      if (kCentroids && r < rows) {
        // Parts [0, parts/2) take centroid 1's vectors, [parts/2, parts) centroid 2's (geo.parts >= 2: tile_rows <=
        // 128 of 256 threads), each over the same query slice.
        const int half_parts = geo.parts / 2;
        const int m = part / half_parts;
        const int per_centroid = d.head_dim / 16;
        for (int v = part - m * half_parts; v < per_centroid; v += half_parts) {
          // 16 codes decoded once for all heads (hardware conversion, two codes an instruction).
          float x[16];
          decode_e4m3x16(*reinterpret_cast<const uint4*>(row + (m * per_centroid + v) * 16), x);
#pragma unroll
          for (int gi = 0; gi < kHeadBlock; ++gi) {
            const float4* q4 = reinterpret_cast<const float4*>(q_shared + gi * padded + v * 16);
#pragma unroll
            for (int e4 = 0; e4 < 4; ++e4) {
              const float4 q = q4[e4];
              acc[gi] = fmaf(q.x, x[4 * e4 + 0], acc[gi]);
              acc[gi] = fmaf(q.y, x[4 * e4 + 1], acc[gi]);
              acc[gi] = fmaf(q.z, x[4 * e4 + 2], acc[gi]);
              acc[gi] = fmaf(q.w, x[4 * e4 + 3], acc[gi]);
            }
          }
        }
      } else if (r < rows) {
        for (int v = part; v < geo.vectors; v += geo.parts) {
          float x[kElements];
          vector16<T>::to_floats(*reinterpret_cast<const uint4*>(row + v * 16), x);
#pragma unroll
          for (int gi = 0; gi < kHeadBlock; ++gi) {
            // Same address across the warp: a broadcast.
            const float4* q4 = reinterpret_cast<const float4*>(q_shared + gi * padded + v * kElements);
#pragma unroll
            for (int e4 = 0; e4 < kElements / 4; ++e4) {
              const float4 q = q4[e4];
              acc[gi] = fmaf(q.x, x[4 * e4 + 0], acc[gi]);
              acc[gi] = fmaf(q.y, x[4 * e4 + 1], acc[gi]);
              acc[gi] = fmaf(q.z, x[4 * e4 + 2], acc[gi]);
              acc[gi] = fmaf(q.w, x[4 * e4 + 3], acc[gi]);
            }
          }
        }
      }
      if (geo.parts > 1) {
        // Fixed order (part 0, 1, ...) for every row, so equal rows give equal sums.
#pragma unroll
        for (int gi = 0; gi < kHeadBlock; ++gi) part_sums[(part * kHeadBlock + gi) * geo.tile_rows + r] = acc[gi];
        __syncthreads();
        if (part == 0 && !kCentroids) {
#pragma unroll
          for (int gi = 0; gi < kHeadBlock; ++gi) {
            float sum = part_sums[gi * geo.tile_rows + r];
            for (int p = 1; p < geo.parts; ++p) sum += part_sums[(p * kHeadBlock + gi) * geo.tile_rows + r];
            acc[gi] = sum;
          }
        }
        if (kCentroids && owner && !outlier) {
          // acc = the logit: logaddexp(s q·ĉ1 + log w1, s q·ĉ2 + log w2).
          const long long chunk = head_first + static_cast<long long>(tile) * geo.tile_rows + r;
          const float scale1 = view->centroid_scales[2 * chunk];
          const float scale2 = view->centroid_scales[2 * chunk + 1];
          const int n1 = view->first_counts[chunk];
          const float log_w1 = n1 > 0 ? logf(static_cast<float>(n1) / static_cast<float>(d.chunk)) : kNegativeInfinity;
          const float log_w2 =
              n1 < d.chunk ? logf(static_cast<float>(d.chunk - n1) / static_cast<float>(d.chunk)) : kNegativeInfinity;
          const int half_parts = geo.parts / 2;
#pragma unroll
          for (int gi = 0; gi < kHeadBlock; ++gi) {
            float dot1 = part_sums[gi * geo.tile_rows + r];
            for (int p = 1; p < half_parts; ++p) dot1 += part_sums[(p * kHeadBlock + gi) * geo.tile_rows + r];
            float dot2 = part_sums[(half_parts * kHeadBlock + gi) * geo.tile_rows + r];
            for (int p = half_parts + 1; p < geo.parts; ++p) {
              dot2 += part_sums[(p * kHeadBlock + gi) * geo.tile_rows + r];
            }
            const float a = d.softmax_scale * (dot1 * scale1) + log_w1;
            const float bb = d.softmax_scale * (dot2 * scale2) + log_w2;
            const float top = fmaxf(a, bb);
            acc[gi] = top + logf(expf(a - top) + expf(bb - top));
          }
        }
      }

      float logit[kHeadBlock];
#pragma unroll
      for (int gi = 0; gi < kHeadBlock; ++gi) {
        logit[gi] = owner && !outlier ? (kCentroids ? acc[gi] : d.softmax_scale * acc[gi]) : kNegativeInfinity;
        if (owner && g0 + gi < d.group && mode != logit_mode::statistics) {
          const long long j = static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * d.group + g0 + gi;
          float* out = logits + j * d.max_chunks + tile * geo.tile_rows + r;
          if (mode == logit_mode::logits) {
            *out = logit[gi];
          } else if (outlier) {
            *out = -1.0F;  // marks a non-candidate for kernel 2 (probabilities are >= 0)
          } else {
            const float p = expf(logit[gi] - token_stats[k][gi][0]) / token_stats[k][gi][1];
            *out = token == 0 ? p : *out + p;
          }
        }
      }

      if (mode == logit_mode::statistics || mode == logit_mode::logits) {
        // Tile (max, sum exp): max first (shuffles, then across warps), so each logit costs one exp.
        constexpr int kWarps = kLogitThreads / 32;
        float m[kHeadBlock];
#pragma unroll
        for (int gi = 0; gi < kHeadBlock; ++gi) {
          m[gi] = logit[gi];
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) m[gi] = fmaxf(m[gi], __shfl_xor_sync(0xffffffffU, m[gi], offset));
          if (lane == 0) warp_partials[warp][gi][0] = m[gi];
        }
        __syncthreads();
#pragma unroll
        for (int gi = 0; gi < kHeadBlock; ++gi) {
          float top = warp_partials[0][gi][0];
          for (int w = 1; w < kWarps; ++w) top = fmaxf(top, warp_partials[w][gi][0]);
          float e = logit[gi] == kNegativeInfinity ? 0.0F : expf(logit[gi] - top);
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) e += __shfl_xor_sync(0xffffffffU, e, offset);
          if (lane == 0) warp_partials[warp][gi][1] = e;
        }
        __syncthreads();
        if (threadIdx.x < kHeadBlock && g0 + static_cast<int>(threadIdx.x) < d.group) {
          const int gi = threadIdx.x;
          float tile_m = warp_partials[0][gi][0];
          float tile_s = 0.0F;
          for (int w = 0; w < kWarps; ++w) {
            tile_m = fmaxf(tile_m, warp_partials[w][gi][0]);
            tile_s += warp_partials[w][gi][1];
          }
          float* partial = head_partials + (static_cast<long long>(g0 + gi) * geo.tiles + tile) * 2;
          partial[0] = tile_m;
          partial[1] = tile_s;
        }
      }
     }
    }
    if (!has_next) {
      finish_phase_stamps(stamped_kernel::logits, 49);
      break;
    }
    __syncthreads();  // this stage, q_shared, part_sums and warp_partials are reused
    phase_stamp(stamped_kernel::logits, 41);
    tile = next;
    outlier = next_outlier;
  }
}

template <typename T, int kHeadBlock, bool kCentroids>
void launch_logits(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                   const strided_tensor& queries, int tokens, const logit_geometry& geo, const step_workspace& ws,
                   const device_limits& limits, cudaStream_t stream) {
  constexpr int kElements = vector16<T>::elements;
  const long long q_floats = kCentroids ? (d.head_dim + 15) / 16 * 16 : static_cast<long long>(geo.vectors) * kElements;
  const long long shared = 2LL * geo.tile_rows * geo.row_stride + 4LL * kHeadBlock * q_floats +
                           (geo.parts > 1 ? 4LL * geo.parts * kHeadBlock * geo.tile_rows : 0LL);
  SHADOWKV_EXPECTS(shared + 1024 <= limits.optin_shared, "chunk selection: head_dim ", d.head_dim,
                   " needs more shared memory than the device has");
  auto kernel = landmark_logits_kernel<T, kHeadBlock, kCentroids>;
  allow_shared(kernel, shared);
  // Tiles per CTA: about one wave of resident CTAs when every chunk is live. Depends on dims, batch and the device
  // only, never on the context lengths (the step stays capturable). The occupancy is asked once per (device,
  // shared bytes) of each instantiation.
  static per_device_cache<int, long long> resident_per_multiprocessor;
  const int resident = resident_per_multiprocessor.get(shared, [&](int, long long bytes) {
    int ctas = 0;
    SHADOWKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kLogitThreads,
                                                                    static_cast<size_t>(bytes)));
    return ctas;
  });
  const long long slots = static_cast<long long>(limits.multiprocessors) * (resident > 0 ? resident : 1);
  const long long work = static_cast<long long>(batch) * d.kv_heads * geo.tiles;
  const long long per_cta = std::min<long long>(std::max<long long>((work + slots - 1) / slots, 1), kMaxTilesPerCta);
  const dim3 grid(static_cast<unsigned>((geo.tiles + per_cta - 1) / per_cta), static_cast<unsigned>(d.kv_heads),
                  static_cast<unsigned>(batch));
  auto launch = [&](logit_mode mode, int first, int count) {
    launch_after_prior_grid(kernel, grid, dim3(kLogitThreads), static_cast<std::size_t>(shared), stream,
                            true, d, views, batch_slots, layer, queries, geo, mode, first, count,
                            ws.logits, ws.selection_partials);
  };
  if (tokens == 1) {
    launch(logit_mode::logits, 0, 1);
  } else {
    for (int first = 0; first < tokens; first += kScoringTokenGroup) {
      const int count = std::min(kScoringTokenGroup, tokens - first);
      launch(logit_mode::statistics, first, count);
      launch(logit_mode::accumulate, first, count);
    }
  }
}

}  // namespace

logit_geometry plan_logits(const dims& d, int element_bytes) {
  logit_geometry geo{};
  const int row_bytes = d.head_dim * element_bytes;
  geo.vectors = (row_bytes + 15) / 16;
  geo.row_stride = geo.vectors * 16 + 16;
  geo.tile_rows = 128;
  while (geo.tile_rows > 8 && geo.tile_rows * geo.row_stride > kLogitTileBudget) geo.tile_rows /= 2;
  geo.parts = kLogitThreads / geo.tile_rows;
  geo.tiles = (d.max_chunks + geo.tile_rows - 1) / geo.tile_rows;
  return geo;
}

void launch_landmark_scoring(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                             int batch, const strided_tensor& queries, int tokens, const logit_geometry& geo,
                             const step_workspace& ws, const device_limits& limits, cudaStream_t stream) {
  shadowkv_dispatch_element(kv_type, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    shadowkv_dispatch_head_tile(d.group, [&](auto head_tile) {
      if (d.chunk_centroids != 0) {
        SHADOWKV_EXPECTS(d.head_dim % 16 == 0 && geo.parts >= 2 && geo.parts % 2 == 0,
                         "two-centroid scores: head_dim ", d.head_dim, " must be a multiple of 16");
        launch_logits<T, decltype(head_tile)::value, true>(d, views, batch_slots, layer, batch, queries, tokens, geo,
                                                           ws, limits, stream);
      } else {
        launch_logits<T, decltype(head_tile)::value, false>(d, views, batch_slots, layer, batch, queries, tokens, geo,
                                                            ws, limits, stream);
      }
    });
  });
}

}  // namespace shadowkv::cuda::selection
