#include "capacity.hpp"

#include <algorithm>
#include <climits>

#include "shadowkv/backend.hpp"
#include "shadowkv/errors.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace shadowkv::detail {
namespace {

// Bookkeeping per slot (the store's record and a backend's table entry: 56 bytes on LP64 today) and per
// (sequence, layer) (the store's layer_state and a backend's record of that layer's arrays), rounded up.
constexpr std::int64_t slot_record_bytes = 64;
constexpr std::int64_t layer_record_bytes = 1024;

std::int64_t storage_bytes(const config& cfg) noexcept { return static_cast<std::int64_t>(dtype_size(cfg.kv_dtype)); }

}  // namespace

std::int64_t saturating_mul(std::int64_t a, std::int64_t b) noexcept {
  if (a == 0 || b == 0) return 0;
  if (a > saturated_bytes / b) return saturated_bytes;
  return a * b;
}

std::int64_t saturating_add(std::int64_t a, std::int64_t b) noexcept {
  return a > saturated_bytes - b ? saturated_bytes : a + b;
}

std::int64_t physical_host_bytes() noexcept {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) return saturating_mul(pages, page_size);
#endif
  return saturated_bytes;
}

std::int64_t max_chunks_per_sequence(const config& cfg) noexcept { return cfg.max_seq_len / cfg.chunk_size; }

config effective_config(config cfg) {
  cfg.rank = cfg.effective_rank();  // 0: the default rank, min(160, Hkv*D)
  const std::int64_t most = std::max<std::int64_t>(1, max_chunks_per_sequence(cfg));
  if (cfg.budget_chunks() > most) cfg.budget = most * cfg.chunk_size;
  // The cache holds at most every chunk a sequence can have; an LRU cache that never needs to evict behaves alike
  // at any larger size, so the clamp changes no hit. 0 (the default) becomes the budget, the size used.
  if (cfg.cache_tokens == 0) cfg.cache_tokens = cfg.budget;
  if (cfg.cache_slots() > most) cfg.cache_tokens = most * cfg.chunk_size;
  return cfg;
}

fixed_costs fixed_costs_of(const config& cfg) noexcept {
  const std::int64_t width = cfg.kv_width();
  const std::int64_t e = storage_bytes(cfg);
  fixed_costs costs;
  costs.slot_tables = saturating_mul(cfg.max_batch, slot_record_bytes);
  costs.per_sequence = saturating_mul(cfg.num_layers, layer_record_bytes);
  // Selection cache (keys and values of K chunks per KV head, plus per-slot chunk ids and flags, and with K > k the
  // slots' last-used steps and selected flags), B, and the Gram matrix (float32 product and its float64 copy).
  const std::int64_t most_chunks = std::max<std::int64_t>(1, max_chunks_per_sequence(cfg));
  const std::int64_t k = std::min<std::int64_t>(cfg.budget_chunks(), most_chunks);
  const std::int64_t slots = std::max(k, std::min<std::int64_t>(cfg.cache_slots(), most_chunks));
  const std::int64_t cache_rows = saturating_mul(slots, cfg.chunk_size);
  std::int64_t prefill = saturating_mul(saturating_mul(cache_rows, width), 2 * e);
  prefill = saturating_add(prefill, saturating_mul(saturating_mul(slots, cfg.num_kv_heads), 8 + 2));
  if (slots > k) prefill = saturating_add(prefill, saturating_mul(saturating_mul(slots, cfg.num_kv_heads), 8 + 1));
  prefill = saturating_add(prefill, saturating_mul(saturating_mul(cfg.rank, width), 4));
  prefill = saturating_add(prefill, saturating_mul(saturating_mul(width, width), 4 + 8));
  costs.per_prefill = prefill;
  return costs;
}

std::int64_t layer_bytes_upper_bound(const config& cfg, std::int64_t tokens) noexcept {
  const std::int64_t width = cfg.kv_width();
  const std::int64_t e = storage_bytes(cfg);
  const std::int64_t token_elements = saturating_mul(tokens, width);
  std::int64_t bytes = fixed_costs_of(cfg).per_prefill;
  bytes = saturating_add(bytes, saturating_mul(saturating_mul(tokens, cfg.rank), 4));  // A
  bytes = saturating_add(bytes, saturating_mul(token_elements, 4 * e));  // values, landmarks, exact keys and values
  if (cfg.chunk_score == chunk_score_rule::two_centroids) {  // scales and counts beyond the codes (2 bytes a dim)
    bytes = saturating_add(bytes, saturating_mul(saturating_mul(tokens, cfg.num_kv_heads), 2 * 4 + 1));
  }
  bytes = saturating_add(bytes, saturating_mul(token_elements, 2 * 4));  // prefill's float32 pre/post-RoPE keys
  return bytes;
}

void check_capacity(const config& cfg, std::int64_t host_bytes) {
  SHADOWKV_EXPECTS(cfg.chunk_size <= cfg.max_seq_len, "chunk_size = ", cfg.chunk_size, " exceeds max_seq_len = ",
                   cfg.max_seq_len, ": no sequence could ever fill one chunk");
  SHADOWKV_EXPECTS(cfg.kv_width() <= INT_MAX, "num_kv_heads*head_dim = ", cfg.kv_width(),
                   " exceeds the 32-bit LAPACK interface (", INT_MAX, ")");
  const std::int64_t full = layer_bytes_upper_bound(cfg, cfg.max_seq_len);
  SHADOWKV_EXPECTS(full < saturated_bytes, "max_seq_len = ", cfg.max_seq_len, " with num_kv_heads*head_dim = ",
                   cfg.kv_width(), " and rank = ", cfg.rank,
                   ": one sequence's layer at full capacity would hold more than ", saturated_bytes,
                   " bytes (int64 overflow); lower max_seq_len");

  const fixed_costs costs = fixed_costs_of(cfg);
  auto expect_fits = [&](std::int64_t bytes, const auto&... what) {
    if (bytes > host_bytes) {
      throw out_of_memory(format_message(what..., " (", bytes >= saturated_bytes ? "more than " : "", bytes,
                                         " bytes), more than this host's physical memory (", host_bytes,
                                         " bytes)"));
    }
  };
  expect_fits(costs.slot_tables, "max_batch = ", cfg.max_batch, " slots need ", slot_record_bytes,
              " bytes of slot records each");
  expect_fits(costs.per_sequence, "num_layers = ", cfg.num_layers, ": every sequence needs ", layer_record_bytes,
              " bytes of records per layer");
  expect_fits(costs.per_prefill, "every prefilled (sequence, layer) holds a selection cache of ",
              cfg.cache_slots(), " chunks (cache_tokens = ", cfg.cache_tokens, ", budget = ", cfg.budget,
              " tokens) x ", cfg.chunk_size, " tokens x num_kv_heads*head_dim = ", cfg.kv_width(),
              " x keys and values, the basis and the Gram matrix of the factorisation");
}

}  // namespace shadowkv::detail
