#include <cfloat>

#include "cuda_check.hpp"
#include "dispatch.cuh"
#include "element_access.cuh"
#include "prompt_kernels.cuh"

namespace shadowkv::cuda {
namespace {

constexpr int kReduceThreads = 256;

// Sum over a block of `double` values (blockDim.x a multiple of 32, <= 1024).
__device__ double block_sum(double value, double* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffU, value, offset);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  double total = 0.0;
  const int warps = (blockDim.x + 31) / 32;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// One block per (token, head), one thread per dim.
template <typename T>
__global__ void prepare_prompt_keys_kernel(dims d, strided_tensor keys, strided_tensor positions, int positions_bits,
                                           int row, bool post_rope, const float* inv_freq, float* keys_pre,
                                           T* keys_post, long long* positions_out) {
  extern __shared__ float row_values[];
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int dim = threadIdx.x;
  const long long position = positions.data == nullptr
                                 ? t
                                 : load_index_any(positions.data, positions_bits,
                                                  row * positions.stride[0] + t * positions.stride[1]);
  const long long offset = row * keys.stride[0] + t * keys.stride[1] + h * keys.stride[2] + dim * keys.stride[3];
  const float x = load_any(keys.data, keys.type, offset);
  row_values[dim] = x;
  __syncthreads();
  float pre = x;
  float post = x;
  if (dim < d.rotary_dim) {
    const int half = d.rotary_dim / 2;
    const int pair = d.rope_interleaved ? dim / 2 : dim % half;
    int first;
    int second;
    rope_dims(d, pair, first, second);
    float x1 = row_values[first];
    float x2 = row_values[second];
    rope_pair(x1, x2, inv_freq[pair], position, d.attention_scaling, post_rope);
    const float rotated = dim == first ? x1 : x2;
    if (post_rope) {
      pre = rotated;
    } else {
      post = rotated;
    }
  }
  const long long width = static_cast<long long>(d.kv_heads) * d.head_dim;
  keys_pre[t * width + h * d.head_dim + dim] = pre;
  keys_post[t * width + h * d.head_dim + dim] = from_float<T>(post);
  if (h == 0 && dim == 0) positions_out[t] = position;
}

// One block per (chunk, head), one thread per dim.
template <typename T>
__global__ void landmarks_kernel(dims d, const T* keys_post, T* landmarks, float* min_cosine, int chunks) {
  __shared__ double scratch[32];
  const int c = blockIdx.x;
  const int h = blockIdx.y;
  const int dim = threadIdx.x;
  const bool active = dim < d.head_dim;
  const long long width = static_cast<long long>(d.kv_heads) * d.head_dim;
  double sum = 0.0;
  for (int i = 0; i < d.chunk && active; ++i) {
    sum += to_float(keys_post[(static_cast<long long>(c) * d.chunk + i) * width + h * d.head_dim + dim]);
  }
  const float mean = active ? round_through<T>(static_cast<float>(sum / d.chunk)) : 0.0F;
  if (active) landmarks[(static_cast<long long>(h) * d.max_chunks + c) * d.head_dim + dim] = from_float<T>(mean);
  const double landmark_norm = sqrt(block_sum(static_cast<double>(mean) * mean, scratch));
  double lowest = DBL_MAX;
  for (int i = 0; i < d.chunk; ++i) {
    const float key =
        active ? to_float(keys_post[(static_cast<long long>(c) * d.chunk + i) * width + h * d.head_dim + dim]) : 0.0F;
    const double dot = block_sum(static_cast<double>(mean) * key, scratch);
    const double key_norm = sqrt(block_sum(static_cast<double>(key) * key, scratch));
    lowest = fmin(lowest, dot / fmax(landmark_norm * key_norm, 1e-30));
  }
  if (dim == 0) min_cosine[static_cast<long long>(h) * chunks + c] = static_cast<float>(lowest);
}

// One block per head: `count` rounds of a block-wide argmin over the chunks not chosen yet.
__global__ void pick_outliers_kernel(dims d, const float* min_cosine, int chunks, int count,
                                     std::uint8_t* is_outlier, int* outlier_ids) {
  __shared__ float best_value[kReduceThreads];
  __shared__ int best_id[kReduceThreads];
  const int h = blockIdx.x;
  std::uint8_t* flags = is_outlier + static_cast<long long>(h) * d.max_chunks;
  for (int c = threadIdx.x; c < d.max_chunks; c += blockDim.x) flags[c] = 0;
  __syncthreads();
  const float* values = min_cosine + static_cast<long long>(h) * chunks;
  for (int round = 0; round < count; ++round) {
    float value = FLT_MAX;
    int id = INT_MAX;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      if (flags[c] != 0) continue;
      if (values[c] < value || (values[c] == value && c < id)) {
        value = values[c];
        id = c;
      }
    }
    best_value[threadIdx.x] = value;
    best_id[threadIdx.x] = id;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
      if (threadIdx.x < stride) {
        const float other = best_value[threadIdx.x + stride];
        const int other_id = best_id[threadIdx.x + stride];
        if (other < best_value[threadIdx.x] || (other == best_value[threadIdx.x] && other_id < best_id[threadIdx.x])) {
          best_value[threadIdx.x] = other;
          best_id[threadIdx.x] = other_id;
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) flags[best_id[0]] = 1;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int* ids = outlier_ids + static_cast<long long>(h) * d.max_outliers;
    int written = 0;
    for (int c = 0; c < chunks && written < count; ++c) {
      if (flags[c] != 0) ids[written++] = c;
    }
  }
}

// One block per (token, head), one thread per dim.
template <typename T>
__global__ void scatter_prompt_kernel(dims d, const T* keys_post, strided_tensor values, int row, int chunks,
                                      int outliers, const int* outlier_ids, const long long* positions,
                                      layer_view view, T* value_staging) {
  const int t = blockIdx.x;
  const int h = blockIdx.y;
  const int dim = threadIdx.x;
  const long long width = static_cast<long long>(d.kv_heads) * d.head_dim;
  const T key = keys_post[t * width + h * d.head_dim + dim];
  const T value = from_float<T>(load_any(
      values.data, values.type,
      row * values.stride[0] + t * values.stride[1] + h * values.stride[2] + dim * values.stride[3]));
  const int context_tokens = chunks * d.chunk;
  if (t < context_tokens) {
    const int c = t / d.chunk;
    const int i = t % d.chunk;
    value_staging[((static_cast<long long>(c) * d.kv_heads + h) * d.chunk + i) * d.head_dim + dim] = value;
    if (h == 0 && dim == 0) view.context_positions[t] = positions[t];
    // Outlier chunk of this head? ids are ascending: binary search.
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
      const long long out_row = static_cast<long long>(h) * d.max_outliers * d.chunk + lo * d.chunk + i;
      static_cast<T*>(view.outlier_keys)[out_row * d.head_dim + dim] = key;
      static_cast<T*>(view.outlier_values)[out_row * d.head_dim + dim] = value;
    }
  } else {
    const int local = t - context_tokens;
    const long long exact_row = static_cast<long long>(h) * (d.local_capacity + d.window) + local;
    static_cast<T*>(view.exact_keys)[exact_row * d.head_dim + dim] = key;
    static_cast<T*>(view.exact_values)[exact_row * d.head_dim + dim] = value;
    if (h == 0 && dim == 0) view.exact_positions[local] = positions[t];
  }
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
}

unsigned blocks_for(long long count, int threads) { return static_cast<unsigned>((count + threads - 1) / threads); }

}  // namespace

void launch_prepare_prompt_keys(const dims& d, int kv_type, strided_tensor keys, strided_tensor positions,
                                int positions_bits, int row, int len, bool post_rope, const float* inv_freq,
                                float* keys_pre, void* keys_post, long long* positions_out, cudaStream_t stream) {
  if (len == 0) return;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    prepare_prompt_keys_kernel<T><<<dim3(len, d.kv_heads), d.head_dim, d.head_dim * sizeof(float), stream>>>(
        d, keys, positions, positions_bits, row, post_rope, inv_freq, keys_pre, static_cast<T*>(keys_post),
        positions_out);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_landmarks(const dims& d, int kv_type, const void* keys_post, int chunks, void* landmarks,
                      float* min_cosine, cudaStream_t stream) {
  if (chunks == 0) return;
  const int threads = ((d.head_dim + 31) / 32) * 32;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    landmarks_kernel<T><<<dim3(chunks, d.kv_heads), threads, 0, stream>>>(d, static_cast<const T*>(keys_post),
                                                                          static_cast<T*>(landmarks), min_cosine,
                                                                          chunks);
  });
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_pick_outliers(const dims& d, const float* min_cosine, int chunks, int count, std::uint8_t* is_outlier,
                          int* outlier_ids, cudaStream_t stream) {
  pick_outliers_kernel<<<d.kv_heads, kReduceThreads, 0, stream>>>(d, min_cosine, chunks, count, is_outlier,
                                                                  outlier_ids);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

void launch_scatter_prompt(const dims& d, int kv_type, const void* keys_post, strided_tensor values, int row,
                           int len, int chunks, int outliers, const int* outlier_ids, const long long* positions,
                           layer_view view, void* value_staging, cudaStream_t stream) {
  if (len == 0) return;
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scatter_prompt_kernel<T><<<dim3(len, d.kv_heads), d.head_dim, 0, stream>>>(
        d, static_cast<const T*>(keys_post), values, row, chunks, outliers, outlier_ids, positions, view,
        static_cast<T*>(value_staging));
  });
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

void launch_set_prefill_counters(layer_view* view, int prompt_len, int context_chunks, int outlier_chunks,
                                 int local_len, const long long* positions, int len, cudaStream_t stream) {
  set_prefill_counters_kernel<<<1, 1, 0, stream>>>(view, prompt_len, context_chunks, outlier_chunks, local_len,
                                                   positions, len);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda
