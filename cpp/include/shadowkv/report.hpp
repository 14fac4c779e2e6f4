// What a store reports about itself: memory by kind, selection statistics, per-sequence state.
#pragma once

#include <cstdint>
#include <vector>

#include "shadowkv/config.hpp"

namespace shadowkv {

/// Bytes held by the store, by kind, summed over live sequences and prefilled layers (docs/semantics.md).
struct memory_report {
  std::int64_t low_rank_factors = 0;  ///< A (context tokens x r) and B (r x Hkv*D), float32
  std::int64_t landmarks = 0;         ///< one key-sized vector per context chunk and KV head
  std::int64_t outliers = 0;          ///< exact keys and values of outlier chunks
  std::int64_t exact_tokens = 0;      ///< exact keys and values of the local window and generated tokens
  std::int64_t value_store = 0;       ///< values of all context chunks (offloaded on GPUs): the two below summed
  std::int64_t value_store_device = 0;  ///< value_store of sequences whose values are in device memory
  std::int64_t value_store_host = 0;    ///< value_store of sequences whose values are in host memory
  std::int64_t selection_cache = 0;   ///< rebuilt keys and fetched values of the selected chunks
  std::int64_t fold_journal = 0;      ///< exact keys and values of folded generated chunks (what truncate restores)
  std::int64_t full_attention_equivalent = 0;  ///< a plain KV cache of the same tokens in the same dtype
  std::int64_t device_reserved = 0;  ///< device memory reserved: arenas for the configured capacity, and the value
                                     ///< stores of live sequences placed on the device (CUDA)
  std::int64_t host_reserved = 0;    ///< pinned host memory reserved for the value stores of live sequences (CUDA)
  /// Bytes that several live sequences share by reference (the prompt state of a fork's family): counted once in their
  /// kinds above (and in total()) and reported here too. 0 when no sequence shares anything.
  std::int64_t shared = 0;

  [[nodiscard]] std::int64_t total() const noexcept {
    return low_rank_factors + landmarks + outliers + exact_tokens + value_store + selection_cache + fold_journal;
  }
};

/// Counters since construction or the last reset_stats(); hits and misses count (sequence, KV head, chunk).
struct store_stats {
  std::int64_t decode_steps = 0;    ///< decode calls (one per layer per step) that succeeded
  std::int64_t selections = 0;      ///< (sequence, layer) selections, decode and prefill warm-up
  std::int64_t hits = 0;            ///< selected chunks found in the selection cache
  std::int64_t misses = 0;          ///< selected chunks rebuilt and fetched
  std::int64_t chunks_rebuilt = 0;  ///< (chunk, KV head) key rebuilds
  std::int64_t bytes_fetched = 0;   ///< value bytes read from the value store
  std::int64_t folds = 0;           ///< generated chunks folded into the compressed store

  [[nodiscard]] double hit_rate() const noexcept {
    const std::int64_t total = hits + misses;
    return total == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(total);
  }
};

/// The state of one sequence in one layer.
struct sequence_info {
  bool prefilled = false;
  std::int64_t prompt_len = 0;
  std::int64_t total_len = 0;            ///< prompt + generated tokens
  std::int64_t context_chunks = 0;       ///< prompt context chunks + folded chunks
  std::int64_t outlier_chunks = 0;       ///< per KV head
  std::int64_t local_len = 0;            ///< exact tokens of the prompt's local window
  std::int64_t generated_exact_len = 0;  ///< exact generated tokens not yet folded
  std::int64_t last_position = -1;
  value_place values_on = value_place::host;  ///< where the sequence's value store is
  std::vector<int> shares_prompt_with;  ///< the other live slots sharing this sequence's prompt state (fork), ascending
};

}  // namespace shadowkv
