#include <algorithm>

#include "common/chunk_centroids_warp.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "cuda_check.hpp"
#include "generated_tokens.cuh"
#include "shadowkv/fp8.hpp"
#include "shadowkv/generated_region.hpp"

namespace shadowkv::cuda {
namespace {

// The append (step 2 below) is a thread per (head, dim), Hkv * D of them: 512 threads take two a thread at Hkv * D =
// 1024 (four at 256 threads: each a dependent load, a float64 RoPE and a store on the step's critical path). 1024
// threads would cap registers at 64; the kernel needs 80.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

/// Element d of the i-th oldest generated key of head h (the exact ring, stored post-RoPE keys).
template <typename T>
struct ring_chunk_keys {
  const T* head_keys;  ///< exact_keys of head h
  int local_capacity;
  int ring_head;
  int window;
  int head_dim;
  SHADOWKV_HOST_DEVICE float operator()(int i, int d) const {
    const long long row = local_capacity + rules::ring_row(ring_head, i, window);
    return to_float(head_keys[row * head_dim + d]);
  }
};

/// Step 1: folds the oldest C generated tokens of entry blockIdx.x into context chunk `chunk` when its ring is full
/// (rules::fold_due), else returns at once. When the context chunks already fill the arena there is nowhere to fold:
/// the ring stays full, and append_generated_kernel then leaves the sequence as it is (a capacity guard for CUDA-graph
/// replays; eager calls are validated on the host before anything runs, and the host rejects such replays in
/// account_replayed_steps: they took the sequence past max_seq_len). Every thread reads the same counters before any
/// write: uniform exit.
/// The fold of one entry by the whole CTA (every thread calls it; uniform exit). `keys_pre`: the kernel's dynamic shared
/// memory (advance_generated_shared_bytes). The folded rows also go to the fold journal (docs/semantics.md,
/// "Truncate"): the newest dims::journal_chunks folds, a ring of chunks.
template <typename T>
__device__ void fold_one(const dims& d, layer_view* view, const float* inv_freq, float* keys_pre) {
  const int generated = view->generated_exact_len;
  if (!rules::fold_due(generated, d.window) || view->context_chunks >= d.max_chunks) return;
  const int width = d.kv_heads * d.head_dim;
  const long long head_rows = d.local_capacity + d.window;
  T* exact_keys = static_cast<T*>(view->exact_keys);
  T* exact_values = static_cast<T*>(view->exact_values);
  const int ring_head = view->ring_head;
  const int chunk = view->context_chunks;
  // Un-rotated keys of the C tokens, heads concatenated.
  for (int index = threadIdx.x; index < d.chunk * width; index += blockDim.x) {
    const int i = index / width;
    const int h = (index % width) / d.head_dim;
    const int dim = index % d.head_dim;
    const int ring_row = d.local_capacity + rules::ring_row(ring_head, i, d.window);
    const long long position = view->exact_positions[ring_row];
    const T* key = exact_keys + (h * head_rows + ring_row) * d.head_dim;
    float value = to_float(key[dim]);
    if (dim < d.rotary_dim) {
      const int half = d.rotary_dim / 2;
      const int pair = d.rope_interleaved ? dim / 2 : dim % half;
      int first;
      int second;
      rope_dims(d, pair, first, second);
      float x1 = to_float(key[first]);
      float x2 = to_float(key[second]);
      rope_pair(x1, x2, inv_freq[pair], position, d.attention_scaling, true);
      value = dim == first ? x1 : x2;
    }
    keys_pre[index] = value;
  }
  __syncthreads();
  // Coefficients a = k_pre · V_r (B = V_rᵀ rows), context positions, landmark, values to the value store.
  // The factors' element type (float32 or bf16): B is read as held, the new rows of A are rounded to it.
  for (int index = threadIdx.x; index < d.chunk * d.rank; index += blockDim.x) {
    const int i = index / d.rank;
    const int r = index % d.rank;
    const long long row = static_cast<long long>(r) * width;
    const long long target = (static_cast<long long>(chunk) * d.chunk + i) * d.rank + r;
    float sum = 0.0F;
    if (d.factor_bf16 != 0) {
      const auto* basis_row = static_cast<const __nv_bfloat16*>(view->basis) + row;
      for (int j = 0; j < width; ++j) sum += keys_pre[i * width + j] * __bfloat162float(basis_row[j]);
      static_cast<__nv_bfloat16*>(view->coefficients)[target] = __float2bfloat16_rn(sum);
    } else {
      const float* basis_row = static_cast<const float*>(view->basis) + row;
      for (int j = 0; j < width; ++j) sum += keys_pre[i * width + j] * basis_row[j];
      static_cast<float*>(view->coefficients)[target] = sum;
    }
  }
  for (int i = threadIdx.x; i < d.chunk; i += blockDim.x) {
    view->context_positions[static_cast<long long>(chunk) * d.chunk + i] =
        view->exact_positions[d.local_capacity + rules::ring_row(ring_head, i, d.window)];
  }
  T* landmarks = static_cast<T*>(view->landmarks);
  T* value_store = static_cast<T*>(view->value_store);
  // The chunk's place in the sequence's own value store (a forked sequence's own chunks follow its shared prompt's).
  const long long value_chunk = static_cast<long long>(chunk) - view->shared_value_chunks;
  float* head_scales = keys_pre;  // fp8: one scale per head (keys_pre is dead once the coefficients are written)
  if (d.value_fp8 != 0) {
    __syncthreads();
    for (int h = threadIdx.x; h < d.kv_heads; h += blockDim.x) {
      float amax = 0.0F;
      for (int i = 0; i < d.chunk; ++i) {
        const T* row =
            exact_values + (h * head_rows + d.local_capacity + rules::ring_row(ring_head, i, d.window)) * d.head_dim;
        for (int dim = 0; dim < d.head_dim; ++dim) amax = fmaxf(amax, fabsf(to_float(row[dim])));
      }
      head_scales[h] = fp8::scale_for(amax);
      view->value_scales[value_chunk * d.kv_heads + h] = head_scales[h];
    }
    __syncthreads();
  }
  auto* value_codes = static_cast<std::uint8_t*>(view->value_store);
  for (int index = threadIdx.x; index < width; index += blockDim.x) {
    const int h = index / d.head_dim;
    const int dim = index % d.head_dim;
    double sum = 0.0;
    for (int i = 0; i < d.chunk; ++i) {
      const int ring_row = d.local_capacity + rules::ring_row(ring_head, i, d.window);
      sum += to_float(exact_keys[(h * head_rows + ring_row) * d.head_dim + dim]);
      const long long target = ((value_chunk * d.kv_heads + h) * d.chunk + i) * d.head_dim + dim;
      const T value = exact_values[(h * head_rows + ring_row) * d.head_dim + dim];
      if (d.value_fp8 != 0) {
        value_codes[target] = fp8::encode_e4m3(to_float(value) / head_scales[h]);
      } else {
        value_store[target] = value;
      }
    }
    if (d.chunk_centroids == 0) {
      landmarks[(static_cast<long long>(h) * d.max_chunks + chunk) * d.head_dim + dim] =
          from_float<T>(static_cast<float>(sum / d.chunk));
    }
  }
  __syncthreads();
  if (d.chunk_centroids != 0) {
    // The chunk's two centroids per head, a warp a head, scratch in keys_pre (dead now; see
    // advance_generated_shared_bytes).
    const int warp = static_cast<int>(threadIdx.x / 32);
    double* work = reinterpret_cast<double*>(keys_pre) + warp * 2 * d.head_dim;
    for (int h = warp; h < d.kv_heads; h += kWarps) {
      const ring_chunk_keys<T> key{exact_keys + h * head_rows * d.head_dim, d.local_capacity, ring_head, d.window,
                                   d.head_dim};
      const long long at = static_cast<long long>(h) * d.max_chunks + chunk;
      two_means_warp(key, d.chunk, d.head_dim, work,
                     centroid_target{view->centroid_codes + at * 2 * d.head_dim, view->centroid_scales + at * 2,
                                     view->first_counts + at});
    }
    __syncthreads();
  }
  // The journal keeps the folded chunk's exact rows: the next free chunk of its ring, or the oldest one's when full.
  const int journal_count = view->journal_count;
  const int journal_head = view->journal_head;
  if (d.journal_chunks > 0) {
    const int journal_slot =
        journal_count < d.journal_chunks ? (journal_head + journal_count) % d.journal_chunks : journal_head;
    const long long journal_rows = static_cast<long long>(d.journal_chunks) * d.chunk;
    T* journal_keys = static_cast<T*>(view->journal_keys);
    T* journal_values = static_cast<T*>(view->journal_values);
    for (int index = threadIdx.x; index < d.chunk * width; index += blockDim.x) {
      const int i = index / width;
      const int h = (index % width) / d.head_dim;
      const int dim = index % d.head_dim;
      const long long from = (h * head_rows + d.local_capacity + rules::ring_row(ring_head, i, d.window)) * d.head_dim + dim;
      const long long to = (h * journal_rows + static_cast<long long>(journal_slot) * d.chunk + i) * d.head_dim + dim;
      journal_keys[to] = exact_keys[from];
      journal_values[to] = exact_values[from];
    }
    for (int i = threadIdx.x; i < d.chunk; i += blockDim.x) {
      view->journal_positions[static_cast<long long>(journal_slot) * d.chunk + i] =
          view->exact_positions[d.local_capacity + rules::ring_row(ring_head, i, d.window)];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const rules::generated_region<int> folded =
        rules::after_fold(rules::generated_region<int>{chunk, generated, ring_head}, d.chunk, d.window);
    view->context_chunks = folded.context_chunks;
    view->ring_head = folded.ring_head;
    view->generated_exact_len = folded.exact_len;
    if (d.journal_chunks > 0) {
      if (journal_count < d.journal_chunks) {
        view->journal_count = journal_count + 1;
      } else {
        view->journal_head = (journal_head + 1) % d.journal_chunks;
      }
    }
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) fold_generated_kernel(dims d, layer_view* views, const int* batch_slots,
                                                                     int layer, const float* inv_freq) {
  extern __shared__ float keys_pre[];  // [C, Hkv*D]; two-centroid scratch once the fold's values are written
  layer_view* view = views + static_cast<long long>(batch_slots[blockIdx.x]) * d.num_layers + layer;
  fold_one<T>(d, view, inv_freq, keys_pre);
}

/// Step 2: appends entry blockIdx.x's new token at its ring's end, unless the ring is still full (fold_generated_kernel
/// found no room to fold: the sequence is left as it is).
/// The append of entry b's token (row b of k_new, v_new [B, Hkv, D] and positions [B]) by the whole CTA.
template <typename T>
__device__ void append_one(const dims& d, layer_view* view, int b, strided_tensor k_new, strided_tensor v_new,
                           strided_tensor positions, int positions_bits, bool keys_post_rope, const float* inv_freq) {
  const int length = view->generated_exact_len;
  if (rules::fold_due(length, d.window)) return;
  const int width = d.kv_heads * d.head_dim;
  const long long head_rows = d.local_capacity + d.window;
  T* exact_keys = static_cast<T*>(view->exact_keys);
  T* exact_values = static_cast<T*>(view->exact_values);
  const int ring_row = d.local_capacity + rules::ring_row(view->ring_head, length, d.window);
  const long long position = positions.data == nullptr
                                 ? view->last_position + 1
                                 : load_index_any(positions.data, positions_bits, b * positions.stride[0]);
  for (int index = threadIdx.x; index < width; index += blockDim.x) {
    const int h = index / d.head_dim;
    const int dim = index % d.head_dim;
    const float key = caller_key_element(k_new.data, k_new.type, b * k_new.stride[0] + h * k_new.stride[1],
                                         k_new.stride[2], dim, d, inv_freq, position, keys_post_rope);
    const float value = load_any(v_new.data, v_new.type, b * v_new.stride[0] + h * v_new.stride[1] + dim * v_new.stride[2]);
    exact_keys[(h * head_rows + ring_row) * d.head_dim + dim] = from_float<T>(key);
    exact_values[(h * head_rows + ring_row) * d.head_dim + dim] = from_float<T>(value);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    view->exact_positions[ring_row] = position;
    view->generated_exact_len = length + 1;
    view->last_position = position;
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) append_generated_kernel(dims d, layer_view* views, const int* batch_slots,
                                                                       int layer, strided_tensor k_new,
                                                                       strided_tensor v_new, strided_tensor positions,
                                                                       int positions_bits, bool keys_post_rope,
                                                                       const float* inv_freq) {
  layer_view* view = views + static_cast<long long>(batch_slots[blockIdx.x]) * d.num_layers + layer;
  append_one<T>(d, view, static_cast<int>(blockIdx.x), k_new, v_new, positions, positions_bits, keys_post_rope,
                inv_freq);
}

/// Token t of a [B, s, ...] caller tensor as the [B, ...] tensor of one token.
__device__ strided_tensor token_of(strided_tensor tensor, int t, int element_size) {
  strided_tensor one = tensor;
  if (tensor.data == nullptr) return one;
  one.data = static_cast<const unsigned char*>(tensor.data) + t * tensor.stride[1] * element_size;
  one.stride[1] = tensor.stride[2];
  one.stride[2] = tensor.stride[3];
  one.stride[3] = 0;
  return one;
}

__device__ int element_size_of(int type) { return type == element_f32 ? 4 : 2; }

/// An extend block's tokens (keys, values [B, s, Hkv, D], positions [B, s]) appended one after the other, each after
/// the fold of a full ring (decode's rule), then the fold of a ring the last token filled (as a decode step ends).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) append_block_kernel(dims d, layer_view* views, const int* batch_slots,
                                                                   int layer, int tokens, strided_tensor keys,
                                                                   strided_tensor values, strided_tensor positions,
                                                                   int positions_bits, bool keys_post_rope,
                                                                   const float* inv_freq) {
  extern __shared__ float keys_pre[];
  layer_view* view = views + static_cast<long long>(batch_slots[blockIdx.x]) * d.num_layers + layer;
  const int b = static_cast<int>(blockIdx.x);
  for (int t = 0; t < tokens; ++t) {
    fold_one<T>(d, view, inv_freq, keys_pre);
    strided_tensor token_positions = positions;
    if (positions.data != nullptr) {
      token_positions.data =
          static_cast<const unsigned char*>(positions.data) + t * positions.stride[1] * (positions_bits / 8);
    }
    append_one<T>(d, view, b, token_of(keys, t, element_size_of(keys.type)),
                  token_of(values, t, element_size_of(values.type)), token_positions, positions_bits, keys_post_rope,
                  inv_freq);
  }
  fold_one<T>(d, view, inv_freq, keys_pre);
}

/// Truncate of one (slot, layer) (docs/semantics.md, "Truncate"): undo the folds past `kept` context chunks (their rows
/// back from the journal, in front of the ring), keep `exact` generated rows, drop undone chunks from the selection
/// cache. The device's own fold count decides what to undo: it may have folded a full ring the host counts as unfolded.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) truncate_generated_kernel(dims d, layer_view* view, int kept, int exact) {
  const int chunks = view->context_chunks;
  const int undo = chunks - kept;
  const int ring_head = view->ring_head;
  const int journal_count = view->journal_count;
  const int journal_head = view->journal_head;
  const int width = d.kv_heads * d.head_dim;
  const long long head_rows = d.local_capacity + d.window;
  const long long journal_rows = static_cast<long long>(d.journal_chunks) * d.chunk;
  const int back = min(undo * d.chunk, exact);  // journal rows that return to the ring
  const int new_head = ((ring_head - back) % d.window + d.window) % d.window;
  T* exact_keys = static_cast<T*>(view->exact_keys);
  T* exact_values = static_cast<T*>(view->exact_values);
  const T* journal_keys = static_cast<const T*>(view->journal_keys);
  const T* journal_values = static_cast<const T*>(view->journal_values);
  for (int index = threadIdx.x; index < back * width; index += blockDim.x) {
    const int i = index / width;
    const int h = (index % width) / d.head_dim;
    const int dim = index % d.head_dim;
    // Token i of the undone folds: journal chunk (oldest first) journal_count - undo + i / C.
    const int slot = (journal_head + journal_count - undo + i / d.chunk) % d.journal_chunks;
    const long long from = (h * journal_rows + static_cast<long long>(slot) * d.chunk + i % d.chunk) * d.head_dim + dim;
    const long long to = (h * head_rows + d.local_capacity + rules::ring_row(new_head, i, d.window)) * d.head_dim + dim;
    exact_keys[to] = journal_keys[from];
    exact_values[to] = journal_values[from];
  }
  for (int i = threadIdx.x; i < back; i += blockDim.x) {
    const int slot = (journal_head + journal_count - undo + i / d.chunk) % d.journal_chunks;
    view->exact_positions[d.local_capacity + rules::ring_row(new_head, i, d.window)] =
        view->journal_positions[static_cast<long long>(slot) * d.chunk + i % d.chunk];
  }
  // Undone chunks leave the selection cache (a thread per KV head).
  for (int h = threadIdx.x; h < d.kv_heads; h += blockDim.x) {
    int* cache_chunks = view->cache_chunks + static_cast<long long>(h) * d.cache_slots;
    for (int s = 0; s < d.cache_slots; ++s) {
      const int chunk = cache_chunks[s];
      if (chunk < kept) continue;
      view->slot_of_chunk[static_cast<long long>(h) * d.max_chunks + chunk] = -1;
      cache_chunks[s] = -1;
      if (view->cache_last_used != nullptr) view->cache_last_used[static_cast<long long>(h) * d.cache_slots + s] = 0;
    }
    if (view->selected_slots != nullptr) {  // the last selection's slots, ascending, without the freed ones
      int* selected = view->selected_slots + static_cast<long long>(h) * d.budget;
      int write = 0;
      for (int j = 0; j < d.budget; ++j) {
        const int s = selected[j];
        if (s >= 0 && cache_chunks[s] >= 0) selected[write++] = s;
      }
      for (; write < d.budget; ++write) selected[write] = -1;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    view->context_chunks = kept;
    view->generated_exact_len = exact;
    view->ring_head = new_head;
    view->journal_count = journal_count - undo;
    if (exact > 0) {
      view->last_position = view->exact_positions[d.local_capacity + rules::ring_row(new_head, exact - 1, d.window)];
    } else if (view->local_len > 0) {
      view->last_position = view->exact_positions[view->local_len - 1];
    } else {
      view->last_position = view->context_positions[view->prompt_len - 1];
    }
  }
}

}  // namespace

std::size_t advance_generated_shared_bytes(const dims& d) {
  const std::size_t keys = static_cast<std::size_t>(d.chunk) * d.kv_heads * d.head_dim * sizeof(float);
  // Two-centroid scores: 2·D doubles of scratch per warp, in the same memory.
  const std::size_t centroid_work =
      d.chunk_centroids != 0 ? static_cast<std::size_t>(kWarps) * 2 * d.head_dim * sizeof(double) : 0;
  return std::max(keys, centroid_work);
}

void launch_fold_generated(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                           const float* inv_freq, cudaStream_t stream) {
  if (batch == 0) return;
  const std::size_t shared = advance_generated_shared_bytes(d);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    static std::atomic<std::uint64_t> allowed_on_devices{0};  // the opt-in shared-memory limit, once per device
    shadowkv_allow_large_shared_memory(fold_generated_kernel<T>, allowed_on_devices);
    fold_generated_kernel<T><<<batch, kThreads, shared, stream>>>(d, views, batch_slots, layer, inv_freq);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_append_generated(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer,
                             int batch, strided_tensor k_new, strided_tensor v_new, strided_tensor positions,
                             int positions_bits, bool keys_post_rope, const float* inv_freq, cudaStream_t stream) {
  if (batch == 0) return;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    append_generated_kernel<T><<<batch, kThreads, 0, stream>>>(d, views, batch_slots, layer, k_new, v_new, positions,
                                                               positions_bits, keys_post_rope, inv_freq);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_append_block(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         int tokens, strided_tensor keys, strided_tensor values, strided_tensor positions,
                         int positions_bits, bool keys_post_rope, const float* inv_freq, cudaStream_t stream) {
  if (batch == 0 || tokens == 0) return;
  const std::size_t shared = advance_generated_shared_bytes(d);
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    static std::atomic<std::uint64_t> allowed_on_devices{0};
    shadowkv_allow_large_shared_memory(append_block_kernel<T>, allowed_on_devices);
    append_block_kernel<T><<<batch, kThreads, shared, stream>>>(d, views, batch_slots, layer, tokens, keys, values,
                                                                positions, positions_bits, keys_post_rope, inv_freq);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_truncate_generated(const dims& d, int kv_type, layer_view* view, int kept_chunks, int exact,
                               cudaStream_t stream) {
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    truncate_generated_kernel<T><<<1, kThreads, 0, stream>>>(d, view, kept_chunks, exact);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_advance_generated(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer,
                              int batch, strided_tensor k_new, strided_tensor v_new, strided_tensor positions,
                              int positions_bits, bool keys_post_rope, const float* inv_freq, cudaStream_t stream) {
  launch_fold_generated(d, kv_type, views, batch_slots, layer, batch, inv_freq, stream);
  launch_append_generated(d, kv_type, views, batch_slots, layer, batch, k_new, v_new, positions, positions_bits,
                          keys_post_rope, inv_freq, stream);
}

}  // namespace shadowkv::cuda
