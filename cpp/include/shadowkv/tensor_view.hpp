// A non-owning, strided view of a caller's tensor: how tensors cross the API boundary.
//
// Bindings fill it from DLPack / array-interface tensors without copying, so any framework (PyTorch, CuPy, JAX,
// NumPy) or a plain C++ caller can pass its own memory. Strides are in elements, as in DLPack.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "shadowkv/dtype.hpp"

namespace shadowkv {

/// Where a tensor's memory lives.
enum class device_type : std::uint8_t { cpu, cuda };

/// A device: type and ordinal (the ordinal is 0 for the CPU).
struct device {
  device_type type = device_type::cpu;
  int index = 0;

  friend bool operator==(const device& a, const device& b) noexcept {
    return a.type == b.type && a.index == b.index;
  }
  friend bool operator!=(const device& a, const device& b) noexcept { return !(a == b); }
};

/// "cpu" or "cuda:N".
std::string to_string(const device& where);

/// Parses "cpu", "cuda" or "cuda:N"; throws invalid_argument otherwise.
device parse_device(const std::string& name);

/// Element type of an integer tensor (positions, lengths).
enum class index_type : std::uint8_t { int32, int64 };

inline constexpr int max_tensor_rank = 4;

/// A strided view of floating-point or integer data owned by the caller. Shape and strides are in elements.
struct tensor_view {
  const void* data = nullptr;
  bool is_integer = false;
  dtype float_type = dtype::float32;       ///< element type when !is_integer
  index_type int_type = index_type::int64;  ///< element type when is_integer
  device where{};
  int rank = 0;
  std::array<std::int64_t, max_tensor_rank> shape{};
  std::array<std::int64_t, max_tensor_rank> strides{};

  /// True for a view that refers to no tensor (an optional argument left out).
  [[nodiscard]] bool empty() const noexcept { return data == nullptr && rank == 0; }

  /// Offset in elements of the element at `index` (one coordinate per dimension).
  [[nodiscard]] std::int64_t offset(std::initializer_list<std::int64_t> index) const noexcept {
    std::int64_t result = 0;
    int dim = 0;
    for (const std::int64_t coordinate : index) result += coordinate * strides[dim++];
    return result;
  }

  /// "[2, 128, 8, 64] bfloat16 on cpu" — used in error messages.
  [[nodiscard]] std::string describe() const;
};

/// A writable view (outputs).
struct mutable_tensor_view : tensor_view {
  [[nodiscard]] void* mutable_data() const noexcept { return const_cast<void*>(data); }
};

/// Makes a contiguous (row-major) float view of `data` with the given shape (an input: keys, values, queries).
tensor_view make_contiguous_view(const void* data, dtype type, device where,
                                 std::initializer_list<std::int64_t> shape);

/// Makes a contiguous (row-major) writable float view of `data` with the given shape: the `out` argument of
/// kv_store::decode ([B, num_q_heads, head_dim], on the store's device). `data` must hold the product of `shape`
/// elements of `type` on `where` and outlive the call that writes it; nothing is checked or allocated here (decode
/// checks the shape, dtype and device and throws invalid_argument). At most max_tensor_rank dimensions.
mutable_tensor_view make_contiguous_output_view(void* data, dtype type, device where,
                                                std::initializer_list<std::int64_t> shape);

/// Makes a contiguous (row-major) integer view of `data` with the given shape.
tensor_view make_contiguous_index_view(const void* data, index_type type, device where,
                                       std::initializer_list<std::int64_t> shape);

/// Reads integer element at `index` of an integer view as int64.
std::int64_t load_index(const tensor_view& view, std::int64_t offset) noexcept;

}  // namespace shadowkv
