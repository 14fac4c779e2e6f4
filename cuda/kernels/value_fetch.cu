// The value fetch of a decode step (value_fetch.cuh): a persistent grid that walks the missed runs.
//
// Work: the (entry, head, miss) items (pair = entry * Hkv + head). A *unit* is up to `unit_items` consecutive misses
// of one pair (a power of two <= 32, so that a unit's items fit one warp's lanes), numbered rank-major (unit u is rank
// u / pairs of pair u % pairs); warp w of the grid takes units w, w + warps, ...; units past a pair's miss count are
// skipped. A warp first resolves its unit's items at once, one a lane (miss slot -> cached chunk -> source run, and the
// fp8 scale), then streams the unit's runs as one flat array of 16-byte vectors, kLoads a lane in flight before any
// is stored, each lane finding its vector's run by a shuffle from the lane that resolved it.
//
// Why so (bench/NOTES.md, session 17): the previous kernel gave each warp one or two runs at a time, each behind its
// own chain of four dependent loads (miss count, slot, chunk, then the run across PCIe), so a warp had 2 KiB in
// flight for a fraction of its time and 33 CTAs reached ~45 GB/s of fp8 runs only by holding ~0.5 MiB of slow loads
// in their multiprocessors, which slowed the kernels beside them there by 40-85%.
#include "value_fetch.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/dependent_launch.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/fp8_vectors.cuh"
#include "cuda_check.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {
namespace {

constexpr int kFetchWarps = 8;      ///< per CTA
constexpr int kLoads = 8;           ///< 16-byte loads a lane has in flight: 4 KiB a warp
constexpr int kMaxUnitItems = 32;   ///< a unit's items are resolved one a lane
constexpr unsigned kFullWarp = 0xFFFFFFFFU;

// kFp8: dims::value_fp8 (the value store holds e4m3 codes). At most 80 registers, so that a fetch CTA fits beside two
// of the tensor-core attention's (176 registers x 128 threads each).
template <typename T, bool kFp8>
__global__ void __launch_bounds__(kFetchWarps * 32, 3)
    fetch_values_kernel(dims d, layer_view* views, const int* batch_slots, int layer, int batch,
                        step_workspace workspace, int unit_items) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  const long long pairs = static_cast<long long>(batch) * d.kv_heads;
  const long long units = pairs * ((d.budget + unit_items - 1) / unit_items);
  constexpr bool fp8 = kFp8;
  const long long run = static_cast<long long>(d.chunk) * d.head_dim;  // values a run
  const long long run_bytes = fp8 ? run : run * static_cast<long long>(sizeof(T));  // read from the value store
  const int vectors = static_cast<int>(run_bytes / 16);  // a run's 16-byte vectors (launch_fetch_values checks)
  const long long first_unit = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  for (long long unit = first_unit; unit < units; unit += warps) {
    // Units in rank-major order (every pair's first unit, then every pair's second, ...): the misses sit at the
    // front of each pair's list, so the units that hold any come first and spread over all the warps. (Pair-major,
    // a grid whose warp count is a multiple of the units per pair gave every warp the same rank in every pair, and
    // the warps of the late ranks nothing to do.)
    const long long rank = unit / pairs;
    const long long pair = unit - rank * pairs;
    const int first = static_cast<int>(rank) * unit_items;
    const int misses = workspace.miss_counts[pair];
    if (first >= misses) continue;
    const int b = static_cast<int>(pair / d.kv_heads);
    const int h = static_cast<int>(pair - static_cast<long long>(b) * d.kv_heads);
    const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
    if (first == 0 && lane == 0) {
      const unsigned long long bytes = fp8 ? run_bytes + sizeof(float) : run_bytes;
      atomicAdd(workspace.counters + 3, static_cast<unsigned long long>(misses) * bytes);
    }
    if (view->values_in_place != 0) {
      // Attention reads these values from the value store: the bytes are counted (the statistics stay the same
      // whichever way the values are read), nothing is copied.
      continue;
    }
    // The unit's items, one a lane: its buffer slot, its run in the value store and (fp8) its scale.
    const int items = min(unit_items, misses - first);
    int slot = 0;
    long long source_run = 0;
    float scale = 0.0F;
    if (lane < items) {
      slot = workspace.miss_slots[pair * d.budget + first + lane];  // k entries per pair, slots in [0, K)
      const int chunk = view->cache_chunks[static_cast<long long>(h) * d.cache_slots + slot];
      source_run = static_cast<long long>(chunk) * d.kv_heads + h;
      if constexpr (fp8) scale = view->value_scales[source_run];
    }
    const auto* source = static_cast<const std::uint8_t*>(view->value_store);
    T* const target = static_cast<T*>(view->cache_values) + static_cast<long long>(h) * d.cache_slots * run;
    const int total = items * vectors;  // the unit's vectors, item-major
    for (int window = 0; window < total; window += 32 * kLoads) {
      uint4 loaded[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int f = window + 32 * u + lane;
        const int item = min(f / vectors, items - 1);
        const long long from_run = __shfl_sync(kFullWarp, source_run, item);
        if (f < total) {
          loaded[u] = *reinterpret_cast<const uint4*>(source + from_run * run_bytes +
                                                      static_cast<long long>(f - item * vectors) * 16);
        }
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int f = window + 32 * u + lane;
        const int item = min(f / vectors, items - 1);
        const int to_slot = __shfl_sync(kFullWarp, slot, item);
        const float to_scale = fp8 ? __shfl_sync(kFullWarp, scale, item) : 0.0F;
        if (f >= total) continue;
        const long long vector = f - item * vectors;
        if constexpr (fp8) {
          // 16 codes dequantised and rounded to T (shadowkv/fp8.hpp's rule), stored as sizeof(T) 16-byte vectors.
          float codes[16];
          decode_e4m3x16(loaded[u], codes);
          union {
            uint4 vectors[sizeof(T)];
            T elements[16];
          } decoded;
#pragma unroll
          for (int k = 0; k < 16; ++k) decoded.elements[k] = from_float<T>(codes[k] * to_scale);
          auto* to = reinterpret_cast<uint4*>(target + static_cast<long long>(to_slot) * run + vector * 16);
#pragma unroll
          for (int v = 0; v < static_cast<int>(sizeof(T)); ++v) to[v] = decoded.vectors[v];
        } else {
          reinterpret_cast<uint4*>(target + static_cast<long long>(to_slot) * run)[vector] = loaded[u];
        }
      }
    }
  }
}

/// Items a unit, a power of two in [1, 32]: enough runs to fill a warp's loads (kLoads 16-byte vectors a lane), and
/// more while every warp would still get kUnitsPerWarp units if every slot of every pair missed, so that the units
/// stay small next to a warp's share (the grid ends with its most loaded warp) at the hit rates where few miss.
constexpr long long kUnitsPerWarp = 8;
int unit_items_for(long long slots, long long warps, long long run_bytes) {
  int items = 1;
  while (items < kMaxUnitItems && items * run_bytes < 32LL * kLoads * 16) items *= 2;
  while (items < kMaxUnitItems && 2LL * items * kUnitsPerWarp * warps <= slots) items *= 2;
  return items;
}

}  // namespace

void launch_fetch_values(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, int ctas, int priority, cudaStream_t stream) {
  SHADOWKV_EXPECTS(batch >= 0 && ctas >= 1, "value fetch: batch must be >= 0 and ctas >= 1, got batch ", batch,
                   ", ctas ", ctas);
  SHADOWKV_EXPECTS(d.budget >= 1 && d.cache_slots >= d.budget,
                   "value fetch: need budget >= 1 and cache_slots >= budget, got budget ", d.budget, ", cache_slots ",
                   d.cache_slots);
  const long long run = static_cast<long long>(d.chunk) * d.head_dim;
  const long long slots = static_cast<long long>(batch) * d.kv_heads * d.budget;
  if (batch == 0) return;
  // A plain launch (the fetch starts no programmatic chain), with the caller's priority if it gave one: the block
  // scheduler then places the fetch's CTAs before the pending CTAs of the kernels beside it (bench/NOTES.md, session 13).
  cudaLaunchAttribute sooner{};
  sooner.id = cudaLaunchAttributePriority;
  sooner.val.priority = priority;
  const int attributes = priority != 0 ? 1 : 0;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const long long run_bytes = d.value_fp8 != 0 ? run : run * static_cast<long long>(sizeof(T));
    SHADOWKV_EXPECTS(run_bytes % 16 == 0, "value fetch: a run of chunk_size * head_dim = ", run,
                     " values must be a whole number of 16-byte vectors");
    const int unit_items = unit_items_for(slots, static_cast<long long>(ctas) * kFetchWarps, run_bytes);
    // No more CTAs than there are units for their warps.
    const long long units = static_cast<long long>(batch) * d.kv_heads * ((d.budget + unit_items - 1) / unit_items);
    const auto grid = static_cast<unsigned>(std::min<long long>(ctas, (units + kFetchWarps - 1) / kFetchWarps));
    auto* kernel = d.value_fp8 != 0 ? fetch_values_kernel<T, true> : fetch_values_kernel<T, false>;
    launch_after_prior_grid_with(&sooner, attributes, kernel, dim3(grid), dim3(32 * kFetchWarps), 0,
                                 stream, false, d, views, batch_slots, layer, batch, workspace, unit_items);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
