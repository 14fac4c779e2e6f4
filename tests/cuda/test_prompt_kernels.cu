// The prefill kernels (prompt_kernels.cuh) against host models of the CPU backend's prefill (cpu_backend.cpp):
//   * pick_outliers: per head the `count` smallest (min_cosine, id) pairs — a stable sort, float comparison (-0 == +0,
//     sinks at -6.02) — compared exactly: flags over max_chunks, ids ascending, nothing written past them;
//   * landmarks: each dim's float64 sum over the chunk in key order, divided, rounded to T (exactly equal), and the
//     minimum float64 cosine (within 1e-6: the summation order across dims differs);
//   * scatter_prompt: staging, outlier, local-window arrays and positions, byte for byte, for 16-byte vector values
//     and for strided values of another type; rows that must not be written keep their sentinel;
//   * prepare_prompt_keys: keys_pre and keys_post (rounded to T) against host RoPE (float64 sincos, the device's
//     formula; within 1e-6 relative for rotated dims, exact elsewhere), contiguous and strided keys, both RoPE
//     styles, partial rotary dims that end inside a 16-byte vector, keys given before or after RoPE;
//   * the split-K Gram matrix: plan_gram_split's shapes; pointers, the same cublasSgemmBatched call as
//     cuda_backend::factorize, and the float64 sum against a float64 host Gram matrix (fp32 dot-product bound),
//     with tail rows and with a single slice.
// Random data with printed seeds.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_support.cuh"
#include "device_layout.cuh"
#include "prompt_kernels.cuh"
#include "shadowkv/chunk_centroids.hpp"
#include "shadowkv/errors.hpp"

namespace {

using shadowkv::cuda::dims;
using shadowkv::cuda::element_bf16;
using shadowkv::cuda::element_f16;
using shadowkv::cuda::element_f32;
using shadowkv::cuda::gram_split;
using shadowkv::cuda::key_stats;
using shadowkv::cuda::layer_view;
using shadowkv::cuda::strided_tensor;

using namespace shadowkv::cuda::testing;

/// What prefill_one's memset of 0xC0 bytes makes of a sink chunk's minimum cosine (about -6.02).
float sink_cosine() {
  const std::uint32_t bits = 0xC0C0C0C0U;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

dims make_dims(int kv_heads, int head_dim, int chunk, int max_chunks, int max_outliers) {
  dims d{};
  d.num_layers = 1;
  d.q_heads = kv_heads;
  d.kv_heads = kv_heads;
  d.head_dim = head_dim;
  d.group = 1;
  d.chunk = chunk;
  d.budget = 1;
  d.max_outliers = max_outliers;
  d.rank = 1;
  d.window = chunk;
  d.local_capacity = 0;
  d.max_chunks = max_chunks;
  d.rotary_dim = head_dim;
  d.rope_interleaved = 0;
  d.attention_scaling = 1.0F;
  d.softmax_scale = 1.0F;
  return d;
}

class PromptKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!device_present()) GTEST_SKIP() << "no CUDA device: the prompt kernels are not exercised";
  }
};

// --- pick_outliers ------------------------------------------------------------------------------------------------

void run_pick(std::uint64_t seed, int heads, int chunks, int count, int distinct, int sinks) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed << " heads=" << heads << " chunks=" << chunks
                                  << " count=" << count << " distinct=" << distinct << " sinks=" << sinks);
  std::printf("[ pick_outliers ] seed=%llu heads=%d chunks=%d count=%d distinct=%d sinks=%d\n",
              static_cast<unsigned long long>(seed), heads, chunks, count, distinct, sinks);
  std::mt19937_64 rng(seed);
  const int max_chunks = chunks + 5;
  const int max_outliers = std::max(1, count + 2);
  const dims d = make_dims(heads, 64, 8, max_chunks, max_outliers);
  std::vector<float> values(static_cast<std::size_t>(heads) * chunks);
  std::uniform_real_distribution<float> cosine(-1.0F, 1.0F);
  std::vector<float> palette = {0.5F, 0.25F, -0.0F, 0.0F, 0.9999F, -0.75F, 1.0F};
  for (int h = 0; h < heads; ++h) {
    for (int c = 0; c < chunks; ++c) {
      float v = distinct == 0 ? cosine(rng)
                              : palette[static_cast<std::size_t>(rng() % std::min<std::size_t>(palette.size(),
                                                                                                  distinct))];
      if (c < sinks) v = sink_cosine();
      values[static_cast<std::size_t>(h) * chunks + c] = v;
    }
  }
  device_buffer values_device(values.size() * sizeof(float) + 4);
  device_buffer flags_device(static_cast<std::size_t>(heads) * max_chunks);
  device_buffer ids_device(static_cast<std::size_t>(heads) * max_outliers * sizeof(int));
  ASSERT_TRUE(values_device.ok() && flags_device.ok() && ids_device.ok());
  CUDA_OK(upload(values_device, values));
  CUDA_OK(cudaMemset(flags_device.get(), 0xAB, static_cast<std::size_t>(heads) * max_chunks));
  CUDA_OK(cudaMemset(ids_device.get(), 0x7F, static_cast<std::size_t>(heads) * max_outliers * sizeof(int)));
  ASSERT_NO_THROW(shadowkv::cuda::launch_pick_outliers(d, values_device.get<float>(), chunks, count,
                                                       flags_device.get<std::uint8_t>(), ids_device.get<int>(),
                                                       nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::uint8_t> flags;
  std::vector<int> ids;
  CUDA_OK(download(flags, flags_device.get<std::uint8_t>(), static_cast<std::size_t>(heads) * max_chunks));
  CUDA_OK(download(ids, ids_device.get<int>(), static_cast<std::size_t>(heads) * max_outliers));
  const int take = std::max(0, std::min(count, chunks));
  for (int h = 0; h < heads; ++h) {
    const float* row = values.data() + static_cast<std::size_t>(h) * chunks;
    std::vector<int> order(static_cast<std::size_t>(chunks));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return row[x] < row[y]; });
    std::vector<int> expected(order.begin(), order.begin() + take);
    std::sort(expected.begin(), expected.end());
    for (int i = 0; i < take; ++i) {
      ASSERT_EQ(ids[static_cast<std::size_t>(h) * max_outliers + i], expected[static_cast<std::size_t>(i)])
          << "head " << h << " outlier " << i;
    }
    for (int i = take; i < max_outliers; ++i) {
      ASSERT_EQ(ids[static_cast<std::size_t>(h) * max_outliers + i], 0x7F7F7F7F) << "written past the outliers";
    }
    std::vector<std::uint8_t> want(static_cast<std::size_t>(max_chunks), 0);
    for (const int c : expected) want[static_cast<std::size_t>(c)] = 1;
    for (int c = 0; c < max_chunks; ++c) {
      ASSERT_EQ(flags[static_cast<std::size_t>(h) * max_chunks + c], want[static_cast<std::size_t>(c)])
          << "head " << h << " chunk " << c;
    }
  }
}

TEST_F(PromptKernels, PickOutliersMatchesStableSort) {
  std::uint64_t seed = 101;
  for (const int chunks : {1, 7, 100, 1025, 15356, 40000}) {
    for (const int count : {0, 1, 3, 48, chunks - 1, chunks}) {
      if (count < 0 || count > chunks) continue;
      for (const int distinct : {0, 1, 3, 7}) {
        run_pick(seed++, 3, chunks, count, distinct, 0);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(PromptKernels, PickOutliersTakesSinksFirst) {
  run_pick(7, 2, 15356, 48, 0, 4);
  run_pick(8, 2, 500, 3, 3, 5);  // more sinks than outliers: the first ids among equal sinks
}

// --- landmarks ----------------------------------------------------------------------------------------------------

void run_landmarks(std::uint64_t seed, int type, int heads, int head_dim, int chunk, int chunks) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed << " type=" << type_name(type) << " Hkv=" << heads
                                  << " D=" << head_dim << " C=" << chunk << " chunks=" << chunks);
  std::printf("[ landmarks ] seed=%llu %s Hkv=%d D=%d C=%d chunks=%d\n", static_cast<unsigned long long>(seed),
              type_name(type), heads, head_dim, chunk, chunks);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const int max_chunks = chunks + 3;
  const dims d = make_dims(heads, head_dim, chunk, max_chunks, 1);
  const int width = heads * head_dim;
  const std::size_t count = static_cast<std::size_t>(chunks) * chunk * width;
  const std::size_t bytes = element_bytes(type);
  std::vector<unsigned char> keys(count * bytes);
  std::vector<float> key_values(count);
  for (std::size_t i = 0; i < count; ++i) {
    const float v = (i % 97 == 0 ? 0.0F : normal(rng)) + 0.3F;  // a shared mean: cosines away from zero
    store_element(type, keys, i, v);
    key_values[i] = load_element(type, keys.data(), i);
  }
  device_buffer keys_device(keys.size());
  device_buffer landmarks_device(static_cast<std::size_t>(heads) * max_chunks * head_dim * bytes);
  device_buffer cosine_device(static_cast<std::size_t>(heads) * chunks * sizeof(float));
  ASSERT_TRUE(keys_device.ok() && landmarks_device.ok() && cosine_device.ok());
  CUDA_OK(upload(keys_device, keys));
  // Rows past the chunks are not the kernel's to write; set so that the whole-array copy below reads defined bytes
  // (compute-sanitizer initcheck).
  CUDA_OK(cudaMemset(landmarks_device.get(), 0x5A, static_cast<std::size_t>(heads) * max_chunks * head_dim * bytes));
  ASSERT_NO_THROW(shadowkv::cuda::launch_landmarks(d, type, keys_device.get(), chunks, landmarks_device.get(),
                                                   cosine_device.get<float>(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned char> landmarks(static_cast<std::size_t>(heads) * max_chunks * head_dim * bytes);
  CUDA_OK(cudaMemcpy(landmarks.data(), landmarks_device.get(), landmarks.size(), cudaMemcpyDeviceToHost));
  std::vector<float> cosines;
  CUDA_OK(download(cosines, cosine_device.get<float>(), static_cast<std::size_t>(heads) * chunks));
  std::vector<float> landmark(static_cast<std::size_t>(head_dim));
  double norm_checked = 0.0;
  for (int c = 0; c < chunks; ++c) {
    for (int h = 0; h < heads; ++h) {
      auto key_at = [&](int i, int dim) {
        return key_values[(static_cast<std::size_t>(c) * chunk + i) * width + static_cast<std::size_t>(h) * head_dim +
                          dim];
      };
      for (int dim = 0; dim < head_dim; ++dim) {
        double sum = 0.0;
        for (int i = 0; i < chunk; ++i) sum += key_at(i, dim);
        landmark[static_cast<std::size_t>(dim)] = round_through(type, static_cast<float>(sum / chunk));
        const float got = load_element(type, landmarks.data(),
                                       (static_cast<std::size_t>(h) * max_chunks + c) * head_dim + dim);
        ASSERT_EQ(got, landmark[static_cast<std::size_t>(dim)]) << "landmark c=" << c << " h=" << h << " d=" << dim;
        norm_checked += std::fabs(got);
      }
      double lowest = INFINITY;
      for (int i = 0; i < chunk; ++i) {
        double dot = 0.0;
        double ll = 0.0;
        double kk = 0.0;
        for (int dim = 0; dim < head_dim; ++dim) {
          const double l = landmark[static_cast<std::size_t>(dim)];
          const double k = key_at(i, dim);
          dot += l * k;
          ll += l * l;
          kk += k * k;
        }
        lowest = std::min(lowest, dot / std::max(std::sqrt(ll) * std::sqrt(kk), 1e-30));
      }
      ASSERT_NEAR(cosines[static_cast<std::size_t>(h) * chunks + c], lowest, 1e-6) << "c=" << c << " h=" << h;
    }
  }
  ASSERT_GT(norm_checked, 0.0);
}

TEST_F(PromptKernels, LandmarksMatchTheCpuMaths) {
  std::uint64_t seed = 201;
  for (const int type : {element_bf16, element_f16, element_f32}) {
    for (const int head_dim : {64, 80, 96, 128, 256}) {
      for (const int chunk : {1, 3, 8, 13, 64}) {
        const int heads = 1 + static_cast<int>(seed % 3);
        const int chunks = 1 + static_cast<int>(seed % 37);
        run_landmarks(seed++, type, heads, head_dim, chunk, chunks);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// --- two-centroid scores ------------------------------------------------------------------------------------------

// launch_chunk_centroids against rules::two_means (what the CPU backend runs) on the same stored keys: codes, scales
// and counts equal bit for bit. Keys: two clusters with noise, some chunks of identical keys (one cluster, n1 = C),
// some with repeated rows (farthest-pair ties), chunk sizes up to 64 (two ballots a Lloyd round).
void run_centroids(std::uint64_t seed, int type, int heads, int head_dim, int chunk, int chunks) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed << " type=" << type_name(type) << " Hkv=" << heads
                                  << " D=" << head_dim << " C=" << chunk << " chunks=" << chunks);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const int max_chunks = chunks + 2;
  dims d = make_dims(heads, head_dim, chunk, max_chunks, 1);
  d.chunk_centroids = 1;
  const int width = heads * head_dim;
  const std::size_t count = static_cast<std::size_t>(chunks) * chunk * width;
  std::vector<unsigned char> keys(count * element_bytes(type));
  std::vector<float> key_values(count);
  std::vector<float> centre(static_cast<std::size_t>(2 * width));
  for (float& x : centre) x = 2.0F * normal(rng);
  for (int c = 0; c < chunks; ++c) {
    for (int i = 0; i < chunk; ++i) {
      const int pick = c % 5 == 1 ? 0 : static_cast<int>(rng() % 2);  // every 5th chunk one cluster
      const int row = c % 5 == 3 ? i % 3 : i;                          // repeated rows: tied distances
      for (int x = 0; x < width; ++x) {
        const std::size_t at = (static_cast<std::size_t>(c) * chunk + i) * width + x;
        std::mt19937_64 noise(seed * 1000003U + (static_cast<std::uint64_t>(c) * chunk + row) * width + x);
        const float v = c % 5 == 1 ? centre[static_cast<std::size_t>(x)]
                                   : centre[static_cast<std::size_t>(pick * width + x)] +
                                         0.3F * std::normal_distribution<float>(0.0F, 1.0F)(noise);
        store_element(type, keys, at, c % 5 == 3 ? centre[static_cast<std::size_t>((row % 2) * width + x)] + row : v);
        key_values[at] = load_element(type, keys.data(), at);
      }
    }
  }
  const std::size_t head_chunks = static_cast<std::size_t>(heads) * max_chunks;
  device_buffer keys_device(keys.size());
  device_buffer codes_device(head_chunks * 2 * head_dim);
  device_buffer scales_device(head_chunks * 2 * sizeof(float));
  device_buffer counts_device(head_chunks);
  ASSERT_TRUE(keys_device.ok() && codes_device.ok() && scales_device.ok() && counts_device.ok());
  CUDA_OK(upload(keys_device, keys));
  CUDA_OK(cudaMemset(codes_device.get(), 0x5A, head_chunks * 2 * head_dim));
  CUDA_OK(cudaMemset(scales_device.get(), 0x5A, head_chunks * 2 * sizeof(float)));
  CUDA_OK(cudaMemset(counts_device.get(), 0x5A, head_chunks));
  shadowkv::cuda::layer_view view{};
  view.centroid_codes = codes_device.get<std::uint8_t>();
  view.centroid_scales = scales_device.get<float>();
  view.first_counts = counts_device.get<std::uint8_t>();
  ASSERT_NO_THROW(shadowkv::cuda::launch_chunk_centroids(d, type, keys_device.get(), chunks, view, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned char> codes(head_chunks * 2 * head_dim);
  std::vector<float> scales(head_chunks * 2);
  std::vector<unsigned char> counts(head_chunks);
  CUDA_OK(cudaMemcpy(codes.data(), codes_device.get(), codes.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(scales.data(), scales_device.get(), scales.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(counts.data(), counts_device.get(), counts.size(), cudaMemcpyDeviceToHost));
  std::vector<double> work(static_cast<std::size_t>(2 * head_dim));
  std::vector<std::uint8_t> want(static_cast<std::size_t>(2 * head_dim));
  int one_cluster = 0;
  int split = 0;
  for (int c = 0; c < chunks; ++c) {
    for (int h = 0; h < heads; ++h) {
      const auto key = [&](int i, int x) {
        return key_values[(static_cast<std::size_t>(c) * chunk + i) * width + static_cast<std::size_t>(h) * head_dim +
                          x];
      };
      const shadowkv::rules::chunk_centroids made =
          shadowkv::rules::two_means(key, chunk, head_dim, work.data(), want.data());
      const std::size_t at = static_cast<std::size_t>(h) * max_chunks + c;
      ASSERT_EQ(counts[at], made.first_count) << "c=" << c << " h=" << h;
      ASSERT_EQ(std::memcmp(&scales[2 * at], made.scale, 2 * sizeof(float)), 0)
          << "c=" << c << " h=" << h << ": scales " << scales[2 * at] << ", " << scales[2 * at + 1] << " want "
          << made.scale[0] << ", " << made.scale[1];
      ASSERT_EQ(std::memcmp(codes.data() + at * 2 * head_dim, want.data(), want.size()), 0) << "c=" << c << " h=" << h;
      (made.first_count == chunk ? one_cluster : split) += 1;
    }
  }
  if (chunk > 1 && chunks >= 5) {
    EXPECT_GT(one_cluster, 0) << "no chunk of identical keys was seen as one cluster";
    EXPECT_GT(split, 0) << "no chunk was split";
  }
}

TEST_F(PromptKernels, TwoCentroidsMatchTheCpuRuleBitForBit) {
  std::uint64_t seed = 301;
  for (const int type : {element_bf16, element_f16, element_f32}) {
    for (const int head_dim : {64, 128, 256}) {
      for (const int chunk : {1, 2, 8, 33, 64}) {
        run_centroids(seed++, type, 1 + static_cast<int>(seed % 3), head_dim, chunk, 5 + static_cast<int>(seed % 7));
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(PromptKernelArguments, CentroidChunkLimit) {
  dims d = make_dims(1, 64, 65, 4, 1);
  d.chunk_centroids = 1;
  EXPECT_THROW(shadowkv::cuda::launch_chunk_centroids(d, element_f32, nullptr, 1, shadowkv::cuda::layer_view{}, nullptr),
               shadowkv::invalid_argument);
}

// --- scatter_prompt -----------------------------------------------------------------------------------------------

void run_scatter(std::uint64_t seed, int type, int value_type, bool strided, int heads, int head_dim) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed << " type=" << type_name(type) << " values "
                                  << type_name(value_type) << (strided ? " strided" : " contiguous"));
  std::printf("[ scatter_prompt ] seed=%llu %s values %s %s Hkv=%d D=%d\n", static_cast<unsigned long long>(seed),
              type_name(type), type_name(value_type), strided ? "strided" : "contiguous", heads, head_dim);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const int chunk = 8;
  const int local_chunks = 2;
  const int chunks = 23;
  const int local_len = local_chunks * chunk + 5;
  const int len = chunks * chunk + local_len;
  const int outliers = 3;
  const int batch = 2;
  const int row = 1;
  const int seq = len + 4;
  dims d = make_dims(heads, head_dim, chunk, chunks + 4, outliers + 1);
  d.local_capacity = (local_chunks + 1) * chunk - 1 + 8;
  d.window = 16;
  const int width = heads * head_dim;
  const std::size_t bytes = element_bytes(type);
  const std::size_t value_bytes = element_bytes(value_type);

  std::vector<unsigned char> keys_post(static_cast<std::size_t>(len) * width * bytes);
  for (std::size_t i = 0; i < static_cast<std::size_t>(len) * width; ++i) store_element(type, keys_post, i, normal(rng));
  // Values [B, S, H, D]; strided: [B, S, D, H] memory order (stride over D = H).
  std::vector<unsigned char> values(static_cast<std::size_t>(batch) * seq * width * value_bytes);
  for (std::size_t i = 0; i < static_cast<std::size_t>(batch) * seq * width; ++i) {
    store_element(value_type, values, i, normal(rng));
  }
  strided_tensor values_tensor{nullptr, value_type, {0, 0, 0, 0}};
  values_tensor.stride[0] = static_cast<long long>(seq) * width;
  values_tensor.stride[1] = width;
  values_tensor.stride[2] = strided ? 1 : head_dim;
  values_tensor.stride[3] = strided ? heads : 1;
  auto value_at = [&](int t, int h, int dim) {
    const long long at = row * values_tensor.stride[0] + t * values_tensor.stride[1] + h * values_tensor.stride[2] +
                         dim * values_tensor.stride[3];
    return round_through(type, load_element(value_type, values.data(), static_cast<std::size_t>(at)));
  };
  std::vector<long long> positions(static_cast<std::size_t>(len));
  for (int t = 0; t < len; ++t) positions[static_cast<std::size_t>(t)] = 1000 + 3 * t;
  // Outliers per head, ascending, and the flags pick_outliers would have left.
  std::vector<int> outlier_ids(static_cast<std::size_t>(heads) * d.max_outliers, -1);
  std::vector<std::uint8_t> is_outlier(static_cast<std::size_t>(heads) * d.max_chunks, 0);
  for (int h = 0; h < heads; ++h) {
    std::vector<int> all(static_cast<std::size_t>(chunks));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + outliers);
    for (int o = 0; o < outliers; ++o) {
      outlier_ids[static_cast<std::size_t>(h) * d.max_outliers + o] = all[static_cast<std::size_t>(o)];
      is_outlier[static_cast<std::size_t>(h) * d.max_chunks + all[static_cast<std::size_t>(o)]] = 1;
    }
  }

  const std::size_t outlier_bytes = static_cast<std::size_t>(heads) * d.max_outliers * chunk * head_dim * bytes;
  const std::size_t exact_bytes = static_cast<std::size_t>(heads) * (d.local_capacity + d.window) * head_dim * bytes;
  const std::size_t staging_bytes = static_cast<std::size_t>(chunks) * chunk * width * bytes;
  device_buffer keys_device(keys_post.size());
  device_buffer values_device(values.size());
  device_buffer positions_device(positions.size() * sizeof(long long));
  device_buffer ids_device(outlier_ids.size() * sizeof(int));
  device_buffer flags_device(is_outlier.size());
  device_buffer outlier_keys(outlier_bytes);
  device_buffer outlier_values(outlier_bytes);
  device_buffer exact_keys(exact_bytes);
  device_buffer exact_values(exact_bytes);
  device_buffer exact_positions(static_cast<std::size_t>(d.local_capacity + d.window) * sizeof(long long));
  device_buffer context_positions(static_cast<std::size_t>(d.max_chunks) * chunk * sizeof(long long));
  device_buffer staging(staging_bytes);
  CUDA_OK(upload(keys_device, keys_post));
  CUDA_OK(upload(values_device, values));
  CUDA_OK(upload(positions_device, positions));
  CUDA_OK(upload(ids_device, outlier_ids));
  CUDA_OK(upload(flags_device, is_outlier));
  for (const device_buffer* b : {&outlier_keys, &outlier_values, &exact_keys, &exact_values}) {
    CUDA_OK(cudaMemset(b->get(), 0x5A, b == &exact_keys || b == &exact_values ? exact_bytes : outlier_bytes));
  }
  CUDA_OK(cudaMemset(exact_positions.get(), 0x5A, static_cast<std::size_t>(d.local_capacity + d.window) * 8));
  CUDA_OK(cudaMemset(context_positions.get(), 0x5A, static_cast<std::size_t>(d.max_chunks) * chunk * 8));
  CUDA_OK(cudaMemset(staging.get(), 0x5A, staging_bytes));
  values_tensor.data = values_device.get();
  layer_view view{};
  view.is_outlier = flags_device.get<std::uint8_t>();
  view.outlier_keys = outlier_keys.get();
  view.outlier_values = outlier_values.get();
  view.exact_keys = exact_keys.get();
  view.exact_values = exact_values.get();
  view.exact_positions = exact_positions.get<long long>();
  view.context_positions = context_positions.get<long long>();
  ASSERT_NO_THROW(shadowkv::cuda::launch_scatter_prompt(d, type, keys_device.get(), values_tensor, row, len, chunks,
                                                        outliers, ids_device.get<int>(),
                                                        positions_device.get<long long>(), view, staging.get(),
                                                        nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  auto fetch = [](const device_buffer& b, std::size_t n) {
    std::vector<unsigned char> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), b.get(), n, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  };
  const auto got_staging = fetch(staging, staging_bytes);
  const auto got_outlier_keys = fetch(outlier_keys, outlier_bytes);
  const auto got_outlier_values = fetch(outlier_values, outlier_bytes);
  const auto got_exact_keys = fetch(exact_keys, exact_bytes);
  const auto got_exact_values = fetch(exact_values, exact_bytes);
  std::vector<long long> got_context;
  std::vector<long long> got_exact_positions;
  CUDA_OK(download(got_context, context_positions.get<long long>(), static_cast<std::size_t>(d.max_chunks) * chunk));
  CUDA_OK(download(got_exact_positions, exact_positions.get<long long>(),
                   static_cast<std::size_t>(d.local_capacity + d.window)));

  auto key_at = [&](int t, int h, int dim) {
    return load_element(type, keys_post.data(), static_cast<std::size_t>(t) * width + h * head_dim + dim);
  };
  std::vector<unsigned char> sentinel(8, 0x5A);
  for (int t = 0; t < chunks * chunk; ++t) {
    const int c = t / chunk;
    const int i = t % chunk;
    ASSERT_EQ(got_context[static_cast<std::size_t>(t)], positions[static_cast<std::size_t>(t)]);
    for (int h = 0; h < heads; ++h) {
      for (int dim = 0; dim < head_dim; ++dim) {
        const std::size_t at = ((static_cast<std::size_t>(c) * heads + h) * chunk + i) * head_dim + dim;
        ASSERT_EQ(load_element(type, got_staging.data(), at), value_at(t, h, dim)) << "t=" << t << " h=" << h;
      }
    }
  }
  for (int h = 0; h < heads; ++h) {
    for (int o = 0; o < d.max_outliers; ++o) {
      const int c = o < outliers ? outlier_ids[static_cast<std::size_t>(h) * d.max_outliers + o] : -1;
      for (int i = 0; i < chunk; ++i) {
        for (int dim = 0; dim < head_dim; ++dim) {
          const std::size_t at = ((static_cast<std::size_t>(h) * d.max_outliers + o) * chunk + i) * head_dim + dim;
          if (c < 0) {
            ASSERT_EQ(std::memcmp(got_outlier_keys.data() + at * bytes, sentinel.data(), bytes), 0);
            continue;
          }
          ASSERT_EQ(load_element(type, got_outlier_keys.data(), at), key_at(c * chunk + i, h, dim));
          ASSERT_EQ(load_element(type, got_outlier_values.data(), at), value_at(c * chunk + i, h, dim));
        }
      }
    }
    for (int local = 0; local < d.local_capacity + d.window; ++local) {
      const int t = chunks * chunk + local;
      for (int dim = 0; dim < head_dim; ++dim) {
        const std::size_t at = (static_cast<std::size_t>(h) * (d.local_capacity + d.window) + local) * head_dim + dim;
        if (local >= local_len) {
          ASSERT_EQ(std::memcmp(got_exact_keys.data() + at * bytes, sentinel.data(), bytes), 0);
          continue;
        }
        ASSERT_EQ(load_element(type, got_exact_keys.data(), at), key_at(t, h, dim));
        ASSERT_EQ(load_element(type, got_exact_values.data(), at), value_at(t, h, dim));
      }
    }
  }
  for (int local = 0; local < local_len; ++local) {
    ASSERT_EQ(got_exact_positions[static_cast<std::size_t>(local)],
              positions[static_cast<std::size_t>(chunks * chunk + local)]);
  }
}

TEST_F(PromptKernels, ScatterPromptWritesEveryArray) {
  std::uint64_t seed = 301;
  for (const int type : {element_bf16, element_f16, element_f32}) {
    for (const int head_dim : {64, 80, 128}) {
      run_scatter(seed++, type, type, false, 3, head_dim);            // 16-byte vectors
      run_scatter(seed++, type, type, true, 2, head_dim);             // unit stride over heads, not dims
      run_scatter(seed++, type, type == element_f32 ? element_bf16 : element_f32, false, 2, head_dim);  // converted
      if (HasFatalFailure()) return;
    }
  }
}

// --- prepare_prompt_keys ------------------------------------------------------------------------------------------

void host_rope(float& x1, float& x2, float inv_freq, long long position, float scaling, bool inverse) {
  const float angle = static_cast<float>(position) * inv_freq;
  const double s = std::sin(static_cast<double>(angle));
  const double c = std::cos(static_cast<double>(angle));
  double cos_a;
  double sin_a;
  if (inverse) {
    cos_a = c / scaling;
    sin_a = -s / scaling;
  } else {
    cos_a = static_cast<double>(static_cast<float>(c) * scaling);
    sin_a = static_cast<double>(static_cast<float>(s) * scaling);
  }
  const double a = x1;
  const double b = x2;
  x1 = static_cast<float>(a * cos_a - b * sin_a);
  x2 = static_cast<float>(b * cos_a + a * sin_a);
}

void run_prepare(std::uint64_t seed, int type, int key_type, bool strided, bool post_rope, bool interleaved,
                 int heads, int head_dim, int rotary_dim, int len) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed << " type=" << type_name(type) << " keys "
                                  << type_name(key_type) << (strided ? " strided" : " contiguous")
                                  << (post_rope ? " post" : " pre") << (interleaved ? " interleaved" : " half")
                                  << " Hkv=" << heads << " D=" << head_dim << " rotary=" << rotary_dim
                                  << " len=" << len);
  std::printf("[ prepare_prompt_keys ] seed=%llu %s keys %s %s %s %s Hkv=%d D=%d rotary=%d len=%d\n",
              static_cast<unsigned long long>(seed), type_name(type), type_name(key_type),
              strided ? "strided" : "contiguous", post_rope ? "post" : "pre", interleaved ? "interleaved" : "half",
              heads, head_dim, rotary_dim, len);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  dims d = make_dims(heads, head_dim, 8, 64, 1);
  d.rotary_dim = rotary_dim;
  d.rope_interleaved = interleaved ? 1 : 0;
  d.attention_scaling = 1.125F;
  const int width = heads * head_dim;
  const int batch = 2;
  const int row = 1;
  const int seq = len + 3;
  std::vector<unsigned char> keys(static_cast<std::size_t>(batch) * seq * width * element_bytes(key_type));
  for (std::size_t i = 0; i < static_cast<std::size_t>(batch) * seq * width; ++i) {
    store_element(key_type, keys, i, 3.0F * normal(rng));
  }
  strided_tensor keys_tensor{nullptr, key_type, {0, 0, 0, 0}};
  keys_tensor.stride[0] = static_cast<long long>(seq) * width;
  keys_tensor.stride[1] = width;
  keys_tensor.stride[2] = strided ? 1 : head_dim;
  keys_tensor.stride[3] = strided ? heads : 1;
  std::vector<int> positions(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int>(7 * i + (i % 5) * 1000);
  std::vector<float> inv_freq(static_cast<std::size_t>(rotary_dim / 2));
  for (int i = 0; i < rotary_dim / 2; ++i) {
    inv_freq[static_cast<std::size_t>(i)] =
        static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / static_cast<double>(rotary_dim)));
  }
  device_buffer keys_device(keys.size());
  device_buffer positions_device(positions.size() * sizeof(int));
  device_buffer inv_freq_device(std::max<std::size_t>(4, inv_freq.size() * sizeof(float)));
  device_buffer pre_device(static_cast<std::size_t>(len) * width * sizeof(float));
  device_buffer post_device(static_cast<std::size_t>(len) * width * element_bytes(type));
  device_buffer positions_out(static_cast<std::size_t>(len) * sizeof(long long));
  device_buffer stats_device(sizeof(key_stats));
  CUDA_OK(upload(keys_device, keys));
  CUDA_OK(upload(positions_device, positions));
  CUDA_OK(upload(stats_device, std::vector<key_stats>{key_stats{7, 0x7f7fffffU, 3}}));  // stale: the launch zeroes it
  if (!inv_freq.empty()) CUDA_OK(upload(inv_freq_device, inv_freq));
  keys_tensor.data = keys_device.get();
  const strided_tensor positions_tensor{positions_device.get(), 0, {seq, 1, 0, 0}};
  ASSERT_NO_THROW(shadowkv::cuda::launch_prepare_prompt_keys(
      d, type, keys_tensor, positions_tensor, 32, row, len, post_rope, inv_freq_device.get<float>(),
      pre_device.get<float>(), post_device.get(), positions_out.get<long long>(), stats_device.get<key_stats>(),
      nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<key_stats> stats;
  CUDA_OK(download(stats, stats_device.get<key_stats>(), 1));
  EXPECT_EQ(stats[0].overflowed, 0) << "keys of a few units flagged as overflowing";
  std::vector<float> pre;
  std::vector<long long> got_positions;
  CUDA_OK(download(pre, pre_device.get<float>(), static_cast<std::size_t>(len) * width));
  CUDA_OK(download(got_positions, positions_out.get<long long>(), static_cast<std::size_t>(len)));
  std::vector<unsigned char> post(static_cast<std::size_t>(len) * width * element_bytes(type));
  CUDA_OK(cudaMemcpy(post.data(), post_device.get(), post.size(), cudaMemcpyDeviceToHost));
  float largest = 0.0F;
  for (const float x : pre) largest = std::max(largest, std::fabs(x));
  float reported = 0.0F;
  std::memcpy(&reported, &stats[0].largest_bits, sizeof(float));
  EXPECT_EQ(reported, largest) << "largest |pre-RoPE key|";
  EXPECT_EQ(stats[0].gram_exponent, 0);

  std::vector<float> given(static_cast<std::size_t>(head_dim));
  std::vector<float> turned(static_cast<std::size_t>(head_dim));
  for (int t = 0; t < len; ++t) {
    const long long position = positions[static_cast<std::size_t>(row) * seq + t];
    ASSERT_EQ(got_positions[static_cast<std::size_t>(t)], position);
    for (int h = 0; h < heads; ++h) {
      for (int dim = 0; dim < head_dim; ++dim) {
        const long long at = row * keys_tensor.stride[0] + t * keys_tensor.stride[1] + h * keys_tensor.stride[2] +
                             dim * keys_tensor.stride[3];
        given[static_cast<std::size_t>(dim)] = load_element(key_type, keys.data(), static_cast<std::size_t>(at));
      }
      turned = given;
      for (int pair = 0; pair < rotary_dim / 2; ++pair) {
        const int first = interleaved ? 2 * pair : pair;
        const int second = interleaved ? 2 * pair + 1 : pair + rotary_dim / 2;
        host_rope(turned[static_cast<std::size_t>(first)], turned[static_cast<std::size_t>(second)],
                  inv_freq[static_cast<std::size_t>(pair)], position, d.attention_scaling, post_rope);
      }
      for (int dim = 0; dim < head_dim; ++dim) {
        const float want_pre = post_rope ? turned[static_cast<std::size_t>(dim)] : given[static_cast<std::size_t>(dim)];
        const float want_post = post_rope ? given[static_cast<std::size_t>(dim)] : turned[static_cast<std::size_t>(dim)];
        const std::size_t at = static_cast<std::size_t>(t) * width + static_cast<std::size_t>(h) * head_dim + dim;
        const float got_pre = pre[at];
        const float got_post = load_element(type, post.data(), at);
        if (dim >= rotary_dim) {
          ASSERT_EQ(got_pre, want_pre) << "t=" << t << " h=" << h << " d=" << dim;
          ASSERT_EQ(got_post, round_through(type, want_post)) << "t=" << t << " h=" << h << " d=" << dim;
          continue;
        }
        // Host and device sincos may differ in the last bit of a double; the float results then by an ulp, and
        // the rounding to T by one step of T.
        ASSERT_NEAR(got_pre, want_pre, 1e-6 * (std::fabs(want_pre) + 1.0)) << "t=" << t << " h=" << h << " d=" << dim;
        const float step = type == element_f32 ? 0.0F
                                               : std::fabs(round_through(type, want_post)) *
                                                     (type == element_bf16 ? 1.0F / 128 : 1.0F / 1024);
        ASSERT_NEAR(got_post, round_through(type, want_post), 1e-6 * (std::fabs(want_post) + 1.0) + step)
            << "t=" << t << " h=" << h << " d=" << dim;
      }
    }
  }
}

TEST_F(PromptKernels, PrepareKeysMatchesHostRope) {
  std::uint64_t seed = 401;
  struct shape {
    int heads, head_dim, rotary_dim, len;
  };
  for (const shape s : {shape{8, 128, 128, 37}, shape{2, 64, 40, 70}, shape{3, 80, 20, 9}, shape{1, 256, 256, 33},
                        shape{40, 128, 64, 5}, shape{2, 96, 0, 11}}) {
    for (const int type : {element_bf16, element_f32}) {
      for (const bool post_rope : {false, true}) {
        run_prepare(seed++, type, type, false, post_rope, false, s.heads, s.head_dim, s.rotary_dim, s.len);
        run_prepare(seed++, type, element_f16, true, post_rope, true, s.heads, s.head_dim, s.rotary_dim, s.len);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Finite keys near the float32 limit: rotating (or un-rotating) them overflows at some positions, and the kernel
// says so (the CUDA backend then rejects the prefill as the CPU backend does). Keys of 1e38 never overflow
// (|x cos - y sin| <= 1.42e38), nor does a zero rotary_dim.
TEST_F(PromptKernels, PrepareKeysFlagsRopeOverflow) {
  const int heads = 2;
  const int head_dim = 64;
  const int len = 16;
  const int width = heads * head_dim;
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq[static_cast<std::size_t>(i)] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / head_dim));
  }
  device_buffer inv_freq_device(inv_freq.size() * sizeof(float));
  CUDA_OK(upload(inv_freq_device, inv_freq));
  struct variant {
    float magnitude;
    int rotary_dim;
    bool overflows;
  };
  for (const variant v : {variant{3.0e38F, head_dim, true}, variant{1.0e38F, head_dim, false},
                          variant{3.0e38F, 0, false}}) {
    for (const int type : {element_f32, element_bf16}) {
      for (const bool post_rope : {false, true}) {
        SCOPED_TRACE(testing::Message() << "magnitude " << v.magnitude << " rotary " << v.rotary_dim << " "
                                        << type_name(type) << (post_rope ? " post" : " pre"));
        dims d = make_dims(heads, head_dim, 8, 64, 1);
        d.rotary_dim = v.rotary_dim;
        std::vector<float> keys(static_cast<std::size_t>(len) * width);
        for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = i % 2 == 0 ? v.magnitude : -v.magnitude;
        device_buffer keys_device(keys.size() * sizeof(float));
        device_buffer pre_device(keys.size() * sizeof(float));
        device_buffer post_device(keys.size() * element_bytes(type));
        device_buffer positions_out(static_cast<std::size_t>(len) * sizeof(long long));
        device_buffer stats_device(sizeof(key_stats));
        CUDA_OK(upload(keys_device, keys));
        CUDA_OK(upload(stats_device, std::vector<key_stats>{key_stats{v.overflows ? 0 : 7, 0, 0}}));  // stale
        const strided_tensor keys_tensor{keys_device.get(), element_f32, {static_cast<long long>(len) * width, width,
                                                                          head_dim, 1}};
        const strided_tensor no_positions{nullptr, 0, {0, 0, 0, 0}};
        ASSERT_NO_THROW(shadowkv::cuda::launch_prepare_prompt_keys(
            d, type, keys_tensor, no_positions, 64, 0, len, post_rope, inv_freq_device.get<float>(),
            pre_device.get<float>(), post_device.get(), positions_out.get<long long>(),
            stats_device.get<key_stats>(), nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<key_stats> stats;
        CUDA_OK(download(stats, stats_device.get<key_stats>(), 1));
        EXPECT_EQ(stats[0].overflowed, v.overflows ? 1 : 0);
      }
    }
  }
}

// The CPU backend's Gram scaling (factorization.cpp, rescaled_for_gram): keys whose largest magnitude has a binary
// exponent outside [-40, 40] are scaled by 2^-exponent, exactly; the coefficients computed from them are scaled back.
TEST_F(PromptKernels, GramScalingFollowsTheCpuRule) {
  std::mt19937_64 rng(431);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (const float magnitude : {0.0F, 3.0F, 1.0e12F, 1.0e30F, 1.0e-30F, 2.0e-13F}) {
    SCOPED_TRACE(testing::Message() << "largest " << magnitude);
    const long long count = 3000;
    std::vector<float> keys(static_cast<std::size_t>(count));
    for (float& k : keys) k = magnitude * std::tanh(normal(rng));  // |k| < magnitude
    keys[17] = -magnitude;                                         // the largest, exactly
    int exponent = 0;
    (void)std::frexp(magnitude, &exponent);
    const int expected = magnitude == 0.0F || (exponent >= -40 && exponent <= 40) ? 0 : exponent;
    unsigned largest_bits = 0;
    std::memcpy(&largest_bits, &magnitude, sizeof(float));
    device_buffer keys_device(keys.size() * sizeof(float));
    device_buffer stats_device(sizeof(key_stats));
    CUDA_OK(upload(keys_device, keys));
    CUDA_OK(upload(stats_device, std::vector<key_stats>{key_stats{0, largest_bits, 99}}));
    ASSERT_NO_THROW(shadowkv::cuda::launch_scale_keys_for_gram(keys_device.get<float>(), count,
                                                               stats_device.get<key_stats>(), nullptr));
    std::vector<float> scaled;
    std::vector<key_stats> stats;
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(download(scaled, keys_device.get<float>(), keys.size()));
    CUDA_OK(download(stats, stats_device.get<key_stats>(), 1));
    EXPECT_EQ(stats[0].gram_exponent, expected);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      ASSERT_EQ(scaled[i], std::ldexp(keys[i], -expected)) << "key " << i;
    }
    // Coefficients back by 2^e (the same kernel word).
    ASSERT_NO_THROW(shadowkv::cuda::launch_unscale_coefficients(keys_device.get<float>(), count,
                                                                stats_device.get<key_stats>(), nullptr));
    std::vector<float> back;
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(download(back, keys_device.get<float>(), keys.size()));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      ASSERT_EQ(back[i], std::ldexp(scaled[i], expected)) << "coefficient " << i;
    }
  }
}

// --- Gram matrix --------------------------------------------------------------------------------------------------

TEST(PromptKernelsPlan, GramSplitShapes) {
  // Llama-3-8B on an H200: 8 blocks of 128, 36 pairs, 22 slices of 5585 rows (10 tail rows).
  gram_split s = shadowkv::cuda::plan_gram_split(1024, 122880, 132);
  EXPECT_EQ(s.block, 128);
  EXPECT_EQ(s.blocks, 8);
  EXPECT_EQ(s.pairs, 36);
  EXPECT_EQ(s.slices, 22);
  EXPECT_EQ(s.slice_rows, 122880 / 22);
  EXPECT_EQ(s.tail_rows(122880), 122880 % 22);
  s = shadowkv::cuda::plan_gram_split(640, 1000, 132);  // 8 x 80, short prompt: one slice
  EXPECT_EQ(s.block, 128);
  EXPECT_EQ(s.slices, 1);
  EXPECT_EQ(s.slice_rows, 1000);
  s = shadowkv::cuda::plan_gram_split(80, 5000, 132);
  EXPECT_EQ(s.block, 80);
  EXPECT_EQ(s.pairs, 1);
  EXPECT_EQ(s.slices, 5000 / 512);
  s = shadowkv::cuda::plan_gram_split(100, 3000, 132);  // no block size divides: the whole matrix
  EXPECT_EQ(s.block, 100);
  EXPECT_EQ(s.pairs, 1);
  s = shadowkv::cuda::plan_gram_split(1024, 0, 132);
  EXPECT_EQ(s.slices, 0);
  EXPECT_EQ(s.entries(), 0);
}

void run_gram(std::uint64_t seed, int n, int rows, int multiprocessors) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed << " n=" << n << " rows=" << rows << " SMs=" << multiprocessors);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const gram_split split = shadowkv::cuda::plan_gram_split(n, rows, multiprocessors);
  std::printf("[ gram ] seed=%llu n=%d rows=%d: block %d, %d pairs, %d slices of %d rows, %d tail rows\n",
              static_cast<unsigned long long>(seed), n, rows, split.block, split.pairs, split.slices,
              split.slice_rows, split.tail_rows(rows));
  std::vector<float> keys(static_cast<std::size_t>(rows) * n);
  for (float& k : keys) k = normal(rng) + 0.5F;
  device_buffer keys_device(std::max<std::size_t>(4, keys.size() * sizeof(float)));
  device_buffer partials(std::max<std::size_t>(4, shadowkv::cuda::gram_partial_bytes(split, n)));
  const auto entries = static_cast<std::size_t>(split.entries());
  device_buffer pointers(std::max<std::size_t>(8, 3 * entries * sizeof(void*)));
  device_buffer gram_device(static_cast<std::size_t>(n) * n * sizeof(double));
  if (!keys.empty()) CUDA_OK(upload(keys_device, keys));
  auto** a = static_cast<const float**>(pointers.get());
  const float** b = a + entries;
  auto** c = static_cast<float**>(static_cast<void*>(b + entries));
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  if (entries > 0) {
    ASSERT_NO_THROW(shadowkv::cuda::launch_gram_block_pointers(keys_device.get<float>(), n, split,
                                                               partials.get<float>(), a, b, c, nullptr));
    const float one = 1.0F;
    const float zero = 0.0F;
    // The call of cuda_backend::factorize.
    ASSERT_EQ(cublasSgemmBatched(handle, CUBLAS_OP_N, CUBLAS_OP_T, split.block, split.block, split.slice_rows, &one,
                                 a, n, b, n, &zero, c, n, static_cast<int>(entries)),
              CUBLAS_STATUS_SUCCESS);
  }
  // The sum writes the lower block triangle; the upper blocks are zeroed first, as cuda_backend::factorize does.
  CUDA_OK(cudaMemset(gram_device.get(), 0, static_cast<std::size_t>(n) * n * sizeof(double)));
  ASSERT_NO_THROW(shadowkv::cuda::launch_sum_gram_partials(partials.get<float>(), keys_device.get<float>(), rows, n,
                                                           split, gram_device.get<double>(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  cublasDestroy(handle);
  std::vector<double> gram;
  CUDA_OK(download(gram, gram_device.get<double>(), static_cast<std::size_t>(n) * n));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j <= i; ++j) {
      double exact = 0.0;
      double magnitude = 0.0;
      for (int r = 0; r < rows; ++r) {
        const double x = static_cast<double>(keys[static_cast<std::size_t>(r) * n + i]) *
                         keys[static_cast<std::size_t>(r) * n + j];
        exact += x;
        magnitude += std::fabs(x);
      }
      // fp32 accumulation over one slice, in any order: at most (slice_rows + 1) units of 2^-24 of the magnitude.
      // A wrong block, slice or tail is off by whole products, far above it.
      const double bound = (split.slice_rows + 2.0) * std::ldexp(magnitude, -24) + 1e-30;
      const double got = gram[static_cast<std::size_t>(j) * n + i];
      ASSERT_NEAR(got, exact, bound) << "i=" << i << " j=" << j;
      ASSERT_EQ(got, gram[static_cast<std::size_t>(i) * n + j]) << "not symmetric at i=" << i << " j=" << j;
    }
  }
}

TEST_F(PromptKernels, GramSplitKMatchesFloat64) {
  run_gram(501, 256, 5000, 132);   // 2 blocks of 128, slices of 512+ rows, tail rows
  run_gram(502, 640, 4100, 132);   // 5 blocks of 128
  run_gram(503, 160, 3001, 8);     // 2 blocks of 80, few SMs
  run_gram(504, 100, 700, 132);    // one block of 100, one slice
  run_gram(505, 128, 0, 132);      // no rows: a zero matrix
}

}  // namespace
