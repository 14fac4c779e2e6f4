// Park and save on the CPU backend (docs/semantics.md, "Fork, park and save";
// the file: docs/api.md, "Saved sequences").
//
// park moves a slot's layers (std::vector<cpu_layer_data>) out whole into the
// parked object: no array is copied, and after the object's allocation nothing
// can fail. A saved sequence is each layer's arrays, their valid parts only (as
// the counters give them), one section per array. The arrays are named in one
// place, layer_fields(): a change of cpu_layer_data's members (e.g. a prompt
// part shared between forks) changes only that list and the content check.
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cpu_backend.hpp"
#include "shadowkv/errors.hpp"

namespace shadowkv::detail {
namespace {

/// A parked sequence: the slot's layers, moved out of the backend whole.
class cpu_parked_state final : public parked_state {
 public:
  std::vector<cpu_layer_data> layers;
  value_place values_on = value_place::host;
  std::int64_t bytes = 0;  ///< what the layers' arrays hold (their sections' sizes)

  [[nodiscard]] std::int64_t host_bytes() const noexcept override { return bytes; }
};

cpu_parked_state& as_cpu(parked_state& parked) noexcept { return static_cast<cpu_parked_state&>(parked); }

using piece_sink = std::function<void(std::span<const std::byte>)>;

/// One array of a (sequence, layer): its section name, its size in bytes (from
/// the configuration and the counters), how it is written (one or more pieces)
/// and how it is rebuilt from its section's bytes.
struct layer_field {
  const char* name;
  std::int64_t bytes;
  std::function<void(const cpu_layer_data&, const piece_sink&)> write;
  std::function<void(cpu_layer_data&, std::span<const std::byte>)> read;
};

template <typename T>
std::span<const std::byte> bytes_of(const std::vector<T>& values) noexcept {
  return std::as_bytes(std::span(values));
}

template <typename T>
void assign_bytes(std::vector<T>& values, std::span<const std::byte> raw) {
  values.resize(raw.size() / sizeof(T));
  if (!raw.empty()) std::memcpy(values.data(), raw.data(), values.size() * sizeof(T));
}

layer_field array_field(const char* name, std::int64_t bytes, host_array cpu_layer_data::*member) {
  return {name, bytes, [member](const cpu_layer_data& d, const piece_sink& sink) { sink((d.*member).raw_bytes()); },
          [member](cpu_layer_data& d, std::span<const std::byte> raw) { (d.*member).assign_raw_bytes(raw); }};
}

template <typename T>
layer_field vector_field(const char* name, std::int64_t bytes, std::vector<T> cpu_layer_data::*member) {
  return {name, bytes, [member](const cpu_layer_data& d, const piece_sink& sink) { sink(bytes_of(d.*member)); },
          [member](cpu_layer_data& d, std::span<const std::byte> raw) { assign_bytes(d.*member, raw); }};
}

/// A [heads][count] array of vectors, head after head.
template <typename T>
layer_field per_head_field(const char* name, std::int64_t heads, std::int64_t count,
                           std::vector<std::vector<T>> cpu_layer_data::*member) {
  const auto row_bytes = static_cast<std::size_t>(count) * sizeof(T);
  return {name, heads * static_cast<std::int64_t>(row_bytes),
          [member](const cpu_layer_data& d, const piece_sink& sink) {
            for (const std::vector<T>& row : d.*member) sink(bytes_of(row));
          },
          [member, heads, row_bytes](cpu_layer_data& d, std::span<const std::byte> raw) {
            std::vector<std::vector<T>>& rows = d.*member;
            rows.assign(static_cast<std::size_t>(heads), {});
            for (std::size_t h = 0; h < rows.size(); ++h) assign_bytes(rows[h], raw.subspan(h * row_bytes, row_bytes));
          }};
}

/// Every array of one (sequence, layer) with counters `s`, in file order
/// (docs/api.md, "Saved sequences", lists them).
std::vector<layer_field> layer_fields(const config& c, const layer_state& s) {
  const std::int64_t heads = c.num_kv_heads;
  const std::int64_t dim = c.head_dim;
  const std::int64_t width = c.kv_width();
  const std::int64_t chunk = c.chunk_size;
  const std::int64_t rank = c.rank;
  const auto e = static_cast<std::int64_t>(dtype_size(c.kv_dtype));
  const auto f = static_cast<std::int64_t>(dtype_size(c.factor_dtype()));
  constexpr std::int64_t i64 = sizeof(std::int64_t);
  const std::int64_t chunks = s.context_chunks;
  const std::int64_t outliers = s.outlier_chunks;
  const std::int64_t exact = s.local_len + s.generated_exact_len;
  const std::int64_t journal = s.journal_chunks * chunk;
  const std::int64_t slots = c.cache_slots();
  using d = cpu_layer_data;
  std::vector<layer_field> out;
  out.push_back(array_field("basis", rank * width * f, &d::basis));
  out.push_back(array_field("coefficients", chunks * chunk * rank * f, &d::coefficients));
  out.push_back(vector_field("context_positions", chunks * chunk * i64, &d::context_positions));
  if (c.chunk_score == chunk_score_rule::two_centroids) {
    out.push_back(vector_field("centroid_codes", chunks * heads * 2 * dim, &d::centroid_codes));
    out.push_back(vector_field("centroid_scales", chunks * heads * 2 * 4, &d::centroid_scales));
    out.push_back(vector_field("first_counts", chunks * heads, &d::first_counts));
  } else {
    out.push_back(array_field("landmarks", chunks * width * e, &d::landmarks));
  }
  if (c.values_as == value_format::fp8_e4m3) {
    out.push_back({"value_codes", chunks * heads * chunk * dim,
                   [](const d& x, const piece_sink& sink) { sink(x.value_store.raw_codes()); },
                   [](d& x, std::span<const std::byte> raw) { x.value_store.assign_raw_codes(raw); }});
    out.push_back({"value_scales", chunks * heads * 4,
                   [](const d& x, const piece_sink& sink) { sink(x.value_store.raw_scales()); },
                   [](d& x, std::span<const std::byte> raw) { x.value_store.assign_raw_scales(raw); }});
  } else {
    out.push_back({"values", chunks * heads * chunk * dim * e,
                   [](const d& x, const piece_sink& sink) { sink(x.value_store.raw_values()); },
                   [](d& x, std::span<const std::byte> raw) { x.value_store.assign_raw_values(raw); }});
  }
  out.push_back(per_head_field("outliers", heads, outliers, &d::outliers));
  out.push_back(per_head_field("is_outlier", heads, chunks, &d::is_outlier));
  out.push_back(array_field("outlier_keys", heads * outliers * chunk * dim * e, &d::outlier_keys));
  out.push_back(array_field("outlier_values", heads * outliers * chunk * dim * e, &d::outlier_values));
  out.push_back(array_field("exact_keys", exact * width * e, &d::exact_keys));
  out.push_back(array_field("exact_values", exact * width * e, &d::exact_values));
  out.push_back(vector_field("exact_positions", exact * i64, &d::exact_positions));
  out.push_back(array_field("journal_keys", journal * width * e, &d::journal_keys));
  out.push_back(array_field("journal_values", journal * width * e, &d::journal_values));
  out.push_back(vector_field("journal_positions", journal * i64, &d::journal_positions));
  out.push_back(vector_field("cache_chunks", heads * slots * i64, &d::cache_chunks));
  out.push_back(vector_field("pending_rebuild", heads * slots, &d::pending_rebuild));
  out.push_back(vector_field("pending_fetch", heads * slots, &d::pending_fetch));
  out.push_back(array_field("cache_keys", heads * slots * chunk * dim * e, &d::cache_keys));
  out.push_back(array_field("cache_values", heads * slots * chunk * dim * e, &d::cache_values));
  if (slots > c.budget_chunks()) {
    out.push_back(vector_field("cache_last_used", heads * slots * i64, &d::cache_last_used));
    out.push_back(vector_field("cache_selected", heads * slots, &d::cache_selected));
  }
  out.push_back({"scalars", 3 * i64,
                 [](const d& x, const piece_sink& sink) {
                   const std::int64_t values[3] = {x.last_position, x.prompt_last_position, x.selection_steps};
                   sink(std::as_bytes(std::span(values)));
                 },
                 [](d& x, std::span<const std::byte> raw) {
                   std::int64_t values[3];
                   std::memcpy(values, raw.data(), sizeof(values));
                   x.last_position = values[0];
                   x.prompt_last_position = values[1];
                   x.selection_steps = values[2];
                 }});
  return out;
}

/// A (sequence, layer) with no arrays yet, each array of its element type (as
/// prefill makes them).
cpu_layer_data empty_layer(const config& c) {
  cpu_layer_data d;
  d.basis = host_array(c.factor_dtype());
  d.coefficients = host_array(c.factor_dtype());
  for (host_array* array : {&d.landmarks, &d.outlier_keys, &d.outlier_values, &d.exact_keys, &d.exact_values,
                            &d.journal_keys, &d.journal_values, &d.cache_keys, &d.cache_values}) {
    *array = host_array(c.kv_dtype);
  }
  d.value_store = value_store_array(c.kv_dtype, c.values_as, static_cast<std::int64_t>(c.chunk_size) * c.head_dim);
  return d;
}

/// Throws invalid_argument where the arrays read for layer `layer` contradict
/// each other or the counters `s` in a way later steps would index by: outlier
/// ids and flags, cached chunk ids and the cache's flags. (A file written by
/// save passes; one that does not was made by hand, since the checksum
/// matched.)
void expect_consistent_layer(const config& c, const layer_state& s, const cpu_layer_data& d, std::size_t layer) {
  const auto fail = [layer](const auto&... parts) {
    throw invalid_argument(format_message("corrupted: layer ", layer, ": ", parts...));
  };
  const std::int64_t chunks = s.context_chunks;
  for (std::size_t h = 0; h < d.outliers.size(); ++h) {
    const std::vector<std::int64_t>& ids = d.outliers[h];
    const std::vector<std::uint8_t>& flags = d.is_outlier[h];
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= s.prompt_context_chunks || (i > 0 && ids[i] <= ids[i - 1])) {
        fail("the outlier ids of KV head ", h, " are not ascending ids of prompt chunks in [0, ",
             s.prompt_context_chunks, ")");
      }
      if (flags[static_cast<std::size_t>(ids[i])] != 1)
        fail("outlier chunk ", ids[i], " of KV head ", h, " is not flagged");
    }
    const auto flagged = std::count_if(flags.begin(), flags.end(), [](std::uint8_t x) { return x != 0; });
    if (std::any_of(flags.begin(), flags.end(), [](std::uint8_t x) { return x > 1; }) ||
        flagged != static_cast<std::ptrdiff_t>(ids.size())) {
      fail("the outlier flags of KV head ", h, " do not match its outlier ids");
    }
  }
  if (std::any_of(d.first_counts.begin(), d.first_counts.end(), [&](std::uint8_t n) { return n > c.chunk_size; })) {
    fail("a centroid's key count exceeds chunk_size = ", c.chunk_size);
  }
  if (d.selection_steps < 0) fail("selection_steps is ", d.selection_steps);
  const std::int64_t slots = c.cache_slots();
  std::vector<std::int64_t> held;
  for (std::int64_t h = 0; h < c.num_kv_heads; ++h) {
    held.clear();
    std::int64_t selected = 0;
    for (std::int64_t slot = 0; slot < slots; ++slot) {
      const auto i = static_cast<std::size_t>(h * slots + slot);
      const std::int64_t chunk = d.cache_chunks[i];
      if (chunk < -1 || chunk >= chunks)
        fail("the selection cache holds chunk id ", chunk, " outside [-1, ", chunks, ")");
      if (chunk >= 0) held.push_back(chunk);
      if (d.pending_rebuild[i] > (chunk >= 0 ? 1 : 0) || d.pending_fetch[i] > (chunk >= 0 ? 1 : 0)) {
        fail(
            "a pending flag of the selection cache is not 0 or 1, or marks an "
            "empty slot");
      }
      if (!d.cache_selected.empty()) {
        if (d.cache_selected[i] > (chunk >= 0 ? 1 : 0))
          fail(
              "a selected flag of the selection cache is not 0 or 1, "
              "or marks an empty slot");
        if (d.cache_last_used[i] < 0 || d.cache_last_used[i] > d.selection_steps) {
          fail("a selection cache slot was last used at step ", d.cache_last_used[i], ", outside [0, ",
               d.selection_steps, "]");
        }
        selected += d.cache_selected[i];
      }
    }
    std::sort(held.begin(), held.end());
    if (std::adjacent_find(held.begin(), held.end()) != held.end()) fail("the selection cache holds a chunk twice");
    if (selected > c.budget_chunks()) fail("more chunks are selected than the budget's ", c.budget_chunks());
  }
}

/// Bytes the arrays of `d` hold (its sections' sizes).
std::int64_t held_bytes(const config& c, const layer_state& s) {
  std::int64_t total = 0;
  for (const layer_field& field : layer_fields(c, s)) total += field.bytes;
  return total;
}

}  // namespace

std::unique_ptr<parked_state> cpu_backend::park_sequence(int slot, std::span<const layer_state> layers) {
  auto parked = std::make_unique<cpu_parked_state>();
  for (const layer_state& s : layers) parked->bytes += held_bytes(config_, s);
  parked->values_on = values_on_[static_cast<std::size_t>(slot)];
  // Nothing below can fail: the layers move (no array is copied), leaving the
  // slot with none (as closed).
  parked->layers = std::move(layers_[static_cast<std::size_t>(slot)]);
  layers_[static_cast<std::size_t>(slot)].clear();
  return parked;
}

void cpu_backend::unpark_sequence(int slot, parked_state& parked) noexcept {
  cpu_parked_state& p = as_cpu(parked);
  layers_[static_cast<std::size_t>(slot)] = std::move(p.layers);
  p.layers.clear();
}

void cpu_backend::resume_sequence(int slot, parked_state& parked, std::span<const layer_state> /*layers*/) {
  cpu_parked_state& p = as_cpu(parked);
  layers_[static_cast<std::size_t>(slot)] = std::move(p.layers);
  p.layers.clear();
  values_on_[static_cast<std::size_t>(slot)] = p.values_on;
}

void cpu_backend::unresume_sequence(int slot, parked_state& parked) noexcept {
  cpu_parked_state& p = as_cpu(parked);
  p.layers = std::move(layers_[static_cast<std::size_t>(slot)]);
  layers_[static_cast<std::size_t>(slot)].clear();
}

std::vector<state_section> cpu_backend::state_sections(std::span<const layer_state> layers) const {
  std::vector<state_section> sections;
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    for (const layer_field& field : layer_fields(config_, layers[layer])) {
      sections.push_back({format_message("layer", layer, ".", field.name), field.bytes});
    }
  }
  return sections;
}

void cpu_backend::write_state(int slot, std::span<const layer_state> layers, const state_sink& sink) const {
  std::size_t index = 0;
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    const cpu_layer_data& d = data(slot, static_cast<int>(layer));
    for (const layer_field& field : layer_fields(config_, layers[layer])) {
      field.write(d, [&](std::span<const std::byte> bytes) {
        if (!bytes.empty()) sink(index, bytes);
      });
      ++index;
    }
  }
}

void cpu_backend::read_state(int slot, value_place values_on, std::span<const layer_state> layers,
                             std::span<const std::span<const std::byte>> sections) {
  // Built on the side and moved in: all or nothing.
  std::vector<cpu_layer_data> built;
  built.reserve(layers.size());
  std::size_t index = 0;
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    cpu_layer_data d = empty_layer(config_);
    for (const layer_field& field : layer_fields(config_, layers[layer])) {
      SHADOWKV_ASSERT(index < sections.size() && static_cast<std::int64_t>(sections[index].size()) == field.bytes);
      field.read(d, sections[index]);
      ++index;
    }
    expect_consistent_layer(config_, layers[layer], d, layer);
    built.push_back(std::move(d));
  }
  SHADOWKV_ASSERT(index == sections.size());
  layers_[static_cast<std::size_t>(slot)] = std::move(built);
  values_on_[static_cast<std::size_t>(slot)] = values_on;
}

}  // namespace shadowkv::detail
