// Park and save on the CPU backend (docs/semantics.md, "Fork, park and save"; the file: docs/api.md, "Saved
// sequences").
//
// park moves a slot's layers (std::vector<cpu_layer_data>) out whole into the parked object: no array is copied, and
// after the object's allocation nothing can fail. A layer's prompt part (cpu_prompt_state) moves with it by its
// shared_ptr, so a parked member of a fork's family keeps sharing it (and keeps it alive for the others, and they for
// it). A saved sequence is each layer's arrays, their valid parts only (as the counters give them), one section per
// array: an array split between the prompt part and the own part (the context chunks' rows: prompt chunks, then
// folded ones) is one section, the prompt's rows first, so that a file stands alone and a forked sequence's file is
// an unshared one's. load builds an unshared sequence (a prompt part of its own). The arrays are named in one place,
// layer_fields(): a change of cpu_layer_data's or cpu_prompt_state's members changes only that list and the content
// check.
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

/// A parked sequence: the slot's layers, moved out of the backend whole (their prompt parts by reference).
class cpu_parked_state final : public parked_state {
 public:
  std::vector<cpu_layer_data> layers;
  value_place values_on = value_place::host;
  std::int64_t own_bytes = 0;               ///< what the layers' own parts hold (as their sections count them)
  std::vector<std::int64_t> prompt_bytes;   ///< [layer] what the layer's prompt part holds (likewise)

  /// The own parts, and each prompt part this object alone holds: what destroying it would free. A prompt part that
  /// other sequences of its family share (live, or parked) is theirs as much as its.
  [[nodiscard]] std::int64_t host_bytes() const noexcept override {
    std::int64_t total = own_bytes;
    for (std::size_t layer = 0; layer < layers.size() && layer < prompt_bytes.size(); ++layer) {
      if (layers[layer].prompt != nullptr && layers[layer].prompt.use_count() == 1) total += prompt_bytes[layer];
    }
    return total;
  }
};

cpu_parked_state& as_cpu(parked_state& parked) noexcept { return static_cast<cpu_parked_state&>(parked); }

using piece_sink = std::function<void(std::span<const std::byte>)>;

/// One array of a (sequence, layer): its section name, its size in bytes in the file (from the configuration and the
/// counters), the bytes of it held by the prompt part and by the own part, how it is written (one or more pieces) and
/// how it is rebuilt from its section's bytes (into a prompt part and an own part being built).
struct layer_field {
  const char* name;
  std::int64_t bytes;
  std::int64_t prompt_bytes;
  std::int64_t own_bytes;
  std::function<void(const cpu_layer_data&, const piece_sink&)> write;
  std::function<void(cpu_prompt_state&, cpu_layer_data&, std::span<const std::byte>)> read;
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

// An array's bytes, and the array made to hold given bytes: host_array and std::vector alike.
std::span<const std::byte> raw_of(const host_array& array) noexcept { return array.raw_bytes(); }
template <typename T>
std::span<const std::byte> raw_of(const std::vector<T>& values) noexcept {
  return bytes_of(values);
}
void assign_raw(host_array& array, std::span<const std::byte> raw) { array.assign_raw_bytes(raw); }
template <typename T>
void assign_raw(std::vector<T>& values, std::span<const std::byte> raw) {
  assign_bytes(values, raw);
}

/// An array of the sequence's own part.
template <typename T>
layer_field own_field(const char* name, std::int64_t bytes, T cpu_layer_data::*member) {
  return {name, bytes, 0, bytes, [member](const cpu_layer_data& d, const piece_sink& sink) { sink(raw_of(d.*member)); },
          [member](cpu_prompt_state&, cpu_layer_data& d, std::span<const std::byte> raw) {
            assign_raw(d.*member, raw);
          }};
}

/// An array of the prompt part.
template <typename T>
layer_field prompt_field(const char* name, std::int64_t bytes, T cpu_prompt_state::*member) {
  return {name, bytes, bytes, 0,
          [member](const cpu_layer_data& d, const piece_sink& sink) { sink(raw_of((*d.prompt).*member)); },
          [member](cpu_prompt_state& p, cpu_layer_data&, std::span<const std::byte> raw) {
            assign_raw(p.*member, raw);
          }};
}

/// An array of the context chunks: the prompt part's rows (its `prompt_bytes`), then the own part's (folded chunks).
template <typename T>
layer_field split_field(const char* name, std::int64_t prompt_bytes, std::int64_t own_bytes,
                        T cpu_prompt_state::*prompt_member, T cpu_layer_data::*own_member) {
  return {name, prompt_bytes + own_bytes, prompt_bytes, own_bytes,
          [prompt_member, own_member](const cpu_layer_data& d, const piece_sink& sink) {
            sink(raw_of((*d.prompt).*prompt_member));
            sink(raw_of(d.*own_member));
          },
          [prompt_member, own_member, prompt_bytes](cpu_prompt_state& p, cpu_layer_data& d,
                                                    std::span<const std::byte> raw) {
            const auto split = static_cast<std::size_t>(prompt_bytes);
            assign_raw(p.*prompt_member, raw.first(split));
            assign_raw(d.*own_member, raw.subspan(split));
          }};
}

/// The value store's codes, values or scales (one of value_store_array's raw arrays), split as split_field.
layer_field value_field(const char* name, std::int64_t prompt_bytes, std::int64_t own_bytes,
                        std::span<const std::byte> (value_store_array::*get)() const noexcept,
                        void (value_store_array::*set)(std::span<const std::byte>)) {
  return {name, prompt_bytes + own_bytes, prompt_bytes, own_bytes,
          [get](const cpu_layer_data& d, const piece_sink& sink) {
            sink((d.prompt->value_store.*get)());
            sink((d.value_store.*get)());
          },
          [set, prompt_bytes](cpu_prompt_state& p, cpu_layer_data& d, std::span<const std::byte> raw) {
            const auto split = static_cast<std::size_t>(prompt_bytes);
            (p.value_store.*set)(raw.first(split));
            (d.value_store.*set)(raw.subspan(split));
          }};
}

/// The prompt's outlier ids, [heads][outliers], head after head.
layer_field outlier_ids_field(std::int64_t heads, std::int64_t outliers) {
  const auto row_bytes = static_cast<std::size_t>(outliers) * sizeof(std::int64_t);
  const std::int64_t bytes = heads * static_cast<std::int64_t>(row_bytes);
  return {"outliers", bytes, bytes, 0,
          [](const cpu_layer_data& d, const piece_sink& sink) {
            for (const std::vector<std::int64_t>& row : d.prompt->outliers) sink(bytes_of(row));
          },
          [heads, row_bytes](cpu_prompt_state& p, cpu_layer_data&, std::span<const std::byte> raw) {
            p.outliers.assign(static_cast<std::size_t>(heads), {});
            for (std::size_t h = 0; h < p.outliers.size(); ++h) {
              assign_bytes(p.outliers[h], raw.subspan(h * row_bytes, row_bytes));
            }
          }};
}

/// The outlier flags, [heads][context chunks] in the file: the prompt's flags, then a 0 per folded chunk (a folded
/// chunk is never an outlier: the prompt part holds flags of its own chunks only). read keeps the folded chunks'
/// bytes at the end of each row (expect_consistent_layer checks them, then they are dropped).
layer_field outlier_flags_field(std::int64_t heads, std::int64_t prompt_chunks, std::int64_t chunks) {
  const auto row = static_cast<std::size_t>(chunks);
  const auto prompt_row = static_cast<std::size_t>(prompt_chunks);
  return {"is_outlier", heads * chunks, heads * prompt_chunks, 0,
          [row, prompt_row](const cpu_layer_data& d, const piece_sink& sink) {
            const std::vector<std::uint8_t> folded(row - prompt_row, 0);
            for (const std::vector<std::uint8_t>& flags : d.prompt->is_outlier) {
              sink(bytes_of(flags));
              sink(bytes_of(folded));
            }
          },
          [heads, row](cpu_prompt_state& p, cpu_layer_data&, std::span<const std::byte> raw) {
            p.is_outlier.assign(static_cast<std::size_t>(heads), {});
            for (std::size_t h = 0; h < p.is_outlier.size(); ++h) {
              assign_bytes(p.is_outlier[h], raw.subspan(h * row, row));
            }
          }};
}

/// Every array of one (sequence, layer) with counters `s`, in file order (docs/api.md, "Saved sequences", lists
/// them).
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
  const std::int64_t n = s.prompt_context_chunks;  // the prompt part's chunks; chunks - n folded ones are the own's
  const std::int64_t folded = chunks - n;
  const std::int64_t outliers = s.outlier_chunks;
  const std::int64_t exact = s.local_len + s.generated_exact_len;
  const std::int64_t journal = s.journal_chunks * chunk;
  const std::int64_t slots = c.cache_slots();
  using d = cpu_layer_data;
  using p = cpu_prompt_state;
  using v = value_store_array;
  std::vector<layer_field> out;
  out.push_back(prompt_field("basis", rank * width * f, &p::basis));
  out.push_back(split_field("coefficients", n * chunk * rank * f, folded * chunk * rank * f, &p::coefficients,
                            &d::coefficients));
  out.push_back(split_field("context_positions", n * chunk * i64, folded * chunk * i64, &p::context_positions,
                            &d::context_positions));
  if (c.chunk_score == chunk_score_rule::two_centroids) {
    out.push_back(split_field("centroid_codes", n * heads * 2 * dim, folded * heads * 2 * dim, &p::centroid_codes,
                              &d::centroid_codes));
    out.push_back(split_field("centroid_scales", n * heads * 2 * 4, folded * heads * 2 * 4, &p::centroid_scales,
                              &d::centroid_scales));
    out.push_back(split_field("first_counts", n * heads, folded * heads, &p::first_counts, &d::first_counts));
  } else {
    out.push_back(split_field("landmarks", n * width * e, folded * width * e, &p::landmarks, &d::landmarks));
  }
  if (c.values_as == value_format::fp8_e4m3) {
    out.push_back(value_field("value_codes", n * heads * chunk * dim, folded * heads * chunk * dim, &v::raw_codes,
                              &v::assign_raw_codes));
    out.push_back(
        value_field("value_scales", n * heads * 4, folded * heads * 4, &v::raw_scales, &v::assign_raw_scales));
  } else {
    out.push_back(value_field("values", n * heads * chunk * dim * e, folded * heads * chunk * dim * e, &v::raw_values,
                              &v::assign_raw_values));
  }
  out.push_back(outlier_ids_field(heads, outliers));
  out.push_back(outlier_flags_field(heads, n, chunks));
  out.push_back(prompt_field("outlier_keys", heads * outliers * chunk * dim * e, &p::outlier_keys));
  out.push_back(prompt_field("outlier_values", heads * outliers * chunk * dim * e, &p::outlier_values));
  out.push_back(own_field("exact_keys", exact * width * e, &d::exact_keys));
  out.push_back(own_field("exact_values", exact * width * e, &d::exact_values));
  out.push_back(own_field("exact_positions", exact * i64, &d::exact_positions));
  out.push_back(own_field("journal_keys", journal * width * e, &d::journal_keys));
  out.push_back(own_field("journal_values", journal * width * e, &d::journal_values));
  out.push_back(own_field("journal_positions", journal * i64, &d::journal_positions));
  out.push_back(own_field("cache_chunks", heads * slots * i64, &d::cache_chunks));
  out.push_back(own_field("pending_rebuild", heads * slots, &d::pending_rebuild));
  out.push_back(own_field("pending_fetch", heads * slots, &d::pending_fetch));
  out.push_back(own_field("cache_keys", heads * slots * chunk * dim * e, &d::cache_keys));
  out.push_back(own_field("cache_values", heads * slots * chunk * dim * e, &d::cache_values));
  if (slots > c.budget_chunks()) {
    out.push_back(own_field("cache_last_used", heads * slots * i64, &d::cache_last_used));
    out.push_back(own_field("cache_selected", heads * slots, &d::cache_selected));
  }
  out.push_back({"scalars", 3 * i64, 0, 3 * i64,
                 [](const d& x, const piece_sink& sink) {
                   const std::int64_t values[3] = {x.last_position, x.prompt_last_position, x.selection_steps};
                   sink(std::as_bytes(std::span(values)));
                 },
                 [](p&, d& x, std::span<const std::byte> raw) {
                   std::int64_t values[3];
                   std::memcpy(values, raw.data(), sizeof(values));
                   x.last_position = values[0];
                   x.prompt_last_position = values[1];
                   x.selection_steps = values[2];
                 }});
  return out;
}

/// A (sequence, layer) with no arrays yet, and a prompt part for it, each array of its element type (as prefill makes
/// them).
cpu_layer_data empty_layer(const config& c) {
  cpu_layer_data d;
  d.coefficients = host_array(c.factor_dtype());
  for (host_array* array : {&d.landmarks, &d.exact_keys, &d.exact_values, &d.journal_keys, &d.journal_values,
                            &d.cache_keys, &d.cache_values}) {
    *array = host_array(c.kv_dtype);
  }
  d.value_store = value_store_array(c.kv_dtype, c.values_as, static_cast<std::int64_t>(c.chunk_size) * c.head_dim);
  return d;
}

cpu_prompt_state empty_prompt(const config& c, std::int64_t chunks) {
  cpu_prompt_state p;
  p.chunks = chunks;
  p.basis = host_array(c.factor_dtype());
  p.coefficients = host_array(c.factor_dtype());
  for (host_array* array : {&p.landmarks, &p.outlier_keys, &p.outlier_values}) *array = host_array(c.kv_dtype);
  p.value_store = value_store_array(c.kv_dtype, c.values_as, static_cast<std::int64_t>(c.chunk_size) * c.head_dim);
  return p;
}

/// Throws invalid_argument where the arrays read for layer `layer` (prompt part `p`, its outlier flags still rows of
/// every context chunk as in the file, and own part `d`) contradict each other or the counters `s` in a way later
/// steps would index by: outlier ids and flags, cached chunk ids and the cache's flags. (A file written by save passes;
/// one that does not was made by hand, since the checksum matched.)
void expect_consistent_layer(const config& c, const layer_state& s, const cpu_prompt_state& p, const cpu_layer_data& d,
                             std::size_t layer) {
  const auto fail = [layer](const auto&... parts) {
    throw invalid_argument(format_message("corrupted: layer ", layer, ": ", parts...));
  };
  const std::int64_t chunks = s.context_chunks;
  for (std::size_t h = 0; h < p.outliers.size(); ++h) {
    const std::vector<std::int64_t>& ids = p.outliers[h];
    const std::vector<std::uint8_t>& flags = p.is_outlier[h];
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= s.prompt_context_chunks || (i > 0 && ids[i] <= ids[i - 1])) {
        fail("the outlier ids of KV head ", h, " are not ascending ids of prompt chunks in [0, ",
             s.prompt_context_chunks, ")");
      }
      if (flags[static_cast<std::size_t>(ids[i])] != 1)
        fail("outlier chunk ", ids[i], " of KV head ", h, " is not flagged");
    }
    // Flags past the prompt's chunks (folded chunks, never outliers) count as well: they must be 0.
    const auto flagged = std::count_if(flags.begin(), flags.end(), [](std::uint8_t x) { return x != 0; });
    if (std::any_of(flags.begin(), flags.end(), [](std::uint8_t x) { return x > 1; }) ||
        flagged != static_cast<std::ptrdiff_t>(ids.size())) {
      fail("the outlier flags of KV head ", h, " do not match its outlier ids");
    }
  }
  const auto too_many = [&](std::uint8_t n) { return n > c.chunk_size; };
  if (std::any_of(p.first_counts.begin(), p.first_counts.end(), too_many) ||
      std::any_of(d.first_counts.begin(), d.first_counts.end(), too_many)) {
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

}  // namespace

std::unique_ptr<parked_state> cpu_backend::park_sequence(int slot, std::span<const layer_state> layers) {
  auto parked = std::make_unique<cpu_parked_state>();
  parked->prompt_bytes.reserve(layers.size());
  for (const layer_state& s : layers) {
    std::int64_t prompt = 0;
    for (const layer_field& field : layer_fields(config_, s)) {
      prompt += field.prompt_bytes;
      parked->own_bytes += field.own_bytes;
    }
    parked->prompt_bytes.push_back(prompt);
  }
  parked->values_on = values_on_[static_cast<std::size_t>(slot)];
  // Nothing below can fail: the layers move (no array is copied; the prompt parts by their shared_ptr, still shared
  // with the family's other sequences), leaving the slot with none (as closed).
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
  // Built on the side and moved in: all or nothing. Each layer gets a prompt part of its own (unshared).
  std::vector<cpu_layer_data> built;
  built.reserve(layers.size());
  std::size_t index = 0;
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    const layer_state& s = layers[layer];
    auto prompt = std::make_shared<cpu_prompt_state>(empty_prompt(config_, s.prompt_context_chunks));
    cpu_layer_data d = empty_layer(config_);
    for (const layer_field& field : layer_fields(config_, s)) {
      SHADOWKV_ASSERT(index < sections.size() && static_cast<std::int64_t>(sections[index].size()) == field.bytes);
      field.read(*prompt, d, sections[index]);
      ++index;
    }
    expect_consistent_layer(config_, s, *prompt, d, layer);
    for (std::vector<std::uint8_t>& flags : prompt->is_outlier) {
      flags.resize(static_cast<std::size_t>(s.prompt_context_chunks));  // the folded chunks' zeros, checked above
    }
    d.prompt = std::move(prompt);
    built.push_back(std::move(d));
  }
  SHADOWKV_ASSERT(index == sections.size());
  layers_[static_cast<std::size_t>(slot)] = std::move(built);
  values_on_[static_cast<std::size_t>(slot)] = values_on;
}

}  // namespace shadowkv::detail
