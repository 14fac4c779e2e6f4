// value_store_array: the CPU backend's value store of one (sequence, layer), in the configured value format.
//
// Runs are (chunk, KV head) pairs in chunk-major order (index chunk * Hkv + head), each C x D values, as on the GPU.
// Format `same`: the store's dtype (a host_array). Format `fp8_e4m3`: one e4m3 code per value and one float32 scale
// per run (shadowkv/fp8.hpp, the rule the CUDA kernels share). Values come in as float and are first rounded to the
// store's dtype, so an fp8 store quantizes exactly what a non-fp8 store would hold.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "host_array.hpp"
#include "shadowkv/config.hpp"
#include "shadowkv/fp8.hpp"

namespace shadowkv::detail {

class value_store_array {
 public:
  value_store_array() = default;
  value_store_array(dtype type, value_format format, std::int64_t run)
      : type_(type), format_(format), run_(run), same_(type) {}

  [[nodiscard]] std::int64_t runs() const noexcept {
    return format_ == value_format::fp8_e4m3 ? static_cast<std::int64_t>(scales_.size())
                                             : (run_ == 0 ? 0 : same_.size() / run_);
  }
  /// Bytes held (codes and scales for fp8).
  [[nodiscard]] std::int64_t bytes() const noexcept {
    return format_ == value_format::fp8_e4m3
               ? static_cast<std::int64_t>(codes_.size() + scales_.size() * sizeof(float))
               : same_.bytes();
  }
  /// Bytes one run occupies (what a fetch of it reads).
  [[nodiscard]] std::int64_t run_bytes() const noexcept {
    return format_ == value_format::fp8_e4m3 ? run_ + static_cast<std::int64_t>(sizeof(float))
                                             : run_ * static_cast<std::int64_t>(dtype_size(type_));
  }

  /// Runs it holds room for without reallocating.
  [[nodiscard]] std::int64_t capacity_runs() const noexcept {
    if (run_ == 0) return 0;
    if (format_ == value_format::fp8_e4m3) {
      return std::min(static_cast<std::int64_t>(scales_.capacity()),
                      static_cast<std::int64_t>(codes_.capacity()) / run_);
    }
    return same_.capacity() / run_;
  }

  /// Reserves room for `count` runs in all, so that appending up to it cannot throw.
  void reserve_runs(std::int64_t count) {
    if (format_ == value_format::fp8_e4m3) {
      codes_.reserve(static_cast<std::size_t>(count * run_));
      scales_.reserve(static_cast<std::size_t>(count));
    } else {
      same_.reserve(count * run_);
    }
  }

  /// Appends one run of `run` values.
  void append_run(const float* values) {
    if (format_ != value_format::fp8_e4m3) {
      same_.append(run_, values);
      return;
    }
    float amax = 0.0F;
    for (std::int64_t i = 0; i < run_; ++i) amax = std::max(amax, std::fabs(round_to(type_, values[i])));
    const float scale = fp8::scale_for(amax);
    for (std::int64_t i = 0; i < run_; ++i) codes_.push_back(fp8::encode_e4m3(round_to(type_, values[i]) / scale));
    scales_.push_back(scale);
  }

  /// Removes the last `count` runs.
  void pop_runs(std::int64_t count) noexcept {
    const std::int64_t keep = runs() - count;
    if (format_ == value_format::fp8_e4m3) {
      codes_.erase(codes_.begin() + static_cast<std::ptrdiff_t>(keep * run_), codes_.end());
      scales_.erase(scales_.begin() + static_cast<std::ptrdiff_t>(keep), scales_.end());
    } else {
      same_.erase(keep * run_, count * run_);
    }
  }

  // The bytes held, for a saved sequence: format `same` holds values only; fp8 holds codes and scales.
  [[nodiscard]] std::span<const std::byte> raw_values() const noexcept { return same_.raw_bytes(); }
  [[nodiscard]] std::span<const std::byte> raw_codes() const noexcept { return std::as_bytes(std::span(codes_)); }
  [[nodiscard]] std::span<const std::byte> raw_scales() const noexcept { return std::as_bytes(std::span(scales_)); }
  void assign_raw_values(std::span<const std::byte> raw) { same_.assign_raw_bytes(raw); }
  void assign_raw_codes(std::span<const std::byte> raw) {
    const auto* first = reinterpret_cast<const std::uint8_t*>(raw.data());
    codes_.assign(first, first + raw.size());
  }
  void assign_raw_scales(std::span<const std::byte> raw) {
    scales_.resize(raw.size() / sizeof(float));
    if (!raw.empty()) std::memcpy(scales_.data(), raw.data(), scales_.size() * sizeof(float));
  }

  /// Writes run `index` into `target` (the store's dtype) at element `offset`: a copy, or the dequantized codes.
  void read_run(std::int64_t index, host_array& target, std::int64_t offset) const noexcept {
    if (format_ != value_format::fp8_e4m3) {
      target.copy_from(same_, index * run_, offset, run_);
      return;
    }
    const float scale = scales_[static_cast<std::size_t>(index)];
    const std::uint8_t* codes = codes_.data() + index * run_;
    for (std::int64_t i = 0; i < run_; ++i) target.set(offset + i, fp8::decode_e4m3(codes[i]) * scale);
  }

 private:
  dtype type_ = dtype::float32;
  value_format format_ = value_format::same;
  std::int64_t run_ = 0;
  host_array same_;
  std::vector<std::uint8_t> codes_;
  std::vector<float> scales_;
};

}  // namespace shadowkv::detail
