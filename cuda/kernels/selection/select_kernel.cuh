// Kernel 2 of the chunk selection, one CTA of 1024 threads (or a cluster of them) per (sequence, KV head): the group's
// chunk scores from the logits that kernel 1 left, the top-k chunks, and the temporal-cache update (see
// chunk_selection.cu).
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"
#include "selection/group_scores.cuh"
#include "selection/selection_plan.cuh"

namespace shadowkv::cuda::selection {

/// cluster == 1: grid (Hkv, batch), geo.shared_bytes of dynamic shared memory (plan_select). cluster 2, 4 or 8
/// (plan_select_cluster): grid (Hkv * cluster, batch) in clusters of `cluster` CTAs, each ranking a slice of the
/// chunks, with the radix keys in ws.radix_keys. `input` says what the logits rows hold; with logits, the tile partials
/// of `logit_geo` in ws.selection_partials give the normalisers. Throws invalid_argument when the radix keys need
/// ws.radix_keys, or the logits need ws.selection_partials, and it is null, or `cluster` is not 1, 2, 4 or 8;
/// cuda_error on a launch failure.
void launch_select_kernel(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                          const step_workspace& ws, const select_geometry& geo, int cluster, score_input input,
                          const logit_geometry& logit_geo, cudaStream_t stream);

/// Clusters of `cluster` (2, 4 or 8) CTAs of the select kernel that the current device runs at once, with the most
/// dynamic shared memory a launch may take (one CTA an SM): cudaOccupancyMaxActiveClusters, asked once per device
/// and size. Throws cuda_error when the runtime cannot say.
int select_clusters_at_once(int cluster);

}  // namespace shadowkv::cuda::selection
