#include "shadowkv/rope.hpp"

#include <cmath>

namespace shadowkv {

std::vector<float> default_inv_freq(double theta, int rotary_dim) {
  std::vector<float> result(static_cast<std::size_t>(rotary_dim / 2));
  for (int i = 0; i < rotary_dim / 2; ++i) {
    const double exponent = static_cast<double>(2 * i) / static_cast<double>(rotary_dim);
    result[static_cast<std::size_t>(i)] = static_cast<float>(1.0 / std::pow(theta, exponent));
  }
  return result;
}

rope_rotation::rope_rotation(const config& cfg)
    : inv_freq_(cfg.inv_freq.empty() ? default_inv_freq(cfg.rope_theta, cfg.effective_rotary_dim()) : cfg.inv_freq),
      rotary_dim_(cfg.effective_rotary_dim()),
      style_(cfg.rope),
      scaling_(cfg.attention_scaling) {}

void rope_rotation::apply(float* x, std::int64_t position) const noexcept { rotate(x, position, false); }

void rope_rotation::remove(float* x, std::int64_t position) const noexcept { rotate(x, position, true); }

void rope_rotation::rotate(float* x, std::int64_t position, bool inverse) const noexcept {
  const int half = rotary_dim_ / 2;
  // The angle is a float32 product, as transformers computes it; cos/sin of that float are then exact-rounded.
  const float position_f = static_cast<float>(position);
  for (int i = 0; i < half; ++i) {
    const float angle = position_f * inv_freq_[static_cast<std::size_t>(i)];
    double cos_a = std::cos(static_cast<double>(angle));
    double sin_a = std::sin(static_cast<double>(angle));
    if (inverse) {
      cos_a = cos_a / scaling_;
      sin_a = -sin_a / scaling_;
    } else {
      cos_a = static_cast<double>(static_cast<float>(cos_a) * scaling_);
      sin_a = static_cast<double>(static_cast<float>(sin_a) * scaling_);
    }
    const int first = style_ == rope_style::half_split ? i : 2 * i;
    const int second = style_ == rope_style::half_split ? i + half : 2 * i + 1;
    const double x1 = x[first];
    const double x2 = x[second];
    x[first] = static_cast<float>(x1 * cos_a - x2 * sin_a);
    x[second] = static_cast<float>(x2 * cos_a + x1 * sin_a);
  }
}

}  // namespace shadowkv
