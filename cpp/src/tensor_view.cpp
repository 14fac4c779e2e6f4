#include "shadowkv/tensor_view.hpp"


#include "shadowkv/errors.hpp"

namespace shadowkv {

std::string_view dtype_name(dtype type) noexcept {
  switch (type) {
    case dtype::float16: return "float16";
    case dtype::bfloat16: return "bfloat16";
    case dtype::float32: break;
  }
  return "float32";
}

dtype parse_dtype(std::string_view name) {
  if (name == "float32" || name == "fp32" || name == "float") return dtype::float32;
  if (name == "float16" || name == "fp16" || name == "half") return dtype::float16;
  if (name == "bfloat16" || name == "bf16") return dtype::bfloat16;
  throw invalid_argument(
      detail::format_message("dtype must be 'float32', 'float16' or 'bfloat16', got '", name, "'"));
}

std::string to_string(const device& where) {
  return where.type == device_type::cpu ? std::string("cpu") : "cuda:" + std::to_string(where.index);
}

device parse_device(const std::string& name) {
  if (name == "cpu") return {device_type::cpu, 0};
  if (name == "cuda") return {device_type::cuda, 0};
  if (name.rfind("cuda:", 0) == 0 && name.size() > 5) {
    const std::string ordinal = name.substr(5);
    if (ordinal.find_first_not_of("0123456789") == std::string::npos && ordinal.size() < 6) {
      return {device_type::cuda, std::stoi(ordinal)};
    }
  }
  throw invalid_argument(detail::format_message("device must be 'cpu', 'cuda' or 'cuda:N', got '", name, "'"));
}

std::string tensor_view::describe() const {
  std::string text = "[";
  for (int dim = 0; dim < rank; ++dim) text += detail::format_message(dim ? ", " : "", shape[dim]);
  text += "] ";
  text += is_integer ? (int_type == index_type::int32 ? "int32" : "int64") : std::string(dtype_name(float_type));
  return detail::format_message(text, " on ", to_string(where));
}

namespace {

void fill_contiguous(tensor_view& view, std::initializer_list<std::int64_t> shape) {
  SHADOWKV_ASSERT(shape.size() <= static_cast<std::size_t>(max_tensor_rank));
  view.rank = static_cast<int>(shape.size());
  int dim = 0;
  for (const std::int64_t extent : shape) view.shape[dim++] = extent;
  std::int64_t stride = 1;
  for (dim = view.rank - 1; dim >= 0; --dim) {
    view.strides[dim] = stride;
    stride *= view.shape[dim];
  }
}

}  // namespace

tensor_view make_contiguous_view(const void* data, dtype type, device where,
                                 std::initializer_list<std::int64_t> shape) {
  tensor_view view;
  view.data = data;
  view.float_type = type;
  view.where = where;
  fill_contiguous(view, shape);
  return view;
}

mutable_tensor_view make_contiguous_output_view(void* data, dtype type, device where,
                                                std::initializer_list<std::int64_t> shape) {
  mutable_tensor_view view;
  view.data = data;
  view.float_type = type;
  view.where = where;
  fill_contiguous(view, shape);
  return view;
}

tensor_view make_contiguous_index_view(const void* data, index_type type, device where,
                                       std::initializer_list<std::int64_t> shape) {
  tensor_view view;
  view.data = data;
  view.is_integer = true;
  view.int_type = type;
  view.where = where;
  fill_contiguous(view, shape);
  return view;
}

std::int64_t load_index(const tensor_view& view, std::int64_t offset) noexcept {
  if (view.int_type == index_type::int32) return static_cast<const std::int32_t*>(view.data)[offset];
  return static_cast<const std::int64_t*>(view.data)[offset];
}

}  // namespace shadowkv
