// Decode step 4 (misses only), beside the key rebuild: the values of the missed chunks, from the value store (pinned
// host memory read across PCIe, or device memory) into their slots of the selection cache, on the copy stream. Reads
// the miss lists that launch_select_chunks wrote into the step workspace.
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Values of every missed (entry, head, chunk): one contiguous run of C*D values of the value store (T, or e4m3
/// codes with a float32 scale per (chunk, head) when dims::value_fp8, dequantised to T on the way) into its buffer
/// slot of cache_values; adds the bytes read to counters[3]. A persistent grid of at most `ctas` CTAs (8 warps each)
/// covers every item, whatever the batch: few CTAs leave the multiprocessors to the kernels that run beside the fetch
/// (the key rebuild, a later part's selection); the caller sizes it (cuda_backend: enough bytes in flight for PCIe,
/// more for device values). `priority` is a launch priority (cudaLaunchAttributePriority, as
/// cudaDeviceGetStreamPriorityRange counts: lower is sooner), or 0 for the stream's own.
void launch_fetch_values(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                         const step_workspace& workspace, int ctas, int priority, cudaStream_t stream);

}  // namespace shadowkv::cuda
