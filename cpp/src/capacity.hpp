// What a configuration costs in bytes, and the checks that reject, at construction, a configuration that cannot be
// served (docs/semantics.md, "Capacity and errors"). Byte counts saturate at INT64_MAX instead of overflowing.
#pragma once

#include <cstdint>
#include <limits>

#include "shadowkv/config.hpp"

namespace shadowkv::detail {

/// A byte count that did not fit in int64: "more than can be counted".
inline constexpr std::int64_t saturated_bytes = std::numeric_limits<std::int64_t>::max();

/// a·b and a+b for non-negative counts, saturating at saturated_bytes.
[[nodiscard]] std::int64_t saturating_mul(std::int64_t a, std::int64_t b) noexcept;
[[nodiscard]] std::int64_t saturating_add(std::int64_t a, std::int64_t b) noexcept;

/// The physical memory of this host in bytes; saturated_bytes where the platform cannot tell.
[[nodiscard]] std::int64_t physical_host_bytes() noexcept;

/// The most chunks one sequence can ever hold: max_seq_len / chunk_size.
[[nodiscard]] std::int64_t max_chunks_per_sequence(const config& cfg) noexcept;

/// `cfg` as a store runs it: budget and cache_tokens clamped to max_chunks_per_sequence chunks (a selection never
/// holds more chunks than exist, and a cache that holds them all never evicts, so the clamp changes no output, only
/// the selection cache's size); cache_tokens 0 resolved to the budget. `cfg` must be valid.
[[nodiscard]] config effective_config(config cfg);

/// Host bytes a store allocates whatever its sequences hold (estimates of the bookkeeping, exact for the buffers).
struct fixed_costs {
  std::int64_t slot_tables = 0;   ///< at construction: max_batch slot records (store and backend)
  std::int64_t per_sequence = 0;  ///< at add_sequences, per sequence: num_layers layer records
  std::int64_t per_prefill = 0;   ///< at each prefill, per (sequence, layer): selection cache, basis B, Gram matrix
};
[[nodiscard]] fixed_costs fixed_costs_of(const config& cfg) noexcept;

/// Host bytes of one (sequence, layer) holding `tokens` tokens, all of them counted at their most expensive
/// (compressed context and exact copies), plus the prefill's working copies: an upper bound, saturating.
[[nodiscard]] std::int64_t layer_bytes_upper_bound(const config& cfg, std::int64_t tokens) noexcept;

/// Rejects a valid (validate()d) configuration that cannot be served:
///  * invalid_argument: chunk_size > max_seq_len (no chunk could ever form); num_kv_heads*head_dim beyond the 32-bit
///    LAPACK interface; byte counts of one sequence's layer at max_seq_len tokens that overflow int64;
///  * out_of_memory: fixed costs (slot tables, a sequence's layer records, one prefill's fixed buffers) larger than
///    `host_bytes` (the host's physical memory) — the message names the bytes.
void check_capacity(const config& cfg, std::int64_t host_bytes);

}  // namespace shadowkv::detail
