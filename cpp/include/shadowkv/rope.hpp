// Rotary position embedding as the store applies and removes it (docs/semantics.md, "RoPE").
#pragma once

#include <cstdint>
#include <vector>

#include "shadowkv/config.hpp"

namespace shadowkv {

/// The rotation of one configuration: inverse frequencies, style, rotary dims and attention scaling.
class rope_rotation {
 public:
  /// Takes inv_freq from the config, or computes theta^(-2i/rotary_dim).
  explicit rope_rotation(const config& cfg);

  /// Rotates one head vector `x[head_dim]` in place to `position`.
  void apply(float* x, std::int64_t position) const noexcept;

  /// Inverse of apply(): un-rotates a post-RoPE head vector in place.
  void remove(float* x, std::int64_t position) const noexcept;

  [[nodiscard]] const std::vector<float>& inv_freq() const noexcept { return inv_freq_; }
  [[nodiscard]] int rotary_dim() const noexcept { return rotary_dim_; }

 private:
  void rotate(float* x, std::int64_t position, bool inverse) const noexcept;

  std::vector<float> inv_freq_;
  int rotary_dim_;
  rope_style style_;
  float scaling_;
};

/// Inverse frequencies theta^(-2i/rotary_dim), i < rotary_dim/2, rounded to float32.
std::vector<float> default_inv_freq(double theta, int rotary_dim);

}  // namespace shadowkv
