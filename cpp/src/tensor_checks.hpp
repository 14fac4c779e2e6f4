// Argument checks shared by the store's entry points: shapes, element types and devices of caller tensors.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "shadowkv/tensor_view.hpp"

namespace shadowkv::detail {

/// Any extent is accepted in a dimension marked `any_extent`.
inline constexpr std::int64_t any_extent = -1;

/// Throws invalid_argument unless `view` is a floating-point tensor on `where` with the given shape.
void expect_float_tensor(const tensor_view& view, std::string_view name, device where,
                         std::initializer_list<std::int64_t> shape);

/// Throws invalid_argument unless `view` is an int32/int64 tensor on `where` with the given shape.
void expect_index_tensor(const tensor_view& view, std::string_view name, device where,
                         std::initializer_list<std::int64_t> shape);

/// Returns `view` [d0, d1, d2] as [d0, 1, d1, d2] (a zero stride for the new dimension).
tensor_view insert_unit_dim(const tensor_view& view);

/// Returns `view` [d0, ...] cut to [count, ...] starting at row `start` of dimension 0 (no copy).
tensor_view narrow_rows(const tensor_view& view, std::int64_t start, std::int64_t count);
/// As narrow_rows, for an output.
mutable_tensor_view narrow_rows(const mutable_tensor_view& view, std::int64_t start, std::int64_t count);

/// Returns `view` [d0, d1, ...] cut to [d0, count, ...] starting at index `start` of dimension 1 (no copy).
tensor_view narrow_tokens(const tensor_view& view, std::int64_t start, std::int64_t count);
/// As narrow_tokens, for an output.
mutable_tensor_view narrow_tokens(const mutable_tensor_view& view, std::int64_t start, std::int64_t count);

/// Returns `view` [d0, d1, d2, ...] at index `token` of dimension 1, as [d0, d2, ...] (no copy).
tensor_view select_token(const tensor_view& view, std::int64_t token);
/// As select_token, for an output.
mutable_tensor_view select_token(const mutable_tensor_view& view, std::int64_t token);

}  // namespace shadowkv::detail
