#include <algorithm>
#include <type_traits>

#include "block_attention.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "cuda_check.hpp"
#include "shadowkv/generated_region.hpp"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kGatherRows = 16;  ///< union rows a gather CTA copies
constexpr std::size_t kAlign = 256;

std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

std::size_t element_bytes(int kv_type) {
  return kv_type == element_f32 ? sizeof(float) : 2;
}

/// Where the rows of one (entry, head)'s union come from, in union order.
struct union_parts {
  int outliers;   ///< outlier rows
  int local;      ///< local window rows
  int generated;  ///< exact generated rows (ring order)
  int selected;   ///< selected chunks' rows
  int block;      ///< the block's tokens
  __device__ int total() const { return outliers + local + generated + selected + block; }
};

/// One union row of head h of entry b as float (its key or value), into `row` [D] — from the store's arrays, or for
/// the block's tokens from the caller's tensors (RoPE applied to keys given pre-RoPE, rounded to T as the append
/// stores them).
template <typename T>
__device__ void load_union_row(const dims& d, const layer_view& view, int b, int h, int u, const union_parts& parts,
                               const int* selected, strided_tensor keys, strided_tensor values, strided_tensor positions,
                               int positions_bits, bool keys_post_rope, const float* inv_freq, bool want_key,
                               int dim, float& out) {
  const long long head_rows = d.local_capacity + d.window;
  if (u < parts.outliers) {
    const T* base = static_cast<const T*>(want_key ? view.outlier_keys : view.outlier_values);
    out = to_float(base[(static_cast<long long>(h) * d.max_outliers * d.chunk + u) * d.head_dim + dim]);
    return;
  }
  u -= parts.outliers;
  if (u < parts.local + parts.generated) {
    const int row = u < parts.local ? u : d.local_capacity + rules::ring_row(view.ring_head, u - parts.local, d.window);
    const T* base = static_cast<const T*>(want_key ? view.exact_keys : view.exact_values);
    out = to_float(base[(h * head_rows + row) * d.head_dim + dim]);
    return;
  }
  u -= parts.local + parts.generated;
  if (u < parts.selected) {
    const int chunk = selected[u / d.chunk];
    const int slot = view.slot_of_chunk[static_cast<long long>(h) * d.max_chunks + chunk];
    const T* base = static_cast<const T*>(want_key ? view.cache_keys : view.cache_values);
    const long long row = static_cast<long long>(slot) * d.chunk + u % d.chunk;
    out = to_float(base[(static_cast<long long>(h) * d.cache_slots * d.chunk + row) * d.head_dim + dim]);
    return;
  }
  const int t = u - parts.selected;
  if (!want_key) {
    out = round_through<T>(
        load_any(values.data, values.type, b * values.stride[0] + t * values.stride[1] + h * values.stride[2] +
                                               dim * values.stride[3]));
    return;
  }
  const long long position = positions.data == nullptr
                                 ? view.last_position + 1 + t
                                 : load_index_any(positions.data, positions_bits,
                                                  b * positions.stride[0] + t * positions.stride[1]);
  const float key = caller_key_element(keys.data, keys.type, b * keys.stride[0] + t * keys.stride[1] + h * keys.stride[2],
                                       keys.stride[3], dim, d, inv_freq, position, keys_post_rope);
  out = round_through<T>(key);
}

/// Grid (row tiles, Hkv, B): rows [x * kGatherRows, ...) of the union of (entry z, head y) into the key and value
/// buffers (zero past the union), the union's length, and (tile 0) the entry's queries of head y.
template <typename T>
__global__ void __launch_bounds__(kThreads) gather_block_union_kernel(
    dims d, const layer_view* views, const int* batch_slots, int layer, int tokens, const int* selected,
    strided_tensor queries, strided_tensor keys, strided_tensor values, strided_tensor positions, int positions_bits,
    bool keys_post_rope, const float* inv_freq, block_attention_buffers buffers) {
  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const layer_view& view = views[static_cast<long long>(batch_slots[b]) * d.num_layers + layer];
  const int* head_selected = selected + (static_cast<long long>(b) * d.kv_heads + h) * d.budget;
  // The selection's chunks of this head: ascending ids, then -1 padding.
  __shared__ int selected_chunks;
  if (threadIdx.x == 0) selected_chunks = 0;
  __syncthreads();
  int chosen = 0;
  for (int j = static_cast<int>(threadIdx.x); j < d.budget; j += blockDim.x) chosen += head_selected[j] >= 0 ? 1 : 0;
  if (chosen > 0) atomicAdd(&selected_chunks, chosen);
  __syncthreads();
  const union_parts parts{view.outlier_chunks * d.chunk, view.local_len, view.generated_exact_len,
                          selected_chunks * d.chunk, tokens};
  const long long bh = static_cast<long long>(b) * d.kv_heads + h;
  if (blockIdx.x == 0 && threadIdx.x == 0) buffers.union_lengths[bh] = parts.total();
  T* key_rows = static_cast<T*>(buffers.keys) + bh * buffers.union_rows * d.head_dim;
  T* value_rows = static_cast<T*>(buffers.values) + bh * buffers.union_rows * d.head_dim;
  const int first = static_cast<int>(blockIdx.x) * kGatherRows;
  for (int index = static_cast<int>(threadIdx.x); index < kGatherRows * d.head_dim; index += blockDim.x) {
    const int u = first + index / d.head_dim;
    const int dim = index % d.head_dim;
    if (u >= buffers.union_rows) break;
    float key = 0.0F;
    float value = 0.0F;
    if (u < parts.total()) {
      load_union_row<T>(d, view, b, h, u, parts, head_selected, keys, values, positions, positions_bits,
                        keys_post_rope, inv_freq, true, dim, key);
      load_union_row<T>(d, view, b, h, u, parts, head_selected, keys, values, positions, positions_bits,
                        keys_post_rope, inv_freq, false, dim, value);
    }
    key_rows[static_cast<long long>(u) * d.head_dim + dim] = from_float<T>(key);
    value_rows[static_cast<long long>(u) * d.head_dim + dim] = from_float<T>(value);
  }
  if (blockIdx.x != 0) return;
  // Query row t * G + g of (entry b, head h): token t's query head h * G + g.
  T* query_rows = static_cast<T*>(buffers.queries) + bh * buffers.block * d.group * d.head_dim;
  for (int index = static_cast<int>(threadIdx.x); index < tokens * d.group * d.head_dim; index += blockDim.x) {
    const int r = index / d.head_dim;
    const int dim = index % d.head_dim;
    const int t = r / d.group;
    const int head = h * d.group + r % d.group;
    const float q = load_any(queries.data, queries.type,
                             b * queries.stride[0] + t * queries.stride[1] + head * queries.stride[2] +
                                 dim * queries.stride[3]);
    query_rows[static_cast<long long>(r) * d.head_dim + dim] = from_float<T>(q);
  }
}

/// A warp per query row (entry, head, t * G + g): softmax of its scores over the union rows token t sees.
template <typename T>
__global__ void __launch_bounds__(kThreads) block_softmax_kernel(dims d, int batch, int tokens,
                                                                 block_attention_buffers buffers) {
  const int warps = kThreads / 32;
  const long long row = static_cast<long long>(blockIdx.x) * warps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int rows_per_head = tokens * d.group;
  if (row >= static_cast<long long>(batch) * d.kv_heads * rows_per_head) return;
  const long long bh = row / rows_per_head;
  const int r = static_cast<int>(row % rows_per_head);
  const int t = r / d.group;
  const int length = buffers.union_lengths[bh];
  const int visible = length - tokens + t + 1;
  const long long offset = (bh * buffers.block * d.group + r) * buffers.union_rows;
  const float* scores = buffers.scores + offset;
  T* probabilities = static_cast<T*>(buffers.probabilities) + offset;
  const float scale = d.softmax_scale;
  float largest = -INFINITY;
  for (int u = lane; u < visible; u += 32) largest = fmaxf(largest, scale * scores[u]);
  for (int delta = 16; delta > 0; delta /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffU, largest, delta));
  float total = 0.0F;
  for (int u = lane; u < visible; u += 32) total += __expf(scale * scores[u] - largest);
  for (int delta = 16; delta > 0; delta /= 2) total += __shfl_xor_sync(0xffffffffU, total, delta);
  const float inverse = 1.0F / total;
  for (int u = lane; u < buffers.union_rows; u += 32) {
    probabilities[u] = from_float<T>(u < visible ? __expf(scale * scores[u] - largest) * inverse : 0.0F);
  }
}

__global__ void __launch_bounds__(kThreads) scatter_block_outputs_kernel(dims d, int batch, int tokens,
                                                                         block_attention_buffers buffers,
                                                                         strided_tensor out) {
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long rows_per_head = static_cast<long long>(tokens) * d.group;
  if (index >= static_cast<long long>(batch) * d.kv_heads * rows_per_head * d.head_dim) return;
  const int dim = static_cast<int>(index % d.head_dim);
  const long long row = index / d.head_dim;
  const long long bh = row / rows_per_head;
  const int r = static_cast<int>(row % rows_per_head);
  const int b = static_cast<int>(bh / d.kv_heads);
  const int h = static_cast<int>(bh % d.kv_heads);
  const int t = r / d.group;
  const int head = h * d.group + r % d.group;
  const float value = buffers.outputs[(bh * buffers.block * d.group + r) * d.head_dim + dim];
  store_any(const_cast<void*>(out.data), out.type,
            b * out.stride[0] + t * out.stride[1] + head * out.stride[2] + dim * out.stride[3], value);
}

}  // namespace

int block_union_rows(const dims& d, int block) {
  const long long rows = static_cast<long long>(d.max_outliers) * d.chunk + d.local_capacity + d.window +
                         static_cast<long long>(d.budget) * d.chunk + block;
  return static_cast<int>((rows + 7) / 8 * 8);
}

std::size_t block_attention_bytes(const dims& d, int kv_type, int batch, int block) {
  const std::size_t heads = static_cast<std::size_t>(batch) * d.kv_heads;
  const std::size_t rows = static_cast<std::size_t>(block_union_rows(d, block));
  const std::size_t queries = static_cast<std::size_t>(block) * d.group;
  const std::size_t element = element_bytes(kv_type);
  return 2 * aligned(heads * rows * d.head_dim * element) + aligned(heads * queries * d.head_dim * element) +
         aligned(heads * queries * rows * sizeof(float)) + aligned(heads * queries * rows * element) +
         aligned(heads * queries * d.head_dim * sizeof(float)) + aligned(heads * sizeof(int));
}

block_attention_buffers block_attention_layout(const dims& d, int kv_type, int batch, int block, void* memory) {
  const std::size_t heads = static_cast<std::size_t>(batch) * d.kv_heads;
  const int rows = block_union_rows(d, block);
  const std::size_t queries = static_cast<std::size_t>(block) * d.group;
  const std::size_t element = element_bytes(kv_type);
  auto* next = static_cast<unsigned char*>(memory);
  const auto take = [&](std::size_t bytes) {
    void* at = next;
    next += aligned(bytes);
    return at;
  };
  block_attention_buffers buffers;
  buffers.union_rows = rows;
  buffers.block = block;
  buffers.keys = take(heads * rows * d.head_dim * element);
  buffers.values = take(heads * rows * d.head_dim * element);
  buffers.queries = take(heads * queries * d.head_dim * element);
  buffers.scores = static_cast<float*>(take(heads * queries * rows * sizeof(float)));
  buffers.probabilities = take(heads * queries * rows * element);
  buffers.outputs = static_cast<float*>(take(heads * queries * d.head_dim * sizeof(float)));
  buffers.union_lengths = static_cast<int*>(take(heads * sizeof(int)));
  return buffers;
}

void launch_gather_block_union(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                               int batch, int tokens, const int* selected, strided_tensor queries, strided_tensor keys,
                               strided_tensor values, strided_tensor positions, int positions_bits,
                               bool keys_post_rope, const float* inv_freq, const block_attention_buffers& buffers,
                               cudaStream_t stream) {
  if (batch == 0) return;
  const dim3 grid((buffers.union_rows + kGatherRows - 1) / kGatherRows, d.kv_heads, batch);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gather_block_union_kernel<T><<<grid, kThreads, 0, stream>>>(d, views, batch_slots, layer, tokens, selected,
                                                                queries, keys, values, positions, positions_bits,
                                                                keys_post_rope, inv_freq, buffers);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_block_softmax(const dims& d, int kv_type, int batch, int tokens, const block_attention_buffers& buffers,
                          cudaStream_t stream) {
  const long long rows = static_cast<long long>(batch) * d.kv_heads * tokens * d.group;
  if (rows == 0) return;
  const int warps = kThreads / 32;
  const auto blocks = static_cast<unsigned>((rows + warps - 1) / warps);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    block_softmax_kernel<T><<<blocks, kThreads, 0, stream>>>(d, batch, tokens, buffers);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_scatter_block_outputs(const dims& d, int batch, int tokens, const block_attention_buffers& buffers,
                                  strided_tensor out, cudaStream_t stream) {
  const long long elements = static_cast<long long>(batch) * d.kv_heads * tokens * d.group * d.head_dim;
  if (elements == 0) return;
  const auto blocks = static_cast<unsigned>((elements + kThreads - 1) / kThreads);
  scatter_block_outputs_kernel<<<blocks, kThreads, 0, stream>>>(d, batch, tokens, buffers, out);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
