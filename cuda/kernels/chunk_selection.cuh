// Landmark scores, top-k per KV head and the temporal-cache scan (docs/semantics.md decode steps 2–4,
// docs/semantics.md "Decode" 3–6), for a batch of (sequence, layer) entries.
//
// For entry b (slot = batch_slots[b], view = views[slot * num_layers + layer]) and KV head h:
//   candidates = chunks c < context_chunks with is_outlier[h*max_chunks + c] == 0;
//   p_j(c) = softmax over candidates of softmax_scale * q_{t,j}·landmark[h, c] for each query token t, summed over t;
//   score(c) = max over the G query heads j of h of p_j(c) (dims::group_mean: their mean);
//   selected = the min(k, #candidates) best by descending score, ties to the smaller chunk id, written ascending
//              to workspace.selected[(b*Hkv + h)*k ...] and padded with -1;
//   cache (K = dims::cache_slots slots per head, cache_chunks[h*K ...]):
//     K == k: a buffer slot whose chunk is selected is a hit and stays; other slots are freed (cache_chunks = -1
//          and slot_of_chunk[old] = -1); each selected chunk not cached (a miss), in ascending chunk id, takes the
//          lowest free slot (cache_chunks, slot_of_chunk updated);
//     K > k: the selection's number is now = selection_clock[h] + 1 (written back); hits get cache_last_used = now;
//          each miss, in ascending chunk id, takes the lowest-index empty slot, else the slot not selected now with
//          the smallest (cache_last_used, index), whose chunk is dropped, and is stamped now
//          (cpp/src/lru_selection_cache.hpp); selected_slots[h*k ...] lists the selected slots ascending (-1 padding);
//   workspace.miss_slots[(b*Hkv + h)*k ...] lists the filled slots (ascending chunk order), miss_counts[b*Hkv + h]
//   their number;
//   counters[0] += hits, counters[1] += misses, counters[2] += 1 per entry.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// queries: [B, Tq, Hq, D] (strides in queries.stride[0..3]), any element type; tokens = Tq >= 1.
/// kv_type: element_type of landmarks. beside_ctas: CTAs another kernel may keep resident while this runs (an earlier
/// pipeline part's value fetch; 0 when none): the one-wave landmark-logits grid is that many CTAs smaller, so that
/// none of its CTAs waits for a second wave. `logits_done`, when not null, is recorded on the stream between the
/// landmark logits and the select kernel. Never allocates; throws shadowkv::cuda_error on a launch failure.
void launch_select_chunks(const dims& d, int kv_type, layer_view* views, const int* batch_slots, int layer, int batch,
                          strided_tensor queries, int tokens, const step_workspace& workspace, int beside_ctas,
                          cudaStream_t stream, cudaEvent_t logits_done = nullptr);

/// Bytes of the selection's own workspace rows for `max_batch` sequences on the current device:
/// step_workspace::selection_partials and step_workspace::radix_keys (0: not needed, the radix keys fit in the select
/// kernel's shared memory). launch_select_chunks throws invalid_argument when a needed row is null.
struct selection_workspace_bytes {
  std::size_t partials = 0;
  std::size_t radix_keys = 0;
};
selection_workspace_bytes chunk_selection_workspace(const dims& d, int kv_type, int max_batch);

}  // namespace shadowkv::cuda
