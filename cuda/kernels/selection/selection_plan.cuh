// What the chunk selection's host planner (chunk_selection.cu) decides and its kernels read: the modes, the tile
// geometry of the landmark logits, the layout of the select kernel's shared memory, and the shared-memory budget
// they are planned against. See chunk_selection.cu for how the kernels fit together.
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.hpp"
#include "device_layout.cuh"

namespace shadowkv::cuda::selection {

constexpr int kLogitThreads = 256;  // 2 threads a row at 128 rows: 24 warps per SM hide the LDS/FMA latency
constexpr int kDefaultSharedLimit = 48 * 1024;
/// Left for the select kernel's static shared memory (kSelectStaticShared in select_kernel.cu: ~17 KiB, most of it
/// the radix histogram) when its dynamic part is planned against the device's opt-in limit and the 48 KiB default.
constexpr int kSharedMargin = 20 * 1024;

/// What the host plans against, per device (chunk_selection.cu asks once per device ordinal).
struct device_limits {
  int optin_shared;  ///< bytes of shared memory a block may opt in to
  int multiprocessors;
  /// Clusters of 4 ([0]) and of 8 ([1]) CTAs of select_cluster_kernel that the device runs at once
  /// (cudaOccupancyMaxActiveClusters; select_clusters_at_once). A cluster sits in one GPC, so this can be less than
  /// multiprocessors / size. 0: not known, and then multiprocessors / size is taken.
  int clusters_at_once[2];
};

/// Clusters of `cluster` (4 or 8) CTAs that `limits` runs at once.
__host__ __device__ inline long long resident_clusters(const device_limits& limits, int cluster) {
  const int known = limits.clusters_at_once[cluster == 8 ? 1 : 0];
  return known > 0 ? known : limits.multiprocessors / cluster;
}

/// Tiles of the landmark logits kernel (landmark_scoring.cu); the select kernel reads the softmax
/// partials it leaves per tile.
struct logit_geometry {
  int tile_rows;   ///< chunks per tile (power of two, 8..128)
  int parts;       ///< threads sharing one row: kLogitThreads / tile_rows (they split the 16-byte vectors)
  int row_stride;  ///< bytes per staged row: vectors * 16 + 16 (the extra 16 B keep row reads free of conflicts)
  int vectors;     ///< 16-byte vectors per row, rounded up (a row's tail past D is zero-filled)
  int tiles;       ///< ceil(max_chunks / tile_rows)
};

/// Query tokens whose logits one scoring launch computes from each staged tile (several query tokens: a prefill's
/// q_last, an extend block): step_workspace::selection_partials holds this many rows per (entry, KV head).
inline constexpr int kScoringTokenGroup = 16;

/// Floats of one (entry, KV head) row of step_workspace::selection_partials: (max, sum exp) per query head and tile.
__host__ __device__ inline long long partial_row_floats(const dims& d, const logit_geometry& geo) {
  return 2LL * d.group * geo.tiles;
}

/// The select kernel's dynamic shared memory: the group's G score offsets (group_scores.cuh) at byte 0, then the
/// per-chunk radix keys when they fit (else they live in step_workspace::radix_keys).
struct select_geometry {
  int radix_keys_in_shared;    ///< 1: per-chunk radix keys in dynamic shared memory; 0: in ws.radix_keys
  long long radix_keys_offset;  ///< their byte offset there: the offsets' bytes rounded up to 16
  long long shared_bytes;      ///< dynamic shared memory of the launch
};

/// Where the select kernel keeps its radix keys on a device with `limits`: one decision for the workspace query and
/// the launch.
inline select_geometry plan_select(const dims& d, const device_limits& limits) {
  select_geometry geo{};
  geo.radix_keys_offset = (4LL * d.group + 15) / 16 * 16;
  const long long keys = 4LL * d.max_chunks;
  geo.radix_keys_in_shared = geo.radix_keys_offset + keys <= limits.optin_shared - kSharedMargin ? 1 : 0;
  geo.shared_bytes = geo.radix_keys_offset + (geo.radix_keys_in_shared ? keys : 0);
  return geo;
}

/// The select kernel may spread each (sequence, KV head) over a thread-block cluster when the batch leaves
/// multiprocessors idle: one 1024-thread CTA a head runs on 8 of 132 SMs at B = 1.
constexpr int kMaxSelectCluster = 8;            // the portable cluster size
constexpr int kSelectClusterFromChunks = 2048;  // fewer chunks: one CTA's passes are short, a cluster's barriers not

/// Launch rows (sequence, KV head) up to which the select kernel may run in clusters (two SMs a row at least); the
/// radix-key workspace has this many rows at least (chunk_selection_workspace), since the clusters keep their radix
/// keys there.
inline long long select_cluster_rows(const device_limits& limits) { return limits.multiprocessors / 2; }

/// Bytes of select_cluster_kernel's static shared memory, at most (select_kernel.cu asserts it): what is left of the
/// opt-in limit for its dynamic part.
constexpr int kClusterStaticShared = 48 * 1024;

/// select_cluster_kernel's dynamic shared memory, the same in every CTA of a launch (byte offsets, 16-byte aligned):
/// the group's G score offsets at byte 0; the radix keys of the CTA's slice of the chunks (so that the radix passes
/// and the compaction read them from shared memory, not from L2); and, for the cache update of the default cache
/// (K == k) by the cluster's first CTA, that head's cache and this step's selection as it is made: the buffer slots'
/// chunks, read while the others score; the selected ids, stored there by every CTA's compaction; the free slots and
/// the misses' chunks in ascending order; and two bitmaps over the chunks (selected now, cached before the step), so that the update's
/// rules read no global memory. Computed alike on the host (launch, plan) and in the kernel.
struct cluster_shared_layout {
  int slice_capacity;  ///< radix keys of a slice: ceil(max_chunks / cluster), in whole warps
  int bitmap_words;    ///< unsigned words of each bitmap (0 when K > k)
  int slice_keys;      ///< unsigned [slice_capacity]
  int cache_chunks;    ///< int [k]: the chunk of each buffer slot (K == k only, as the rest below)
  int selected_ids;    ///< int [k]: this step's selection, ascending
  int free_slots;      ///< int [k]: the free buffer slots, ascending, once the hits are kept
  int miss_chunks;     ///< int [k]: the misses' chunks, ascending
  int selected_bits;   ///< unsigned [bitmap_words]: chunk c selected now
  int cached_bits;     ///< unsigned [bitmap_words]: chunk c in the cache before the step
  long long bytes;     ///< the whole (offsets are meaningful only when it fits: plan_select_cluster)
};

__host__ __device__ inline cluster_shared_layout cluster_shared_layout_for(const dims& d, int cluster) {
  auto align16 = [](long long bytes) { return (bytes + 15) / 16 * 16; };
  const long long per_cta = (static_cast<long long>(d.max_chunks) + cluster - 1) / cluster;
  const long long slice_capacity = (per_cta + 31) / 32 * 32;
  const bool temporal = d.cache_slots == d.budget;
  const long long bitmap_words = temporal ? (static_cast<long long>(d.max_chunks) + 31) / 32 : 0;
  const long long k_ints = temporal ? 4LL * d.budget : 0;
  const long long slice_keys = align16(4LL * d.group);
  const long long cache_chunks = slice_keys + align16(4 * slice_capacity);
  const long long selected_ids = cache_chunks + align16(k_ints);
  const long long free_slots = selected_ids + align16(k_ints);
  const long long miss_chunks = free_slots + align16(k_ints);
  const long long selected_bits = miss_chunks + align16(k_ints);
  const long long cached_bits = selected_bits + align16(4 * bitmap_words);
  cluster_shared_layout layout{};
  layout.slice_capacity = static_cast<int>(slice_capacity);
  layout.bitmap_words = static_cast<int>(bitmap_words);
  layout.slice_keys = static_cast<int>(slice_keys);
  layout.cache_chunks = static_cast<int>(cache_chunks);
  layout.selected_ids = static_cast<int>(selected_ids);
  layout.free_slots = static_cast<int>(free_slots);
  layout.miss_chunks = static_cast<int>(miss_chunks);
  layout.selected_bits = static_cast<int>(selected_bits);
  layout.cached_bits = static_cast<int>(cached_bits);
  layout.bytes = cached_bits + align16(4 * bitmap_words);
  return layout;
}

/// CTAs per (sequence, KV head) for a launch of `batch` sequences, the planner's choice: a cluster of 8 when every row's cluster fits on the device at once (one CTA an SM,
/// and no more clusters than clusters_at_once says the GPCs hold); where rows x 8 CTAs would fit on the SMs but not
/// that many clusters of 8 in the GPCs (the rest would wait for a second wave), a cluster of 4 when those fit; else 1.
/// Measured on the H200 (docs/performance.md; session 11; S = 122880, Hkv 8): B = 1, 8 CTAs a head, 26.8 µs against 28.9
/// on one; B = 8, 2 a head, 32.2 against 32.9; the three parts of B = 24 (8 sequences each, beside the value fetch),
/// 2 a head, 171-174 µs against 129-132 for the three launches, and the rebuild beside them slower too. The kernel is
/// a chain of dependent steps whose length the cluster does not shorten; the per-chunk work it splits is small.
/// `radix_workspace`: the step workspace has radix-key rows.
/// A cluster size is taken only when its dynamic shared memory (cluster_shared_layout_for) fits beside the static.
inline int plan_select_cluster(const dims& d, int batch, const device_limits& limits, bool radix_workspace) {
  const long long rows = static_cast<long long>(batch) * d.kv_heads;
  if (!radix_workspace || d.max_chunks == 0 || rows > select_cluster_rows(limits)) return 1;
  auto fits = [&](int cluster) {
    return cluster_shared_layout_for(d, cluster).bytes <= limits.optin_shared - kClusterStaticShared;
  };
  if (d.max_chunks < kSelectClusterFromChunks) return 1;
  if (rows * kMaxSelectCluster > limits.multiprocessors || !fits(kMaxSelectCluster)) return 1;
  if (rows <= resident_clusters(limits, kMaxSelectCluster)) return kMaxSelectCluster;
  constexpr int kHalf = kMaxSelectCluster / 2;
  return rows <= resident_clusters(limits, kHalf) && fits(kHalf) ? kHalf : 1;
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

}  // namespace shadowkv::cuda::selection
