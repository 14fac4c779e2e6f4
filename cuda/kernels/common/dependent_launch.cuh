// Programmatic dependent launch (sm_90): the kernels of a decode step follow each other on one stream, each a few to a
// few dozen µs at small batch, and each waits for the one before it to drain, then for its own launch and CTA start-up.
// Launched with cudaLaunchAttributeProgrammaticStreamSerialization, a kernel's CTAs may be scheduled while the kernel
// before it still runs; every such kernel starts with begin_dependent_kernel(), whose wait returns once the grids it
// depends on have finished and their writes are visible. So no kernel reads or writes anything before its predecessor
// is done (the order is the stream's, as without the attribute); only the launch and the CTAs' start-up overlap the
// predecessor. When the successor may be scheduled is dims::programmatic_launch's choice (SHADOWKV_PROGRAMMATIC_LAUNCH):
//  * kLaunchEarly ("on", the default): every kernel of the step, the first included, lets its successor launch at its
//    own first line (griddepcontrol.launch_dependents). The successor's CTAs are then scheduled once all of this
//    kernel's CTAs have started, into whatever room they leave, and wait there.
//  * kLaunchAtTail ("tail"): the successor is scheduled as this kernel's CTAs exit.
//  * kPlainLaunch ("off"): plain launches; the wait returns at once.
// A successor scheduled early cannot delay its predecessor: it launches only after every CTA of the predecessor has
// started (so it never takes the room of one not yet scheduled), and its warps wait without issuing.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda_check.hpp"
#include "device_layout.cuh"

namespace shadowkv::cuda {

/// First statement of every kernel that launch_after_prior_grid may launch, and of the step's first kernel (launched
/// plainly): lets the stream's next kernel launch now (kLaunchEarly), then waits until the grids this one depends on
/// are done (a no-op for a kernel launched without the attribute). Nothing of the kernel runs before that.
__device__ __forceinline__ void begin_dependent_kernel(int programmatic_launch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (programmatic_launch == kLaunchEarly) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#else
  (void)programmatic_launch;
#endif
}

/// Launches kernel<<<grid, block, shared_bytes, stream>>>(args...) with the `extra_count` launch attributes `extra`
/// (e.g. a cluster size), programmatically dependent on the stream's previous kernel when `programmatic` (the kernel
/// must begin with begin_dependent_kernel). Throws cuda_error when the launch fails.
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
