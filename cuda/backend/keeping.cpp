// Fork, park and save on the CUDA backend (docs/semantics.md, "Fork, park and save").
//
// A slot's arenas (every layer's factors, landmarks, outliers, exact region, journal and selection cache) are one
// contiguous block reserved when the store is built, and its layer views hold the counters the device advances. So
// a sequence's whole device state is that block and its views' counters; its value store is a separate allocation.
//   fork:   the source's block is copied into each child's (the child's slot has it reserved anyway: sharing it would
//           free no byte), the counters are copied, and the value store's prompt runs are shared by reference: the
//           child reads chunks below layer_view::shared_value_chunks from the family's value store and keeps its own
//           chunks in a value store of its own, sized for what it can append.
//   park:   the block and the views go to pinned host memory; a value store in host memory stays where it is (held by
//           the parked state), one in device memory that no other sequence reads is copied to pinned memory and freed.
//   save:   the block, the counters and the values of every context chunk (shared ones included), as sections.
// Every call waits for the device first (no stream of an earlier call may still touch the slots).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend_support.hpp"
#include "cuda_backend.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {

using backend_support::device_guard;

namespace {

/// The counters of a layer view (everything of it that is not a pointer), as saved: int64 each, in this order.
constexpr std::size_t kViewCounters = 9;
std::array<std::int64_t, kViewCounters> counters_of(const layer_view& v) {
  return {v.prompt_len, v.context_chunks, v.outlier_chunks, v.local_len,    v.generated_exact_len,
          v.ring_head,  v.last_position,  v.journal_head,   v.journal_count};
}
void set_counters(layer_view& v, const std::array<std::int64_t, kViewCounters>& c) {
  v.prompt_len = static_cast<int>(c[0]);
  v.context_chunks = static_cast<int>(c[1]);
  v.outlier_chunks = static_cast<int>(c[2]);
  v.local_len = static_cast<int>(c[3]);
  v.generated_exact_len = static_cast<int>(c[4]);
  v.ring_head = static_cast<int>(c[5]);
  v.last_position = c[6];
  v.journal_head = static_cast<int>(c[7]);
  v.journal_count = static_cast<int>(c[8]);
}

/// A parked sequence: its arenas and views in pinned host memory, its value stores held (or copied out of the device).
class cuda_parked_state final : public parked_state {
 public:
  host_buffer arena;                       ///< the slot's arena block
  std::vector<layer_view> views;           ///< as the device had them (counters; value pointers into `own`)
  std::shared_ptr<void> own;               ///< the own value store (a cuda_backend::value_allocation), kept
  std::shared_ptr<void> prompt;            ///< the shared prompt's value store, kept (fork families)
  host_buffer own_copy;                    ///< a device value store's bytes, when it was copied out and freed
  const std::uint8_t* own_base = nullptr;  ///< where the own value store was when the views were read
  value_place values_on = value_place::host;

  std::size_t own_host_bytes = 0;     ///< pinned bytes of `own` (a host value store), 0 for a device one
  std::size_t prompt_host_bytes = 0;  ///< pinned bytes of `prompt`, likewise

  /// What destroying it frees: its copies, and the value stores only it still holds.
  [[nodiscard]] std::int64_t host_bytes() const noexcept override {
    std::size_t bytes = arena.size() + own_copy.size();
    if (own != nullptr && own.use_count() == 1) bytes += own_host_bytes;
    if (prompt != nullptr && prompt.use_count() == 1) bytes += prompt_host_bytes;
    return static_cast<std::int64_t>(bytes);
  }
};

}  // namespace

std::vector<layer_view> cuda_backend::read_views(int slot) const {
  std::vector<layer_view> views(static_cast<std::size_t>(config_.num_layers));
  read_back(views.data(), device_view(slot, 0), views.size() * sizeof(layer_view));
  return views;
}

void cuda_backend::install_views(int slot, std::span<const layer_view> views, std::shared_ptr<value_allocation> own,
                                 std::shared_ptr<value_allocation> prompt, value_place values_on) {
  std::vector<layer_view> installed(views.begin(), views.end());
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    // The slot's own arena pointers; counters and value pointers as given.
    layer_view view = host_view(slot, layer);
    const layer_view& given = views[static_cast<std::size_t>(layer)];
    set_counters(view, counters_of(given));
    view.value_store = given.value_store;
    view.value_scales = given.value_scales;
    view.shared_value_store = given.shared_value_store;
    view.shared_value_scales = given.shared_value_scales;
    view.shared_value_chunks = given.shared_value_chunks;
    installed[static_cast<std::size_t>(layer)] = view;
  }
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(device_view(slot, 0), installed.data(), installed.size() * sizeof(layer_view),
                                    cudaMemcpyHostToDevice, own_stream_));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
  std::copy(installed.begin(), installed.end(),
            host_views_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(slot) * config_.num_layers));
  values_[static_cast<std::size_t>(slot)] = std::move(own);
  prompt_values_[static_cast<std::size_t>(slot)] = std::move(prompt);
  values_on_[static_cast<std::size_t>(slot)] = values_on;
}

void cuda_backend::fork_sequence(int source, std::span<const int> children, std::span<const layer_state> layers) {
  device_guard guard(device_);
  SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
  const std::vector<layer_view> source_views = read_views(source);
  const value_place where = values_on_[static_cast<std::size_t>(source)];
  // Each layer's shared chunks (the prompt's context chunks) and the chunks a child may append after them.
  std::vector<int> shared(static_cast<std::size_t>(config_.num_layers));
  std::vector<int> own(static_cast<std::size_t>(config_.num_layers));
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    shared[static_cast<std::size_t>(layer)] =
        static_cast<int>(layers[static_cast<std::size_t>(layer)].prompt_context_chunks);
    own[static_cast<std::size_t>(layer)] = dims_.max_chunks - shared[static_cast<std::size_t>(layer)];
  }
  // Everything allocated before anything is written: a child that cannot get its value store changes nothing.
  std::vector<std::shared_ptr<value_allocation>> allocations;
  allocations.reserve(children.size());
  for (std::size_t i = 0; i < children.size(); ++i) allocations.push_back(allocate_values(where, own));
  const std::shared_ptr<value_allocation>& family = prompt_values_[static_cast<std::size_t>(source)] != nullptr
                                                        ? prompt_values_[static_cast<std::size_t>(source)]
                                                        : values_[static_cast<std::size_t>(source)];
  const auto* source_block = static_cast<const std::uint8_t*>(host_view(source, 0).basis);
  for (std::size_t i = 0; i < children.size(); ++i) {
    const int child = children[i];
    SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_view(child, 0).basis, source_block, arena_slot_bytes_,
                                      cudaMemcpyDeviceToDevice, own_stream_));
    std::vector<layer_view> views = source_views;
    std::uint8_t* cursor = allocations[i]->base();
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      const auto l = static_cast<std::size_t>(layer);
      layer_view& view = views[l];
      const layer_view& from = source_views[l];
      // The prompt's runs: where the source reads them (its family's store, or its own store at chunk ids).
      view.shared_value_store = from.shared_value_chunks > 0 ? from.shared_value_store : from.value_store;
      view.shared_value_scales = from.shared_value_chunks > 0 ? from.shared_value_scales : from.value_scales;
      view.shared_value_chunks = shared[l];
      view.value_store = cursor;
      view.value_scales =
          dims_.value_fp8 != 0 ? reinterpret_cast<float*>(cursor + value_scales_offset(own[l])) : nullptr;
      // The source's own chunks (folded generated tokens) are copied.
      const int appended = from.context_chunks - shared[l];
      if (appended > 0) {
        const value_runs runs = value_runs_of(from, shared[l]);
        const std::size_t run_elements = static_cast<std::size_t>(config_.chunk_size) * config_.head_dim;
        const std::size_t code_bytes = dims_.value_fp8 != 0 ? 1 : dtype_size(config_.kv_dtype);
        const std::size_t per_chunk = static_cast<std::size_t>(config_.num_kv_heads) * run_elements * code_bytes;
        SHADOWKV_CUDA_TRY(cudaMemcpyAsync(view.value_store,
                                          static_cast<const std::uint8_t*>(runs.store) + runs.chunk * per_chunk,
                                          per_chunk * appended, cudaMemcpyDefault, own_stream_));
        if (dims_.value_fp8 != 0) {
          SHADOWKV_CUDA_TRY(cudaMemcpyAsync(view.value_scales, runs.scales + runs.chunk * config_.num_kv_heads,
                                            sizeof(float) * config_.num_kv_heads * appended, cudaMemcpyDefault,
                                            own_stream_));
        }
      }
      cursor += value_runs_bytes(own[l]);
    }
    install_views(child, views, allocations[i], family, where);
  }
}

std::unique_ptr<parked_state> cuda_backend::park_sequence(int slot, std::span<const layer_state> /*layers*/) {
  device_guard guard(device_);
  SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
  auto parked = std::make_unique<cuda_parked_state>();
  parked->views = read_views(slot);
  parked->values_on = values_on_[static_cast<std::size_t>(slot)];
  parked->arena = host_buffer(arena_slot_bytes_, resources_->host_memory());
  const std::shared_ptr<value_allocation>& own = values_[static_cast<std::size_t>(slot)];
  parked->own_base = own->base();
  // A device value store that no other sequence reads (no child shares its prompt runs) leaves the device.
  const bool copy_out = own->device.data() != nullptr && own.use_count() == 1;
  if (copy_out) parked->own_copy = host_buffer(own->device.size(), resources_->host_memory());
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(parked->arena.data(), host_view(slot, 0).basis, arena_slot_bytes_,
                                    cudaMemcpyDeviceToHost, own_stream_));
  if (copy_out) {
    SHADOWKV_CUDA_TRY(cudaMemcpyAsync(parked->own_copy.data(), own->device.data(), own->device.size(),
                                      cudaMemcpyDeviceToHost, own_stream_));
  } else {
    parked->own = own;
    parked->own_host_bytes = own->host.size();
  }
  parked->prompt = prompt_values_[static_cast<std::size_t>(slot)];
  if (parked->prompt != nullptr) parked->prompt_host_bytes = prompt_values_[static_cast<std::size_t>(slot)]->host.size();
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
  return parked;
}

void cuda_backend::resume_sequence(int slot, parked_state& state, std::span<const layer_state> /*layers*/) {
  device_guard guard(device_);
  auto& parked = dynamic_cast<cuda_parked_state&>(state);
  std::shared_ptr<value_allocation> own = std::static_pointer_cast<value_allocation>(parked.own);
  std::vector<layer_view> views = parked.views;
  if (own == nullptr) {
    // The device value store was copied out: back into a new one (may throw out_of_memory: nothing changed).
    own = std::make_shared<value_allocation>();
    own->device = device_buffer(parked.own_copy.size(), own_stream_, resources_->device_memory());
    SHADOWKV_CUDA_TRY(cudaMemcpyAsync(own->device.data(), parked.own_copy.data(), parked.own_copy.size(),
                                      cudaMemcpyHostToDevice, own_stream_));
    const std::ptrdiff_t moved = own->base() - parked.own_base;
    for (layer_view& view : views) {
      view.value_store = static_cast<std::uint8_t*>(view.value_store) + moved;
      if (view.value_scales != nullptr) {
        view.value_scales = reinterpret_cast<float*>(reinterpret_cast<std::uint8_t*>(view.value_scales) + moved);
      }
    }
  }
  SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_view(slot, 0).basis, parked.arena.data(), arena_slot_bytes_,
                                    cudaMemcpyHostToDevice, own_stream_));
  install_views(slot, views, std::move(own), std::static_pointer_cast<value_allocation>(parked.prompt),
                parked.values_on);
  // `parked` keeps its copies until the store destroys it (after the whole resume call succeeded) or undoes this
  // resume (unresume_sequence).
}

void cuda_backend::unpark_sequence(int /*slot*/, parked_state& /*parked*/) noexcept {
  // park_sequence copied the state out and left the slot as it was: nothing to put back.
}

void cuda_backend::unresume_sequence(int slot, parked_state& /*parked*/) noexcept {
  // resume_sequence copied into the slot and left `parked` whole: closing the slot undoes it.
  close_sequence(slot);
}

// The saved state: the arena block, then per layer its view's counters and the value runs of its context chunks (the
// device's count: one more than the host's when the device folded a full ring at the end of the last step; sized for
// that one, zeros when it is not there).
std::vector<state_section> cuda_backend::state_sections(std::span<const layer_state> layers) const {
  std::vector<state_section> sections;
  sections.push_back({"arenas", static_cast<std::int64_t>(arena_slot_bytes_)});
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const layer_state& state = layers[static_cast<std::size_t>(layer)];
    const int chunks = static_cast<int>(std::min<std::int64_t>(dims_.max_chunks, state.context_chunks + 1));
    const std::string prefix = "layer" + std::to_string(layer) + ".";
    sections.push_back({prefix + "counters", static_cast<std::int64_t>(kViewCounters * sizeof(std::int64_t))});
    sections.push_back({prefix + "values", static_cast<std::int64_t>(value_runs_bytes(chunks))});
  }
  return sections;
}

void cuda_backend::write_state(int slot, std::span<const layer_state> layers, const state_sink& sink) const {
  device_guard guard(device_);
  SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
  const std::vector<layer_view> views = read_views(slot);
  // A pinned bounce buffer: the arena block and each layer's values go through it in pieces.
  constexpr std::size_t kPiece = std::size_t{64} << 20;
  host_buffer bounce(kPiece, resources_->host_memory());
  auto copy_out = [&](std::size_t section, const std::uint8_t* from, std::size_t bytes) {
    for (std::size_t done = 0; done < bytes; done += kPiece) {
      const std::size_t piece = std::min(kPiece, bytes - done);
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(bounce.data(), from + done, piece, cudaMemcpyDefault, own_stream_));
      SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
      sink(section, std::span<const std::byte>(static_cast<const std::byte*>(bounce.data()), piece));
    }
  };
  const std::vector<state_section> sections = state_sections(layers);
  copy_out(0, static_cast<const std::uint8_t*>(host_view(slot, 0).basis), arena_slot_bytes_);
  const std::size_t run_elements = static_cast<std::size_t>(config_.chunk_size) * config_.head_dim;
  const std::size_t per_chunk = static_cast<std::size_t>(config_.num_kv_heads) * run_elements *
                                (dims_.value_fp8 != 0 ? 1 : dtype_size(config_.kv_dtype));
  const std::vector<std::byte> zeros(per_chunk);
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const auto l = static_cast<std::size_t>(layer);
    const layer_view& view = views[l];
    const std::size_t counters_section = 1 + 2 * l;
    const auto counters = counters_of(view);
    sink(counters_section, std::as_bytes(std::span(counters)));
    const std::size_t values_section = counters_section + 1;
    const int chunks = static_cast<int>(std::min<std::int64_t>(dims_.max_chunks, layers[l].context_chunks + 1));
    // Codes (or values) of chunks [0, chunks): the device's chunks from wherever they are, zeros past them.
    auto runs_of = [&](int first, int count, bool scales) {
      int chunk = first;
      while (chunk < first + count) {
        const value_runs runs = value_runs_of(view, chunk);
        // Chunks that lie together: up to the shared/own boundary.
        const int end =
            chunk < view.shared_value_chunks ? std::min(first + count, view.shared_value_chunks) : first + count;
        if (scales) {
          copy_out(values_section,
                   reinterpret_cast<const std::uint8_t*>(runs.scales + runs.chunk * config_.num_kv_heads),
                   sizeof(float) * config_.num_kv_heads * static_cast<std::size_t>(end - chunk));
        } else {
          copy_out(values_section, static_cast<const std::uint8_t*>(runs.store) + runs.chunk * per_chunk,
                   per_chunk * static_cast<std::size_t>(end - chunk));
        }
        chunk = end;
      }
    };
    const int present = std::min(chunks, view.context_chunks);
    runs_of(0, present, false);
    for (int c = present; c < chunks; ++c) sink(values_section, zeros);
    std::size_t written = per_chunk * static_cast<std::size_t>(chunks);
    if (dims_.value_fp8 != 0) {
      const std::size_t padding = value_scales_offset(chunks) - written;
      const std::vector<std::byte> pad(padding);
      if (padding > 0) sink(values_section, pad);
      runs_of(0, present, true);
      const std::vector<std::byte> zero_scales(sizeof(float) * config_.num_kv_heads *
                                               static_cast<std::size_t>(chunks - present));
      if (!zero_scales.empty()) sink(values_section, zero_scales);
      written = value_scales_offset(chunks) + sizeof(float) * config_.num_kv_heads * static_cast<std::size_t>(chunks);
    }
    const std::size_t total = value_runs_bytes(chunks);
    if (total > written) {
      const std::vector<std::byte> tail(total - written);
      sink(values_section, tail);
    }
  }
}

void cuda_backend::read_state(int slot, value_place values_on, std::span<const layer_state> layers,
                              std::span<const std::span<const std::byte>> sections) {
  device_guard guard(device_);
  // Check the device counters against the host's before anything is allocated.
  std::vector<std::array<std::int64_t, kViewCounters>> counters(static_cast<std::size_t>(config_.num_layers));
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const auto l = static_cast<std::size_t>(layer);
    const std::span<const std::byte> section = sections[1 + 2 * l];
    std::memcpy(counters[l].data(), section.data(), sizeof(std::int64_t) * kViewCounters);
    const layer_state& state = layers[l];
    const auto& c = counters[l];
    const bool folded_at_step_end = c[1] == state.context_chunks + 1;
    if (c[0] != state.prompt_len || (c[1] != state.context_chunks && !folded_at_step_end) || c[1] > dims_.max_chunks ||
        c[2] != state.outlier_chunks || c[3] != state.local_len || c[4] < 0 || c[4] > dims_.window || c[5] < 0 ||
        c[5] >= std::max(1, dims_.window) || c[7] < 0 || c[8] < 0 || c[8] > dims_.journal_chunks) {
      throw invalid_argument(shadowkv::detail::format_message("the saved device counters of layer ", layer,
                                                              " do not match the file's sequence counters"));
    }
  }
  std::shared_ptr<value_allocation> own = allocate_values(values_on);
  SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
  SHADOWKV_CUDA_TRY(cudaMemcpyAsync(host_view(slot, 0).basis, sections[0].data(), arena_slot_bytes_,
                                    cudaMemcpyHostToDevice, own_stream_));
  std::vector<layer_view> views(static_cast<std::size_t>(config_.num_layers));
  const std::size_t run_elements = static_cast<std::size_t>(config_.chunk_size) * config_.head_dim;
  const std::size_t per_chunk = static_cast<std::size_t>(config_.num_kv_heads) * run_elements *
                                (dims_.value_fp8 != 0 ? 1 : dtype_size(config_.kv_dtype));
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const auto l = static_cast<std::size_t>(layer);
    layer_view& view = views[l];
    set_counters(view, counters[l]);
    std::uint8_t* base = own->base() + l * value_layer_bytes_;
    view.value_store = base;
    view.value_scales = dims_.value_fp8 != 0 ? reinterpret_cast<float*>(base + value_codes_bytes_) : nullptr;
    const std::span<const std::byte> values = sections[2 + 2 * l];
    const auto chunks = static_cast<int>(std::min<std::int64_t>(dims_.max_chunks, layers[l].context_chunks + 1));
    SHADOWKV_CUDA_TRY(cudaMemcpyAsync(base, values.data(), per_chunk * static_cast<std::size_t>(chunks),
                                      cudaMemcpyDefault, own_stream_));
    if (dims_.value_fp8 != 0) {
      SHADOWKV_CUDA_TRY(cudaMemcpyAsync(view.value_scales, values.data() + value_scales_offset(chunks),
                                        sizeof(float) * config_.num_kv_heads * static_cast<std::size_t>(chunks),
                                        cudaMemcpyDefault, own_stream_));
    }
  }
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(own_stream_));
  install_views(slot, views, std::move(own), nullptr, values_on);
}

}  // namespace shadowkv::cuda
