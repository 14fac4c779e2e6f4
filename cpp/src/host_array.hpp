// host_array: elements of one storage dtype in plain host memory, read and written as float.
//
// The CPU backend keeps keys, values and landmarks at the store's dtype (so that memory_report() is what is really
// held, and rounding matches what a GPU stores) and converts whole rows to float for arithmetic.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "shadowkv/dtype.hpp"

namespace shadowkv::detail {

class host_array {
 public:
  explicit host_array(dtype type = dtype::float32) noexcept : type_(type) {}

  [[nodiscard]] dtype type() const noexcept { return type_; }
  [[nodiscard]] std::int64_t size() const noexcept {
    return static_cast<std::int64_t>(bytes_.size() / dtype_size(type_));
  }
  [[nodiscard]] std::int64_t bytes() const noexcept { return static_cast<std::int64_t>(bytes_.size()); }
  /// Elements it holds room for without reallocating.
  [[nodiscard]] std::int64_t capacity() const noexcept {
    return static_cast<std::int64_t>(bytes_.capacity() / dtype_size(type_));
  }

  /// Grows or shrinks to `count` elements; new elements are zero.
  void resize(std::int64_t count) { bytes_.resize(static_cast<std::size_t>(count) * dtype_size(type_), 0); }
  /// Reserves room for `count` elements so that later growth up to it cannot throw.
  void reserve(std::int64_t count) { bytes_.reserve(static_cast<std::size_t>(count) * dtype_size(type_)); }

  [[nodiscard]] float get(std::int64_t index) const noexcept { return load_element(bytes_.data(), type_, index); }
  void set(std::int64_t index, float value) noexcept { store_element(bytes_.data(), type_, index, value); }

  /// Converts `count` elements from `offset` to float.
  void load(std::int64_t offset, std::int64_t count, float* destination) const noexcept {
    for (std::int64_t i = 0; i < count; ++i) destination[i] = get(offset + i);
  }
  /// `count` elements from `offset` as float: a pointer into the array itself when it holds float32 (valid until the
  /// array is next changed), else `scratch` (room for `count` floats) after converting the elements into it.
  [[nodiscard]] const float* floats(std::int64_t offset, std::int64_t count, float* scratch) const noexcept {
    if (type_ == dtype::float32) return reinterpret_cast<const float*>(bytes_.data()) + offset;
    load(offset, count, scratch);
    return scratch;
  }
  /// Rounds `count` floats to the dtype and writes them from `offset`.
  void store(std::int64_t offset, std::int64_t count, const float* source) noexcept {
    for (std::int64_t i = 0; i < count; ++i) set(offset + i, source[i]);
  }
  /// Appends `count` floats rounded to the dtype (reserve first to make it non-throwing).
  void append(std::int64_t count, const float* source) {
    const std::int64_t offset = size();
    resize(offset + count);
    store(offset, count, source);
  }
  /// Copies `count` elements from `source` at `source_offset` to `offset` (same dtype, no rounding).
  void copy_from(const host_array& source, std::int64_t source_offset, std::int64_t offset,
                 std::int64_t count) noexcept {
    const std::size_t element = dtype_size(type_);
    std::memcpy(bytes_.data() + static_cast<std::size_t>(offset) * element,
                source.bytes_.data() + static_cast<std::size_t>(source_offset) * element,
                static_cast<std::size_t>(count) * element);
  }
  /// Appends `count` elements of `source` (same dtype) from `source_offset` (reserve first to make it non-throwing).
  void append_copy(const host_array& source, std::int64_t source_offset, std::int64_t count) {
    const std::int64_t offset = size();
    resize(offset + count);
    copy_from(source, source_offset, offset, count);
  }
  /// Inserts `count` elements of `source` (same dtype, another array) from `source_offset` before element `offset`
  /// (reserve first to make it non-throwing).
  void insert_copy(std::int64_t offset, const host_array& source, std::int64_t source_offset, std::int64_t count) {
    const std::size_t element = dtype_size(type_);
    const auto from = source.bytes_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(source_offset) * element);
    bytes_.insert(bytes_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(offset) * element), from,
                  from + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(count) * element));
  }
  /// The elements' bytes as held (a saved sequence's sections).
  [[nodiscard]] std::span<const std::byte> raw_bytes() const noexcept { return std::as_bytes(std::span(bytes_)); }
  /// Makes the array hold the elements whose bytes are `raw` (as raw_bytes gave them; whole elements of the dtype).
  void assign_raw_bytes(std::span<const std::byte> raw) {
    const auto* first = reinterpret_cast<const std::uint8_t*>(raw.data());
    bytes_.assign(first, first + raw.size());
  }
  /// Removes `count` elements starting at `offset`.
  void erase(std::int64_t offset, std::int64_t count) noexcept {
    const std::size_t element = dtype_size(type_);
    const auto first = bytes_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(offset) * element);
    bytes_.erase(first, first + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(count) * element));
  }

 private:
  dtype type_;
  std::vector<std::uint8_t> bytes_;
};

}  // namespace shadowkv::detail
