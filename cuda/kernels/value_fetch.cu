// The value fetch of a decode step (value_fetch.cuh): a persistent grid that walks the missed runs.
//
// (Session 17 measured a rewrite that resolved 32 misses a warp at once and kept 4 KiB a warp in flight: slower at
// every shape, docs/performance.md, "Session 17"; this is the kernel that was in chunk_rebuild.cu until then.)
#include "value_fetch.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/dependent_launch.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/fp8_vectors.cuh"
#include "common/phase_stamps.cuh"
#include "cuda_check.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/fp8.hpp"

namespace shadowkv::cuda {
namespace {

constexpr int kFetchWarps = 8;  // per CTA of the value fetch

// A persistent grid of few CTAs (launch_fetch_values): the work is the flat list of (entry, head, miss) items, pair-
// major (pair = entry * Hkv + head), taken kItemsPerWarp at a time: unit u is items u * kItemsPerWarp ... of one pair
// (a pair's items are rounded up to whole units), and warp w of the grid takes units w, w + warps, ...; its lanes
// split into kItemsPerWarp groups, one missed chunk (a contiguous run of C*D values) each, 16-byte reads. Units past a
// pair's miss count are skipped in one jump to the next pair. The grid is small on purpose: a zero-copy read across
// PCIe keeps its warp resident for microseconds, so a grid as large as the batch (one CTA per pair, as before) held
// every multiprocessor for the whole fetch and slowed the key rebuild beside it 2.6x (docs/performance.md). fp8 runs are
// half as long (1 KiB at C = 8, D = 128), so a warp takes two of them: 2 KiB of loads in flight a warp either way.
template <typename T, int kItemsPerWarp>
__global__ void fetch_values_kernel(dims d, layer_view* views, const int* batch_slots, int layer, int batch,
                                    step_workspace workspace) {
  start_phase_stamps(stamped_kernel::fetch);  // (common/phase_stamps.cuh: empty unless built to measure)
  constexpr int kLanes = 32 / kItemsPerWarp;  // lanes per item
  const int lane = threadIdx.x % kLanes;
  const int sub = (threadIdx.x % 32) / kLanes;  // which of the unit's items this lane copies
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  const long long units_per_pair = (d.budget + kItemsPerWarp - 1) / kItemsPerWarp;
  const long long units = static_cast<long long>(batch) * d.kv_heads * units_per_pair;
  const long long run = static_cast<long long>(d.chunk) * d.head_dim;  // elements
  const bool vectorised = (run * sizeof(T)) % 16 == 0;
  long long unit = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  while (unit < units) {
    const long long pair = unit / units_per_pair;
    const int first = static_cast<int>(unit - pair * units_per_pair) * kItemsPerWarp;
    const int misses = workspace.miss_counts[pair];
    // The warp's first unit of the next pair: the smallest unit + j * warps at or past (pair + 1) * units_per_pair.
    const auto next_pair_unit = [&] { return unit + ((pair + 1) * units_per_pair - unit + warps - 1) / warps * warps; };
    if (first >= misses) {
      unit = next_pair_unit();
      continue;
    }
    const int b = static_cast<int>(pair / d.kv_heads);
    const int h = static_cast<int>(pair - static_cast<long long>(b) * d.kv_heads);
    const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
    if (first == 0 && threadIdx.x % 32 == 0) {
      const unsigned long long run_bytes = d.value_fp8 != 0 ? run + sizeof(float) : run * sizeof(T);
      atomicAdd(workspace.counters + 3, static_cast<unsigned long long>(misses) * run_bytes);
    }
    const int m = first + sub;
    if (m < misses) {
      const int slot = workspace.miss_slots[pair * d.budget + m];  // k entries per pair, slots in [0, K)
      const int chunk = view->cache_chunks[static_cast<long long>(h) * d.cache_slots + slot];
      const value_runs source = value_runs_of(*view, chunk);  // a forked sequence reads its prompt's shared runs
      const long long source_run = source.chunk * d.kv_heads + h;
      T* target = static_cast<T*>(view->cache_values) + (static_cast<long long>(h) * d.cache_slots + slot) * run;
      if (d.value_fp8 != 0) {
        // 16 codes (16 bytes) a lane at a time, dequantized and rounded to T (shadowkv/fp8.hpp), stored as 16-byte
        // vectors (16 * sizeof(T) bytes a lane).
        const float scale = source.scales[source_run];
        const auto* from = static_cast<const std::uint8_t*>(source.store) + source_run * run;
        if (run % 16 == 0) {
          // Four 16-byte loads a lane in flight before any store (the source is host memory across PCIe): a 1 KiB
          // run (C = 8, D = 128) in one round trip of 16 lanes.
          constexpr long long kStride = 16LL * kLanes;
          constexpr int kLoads = 4;
          for (long long i0 = 16LL * lane; i0 < run; i0 += kLoads * kStride) {
            uint4 packed[kLoads];
#pragma unroll
            for (int u = 0; u < kLoads; ++u) {
              if (i0 + u * kStride < run) packed[u] = *reinterpret_cast<const uint4*>(from + i0 + u * kStride);
            }
#pragma unroll
            for (int u = 0; u < kLoads; ++u) {
              if (i0 + u * kStride >= run) break;
              float codes[16];
              decode_e4m3x16(packed[u], codes);  // integer decode, equal to fp8::decode_e4m3 (common/fp8_vectors.cuh)
              union {
                uint4 vectors[sizeof(T)];
                T elements[16];
              } decoded;
#pragma unroll
              for (int k = 0; k < 16; ++k) decoded.elements[k] = from_float<T>(codes[k] * scale);
              auto* to = reinterpret_cast<uint4*>(target + i0 + u * kStride);
#pragma unroll
              for (int v = 0; v < static_cast<int>(sizeof(T)); ++v) to[v] = decoded.vectors[v];
            }
          }
        } else {
          for (long long i = lane; i < run; i += kLanes) target[i] = from_float<T>(fp8::decode_e4m3(from[i]) * scale);
        }
      } else if (vectorised) {
        // Four 16-byte loads a lane in flight before any store: a 2 KiB run (C = 8, D = 128, bf16) in one round trip.
        const long long vectors = run * static_cast<long long>(sizeof(T)) / 16;
        const int4* from = reinterpret_cast<const int4*>(static_cast<const T*>(source.store) + source_run * run);
        int4* to = reinterpret_cast<int4*>(target);
        for (long long i0 = lane; i0 < vectors; i0 += 4 * kLanes) {
          int4 loaded[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (i0 + kLanes * u < vectors) loaded[u] = from[i0 + kLanes * u];
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (i0 + kLanes * u < vectors) to[i0 + kLanes * u] = loaded[u];
          }
        }
      } else {
        const T* from = static_cast<const T*>(source.store) + source_run * run;
        for (long long i = lane; i < run; i += kLanes) target[i] = from[i];
      }
    }
    unit += warps;
  }
  finish_phase_stamps(stamped_kernel::fetch, 79);
}

}  // namespace

void launch_fetch_values(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, int ctas, int priority, cudaStream_t stream) {
  SHADOWKV_EXPECTS(batch >= 0 && ctas >= 1, "value fetch: batch must be >= 0 and ctas >= 1, got batch ", batch,
                   ", ctas ", ctas);
  SHADOWKV_EXPECTS(d.budget >= 1 && d.cache_slots >= d.budget,
                   "value fetch: need budget >= 1 and cache_slots >= budget, got budget ", d.budget, ", cache_slots ",
                   d.cache_slots);
  if (batch == 0) return;
  // No more CTAs than there are items for their warps (8 a CTA).
  const long long items = static_cast<long long>(batch) * d.kv_heads * d.budget;
  const auto grid = static_cast<unsigned>(std::min<long long>(ctas, (items + kFetchWarps - 1) / kFetchWarps));
  // A plain launch (the fetch starts no programmatic chain), with the caller's priority if it gave one: the block
  // scheduler then places the fetch's CTAs before the pending CTAs of the kernels beside it (docs/performance.md; session 13).
  cudaLaunchAttribute sooner{};
  sooner.id = cudaLaunchAttributePriority;
  sooner.val.priority = priority;
  const int attributes = priority != 0 ? 1 : 0;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* kernel = d.value_fp8 != 0 ? fetch_values_kernel<T, 2> : fetch_values_kernel<T, 1>;
    launch_after_prior_grid_with(&sooner, attributes, kernel, dim3(grid), dim3(32 * kFetchWarps), 0, stream, false, d,
                                 views, batch_slots, layer, batch, workspace);
  });
}

}  // namespace shadowkv::cuda
