// Kernel 1b of the chunk selection: merges the tile partials into one normaliser per query head and writes
// score(c) (max or mean over the group of p_j(c)) in place into the group's first logits row (see chunk_selection.cu).
#pragma once

#include <cuda_runtime.h>

#include "device_layout.cuh"
#include "selection/selection_plan.cuh"

namespace shadowkv::cuda::selection {

/// What the logits rows hold when the score merge runs. int-sized: it travels in a kernel argument.
enum class score_input : int {
  logits_and_partials,   ///< decode: logits rows, and the logits kernel's tile partials at the start of the scores rows
  summed_probabilities,  ///< several tokens: p_j(c) summed over the tokens (-1 for non-candidates)
};

/// Grid (ceil(max_chunks / 256), Hkv, batch): the exp work spread over the GPU instead of batch * Hkv CTAs.
/// Throws cuda_error on a launch failure.
void launch_score_merge(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                        const logit_geometry& geo, score_input input, const step_workspace& ws, cudaStream_t stream);

}  // namespace shadowkv::cuda::selection
