#include <algorithm>

#include "chunk_rebuild.cuh"
#include "cuda_check.hpp"
#include "dispatch.cuh"
#include "element_access.cuh"

namespace shadowkv::cuda {
namespace {

// Chunks a CTA rebuilds together: each basis element read from L2 is used for kGroupChunks * C rows.
constexpr int kGroupChunks = 4;
constexpr int kMaxRows = 64;           // kGroupChunks * C must not exceed this (C <= 16)
// CTAs per (entry, head): enough to give every SM two CTAs for small batches; each takes every gridDim.z-th group.
int splits_for(int batch, int kv_heads, int most) {
  static const int multiprocessors = [] {
    int device = 0;
    int count = 132;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    return count;
  }();
  const int wanted = (2 * multiprocessors + batch * kv_heads - 1) / (batch * kv_heads);
  return std::max(1, std::min(wanted, most));
}
constexpr int kRankTile = 32;

// One CTA per (entry, head, split); one thread per output dim. Rows of A for a group of missed chunks are staged in
// shared memory a rank tile at a time; each thread accumulates its dim for all rows of the group.
template <typename T>
__global__ void rebuild_keys_kernel(dims d, layer_view* views, const int* batch_slots, int layer,
                                    step_workspace workspace, const float* inv_freq) {
  extern __shared__ float shared[];
  float* a_tile = shared;                      // [kMaxRows, kRankTile]
  float* rows_out = shared + kMaxRows * kRankTile;  // [kMaxRows, D]
  const int b = blockIdx.x;
  const int h = blockIdx.y;
  const int split = blockIdx.z;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int misses = workspace.miss_counts[b * d.kv_heads + h];
  const int* miss_slots = workspace.miss_slots + static_cast<long long>(b * d.kv_heads + h) * d.budget;
  const int* cache_chunks = view->cache_chunks + static_cast<long long>(h) * d.budget;
  const int width = d.kv_heads * d.head_dim;
  T* cache_keys = static_cast<T*>(view->cache_keys) + static_cast<long long>(h) * d.budget * d.chunk * d.head_dim;
  const int dim = threadIdx.x;
  const bool active = dim < d.head_dim;
  const int group_chunks = kMaxRows / d.chunk < kGroupChunks ? kMaxRows / d.chunk : kGroupChunks;

  for (int first = split * group_chunks; first < misses; first += static_cast<int>(gridDim.z) * group_chunks) {
    const int chunks_here = min(group_chunks, misses - first);
    const int rows = chunks_here * d.chunk;
    float accumulator[kMaxRows];
#pragma unroll
    for (int row = 0; row < kMaxRows; ++row) accumulator[row] = 0.0F;
    for (int r0 = 0; r0 < d.rank; r0 += kRankTile) {
      const int tile = min(kRankTile, d.rank - r0);
      __syncthreads();
      for (int index = threadIdx.x; index < rows * kRankTile; index += blockDim.x) {
        const int row = index / kRankTile;
        const int r = index % kRankTile;
        const int chunk = cache_chunks[miss_slots[first + row / d.chunk]];
        const long long token = static_cast<long long>(chunk) * d.chunk + row % d.chunk;
        a_tile[index] = r < tile ? view->coefficients[token * d.rank + r0 + r] : 0.0F;
      }
      __syncthreads();
      if (active) {
        for (int r = 0; r < tile; ++r) {
          const float basis = view->basis[static_cast<long long>(r0 + r) * width + h * d.head_dim + dim];
#pragma unroll
          for (int row = 0; row < kMaxRows; ++row) {
            if (row < rows) accumulator[row] += a_tile[row * kRankTile + r] * basis;
          }
        }
      }
    }
    if (active) {
#pragma unroll
      for (int row = 0; row < kMaxRows; ++row) {
        if (row < rows) rows_out[row * d.head_dim + dim] = accumulator[row];
      }
    }
    __syncthreads();
    // RoPE at each token's own position, then store into the buffer slot.
    if (active) {
      for (int row = 0; row < rows; ++row) {
        const int slot = miss_slots[first + row / d.chunk];
        const int chunk = cache_chunks[slot];
        const long long position = view->context_positions[static_cast<long long>(chunk) * d.chunk + row % d.chunk];
        float value = rows_out[row * d.head_dim + dim];
        if (dim < d.rotary_dim) {
          const int half = d.rotary_dim / 2;
          const int pair = d.rope_interleaved ? dim / 2 : dim % half;
          int first_dim;
          int second_dim;
          rope_dims(d, pair, first_dim, second_dim);
          float x1 = rows_out[row * d.head_dim + first_dim];
          float x2 = rows_out[row * d.head_dim + second_dim];
          rope_pair(x1, x2, inv_freq[pair], position, d.attention_scaling, false);
          value = dim == first_dim ? x1 : x2;
        }
        cache_keys[(static_cast<long long>(slot) * d.chunk + row % d.chunk) * d.head_dim + dim] = from_float<T>(value);
      }
    }
  }
}

// One CTA per (entry, head); one warp per missed chunk at a time, 16-byte reads of the contiguous run.
template <typename T>
__global__ void fetch_values_kernel(dims d, layer_view* views, const int* batch_slots, int layer,
                                    step_workspace workspace) {
  const int b = blockIdx.x;
  const int h = blockIdx.y;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int misses = workspace.miss_counts[b * d.kv_heads + h];
  const int* miss_slots = workspace.miss_slots + static_cast<long long>(b * d.kv_heads + h) * d.budget;
  const int* cache_chunks = view->cache_chunks + static_cast<long long>(h) * d.budget;
  const long long run = static_cast<long long>(d.chunk) * d.head_dim;  // elements
  const T* store = static_cast<const T*>(view->value_store);
  T* cache = static_cast<T*>(view->cache_values) + static_cast<long long>(h) * d.budget * run;
  const int warp = blockIdx.z * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.z * (blockDim.x / 32);
  const bool vectorised = (run * sizeof(T)) % 16 == 0;
  for (int m = warp; m < misses; m += warps) {
    const int slot = miss_slots[m];
    const int chunk = cache_chunks[slot];
    const T* source = store + (static_cast<long long>(chunk) * d.kv_heads + h) * run;
    T* target = cache + static_cast<long long>(slot) * run;
    if (vectorised) {
      const long long vectors = run * static_cast<long long>(sizeof(T)) / 16;
      const int4* from = reinterpret_cast<const int4*>(source);
      int4* to = reinterpret_cast<int4*>(target);
      for (long long i = lane; i < vectors; i += 32) to[i] = from[i];
    } else {
      for (long long i = lane; i < run; i += 32) target[i] = source[i];
    }
  }
  if (blockIdx.z == 0 && threadIdx.x == 0 && misses > 0) {
    atomicAdd(workspace.counters + 3, static_cast<unsigned long long>(misses) * run * sizeof(T));
  }
}

}  // namespace

void launch_rebuild_keys(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, const float* inv_freq, cudaStream_t stream) {
  SHADOWKV_EXPECTS(d.chunk <= kMaxRows, "chunk_size ", d.chunk, " is larger than the CUDA key rebuild supports (",
                   kMaxRows, ")");
  const int threads = ((d.head_dim + 31) / 32) * 32;
  const std::size_t shared = (kMaxRows * kRankTile + static_cast<std::size_t>(kMaxRows) * d.head_dim) * sizeof(float);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    static const bool large_shared_memory_allowed = shadowkv_allow_max_shared_memory(rebuild_keys_kernel<T>);
    (void)large_shared_memory_allowed;
    const int groups = (d.budget + kGroupChunks - 1) / kGroupChunks;
    rebuild_keys_kernel<T><<<dim3(batch, d.kv_heads, splits_for(batch, d.kv_heads, groups)), threads, shared, stream>>>(
        d, views, batch_slots, layer, workspace, inv_freq);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_fetch_values(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, cudaStream_t stream) {
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // 8 warps per CTA, one missed chunk per warp at a time: enough warps in flight to cover PCIe latency.
    const int splits = splits_for(batch, d.kv_heads, (d.budget + 7) / 8);
    fetch_values_kernel<T><<<dim3(batch, d.kv_heads, splits), 256, 0, stream>>>(d, views, batch_slots, layer,
                                                                                workspace);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
