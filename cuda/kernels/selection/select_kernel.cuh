// Kernel 2 of the chunk selection, one CTA of 1024 threads per (sequence, KV head): the scores from what kernels 1
// and 1b left (or, select_mode::in_kernel, from the landmarks themselves), the top-k chunks, and the temporal-cache
// update (see chunk_selection.cu).
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"
#include "selection/selection_plan.cuh"

namespace shadowkv::cuda::selection {

/// Grid (Hkv, batch), `shared_bytes` of dynamic shared memory laid out as `geo` says (planned in chunk_selection.cu).
/// Throws cuda_error on a launch failure.
void launch_select_kernel(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                          int batch, const strided_tensor& queries, int tokens, const step_workspace& ws,
                          const select_geometry& geo, long long shared_bytes, cudaStream_t stream);

}  // namespace shadowkv::cuda::selection
