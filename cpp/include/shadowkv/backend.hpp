// The backend seam: the operations the store's algorithm needs from a device (README.md).
//
// The store (store.cpp) owns slots, validation, per-(sequence, layer) counters and the order of operations; a
// backend owns the bulk data and does the arithmetic. The CPU backend is the readable reference; the CUDA backend
// implements the same interface. Every method is called only with arguments the store has validated, and a
// backend must leave its data unchanged when it throws (allocation happens before any write).
#pragma once

#include <cstdint>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shadowkv/config.hpp"
#include "shadowkv/report.hpp"
#include "shadowkv/stream_view.hpp"
#include "shadowkv/tensor_view.hpp"

namespace shadowkv {

/// Host-side counters of one (sequence, layer), kept by the store and read by backends.
struct layer_state {
  bool prefilled = false;
  std::int64_t prompt_len = 0;
  std::int64_t prompt_context_chunks = 0;  ///< n = max(0, floor(S/C) - local_chunks)
  std::int64_t context_chunks = 0;         ///< n + folded chunks
  std::int64_t outlier_chunks = 0;         ///< min(outlier_chunks, n), per KV head
  std::int64_t local_len = 0;              ///< S - n*C
  std::int64_t generated_total = 0;        ///< generated tokens so far
  std::int64_t generated_exact_len = 0;    ///< generated tokens not folded
  std::int64_t journal_chunks = 0;         ///< folded chunks the fold journal holds (<= config::journal_chunks())
  value_place values_on = value_place::host;  ///< where the sequence's value store is (same for all layers)

  [[nodiscard]] std::int64_t total_len() const noexcept { return prompt_len + generated_total; }
  [[nodiscard]] std::int64_t context_tokens(int chunk_size) const noexcept { return context_chunks * chunk_size; }
};

/// One sequence of a batched call: its slot, its row in the call's tensors, and its counters.
struct batch_entry {
  int slot = 0;
  std::int64_t row = 0;
  const layer_state* state = nullptr;
};

/// One prefilled (sequence, layer) of a memory report: its slot, its layer and its counters.
struct stored_layer {
  int slot = 0;
  int layer = 0;
  const layer_state* state = nullptr;
};

/// Inputs of a prefill call. Tensors are [B, S, Hkv, D]; positions [B, S] (may be empty: 0..S-1);
/// q_last [B, Tq, Hq, D] (may be empty).
struct prefill_inputs {
  tensor_view keys;
  tensor_view values;
  tensor_view positions;
  tensor_view q_last;
  bool keys_post_rope = false;
};

/// Inputs of appending one token per sequence. Tensors are [B, Hkv, D]; positions [B] (may be empty:
/// each sequence's last position + 1).
struct append_inputs {
  tensor_view keys;
  tensor_view values;
  tensor_view positions;
  bool keys_post_rope = true;
};

/// Inputs of one block of an extend: queries [B, s, Hq, D] post-RoPE, keys and values [B, s, Hkv, D], positions
/// [B, s] (may be empty: each sequence's last position + 1, + 2, ...).
struct block_inputs {
  tensor_view queries;
  tensor_view keys;
  tensor_view values;
  tensor_view positions;
  bool keys_post_rope = true;
};

/// A sequence's state outside the backend's slots: made by backend::park_sequence, taken back by resume_sequence.
/// Holds host memory (and references to shared state) until it is resumed or destroyed.
class parked_state {
 public:
  parked_state() = default;
  parked_state(const parked_state&) = delete;
  parked_state& operator=(const parked_state&) = delete;
  parked_state(parked_state&&) = delete;
  parked_state& operator=(parked_state&&) = delete;
  virtual ~parked_state() = default;
  /// Host bytes this object holds of its own: what destroying it frees. State it shares by reference with other
  /// sequences (a fork's family, live or parked) counts only while no other holds it.
  [[nodiscard]] virtual std::int64_t host_bytes() const noexcept = 0;
};

/// One section of a saved sequence: its name (unique within a file) and its size in bytes.
struct state_section {
  std::string name;
  std::int64_t bytes = 0;
};

/// Where backend::write_state puts a section's bytes: (section index, bytes), called in section order.
using state_sink = std::function<void(std::size_t, std::span<const std::byte>)>;

/// Chunk ids per KV head (ascending), as returned for inspection.
using chunk_ids_per_head = std::vector<std::vector<std::int64_t>>;

class backend {
 public:
  backend() = default;
  backend(const backend&) = delete;
  backend& operator=(const backend&) = delete;
  backend(backend&&) = delete;
  backend& operator=(backend&&) = delete;
  virtual ~backend() = default;

  /// The device whose memory the backend's tensors must live on.
  [[nodiscard]] virtual device where() const noexcept = 0;

  /// Makes the following operations run on the caller's stream (a cudaStream_t as an integer); unset: the
  /// backend's own stream, and finish_call() then waits for it. Backends without streams ignore it.
  virtual void use_stream(std::optional<stream_view> stream) { (void)stream; }

  /// Prepares storage for a new sequence in `slot` (all layers empty), its value store in `values_on`. May throw
  /// out_of_memory, and then holds nothing for the slot.
  virtual void open_sequence(int slot, value_place values_on) = 0;
  /// Bytes one sequence's value store takes (all layers, at max_seq_len), wherever it is placed.
  [[nodiscard]] virtual std::int64_t value_bytes_per_sequence() const = 0;
  /// Device bytes the value stores of value_store="auto" sequences may take when the config gives no budget.
  [[nodiscard]] virtual std::int64_t default_device_value_budget() const = 0;
  /// Whether device memory free now, less the backend's margin for the caller's own work, holds `bytes` more (an
  /// "auto" sequence goes to the host otherwise, even within its budget: the caller may have taken memory since).
  [[nodiscard]] virtual bool device_has_room(std::int64_t bytes) const { (void)bytes; return true; }
  /// Frees everything of `slot`.
  virtual void close_sequence(int slot) noexcept = 0;

  /// Factorises, builds landmarks and outliers, stores values and the local window for each entry. Entry states
  /// already hold the new counters (prompt_len, context chunks, outliers, local_len). Without q_last no selection.
  virtual void prefill(int layer, std::span<const batch_entry> entries, const prefill_inputs& inputs) = 0;

  /// Folds each entry's oldest `chunk_size` exact generated tokens into the compressed store as context chunk
  /// `state->context_chunks` (states hold the counters before the fold). A backend whose counters live on the
  /// device may instead fold on the device by the same rule (ring full), before this step's selection reads the
  /// context chunks: inside append_token, or at the end of the step that filled the ring (the CUDA backend).
  virtual void fold_oldest_generated_chunk(int layer, std::span<const batch_entry> entries) = 0;

  /// Appends one token per entry to its exact generated region (states hold the counters before the append).
  virtual void append_token(int layer, std::span<const batch_entry> entries, const append_inputs& inputs) = 0;

  /// Scores landmarks with `queries` [B, Tq, Hq, D], selects the top-k chunks per KV head and updates the
  /// selection cache, recording hits and the misses to fill.
  virtual void select_chunks(int layer, std::span<const batch_entry> entries, const tensor_view& queries) = 0;
  /// Fetches the values of the misses recorded by the last select_chunks into the selection cache.
  virtual void fetch_values(int layer, std::span<const batch_entry> entries) = 0;
  /// Rebuilds the keys (A·B + RoPE) of the misses recorded by the last select_chunks into the selection cache.
  virtual void rebuild_keys(int layer, std::span<const batch_entry> entries) = 0;

  /// Exact attention of `queries` [B, Hq, D] over outliers ∪ local ∪ selected ∪ generated; writes `out` [B, Hq, D].
  virtual void attend(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
                      const mutable_tensor_view& out) = 0;

  // --- extend and truncate (docs/semantics.md, "Extend" and "Truncate") -------------------------------------------

  /// True if the backend implements extend_block, i.e. extend by more than one token per sequence.
  [[nodiscard]] virtual bool supports_extend() const { return false; }
  /// Allocates what an extend of `tokens[i]` tokens of entries[i] (states before it) needs beyond reserve_decode:
  /// room for the exact region of a block, the block's attention and every fold of the call (and the fold journal's
  /// rows of all of them, so that the store can undo the call). May throw out_of_memory, changing nothing observable.
  virtual void reserve_extend(int layer, std::span<const batch_entry> entries, std::span<const std::int64_t> tokens) {
    (void)tokens;
    reserve_decode(layer, entries);
  }
  /// One block of an extend (docs/semantics.md, "Extend", steps 1–5) for entries that all take s = inputs.queries
  /// .shape[1] tokens: the fold of a full region, the block's tokens appended, one selection with its queries, the
  /// causal attention of each of them into `out` [B, s, Hq, D], and the folds down to what s decode steps leave.
  /// States hold the counters before the block (the store advances them afterwards by the fold rule). All or nothing:
  /// when it throws, the entries' data are as before the block.
  virtual void extend_block(int layer, std::span<const batch_entry> entries, const block_inputs& inputs,
                            const mutable_tensor_view& out);
  /// The extend call whose blocks ran on these entries is over (succeeded or undone): the backend may drop what it
  /// kept to undo the call (the fold journal's rows beyond its last journal_chunks folds).
  virtual void end_extend(int layer, std::span<const batch_entry> entries) {
    (void)layer;
    (void)entries;
  }

  /// True if the backend implements truncate_generated.
  [[nodiscard]] virtual bool supports_truncate() const { return false; }
  /// Makes each entry's (layer, slot) the state `targets[i]` (fewer generated tokens, the same prompt; counters as
  /// the fold rule gives them): drops the exact tokens past the target, undoes the folds past targets[i].context_chunks
  /// (newest first, their exact rows back from the fold journal, which the store has checked holds them) and drops
  /// undone chunks from the selection cache.
  /// States hold the counters before. Does not throw after reserve_truncate with the same arguments.
  virtual void truncate_generated(int layer, std::span<const batch_entry> entries,
                                  std::span<const layer_state> targets);
  /// Allocates everything truncate_generated(layer, entries, targets) will need, so that it cannot fail once the store
  /// has called this for every layer of a truncate. May throw out_of_memory, changing nothing observable.
  virtual void reserve_truncate(int layer, std::span<const batch_entry> entries, std::span<const layer_state> targets) {
    (void)layer;
    (void)entries;
    (void)targets;
  }

  // --- fork, park and save (docs/semantics.md, "Fork, park and save") ----------------------------------------------

  /// True if the backend implements fork_sequence, park_sequence / resume_sequence and the saved-state sections.
  [[nodiscard]] virtual bool supports_keeping() const { return false; }

  /// Makes each of `children` (slots not open) a sequence equal to the open, prefilled `source` in every layer
  /// (`layers`: the source's counters, one per layer): the prompt's compressed state shared by reference where the
  /// backend can, the rest copied; each child's value store is where the source's is. All or nothing: may throw
  /// out_of_memory, and then no child is open. Shared state lives while any sequence holding it is open: closing any
  /// of them (the source included) leaves the others valid.
  virtual void fork_sequence(int source, std::span<const int> children, std::span<const layer_state> layers);
  /// Bytes the value store of one child that fork_sequence makes of a source with counters `layers` takes in its
  /// place, counted as value_bytes_per_sequence() is (all layers, at max_seq_len): what the store charges against
  /// device_value_budget for a child whose values are on the device. The default, a whole value store; a backend that
  /// shares the prompt's value runs returns value_bytes_per_sequence() less those runs (the CPU backend). The shared
  /// runs stay charged to one live sequence of the family (kv_store::fork, kv_store::release).
  [[nodiscard]] virtual std::int64_t forked_value_bytes(std::span<const layer_state> layers) const {
    (void)layers;
    return value_bytes_per_sequence();
  }

  /// Moves (or copies) the whole state of the open, prefilled `slot` (counters `layers`) out of the slot into host
  /// memory held by the returned object; state the slot shares by reference (fork_sequence) stays shared: the object
  /// holds a reference, which keeps it alive for the family's other sequences and theirs for it. The store charges a
  /// parked sequence no device_value_budget (what it carried for its family passes to a live member, as at close), so
  /// device memory that no open slot reads should not stay held. May throw out_of_memory, changing nothing. The store
  /// then either commits the park with close_sequence(slot), or (when a later slot of the same park call failed)
  /// undoes it with unpark_sequence(slot, parked) before anything else touches the slot.
  [[nodiscard]] virtual std::unique_ptr<parked_state> park_sequence(int slot, std::span<const layer_state> layers);
  /// Undoes park_sequence(slot, ...) of a slot not closed since: the slot holds the state it held before, and
  /// `parked` is to be destroyed. Cannot fail: a backend that moved the state out moves it back (the CPU backend); one
  /// that copied it leaves the slot's own data in place until close_sequence and has nothing to do.
  virtual void unpark_sequence(int slot, parked_state& parked) noexcept;
  /// Opens `slot` (not open) with the state `parked` holds (made by this backend's park_sequence with these counters),
  /// sharing by reference again what it shared when parked. The store charges its value store, when on the device, as
  /// a fork's child (forked_value_bytes) while a slot of its family is open on the device, else a whole one. May throw
  /// out_of_memory (e.g. no device room for a value store that was in device memory), changing nothing (`parked`
  /// keeps its state). On success the store destroys `parked` once every object of the same resume call is in (its
  /// memory is then freed), or (when a later one failed) calls unresume_sequence(slot, parked).
  virtual void resume_sequence(int slot, parked_state& parked, std::span<const layer_state> layers);
  /// Undoes resume_sequence(slot, parked, ...): `parked` holds the state again, as before that call, and `slot` is
  /// not open. Cannot fail (the CPU backend moves the state back; a backend that copied it into the slot keeps the
  /// copy's source in `parked` until it is destroyed, so it only closes the slot).
  virtual void unresume_sequence(int slot, parked_state& parked) noexcept;

  /// The layout name written into saved files ("cpu", "cuda"): a file loads only into a backend of the same layout.
  [[nodiscard]] virtual const char* state_layout() const { return "none"; }
  /// The sections of one sequence's saved state, in file order, with their sizes: from the configuration and the
  /// counters `layers` alone (load checks a file's table against it before reading any section). Names are unique.
  [[nodiscard]] virtual std::vector<state_section> state_sections(std::span<const layer_state> layers) const;
  /// Writes the whole state of the open `slot` (shared state included: a file stands alone) as state_sections(layers)
  /// says: sink(section index, bytes) once or more per non-empty section, in order, the pieces of a section
  /// concatenated (the store checks every section's total). Changes nothing.
  virtual void write_state(int slot, std::span<const layer_state> layers, const state_sink& sink) const;
  /// Opens `slot` (not open), unshared, with its value store in `values_on` and the state `sections` hold (one span
  /// per section of state_sections(layers), sizes already checked, checksum already verified). All or nothing: may
  /// throw out_of_memory, or invalid_argument when the content contradicts itself or the counters (a chunk id out of
  /// range, say: a crafted file), and then the slot is not open.
  virtual void read_state(int slot, value_place values_on, std::span<const layer_state> layers,
                          std::span<const std::span<const std::byte>> sections);

  /// The chunks of the last selection of (layer, slot), per KV head.
  [[nodiscard]] virtual chunk_ids_per_head selected_chunks(int layer, int slot) const = 0;
  /// The outlier chunks of (layer, slot), per KV head.
  [[nodiscard]] virtual chunk_ids_per_head outlier_chunks(int layer, int slot) const = 0;
  /// Position of the last token stored for (layer, slot), -1 if none.
  [[nodiscard]] virtual std::int64_t last_position(int layer, int slot) const = 0;

  /// Bytes held, by kind, over the prefilled (sequence, layer)s of live sequences `layers` (slot, layer, counters). A
  /// byte that several of them share by reference (fork) is counted once in its kind and once more in
  /// memory_report::shared (docs/semantics.md, "Memory report").
  [[nodiscard]] virtual memory_report memory(std::span<const stored_layer> layers) const = 0;
  /// True while the current call's stream is being captured into a CUDA graph: the work is recorded, not run, so
  /// the store leaves its host counters alone (each replay is accounted with kv_store::account_replayed_steps).
  [[nodiscard]] virtual bool capturing() const { return false; }
  /// Ends the current call: waits for the backend's own stream when the caller gave none.
  virtual void finish_call() {}
  /// Selection counters (selections, hits, misses, chunks_rebuilt, bytes_fetched); the store adds the rest.
  [[nodiscard]] virtual store_stats selection_stats() const = 0;
  virtual void reset_selection_stats() noexcept = 0;

  // --- reliability (docs/semantics.md, "Capacity and errors"; docs/errors.md) ---------------------------------------

  /// True if decode calls of this backend can be captured in a CUDA graph and replayed without the store seeing them,
  /// i.e. if kv_store::account_replayed_steps means anything. The CUDA backend returns true.
  [[nodiscard]] virtual bool supports_replay() const { return false; }

  /// True if every element of the floating-point tensor `view` (on where(), validated by the store) is finite.
  /// Runs on the current call's stream and returns its answer (a device backend waits for it; not const: it may use
  /// the backend's scratch memory). The default trusts the input (a backend that cannot check); the CPU and CUDA
  /// backends read every element.
  [[nodiscard]] virtual bool all_finite(const tensor_view& view) {
    (void)view;
    return true;
  }

  /// The index of the first of `views` that holds a NaN or ±Inf, none if all are finite: all_finite over several
  /// tensors, so that a device backend answers them with one wait. The store calls it on the valid part of a call's
  /// inputs before it changes anything (docs/semantics.md, "Non-finite inputs"). The default asks all_finite of each.
  [[nodiscard]] virtual std::optional<std::size_t> find_non_finite(std::span<const tensor_view> views) {
    for (std::size_t i = 0; i < views.size(); ++i) {
      if (!all_finite(views[i])) return i;
    }
    return std::nullopt;
  }

  /// True if the finiteness check waits for the device (a stream synchronisation: the host stops running ahead of
  /// the device for that call). With config::check_finite = automatic the store then checks decode inputs only
  /// where this is false; prefill inputs are checked on every backend.
  [[nodiscard]] virtual bool finite_check_waits() const { return false; }

  /// Allocates everything one decode step of `entries` (states before the step) will need — room for one fold and one
  /// appended token per entry, the selection's and the attention's workspace — so that after it returns the step's
  /// fold_oldest_generated_chunk (beyond its own two phases), append_token, select_chunks, fetch_values, rebuild_keys
  /// and attend cannot fail for lack of memory. Called by the store before the step's first write; may throw
  /// out_of_memory (std::bad_alloc), changing nothing observable. Backends that allocate nothing per call keep the
  /// default.
  virtual void reserve_decode(int layer, std::span<const batch_entry> entries) {
    (void)layer;
    (void)entries;
  }

  /// As reserve_decode for the selection that a prefill with q_last runs after storing the prompts; `entries` hold
  /// the new (prefilled) states. Called before prefill() writes anything.
  virtual void reserve_selection(int layer, std::span<const batch_entry> entries) {
    (void)layer;
    (void)entries;
  }
};

/// Makes the backend for `where`; throws invalid_argument when this build has none for that device.
std::unique_ptr<backend> make_backend(const config& cfg, device where);

}  // namespace shadowkv
