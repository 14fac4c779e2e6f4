// Kernel 1 of the chunk selection: softmax_scale * q_j·L[c] of tiles of landmark rows for all G query heads of a
// KV head, and per tile the softmax partials the normalisers are merged from (see chunk_selection.cu). Used when the
// streaming decode kernel (landmark_logits.cu) does not cover the shape, and for several query tokens.
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"
#include "selection/selection_plan.cuh"

namespace shadowkv::cuda::selection {

/// Tiles of `geo` for the store's element type `element_bytes` (4 or 2) and dims `d`.
logit_geometry plan_logits(const dims& d, int element_bytes);

/// Decode (tokens == 1): one launch writing the logits to ws.logits and the tile partials to ws.selection_partials
/// (rows of partial_row_floats). Several tokens: per token t, a launch of the partials of token t, then one that adds p_{j,t} to logits
/// row j. Grid (ceil(geo.tiles / tiles_per_cta), Hkv, batch), tiles_per_cta from `limits` (about one wave).
/// Throws invalid_argument when a tile does not fit the device's shared memory, cuda_error on a launch failure.
void launch_landmark_scoring(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                             int batch, const strided_tensor& queries, int tokens, const logit_geometry& geo,
                             const step_workspace& ws, const device_limits& limits, cudaStream_t stream);

}  // namespace shadowkv::cuda::selection
