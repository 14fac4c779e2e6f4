// The CUDA backend: the backend seam on one GPU (docs/semantics.md). Its members are defined by job:
//   cuda_backend.cpp   construction (dims from the config, streams, events) and each call's streams
//   arenas.cpp         the arenas and the decode workspace reserved up front, sequences joining and leaving, memory
//   prefill.cpp        a prefill: prompt keys, factorisation (Gram eigensolve or SVD), landmarks, outliers, scatter
//   decode_step.cpp    a decode step's orchestration over the compute and copy streams
//   pipeline_plan.cpp  the step's plan: pipeline parts, fetch CTAs and priority, early attention, fused misses
//   inspection.cpp     reads of device state (selections, outliers, positions, statistics) and the finiteness check
//   keeping.cpp        fork, park and resume, and the saved state's sections
//
// Everything a sequence can need on the device is reserved when the store is built: per (slot, layer) device arenas
// sized from max_seq_len and the decode workspace for max_batch sequences, so a decode step allocates nothing. A
// sequence's value store (all layers, at max_seq_len) is allocated when it joins (open_sequence), in device memory
// or pinned, mapped host memory, and freed when it leaves. A decode step runs on the caller's stream (compute) and a copy stream of the backend's own:
//   compute: advance_generated (fold + append) -> select part 1 -> [event] -> ... -> select part P -> [event]
//            -> rebuild_keys -> [wait fetched] -> sparse attention
//   copy:    [wait part 1 selected] -> fetch part 1 -> ... -> [wait part P selected] -> fetch part P -> [event fetched]
// With decode_pipeline_parts > 1 the batch is cut into parts (pipeline_parts), so that the PCIe fetch of one part
// runs while the next part is selected (off by default: measured slower, see pipeline_parts).
// Counters of each (slot, layer) live in device layer_views and advance on the device, so the host never reads
// device memory inside a step (see device_layout.cuh).
// A prefill queues each sequence of its batch on the call's stream (prompt kernels, factorisation, A = K·Bᵀ,
// landmarks, outliers, scatter, counters; the values' copy to pinned memory on the copy stream) without a wait of its
// own, and reads the cuSOLVER infos of all its factorisations once, after the last one; a non-zero one fails the call
// (cuda_error) after the layers were written, which the store never commits, and their counters are put back
// (forget_prefill). cuSOLVER's dense solvers themselves return only once the stream has drained (docs/performance.md), so
// the host still waits inside each sequence's factorisation.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cuda_handles.hpp"
#include "device_layout.cuh"
#include "device_resources.hpp"
#include "memory_resources.hpp"
#include "shadowkv/backend.hpp"

namespace shadowkv::cuda {

struct key_stats;  // prompt_kernels.cuh

class cuda_backend final : public backend {
 public:
  cuda_backend(const config& cfg, int device_index);
  ~cuda_backend() override;

  [[nodiscard]] device where() const noexcept override { return {device_type::cuda, device_}; }
  void use_stream(std::optional<stream_view> stream) override;
  void finish_call() override;
  [[nodiscard]] bool capturing() const override;
  void open_sequence(int slot, value_place values_on) override;
  [[nodiscard]] std::int64_t value_bytes_per_sequence() const override;
  [[nodiscard]] std::int64_t default_device_value_budget() const override { return default_value_budget_; }
  [[nodiscard]] bool device_has_room(std::int64_t bytes) const override;
  void close_sequence(int slot) noexcept override;
  /// Queues every entry's prefill on the call's stream and reads their factorisations' infos once, after the last
  /// factorisation. Throws cuda_error naming the slot and batch row of a failed factorisation, out_of_memory, or what
  /// a CUDA/cuBLAS/cuSOLVER call throws; after a failure the entries' device counters are as before the call.
  void prefill(int layer, std::span<const batch_entry> entries, const prefill_inputs& inputs) override;
  void fold_oldest_generated_chunk(int layer, std::span<const batch_entry> entries) override;
  void append_token(int layer, std::span<const batch_entry> entries, const append_inputs& inputs) override;
  void select_chunks(int layer, std::span<const batch_entry> entries, const tensor_view& queries) override;
  void fetch_values(int layer, std::span<const batch_entry> entries) override;
  void rebuild_keys(int layer, std::span<const batch_entry> entries) override;
  void attend(int layer, std::span<const batch_entry> entries, const tensor_view& queries,
              const mutable_tensor_view& out) override;
  [[nodiscard]] chunk_ids_per_head selected_chunks(int layer, int slot) const override;
  [[nodiscard]] chunk_ids_per_head outlier_chunks(int layer, int slot) const override;
  [[nodiscard]] std::int64_t last_position(int layer, int slot) const override;
  [[nodiscard]] memory_report memory(std::span<const stored_layer> layers) const override;
  [[nodiscard]] store_stats selection_stats() const override;
  void reset_selection_stats() noexcept override;
  [[nodiscard]] bool supports_replay() const override { return true; }
  // extend and truncate (extend.cpp; docs/semantics.md, "Extend" and "Truncate").
  [[nodiscard]] bool supports_extend() const override { return true; }
  /// Reserves the block attention's workspace for this batch and block size (kept for later calls; grown when a
  /// later call needs more). Throws out_of_memory, changing nothing.
  void reserve_extend(int layer, std::span<const batch_entry> entries, std::span<const std::int64_t> tokens) override;
  /// The block's fold of a full ring, selection, fetch and rebuild as a decode step's, the block attention (gather,
  /// two batched GEMMs of cuBLAS, softmax, scatter), then the block's tokens appended (launch_append_block).
  void extend_block(int layer, std::span<const batch_entry> entries, const block_inputs& inputs,
                    const mutable_tensor_view& out) override;
  [[nodiscard]] bool supports_truncate() const override { return true; }
  /// Waits for the device (the call has no stream: earlier work on any stream must be done), then one kernel per
  /// (slot, layer) (launch_truncate_generated). Throws invalid_argument when the journal cannot hold the undone folds
  /// (the store checks it first; an extend's rollback may ask for more).
  void truncate_generated(int layer, std::span<const batch_entry> entries,
                          std::span<const layer_state> targets) override;
  // fork, park and save (keeping.cpp; docs/semantics.md, "Fork, park and save").
  [[nodiscard]] bool supports_keeping() const override { return true; }
  /// Copies the source's arenas into each child's (they are reserved per slot anyway) and shares the value store's
  /// prompt runs by reference; each child gets a value store for its own chunks only.
  void fork_sequence(int source, std::span<const int> children, std::span<const layer_state> layers) override;
  [[nodiscard]] std::int64_t forked_value_bytes(std::span<const layer_state> layers) const override;
  [[nodiscard]] std::unique_ptr<parked_state> park_sequence(int slot, std::span<const layer_state> layers) override;
  void unpark_sequence(int slot, parked_state& parked) noexcept override;
  void resume_sequence(int slot, parked_state& parked, std::span<const layer_state> layers) override;
  void unresume_sequence(int slot, parked_state& parked) noexcept override;
  [[nodiscard]] const char* state_layout() const override { return "cuda"; }
  [[nodiscard]] std::vector<state_section> state_sections(std::span<const layer_state> layers) const override;
  void write_state(int slot, std::span<const layer_state> layers, const state_sink& sink) const override;
  void read_state(int slot, value_place values_on, std::span<const layer_state> layers,
                  std::span<const std::span<const std::byte>> sections) override;
  [[nodiscard]] bool all_finite(const tensor_view& view) override;
  /// One kernel over all views, a copy of their flags to pinned memory and a wait on the call's stream.
  [[nodiscard]] std::optional<std::size_t> find_non_finite(std::span<const tensor_view> views) override;
  [[nodiscard]] bool finite_check_waits() const override { return true; }

 private:
  struct layer_sizes;  // bytes of each array of one (slot, layer)
  /// One sequence's value store (all its layers), on the device or in pinned host memory; shared by reference
  /// between the sequences of a fork family (values_, prompt_values_).
  struct value_allocation {
    device_buffer device;
    host_buffer host;
    /// Where a kernel reads it.
    [[nodiscard]] std::uint8_t* base() const noexcept {
      return static_cast<std::uint8_t*>(device.data() != nullptr ? device.data() : host.device_pointer());
    }
  };
  /// Reserves everything up front (arenas.cpp): the (slot, layer) arenas and views, the decode workspace for
  /// max_batch sequences, the RoPE table, the prefill's small buffers; then the default device value budget.
  void reserve_memory();
  void upload_batch(std::span<const batch_entry> entries);
  /// A prompt's keys as the prefill reads them (launch_prepare_prompt_keys): float32 before RoPE (scaled for the
  /// Gram matrix), the store's type after RoPE, and the positions.
  struct prompt_keys {
    device_buffer pre_rope;
    device_buffer post_rope;
    device_buffer positions;
    void release(cudaStream_t stream) noexcept {
      pre_rope.release(stream);
      post_rope.release(stream);
      positions.release(stream);
    }
  };
  /// Sequences whose Gram matrices share one batched eigensolve: one host wait inside cuSOLVER a group instead of one
  /// a sequence, for the group's Gram matrices (8 MB each at n = 1024) and the solver's workspace (~35 MB a matrix).
  static constexpr std::size_t kEigensolveGroup = 8;
  /// Queues the key preparation of entries[index] (its key_stats: stats_of(index)) on stream_.
  prompt_keys prepare_keys(const batch_entry& entry, std::size_t index, const prefill_inputs& inputs);
  /// Queues the prefill of entries [first, end), all factorised by their Gram matrices: each Gram matrix, one batched
  /// eigensolve (infos to solver_infos_[first, end)), then prefill_one of each with its eigenvectors. Checks every
  /// info of the call when `end` is the last entry (check_factorizations).
  void prefill_gram_group(int layer, std::span<const batch_entry> entries, std::size_t first, std::size_t end,
                          const prefill_inputs& inputs, const device_resources::library_lease& libraries);
  /// Queues the prefill of entries[index] on stream_. `eigenvectors`: its leading eigenvectors (column-major
  /// [n, rank], ascending), from prefill_gram_group; null: factorised here by an exact SVD (info to
  /// solver_infos_[index]; after the call's last factorisation it checks them all).
  void prefill_one(int layer, std::span<const batch_entry> entries, std::size_t index, const prefill_inputs& inputs,
                   const device_resources::library_lease& libraries, const double* eigenvectors);
  /// Queues KᵀK of `rows` keys (row-major [rows, n] float32) into `gram` (column-major n x n float64) on stream_.
  void gram_matrix(const float* keys_pre, int rows, double* gram, const device_resources::library_lease& libraries);
  /// Every eigenpair of `count` consecutive Gram matrices, in place (eigenvectors in the columns, ascending);
  /// cuSOLVER's infos to `infos` (device), read by the caller.
  void solve_gram_matrices(double* grams, int count, int* infos, const device_resources::library_lease& libraries);
  /// Queues the basis of `rows` keys by an exact SVD on stream_; cuSOLVER's info goes to `info` (device).
  void svd_basis(const float* keys_pre, int rows, float* basis, int* info,
                 const device_resources::library_lease& libraries);
  /// Copies the entries' cuSOLVER infos to pinned memory and waits for them (the prefill's one wait of its own);
  /// throws cuda_error naming the slot and batch row of the first that is not zero.
  void check_factorizations(std::span<const batch_entry> entries);
  /// entries[index]'s key_stats (device): RoPE overflow, largest magnitude, Gram scaling (launch_prepare_prompt_keys).
  [[nodiscard]] key_stats* stats_of(std::size_t index) const;
  /// Reads the overflow flags of entries [first, end) (waits for the stream) and throws invalid_argument, with the
  /// CPU backend's message, for the first one set.
  void reject_overflowed_keys(std::span<const batch_entry> entries, std::size_t first, std::size_t end);
  /// After a failed prefill: waits for stream_ and puts back the entries' device views of `layer` as open_sequence
  /// uploaded them (fresh counters), so that inspection calls read what they read before the call.
  void forget_prefill(int layer, std::span<const batch_entry> entries) noexcept;
  [[nodiscard]] layer_view& host_view(int slot, int layer) { return host_views_[static_cast<std::size_t>(slot * config_.num_layers + layer)]; }
  [[nodiscard]] const layer_view& host_view(int slot, int layer) const { return host_views_[static_cast<std::size_t>(slot * config_.num_layers + layer)]; }
  [[nodiscard]] layer_view* device_view(int slot, int layer) const;
  /// A value store for one sequence in `where`: every chunk of every layer (own_chunks empty), or per layer l only
  /// own_chunks[l] chunks (a forked sequence's own). Throws out_of_memory.
  [[nodiscard]] std::shared_ptr<value_allocation> allocate_values(value_place where,
                                                                  std::span<const int> own_chunks = {}) const;
  /// Bytes of `chunks` chunks' value runs of one layer (fp8: codes, aligned, then scales), and where the scales start.
  [[nodiscard]] std::size_t value_runs_bytes(int chunks) const;
  [[nodiscard]] std::size_t value_scales_offset(int chunks) const;
  /// The device views of all layers of `slot` (counters as the device has them), waiting for the device.
  [[nodiscard]] std::vector<layer_view> read_views(int slot) const;
  /// Makes `slot` hold the sequence whose views (counters, value pointers) are `views`: its arena pointers, uploaded.
  void install_views(int slot, std::span<const layer_view> views, std::shared_ptr<value_allocation> own,
                     std::shared_ptr<value_allocation> prompt, value_place values_on);
  /// Consecutive entries of a decode batch, selected and fetched as one unit of the pipeline.
  struct batch_part {
    int first = 0;
    int count = 0;
  };
  static constexpr int kMaxPipelineParts = 8;      ///< config::decode_pipeline_parts' limit
  static constexpr int kDefaultPipelineParts = 3;  ///< the backend's choice from kPipelineFromBatch sequences
  static constexpr int kDefaultPipelinePartsFp8 = 2;  ///< the same with fp8 values (half the PCIe bytes to hide)
  static constexpr int kPipelineFromBatch = 16;    ///< (with host values; docs/performance.md)
  /// The largest batch whose attention the key rebuild releases early (dims::attention_early; measured at B = 1 and
  /// 8, docs/performance.md; session 20: at B = 1 device values hit 0.52 the step 0.071 -> 0.069 ms in one-step graphs,
  /// 0.066 -> 0.064 in graphs of 8; B = 8 level).
  static constexpr int kEarlyAttentionMaxBatch = 8;
  /// dims_ as the kernels of a decode step of `batch` sequences take them (dims::attention_early).
  [[nodiscard]] dims step_dims(int batch) const;
  /// The largest batch whose steps are fused (dims::fused_misses): one sequence. Measured on the H200 at B = 1, S = 122880, device values (docs/performance.md; session 25): at hit 0.52 the
  /// fused step takes 0.066 ms a step in graphs of 8 against 0.068 unfused (0.068 against 0.070 in one-step graphs);
  /// at hit 0.04 it is slower (0.079 against 0.073), but decode hit rates on real captures are 0.6-0.9. At B = 8 a
  /// fused rebuild CTA takes several groups, and the step is slower (0.236 against 0.205 ms, session 23).
  static constexpr int kFusedMissesMaxBatch = 1;
  /// Whether this step's key rebuild attends over the missed rows (dims::fused_misses): at most
  /// kFusedMissesMaxBatch sequences, the call decodes (not a prefill), the batch is one pipeline part, every value is in device memory, and the shapes
  /// allow it (sparse_attention_fuses).
  [[nodiscard]] bool fuse_step(std::span<const batch_entry> entries) const;
  /// stream_ waits for the whole fetch queued by fetch_values, once (no-op when none is pending).
  void join_fetch();
  /// select_chunks' work (select_chunks launches the queued append if it throws).
  void select_parts(int layer, std::span<const batch_entry> entries, const tensor_view& queries);
  /// Launches the append that append_token queued, if any: on the copy stream after logits_done_event_ when
  /// `beside_select` (the select kernel leaves multiprocessors free; the landmark logits fill them all), else on
  /// stream_ (a call whose selection did not launch it).
  void launch_queued_append(bool beside_select);
  /// Makes stream_ wait for the append launched on the copy stream, if stream_ has not joined it yet.
  void join_append();
  /// Copies `bytes` from the device to the host on the backend's own (non-blocking) stream and waits for it: the
  /// inspection calls read through it instead of the legacy default stream, which would wait for every blocking
  /// stream of the device (the caller's included).
  void read_back(void* host, const void* device, std::size_t bytes) const;
  /// The pipeline's parts for this batch, split tapered (part_start): config::decode_pipeline_parts when set (at
  /// most the batch), else the backend's choice (see the measurement in pipeline_parts).
  [[nodiscard]] std::vector<batch_part> pipeline_parts(std::span<const batch_entry> entries) const;
  /// Whether any of these entries' values are in pinned host memory.
  [[nodiscard]] bool any_host_values(std::span<const batch_entry> entries) const;
  /// CTAs of the value fetch for these entries: few when any of their values are in pinned host memory (a PCIe
  /// read holds its warp for microseconds), more when all are in device memory.
  [[nodiscard]] int fetch_ctas(std::span<const batch_entry> entries) const;
  /// The decode workspace seen from batch entry `first` on (every per-entry array offset by `first` rows).
  [[nodiscard]] step_workspace workspace_from(int first) const;

  config config_;
  int device_;
  dims dims_{};
  int kv_type_;
  int fetch_ctas_host_ = 1;             ///< value fetch CTAs when values cross PCIe (fetch_ctas_for_host_values)
  int fetch_ctas_device_ = 1;           ///< value fetch CTAs when every value of the part is in device memory
  int fetch_priority_host_ = 0;         ///< launch priority of a fetch across PCIe (fetch_priority_for_host_values)
  bool fused_step_ = false;  ///< this call is a fused step (fetch_values decides; rebuild_keys and attend follow)
  bool prefilling_ = false;
  bool extending_ = false;  ///< this call is an extend block (its selection is followed by the block attention)
  device_buffer extend_memory_;  ///< the block attention's workspace (reserve_extend)
  int extend_batch_ = 0;         ///< entries it holds room for
  int extend_block_ = 0;         ///< tokens a block it holds room for             ///< this call is a prefill (its selection is not followed by an attention)
  strided_tensor selection_queries_{};  ///< this call's queries as [B, Hq, D] (select_chunks; miss_attention)
  cudaStream_t stream_ = nullptr;       ///< the current call's compute stream (caller's or own_stream_)
  bool caller_stream_ = false;
  // Handles before buffers: members are destroyed in reverse order, so the buffers (freed on own_stream_) go first.
  // The device's shared resources (cuBLAS/cuSOLVER, memory resources, its facts): the buffers allocate through them.
  std::shared_ptr<device_resources> resources_;
  stream_handle own_stream_;   ///< ordered with the legacy default stream (make_stream), the others are not
  stream_handle copy_stream_;
  std::array<event_handle, kMaxPipelineParts> part_selected_events_;  ///< part p selected (the copy stream waits)
  std::array<event_handle, kMaxPipelineParts> part_fetched_events_;   ///< part p's values fetched (attention waits)
  event_handle fetched_event_;  ///< every part's values fetched
  bool fetch_pending_ = false;  ///< a fetch was queued that stream_ has not joined yet (join_fetch)
  // The decode step's exact generated region (append_token, attend): the append on the copy stream beside the
  // select kernel, the fold of full rings after the attention's split kernel, beside its combine.
  /// The arguments of append_token, kept until the selection launches the append (launch_queued_append).
  struct queued_append {
    int layer;
    int batch;
    strided_tensor keys;
    strided_tensor values;
    strided_tensor positions;
    int positions_bits;
    bool keys_post_rope;
  };
  std::optional<queued_append> queued_append_;
  event_handle logits_done_event_;  ///< the first part's landmark logits done (the append waits)
  event_handle appended_event_;     ///< the new tokens appended (the attention waits)
  event_handle splits_done_event_;  ///< the attention's last split kernel done (the fold waits)
  event_handle folded_event_;       ///< full rings folded (stream_ waits before the call ends)
  bool append_pending_ = false;     ///< an append was launched on the copy stream that stream_ has not joined yet
  bool fold_requested_ = false;     ///< the store asked for a fold: append_token launches it first
  event_handle values_ready_event_;
  device_buffer arena_;          ///< all (slot, layer) arrays
  // Value stores, one allocation per live sequence (all its layers), on the device or in pinned host memory. A forked
  // sequence's holds its own chunks only, and it keeps the allocation holding its prompt's runs alive
  // (layer_view::shared_value_store; keeping.cpp).
  std::vector<std::shared_ptr<value_allocation>> values_;         ///< [slot]: the sequence's own
  std::vector<std::shared_ptr<value_allocation>> prompt_values_;  ///< [slot]: its shared prompt's runs (fork), or null
  std::vector<value_place> values_on_;        ///< [slot]
  std::size_t arena_slot_bytes_ = 0;          ///< one slot's arenas (all layers), contiguous from host_view(slot, 0).basis
  std::size_t value_layer_bytes_ = 0;         ///< one (slot, layer) value store, aligned
  std::size_t value_codes_bytes_ = 0;         ///< its values (fp8: codes) part; fp8 scales follow at this offset
  std::int64_t default_value_budget_ = 0;     ///< free device memory after the reservations, less a margin
  std::int64_t device_margin_ = 0;            ///< device bytes "auto" placement leaves free for the caller
  device_buffer views_;          ///< layer_view [max_batch * num_layers]
  device_buffer workspace_memory_;
  device_buffer inv_freq_;
  device_buffer batch_slots_;    ///< int [max_batch]
  host_buffer batch_staging_;    ///< pinned int [max_batch]
  device_buffer solver_infos_;   ///< int [max_batch]: the cuSOLVER info of each sequence of a prefill
  host_buffer solver_infos_host_;  ///< pinned int [max_batch]: their copy, read once per prefill
  device_buffer key_stats_;      ///< key_stats [max_batch]: what the prompt-key kernel found in each sequence's keys
  host_buffer key_stats_host_;   ///< pinned key_stats [max_batch]: their copy, read with the infos
  std::vector<layer_view> host_views_;
  std::vector<int> uploaded_slots_;
  step_workspace workspace_{};
  std::int64_t batch_size_ = 0;
  std::vector<batch_part> parts_;  ///< this step's pipeline parts: set by select_chunks, used by fetch_values
  // The finiteness check's flags, one int per view of a batch (device) and their copy (pinned host), allocated on the
  // first check and kept. Declared last: freed (on own_stream_) before the handles go.
  static constexpr int kFiniteFlags = 64;
  device_buffer finite_flags_;
  host_buffer finite_flags_host_;
};

}  // namespace shadowkv::cuda
