// The temporal cache's replacement policy for one (sequence, layer, KV head), run by the select kernel right after
// the selection (docs/semantics.md decode step 4, docs/semantics.md Decode 6). Two rules, as on the CPU backend:
//  * K == k (update_temporal_cache): hits keep their buffer slots, the other slots are freed, and the misses, in
//    ascending chunk id, take the free slots in ascending order.
//  * K > k (update_lru_cache): slots keep their chunk until evicted; the misses, in ascending chunk id, take the
//    lowest-index empty slot, else the slot not selected at this step that was selected least recently (ties: the
//    lowest index) — cpp/src/lru_selection_cache.hpp, slot indices included.
#pragma once

#include <cuda_runtime.h>

#include "common/ordered_compaction.cuh"
#include "selection/radix_select.cuh"

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
  // ordered_pass calls flag(i) in both of its passes from the same thread, item after item in the same order: a flag
  // is computed by the first call and kept for the second when the thread has one item (k and take <= 1024, as at
  // every budget up to 8192 tokens of chunk 8), so the second pass issues no global loads. A thread with more items
  // recomputes them (the same answer: nothing an emit writes is read by another item's flag).
  int memo_slot = -1;
  unsigned memo_free = 0;
  const unsigned free_slots = ordered_pass(
                                  k, pass_scratch,
                                  [&](int s) -> unsigned {
                                    if (s != memo_slot) {
                                      memo_free = cache[s] < 0 ? 1U : 0U;
                                      memo_slot = s;
                                    }
                                    return memo_free;
                                  },
                                  [&](int s, unsigned f, unsigned before, unsigned) {
                                    if (f != 0) miss_slots[before] = s;
                                  })
                                  .x;
  // 3: misses in ascending chunk id take those slots. A miss's flag reads only its own chunk's slot_of entry
  // (still -1) and hits' slots, which no emit writes, so both passes agree. Its three dependent loads (selected,
  // slot_of, cache) are made once, as above, and the chunk id is kept for the emit.
  int memo_item = -1;
  int memo_chunk = -1;
  unsigned memo_miss = 0;
  auto miss_of = [&](int i) -> unsigned {
    if (i != memo_item) {
      const int c = selected[i];
      const int s = slot_of[c];
      memo_miss = s >= 0 && s < k && cache[s] == c ? 0U : 1U;
      memo_chunk = c;
      memo_item = i;
    }
    return memo_miss;
  };
  const unsigned misses = ordered_pass(take, pass_scratch, miss_of,
                                       [&](int i, unsigned f, unsigned before, unsigned) {
                                         if (f == 0 || before >= free_slots) return;
                                         const int c = i == memo_item ? memo_chunk : selected[i];
                                         const int s = miss_slots[before];
                                         cache[s] = c;
                                         slot_of[c] = s;
                                       })
                              .x;
  const int filled = static_cast<int>(min(misses, free_slots));
  for (int m = filled + tid; m < k; m += kOrderedPassThreads) miss_slots[m] = -1;
  return filled;
}

/// Whether bit c of a bitmap in shared memory is set.
__device__ __forceinline__ bool bit_of(const unsigned* bits, int c) { return ((bits[c >> 5] >> (c & 31)) & 1U) != 0U; }

/// The K == k rule of update_temporal_cache, from the head's state in shared memory (select_cluster_kernel's first
/// CTA; cluster_shared_layout): cache_chunks[0, k) (the slots' chunks, kept current here and written through to
/// `cache`), selected_ids[0, take) (this step's selection, ascending), cached_bits (chunks in the cache before the
/// step) and selected_bits (zeroed; set here), free_slots[0, k) and miss_chunks[0, k) (scratch). The same slots as
/// update_temporal_cache, whose rules it follows, without its dependent global loads (a slot's chunk, then that
/// chunk's flag and slot_of entry): slot_of is only written, cleared for a freed chunk and set for a miss, since slot_of is the
/// inverse of the cache (each chunk in at most one slot: both rules and the prefill's reset keep it so). Writes
/// miss_slots as update_temporal_cache does and returns the misses that got a slot. Called by every thread of a block
/// of kOrderedPassThreads threads; `pass_scratch`: ordered_pass's shared scratch.
__device__ __forceinline__ int update_temporal_cache_shared(int n, int mc, int k, int take, const int* selected_ids,
                                                            int* cache_chunks, const unsigned* cached_bits,
                                                            unsigned* selected_bits, int* free_slots,
                                                            int* miss_chunks, int* cache,
                                                            int* slot_of, int* miss_slots, unsigned* pass_scratch) {
  const int tid = threadIdx.x;
  for (int i = tid; i < take; i += kOrderedPassThreads) {
    const int c = selected_ids[i];
    atomicOr(&selected_bits[c >> 5], 1U << (c & 31));
  }
  __syncthreads();
  // 1: free every slot whose chunk is not selected (hits stay where they are).
  for (int s = tid; s < k; s += kOrderedPassThreads) {
    const int old = cache_chunks[s];
    if (old < 0 || (old < n && bit_of(selected_bits, old))) continue;
    cache_chunks[s] = -1;
    cache[s] = -1;
    if (old < mc) slot_of[old] = -1;
  }
  __syncthreads();
  // 2 and 3 in one ordered pass over [0, k) with two predicates: slot i is free now (the free slots in ascending
  // order: miss m takes the m-th), and selection i is a miss (selected, not cached before the step; take <= k). The
  // misses' chunks, in ascending order, are parked in miss_chunks; once the pass has ended (its last barrier), miss m
  // takes free slot m. (Two passes, one a list, took two more block barriers and a scan.)
  const uint2 counts = ordered_pass(
      k, pass_scratch,
      [&](int i) -> unsigned {
        const unsigned free_slot = cache_chunks[i] < 0 ? 1U : 0U;
        const unsigned miss = i < take && !bit_of(cached_bits, selected_ids[i]) ? 2U : 0U;
        return free_slot | miss;
      },
      [&](int i, unsigned f, unsigned free_before, unsigned misses_before) {
        if ((f & 1U) != 0) {
          free_slots[free_before] = i;
          miss_slots[free_before] = i;
        }
        if ((f & 2U) != 0) miss_chunks[misses_before] = selected_ids[i];
      });
  const int filled = static_cast<int>(min(counts.x, counts.y));
  for (int m = tid; m < filled; m += kOrderedPassThreads) {
    const int c = miss_chunks[m];
    const int s = free_slots[m];
    cache[s] = c;
    slot_of[c] = s;
  }
  for (int m = filled + tid; m < k; m += kOrderedPassThreads) miss_slots[m] = -1;
  return filled;
}

/// Eviction order of a slot that is not selected at this step: empty slots first (by index), then the least recently
/// selected. As a radix key (larger goes first; ties go to the lower index, as compact_top_k takes them): empty =
/// 0xFFFFFFFF, else the slot's age now - last_used >= 1, saturated at 0xFFFFFFFE. The saturation never binds: a
/// sequence has at most max_seq_len + 1 selections per layer, and max_seq_len tokens fit int32 arrays.
__device__ __forceinline__ unsigned lru_eviction_key(int chunk, long long last_used, long long now) {
  if (chunk < 0) return 0xFFFFFFFFU;
  const unsigned long long age = static_cast<unsigned long long>(now - last_used);
  return age >= 0xFFFFFFFEULL ? 0xFFFFFFFEU : static_cast<unsigned>(age);
}

/// Whether slot a goes before slot b in the eviction order (both not selected at this step): empty before filled,
/// then the older last_used, then the lower index. Exact (64-bit stamps), unlike the radix key.
__device__ __forceinline__ bool evicted_before(int a, int b, const int* cache, const long long* last_used) {
  const bool empty_a = cache[a] < 0;
  const bool empty_b = cache[b] < 0;
  if (empty_a != empty_b) return empty_a;
  if (!empty_a && last_used[a] != last_used[b]) return last_used[a] < last_used[b];
  return a < b;
}

/// The K > k rule (cpp/src/lru_selection_cache.hpp) for one head: cache[0, K) and last_used[0, K) (the slots' chunks
/// and stamps), slot_of[0, mc), `now` = this selection's number (larger than every stamp). is_selected and selected
/// as for update_temporal_cache; `keys` is radix_keys (is_selected aliases it; K <= mc entries are reused as eviction
/// keys once the hits are stamped). Writes the filled slots to miss_slots[0, misses) (in the misses' ascending chunk
/// order, -1 padding to k) and this step's selected slots, ascending, to selected_slots[0, take) (-1 padding to k).
/// Returns the number of misses (each gets a slot: at most k <= K chunks are selected, so an unselected slot always
/// remains). Called by every thread of a block of kOrderedPassThreads threads, with the radix select's shared
/// scratch (free again after the top-k).
template <int kThreads>
__device__ __forceinline__ int update_lru_cache(int n, int mc, int k, int capacity, int take, long long now,
                                                unsigned* keys, const int* selected, int* cache, int* slot_of,
                                                long long* last_used, int* miss_slots, int* selected_slots,
                                                unsigned* histogram,
                                                typename radix_digit_scan<kThreads>::TempStorage& scan_storage,
                                                unsigned* radix_found, unsigned* pass_scratch) {
  static_assert(kThreads == kOrderedPassThreads, "ordered_pass needs the whole block");
  const int tid = threadIdx.x;
  const unsigned* is_selected = keys;
  // 1: hits are stamped `now` (stamp == now marks "selected at this step" from here on: every other stamp is older).
  // __syncthreads_count counts them and is the barrier before `keys` is overwritten.
  int hits = 0;
  for (int base = 0; base < capacity; base += kThreads) {
    const int s = base + tid;
    bool hit = false;
    if (s < capacity) {
      const int c = cache[s];
      hit = c >= 0 && c < n && is_selected[c] != 0;
      if (hit) last_used[s] = now;
    }
    hits += __syncthreads_count(hit ? 1 : 0);
  }
  const int misses = take - hits;

  if (misses > 0) {
    // 2: the `misses` first slots of the eviction order among the slots not selected now (capacity - hits of them),
    // as a set: the radix select of radix_select.cuh over eviction keys (0 for the selected slots).
    const int first_bits_shift = 32 - kRadixFirstBits;
    for (int i = tid; i < (1 << kRadixFirstBits); i += kThreads) histogram[i] = 0;
    __syncthreads();
    for (int s = tid; s < capacity; s += kThreads) {
      const unsigned key = last_used[s] == now ? 0U : lru_eviction_key(cache[s], last_used[s], now);
      keys[s] = key;
      atomicAdd(&histogram[key >> first_bits_shift], 1U);
    }
    __syncthreads();
    const radix_threshold rule = find_radix_threshold<kThreads>(keys, capacity, capacity - hits, misses, histogram,
                                                                scan_storage, radix_found);
    // The victims, ascending slot index, parked in selected_slots (rewritten below).
    compact_top_k(keys, capacity, misses, misses, rule, pass_scratch, selected_slots);
    // 3: victim of rank r (in eviction order) goes to the r-th miss: miss_slots[r]. At most k victims, so the
    // quadratic rank is at most k reads per victim.
    for (int i = tid; i < misses; i += kThreads) {
      const int v = selected_slots[i];
      int rank = 0;
      for (int j = 0; j < misses; ++j) rank += evicted_before(selected_slots[j], v, cache, last_used) ? 1 : 0;
      miss_slots[rank] = v;
    }
    __syncthreads();
    // 4: misses in ascending chunk id take their slots. A miss's flag reads its own chunk's slot_of entry and hits'
    // slots; an emit writes only a victim's slot (not selected now) and the slot_of entries of the victim's old
    // chunk (not selected) and of its own chunk, so both passes of ordered_pass agree.
    ordered_pass(
        take, pass_scratch,
        [&](int i) -> unsigned {
          const int c = selected[i];
          const int s = slot_of[c];
          return s >= 0 && s < capacity && cache[s] == c ? 0U : 1U;
        },
        [&](int i, unsigned f, unsigned before, unsigned) {
          if (f == 0) return;
          const int c = selected[i];
          const int s = miss_slots[before];
          const int old = cache[s];
          if (old >= 0 && old < mc && slot_of[old] == s) slot_of[old] = -1;
          cache[s] = c;
          slot_of[c] = s;
          last_used[s] = now;
        });
  }
  for (int m = misses + tid; m < k; m += kThreads) miss_slots[m] = -1;
  // 5: the slots attention reads, ascending: exactly those stamped now.
  const unsigned listed = ordered_pass(
                              capacity, pass_scratch,
                              [&](int s) -> unsigned { return cache[s] >= 0 && last_used[s] == now ? 1U : 0U; },
                              [&](int s, unsigned f, unsigned before, unsigned) {
                                if (f != 0) selected_slots[before] = s;
                              })
                              .x;
  for (int i = static_cast<int>(listed) + tid; i < k; i += kThreads) selected_slots[i] = -1;
  return misses;
}

}  // namespace shadowkv::cuda::selection
