// The temporal cache's replacement policy for one (sequence, layer, KV head), run by the select kernel right after
// the selection (DESIGN.md §2 decode step 4): hits keep their buffer slots, the other slots are freed, and the misses,
// in ascending chunk id, take the free slots in ascending order.
#pragma once

#include <cuda_runtime.h>

#include "common/ordered_compaction.cuh"

namespace shadowkv::cuda::selection {

/// cache[0, k): the chunk in each buffer slot (-1: empty); slot_of[0, mc): the slot of each chunk (-1: none), O(1)
/// membership; is_selected[c] (c < n): whether chunk c was selected; selected[0, take): the selected ids, ascending.
/// Updates cache and slot_of, writes the filled slots to miss_slots[0, filled) (in the misses' ascending chunk order)
/// and pads miss_slots[filled, k) with -1. Returns filled, the misses that got a slot. Called by every thread of a
/// block of kOrderedPassThreads threads; `pass_scratch`: ordered_pass's shared scratch.
__device__ __forceinline__ int update_temporal_cache(int n, int mc, int k, int take, const unsigned* is_selected,
                                                     const int* selected, int* cache, int* slot_of, int* miss_slots,
                                                     unsigned* pass_scratch) {
  const int tid = threadIdx.x;
  // 1: free every slot whose chunk is not selected (hits stay where they are).
  for (int s = tid; s < k; s += kOrderedPassThreads) {
    const int old = cache[s];
    if (old < 0) continue;
    const bool hit = old < n && is_selected[old] != 0;
    if (!hit) {
      cache[s] = -1;
      if (old < mc && slot_of[old] == s) slot_of[old] = -1;
    }
  }
  __syncthreads();
  // 2: free slots in ascending order, parked in miss_slots (miss m takes the m-th free slot).
  const unsigned free_slots =
      ordered_pass(k, pass_scratch, [&](int s) -> unsigned { return cache[s] < 0 ? 1U : 0U; },
                   [&](int s, unsigned f, unsigned before, unsigned) {
                     if (f != 0) miss_slots[before] = s;
                   })
          .x;
  // 3: misses in ascending chunk id take those slots. A miss's flag reads only its own chunk's slot_of entry
  // (still -1) and hits' slots, which no emit writes, so both passes agree.
  const unsigned misses = ordered_pass(
                              take, pass_scratch,
                              [&](int i) -> unsigned {
                                const int c = selected[i];
                                const int s = slot_of[c];
                                return s >= 0 && s < k && cache[s] == c ? 0U : 1U;
                              },
                              [&](int i, unsigned f, unsigned before, unsigned) {
                                if (f == 0 || before >= free_slots) return;
                                const int c = selected[i];
                                const int s = miss_slots[before];
                                cache[s] = c;
                                slot_of[c] = s;
                              })
                              .x;
  const int filled = static_cast<int>(min(misses, free_slots));
  for (int m = filled + tid; m < k; m += kOrderedPassThreads) miss_slots[m] = -1;
  return filled;
}

}  // namespace shadowkv::cuda::selection
