#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda_check.hpp"
#include "finite_check.cuh"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to keep every SM of an H200 streaming a prefill's keys (tens of MB), few enough that a decode input
// (thousands of elements) is one or two blocks: each thread takes >= kElementsPerThread elements before another block
// is added.
constexpr long long kElementsPerThread = 16;
constexpr long long kMaxBlocksPerView = 1024;

struct finite_check_batch {
  finite_check_view views[kFiniteCheckViewsPerLaunch];
  long long elements[kFiniteCheckViewsPerLaunch];
  int* non_finite;
};

// NaN and ±Inf are the encodings whose exponent bits are all ones, in every format: test the bits (no conversion).
__device__ __forceinline__ bool non_finite(float v) { return (__float_as_uint(v) & 0x7f800000U) == 0x7f800000U; }
__device__ __forceinline__ bool non_finite(__half v) { return (__half_as_ushort(v) & 0x7c00U) == 0x7c00U; }
__device__ __forceinline__ bool non_finite(__nv_bfloat16 v) {
  return (__bfloat16_as_ushort(v) & 0x7f80U) == 0x7f80U;
}

// Whether this thread's grid-stride share of `view` holds a non-finite element. Rank 1 (every contiguous view, once
// coalesced on the host) indexes directly; higher ranks unravel the linear index.
template <typename T>
__device__ bool thread_finds_non_finite(const finite_check_view& view, long long elements) {
  const T* data = static_cast<const T*>(view.data);
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool found = false;
  if (view.rank == 1) {
    const long long stride = view.stride[0];
    for (long long i = first; i < elements; i += step) found |= non_finite(data[i * stride]);
    return found;
  }
  for (long long i = first; i < elements; i += step) {
    long long rest = i;
    long long offset = 0;
#pragma unroll
    for (int dim = 3; dim > 0; --dim) {
      if (dim < view.rank) {
        const long long extent = view.shape[dim];
        const long long outer = rest / extent;
        offset += (rest - outer * extent) * view.stride[dim];
        rest = outer;
      }
    }
    offset += rest * view.stride[0];
    found |= non_finite(data[offset]);
  }
  return found;
}

// blockIdx.y picks the view; blocks of a view stride over its elements. One block-wide OR, then one atomic per block
// that found something (none in the common case), so the flag costs nothing when the input is finite.
__global__ void __launch_bounds__(kThreads) find_non_finite_kernel(const __grid_constant__ finite_check_batch batch) {
  const int v = static_cast<int>(blockIdx.y);
  const finite_check_view& view = batch.views[v];
  const long long elements = batch.elements[v];
  bool found = false;
  switch (view.type) {  // uniform over the block
    case element_f16: found = thread_finds_non_finite<__half>(view, elements); break;
    case element_bf16: found = thread_finds_non_finite<__nv_bfloat16>(view, elements); break;
    default: found = thread_finds_non_finite<float>(view, elements); break;
  }
  if (__syncthreads_or(found ? 1 : 0) != 0 && threadIdx.x == 0) atomicOr(&batch.non_finite[v], 1);
}

// `view` with unit extents dropped and neighbours merged where the outer stride is the inner extent times the inner
// stride: a contiguous (or uniformly strided) tensor of any rank becomes rank 1. Returns the element count.
long long coalesce(finite_check_view& view) {
  finite_check_view merged = view;
  merged.rank = 0;
  long long elements = 1;
  for (int dim = 0; dim < view.rank; ++dim) {
    const long long extent = view.shape[dim];
    elements *= extent;
    if (extent == 1) continue;
    const long long stride = view.stride[dim];
    if (merged.rank > 0) {
      const int last = merged.rank - 1;
      if (merged.stride[last] == stride * extent) {  // the previous (outer) dim steps over this one exactly
        merged.shape[last] *= extent;
        merged.stride[last] = stride;
        continue;
      }
    }
    merged.shape[merged.rank] = extent;
    merged.stride[merged.rank] = stride;
    ++merged.rank;
  }
  if (merged.rank == 0) {  // one element (or a rank-0 view)
    merged.rank = 1;
    merged.shape[0] = 1;
    merged.stride[0] = 1;
  }
  view = merged;
  return elements;
}

}  // namespace

void launch_find_non_finite(const finite_check_view* views, int count, int* non_finite, cudaStream_t stream) {
  for (int first = 0; first < count; first += kFiniteCheckViewsPerLaunch) {
    finite_check_batch batch{};
    batch.non_finite = non_finite + first;
    const int in_batch = std::min(kFiniteCheckViewsPerLaunch, count - first);
    long long largest = 0;
    for (int i = 0; i < in_batch; ++i) {
      batch.views[i] = views[first + i];
      SHADOWKV_EXPECTS(batch.views[i].rank >= 0 && batch.views[i].rank <= 4, "finite check: view ", first + i,
                       " has rank ", batch.views[i].rank, " (at most 4)");
      batch.elements[i] = coalesce(batch.views[i]);
      largest = std::max(largest, batch.elements[i]);
    }
    if (largest == 0) continue;  // only empty views: all finite
    const long long per_block = kThreads * kElementsPerThread;
    const long long blocks = std::clamp((largest + per_block - 1) / per_block, 1LL, kMaxBlocksPerView);
    find_non_finite_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(in_batch)), kThreads, 0,
                             stream>>>(batch);
    SHADOWKV_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace shadowkv::cuda
