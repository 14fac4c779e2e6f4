#include "tensor_checks.hpp"

#include <cstddef>


#include "shadowkv/errors.hpp"

namespace shadowkv::detail {
namespace {

std::string shape_text(std::initializer_list<std::int64_t> shape) {
  std::string text = "[";
  bool first = true;
  for (const std::int64_t extent : shape) {
    text += first ? "" : ", ";
    text += extent == any_extent ? std::string("*") : format_message(extent);
    first = false;
  }
  return text + "]";
}

void expect_shape_and_device(const tensor_view& view, std::string_view name, device where,
                             std::initializer_list<std::int64_t> shape) {
  SHADOWKV_EXPECTS(!view.empty(), name, " is required");
  bool matches = view.rank == static_cast<int>(shape.size());
  int dim = 0;
  for (const std::int64_t extent : shape) {
    if (!matches) break;
    matches = extent == any_extent || view.shape[dim] == extent;
    ++dim;
  }
  SHADOWKV_EXPECTS(matches, name, " must have shape ", shape_text(shape), ", got ", view.describe());
  SHADOWKV_EXPECTS(view.where == where, name, " must be on ", to_string(where), " (the store's device), got ",
                   view.describe());
  std::int64_t elements = 1;
  for (dim = 0; dim < view.rank; ++dim) {
    SHADOWKV_EXPECTS(view.shape[dim] >= 0, name, " has a negative extent: ", view.describe());
    elements *= view.shape[dim];
  }
  SHADOWKV_EXPECTS(elements == 0 || view.data != nullptr, name, " has no data pointer: ", view.describe());
}

}  // namespace

void expect_float_tensor(const tensor_view& view, std::string_view name, device where,
                         std::initializer_list<std::int64_t> shape) {
  expect_shape_and_device(view, name, where, shape);
  SHADOWKV_EXPECTS(!view.is_integer, name, " must be float32, float16 or bfloat16, got ", view.describe());
}

void expect_index_tensor(const tensor_view& view, std::string_view name, device where,
                         std::initializer_list<std::int64_t> shape) {
  expect_shape_and_device(view, name, where, shape);
  SHADOWKV_EXPECTS(view.is_integer, name, " must be int32 or int64, got ", view.describe());
}

tensor_view insert_unit_dim(const tensor_view& view) {
  SHADOWKV_ASSERT(view.rank == 3);
  tensor_view result = view;
  result.rank = 4;
  result.shape = {view.shape[0], 1, view.shape[1], view.shape[2]};
  result.strides = {view.strides[0], 0, view.strides[1], view.strides[2]};
  return result;
}

namespace {

std::int64_t element_bytes(const tensor_view& view) {
  if (view.is_integer) return view.int_type == index_type::int32 ? 4 : 8;
  return static_cast<std::int64_t>(dtype_size(view.float_type));
}


// `view` cut to `count` indices of dimension `dim` from `start` (no copy).
tensor_view narrow_dim(const tensor_view& view, int dim, std::int64_t start, std::int64_t count) {
  const auto d = static_cast<std::size_t>(dim);
  SHADOWKV_ASSERT(view.rank > dim && start >= 0 && count >= 0 && start + count <= view.shape[d]);
  tensor_view result = view;
  result.data = static_cast<const std::byte*>(view.data) + start * view.strides[d] * element_bytes(view);
  result.shape[d] = count;
  return result;
}

template <typename View>
View narrowed(const View& view, int dim, std::int64_t start, std::int64_t count) {
  View result = view;
  static_cast<tensor_view&>(result) = narrow_dim(view, dim, start, count);
  return result;
}

}  // namespace

tensor_view narrow_rows(const tensor_view& view, std::int64_t start, std::int64_t count) {
  return narrowed(view, 0, start, count);
}

mutable_tensor_view narrow_rows(const mutable_tensor_view& view, std::int64_t start, std::int64_t count) {
  return narrowed(view, 0, start, count);
}

tensor_view narrow_tokens(const tensor_view& view, std::int64_t start, std::int64_t count) {
  return narrowed(view, 1, start, count);
}

mutable_tensor_view narrow_tokens(const mutable_tensor_view& view, std::int64_t start, std::int64_t count) {
  return narrowed(view, 1, start, count);
}

tensor_view select_token(const tensor_view& view, std::int64_t token) {
  tensor_view result = narrow_tokens(view, token, 1);
  for (int dim = 1; dim + 1 < view.rank; ++dim) {
    result.shape[static_cast<std::size_t>(dim)] = view.shape[static_cast<std::size_t>(dim + 1)];
    result.strides[static_cast<std::size_t>(dim)] = view.strides[static_cast<std::size_t>(dim + 1)];
  }
  result.shape[static_cast<std::size_t>(view.rank - 1)] = 0;
  result.strides[static_cast<std::size_t>(view.rank - 1)] = 0;
  result.rank = view.rank - 1;
  return result;
}

mutable_tensor_view select_token(const mutable_tensor_view& view, std::int64_t token) {
  mutable_tensor_view result = view;
  static_cast<tensor_view&>(result) = select_token(static_cast<const tensor_view&>(view), token);
  return result;
}

}  // namespace shadowkv::detail
