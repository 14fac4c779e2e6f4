// The CPU backend: the reference implementation of the backend seam (docs/semantics.md), plain loops with
// float64 accumulation, BLAS/LAPACK for the dense algebra. Every other backend is checked against it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "host_array.hpp"
#include "value_store_array.hpp"
#include "shadowkv/backend.hpp"
#include "shadowkv/rope.hpp"

namespace shadowkv::detail {

/// The prompt's compressed state of one (sequence, layer): written by the prefill and never changed afterwards (folds
/// append to the sequence's own arrays; truncate never reaches into the prompt), so the sequences a fork makes share it
/// by reference (docs/semantics.md, "Fork, park and save"). Chunk ids [0, chunks) are the prompt's context chunks.
struct cpu_prompt_state {
  std::int64_t chunks = 0;  ///< n: the prompt's context chunks
  // Low-rank keys: B = V_rᵀ [r, Hkv*D] and the prompt's rows of A [n*C, r] in the factor dtype
  // (config::factor_dtype()), with the tokens' positions.
  host_array basis;
  host_array coefficients;
  std::vector<std::int64_t> context_positions;
  host_array landmarks;  ///< [n, Hkv, D] (chunk_score = landmark; empty otherwise)
  // chunk_score = two_centroids (shadowkv/chunk_centroids.hpp), in place of the landmarks:
  std::vector<std::uint8_t> centroid_codes;  ///< [n, Hkv, 2, D] e4m3
  std::vector<float> centroid_scales;        ///< [n, Hkv, 2]
  std::vector<std::uint8_t> first_counts;    ///< [n, Hkv]: keys in each chunk's first cluster
  value_store_array value_store;             ///< [n, Hkv, C, D]: one (chunk, head) is one contiguous run
  // Outliers are chosen among the prompt's chunks only (a folded chunk never is one).
  std::vector<std::vector<std::int64_t>> outliers;    ///< [Hkv] ascending chunk ids
  std::vector<std::vector<std::uint8_t>> is_outlier;  ///< [Hkv][n]
  host_array outlier_keys;    ///< [Hkv, outliers*C, D] post-RoPE
  host_array outlier_values;  ///< [Hkv, outliers*C, D]

  /// Bytes of each kind of the memory report it holds.
  [[nodiscard]] std::int64_t factor_bytes() const noexcept { return basis.bytes() + coefficients.bytes(); }
  [[nodiscard]] std::int64_t landmark_bytes() const noexcept {
    return landmarks.bytes() + static_cast<std::int64_t>(centroid_codes.size()) +
           static_cast<std::int64_t>(centroid_scales.size() * sizeof(float)) +
           static_cast<std::int64_t>(first_counts.size());
  }
  [[nodiscard]] std::int64_t outlier_bytes() const noexcept { return outlier_keys.bytes() + outlier_values.bytes(); }
  [[nodiscard]] std::int64_t bytes() const noexcept {
    return factor_bytes() + landmark_bytes() + outlier_bytes() + value_store.bytes();
  }
};

/// Everything stored for one (sequence, layer): the prompt's compressed state, shared (`prompt`), and what was
/// appended after the prefill, the sequence's own. Context chunk c < prompt->chunks is the prompt's chunk c; a later c
/// is folded chunk c - prompt->chunks of the own arrays. Chunk-indexed reads go through the accessors below.
struct cpu_layer_data {
  std::shared_ptr<const cpu_prompt_state> prompt;  ///< null until the layer is prefilled
  // The folded chunks (context chunks n, n+1, ...), laid out as the prompt's arrays: rows of A [folded tokens, r] and
  // their positions, landmarks or centroids, value runs.
  host_array coefficients;
  std::vector<std::int64_t> context_positions;
  host_array landmarks;
  std::vector<std::uint8_t> centroid_codes;
  std::vector<float> centroid_scales;
  std::vector<std::uint8_t> first_counts;
  value_store_array value_store;
  // Exact tokens: the prompt's local window, then the generated tokens not folded yet.
  host_array exact_keys;    ///< [tokens, Hkv, D] post-RoPE
  host_array exact_values;  ///< [tokens, Hkv, D]
  std::vector<std::int64_t> exact_positions;
  std::int64_t last_position = -1;
  std::int64_t prompt_last_position = -1;  ///< where last_position returns to when truncate removes every token
  // The fold journal: the exact rows of the newest config::journal_chunks() folded generated chunks (of every fold
  // of an extend call while it runs), oldest first, so that truncate can undo folds.
  host_array journal_keys;    ///< [folded generated tokens, Hkv, D] post-RoPE
  host_array journal_values;  ///< [folded generated tokens, Hkv, D]
  std::vector<std::int64_t> journal_positions;
  // Selection cache: K = config::cache_slots() buffer slots per KV head (K = k: exactly the last selection).
  std::vector<std::int64_t> cache_chunks;    ///< [Hkv, K]; -1 = empty
  std::vector<std::uint8_t> pending_rebuild;  ///< [Hkv, K]: missed this step, keys to rebuild
  std::vector<std::uint8_t> pending_fetch;    ///< [Hkv, K]: missed this step, values to fetch
  host_array cache_keys;    ///< [Hkv, K, C, D]
  host_array cache_values;  ///< [Hkv, K, C, D]
  // Only when K > k (lru_selection_cache.hpp); empty otherwise, where every occupied slot is selected.
  std::vector<std::int64_t> cache_last_used;  ///< [Hkv, K]: the selection step that last selected the slot's chunk
  std::vector<std::uint8_t> cache_selected;   ///< [Hkv, K]: the slot's chunk is in the last selection
  std::int64_t selection_steps = 0;           ///< selections of this (sequence, layer) so far (the LRU clock)

  [[nodiscard]] bool prefilled() const noexcept { return prompt != nullptr; }
  [[nodiscard]] std::int64_t prompt_chunks() const noexcept { return prompt->chunks; }
  /// Whether context chunk c is one of head h's outliers (only prompt chunks can be).
  [[nodiscard]] bool is_outlier(std::int64_t h, std::int64_t c) const noexcept {
    return c < prompt->chunks && prompt->is_outlier[static_cast<std::size_t>(h)][static_cast<std::size_t>(c)] != 0;
  }
  /// Chunk c's landmark of head h as float (host_array::floats: `room` holds D floats).
  [[nodiscard]] const float* landmark(std::int64_t c, std::int64_t h, std::int64_t heads, std::int64_t dim,
                                      float* room) const noexcept {
    const std::int64_t n = prompt->chunks;
    return c < n ? prompt->landmarks.floats((c * heads + h) * dim, dim, room)
                 : landmarks.floats(((c - n) * heads + h) * dim, dim, room);
  }
  /// Centroid m of (chunk c, head h): its e4m3 codes [D] and its scale.
  [[nodiscard]] const std::uint8_t* centroid_codes_of(std::int64_t c, std::int64_t h, std::int64_t m,
                                                      std::int64_t heads, std::int64_t dim) const noexcept {
    const std::int64_t n = prompt->chunks;
    return c < n ? prompt->centroid_codes.data() + ((c * heads + h) * 2 + m) * dim
                 : centroid_codes.data() + (((c - n) * heads + h) * 2 + m) * dim;
  }
  [[nodiscard]] float centroid_scale_of(std::int64_t c, std::int64_t h, std::int64_t m,
                                        std::int64_t heads) const noexcept {
    const std::int64_t n = prompt->chunks;
    return c < n ? prompt->centroid_scales[static_cast<std::size_t>((c * heads + h) * 2 + m)]
                 : centroid_scales[static_cast<std::size_t>(((c - n) * heads + h) * 2 + m)];
  }
  [[nodiscard]] std::int64_t first_count_of(std::int64_t c, std::int64_t h, std::int64_t heads) const noexcept {
    const std::int64_t n = prompt->chunks;
    return c < n ? prompt->first_counts[static_cast<std::size_t>(c * heads + h)]
                 : first_counts[static_cast<std::size_t>((c - n) * heads + h)];
  }
  /// Writes the values of (chunk c, head h) into `target` at element `offset` (value_store_array::read_run).
  void read_value_run(std::int64_t c, std::int64_t h, std::int64_t heads, host_array& target,
                      std::int64_t offset) const noexcept {
    const std::int64_t n = prompt->chunks;
    if (c < n) {
      prompt->value_store.read_run(c * heads + h, target, offset);
    } else {
      value_store.read_run((c - n) * heads + h, target, offset);
    }
  }
  /// Chunk c's rows of A [C, r] as float (host_array::floats: `room` holds C*r floats).
  [[nodiscard]] const float* coefficient_rows(std::int64_t c, std::int64_t chunk, std::int64_t rank,
                                              float* room) const noexcept {
    const std::int64_t n = prompt->chunks;
    return c < n ? prompt->coefficients.floats(c * chunk * rank, chunk * rank, room)
                 : coefficients.floats((c - n) * chunk * rank, chunk * rank, room);
  }
  /// Position of token i of context chunk c.
  [[nodiscard]] std::int64_t context_position(std::int64_t c, std::int64_t i, std::int64_t chunk) const noexcept {
    const std::int64_t n = prompt->chunks;
    return c < n ? prompt->context_positions[static_cast<std::size_t>(c * chunk + i)]
                 : context_positions[static_cast<std::size_t>((c - n) * chunk + i)];
  }

  /// Whether attention reads slot `index` ([Hkv, K] flat): it holds a chunk of the last selection.
  [[nodiscard]] bool slot_selected(std::size_t index) const noexcept {
    return cache_chunks[index] >= 0 && (cache_selected.empty() || cache_selected[index] != 0);
  }
};

/// One token of the attention's union: the array pair holding it and the element offset of its key/value row.
struct attention_source {
  const host_array* keys = nullptr;
  const host_array* values = nullptr;
  std::int64_t offset = 0;
};

/// Work buffers of append_token, select_chunks, rebuild_keys and attend. reserve_decode / reserve_selection size them
/// before a call's first write, so that those operations allocate nothing once the call has started changing data:
/// running out of memory then leaves the store as it was (docs/semantics.md, "Capacity and errors").
struct cpu_workspace {
  std::vector<float> token_key;                       ///< [Hkv*D] append_token
  std::vector<float> token_value;                     ///< [Hkv*D]
  std::vector<std::int64_t> candidates;               ///< [context chunks] select_chunks
  std::vector<double> score;                          ///< [context chunks]
  std::vector<double> logits;                         ///< [G, context chunks]
  std::vector<double> probability;                    ///< [G, context chunks]
  std::vector<double> pair_logits;                    ///< [G, 2 * context chunks] (chunk_score = two_centroids)
  std::vector<std::int64_t> order;                    ///< [context chunks]
  std::vector<std::int64_t> selected;                 ///< [k]
  std::vector<std::uint8_t> cached;                   ///< [k]: selected chunk i is a hit
  std::vector<double> queries;                        ///< [D, G] one KV head's query heads, interleaved (row_dots.hpp)
  std::vector<float> rows;                            ///< [dot_block_rows, D] rows converted to float (row_dots.hpp)
  std::vector<float> gathered;                        ///< [C, r] rebuild_keys: one chunk's rows of A as float
  std::vector<float> basis;                           ///< [r, Hkv*D] B as float
  std::vector<float> rebuilt;                         ///< [C, D] one chunk's rebuilt keys
  std::vector<attention_source> union_rows;           ///< [outlier + exact + selected tokens] attend
  std::vector<double> weights;                        ///< [G, union rows]
  std::vector<double> accumulator;                    ///< [G, D]
  std::vector<double> total;                          ///< [G] each head's softmax denominator
  std::vector<std::int64_t> attended_slots;           ///< [K] attend: one head's selected slots by chunk id
};

// Not final: tests derive from it (e.g. a CPU backend that claims graph replay, to test the store's accounting).
class cpu_backend : public backend {
 public:
  explicit cpu_backend(const config& cfg);

  [[nodiscard]] device where() const noexcept override { return {device_type::cpu, 0}; }
  void open_sequence(int slot, value_place values_on) override;
  [[nodiscard]] std::int64_t value_bytes_per_sequence() const override;
  /// The CPU's memory is its device: "auto" places every sequence there unless the config sets a budget.
  [[nodiscard]] std::int64_t default_device_value_budget() const override;
  void close_sequence(int slot) noexcept override;
  void prefill(int layer, std::span<const batch_entry> entries, const prefill_inputs& inputs) override;
  void fold_oldest_generated_chunk(int layer, std::span<const batch_entry> entries) override;
  void append_token(int layer, std::span<const batch_entry> entries, const append_inputs& inputs) override;
  void select_chunks(int layer, std::span<const batch_entry> entries, const tensor_view& queries) override;
  void fetch_values(int layer, std::span<const batch_entry> entries) override;
  void rebuild_keys(int layer, std::span<const batch_entry> entries) override;
  void attend(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
              const mutable_tensor_view& out) override;
  [[nodiscard]] bool supports_extend() const override { return true; }
  void reserve_extend(int layer, std::span<const batch_entry> entries, std::span<const std::int64_t> tokens) override;
  void extend_block(int layer, std::span<const batch_entry> entries, const block_inputs& inputs,
                    const mutable_tensor_view& out) override;
  void end_extend(int layer, std::span<const batch_entry> entries) override;
  [[nodiscard]] bool supports_truncate() const override { return true; }
  void truncate_generated(int layer, std::span<const batch_entry> entries,
                          std::span<const layer_state> targets) override;
  void reserve_truncate(int layer, std::span<const batch_entry> entries,
                        std::span<const layer_state> targets) override;
  /// The children's layers are copies of the source's: the prompt states by reference (shared_ptr), the rest by value.
  void fork_sequence(int source, std::span<const int> children, std::span<const layer_state> layers) override;
  [[nodiscard]] std::int64_t forked_value_bytes(std::span<const layer_state> layers) const override;
  // Park and save (cpu_keeping.cpp): a parked sequence's layers move out of the slot whole; a saved one is written
  // and read array by array (each its valid part, as the counters give it).
  [[nodiscard]] bool supports_keeping() const override { return true; }
  [[nodiscard]] std::unique_ptr<parked_state> park_sequence(int slot, std::span<const layer_state> layers) override;
  void unpark_sequence(int slot, parked_state& parked) noexcept override;
  void resume_sequence(int slot, parked_state& parked, std::span<const layer_state> layers) override;
  void unresume_sequence(int slot, parked_state& parked) noexcept override;
  [[nodiscard]] const char* state_layout() const override { return "cpu"; }
  [[nodiscard]] std::vector<state_section> state_sections(std::span<const layer_state> layers) const override;
  void write_state(int slot, std::span<const layer_state> layers, const state_sink& sink) const override;
  void read_state(int slot, value_place values_on, std::span<const layer_state> layers,
                  std::span<const std::span<const std::byte>> sections) override;
  [[nodiscard]] chunk_ids_per_head selected_chunks(int layer, int slot) const override;
  [[nodiscard]] chunk_ids_per_head outlier_chunks(int layer, int slot) const override;
  [[nodiscard]] std::int64_t last_position(int layer, int slot) const override;
  [[nodiscard]] memory_report memory(std::span<const stored_layer> layers) const override;
  [[nodiscard]] store_stats selection_stats() const override { return stats_; }
  void reset_selection_stats() noexcept override { stats_ = {}; }
  [[nodiscard]] bool all_finite(const tensor_view& view) override;
  void reserve_decode(int layer, std::span<const batch_entry> entries) override;
  void reserve_selection(int layer, std::span<const batch_entry> entries) override;

 private:
  [[nodiscard]] cpu_layer_data& data(int slot, int layer);
  [[nodiscard]] const cpu_layer_data& data(int slot, int layer) const;
  [[nodiscard]] cpu_layer_data prefill_one(const batch_entry& entry, const prefill_inputs& inputs) const;
  /// Grows the workspace for selections over up to `chunks` context chunks and attention over `union_rows` tokens.
  void reserve_workspace(std::int64_t chunks, std::int64_t union_rows);
  /// extend_block's steps, on states it advances as it goes (`states`: the entries' copies).
  void run_block(int layer, std::span<const batch_entry> entries, std::span<layer_state> states,
                 const block_inputs& inputs, const mutable_tensor_view& out);
  /// Causal attention of a block of queries [B, s, Hq, D] whose tokens are the entries' last s exact rows.
  void attend_block(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                    const mutable_tensor_view& out);
  /// Drops the fold journal's rows beyond its newest journal_chunks() chunks.
  void trim_journal(cpu_layer_data& d) const noexcept;
  /// Attention of one query token per entry, queries and out [B, Hq, D], over the union with the entry's first
  /// `exact_rows_hidden` exact rows from the end left out (the later tokens of an extend block).
  void attend_token(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                    const mutable_tensor_view& out, std::int64_t exact_rows_hidden);

  config config_;
  rope_rotation rope_;
  std::vector<std::vector<cpu_layer_data>> layers_;  ///< [slot][layer]; empty for free slots
  std::vector<value_place> values_on_;               ///< [slot]: where the slot's values are (a label on the CPU)
  store_stats stats_;
  cpu_workspace workspace_;
  bool keep_full_journal_ = false;  ///< inside an extend call: folds keep their journal rows until end_extend
};

}  // namespace shadowkv::detail
