// Tensor views (shadowkv/tensor_view.hpp): the contiguous factories' shapes and strides, and
// make_contiguous_output_view as decode's `out` — it writes the same output as a view built field by field, and a
// view of the wrong shape is rejected before the store changes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "shadowkv/config.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/store.hpp"
#include "shadowkv/tensor_view.hpp"
#include "store_test_support.hpp"

namespace {

using shadowkv::device;
using shadowkv::device_type;
using shadowkv::dtype;
using shadowkv::mutable_tensor_view;
using shadowkv::tensor_view;
using shadowkv_test::view_of;

TEST(TensorView, OutputViewIsContiguousRowMajorAndWritable) {
  std::vector<std::uint16_t> storage(2 * 4 * 64);
  const device gpu{device_type::cuda, 1};
  const mutable_tensor_view out = shadowkv::make_contiguous_output_view(storage.data(), dtype::bfloat16, gpu, {2, 4, 64});
  EXPECT_EQ(out.mutable_data(), static_cast<void*>(storage.data()));
  EXPECT_EQ(out.data, static_cast<const void*>(storage.data()));
  EXPECT_FALSE(out.is_integer);
  EXPECT_FALSE(out.empty());
  EXPECT_EQ(out.float_type, dtype::bfloat16);
  EXPECT_EQ(out.where, gpu);
  ASSERT_EQ(out.rank, 3);
  EXPECT_EQ(out.shape[0], 2);
  EXPECT_EQ(out.shape[1], 4);
  EXPECT_EQ(out.shape[2], 64);
  EXPECT_EQ(out.strides[0], 256);
  EXPECT_EQ(out.strides[1], 64);
  EXPECT_EQ(out.strides[2], 1);
  EXPECT_EQ(out.offset({1, 2, 3}), 256 + 128 + 3);
  EXPECT_EQ(out.describe(), "[2, 4, 64] bfloat16 on cuda:1");
}

TEST(TensorView, OutputViewMatchesTheInputFactoryAtEveryRank) {
  float element = 0.0F;
  const auto same_layout = [](const tensor_view& a, const tensor_view& b) {
    if (a.rank != b.rank || a.data != b.data || a.float_type != b.float_type || a.where != b.where) return false;
    for (int dim = 0; dim < a.rank; ++dim) {
      if (a.shape[dim] != b.shape[dim] || a.strides[dim] != b.strides[dim]) return false;
    }
    return true;
  };
  EXPECT_TRUE(same_layout(shadowkv::make_contiguous_output_view(&element, dtype::float32, {}, {7}),
                          shadowkv::make_contiguous_view(&element, dtype::float32, {}, {7})));
  EXPECT_TRUE(same_layout(shadowkv::make_contiguous_output_view(&element, dtype::float16, {}, {3, 5}),
                          shadowkv::make_contiguous_view(&element, dtype::float16, {}, {3, 5})));
  const mutable_tensor_view four = shadowkv::make_contiguous_output_view(&element, dtype::float32, {}, {2, 3, 4, 5});
  EXPECT_TRUE(same_layout(four, shadowkv::make_contiguous_view(&element, dtype::float32, {}, {2, 3, 4, 5})));
  EXPECT_EQ(four.strides[0], 60);
  EXPECT_EQ(four.strides[3], 1);
}

// Decode into the helper's view and, on a twin store with the same inputs, into a view built by hand (a
// mutable_tensor_view whose tensor_view part is assigned): the outputs are identical, finite and non-zero.
TEST(TensorView, DecodeWritesThroughTheOutputView) {
  const shadowkv::config cfg = shadowkv_test::twin_config();
  shadowkv::kv_store subject(cfg);
  shadowkv::kv_store twin(cfg);
  shadowkv_test::random_source rng(4242);
  const std::int64_t prompt = 60;
  const std::int64_t width = cfg.kv_width();
  const std::vector<float> keys = rng.normals(static_cast<std::size_t>(prompt * width));
  const std::vector<float> values = rng.normals(static_cast<std::size_t>(prompt * width));
  const std::vector<int> slots{0};
  for (shadowkv::kv_store* store : {&subject, &twin}) {
    ASSERT_EQ(store->add_sequences(1), slots);
    store->prefill(0, slots, view_of(keys, {1, prompt, cfg.num_kv_heads, cfg.head_dim}),
                   view_of(values, {1, prompt, cfg.num_kv_heads, cfg.head_dim}));
  }
  const std::int64_t hq = cfg.num_q_heads;
  const std::int64_t hkv = cfg.num_kv_heads;
  const std::int64_t d = cfg.head_dim;
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> q = rng.normals(static_cast<std::size_t>(hq * d));
    const std::vector<float> k = rng.normals(static_cast<std::size_t>(hkv * d));
    const std::vector<float> v = rng.normals(static_cast<std::size_t>(hkv * d));
    std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> expected(q.size(), std::numeric_limits<float>::quiet_NaN());

    subject.decode(0, slots, view_of(q, {1, hq, d}), view_of(k, {1, hkv, d}), view_of(v, {1, hkv, d}),
                   shadowkv::make_contiguous_output_view(out.data(), dtype::float32, device{}, {1, hq, d}));
    mutable_tensor_view by_hand;
    static_cast<tensor_view&>(by_hand) = shadowkv::make_contiguous_view(expected.data(), dtype::float32, {}, {1, hq, d});
    twin.decode(0, slots, view_of(q, {1, hq, d}), view_of(k, {1, hkv, d}), view_of(v, {1, hkv, d}), by_hand);

    EXPECT_TRUE(shadowkv_test::all_finite(out)) << "step " << step;
    EXPECT_GT(shadowkv_test::norm(out), 0.0) << "step " << step;
    EXPECT_EQ(out, expected) << "step " << step;
  }
}

TEST(TensorView, OutputViewOfTheWrongShapeIsRejectedBeforeTheStoreChanges) {
  const shadowkv::config cfg = shadowkv_test::twin_config();
  shadowkv::kv_store store(cfg);
  shadowkv_test::random_source rng(77);
  const std::int64_t prompt = 40;
  const std::vector<float> keys = rng.normals(static_cast<std::size_t>(prompt * cfg.kv_width()));
  const std::vector<float> values = rng.normals(static_cast<std::size_t>(prompt * cfg.kv_width()));
  const std::vector<int> slots{0};
  ASSERT_EQ(store.add_sequences(1), slots);
  store.prefill(0, slots, view_of(keys, {1, prompt, cfg.num_kv_heads, cfg.head_dim}),
                view_of(values, {1, prompt, cfg.num_kv_heads, cfg.head_dim}));
  const std::int64_t total_before = store.info(0, 0).total_len;

  const std::vector<float> q = rng.normals(static_cast<std::size_t>(cfg.num_q_heads * cfg.head_dim));
  const std::vector<float> kv = rng.normals(static_cast<std::size_t>(cfg.kv_width()));
  std::vector<float> out(q.size());
  const auto heads = static_cast<std::int64_t>(cfg.num_q_heads);
  const auto half_dim = static_cast<std::int64_t>(cfg.head_dim / 2);
  EXPECT_THROW(store.decode(0, slots, view_of(q, {1, heads, cfg.head_dim}), view_of(kv, {1, cfg.num_kv_heads, cfg.head_dim}),
                            view_of(kv, {1, cfg.num_kv_heads, cfg.head_dim}),
                            shadowkv::make_contiguous_output_view(out.data(), dtype::float32, {}, {1, heads * 2, half_dim})),
               shadowkv::invalid_argument);
  EXPECT_EQ(store.info(0, 0).total_len, total_before);
  EXPECT_EQ(store.stats().decode_steps, 0);
}

}  // namespace
