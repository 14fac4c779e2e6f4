// kv_store: the public C++ entry point of shadowkv_core.
//
// One store serves all layers of a model and up to `max_batch` sequences. Per layer, the caller prefills the prompt's
// keys and values once, then calls decode once per generated token; the store returns the attention output.
// Every call validates all of its arguments before it changes anything: when it throws, the store and every
// sequence in it are as they were.
//
// Thread safety: a store may be shared by threads. Every public member function takes the store's one mutex for the
// whole call, so calls are serialised: concurrent calls behave as if made one after another in some order, counters
// (stats()) are exact, and two threads decoding the same slot each get the output of one step of that serial order.
// Calls on one store do not run in parallel; use one store per thread for parallelism.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "shadowkv/backend.hpp"
#include "shadowkv/config.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/report.hpp"
#include "shadowkv/stream_view.hpp"
#include "shadowkv/tensor_view.hpp"

namespace shadowkv {

/// Optional inputs of kv_store::prefill.
struct prefill_options {
  std::vector<std::int64_t> lengths;  ///< valid tokens per row (right padding); empty: every row has S tokens
  tensor_view positions;              ///< int [B, S]; empty: 0..S-1
  tensor_view q_last;                 ///< post-RoPE queries [B, Hq, D] or [B, Tq, Hq, D] to warm the selection
  /// Keys carry RoPE at `positions` (the default, as decode's k_new and as transformers hands them to an attention
  /// function; the store removes it for the factorisation). false: pre-RoPE keys (the store applies it).
  bool keys_post_rope = true;
  /// The caller's CUDA stream the inputs are ready on and the work is ordered on (CUDA backend; others ignore it).
  /// Unset: the store's own stream, and the call completes before it returns (inputs must be ready: on CUDA the own
  /// stream is ordered after the work queued on the legacy default stream, such as a cudaMemcpy of an input).
  std::optional<stream_view> stream;
};

/// Optional inputs of kv_store::decode.
struct decode_options {
  tensor_view positions;         ///< int [B]; empty: each sequence's last position + 1
  bool keys_post_rope = true;    ///< k_new carries RoPE (false: the store applies it)
  /// As prefill_options::stream; `out` is written in stream order.
  std::optional<stream_view> stream;
};

/// Optional inputs of kv_store::extend.
struct extend_options {
  std::vector<std::int64_t> lengths;  ///< new tokens per row (right padding), each in [1, T]; empty: every row has T
  tensor_view positions;              ///< int [B, T]; empty: each sequence's last position + 1, + 2, ...
  bool keys_post_rope = true;         ///< k carries RoPE (false: the store applies it), as decode_options
  /// As prefill_options::stream; `out` is written in stream order.
  std::optional<stream_view> stream;
};

/// A sequence parked out of a store by kv_store::park: its whole state in host memory (docs/semantics.md, "Fork, park
/// and save"). Move-only. kv_store::resume puts it back into the store that parked it (once: it is empty afterwards);
/// destroying it frees its memory.
class parked_sequence {
 public:
  parked_sequence();
  ~parked_sequence();
  parked_sequence(parked_sequence&&) noexcept;
  parked_sequence& operator=(parked_sequence&&) noexcept;
  parked_sequence(const parked_sequence&) = delete;
  parked_sequence& operator=(const parked_sequence&) = delete;

  /// True once resumed (or moved from, or default-constructed): nothing to resume.
  [[nodiscard]] bool empty() const noexcept { return state_ == nullptr; }
  /// Host bytes held of its own, what destroying it frees: state shared with other sequences (a fork's family, live
  /// or parked) is counted only once no other holds it.
  [[nodiscard]] std::int64_t host_bytes() const noexcept;
  /// Tokens of the sequence (prompt + generated, as in layer 0).
  [[nodiscard]] std::int64_t tokens() const noexcept;
  /// The slot the sequence had when it was parked.
  [[nodiscard]] int parked_from() const noexcept { return slot_; }

 private:
  friend class kv_store;
  std::uint64_t store_id_ = 0;  ///< the store that parked it (kv_store::id_)
  int slot_ = -1;
  std::uint64_t family_ = 0;    ///< the prompt family it shares (0: none)
  value_place values_on_ = value_place::host;
  std::vector<layer_state> layers_;
  std::unique_ptr<parked_state> state_;
};

/// Makes a store's backend from the configuration the store runs with (kv_store's second constructor).
using backend_maker = std::function<std::unique_ptr<backend>(const config&)>;

class kv_store {
 public:
  /// Validates `cfg` and creates the backend of `where`. Throws invalid_argument (a field out of range, or a size
  /// that cannot be counted) or out_of_memory (fixed costs beyond the host's physical memory, naming the bytes);
  /// see docs/semantics.md, "Capacity and errors". A budget larger than max_seq_len is clamped as that section says
  /// (get_config().budget shows the value used).
  explicit kv_store(config cfg, device where = {});
  /// As above with a backend of the caller's (an out-of-tree backend, or a test double): `make` receives the
  /// configuration the store runs with, after validation and clamping.
  kv_store(config cfg, const backend_maker& make);
  ~kv_store();
  kv_store(const kv_store&) = delete;
  kv_store& operator=(const kv_store&) = delete;
  kv_store(kv_store&&) noexcept;
  kv_store& operator=(kv_store&&) noexcept;

  [[nodiscard]] const config& get_config() const noexcept { return config_; }
  [[nodiscard]] device where() const noexcept;

  /// Takes `count` free slots (lowest ids first) and reserves their value stores where config.value_store says
  /// ("auto": device memory while device_value_budget lasts, else host; a sequence never straddles). Throws
  /// capacity_error when fewer slots are free, out_of_memory when a value store fits nowhere; then takes nothing.
  std::vector<int> add_sequences(int count);
  /// Frees the slots. Throws invalid_argument (and frees nothing) if any slot is not in use or repeats.
  void release(std::span<const int> slots);
  /// Slots in use, ascending.
  [[nodiscard]] std::vector<int> active_slots() const;

  /// Stores layer `layer` of the prompts of `slots`: keys and values [B, S, Hkv, D] (post-RoPE keys, as decode's
  /// k_new, unless options.keys_post_rope is false). Row b of the tensors belongs to slots[b].
  void prefill(int layer, std::span<const int> slots, const tensor_view& keys, const tensor_view& values,
               const prefill_options& options = {});

  /// One decode step of layer `layer`: appends k_new/v_new [B, Hkv, D] (post-RoPE k_new unless
  /// options.keys_post_rope is false), selects chunks with q [B, Hq, D] (post-RoPE) and writes the attention output
  /// to out [B, Hq, D], whose elements must not overlap (invalid_argument for, e.g., a zero stride).
  void decode(int layer, std::span<const int> slots, const tensor_view& q, const tensor_view& k_new,
              const tensor_view& v_new, const mutable_tensor_view& out, const decode_options& options = {});

  /// Appends T >= 1 tokens per sequence to layer `layer` at once (a chat turn, a draft to verify): q [B, T, Hq, D]
  /// post-RoPE, k and v [B, T, Hkv, D], out [B, T, Hq, D] (rows past a sequence's length are not written). Every token
  /// attends exactly and causally to the new tokens before it and to the exact regions, and through one selection
  /// per block of config.extend_block tokens to the compressed context (docs/semantics.md, "Extend"). T = 1 is
  /// decode. Throws invalid_argument / capacity_error (bad input, a full sequence) and out_of_memory, changing nothing.
  void extend(int layer, std::span<const int> slots, const tensor_view& q, const tensor_view& k, const tensor_view& v,
              const mutable_tensor_view& out, const extend_options& options = {});

  /// Removes the last tokens[i] tokens appended after the prefill (by decode or extend) from every layer of
  /// slots[i]; the sequence then equals one that never saw them (docs/semantics.md, "Truncate"). Throws
  /// invalid_argument (a slot not live, a count into the prompt or beyond a layer's generated tokens) and
  /// out_of_memory, changing nothing.
  void truncate(std::span<const int> slots, std::span<const std::int64_t> tokens);

  /// Takes `count` free slots (lowest ids first) and makes each a sequence equal to `slot` now, in every layer, that
  /// shares the prompt's compressed state with it by reference (docs/semantics.md, "Fork, park and save"). Every layer
  /// of `slot` must be prefilled. Throws invalid_argument (slot not live or not prefilled, count < 1), capacity_error
  /// (too few free slots) or out_of_memory, changing nothing.
  std::vector<int> fork(int slot, int count = 1);

  /// Moves each sequence's whole state out of its slot into host memory and frees the slots (for other sequences);
  /// a decode on a freed slot then names it parked until a sequence takes it. Every layer must be prefilled. A fork's
  /// family member keeps sharing its prompt state and its family; it holds no device_value_budget (the shared runs'
  /// charge passes to a live member, as at release). Throws
  /// invalid_argument (a slot not live, repeated or not prefilled in every layer; a backend that cannot park) or
  /// out_of_memory, changing nothing.
  std::vector<parked_sequence> park(std::span<const int> slots);
  /// Restores each parked sequence into a free slot (lowest ids first) and empties it; returns the slots, in order.
  /// A sequence whose values were in device memory gets them there again (with value_store = "auto", within
  /// device_value_budget: a family member beside a live one on the device is charged as a fork's child). Throws invalid_argument (none given, an empty object, parked by another store),
  /// capacity_error (too few free slots) or out_of_memory (no device room), changing nothing.
  std::vector<int> resume(std::span<parked_sequence> parked);

  /// Writes the whole state of the live `slot` to the file `path` (docs/api.md, "Saved sequences"): to `path` +
  /// ".tmp" first, renamed to `path` once complete, so that a failed save leaves no partial file under `path`.
  /// Changes nothing in the store; throws invalid_argument (slot not live, a layer not prefilled, a backend that
  /// cannot save) or io_error (errors.hpp; OSError in Python: the file cannot be written).
  void save(int slot, const std::string& path) const;
  /// Reads a file written by save into a free slot (the lowest) and returns it, unshared (family 0, whatever the
  /// saved sequence shared); its value store is placed as add_sequences places a new sequence's. Checks everything first: throws io_error (the file cannot be read),
  /// invalid_argument (not a saved sequence, another version, backend layout or configuration, truncated or
  /// corrupted), capacity_error (no free slot, or more tokens than max_seq_len) or out_of_memory, changing nothing.
  int load(const std::string& path);

  /// Accounts for `steps` decode steps of (layer, slots) that ran without the store seeing them: replays of a CUDA
  /// graph captured around one decode call. Advances the host counters (fold rule included) exactly as that many
  /// decode calls would, in O(1); throws capacity_error (changing nothing) if a sequence would exceed max_seq_len,
  /// and invalid_argument on a backend that cannot replay (backend::supports_replay(): the CPU backend), where no
  /// step can run unseen.
  ///
  /// CUDA graph rule: capture `decode(layer, slots, ...)` on the caller's stream after at least one eager decode with
  /// the same `slots` (so the slot list is already on the device); shapes, tensors' addresses and slots are fixed
  /// for the graph; each replay advances the device state by one step; tell the store with this call.
  void account_replayed_steps(int layer, std::span<const int> slots, std::int64_t steps);

  /// Chunk ids of the last selection of (layer, slot), per KV head, ascending.
  [[nodiscard]] chunk_ids_per_head selected_chunks(int layer, int slot) const;
  /// Outlier chunk ids of (layer, slot), per KV head, ascending.
  [[nodiscard]] chunk_ids_per_head outlier_chunks(int layer, int slot) const;
  /// Every context chunk of (layer, slot) the last step attended exactly, per KV head, ascending: the outliers (sinks
  /// among them) and the last selection. (The local window and generated tokens are attended too; they are no chunks
  /// of the context.)
  [[nodiscard]] chunk_ids_per_head attended_chunks(int layer, int slot) const;
  /// Counters of (layer, slot).
  [[nodiscard]] sequence_info info(int layer, int slot) const;

  [[nodiscard]] memory_report memory() const;
  /// What memory() reports for one (sequence, layer) right after a prefill of `prompt_tokens` tokens (1 to
  /// max_seq_len; docs/semantics.md, "Memory report"), from the configuration alone; value_store is counted in
  /// value_store_host. With prompt_tokens = max_seq_len, total() against full_attention_equivalent is the store's
  /// footprint relative to full attention (the Python KVStore warns when it exceeds 1). Throws invalid_argument for a
  /// count out of range.
  [[nodiscard]] memory_report layer_memory_after_prefill(std::int64_t prompt_tokens) const;
  /// Device bytes value_store="auto" sequences may take (config.device_value_budget, or the backend's default).
  [[nodiscard]] std::int64_t device_value_budget() const noexcept { return device_value_budget_; }
  /// Bytes one sequence's value store takes (all layers, at max_seq_len), in whichever memory it is placed.
  [[nodiscard]] std::int64_t value_bytes_per_sequence() const { return backend_->value_bytes_per_sequence(); }
  [[nodiscard]] store_stats stats() const;
  void reset_stats() noexcept;

 private:
  struct sequence {
    bool active = false;
    value_place values_on = value_place::host;
    std::uint64_t family = 0;  ///< sequences with the same non-zero family share their prompt (fork)
    /// Inactive because its sequence was parked (and no sequence has taken the slot since): check_slot says so.
    bool parked = false;
    /// Bytes of device_value_budget this sequence holds (its value store in device memory): value_bytes_per_sequence()
    /// for a sequence added (or loaded) on the device; backend::forked_value_bytes() for a fork's child, plus the
    /// prompt's shared runs for the one live member of a family that carries them (the source, until it is released
    /// or parked; a resumed member when none of its family was live). 0 while inactive (released or parked).
    std::int64_t device_value_bytes = 0;
    std::vector<layer_state> layers;
  };

  void check_layer(int layer) const;
  void check_slot(int slot) const;
  [[nodiscard]] bool layer_prefilled(int layer, int slot) const;  ///< after check_layer and check_slot
  void check_batch_slots(std::span<const int> slots) const;
  /// Takes `seq` (made inactive just now: released or parked) out of the device value budget; the shared runs it
  /// carries for its family pass to the lowest live member, if any (docs/semantics.md, "Value placement").
  /// Closes `slot` in the backend and marks it free (remembering whether it was parked), its device value charge
  /// dropped (drop_device_charge) and its family and layers forgotten: release and park.
  void vacate(int slot, bool parked);
  void drop_device_charge(sequence& seq);
  /// decode() after its lock and argument checks; extend() of one token per sequence runs it too.
  void decode_checked(int layer, std::span<const int> slots, const tensor_view& q, const tensor_view& k_new,
                      const tensor_view& v_new, const mutable_tensor_view& out, const tensor_view& positions,
                      bool keys_post_rope);
  /// Folds the oldest generated chunk of each entry (backend and host counters).
  void fold_entries(int layer, std::span<const batch_entry> entries);
  /// The host counters of entries after an extend block of `tokens` tokens.
  void advance_block(int layer, std::span<const batch_entry> entries, std::int64_t tokens);

  std::uint64_t id_ = 0;            ///< unique per store: a parked_sequence resumes only into its own store
  std::uint64_t next_family_ = 1;   ///< the next prompt family id (fork)
  config config_;
  // Serialises every public call (see "Thread safety" above); a pointer so that the store stays movable.
  std::unique_ptr<std::mutex> mutex_ = std::make_unique<std::mutex>();
  std::unique_ptr<backend> backend_;
  std::vector<sequence> sequences_;
  std::int64_t device_value_budget_ = 0;
  std::int64_t device_value_bytes_ = 0;  ///< value stores of live sequences placed on the device
  std::int64_t decode_steps_ = 0;
  std::int64_t folds_ = 0;
};

}  // namespace shadowkv
