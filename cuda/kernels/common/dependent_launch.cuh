// Programmatic dependent launch (sm_90): the kernels of a decode step follow each other on one stream, each a few to a
// few dozen µs at small batch, and each waits for the one before it to drain, then for its own launch and CTA start-up.
// Launched with cudaLaunchAttributeProgrammaticStreamSerialization, a kernel's CTAs may be scheduled while the kernel
// before it still runs; every such kernel starts with wait_for_prior_grids(), which returns once the grids it depends
// on have finished and their writes are visible. So no kernel reads or writes anything before its predecessor is done
// (the order is the stream's, as without the attribute); only the launch and the CTAs' start-up overlap the
// predecessor's tail. A kernel launched plainly (programmatic = false: the value fetch on the copy stream) finds the
// wait returning at once.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda_check.hpp"

namespace shadowkv::cuda {

/// First statement of every kernel that launch_after_prior_grid may launch: nothing of the kernel runs before the
/// grids it depends on are done. A no-op for a kernel launched without the attribute.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the stream's next kernel, if launched programmatically, start once every CTA of this grid has called this or
/// exited (without it: once this grid has ended). The next kernel still waits at its wait_for_prior_grids() for this
/// grid to end; what it does before that wait overlaps this one.
__device__ __forceinline__ void release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Launches kernel<<<grid, block, shared_bytes, stream>>>(args...) with the `extra_count` launch attributes `extra`
/// (e.g. a cluster size), programmatically dependent on the stream's previous kernel when `programmatic` (the kernel
/// must begin with wait_for_prior_grids). Throws cuda_error when the launch fails.
template <typename... Params, typename... Args>
void launch_after_prior_grid_with(const cudaLaunchAttribute* extra, int extra_count, void (*kernel)(Params...),
                                  dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                                  bool programmatic, Args&&... args) {
  cudaLaunchAttribute attributes[4] = {};
  int count = 0;
  for (int i = 0; i < extra_count && count < 3; ++i) attributes[count++] = extra[i];
  if (programmatic) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = count > 0 ? attributes : nullptr;
  config.numAttrs = static_cast<unsigned>(count);
  SHADOWKV_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

/// The same without extra attributes.
template <typename... Params, typename... Args>
void launch_after_prior_grid(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
                             cudaStream_t stream, bool programmatic, Args&&... args) {
  launch_after_prior_grid_with(nullptr, 0, kernel, grid, block, shared_bytes, stream, programmatic,
                               std::forward<Args>(args)...);
}

}  // namespace shadowkv::cuda
