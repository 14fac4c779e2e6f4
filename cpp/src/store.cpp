// The store's algorithm, written once against the backend seam (docs/semantics.md).
#include "shadowkv/store.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "capacity.hpp"
#include "fold_rule.hpp"
#include "shadowkv/generated_region.hpp"
#include "tensor_checks.hpp"

namespace shadowkv {

namespace {

// Validates `cfg`, clamps its budget and rejects what cannot be served (capacity.hpp), before anything is allocated.
config checked_config(config cfg) {
  cfg.validate();
  config effective = detail::effective_config(std::move(cfg));
  detail::check_capacity(effective, detail::physical_host_bytes());
  return effective;
}

// Row `row` of `view` (a view of the caller's memory, no copy), its dimension 1 cut to `length` tokens if >= 0.
tensor_view row_of(const tensor_view& view, std::int64_t row, std::int64_t length = -1) {
  tensor_view result = view;
  const auto element = static_cast<std::int64_t>(dtype_size(view.float_type));
  result.data = static_cast<const std::byte*>(view.data) + row * view.strides[0] * element;
  result.shape[0] = 1;
  if (length >= 0) result.shape[1] = length;
  return result;
}

// One input of a call to check for NaN/±Inf: the whole tensor, or (with `lengths`) each row cut to its valid tokens.
struct finite_input {
  const char* name;
  const tensor_view* view;
  std::span<const std::int64_t> lengths;
};

// Throws invalid_argument naming the first input, row and slot whose valid tokens hold NaN or ±Inf (docs/semantics.md,
// "Non-finite inputs"). One backend question for all of a call's inputs (a device backend waits once); the row of a
// whole tensor is looked for only when it holds something.
void expect_all_finite(backend& checker, std::initializer_list<finite_input> inputs,
                       std::span<const int> slots) {
  std::vector<tensor_view> views;
  std::vector<std::pair<const finite_input*, std::int64_t>> origin;  // (input, row), row -1: the whole tensor
  for (const finite_input& input : inputs) {
    if (input.lengths.empty()) {
      views.push_back(*input.view);
      origin.emplace_back(&input, -1);
      continue;
    }
    for (std::size_t b = 0; b < slots.size(); ++b) {
      views.push_back(row_of(*input.view, static_cast<std::int64_t>(b), input.lengths[b]));
      origin.emplace_back(&input, static_cast<std::int64_t>(b));
    }
  }
  const std::optional<std::size_t> found = checker.find_non_finite(views);
  if (!found) return;
  const finite_input& input = *origin[*found].first;
  std::int64_t row = origin[*found].second;
  if (row < 0) {
    std::vector<tensor_view> rows;
    for (std::size_t b = 0; b < slots.size(); ++b) rows.push_back(row_of(*input.view, static_cast<std::int64_t>(b)));
    row = static_cast<std::int64_t>(checker.find_non_finite(rows).value_or(0));
  }
  throw invalid_argument(detail::format_message(input.name, " (slot ", slots[static_cast<std::size_t>(row)], ", row ",
                                                row, "): NaN or infinite values found; the store accepts only finite "
                                                "inputs"));
}

// True when two index tuples of `view` can address the same element: a dimension of extent > 1 with a stride no
// larger than the reach of the smaller-strided dimensions (a zero stride, as torch's expand() makes, or strides that
// interleave). A sufficient test for distinct elements: rare exotic layouts of distinct elements are refused too.
bool elements_may_overlap(const tensor_view& view) {
  std::array<std::pair<std::int64_t, std::int64_t>, max_tensor_rank> dims{};  // (|stride|, extent)
  std::size_t count = 0;
  for (int dim = 0; dim < view.rank; ++dim) {
    const std::int64_t extent = view.shape[static_cast<std::size_t>(dim)];
    if (extent == 0) return false;  // no elements
    if (extent == 1) continue;
    const std::int64_t stride = view.strides[static_cast<std::size_t>(dim)];
    dims[count++] = {stride < 0 ? -stride : stride, extent};
  }
  for (std::size_t i = 1; i < count; ++i) {  // by stride (insertion sort: at most four dimensions)
    for (std::size_t j = i; j > 0 && dims[j] < dims[j - 1]; --j) std::swap(dims[j], dims[j - 1]);
  }
  std::int64_t reach = 0;  // the largest offset the dimensions so far address
  for (std::size_t i = 0; i < count; ++i) {
    if (dims[i].first <= reach) return true;
    reach += dims[i].first * (dims[i].second - 1);
  }
  return false;
}

// Store ids: a parked_sequence resumes only into the store whose id it carries. 0 is no store's.
std::atomic<std::uint64_t> last_store_id{0};

}  // namespace

using detail::any_extent;

kv_store::kv_store(config cfg, device where)
    : kv_store(std::move(cfg), [where](const config& effective) { return make_backend(effective, where); }) {}

kv_store::kv_store(config cfg, const backend_maker& make) : config_(checked_config(std::move(cfg))) {
  id_ = last_store_id.fetch_add(1) + 1;
  try {
    backend_ = make(config_);
    device_value_budget_ = config_.device_value_budget >= 0 ? config_.device_value_budget
                                                             : backend_->default_device_value_budget();
    sequences_.resize(static_cast<std::size_t>(config_.max_batch));
  } catch (const out_of_memory&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw out_of_memory(detail::format_message(
        "building a store for max_batch = ", config_.max_batch, " sequences ran out of host memory (its slot tables "
        "alone take ", detail::fixed_costs_of(config_).slot_tables, " bytes)"));
  }
  SHADOWKV_EXPECTS(backend_ != nullptr, "the backend maker returned no backend");
}

kv_store::~kv_store() = default;
kv_store::kv_store(kv_store&&) noexcept = default;
kv_store& kv_store::operator=(kv_store&&) noexcept = default;

device kv_store::where() const noexcept { return backend_->where(); }

void kv_store::check_layer(int layer) const {
  SHADOWKV_EXPECTS(layer >= 0 && layer < config_.num_layers, "layer ", layer, " is out of range [0, ",
                   config_.num_layers, ")");
}

void kv_store::check_slot(int slot) const {
  SHADOWKV_EXPECTS(slot >= 0 && slot < config_.max_batch, "slot ", slot, " is out of range [0, ",
                   config_.max_batch, ")");
  const sequence& seq = sequences_[static_cast<std::size_t>(slot)];
  SHADOWKV_EXPECTS(seq.active || !seq.parked, "slot ", slot,
                   " holds no sequence: its sequence was parked (and no sequence has taken the slot since); resume "
                   "the parked sequence to continue it (resume may give it another slot)");
  SHADOWKV_EXPECTS(seq.active, "slot ", slot, " holds no sequence (never added, or released)");
}

bool kv_store::layer_prefilled(int layer, int slot) const {
  return sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)].prefilled;
}

void kv_store::check_batch_slots(std::span<const int> slots) const {
  SHADOWKV_EXPECTS(!slots.empty(), "slots must name at least one sequence");
  std::set<int> seen;
  for (const int slot : slots) {
    check_slot(slot);
    SHADOWKV_EXPECTS(seen.insert(slot).second, "slot ", slot, " appears twice in one call");
  }
}

std::vector<int> kv_store::add_sequences(int count) {
  const std::lock_guard lock(*mutex_);
  SHADOWKV_EXPECTS(count >= 1, "add_sequences needs count >= 1, got ", count);
  std::vector<int> free_slots;
  for (int slot = 0; slot < config_.max_batch && static_cast<int>(free_slots.size()) < count; ++slot) {
    sequence& candidate = sequences_[static_cast<std::size_t>(slot)];
    if (candidate.active) continue;
    // Room for its layer records now (unobservable), so that the commit below allocates nothing and running out of
    // memory cannot leave a slot marked active without its layers.
    candidate.layers.reserve(static_cast<std::size_t>(config_.num_layers));
    free_slots.push_back(slot);
  }
  SHADOWKV_EXPECTS_CAPACITY(static_cast<int>(free_slots.size()) == count, "cannot add ", count,
                            " sequences: only ", free_slots.size(), " of max_batch=", config_.max_batch,
                            " slots are free");
  // Place each sequence's value store: "auto" takes device memory while the budget lasts (and falls back to the
  // host when the device has no room after all); a sequence's values are never split between the two.
  const std::int64_t value_bytes = backend_->value_bytes_per_sequence();
  std::vector<value_place> places;
  places.reserve(free_slots.size());  // so that no push_back below can fail after a sequence was opened
  std::int64_t device_bytes = device_value_bytes_;
  std::size_t opened = 0;
  try {
    for (; opened < free_slots.size(); ++opened) {
      const int slot = free_slots[opened];
      value_place place = config_.value_store == value_store_policy::device ? value_place::device : value_place::host;
      if (config_.value_store == value_store_policy::auto_place) {
        const bool within_budget = device_bytes + value_bytes <= device_value_budget_;
        bool on_device = false;
        if (within_budget && backend_->device_has_room(value_bytes)) {
          try {
            backend_->open_sequence(slot, value_place::device);
            on_device = true;
          } catch (const out_of_memory&) {
          }
        }
        if (on_device) {
          place = value_place::device;
        } else {
          try {
            backend_->open_sequence(slot, value_place::host);
          } catch (const out_of_memory& error) {
            throw out_of_memory(detail::format_message(
                "the value store of a new sequence (", value_bytes, " bytes) fits neither on the device (",
                within_budget ? "no device memory left" : "device_value_budget exhausted", ": ", device_bytes,
                " of ", device_value_budget_, " bytes in use) nor in host memory (", error.what(), ")"));
          }
        }
      } else {
        backend_->open_sequence(slot, place);
      }
      places.push_back(place);
      if (place == value_place::device) device_bytes += value_bytes;
    }
  } catch (...) {
    for (std::size_t i = 0; i < opened; ++i) backend_->close_sequence(free_slots[i]);
    throw;
  }
  for (std::size_t i = 0; i < free_slots.size(); ++i) {
    sequence& seq = sequences_[static_cast<std::size_t>(free_slots[i])];
    seq.active = true;
    seq.parked = false;
    seq.values_on = places[i];
    seq.layers.assign(static_cast<std::size_t>(config_.num_layers), layer_state{});
    for (layer_state& state : seq.layers) state.values_on = places[i];
    seq.family = 0;
    seq.device_value_bytes = places[i] == value_place::device ? value_bytes : 0;
  }
  device_value_bytes_ = device_bytes;
  return free_slots;
}

void kv_store::release(std::span<const int> slots) {
  const std::lock_guard lock(*mutex_);
  check_batch_slots(slots);
  for (const int slot : slots) vacate(slot, /*parked=*/false);
}

void kv_store::vacate(int slot, bool parked) {
  backend_->close_sequence(slot);
  sequence& seq = sequences_[static_cast<std::size_t>(slot)];
  seq.active = false;
  seq.parked = parked;
  drop_device_charge(seq);
  seq.family = 0;
  seq.layers.clear();
}

void kv_store::drop_device_charge(sequence& seq) {
  if (seq.device_value_bytes > 0 && seq.family != 0) {
    // The prompt's shared value runs outlive this sequence while another of its family lives: the budget bytes it
    // carries for them (beyond a child's own) pass to the lowest live member, which now carries them.
    const std::int64_t carried = seq.device_value_bytes - backend_->forked_value_bytes(seq.layers);
    for (sequence& other : sequences_) {
      if (carried <= 0) break;
      if (!other.active || other.family != seq.family) continue;
      other.device_value_bytes += carried;
      seq.device_value_bytes -= carried;
      break;
    }
  }
  device_value_bytes_ -= seq.device_value_bytes;
  seq.device_value_bytes = 0;
}

std::vector<int> kv_store::fork(int slot, int count) {
  const std::lock_guard lock(*mutex_);
  check_slot(slot);
  SHADOWKV_EXPECTS(count >= 1, "fork needs count >= 1, got ", count);
  sequence& source = sequences_[static_cast<std::size_t>(slot)];
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    SHADOWKV_EXPECTS(source.layers[static_cast<std::size_t>(layer)].prefilled, "fork: layer ", layer, " of slot ", slot,
                     " has no prompt yet; every layer must be prefilled before a fork");
  }
  SHADOWKV_EXPECTS(backend_->supports_keeping(), "fork is not implemented on the ", to_string(backend_->where()),
                   " backend yet");
  std::vector<int> children;
  int free_count = 0;
  for (int candidate = 0; candidate < config_.max_batch; ++candidate) {
    sequence& seq = sequences_[static_cast<std::size_t>(candidate)];
    if (seq.active) continue;
    ++free_count;
    if (static_cast<int>(children.size()) == count) continue;
    // Room for its layer records now (unobservable), so that the commit below allocates nothing.
    seq.layers.reserve(static_cast<std::size_t>(config_.num_layers));
    children.push_back(candidate);
  }
  SHADOWKV_EXPECTS_CAPACITY(static_cast<int>(children.size()) == count, "cannot fork slot ", slot, " into ", count,
                            " sequences: only ", free_count, " of max_batch=", config_.max_batch, " slots are free");
  // A child's value store is where the source's is. On the device it takes what the backend allocates for it (the
  // prompt's runs are shared): within device_value_budget for value_store="auto", as add_sequences places sequences.
  std::int64_t child_device_bytes = 0;
  if (source.values_on == value_place::device) {
    child_device_bytes = backend_->forked_value_bytes(source.layers);
    const std::int64_t left = device_value_budget_ - device_value_bytes_;
    if (config_.value_store == value_store_policy::auto_place && child_device_bytes > 0 &&
        (count > left / child_device_bytes || !backend_->device_has_room(child_device_bytes * count))) {
      throw out_of_memory(detail::format_message(
          "fork of slot ", slot, ": its values are in device memory, and the value stores of ", count, " children (",
          child_device_bytes, " bytes each, the prompt's runs shared) do not fit there (device_value_budget: ",
          device_value_bytes_, " of ", device_value_budget_, " bytes in use)"));
    }
  }
  backend_->use_stream(std::nullopt);  // no caller stream: the backend's own, and the call completes before it returns
  try {
    backend_->fork_sequence(slot, children, source.layers);
  } catch (const out_of_memory&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw out_of_memory(
        detail::format_message("fork of slot ", slot, " into ", count, " sequences ran out of host memory"));
  }
  // Commit (no allocation: the children's layer records have room).
  if (source.family == 0) source.family = next_family_++;
  for (const int child : children) {
    sequence& seq = sequences_[static_cast<std::size_t>(child)];
    seq.active = true;
    seq.parked = false;
    seq.values_on = source.values_on;
    seq.family = source.family;
    seq.layers = source.layers;
    seq.device_value_bytes = child_device_bytes;
  }
  device_value_bytes_ += child_device_bytes * count;
  backend_->finish_call();
  return children;
}

std::vector<int> kv_store::active_slots() const {
  const std::lock_guard lock(*mutex_);
  std::vector<int> result;
  for (int slot = 0; slot < config_.max_batch; ++slot) {
    if (sequences_[static_cast<std::size_t>(slot)].active) result.push_back(slot);
  }
  return result;
}

void kv_store::prefill(int layer, std::span<const int> slots, const tensor_view& keys, const tensor_view& values,
                       const prefill_options& options) {
  const std::lock_guard lock(*mutex_);
  // Validate everything first: nothing below the "commit" line may throw on bad input.
  check_layer(layer);
  check_batch_slots(slots);
  const auto batch = static_cast<std::int64_t>(slots.size());
  const device where = backend_->where();
  detail::expect_float_tensor(keys, "keys", where, {batch, any_extent, config_.num_kv_heads, config_.head_dim});
  const std::int64_t padded_len = keys.shape[1];
  detail::expect_float_tensor(values, "values", where, {batch, padded_len, config_.num_kv_heads, config_.head_dim});
  if (!options.positions.empty()) {
    detail::expect_index_tensor(options.positions, "positions", where, {batch, padded_len});
  }
  tensor_view q_last = options.q_last;
  if (!q_last.empty()) {
    if (q_last.rank == 3) {
      detail::expect_float_tensor(q_last, "q_last", where, {batch, config_.num_q_heads, config_.head_dim});
      q_last = detail::insert_unit_dim(q_last);
    }
    detail::expect_float_tensor(q_last, "q_last", where,
                                {batch, any_extent, config_.num_q_heads, config_.head_dim});
    SHADOWKV_EXPECTS(q_last.shape[1] >= 1, "q_last must hold at least one query token, got ", q_last.describe());
  }
  SHADOWKV_EXPECTS(options.lengths.empty() || static_cast<std::int64_t>(options.lengths.size()) == batch,
                   "lengths must have one entry per sequence (", batch, "), got ", options.lengths.size());

  std::vector<layer_state> new_states(slots.size());
  for (std::size_t b = 0; b < slots.size(); ++b) {
    const int slot = slots[b];
    const std::int64_t length = options.lengths.empty() ? padded_len : options.lengths[b];
    SHADOWKV_EXPECTS(length >= 1 && length <= padded_len, "lengths[", b, "] = ", length,
                     " must be in [1, S = ", padded_len, "] (keys hold S tokens per sequence)");
    SHADOWKV_EXPECTS_CAPACITY(length <= config_.max_seq_len, "prompt of slot ", slot, " has ", length,
                              " tokens, more than max_seq_len = ", config_.max_seq_len);
    const layer_state& current = sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)];
    SHADOWKV_EXPECTS(!current.prefilled, "layer ", layer, " of slot ", slot,
                     " is already prefilled; release the slot and add a new sequence to start over");
    layer_state& state = new_states[b];
    state.values_on = current.values_on;
    state.prefilled = true;
    state.prompt_len = length;
    state.prompt_context_chunks = std::max<std::int64_t>(0, length / config_.chunk_size - config_.local_chunks);
    state.context_chunks = state.prompt_context_chunks;
    state.outlier_chunks = std::min<std::int64_t>(config_.outlier_chunks, state.prompt_context_chunks);
    state.local_len = length - state.prompt_context_chunks * config_.chunk_size;
  }

  std::vector<batch_entry> entries(slots.size());
  for (std::size_t b = 0; b < slots.size(); ++b) {
    entries[b] = {slots[b], static_cast<std::int64_t>(b), &new_states[b]};
  }
  backend_->use_stream(options.stream);
  // Non-finite inputs would poison the factorisation and every later score: reject them (only the valid tokens), on
  // every backend and whatever check_finite says.
  if (q_last.empty()) {
    expect_all_finite(*backend_, {{"keys", &keys, options.lengths}, {"values", &values, options.lengths}}, slots);
  } else {
    expect_all_finite(*backend_,
                      {{"keys", &keys, options.lengths}, {"values", &values, options.lengths}, {"q_last", &q_last, {}}},
                      slots);
    // The warm-up selection runs after the prompts are committed: allocate its workspace first.
    backend_->reserve_selection(layer, entries);
  }
  prefill_inputs inputs{keys, values, options.positions, q_last, options.keys_post_rope};
  try {
    backend_->prefill(layer, entries, inputs);
  } catch (const out_of_memory&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw out_of_memory(detail::format_message(
        "prefill of layer ", layer, " for ", batch, " sequence(s) of up to ", padded_len,
        " tokens ran out of host memory; each (sequence, layer) needs up to ",
        detail::layer_bytes_upper_bound(config_, padded_len), " bytes while it is stored"));
  }

  // Commit.
  for (std::size_t b = 0; b < slots.size(); ++b) {
    layer_state& state = sequences_[static_cast<std::size_t>(slots[b])].layers[static_cast<std::size_t>(layer)];
    state = new_states[b];
    entries[b].state = &state;
  }
  if (!q_last.empty()) {
    backend_->select_chunks(layer, entries, q_last);
    backend_->fetch_values(layer, entries);
    backend_->rebuild_keys(layer, entries);
  }
  backend_->finish_call();
}

void kv_store::decode(int layer, std::span<const int> slots, const tensor_view& q, const tensor_view& k_new,
                      const tensor_view& v_new, const mutable_tensor_view& out, const decode_options& options) {
  const std::lock_guard lock(*mutex_);
  check_layer(layer);
  check_batch_slots(slots);
  const auto batch = static_cast<std::int64_t>(slots.size());
  const device where = backend_->where();
  detail::expect_float_tensor(q, "q", where, {batch, config_.num_q_heads, config_.head_dim});
  detail::expect_float_tensor(k_new, "k_new", where, {batch, config_.num_kv_heads, config_.head_dim});
  detail::expect_float_tensor(v_new, "v_new", where, {batch, config_.num_kv_heads, config_.head_dim});
  detail::expect_float_tensor(out, "out", where, {batch, config_.num_q_heads, config_.head_dim});
  SHADOWKV_EXPECTS(!elements_may_overlap(out), "out ", out.describe(), " has elements that overlap (strides [",
                   out.strides[0], ", ", out.strides[1], ", ", out.strides[2], "], e.g. from expand()): each output "
                   "element needs its own memory; pass a tensor of distinct elements (e.g. torch.empty)");
  if (!options.positions.empty()) detail::expect_index_tensor(options.positions, "positions", where, {batch});
  for (const int slot : slots) {
    const layer_state& state = sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)];
    SHADOWKV_EXPECTS(state.prefilled, "decode before prefill: layer ", layer, " of slot ", slot,
                     " has no prompt yet");
    SHADOWKV_EXPECTS_CAPACITY(state.total_len() + 1 <= config_.max_seq_len, "slot ", slot, " layer ", layer,
                              " is full: it holds ", state.total_len(), " tokens and max_seq_len = ",
                              config_.max_seq_len);
  }
  backend_->use_stream(options.stream);
  decode_checked(layer, slots, q, k_new, v_new, out, options.positions, options.keys_post_rope);
}

void kv_store::fold_entries(int layer, std::span<const batch_entry> entries) {
  backend_->fold_oldest_generated_chunk(layer, entries);
  if (backend_->capturing()) return;
  for (const batch_entry& entry : entries) {
    layer_state& state = sequences_[static_cast<std::size_t>(entry.slot)].layers[static_cast<std::size_t>(layer)];
    // The CPU-side counters keep no ring (ring_head 0): the CUDA kernel keeps its own on the device.
    const rules::generated_region<std::int64_t> folded = rules::after_fold(
        rules::generated_region<std::int64_t>{state.context_chunks, state.generated_exact_len, 0},
        static_cast<std::int64_t>(config_.chunk_size), static_cast<std::int64_t>(config_.generation_window));
    state.context_chunks = folded.context_chunks;
    state.generated_exact_len = folded.exact_len;
    state.journal_chunks = std::min(state.journal_chunks + 1, config_.journal_chunks());
  }
  folds_ += static_cast<std::int64_t>(entries.size());
}

void kv_store::advance_block(int layer, std::span<const batch_entry> entries, std::int64_t tokens) {
  // `tokens` more per entry, folded as that many decode steps fold (docs/semantics.md, "Extend").
  for (const batch_entry& entry : entries) {
    layer_state& state = sequences_[static_cast<std::size_t>(entry.slot)].layers[static_cast<std::size_t>(layer)];
    const detail::generated_advance advance = detail::advance_generated(
        state.generated_exact_len, tokens, config_.generation_window, config_.chunk_size);
    state.generated_total += tokens;
    state.generated_exact_len = advance.generated_exact_len;
    state.context_chunks += advance.folds;
    state.journal_chunks = std::min(state.journal_chunks + advance.folds, config_.journal_chunks());
    folds_ += advance.folds;
  }
}

void kv_store::decode_checked(int layer, std::span<const int> slots, const tensor_view& q, const tensor_view& k_new,
                              const tensor_view& v_new, const mutable_tensor_view& out, const tensor_view& positions,
                              bool keys_post_rope) {
  std::vector<batch_entry> entries(slots.size());
  std::vector<batch_entry> folding;
  for (std::size_t b = 0; b < slots.size(); ++b) {
    const layer_state& state = sequences_[static_cast<std::size_t>(slots[b])].layers[static_cast<std::size_t>(layer)];
    entries[b] = {slots[b], static_cast<std::int64_t>(b), &state};
    if (rules::fold_due<std::int64_t>(state.generated_exact_len, config_.generation_window)) folding.push_back(entries[b]);
  }

  // While a CUDA graph is being captured nothing runs: the host counters stay as they are, and each replay is
  // accounted later (account_replayed_steps). Backends that capture keep their counters on the device.
  const bool recording = backend_->capturing();
  // Reject non-finite inputs where check_finite asks for it: "auto" checks them on backends whose check does not wait
  // for the device (a CUDA check would stop the host from running ahead of the GPU on every layer). While a graph is
  // recorded the inputs hold no step's data yet: each replay's are the caller's responsibility. Then allocate
  // everything the step needs before its first write.
  const bool check_inputs =
      config_.check_finite == finite_check::always ||
      (config_.check_finite == finite_check::automatic && !backend_->finite_check_waits());
  if (check_inputs && !recording) {
    expect_all_finite(*backend_, {{"q", &q, {}}, {"k_new", &k_new, {}}, {"v_new", &v_new, {}}}, slots);
  }
  backend_->reserve_decode(layer, entries);
  // 1. Fold the oldest generated chunk where the exact generated region is full.
  if (!folding.empty()) fold_entries(layer, folding);
  // 2. Append the new token.
  backend_->append_token(layer, entries, append_inputs{k_new, v_new, positions, keys_post_rope});
  if (!recording) {
    for (const int slot : slots) {
      layer_state& state = sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)];
      state.generated_total += 1;
      state.generated_exact_len += 1;
    }
  }
  // 3–6. Select, then fetch values and rebuild keys of the misses (concurrent on devices with two streams).
  const tensor_view queries = detail::insert_unit_dim(q);
  backend_->select_chunks(layer, entries, queries);
  backend_->fetch_values(layer, entries);
  backend_->rebuild_keys(layer, entries);
  // 7. Exact attention over the union.
  backend_->attend(layer, entries, q, out);
  backend_->finish_call();
  if (!recording) decode_steps_ += 1;
}

void kv_store::extend(int layer, std::span<const int> slots, const tensor_view& q, const tensor_view& k,
                      const tensor_view& v, const mutable_tensor_view& out, const extend_options& options) {
  const std::lock_guard lock(*mutex_);
  check_layer(layer);
  check_batch_slots(slots);
  const auto batch = static_cast<std::int64_t>(slots.size());
  const device where = backend_->where();
  detail::expect_float_tensor(q, "q", where, {batch, any_extent, config_.num_q_heads, config_.head_dim});
  const std::int64_t tokens = q.shape[1];
  SHADOWKV_EXPECTS(tokens >= 1, "extend needs at least one new token per sequence: q holds T = ", tokens,
                   " tokens (", q.describe(), ")");
  detail::expect_float_tensor(k, "k", where, {batch, tokens, config_.num_kv_heads, config_.head_dim});
  detail::expect_float_tensor(v, "v", where, {batch, tokens, config_.num_kv_heads, config_.head_dim});
  detail::expect_float_tensor(out, "out", where, {batch, tokens, config_.num_q_heads, config_.head_dim});
  SHADOWKV_EXPECTS(!elements_may_overlap(out), "out ", out.describe(), " has elements that overlap (strides [",
                   out.strides[0], ", ", out.strides[1], ", ", out.strides[2], ", ", out.strides[3],
                   "]): every output element needs its own memory; pass a tensor of distinct elements (e.g. torch.empty)");
  if (!options.positions.empty()) {
    detail::expect_index_tensor(options.positions, "positions", where, {batch, tokens});
  }
  SHADOWKV_EXPECTS(options.lengths.empty() || static_cast<std::int64_t>(options.lengths.size()) == batch,
                   "lengths must have one entry per sequence (", batch, "), got ", options.lengths.size());
  std::vector<std::int64_t> lengths(slots.size(), tokens);
  for (std::size_t b = 0; b < slots.size(); ++b) {
    const int slot = slots[b];
    if (!options.lengths.empty()) {
      lengths[b] = options.lengths[b];
      SHADOWKV_EXPECTS(lengths[b] >= 1 && lengths[b] <= tokens, "lengths[", b, "] = ", lengths[b],
                       " must be in [1, T = ", tokens, "] (q, k and v hold T tokens per sequence)");
    }
    const layer_state& state = sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)];
    SHADOWKV_EXPECTS(state.prefilled, "extend before prefill: layer ", layer, " of slot ", slot,
                     " has no prompt yet");
    // Written so that no sum can overflow: total_len <= max_seq_len always holds.
    SHADOWKV_EXPECTS_CAPACITY(lengths[b] <= config_.max_seq_len - state.total_len(), "slot ", slot, " layer ", layer,
                              " holds ", state.total_len(), " tokens: ", lengths[b],
                              " more would exceed max_seq_len = ", config_.max_seq_len);
  }
  backend_->use_stream(options.stream);
  SHADOWKV_EXPECTS(!backend_->capturing(), "extend cannot be captured in a CUDA graph (decode can)");
  const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  if (longest == 1) {
    // One token per sequence: decode, bit for bit (docs/semantics.md, "Extend").
    const tensor_view positions =
        options.positions.empty() ? tensor_view{} : detail::select_token(options.positions, 0);
    decode_checked(layer, slots, detail::select_token(q, 0), detail::select_token(k, 0), detail::select_token(v, 0),
                   detail::select_token(out, 0), positions, options.keys_post_rope);
    return;
  }
  SHADOWKV_EXPECTS(backend_->supports_extend(), "extend of more than one token per sequence is not implemented on the ",
                   to_string(where), " backend yet (T = ", longest, "); call decode once per token");
  const bool check_inputs = config_.check_finite == finite_check::always ||
                            (config_.check_finite == finite_check::automatic && !backend_->finite_check_waits());
  if (check_inputs) {
    expect_all_finite(*backend_, {{"q", &q, lengths}, {"k", &k, lengths}, {"v", &v, lengths}}, slots);
  }

  // States before the call, to put back if a block fails (only out of memory can: the input is valid).
  std::vector<layer_state> before(slots.size());
  std::vector<batch_entry> all(slots.size());
  for (std::size_t b = 0; b < slots.size(); ++b) {
    layer_state& state = sequences_[static_cast<std::size_t>(slots[b])].layers[static_cast<std::size_t>(layer)];
    before[b] = state;
    all[b] = {slots[b], static_cast<std::int64_t>(b), &state};
  }
  backend_->reserve_extend(layer, all, lengths);
  const std::int64_t block = config_.extend_block;
  std::int64_t blocks_run = 0;
  try {
    for (std::int64_t start = 0; start < longest; start += block) {
      // The sequences with tokens in this block, grouped by the block's size (the last block of a sequence may be
      // shorter): one backend call per size.
      std::vector<std::int64_t> sizes;
      for (std::size_t b = 0; b < slots.size(); ++b) {
        if (lengths[b] > start) sizes.push_back(std::min(block, lengths[b] - start));
      }
      std::sort(sizes.begin(), sizes.end());
      sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
      for (const std::int64_t size : sizes) {
        // One backend call per run of consecutive rows of this size, with the tensors cut to those rows: entry i of
        // a call is row i of its tensors, as in decode.
        std::vector<batch_entry> entries;
        for (std::size_t b = 0; b <= slots.size(); ++b) {
          const bool member = b < slots.size() && lengths[b] > start && std::min(block, lengths[b] - start) == size;
          if (member) {
            entries.push_back({all[b].slot, static_cast<std::int64_t>(entries.size()), all[b].state});
            continue;
          }
          if (entries.empty()) continue;
          const auto first = static_cast<std::int64_t>(b - entries.size());
          const auto count = static_cast<std::int64_t>(entries.size());
          const block_inputs inputs{
              detail::narrow_rows(detail::narrow_tokens(q, start, size), first, count),
              detail::narrow_rows(detail::narrow_tokens(k, start, size), first, count),
              detail::narrow_rows(detail::narrow_tokens(v, start, size), first, count),
              options.positions.empty()
                  ? tensor_view{}
                  : detail::narrow_rows(detail::narrow_tokens(options.positions, start, size), first, count),
              options.keys_post_rope};
          backend_->extend_block(layer, entries, inputs,
                                 detail::narrow_rows(detail::narrow_tokens(out, start, size), first, count));
          advance_block(layer, entries, size);
          entries.clear();
        }
      }
      ++blocks_run;
    }

  } catch (...) {
    // Out of memory inside a block (which undid itself): undo the call's earlier blocks too (the backend kept the
    // fold journal's rows of every fold of the call, reserve_extend).
    std::vector<batch_entry> changed;
    std::vector<layer_state> targets;
    for (std::size_t b = 0; b < slots.size(); ++b) {
      if (all[b].state->generated_total == before[b].generated_total) continue;
      changed.push_back(all[b]);
      targets.push_back(before[b]);
    }
    try {
      if (!changed.empty()) {
        backend_->reserve_truncate(layer, changed, targets);
        backend_->truncate_generated(layer, changed, targets);
        for (std::size_t i = 0; i < changed.size(); ++i) {
          layer_state& state =
              sequences_[static_cast<std::size_t>(changed[i].slot)].layers[static_cast<std::size_t>(layer)];
          folds_ -= state.context_chunks - targets[i].context_chunks;
          state = targets[i];
        }
      }
    } catch (...) {
      // Nothing more can be done: the sequences keep the blocks that ran (their counters match their data).
    }
    backend_->end_extend(layer, all);
    backend_->finish_call();
    throw;
  }
  backend_->end_extend(layer, all);
  backend_->finish_call();
  decode_steps_ += blocks_run;
}

void kv_store::truncate(std::span<const int> slots, std::span<const std::int64_t> tokens) {
  const std::lock_guard lock(*mutex_);
  check_batch_slots(slots);
  SHADOWKV_EXPECTS(tokens.size() == slots.size(), "tokens must have one entry per slot (", slots.size(), "), got ",
                   tokens.size());
  const auto window = static_cast<std::int64_t>(config_.generation_window);
  const auto chunk = static_cast<std::int64_t>(config_.chunk_size);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    SHADOWKV_EXPECTS(tokens[i] >= 0, "truncate: tokens[", i, "] = ", tokens[i], " must be >= 0");
    if (tokens[i] == 0) continue;
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      const layer_state& state =
          sequences_[static_cast<std::size_t>(slots[i])].layers[static_cast<std::size_t>(layer)];
      SHADOWKV_EXPECTS(state.prefilled, "truncate: layer ", layer, " of slot ", slots[i],
                       " has no prompt yet, so it holds no tokens to remove");
      SHADOWKV_EXPECTS(tokens[i] <= state.generated_total, "truncate: cannot remove ", tokens[i],
                       " tokens from slot ", slots[i], ": layer ", layer, " holds ", state.generated_total,
                       " tokens after its prompt (the prompt cannot be truncated)");
    }
  }
  SHADOWKV_EXPECTS(backend_->supports_truncate(), "truncate is not implemented on the ", to_string(backend_->where()),
                   " backend yet");
  // The fold journal holds the exact rows of the newest state.journal_chunks folded chunks: a truncate may undo that many.
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (tokens[i] == 0) continue;
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      const layer_state& state =
          sequences_[static_cast<std::size_t>(slots[i])].layers[static_cast<std::size_t>(layer)];
      const std::int64_t folds_now = state.context_chunks - state.prompt_context_chunks;
      const auto undone = [&](std::int64_t removed) {
        return folds_now - detail::advance_generated(0, state.generated_total - removed, window, chunk).folds;
      };
      if (undone(tokens[i]) <= state.journal_chunks) continue;
      std::int64_t most = 0;  // the most tokens that can be removed now
      while (most < state.generated_total && undone(most + 1) <= state.journal_chunks) ++most;
      throw invalid_argument(detail::format_message(
          "truncate: cannot remove ", tokens[i], " tokens from slot ", slots[i], ": that would undo ",
          undone(tokens[i]), " folds of layer ", layer, ", and its fold journal holds the exact tokens of the last ",
          state.journal_chunks, " folded chunks (at most generation_window / chunk_size = ", config_.journal_chunks(),
          "); at most ", most, " tokens can be removed now"));
    }
  }
  // Every layer's targets first, then the backend's allocations for all of them, then the writes: running out of
  // memory leaves every layer as it was.
  std::vector<std::vector<batch_entry>> entries(static_cast<std::size_t>(config_.num_layers));
  std::vector<std::vector<layer_state>> targets(static_cast<std::size_t>(config_.num_layers));
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (tokens[i] == 0) continue;
      const layer_state& state =
          sequences_[static_cast<std::size_t>(slots[i])].layers[static_cast<std::size_t>(layer)];
      layer_state target = state;
      target.generated_total = state.generated_total - tokens[i];
      // The fold rule depends on the generated length only (decode and extend alike).
      const detail::generated_advance from_prompt =
          detail::advance_generated(0, target.generated_total, window, chunk);
      target.generated_exact_len = from_prompt.generated_exact_len;
      target.context_chunks = state.prompt_context_chunks + from_prompt.folds;
      target.journal_chunks = state.journal_chunks - (state.context_chunks - target.context_chunks);
      entries[static_cast<std::size_t>(layer)].push_back({slots[i], static_cast<std::int64_t>(i), &state});
      targets[static_cast<std::size_t>(layer)].push_back(target);
    }
  }
  backend_->use_stream(std::nullopt);  // no caller stream: the backend's own, and the call completes before it returns
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const auto l = static_cast<std::size_t>(layer);
    if (!entries[l].empty()) backend_->reserve_truncate(layer, entries[l], targets[l]);
  }
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const auto l = static_cast<std::size_t>(layer);
    if (entries[l].empty()) continue;
    backend_->truncate_generated(layer, entries[l], targets[l]);
    for (std::size_t i = 0; i < entries[l].size(); ++i) {
      sequences_[static_cast<std::size_t>(entries[l][i].slot)].layers[l] = targets[l][i];
    }
  }
  backend_->finish_call();
}

void kv_store::account_replayed_steps(int layer, std::span<const int> slots, std::int64_t steps) {
  const std::lock_guard lock(*mutex_);
  // On a backend without graph replay every step ran through decode(): advancing the counters alone would make
  // them describe tokens that were never stored (and later steps read past the stored arrays).
  SHADOWKV_EXPECTS(backend_->supports_replay(), "account_replayed_steps: the ", to_string(backend_->where()),
                   " backend cannot capture or replay decode steps (no step ran without the store seeing it)");
  check_layer(layer);
  check_batch_slots(slots);
  SHADOWKV_EXPECTS(steps >= 0, "steps must be >= 0, got ", steps);
  for (const int slot : slots) {
    const layer_state& state = sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)];
    SHADOWKV_EXPECTS(state.prefilled, "layer ", layer, " of slot ", slot, " has no prompt yet");
    // Written so that no sum can overflow: total_len <= max_seq_len always holds.
    SHADOWKV_EXPECTS_CAPACITY(steps <= config_.max_seq_len - state.total_len(), "slot ", slot, " layer ", layer,
                              " holds ", state.total_len(), " tokens: ", steps,
                              " more steps would exceed max_seq_len = ", config_.max_seq_len);
  }
  for (const int slot : slots) {
    layer_state& state = sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)];
    const detail::generated_advance advance =
        detail::advance_generated(state.generated_exact_len, steps, config_.generation_window, config_.chunk_size);
    state.context_chunks += advance.folds;
    state.journal_chunks = std::min(state.journal_chunks + advance.folds, config_.journal_chunks());
    state.generated_exact_len = advance.generated_exact_len;
    state.generated_total += steps;
    folds_ += advance.folds;
  }
  decode_steps_ += steps;
}

// A layer not prefilled yet has no chunks: empty lists per KV head, the same on every backend (the CUDA backend's
// arrays of such a layer hold whatever an earlier sequence or a failed prefill left).
chunk_ids_per_head kv_store::selected_chunks(int layer, int slot) const {
  const std::lock_guard lock(*mutex_);
  check_layer(layer);
  check_slot(slot);
  if (!layer_prefilled(layer, slot)) return chunk_ids_per_head(static_cast<std::size_t>(config_.num_kv_heads));
  return backend_->selected_chunks(layer, slot);
}

chunk_ids_per_head kv_store::outlier_chunks(int layer, int slot) const {
  const std::lock_guard lock(*mutex_);
  check_layer(layer);
  check_slot(slot);
  if (!layer_prefilled(layer, slot)) return chunk_ids_per_head(static_cast<std::size_t>(config_.num_kv_heads));
  return backend_->outlier_chunks(layer, slot);
}

chunk_ids_per_head kv_store::attended_chunks(int layer, int slot) const {
  const std::lock_guard lock(*mutex_);
  check_layer(layer);
  check_slot(slot);
  if (!layer_prefilled(layer, slot)) return chunk_ids_per_head(static_cast<std::size_t>(config_.num_kv_heads));
  chunk_ids_per_head result = backend_->outlier_chunks(layer, slot);
  const chunk_ids_per_head selected = backend_->selected_chunks(layer, slot);
  for (std::size_t h = 0; h < result.size() && h < selected.size(); ++h) {
    std::vector<std::int64_t>& ids = result[h];
    ids.insert(ids.end(), selected[h].begin(), selected[h].end());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }
  return result;
}

sequence_info kv_store::info(int layer, int slot) const {
  const std::lock_guard lock(*mutex_);
  check_layer(layer);
  check_slot(slot);
  const layer_state& state = sequences_[static_cast<std::size_t>(slot)].layers[static_cast<std::size_t>(layer)];
  sequence_info result;
  result.prefilled = state.prefilled;
  result.prompt_len = state.prompt_len;
  result.total_len = state.total_len();
  result.context_chunks = state.context_chunks;
  result.outlier_chunks = state.outlier_chunks;
  result.local_len = state.local_len;
  result.generated_exact_len = state.generated_exact_len;
  result.last_position = state.prefilled ? backend_->last_position(layer, slot) : -1;
  const sequence& seq = sequences_[static_cast<std::size_t>(slot)];
  result.values_on = seq.values_on;
  for (int other = 0; other < config_.max_batch && seq.family != 0; ++other) {
    const sequence& candidate = sequences_[static_cast<std::size_t>(other)];
    if (other != slot && candidate.active && candidate.family == seq.family) result.shares_prompt_with.push_back(other);
  }
  return result;
}

memory_report kv_store::memory() const {
  const std::lock_guard lock(*mutex_);
  std::vector<stored_layer> prefilled;
  for (int slot = 0; slot < config_.max_batch; ++slot) {
    const sequence& seq = sequences_[static_cast<std::size_t>(slot)];
    if (!seq.active) continue;
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      const layer_state& state = seq.layers[static_cast<std::size_t>(layer)];
      if (state.prefilled) prefilled.push_back({slot, layer, &state});
    }
  }
  return backend_->memory(prefilled);
}

memory_report kv_store::layer_memory_after_prefill(std::int64_t prompt_tokens) const {
  SHADOWKV_EXPECTS(prompt_tokens >= 1 && prompt_tokens <= config_.max_seq_len, "prompt_tokens must be in [1, "
                   "max_seq_len = ", config_.max_seq_len, "], got ", prompt_tokens);
  const config& c = config_;
  const std::int64_t chunk = c.chunk_size;
  const std::int64_t width = c.kv_width();
  const std::int64_t heads = c.num_kv_heads;
  const auto e = static_cast<std::int64_t>(dtype_size(c.kv_dtype));
  const auto f = static_cast<std::int64_t>(dtype_size(c.factor_dtype()));
  // The prefill's counters (as prefill() sets them) and the byte counts of docs/semantics.md, "Memory report".
  const std::int64_t context_chunks = std::max<std::int64_t>(0, prompt_tokens / chunk - c.local_chunks);
  const std::int64_t outliers = std::min<std::int64_t>(c.outlier_chunks, context_chunks);
  const std::int64_t local_len = prompt_tokens - context_chunks * chunk;
  memory_report report;
  report.low_rank_factors = (context_chunks * chunk * c.rank + static_cast<std::int64_t>(c.rank) * width) * f;
  report.landmarks = c.chunk_score == chunk_score_rule::two_centroids ? context_chunks * heads * (2 * c.head_dim + 9)
                                                                      : context_chunks * width * e;
  report.outliers = outliers * chunk * width * 2 * e;
  report.exact_tokens = local_len * width * 2 * e;
  report.value_store = context_chunks * heads * c.value_run_bytes();
  report.value_store_host = report.value_store;
  report.selection_cache = c.cache_slots() * chunk * width * 2 * e;
  report.full_attention_equivalent = prompt_tokens * width * 2 * e;
  return report;
}

store_stats kv_store::stats() const {
  const std::lock_guard lock(*mutex_);
  store_stats result = backend_->selection_stats();
  result.decode_steps = decode_steps_;
  result.folds = folds_;
  return result;
}

void kv_store::reset_stats() noexcept {
  const std::lock_guard lock(*mutex_);
  backend_->reset_selection_stats();
  decode_steps_ = 0;
  folds_ = 0;
}

}  // namespace shadowkv
