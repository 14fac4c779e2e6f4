// The slot rule of a selection cache larger than the budget (cache_tokens > budget; docs/semantics.md, Decode 6):
// K slots per (sequence, layer, KV head) keep their chunk until evicted, least recently selected first. Written once
// here so that the CPU backend and the tests of the rule read the same code; the CUDA select kernel must implement
// the same assignment (slot indices included: attention reads the selected slots in index order).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

namespace shadowkv::detail {

/// One (sequence, layer, KV head)'s cache of K slots. All spans have K entries.
struct lru_cache_slots {
  std::span<std::int64_t> chunk;        ///< chunk id held by the slot; -1: empty
  std::span<std::int64_t> last_used;    ///< the selection step that last selected the slot's chunk
  std::span<std::uint8_t> selected;     ///< out: the slot's chunk is selected at this step
  std::span<std::uint8_t> to_rebuild;   ///< out: filled at this step (a miss): its keys are to be rebuilt
  std::span<std::uint8_t> to_fetch;     ///< out: filled at this step (a miss): its values are to be fetched
};

/// Places this step's selection (`chosen`, ascending chunk ids, at most K of them) into the slots and returns the
/// number of hits (chosen chunks already held by a slot). `now` is the step's number (larger than every stamp);
/// `is_hit` is workspace of chosen.size() entries. The rule:
///  1. hits: every slot whose chunk is chosen is selected and stamped `now`;
///  2. misses, in ascending chunk id: each takes the lowest-index empty slot, else, among the slots not selected at
///     this step, the one whose last_used is oldest (ties: the lowest index); it is selected, stamped `now`, and
///     marked to be rebuilt and fetched.
/// Every other slot keeps its chunk (unselected: attention does not read it).
inline std::int64_t assign_lru_slots(std::span<const std::int64_t> chosen, std::int64_t now,
                                     const lru_cache_slots& slots, std::span<std::uint8_t> is_hit) noexcept {
  const auto capacity = static_cast<std::int64_t>(slots.chunk.size());
  std::int64_t hits = 0;
  std::fill(is_hit.begin(), is_hit.end(), std::uint8_t{0});
  for (std::int64_t s = 0; s < capacity; ++s) {
    slots.selected[s] = 0;
    slots.to_rebuild[s] = 0;
    slots.to_fetch[s] = 0;
    if (slots.chunk[s] < 0) continue;
    const auto found = std::lower_bound(chosen.begin(), chosen.end(), slots.chunk[s]);
    if (found == chosen.end() || *found != slots.chunk[s]) continue;
    is_hit[static_cast<std::size_t>(found - chosen.begin())] = 1;
    slots.selected[s] = 1;
    slots.last_used[s] = now;
    ++hits;
  }
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    if (is_hit[i] != 0) continue;
    std::int64_t victim = -1;
    for (std::int64_t s = 0; s < capacity && victim < 0; ++s) {
      if (slots.chunk[s] < 0) victim = s;
    }
    if (victim < 0) {
      for (std::int64_t s = 0; s < capacity; ++s) {
        if (slots.selected[s] != 0) continue;
        if (victim < 0 || slots.last_used[s] < slots.last_used[victim]) victim = s;
      }
    }
    // chosen.size() <= K and every selected slot holds a distinct chosen chunk: an unselected slot always remains.
    slots.chunk[victim] = chosen[i];
    slots.selected[victim] = 1;
    slots.last_used[victim] = now;
    slots.to_rebuild[victim] = 1;
    slots.to_fetch[victim] = 1;
  }
  return hits;
}

}  // namespace shadowkv::detail
