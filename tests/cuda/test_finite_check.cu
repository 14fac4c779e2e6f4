// launch_find_non_finite (the CUDA backend's all_finite) against the definition: a view is flagged exactly when one of
// the elements it addresses has all exponent bits set (±Inf, NaN of any payload and sign).
//
// What is checked, for float32, float16 and bfloat16 and for contiguous, cut, permuted, sliced, every-other-element,
// broadcast (zero-stride) and padded rank-4 views:
//   * a NaN/±Inf at the view's first, middle and last element (logical order), each of four encodings, is flagged;
//   * nothing is flagged when the view holds only finite values, the largest finite ones and subnormals included,
//     while every buffer element outside the view is NaN (so a kernel reading past the view's strides would fail);
//   * many views of mixed types in one call (more than one launch's worth) each get their own flag, and an empty
//     view is finite.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"
#include "device_layout.cuh"
#include "finite_check.cuh"

namespace {

using shadowkv::cuda::element_bf16;
using shadowkv::cuda::element_f16;
using shadowkv::cuda::element_f32;
using shadowkv::cuda::finite_check_view;

using namespace shadowkv::cuda::testing;

constexpr int kTypes[] = {element_f32, element_f16, element_bf16};

/// Raw bit patterns of one element type.
struct patterns {
  std::vector<std::uint32_t> non_finite;  ///< +Inf, -Inf, a quiet NaN, a negative NaN with another payload
  std::uint32_t largest;                  ///< the largest finite value
  std::uint32_t subnormal;                ///< the smallest positive subnormal
  std::uint32_t nan;                      ///< what fills the buffer outside the view
};

patterns patterns_of(int type) {
  switch (type) {
    case element_f16: return {{0x7c00U, 0xfc00U, 0x7e00U, 0xfd01U}, 0x7bffU, 0x0001U, 0x7e00U};
    case element_bf16: return {{0x7f80U, 0xff80U, 0x7fc0U, 0xffa1U}, 0x7f7fU, 0x0001U, 0x7fc0U};
    default: return {{0x7f800000U, 0xff800000U, 0x7fc00000U, 0xffa00001U}, 0x7f7fffffU, 0x00000001U, 0x7fc00000U};
  }
}

void store_bits(int type, std::vector<unsigned char>& bytes, std::size_t index, std::uint32_t bits) {
  if (type == element_f32) {
    std::memcpy(bytes.data() + index * 4, &bits, 4);
  } else {
    const auto half = static_cast<std::uint16_t>(bits);
    std::memcpy(bytes.data() + index * 2, &half, 2);
  }
}

/// A view of a buffer: shape and strides in elements, and its first element's index in the buffer.
struct layout {
  std::string name;
  std::vector<long long> shape;
  std::vector<long long> stride;
  long long start = 0;
  long long buffer_elements = 0;

  [[nodiscard]] long long elements() const {
    long long n = 1;
    for (const long long extent : shape) n *= extent;
    return n;
  }
  /// Buffer index of the element at logical (row-major) position `i`.
  [[nodiscard]] long long buffer_index(long long i) const {
    long long offset = start;
    for (int dim = static_cast<int>(shape.size()) - 1; dim >= 0; --dim) {
      offset += (i % shape[static_cast<std::size_t>(dim)]) * stride[static_cast<std::size_t>(dim)];
      i /= shape[static_cast<std::size_t>(dim)];
    }
    return offset;
  }
};

std::vector<layout> layouts() {
  return {
      // one long contiguous run: many blocks
      {"contiguous 1-d", {100003}, {1}, 0, 100003},
      {"contiguous [2, 37, 3, 64]", {2, 37, 3, 64}, {37 * 192, 192, 64, 1}, 0, 2 * 37 * 192},
      // row 1 of a [2, 50, 3, 64] batch cut to its 29 valid tokens (the store's ragged prefill rows)
      {"row of a padded batch", {1, 29, 3, 64}, {50 * 192, 192, 64, 1}, 50 * 192, 2 * 50 * 192},
      // [37, 3, 64] permuted to [3, 37, 64]
      {"permuted [3, 37, 64]", {3, 37, 64}, {64, 192, 1}, 0, 37 * 192},
      // the first 40 of 64 dims of [4, 5, 6, 64]
      {"last dim sliced", {4, 5, 6, 40}, {5 * 6 * 64, 6 * 64, 64, 1}, 0, 4 * 5 * 6 * 64},
      // every other element of a [3, 7, 11, 10] tensor
      {"every other element", {3, 7, 11, 5}, {770, 110, 10, 2}, 1, 3 * 770},
      // [9, 16] expanded to [4, 9, 16]
      {"broadcast (zero stride)", {4, 9, 16}, {0, 16, 1}, 0, 9 * 16},
      // nothing mergeable (every dim padded: the kernel unravels all four), large enough for several blocks
      {"padded rank 4", {3, 50, 5, 33}, {50 * 7 * 40 + 40, 7 * 40, 40, 1}, 0, 3 * (50 * 7 * 40 + 40)},
  };
}

/// The buffer of `view`: NaN everywhere outside the view, finite values inside (random, plus the largest finite
/// value at both ends and a subnormal in the middle).
std::vector<unsigned char> make_buffer(int type, const layout& view, std::mt19937_64& rng) {
  const patterns p = patterns_of(type);
  std::vector<unsigned char> bytes(static_cast<std::size_t>(view.buffer_elements) * element_bytes(type));
  for (long long i = 0; i < view.buffer_elements; ++i) store_bits(type, bytes, static_cast<std::size_t>(i), p.nan);
  std::normal_distribution<float> normal(0.0F, 3.0F);
  const long long n = view.elements();
  for (long long i = 0; i < n; ++i) {
    store_element(type, bytes, static_cast<std::size_t>(view.buffer_index(i)), normal(rng));
  }
  store_bits(type, bytes, static_cast<std::size_t>(view.buffer_index(0)), p.largest);
  store_bits(type, bytes, static_cast<std::size_t>(view.buffer_index(n - 1)), p.largest | (type == element_f32 ? 0x80000000U : 0x8000U));
  store_bits(type, bytes, static_cast<std::size_t>(view.buffer_index(n / 2)), p.subnormal);
  return bytes;
}

/// The view of `view` in `buffer` (device memory holding the whole buffer): its data points at the first element.
finite_check_view view_of(const void* buffer, int type, const layout& view) {
  finite_check_view v;
  v.data = static_cast<const unsigned char*>(buffer) + view.start * static_cast<long long>(element_bytes(type));
  v.type = type;
  v.rank = static_cast<int>(view.shape.size());
  for (int dim = 0; dim < v.rank; ++dim) {
    v.shape[dim] = view.shape[static_cast<std::size_t>(dim)];
    v.stride[dim] = view.stride[static_cast<std::size_t>(dim)];
  }
  return v;
}

/// Runs the check over `views` (pointers into device memory) and returns the flags.
std::vector<int> run_check(const std::vector<finite_check_view>& views, cudaStream_t stream) {
  device_buffer flags(views.size() * sizeof(int) + sizeof(int));
  std::vector<int> result;
  EXPECT_TRUE(flags.ok());
  // A sentinel past the last flag: the launcher must not write it.
  std::vector<int> initial(views.size() + 1, 0);
  initial.back() = 12345;
  EXPECT_EQ(upload(flags, initial), cudaSuccess);
  shadowkv::cuda::launch_find_non_finite(views.data(), static_cast<int>(views.size()), flags.get<int>(), stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(download(result, flags.get<int>(), views.size() + 1), cudaSuccess);
  EXPECT_EQ(result.back(), 12345) << "a flag past the last view was written";
  result.pop_back();
  return result;
}

class FiniteCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!device_present()) GTEST_SKIP() << "no CUDA device: launch_find_non_finite is not exercised";
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

TEST_F(FiniteCheck, FlagsNonFiniteAtFirstMiddleAndLastOfEveryLayoutAndType) {
  const std::uint64_t seed = 0xF1417EULL;
  std::printf("[ finite_check ] seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (const int type : kTypes) {
    const patterns p = patterns_of(type);
    for (const layout& view : layouts()) {
      const long long n = view.elements();
      const std::vector<unsigned char> clean = make_buffer(type, view, rng);
      struct planted {
        std::string what;
        long long position;  // -1: none
        std::uint32_t bits;
      };
      std::vector<planted> cases{{"all finite (NaN only outside the view)", -1, 0}};
      for (std::size_t k = 0; k < p.non_finite.size(); ++k) {
        char bits[16];
        std::snprintf(bits, sizeof(bits), "0x%x", p.non_finite[k]);
        cases.push_back({std::string("first ") + bits, 0, p.non_finite[k]});
        cases.push_back({std::string("middle ") + bits, n / 2 + 1, p.non_finite[k]});
        cases.push_back({std::string("last ") + bits, n - 1, p.non_finite[k]});
      }
      cases.push_back({"random position", static_cast<long long>(rng() % static_cast<std::uint64_t>(n)),
                       p.non_finite[rng() % p.non_finite.size()]});
      // One buffer per case, all checked in one call.
      std::vector<device_buffer> buffers;
      std::vector<finite_check_view> views;
      for (const planted& c : cases) {
        std::vector<unsigned char> bytes = clean;
        if (c.position >= 0) store_bits(type, bytes, static_cast<std::size_t>(view.buffer_index(c.position)), c.bits);
        buffers.emplace_back(bytes.size());
        ASSERT_TRUE(buffers.back().ok());
        ASSERT_EQ(upload(buffers.back(), bytes), cudaSuccess);
        views.push_back(view_of(buffers.back().get(), type, view));
      }
      const std::vector<int> flags = run_check(views, stream_);
      ASSERT_EQ(flags.size(), cases.size());
      for (std::size_t i = 0; i < cases.size(); ++i) {
        EXPECT_EQ(flags[i], cases[i].position >= 0 ? 1 : 0)
            << type_name(type) << ", " << view.name << ", " << cases[i].what << " (position " << cases[i].position
            << " of " << n << ", seed " << seed << ")";
        ++checked;
      }
    }
  }
  std::printf("[ finite_check ] %d views checked\n", checked);
}

TEST_F(FiniteCheck, MixedViewsInOneCallEachGetTheirOwnFlag) {
  const std::uint64_t seed = 0xF1418EULL;
  std::printf("[ finite_check ] seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const std::vector<layout> all = layouts();
  std::vector<device_buffer> buffers;
  std::vector<finite_check_view> views;
  std::vector<int> expected;
  for (int i = 0; i < 41; ++i) {
    const int type = kTypes[rng() % 3];
    const layout& view = all[rng() % all.size()];
    std::vector<unsigned char> bytes = make_buffer(type, view, rng);
    const bool bad = rng() % 3 == 0;
    if (bad) {
      const patterns p = patterns_of(type);
      store_bits(type, bytes, static_cast<std::size_t>(view.buffer_index(static_cast<long long>(rng() % view.elements()))),
                 p.non_finite[rng() % p.non_finite.size()]);
    }
    buffers.emplace_back(bytes.size());
    ASSERT_TRUE(buffers.back().ok());
    ASSERT_EQ(upload(buffers.back(), bytes), cudaSuccess);
    views.push_back(view_of(buffers.back().get(), type, view));
    expected.push_back(bad ? 1 : 0);
  }
  // An empty view (a zero extent; its pointer is never read) is finite.
  finite_check_view empty = views.front();
  empty.shape[0] = 0;
  views.push_back(empty);
  expected.push_back(0);
  const std::vector<int> flags = run_check(views, stream_);
  EXPECT_EQ(flags, expected) << "seed " << seed;
}

}  // namespace
