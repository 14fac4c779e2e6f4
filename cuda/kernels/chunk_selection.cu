// Landmark scores, top-k per KV head and the temporal-cache update (see chunk_selection.cuh).
//
// Decode (one query token) runs three kernels whose shapes depend only on dims and the batch size, so the step can
// be captured in a CUDA graph (the context length is read from the device layer_view, never from the host):
//
//   1. landmark_logits_kernel, grid (ceil(tiles / tiles_per_cta), Hkv, B), 256 threads. A tile is up to 128
//      consecutive chunks of one head: contiguous rows of T [Hkv, max_chunks, D], staged in shared memory with 16-byte
//      cp.async (two stages: the next tile loads while this one is computed) and used once for all G query heads
//      (q in shared memory as float, read as broadcasts; two threads a row). It writes softmax_scale * q_j·L[c]
//      (-inf for outliers) to workspace.logits [B, Hq, max_chunks], and each tile's softmax partial (max, sum exp)
//      per query head. CTA x takes tiles x, x + gridDim.x, ... below context_chunks; the number of tiles per CTA is
//      chosen on the host from dims, batch and the device (about one wave of CTAs). The partials are carved out of
//      workspace.scores: row (b, h) holds [G][tiles][2] floats at its start (requires 2 * G * tiles <= max_chunks).
//   1b. score_kernel, grid (ceil(max_chunks / 256), Hkv, B): merges the partials into one normaliser per query head
//      and writes score(c) = max_j p_j(c) = exp2(max_j(x_j(c) * log2 e - offset_j)) (dims::group_mean: the mean of
//      the p_j(c), an exp each) in place into the group's first
//      logits row (-1 for non-candidates). Spreads the exp work over the GPU instead of B*Hkv CTAs.
//   2. select_kernel, one CTA of 1024 threads per (b, h): reads the scores into per-chunk keys (float bits + 1;
//      0 for non-candidates) and workspace.scores (chunks c < context_chunks; 0 for outliers); the top-k by an
//      MSB-first radix select over the keys (digits of 12, 11 and 9 bits, shared-memory histograms, the digit found
//      with one cub::BlockScan over the bins); then an ordered compaction (warp ballots and one exchange of warp
//      totals) that takes every chunk strictly above the k-th key and the first ties in ascending id, writing
//      workspace.selected ascending; then the cache update with the same compaction (free slots ascending, misses
//      ascending), slot_of_chunk giving O(1) membership. The keys live in shared memory when max_chunks fits
//      (4 B per chunk, up to about 54K chunks on an H200); else in the group's first logits row, dead by then.
//   If the partials do not fit (tiny max_chunks or a very large group), 1b is skipped and kernel 2 normalises from
//   the logits itself (kFromLogits).
//
// Several query tokens (prefill's q_last) need one softmax per token before the sum over tokens, i.e. a normaliser
// per (b, j, t) that only a full pass can give, and the logits buffer has room for one token. So, per token t in
// order, kernel 1 runs twice: kStatistics writes only the tile partials of token t (into the scores rows), then
// kAccumulate recomputes the logits, normalises them with the merged partials and adds p_{j,t} into logits row j
// (-1 for non-candidates). Kernel 1b then takes the max over the group. 2*Tq + 2 launches, two landmark passes per
// token, all fully parallel. Only when the partials do not fit does kernel 2 do everything itself (kInKernel: a warp
// per chunk, G*Tq passes by one CTA; slow but exact).
//
// Every chunk's logit is computed by the same sequence of float operations wherever it sits in a tile, so identical
// landmarks give bit-identical scores and ties are broken by chunk id exactly as the CPU reference does.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "chunk_selection.cuh"
#include "cuda_check.hpp"
#include "dispatch.cuh"
#include "element_access.cuh"
#include "landmark_logits.cuh"
#include "ordered_compaction.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kLogitThreads = 256;            // 2 threads a row at 128 rows: 24 warps per SM hide the LDS/FMA latency
constexpr int kLogitTileBudget = 36 * 1024;  // bytes of one staged tile (two are in flight): 3 CTAs per SM resident
constexpr int kMaxTilesPerCta = 16;
constexpr int kSelectThreads = 1024;         // one CTA per (b, h): at B=1 only Hkv CTAs run, so make each wide
constexpr int kSelectWarps = kSelectThreads / 32;
static_assert(kSelectThreads == kOrderedPassThreads, "ordered_pass (ordered_compaction.cuh) needs 1024 threads");
constexpr int kScoreBatch = 8;               // chunks per thread whose logits are loaded together
constexpr int kRadixFirstBits = 12;          // first radix digit; 4 bins a thread in the digit search
constexpr int kDefaultSharedLimit = 48 * 1024;
/// Left for the select kernel's static shared memory (kSelectStaticShared below: ~17 KiB, most of it the radix
/// histogram) when its dynamic part is planned against the device's opt-in limit and the 48 KiB default.
constexpr int kSharedMargin = 20 * 1024;

constexpr float kNegativeInfinity = -__builtin_huge_valf();
constexpr float kLog2e = 1.4426950408889634F;

// -----------------------------------------------------------------------------------------------------------------
// Small device helpers.

/// Merges softmax partials (max, sum of exp(x - max)); (-inf, 0) is the empty partial.
__device__ __forceinline__ void merge_partial(float& m, float& s, float other_m, float other_s) {
  const float top = fmaxf(m, other_m);
  if (top == kNegativeInfinity) {
    m = top;
    s = 0.0F;
    return;
  }
  s = s * expf(m - top) + other_s * expf(other_m - top);
  m = top;
}

__device__ __forceinline__ void warp_merge_partial(float& m, float& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_m = __shfl_xor_sync(0xffffffffU, m, offset);
    const float other_s = __shfl_xor_sync(0xffffffffU, s, offset);
    merge_partial(m, s, other_m, other_s);
  }
}


// -----------------------------------------------------------------------------------------------------------------
// Kernel 1: logits of tiles of chunks for all G query heads of (b, h).

/// What kernel 1 writes. Decode: kLogits (logits, and the tile partials when they fit). Several query tokens, for
/// each token t in order: kStatistics (the tile partials of token t only), then kAccumulate (recomputes the logits,
/// normalises them with the merged partials and adds p_{j,t} into logits row j: the probabilities summed over tokens).
enum logit_mode : int { kLogits = 0, kStatistics = 1, kAccumulate = 2 };

struct logit_geometry {
  int tile_rows;   ///< chunks per tile (power of two, 8..128)
  int parts;       ///< threads sharing one row: kLogitThreads / tile_rows (they split the 16-byte vectors)
  int row_stride;  ///< bytes per staged row: vectors * 16 + 16 (the extra 16 B keep row reads free of conflicts)
  int vectors;     ///< 16-byte vectors per row, rounded up (a row's tail past D is zero-filled)
  int tiles;       ///< ceil(max_chunks / tile_rows)
  int write_partials;
};

template <typename T>
__device__ __forceinline__ void stage_tile(unsigned char* buffer, const T* source, int rows, int head_dim,
                                           const logit_geometry& geo, bool async_copy) {
  constexpr int kElements = vector16<T>::elements;
  const int row_bytes = head_dim * static_cast<int>(sizeof(T));
  if (async_copy) {
    // Rows are contiguous in global memory: fully coalesced 16-byte copies that bypass registers.
    const int per_row = row_bytes / 16;
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(source);
    for (int i = threadIdx.x; i < rows * per_row; i += kLogitThreads) {
      const int r = i / per_row;
      const int v = i - r * per_row;
      __pipeline_memcpy_async(buffer + r * geo.row_stride + v * 16, bytes + static_cast<long long>(r) * row_bytes + v * 16,
                              16);
    }
  } else {
    const int padded = geo.vectors * kElements;
    for (int i = threadIdx.x; i < rows * padded; i += kLogitThreads) {
      const int r = i / padded;
      const int e = i - r * padded;
      reinterpret_cast<T*>(buffer + r * geo.row_stride)[e] =
          e < head_dim ? source[static_cast<long long>(r) * head_dim + e] : from_float<T>(0.0F);
    }
  }
  __pipeline_commit();
}

/// Grid (ceil(tiles / tiles_per_cta), Hkv, B): CTA x takes tiles x, x + gridDim.x, ... below context_chunks, so a
/// short context still spreads over all CTAs. Two staging buffers: the next tile's copy is in flight while the
/// current one is computed.
template <typename T, int kHeadBlock>
__global__ void __launch_bounds__(kLogitThreads) landmark_logits_kernel(const dims d, const layer_view* views,
                                                                        const int* batch_slots, const int layer,
                                                                        const strided_tensor queries,
                                                                        const logit_geometry geo, const int mode,
                                                                        const int token, float* logits,
                                                                        float* scores) {
  constexpr int kElements = vector16<T>::elements;
  extern __shared__ __align__(16) unsigned char logit_shared[];
  __shared__ float warp_partials[kLogitThreads / 32][kHeadBlock][2];
  __shared__ float token_stats[kHeadBlock][2];  // kAccumulate: (max, sum exp) of this token's logits per head

  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int n = context_chunks_of(view, d);
  const int tile_stride = gridDim.x;
  int tile = blockIdx.x;
  if (tile * geo.tile_rows >= n) return;
  const int padded = geo.vectors * kElements;
  const long long stage_bytes = static_cast<long long>(geo.tile_rows) * geo.row_stride;

  auto stage = [&](int index) { return logit_shared + (index & 1) * stage_bytes; };
  float* q_shared = reinterpret_cast<float*>(logit_shared + 2 * stage_bytes);
  float* part_sums = q_shared + kHeadBlock * padded;  // [parts][kHeadBlock][tile_rows], only when parts > 1

  const T* head_landmarks = static_cast<const T*>(view->landmarks) + static_cast<long long>(h) * d.max_chunks * d.head_dim;
  const std::uint8_t* head_outliers = view->is_outlier + static_cast<long long>(h) * d.max_chunks;
  const int row_bytes = d.head_dim * static_cast<int>(sizeof(T));
  const bool async_copy = row_bytes % 16 == 0 && (reinterpret_cast<std::uintptr_t>(head_landmarks) & 15U) == 0;

  const int r = threadIdx.x % geo.tile_rows;
  const int part = threadIdx.x / geo.tile_rows;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  auto rows_of = [&](int t) { return min(geo.tile_rows, n - t * geo.tile_rows); };
  auto outlier_of = [&](int t) {
    return part == 0 && r < rows_of(t) && head_outliers[t * geo.tile_rows + r] != 0;
  };
  auto stage_q = [&](int g0) {
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
  const float* head_partials = scores + (static_cast<long long>(b) * d.kv_heads + h) * d.max_chunks;

  stage_tile(stage(0), head_landmarks + static_cast<long long>(tile) * geo.tile_rows * d.head_dim, rows_of(tile),
             d.head_dim, geo, async_copy);
  bool outlier = outlier_of(tile);
  const bool single_block = d.group <= kHeadBlock;
  if (single_block) stage_q(0);

  for (int i = 0;; ++i) {
    const int next = tile + tile_stride;
    const bool has_next = next * geo.tile_rows < n;
    bool next_outlier = false;
    if (has_next) {
      stage_tile(stage(i + 1), head_landmarks + static_cast<long long>(next) * geo.tile_rows * d.head_dim,
                 rows_of(next), d.head_dim, geo, async_copy);
      next_outlier = outlier_of(next);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();

    const int rows = rows_of(tile);
    const bool owner = part == 0 && r < rows;  // the thread that writes row r's results
    const unsigned char* row = stage(i) + r * geo.row_stride;
    for (int g0 = 0; g0 < d.group; g0 += kHeadBlock) {
      if (!single_block) {
        if (g0 > 0) __syncthreads();
        stage_q(g0);
        __syncthreads();
      }
      if (mode == kAccumulate && (i == 0 || !single_block)) {
        // This token's normaliser per head: merge the partials that the kStatistics launch left.
        for (int gi = warp; gi < kHeadBlock; gi += kLogitThreads / 32) {
          float m = kNegativeInfinity;
          float s = 0.0F;
          if (g0 + gi < d.group) {
            const float* partial = head_partials + static_cast<long long>(g0 + gi) * geo.tiles * 2;
            for (int t = lane; t < used_tiles; t += 32) merge_partial(m, s, partial[2 * t], partial[2 * t + 1]);
          }
          warp_merge_partial(m, s);
          if (lane == 0) {
            token_stats[gi][0] = m;
            token_stats[gi][1] = s;
          }
        }
        __syncthreads();
      }
      float acc[kHeadBlock];
#pragma unroll
      for (int gi = 0; gi < kHeadBlock; ++gi) acc[gi] = 0.0F;
      if (r < rows) {
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
        if (part == 0) {
#pragma unroll
          for (int gi = 0; gi < kHeadBlock; ++gi) {
            float sum = part_sums[gi * geo.tile_rows + r];
            for (int p = 1; p < geo.parts; ++p) sum += part_sums[(p * kHeadBlock + gi) * geo.tile_rows + r];
            acc[gi] = sum;
          }
        }
      }

      float logit[kHeadBlock];
#pragma unroll
      for (int gi = 0; gi < kHeadBlock; ++gi) {
        logit[gi] = owner && !outlier ? d.softmax_scale * acc[gi] : kNegativeInfinity;
        if (owner && g0 + gi < d.group && mode != kStatistics) {
          const long long j = static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * d.group + g0 + gi;
          float* out = logits + j * d.max_chunks + tile * geo.tile_rows + r;
          if (mode == kLogits) {
            *out = logit[gi];
          } else if (outlier) {
            *out = -1.0F;  // marks a non-candidate for kernel 2 (probabilities are >= 0)
          } else {
            const float p = expf(logit[gi] - token_stats[gi][0]) / token_stats[gi][1];
            *out = token == 0 ? p : *out + p;
          }
        }
      }

      if (mode == kStatistics || (mode == kLogits && geo.write_partials)) {
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
          float* partial = scores + (static_cast<long long>(b) * d.kv_heads + h) * d.max_chunks +
                           (static_cast<long long>(g0 + gi) * geo.tiles + tile) * 2;
          partial[0] = tile_m;
          partial[1] = tile_s;
        }
      }
    }
    if (!has_next) break;
    __syncthreads();  // this stage, q_shared, part_sums and warp_partials are reused
    tile = next;
    outlier = next_outlier;
  }
}

// -----------------------------------------------------------------------------------------------------------------
// Kernel 1b: scores of one tile of chunks, spread over the whole GPU (kernel 2 runs only B*Hkv CTAs).

constexpr int kScoreThreads = 256;  // one chunk a thread

/// Grid (ceil(max_chunks / 256), Hkv, B). With `probabilities` 0 the logits rows hold logits and the scores row the
/// tile partials of kernel 1; with 1 they hold the probabilities summed over tokens (-1 for non-candidates).
/// Writes score(c) = max_j p_j(c) into logits row 0 of the group, in place, or -1 for a non-candidate.
__global__ void __launch_bounds__(kScoreThreads) score_kernel(const dims d, const layer_view* views,
                                                              const int* batch_slots, const int layer,
                                                              const int tile_rows, const int tiles,
                                                              const int probabilities, float* logits,
                                                              const float* scores) {
  extern __shared__ float offsets[];  // [G]: p_j(c) = exp2(x * log2(e) - offsets[j])
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int n = context_chunks_of(view, d);
  const int c = blockIdx.x * kScoreThreads + threadIdx.x;
  if (blockIdx.x * kScoreThreads >= n) return;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const long long head_row = static_cast<long long>(b) * d.kv_heads + h;
  float* logits_group = logits + (static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * d.group) * d.max_chunks;
  if (!probabilities) {
    const int used_tiles = (n + tile_rows - 1) / tile_rows;
    for (int g = warp; g < d.group; g += kScoreThreads / 32) {
      float m = kNegativeInfinity;
      float s = 0.0F;
      const float* partial = scores + head_row * d.max_chunks + static_cast<long long>(g) * tiles * 2;
      for (int t = lane; t < used_tiles; t += 32) merge_partial(m, s, partial[2 * t], partial[2 * t + 1]);
      warp_merge_partial(m, s);
      // p_j(c) = exp(x - M) / Z = exp2(x * log2(e) - offset); exp2 is monotonic, so the max over j can be taken on
      // the arguments: one exp per chunk instead of one per query head.
      if (lane == 0) offsets[g] = m * kLog2e + log2f(s);
    }
    __syncthreads();
  }
  if (c >= n) return;
  float best = probabilities ? 0.0F : kNegativeInfinity;
  float sum = 0.0F;  // group_mean: the probabilities' sum (an exp per head: the max's one-exp shortcut does not apply)
  bool candidate = false;
#pragma unroll 4
  for (int g = 0; g < d.group; ++g) {
    const float x = logits_group[static_cast<long long>(g) * d.max_chunks + c];
    if (g == 0) candidate = probabilities ? x >= 0.0F : x != kNegativeInfinity;
    if (d.group_mean != 0) {
      sum += probabilities ? x : exp2f(fmaf(x, kLog2e, -offsets[g]));
    } else {
      best = fmaxf(best, probabilities ? x : fmaf(x, kLog2e, -offsets[g]));
    }
  }
  const float score = d.group_mean != 0 ? sum / static_cast<float>(d.group) : (probabilities ? best : exp2f(best));
  logits_group[c] = candidate ? score : -1.0F;
}

// -----------------------------------------------------------------------------------------------------------------
// Kernel 2: normalise, score, top-k, cache update for one (b, h).

/// Where kernel 2 gets p_j(c) from.
enum select_mode : int {
  kFromScores = 0,  ///< kernel 1b left score(c) in logits row 0 (-1 for non-candidates)
  kFromLogits = 1,  ///< logits rows, no partials (they did not fit): normalisers computed here
  kInKernel = 2,    ///< several tokens, partials do not fit: everything computed here (slow, rare)
};

struct select_geometry {
  int mode;            ///< select_mode
  int keys_in_shared;  ///< 1: per-chunk keys in dynamic shared memory at keys_offset; 0: in the first logits row
  int keys_offset;     ///< bytes
  int q_floats;        ///< shared floats reserved for one query row (several-token path only)
  int tile_rows;       ///< kernel 1's tile, for the partials
  int tiles;           ///< kernel 1's tiles over max_chunks
};

using select_scan = cub::BlockScan<unsigned long long, kSelectThreads, cub::BLOCK_SCAN_WARP_SCANS>;
/// select_kernel's static shared arrays, in the order it declares them.
constexpr std::size_t kSelectStaticShared = sizeof(select_scan::TempStorage) + sizeof(unsigned) * (1U << kRadixFirstBits) +
                                            sizeof(float) * (2 * kSelectWarps + 2) + sizeof(unsigned) * 2 * kSelectWarps +
                                            sizeof(unsigned) * 3 + sizeof(int);
static_assert(kSelectStaticShared + 256 <= kSharedMargin, "kSharedMargin must cover select_kernel's static shared memory");


/// (max, sum exp(x - max)) of row[0, n) over the block; -inf entries are left out. Called by every thread.
__device__ void block_softmax_partial(const float* row, int n, float* scratch, float& out_m, float& out_s) {
  float m = kNegativeInfinity;
  float s = 0.0F;
  for (int c = threadIdx.x; c < n; c += kSelectThreads) {
    const float x = row[c];
    if (x > m) {
      s = s * expf(m - x) + 1.0F;
      m = x;
    } else if (x != kNegativeInfinity) {
      s += expf(x - m);
    }
  }
  warp_merge_partial(m, s);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) {
    scratch[2 * warp] = m;
    scratch[2 * warp + 1] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = scratch[2 * lane];
    s = scratch[2 * lane + 1];
    warp_merge_partial(m, s);
    if (lane == 0) {
      scratch[2 * kSelectWarps] = m;
      scratch[2 * kSelectWarps + 1] = s;
    }
  }
  __syncthreads();
  out_m = scratch[2 * kSelectWarps];
  out_s = scratch[2 * kSelectWarps + 1];
}

template <typename T>
__global__ void __launch_bounds__(kSelectThreads, 1) select_kernel(const dims d, const layer_view* views,
                                                                   const int* batch_slots, const int layer,
                                                                   const strided_tensor queries, const int tokens,
                                                                   const step_workspace ws, const select_geometry geo) {
  __shared__ typename select_scan::TempStorage scan_storage;
  __shared__ unsigned histogram[1 << kRadixFirstBits];
  __shared__ float scratch[2 * kSelectWarps + 2];
  __shared__ unsigned pass_scratch[2 * kSelectWarps];
  __shared__ unsigned radix_found[3];  // digit, items before its bin, items in its bin
  __shared__ int candidate_count;
  extern __shared__ __align__(16) unsigned char select_shared[];

  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int group = d.group;
  const int mc = d.max_chunks;
  const int k = d.budget;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int n = context_chunks_of(view, d);
  const long long head_row = static_cast<long long>(b) * d.kv_heads + h;

  // Plain (not restrict) pointers: several of these rows are written and re-read within the kernel.
  float* scores_row = ws.scores + head_row * mc;
  float* logits_group = ws.logits + (static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * group) * mc;
  const std::uint8_t* outlier = view->is_outlier + static_cast<long long>(h) * mc;
  int* cache = view->cache_chunks + static_cast<long long>(h) * k;
  int* slot_of = view->slot_of_chunk + static_cast<long long>(h) * mc;
  int* selected = ws.selected + head_row * k;
  int* miss_slots = ws.miss_slots + head_row * k;

  float* stat_max = reinterpret_cast<float*>(select_shared);  // [G]
  float* stat_sum = stat_max + group;                           // [G]
  float* q_shared = stat_sum + group;                           // [q_floats]
  unsigned* keys = geo.keys_in_shared ? reinterpret_cast<unsigned*>(select_shared + geo.keys_offset)
                                      : reinterpret_cast<unsigned*>(logits_group);

  // --- A. per-query-head normalisers, or (several tokens) the summed probabilities in the logits rows -------------
  // probabilities: the rows hold p_j(c) already (-1 for non-candidates); kFromScores: one row, max taken already.
  const bool probabilities = geo.mode != kFromLogits;
  const int rows = geo.mode == kFromScores ? 1 : group;
  if (geo.mode == kInKernel) {
    const T* landmarks = static_cast<const T*>(view->landmarks) + static_cast<long long>(h) * mc * d.head_dim;
    for (int g = 0; g < group; ++g) {
      float* accumulated = logits_group + static_cast<long long>(g) * mc;
      for (int t = 0; t < tokens; ++t) {
        __syncthreads();  // q_shared and scores_row (the per-token logits) are reused
        const long long j = static_cast<long long>(h) * group + g;
        for (int e = tid; e < d.head_dim; e += kSelectThreads) {
          q_shared[e] = load_any(queries.data, queries.type,
                                 b * queries.stride[0] + t * queries.stride[1] + j * queries.stride[2] + e * queries.stride[3]);
        }
        __syncthreads();
        for (int c = warp; c < n; c += kSelectWarps) {
          float logit = kNegativeInfinity;
          if (outlier[c] == 0) {  // uniform across the warp
            const T* row = landmarks + static_cast<long long>(c) * d.head_dim;
            float acc = 0.0F;
            for (int e = lane; e < d.head_dim; e += 32) acc = fmaf(q_shared[e], to_float(row[e]), acc);
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffU, acc, offset);
            logit = d.softmax_scale * acc;
          }
          if (lane == 0) scores_row[c] = logit;
        }
        __syncthreads();
        float m;
        float s;
        block_softmax_partial(scores_row, n, scratch, m, s);
        for (int c = tid; c < n; c += kSelectThreads) {
          const float x = scores_row[c];
          if (x == kNegativeInfinity) {
            accumulated[c] = -1.0F;  // non-candidate marker, as kernel 1's kAccumulate writes it
          } else {
            const float p = expf(x - m) / s;
            accumulated[c] = t == 0 ? p : accumulated[c] + p;
          }
        }
      }
    }
  } else if (geo.mode == kFromLogits) {
    for (int g = 0; g < group; ++g) {
      float m;
      float s;
      block_softmax_partial(logits_group + static_cast<long long>(g) * mc, n, scratch, m, s);
      if (tid == 0) {
        stat_max[g] = m;
        stat_sum[g] = s;
      }
    }
  }
  if (tid == 0) candidate_count = 0;
  __syncthreads();
  // As in kernel 1b: p_j(c) = exp2(x * log2(e) - offset_j), offset_j = M_j * log2(e) + log2(Z_j).
  float* offset = stat_max;
  if (!probabilities) {
    for (int g = tid; g < group; g += kSelectThreads) offset[g] = stat_max[g] * kLog2e + log2f(stat_sum[g]);
  }
  __syncthreads();

  // --- B. score(c) = max_j p_j(c); key = float bits + 1 for candidates (scores are >= 0), 0 for the others ---------
  // Non-candidates are known from row 0 (logit -inf, or probability -1), so every load is unconditional and
  // kScoreBatch chunks x G rows of loads are in flight together (keys may alias logits row 0: stores come last).
  // The radix select's first histogram (top 12 bits of every key) is counted here, saving a pass over the keys.
  for (int i = tid; i < (1 << kRadixFirstBits); i += kSelectThreads) histogram[i] = 0;
  __syncthreads();
  int my_candidates = 0;
  for (int base = 0; base < n; base += kSelectThreads * kScoreBatch) {
    // max_j of the exp2 argument or of the probability; with group_mean (and more than one row) the probabilities'
    // sum. A single row (kFromScores) is score(c) already.
    const bool sum_rows = d.group_mean != 0 && rows > 1;
    float best[kScoreBatch];
    bool candidate[kScoreBatch];
#pragma unroll
    for (int i = 0; i < kScoreBatch; ++i) {
      candidate[i] = false;
      best[i] = probabilities || sum_rows ? 0.0F : kNegativeInfinity;
    }
#pragma unroll 4
    for (int g = 0; g < rows; ++g) {
      const float* row = logits_group + static_cast<long long>(g) * mc;
      const float shift = probabilities ? 0.0F : offset[g];
#pragma unroll
      for (int i = 0; i < kScoreBatch; ++i) {
        const int c = base + i * kSelectThreads + tid;
        const float x = c < n ? row[c] : kNegativeInfinity;
        if (g == 0) candidate[i] = probabilities ? x >= 0.0F : x != kNegativeInfinity;
        if (sum_rows) {
          best[i] += probabilities ? x : exp2f(fmaf(x, kLog2e, -shift));
        } else {
          best[i] = fmaxf(best[i], probabilities ? x : fmaf(x, kLog2e, -shift));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kScoreBatch; ++i) {
      const int c = base + i * kSelectThreads + tid;
      if (c < n) {
        const float combined = sum_rows ? best[i] / static_cast<float>(rows)
                                        : (probabilities ? best[i] : exp2f(best[i]));
        const float score = candidate[i] ? combined : 0.0F;
        my_candidates += candidate[i] ? 1 : 0;
        scores_row[c] = score;
        const unsigned key = candidate[i] ? __float_as_uint(score) + 1U : 0U;
        keys[c] = key;
        atomicAdd(&histogram[key >> (32 - kRadixFirstBits)], 1U);
      }
    }
  }
  my_candidates = __reduce_add_sync(0xffffffffU, my_candidates);
  if (lane == 0 && my_candidates > 0) atomicAdd(&candidate_count, my_candidates);
  __syncthreads();
  const int candidates = candidate_count;
  const int take = min(k, candidates);

  // --- C. the take-th largest key: MSB-first radix select, digits of 12, 11 and 9 bits -----------------------
  // 12 bits first (exponent and 3 mantissa bits) spread probabilities over many bins, so plain shared atomics rarely
  // collide; after it only a few dozen keys still match the prefix. Selection rule afterwards:
  // (key & mask) > prefix, or == prefix for the first need_ties items in id order.
  unsigned prefix = 0;
  unsigned mask = 0xffffffffU;
  unsigned need_ties = 0;
  if (candidates > k) {
    mask = 0;
    unsigned remaining = static_cast<unsigned>(k);
    for (int pass = 0; pass < 3; ++pass) {
      const int bits = pass == 0 ? kRadixFirstBits : (pass == 1 ? 11 : 9);
      const int shift = pass == 0 ? 32 - kRadixFirstBits : (pass == 1 ? 9 : 0);
      const int bins = 1 << bits;
      const unsigned digit_mask = static_cast<unsigned>(bins - 1);
      if (pass > 0) {  // the first histogram was counted with the keys
        for (int i = tid; i < bins; i += kSelectThreads) histogram[i] = 0;
        __syncthreads();
        for (int c = tid; c < n; c += kSelectThreads) {
          const unsigned key = keys[c];
          if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & digit_mask], 1U);
        }
        __syncthreads();
      }
      // Thread t owns bins bins-1-4t-i (descending); a block scan finds where the count from the top reaches
      // `remaining`.
      unsigned count[4];
      unsigned local = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int index = 4 * tid + i;
        count[i] = index < bins ? histogram[bins - 1 - index] : 0U;
        local += count[i];
      }
      unsigned long long before_wide;
      select_scan(scan_storage).ExclusiveSum(static_cast<unsigned long long>(local), before_wide);
      unsigned before = static_cast<unsigned>(before_wide);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (before < remaining && before + count[i] >= remaining) {
          radix_found[0] = static_cast<unsigned>(bins - 1 - (4 * tid + i));
          radix_found[1] = before;
          radix_found[2] = count[i];
        }
        before += count[i];
      }
      __syncthreads();
      prefix |= radix_found[0] << shift;
      mask |= digit_mask << shift;
      remaining -= radix_found[1];
      if (radix_found[2] == remaining) break;  // the whole bin is taken: no tie to break below this digit
    }
    need_ties = remaining;
  }

  // --- D. ascending compaction of the selection; keys[c] becomes the "selected" flag ----------------------------
  ordered_pass(
      n, pass_scratch,
      [&](int c) -> unsigned {
        const unsigned masked = keys[c] & mask;
        return (masked > prefix ? 1U : 0U) | (masked == prefix ? 2U : 0U);
      },
      [&](int c, unsigned f, unsigned above_before, unsigned ties_before) {
        const bool taken = (f & 1U) != 0 || ((f & 2U) != 0 && ties_before < need_ties);
        if (taken) selected[above_before + min(ties_before, need_ties)] = c;
        keys[c] = taken ? 1U : 0U;
      });
  for (int i = take + tid; i < k; i += kSelectThreads) selected[i] = -1;
  __syncthreads();

  // --- E. temporal cache ---------------------------------------------------------------------------------------
  // E1: free every slot whose chunk is not selected (hits stay where they are).
  for (int s = tid; s < k; s += kSelectThreads) {
    const int old = cache[s];
    if (old < 0) continue;
    const bool hit = old < n && keys[old] != 0;
    if (!hit) {
      cache[s] = -1;
      if (old < mc && slot_of[old] == s) slot_of[old] = -1;
    }
  }
  __syncthreads();
  // E2: free slots in ascending order, parked in miss_slots (miss m takes the m-th free slot).
  const unsigned free_slots =
      ordered_pass(k, pass_scratch, [&](int s) -> unsigned { return cache[s] < 0 ? 1U : 0U; },
                   [&](int s, unsigned f, unsigned before, unsigned) {
                     if (f != 0) miss_slots[before] = s;
                   })
          .x;
  // E3: misses in ascending chunk id take those slots. A miss's flag reads only its own chunk's slot_of entry
  // (still -1) and hits' slots, which no emit writes, so both passes agree.
  const unsigned misses = ordered_pass(
                              take, pass_scratch,
                              [&](int i) -> unsigned {
                                const int c = selected[i];
                                const int s = slot_of[c];
                                return s >= 0 && s < k && cache[s] == c ? 0U : 1U;
                              },
                              [&](int i, unsigned f, unsigned before, unsigned) {
                                if (f == 0 || before >= free_slots) return;
                                const int c = selected[i];
                                const int s = miss_slots[before];
                                cache[s] = c;
                                slot_of[c] = s;
                              })
                              .x;
  const int filled = static_cast<int>(min(misses, free_slots));
  for (int m = filled + tid; m < k; m += kSelectThreads) miss_slots[m] = -1;
  if (tid == 0) {
    ws.miss_counts[head_row] = filled;
    atomicAdd(ws.counters + 0, static_cast<unsigned long long>(take - filled));
    atomicAdd(ws.counters + 1, static_cast<unsigned long long>(filled));
    if (h == 0) atomicAdd(ws.counters + 2, 1ULL);
  }
}

// -----------------------------------------------------------------------------------------------------------------
// Host side.

struct device_limits {
  int optin_shared;  ///< bytes of shared memory a block may opt in to
  int multiprocessors;
};

device_limits current_device_limits() {
  int device = 0;
  SHADOWKV_CUDA_TRY(cudaGetDevice(&device));
  device_limits limits{};
  SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&limits.optin_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&limits.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  return limits;
}

template <typename Kernel>
void allow_shared(Kernel kernel, long long bytes) {
  // A host-side attribute, legal while a stream is being captured; needed when the dynamic bytes and the kernel's
  // static shared memory (at most kSharedMargin) together pass the 48 KiB default. (Testing the dynamic bytes alone
  // let the select kernel launch with 33 KiB dynamic + 17 KiB static at 65536-token contexts: cudaErrorInvalidValue.)
  if (bytes + kSharedMargin > kDefaultSharedLimit) {
    SHADOWKV_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

logit_geometry plan_logits(const dims& d, int element_bytes) {
  logit_geometry geo{};
  const int row_bytes = d.head_dim * element_bytes;
  geo.vectors = (row_bytes + 15) / 16;
  geo.row_stride = geo.vectors * 16 + 16;
  geo.tile_rows = 128;
  while (geo.tile_rows > 8 && geo.tile_rows * geo.row_stride > kLogitTileBudget) geo.tile_rows /= 2;
  geo.parts = kLogitThreads / geo.tile_rows;
  geo.tiles = (d.max_chunks + geo.tile_rows - 1) / geo.tile_rows;
  geo.write_partials = 2LL * d.group * geo.tiles <= d.max_chunks ? 1 : 0;
  return geo;
}

template <typename T, int kHeadBlock>
void launch_logits(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                   const strided_tensor& queries, int tokens, const logit_geometry& geo, const step_workspace& ws,
                   const device_limits& limits, cudaStream_t stream) {
  constexpr int kElements = vector16<T>::elements;
  const long long shared = 2LL * geo.tile_rows * geo.row_stride + 4LL * kHeadBlock * geo.vectors * kElements +
                           (geo.parts > 1 ? 4LL * geo.parts * kHeadBlock * geo.tile_rows : 0LL);
  SHADOWKV_EXPECTS(shared + 1024 <= limits.optin_shared, "chunk selection: head_dim ", d.head_dim,
                   " needs more shared memory than the device has");
  auto kernel = landmark_logits_kernel<T, kHeadBlock>;
  allow_shared(kernel, shared);
  // Tiles per CTA: about one wave of resident CTAs when every chunk is live. Depends on dims, batch and the device
  // only, never on the context lengths (the step stays capturable).
  int resident = 0;
  SHADOWKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kLogitThreads,
                                                                  static_cast<size_t>(shared)));
  const long long slots = static_cast<long long>(limits.multiprocessors) * (resident > 0 ? resident : 1);
  const long long work = static_cast<long long>(batch) * d.kv_heads * geo.tiles;
  const long long per_cta = std::min<long long>(std::max<long long>((work + slots - 1) / slots, 1), kMaxTilesPerCta);
  const dim3 grid(static_cast<unsigned>((geo.tiles + per_cta - 1) / per_cta), static_cast<unsigned>(d.kv_heads),
                  static_cast<unsigned>(batch));
  auto launch = [&](int mode, int token) {
    kernel<<<grid, kLogitThreads, static_cast<size_t>(shared), stream>>>(d, views, batch_slots, layer, queries, geo,
                                                                        mode, token, ws.logits, ws.scores);
    SHADOWKV_CUDA_CHECK_LAUNCH();
  };
  if (tokens == 1) {
    launch(kLogits, 0);
  } else {
    for (int t = 0; t < tokens; ++t) {
      launch(kStatistics, t);
      launch(kAccumulate, t);
    }
  }
}

template <typename T>
constexpr int kv_type_of() {
  if constexpr (std::is_same_v<T, float>) {
    return element_f32;
  } else if constexpr (std::is_same_v<T, __half>) {
    return element_f16;
  } else {
    return element_bf16;
  }
}

template <typename T>
void launch_for_type(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                     const strided_tensor& queries, int tokens, const step_workspace& ws, int beside_ctas,
                     cudaStream_t stream) {
  const device_limits limits = current_device_limits();
  const logit_geometry logit_geo = plan_logits(d, static_cast<int>(sizeof(T)));
  select_geometry geo{};
  if (logit_geo.write_partials) {
    geo.mode = kFromScores;
  } else {
    geo.mode = tokens == 1 ? kFromLogits : kInKernel;
  }
  // Decode with partials: the streaming kernel of landmark_logits.cu where it covers the shape.
  const bool decode_kernel = tokens == 1 && geo.mode == kFromScores && logit_geo.tiles > 0 &&
                             launch_decode_landmark_logits(d, kv_type_of<T>(), views, batch_slots, layer, batch,
                                                           queries, logit_geo.tile_rows, logit_geo.tiles,
                                                           limits.multiprocessors, beside_ctas, ws.logits, ws.scores,
                                                           stream);
  if (!decode_kernel && geo.mode != kInKernel && logit_geo.tiles > 0) {
    if (d.group == 1) {
      launch_logits<T, 1>(d, views, batch_slots, layer, batch, queries, tokens, logit_geo, ws, limits, stream);
    } else if (d.group == 2) {
      launch_logits<T, 2>(d, views, batch_slots, layer, batch, queries, tokens, logit_geo, ws, limits, stream);
    } else if (d.group <= 4) {
      launch_logits<T, 4>(d, views, batch_slots, layer, batch, queries, tokens, logit_geo, ws, limits, stream);
    } else {
      launch_logits<T, 8>(d, views, batch_slots, layer, batch, queries, tokens, logit_geo, ws, limits, stream);
    }
  }

  if (geo.mode == kFromScores && d.max_chunks > 0) {
    const dim3 score_grid(static_cast<unsigned>((d.max_chunks + kScoreThreads - 1) / kScoreThreads),
                          static_cast<unsigned>(d.kv_heads), static_cast<unsigned>(batch));
    const long long score_shared = 4LL * d.group;
    allow_shared(score_kernel, score_shared);
    score_kernel<<<score_grid, kScoreThreads, static_cast<size_t>(score_shared), stream>>>(
        d, views, batch_slots, layer, logit_geo.tile_rows, logit_geo.tiles, tokens > 1 ? 1 : 0, ws.logits, ws.scores);
    SHADOWKV_CUDA_CHECK_LAUNCH();
  }

  geo.q_floats = geo.mode == kInKernel ? (d.head_dim + 3) / 4 * 4 : 0;
  geo.tile_rows = logit_geo.tile_rows;
  geo.tiles = logit_geo.tiles;
  const long long base = (2LL * d.group + geo.q_floats) * 4;
  geo.keys_offset = static_cast<int>((base + 15) / 16 * 16);
  const int limit = limits.optin_shared - kSharedMargin;
  SHADOWKV_EXPECTS(base <= limit, "chunk selection: group ", d.group, " and head_dim ", d.head_dim,
                   " need more shared memory than the device has");
  const long long with_keys = geo.keys_offset + 4LL * d.max_chunks;
  geo.keys_in_shared = with_keys <= limit ? 1 : 0;
  const long long shared = geo.keys_in_shared ? with_keys : base;
  auto kernel = select_kernel<T>;
  allow_shared(kernel, shared);
  const dim3 grid(static_cast<unsigned>(d.kv_heads), static_cast<unsigned>(batch));
  kernel<<<grid, kSelectThreads, static_cast<size_t>(shared), stream>>>(d, views, batch_slots, layer, queries, tokens,
                                                                       ws, geo);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_select_chunks(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                          strided_tensor queries, int tokens, const step_workspace& workspace, int beside_ctas,
                          cudaStream_t stream) {
  SHADOWKV_EXPECTS(batch >= 0, "chunk selection: batch must be >= 0, got ", batch);
  if (batch == 0) return;
  SHADOWKV_EXPECTS(tokens >= 1, "chunk selection: tokens must be >= 1, got ", tokens);
  SHADOWKV_EXPECTS(d.kv_heads >= 1 && d.group >= 1 && d.q_heads == d.kv_heads * d.group,
                   "chunk selection: q_heads must be kv_heads * group");
  SHADOWKV_EXPECTS(d.head_dim >= 1 && d.budget >= 1 && d.max_chunks >= 0,
                   "chunk selection: head_dim and budget must be >= 1, max_chunks >= 0");
  SHADOWKV_EXPECTS(queries.type == element_f32 || queries.type == element_f16 || queries.type == element_bf16,
                   "chunk selection: unknown query element type ", queries.type);
  shadowkv_dispatch_element(kv_type, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_for_type<T>(d, views, batch_slots, layer, batch, queries, tokens, workspace, std::max(beside_ctas, 0),
                       stream);
  });
}

}  // namespace shadowkv::cuda
