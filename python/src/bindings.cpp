// The one binding file: converts DLPack tensors to tensor_views and forwards to shadowkv::kv_store. No logic.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shadowkv/build_info.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/store.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using input_array = nb::ndarray<nb::ro>;
using output_array = nb::ndarray<>;

template <typename Array>
shadowkv::tensor_view to_view(const Array& array, const char* name) {
  shadowkv::tensor_view view;
  SHADOWKV_EXPECTS(array.ndim() <= static_cast<std::size_t>(shadowkv::max_tensor_rank), name, " has ",
                   array.ndim(), " dimensions; at most ", shadowkv::max_tensor_rank, " are expected");
  view.data = array.data();
  view.rank = static_cast<int>(array.ndim());
  for (int dim = 0; dim < view.rank; ++dim) {
    view.shape[static_cast<std::size_t>(dim)] = static_cast<std::int64_t>(array.shape(static_cast<std::size_t>(dim)));
    view.strides[static_cast<std::size_t>(dim)] = static_cast<std::int64_t>(array.stride(static_cast<std::size_t>(dim)));
  }
  const nb::dlpack::dtype type = array.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(type.code);
  SHADOWKV_EXPECTS(type.lanes == 1, name, " must not be a vector dtype");
  if (code == nb::dlpack::dtype_code::Float && type.bits == 32) {
    view.float_type = shadowkv::dtype::float32;
  } else if (code == nb::dlpack::dtype_code::Float && type.bits == 16) {
    view.float_type = shadowkv::dtype::float16;
  } else if (code == nb::dlpack::dtype_code::Bfloat && type.bits == 16) {
    view.float_type = shadowkv::dtype::bfloat16;
  } else if (code == nb::dlpack::dtype_code::Int && (type.bits == 32 || type.bits == 64)) {
    view.is_integer = true;
    view.int_type = type.bits == 32 ? shadowkv::index_type::int32 : shadowkv::index_type::int64;
  } else {
    throw shadowkv::invalid_argument(shadowkv::detail::format_message(
        name, " has an unsupported dtype (DLPack code ", static_cast<int>(type.code), ", ", static_cast<int>(type.bits),
        " bits); expected float32/float16/bfloat16 (or int32/int64 for positions)"));
  }
  if (array.device_type() == nb::device::cpu::value || array.device_type() == nb::device::cuda_host::value) {
    view.where = {shadowkv::device_type::cpu, 0};
  } else if (array.device_type() == nb::device::cuda::value) {
    view.where = {shadowkv::device_type::cuda, array.device_id()};
  } else {
    throw shadowkv::invalid_argument(shadowkv::detail::format_message(
        name, " lives on an unsupported device (DLPack device type ", array.device_type(), "); expected cpu or cuda"));
  }
  return view;
}

// Runs `call` without the GIL. An exception is captured and rethrown once the GIL is held again, so that no C++
// unwinding passes through the GIL re-acquisition (nanobind then translates it to ValueError/MemoryError/...).
template <typename Call>
void without_gil(Call&& call) {
  std::exception_ptr error;
  {
    nb::gil_scoped_release release;
    try {
      call();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Sequences and strings are taken as Python objects and converted here, in the body of the bound function: nanobind's
// own casters for std::vector and std::string run in noexcept code, so a std::bad_alloc there (a vector's reserve, a
// long string) would end the process; here it is a MemoryError like any other. (The Python layer has checked types.)
template <typename T>
std::vector<T> to_vector(const nb::sequence& items) {
  const std::size_t count = nb::len(items);
  std::vector<T> result;
  result.reserve(count);
  for (std::size_t i = 0; i < count; ++i) result.push_back(nb::cast<T>(items[i]));
  return result;
}

std::string to_string(const nb::str& text) { return std::string(text.c_str()); }

// A file path as the filesystem's bytes (the Python side passes os.fsencode(path)).
std::string to_path(const nb::bytes& path) { return std::string(path.c_str(), path.size()); }

// io_error -> OSError(errno, message, filename): Python picks the subclass from the errno (FileNotFoundError,
// PermissionError, IsADirectoryError, ...). An error without an errno (a short read) is EIO.
void translate_io_error(const std::exception_ptr& error, void* /*payload*/) {
  try {
    std::rethrow_exception(error);
  } catch (const shadowkv::io_error& e) {
    const char* what = e.what();
    PyObject* message = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "replace");
    PyObject* filename =
        PyUnicode_DecodeFSDefaultAndSize(e.path().data(), static_cast<Py_ssize_t>(e.path().size()));
    if (message == nullptr || filename == nullptr) {
      Py_XDECREF(message);
      Py_XDECREF(filename);
      return;  // a Python error is set
    }
    PyObject* args = Py_BuildValue("(iNN)", e.code() != 0 ? e.code() : EIO, message, filename);
    if (args == nullptr) return;
    PyErr_SetObject(PyExc_OSError, args);
    Py_DECREF(args);
  }
}

// A decode or extend call's tensors as views: the inputs first, so that their errors name them rather than `out`.
struct call_views {
  shadowkv::tensor_view q, k, v;
  shadowkv::mutable_tensor_view out;
};

call_views views_of(const input_array& q, const input_array& k, const char* k_name, const input_array& v,
                    const char* v_name, const output_array& out) {
  call_views views;
  views.q = to_view(q, "q");
  views.k = to_view(k, k_name);
  views.v = to_view(v, v_name);
  static_cast<shadowkv::tensor_view&>(views.out) = to_view(out, "out");
  return views;
}

shadowkv::tensor_view optional_view(const std::optional<input_array>& array, const char* name) {
  return array ? to_view(*array, name) : shadowkv::tensor_view{};
}

nb::dict info_dict(const shadowkv::sequence_info& info) {
  nb::dict d;
  d["prefilled"] = info.prefilled;
  d["prompt_len"] = info.prompt_len;
  d["total_len"] = info.total_len;
  d["context_chunks"] = info.context_chunks;
  d["outlier_chunks"] = info.outlier_chunks;
  d["local_len"] = info.local_len;
  d["generated_exact_len"] = info.generated_exact_len;
  d["last_position"] = info.last_position;
  d["values_on"] = shadowkv::value_place_name(info.values_on);
  nb::list shares;
  for (const int slot : info.shares_prompt_with) shares.append(slot);
  d["shares_prompt_with"] = shares;
  return d;
}

nb::dict memory_dict(const shadowkv::memory_report& report) {
  nb::dict d;
  d["low_rank_factors"] = report.low_rank_factors;
  d["landmarks"] = report.landmarks;
  d["outliers"] = report.outliers;
  d["exact_tokens"] = report.exact_tokens;
  d["value_store"] = report.value_store;
  d["value_store_device"] = report.value_store_device;
  d["value_store_host"] = report.value_store_host;
  d["selection_cache"] = report.selection_cache;
  d["fold_journal"] = report.fold_journal;
  d["total"] = report.total();
  d["full_attention_equivalent"] = report.full_attention_equivalent;
  d["device_reserved"] = report.device_reserved;
  d["host_reserved"] = report.host_reserved;
  d["shared"] = report.shared;
  return d;
}

nb::dict stats_dict(const shadowkv::store_stats& stats) {
  nb::dict d;
  d["decode_steps"] = stats.decode_steps;
  d["selections"] = stats.selections;
  d["hits"] = stats.hits;
  d["misses"] = stats.misses;
  d["hit_rate"] = stats.hit_rate();
  d["chunks_rebuilt"] = stats.chunks_rebuilt;
  d["bytes_fetched"] = stats.bytes_fetched;
  d["folds"] = stats.folds;
  return d;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "shadowkv_core native module (use the shadowkv_core package, not this module)";
  nb::register_exception_translator(translate_io_error);

  // Made by Store.park only (no constructor from Python); shadowkv_core.ParkedSequence wraps it.
  nb::class_<shadowkv::parked_sequence>(m, "ParkedSequence")
      .def_prop_ro("tokens", &shadowkv::parked_sequence::tokens)
      .def_prop_ro("host_bytes", &shadowkv::parked_sequence::host_bytes)
      .def_prop_ro("parked_from", &shadowkv::parked_sequence::parked_from)
      .def_prop_ro("empty", &shadowkv::parked_sequence::empty);

  nb::class_<shadowkv::config>(m, "Config")
      .def(nb::init<>())
      .def_rw("num_layers", &shadowkv::config::num_layers)
      .def_rw("num_q_heads", &shadowkv::config::num_q_heads)
      .def_rw("num_kv_heads", &shadowkv::config::num_kv_heads)
      .def_rw("head_dim", &shadowkv::config::head_dim)
      .def_rw("max_batch", &shadowkv::config::max_batch)
      .def_rw("max_seq_len", &shadowkv::config::max_seq_len)
      .def_rw("rope_theta", &shadowkv::config::rope_theta)
      .def_prop_rw(
          "inv_freq", [](const shadowkv::config& c) { return c.inv_freq; },
          [](shadowkv::config& c, const nb::sequence& values) { c.inv_freq = to_vector<float>(values); })
      .def_rw("rotary_dim", &shadowkv::config::rotary_dim)
      .def_prop_rw(
          "rope_style", [](const shadowkv::config& c) { return shadowkv::rope_style_name(c.rope); },
          [](shadowkv::config& c, const nb::str& name) { c.rope = shadowkv::parse_rope_style(to_string(name)); })
      .def_rw("attention_scaling", &shadowkv::config::attention_scaling)
      .def_rw("softmax_scale", &shadowkv::config::softmax_scale)
      .def_rw("rank", &shadowkv::config::rank)
      .def_rw("chunk_size", &shadowkv::config::chunk_size)
      .def_rw("budget", &shadowkv::config::budget)
      .def_rw("cache_tokens", &shadowkv::config::cache_tokens)
      .def_rw("outlier_chunks", &shadowkv::config::outlier_chunks)
      .def_rw("sink_chunks", &shadowkv::config::sink_chunks)
      .def_rw("local_chunks", &shadowkv::config::local_chunks)
      .def_rw("generation_window", &shadowkv::config::generation_window)
      .def_rw("extend_block", &shadowkv::config::extend_block)
      .def_prop_rw(
          "factorization",
          [](const shadowkv::config& c) {
            return std::string(c.factorization == shadowkv::factorization_method::svd ? "svd" : "gram");
          },
          [](shadowkv::config& c, const nb::str& name) { c.factorization = shadowkv::parse_factorization(to_string(name)); })
      .def_prop_rw(
          "dtype", [](const shadowkv::config& c) { return std::string(shadowkv::dtype_name(c.kv_dtype)); },
          [](shadowkv::config& c, const nb::str& name) { c.kv_dtype = shadowkv::parse_dtype(to_string(name)); })
      .def_prop_rw(
          "value_store",
          [](const shadowkv::config& c) { return shadowkv::value_store_name(c.value_store); },
          [](shadowkv::config& c, const nb::str& name) { c.value_store = shadowkv::parse_value_store(to_string(name)); })
      .def_rw("device_value_budget", &shadowkv::config::device_value_budget)
      .def_rw("decode_pipeline_parts", &shadowkv::config::decode_pipeline_parts)
      .def_prop_rw(
          "value_format", [](const shadowkv::config& c) { return shadowkv::value_format_name(c.values_as); },
          [](shadowkv::config& c, const nb::str& name) { c.values_as = shadowkv::parse_value_format(to_string(name)); })
      .def_prop_rw(
          "group_score", [](const shadowkv::config& c) { return shadowkv::group_score_name(c.group_score); },
          [](shadowkv::config& c, const nb::str& name) { c.group_score = shadowkv::parse_group_score(to_string(name)); })
      .def_prop_rw(
          "chunk_score", [](const shadowkv::config& c) { return shadowkv::chunk_score_name(c.chunk_score); },
          [](shadowkv::config& c, const nb::str& name) { c.chunk_score = shadowkv::parse_chunk_score(to_string(name)); })
      .def_prop_rw(
          "factor_format", [](const shadowkv::config& c) { return shadowkv::factor_format_name(c.factors_as); },
          [](shadowkv::config& c, const nb::str& name) { c.factors_as = shadowkv::parse_factor_format(to_string(name)); })
      .def_prop_ro("factor_dtype",
                   [](const shadowkv::config& c) { return std::string(shadowkv::dtype_name(c.factor_dtype())); })
      .def_prop_rw(
          "check_finite", [](const shadowkv::config& c) { return shadowkv::finite_check_name(c.check_finite); },
          [](shadowkv::config& c, const nb::str& name) { c.check_finite = shadowkv::parse_finite_check(to_string(name)); })
      .def("validate", &shadowkv::config::validate);

  nb::class_<shadowkv::kv_store>(m, "Store")
      .def(
          "__init__",
          [](shadowkv::kv_store* self, const shadowkv::config& cfg, const nb::str& device) {
            new (self) shadowkv::kv_store(cfg, shadowkv::parse_device(to_string(device)));
          },
          "config"_a, "device"_a = "cpu")
      .def_prop_ro("device", [](const shadowkv::kv_store& s) { return shadowkv::to_string(s.where()); })
      .def("add_sequences", &shadowkv::kv_store::add_sequences, "count"_a)
      .def(
          "release", [](shadowkv::kv_store& s, const nb::sequence& slots) { s.release(to_vector<int>(slots)); },
          "slots"_a)
      .def("active_slots", &shadowkv::kv_store::active_slots)
      .def(
          "prefill",
          [](shadowkv::kv_store& s, int layer, const nb::sequence& slot_list, const input_array& keys,
             const input_array& values, const nb::sequence& lengths, const std::optional<input_array>& positions,
             const std::optional<input_array>& q_last, bool keys_post_rope, std::optional<std::uintptr_t> stream) {
            const std::vector<int> slots = to_vector<int>(slot_list);
            shadowkv::prefill_options options;
            if (stream) options.stream = shadowkv::stream_view::from_integer(*stream);
            options.lengths = to_vector<std::int64_t>(lengths);
            options.positions = optional_view(positions, "positions");
            options.q_last = optional_view(q_last, "q_last");
            options.keys_post_rope = keys_post_rope;
            const shadowkv::tensor_view key_view = to_view(keys, "keys");
            const shadowkv::tensor_view value_view = to_view(values, "values");
            without_gil([&] { s.prefill(layer, slots, key_view, value_view, options); });
          },
          "layer"_a, "slots"_a, "keys"_a, "values"_a, "lengths"_a, "positions"_a.none(), "q_last"_a.none(),
          "keys_post_rope"_a, "stream"_a.none() = nb::none())
      .def(
          "decode",
          [](shadowkv::kv_store& s, int layer, const nb::sequence& slot_list, const input_array& q,
             const input_array& k_new, const input_array& v_new, const output_array& out,
             const std::optional<input_array>& positions, bool k_new_post_rope, std::optional<std::uintptr_t> stream) {
            const std::vector<int> slots = to_vector<int>(slot_list);
            shadowkv::decode_options options;
            if (stream) options.stream = shadowkv::stream_view::from_integer(*stream);
            options.positions = optional_view(positions, "positions");
            options.keys_post_rope = k_new_post_rope;
            const call_views views = views_of(q, k_new, "k_new", v_new, "v_new", out);
            without_gil([&] { s.decode(layer, slots, views.q, views.k, views.v, views.out, options); });
          },
          "layer"_a, "slots"_a, "q"_a, "k_new"_a, "v_new"_a, "out"_a, "positions"_a.none(), "k_new_post_rope"_a,
          "stream"_a.none() = nb::none())
      .def(
          "extend",
          [](shadowkv::kv_store& s, int layer, const nb::sequence& slot_list, const input_array& q, const input_array& k,
             const input_array& v, const output_array& out, const nb::sequence& lengths,
             const std::optional<input_array>& positions, bool k_post_rope, std::optional<std::uintptr_t> stream) {
            const std::vector<int> slots = to_vector<int>(slot_list);
            shadowkv::extend_options options;
            if (stream) options.stream = shadowkv::stream_view::from_integer(*stream);
            options.lengths = to_vector<std::int64_t>(lengths);
            options.positions = optional_view(positions, "positions");
            options.keys_post_rope = k_post_rope;
            const call_views views = views_of(q, k, "k", v, "v", out);
            without_gil([&] { s.extend(layer, slots, views.q, views.k, views.v, views.out, options); });
          },
          "layer"_a, "slots"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lengths"_a, "positions"_a.none(), "k_post_rope"_a,
          "stream"_a.none() = nb::none())
      .def(
          "truncate",
          [](shadowkv::kv_store& s, const nb::sequence& slot_list, const nb::sequence& token_list) {
            const std::vector<int> slots = to_vector<int>(slot_list);
            const std::vector<std::int64_t> tokens = to_vector<std::int64_t>(token_list);
            without_gil([&] { s.truncate(slots, tokens); });
          },
          "slots"_a, "tokens"_a)
      .def(
          "fork",
          [](shadowkv::kv_store& s, int slot, int count) {
            std::vector<int> children;
            without_gil([&] { children = s.fork(slot, count); });
            return children;
          },
          "slot"_a, "count"_a)
      .def(
          "park",
          [](shadowkv::kv_store& s, const nb::sequence& slot_list) {
            const std::vector<int> slots = to_vector<int>(slot_list);
            // The Python objects first, so that nothing can fail once the sequences are out of their slots.
            nb::list result;
            std::vector<shadowkv::parked_sequence*> targets;
            targets.reserve(slots.size());
            for (std::size_t i = 0; i < slots.size(); ++i) {
              nb::object item = nb::cast(shadowkv::parked_sequence{});
              targets.push_back(&nb::cast<shadowkv::parked_sequence&>(item));
              result.append(item);
            }
            std::vector<shadowkv::parked_sequence> parked;
            without_gil([&] { parked = s.park(slots); });
            for (std::size_t i = 0; i < parked.size(); ++i) *targets[i] = std::move(parked[i]);
            return result;
          },
          "slots"_a)
      .def(
          "resume",
          [](shadowkv::kv_store& s, const nb::sequence& items) {
            const std::size_t count = nb::len(items);
            std::vector<shadowkv::parked_sequence*> sources;
            sources.reserve(count);
            for (std::size_t i = 0; i < count; ++i) {
              shadowkv::parked_sequence* p = &nb::cast<shadowkv::parked_sequence&>(items[i]);
              for (std::size_t j = 0; j < sources.size(); ++j) {
                SHADOWKV_EXPECTS(sources[j] != p, "resume: parked[", i, "] is the same parked sequence as parked[", j,
                                 "]");
              }
              sources.push_back(p);
            }
            // kv_store::resume takes the objects by span: they move in for the call and back out after it (moves
            // cannot fail; the room is reserved first), emptied where they resumed.
            std::vector<shadowkv::parked_sequence> batch;
            batch.reserve(count);
            for (shadowkv::parked_sequence* p : sources) batch.push_back(std::move(*p));
            std::vector<int> slots;
            std::exception_ptr error;
            {
              nb::gil_scoped_release release;
              try {
                slots = s.resume(batch);
              } catch (...) {
                error = std::current_exception();
              }
            }
            for (std::size_t i = 0; i < count; ++i) *sources[i] = std::move(batch[i]);
            if (error) std::rethrow_exception(error);
            return slots;
          },
          "parked"_a)
      .def(
          "save",
          [](const shadowkv::kv_store& s, int slot, const nb::bytes& path) {
            const std::string file = to_path(path);
            without_gil([&] { s.save(slot, file); });
          },
          "slot"_a, "path"_a)
      .def(
          "load",
          [](shadowkv::kv_store& s, const nb::bytes& path) {
            const std::string file = to_path(path);
            int slot = -1;
            without_gil([&] { slot = s.load(file); });
            return slot;
          },
          "path"_a)
      .def(
          "account_replayed_steps",
          [](shadowkv::kv_store& s, int layer, const nb::sequence& slots, std::int64_t steps) {
            s.account_replayed_steps(layer, to_vector<int>(slots), steps);
          },
          "layer"_a, "slots"_a, "steps"_a)
      .def("selected_chunks", &shadowkv::kv_store::selected_chunks, "layer"_a, "slot"_a)
      .def("outlier_chunks", &shadowkv::kv_store::outlier_chunks, "layer"_a, "slot"_a)
      .def("attended_chunks", &shadowkv::kv_store::attended_chunks, "layer"_a, "slot"_a)
      .def(
          "sequence_info", [](const shadowkv::kv_store& s, int layer, int slot) { return info_dict(s.info(layer, slot)); },
          "layer"_a, "slot"_a)
      .def("memory_report", [](const shadowkv::kv_store& s) { return memory_dict(s.memory()); })
      .def(
          "layer_memory_after_prefill",
          [](const shadowkv::kv_store& s, std::int64_t tokens) { return memory_dict(s.layer_memory_after_prefill(tokens)); },
          "prompt_tokens"_a)
      .def_prop_ro("config", [](const shadowkv::kv_store& s) { return s.get_config(); })
      .def_prop_ro("device_value_budget", &shadowkv::kv_store::device_value_budget)
      .def_prop_ro("value_bytes_per_sequence", &shadowkv::kv_store::value_bytes_per_sequence)
      .def("stats", [](const shadowkv::kv_store& s) { return stats_dict(s.stats()); })
      .def("reset_stats", &shadowkv::kv_store::reset_stats);

  m.def("build_info", []() {
    const shadowkv::build_info info = shadowkv::get_build_info();
    nb::dict d;
    d["version"] = info.version;
    d["cuda_compiled"] = info.cuda_compiled;
    d["cuda_backend"] = info.cuda_backend;
    d["cuda_devices"] = info.cuda_devices;
    d["backends"] = info.backends;
    d["blas"] = info.blas;
    d["cuda_architectures"] = info.cuda_architectures;
    return d;
  });
}
