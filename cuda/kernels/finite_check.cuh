// Whether caller tensors hold NaN or ±Inf: the device side of backend::all_finite (docs/semantics.md, "Non-finite
// inputs"). The CUDA backend zeroes one int flag per tensor, launches this, copies the flags to pinned host memory
// and waits on the call's stream before the call writes anything.
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// A caller's floating-point tensor of rank <= 4: element type (element_type), shape and strides in elements (any
/// sign, zero included: the check reads what the view addresses, as the store's kernels would).
struct finite_check_view {
  const void* data = nullptr;
  int type = element_f32;
  int rank = 0;
  long long shape[4] = {};
  long long stride[4] = {};
};

/// Views one launch checks (their descriptors travel in the kernel's parameters).
inline constexpr int kFiniteCheckViewsPerLaunch = 16;

/// Sets non_finite[i] to 1 where views[i] holds a NaN or ±Inf (exponent bits all ones, whatever the payload) and
/// leaves it alone otherwise: zero the `count` flags first. Views may differ in element type, shape and strides; an
/// empty view (a zero extent) is finite. Enqueues one kernel per kFiniteCheckViewsPerLaunch views on `stream`;
/// allocates nothing and does not synchronise. Throws cuda_error if a launch fails.
void launch_find_non_finite(const finite_check_view* views, int count, int* non_finite, cudaStream_t stream);

}  // namespace shadowkv::cuda
