// launch_advance_generated (decode steps 0–2 on the device, generated_tokens.cuh) against a host model of
// docs/semantics.md "Decode" 0–2 as the CPU backend does it (cpu_backend.cpp: fold_oldest_generated_chunk,
// append_token), over many steps of a batch, with the device's own ring layout (device_layout.cuh):
//   * fold, when the ring holds W tokens: the oldest C keys un-rotated, A rows a = k_pre · Bᵀ, their positions, the
//     landmark (float64 mean of the stored post-RoPE keys, rounded to T), the values (or fp8 codes and a scale per
//     head) into context chunk `context_chunks`; then the counters (context_chunks, ring_head, generated_exact_len);
//   * append: the token at the ring's end, RoPE applied first when given pre-RoPE, its position (given as int32 or
//     int64, or the last + 1), generated_exact_len and last_position;
//   * the capacity guard of graph replays: a full ring with the context arena full leaves the sequence unchanged.
// What is compared, after every step, against the model:
//   * bit for bit: the counters of every view (views outside the batch unchanged), positions, landmarks, the value
//     store and fp8 scales, appended values, appended keys given post-RoPE, and every byte a step must not write
//     (local window rows, other chunks, other sequences' arrays);
//   * keys given pre-RoPE, within 1e-6 of the rotated pair's magnitude plus one unit of T's last place (host and
//     device float64 sin/cos may differ in the last bit, which can move a float32 or T rounding);
//   * new rows of A, within the bound of a float32 dot product, (Hkv*D + 2) * 2^-24 * sum_j |k_pre[j] B[r, j]| (plus
//     the bf16 rounding with bf16 factors): the device accumulates in float32, the model in float64;
//   * that the run is non-trivial: folds happened, the folded landmarks and A rows have a norm above zero.
// Random data with printed seeds; the configuration of a failing case is printed with it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"
#include "device_layout.cuh"
#include "generated_tokens.cuh"
#include "shadowkv/fp8.hpp"

namespace {

using shadowkv::cuda::dims;
using shadowkv::cuda::element_bf16;
using shadowkv::cuda::element_f16;
using shadowkv::cuda::element_f32;
using shadowkv::cuda::layer_view;
using shadowkv::cuda::strided_tensor;

using namespace shadowkv::cuda::testing;

enum class positions_mode { last_plus_one, int32, int64 };

const char* positions_name(positions_mode m) {
  switch (m) {
    case positions_mode::int32: return "int32";
    case positions_mode::int64: return "int64";
    default: return "last+1";
  }
}

struct case_config {
  std::uint64_t seed = 0;
  int batch = 2;
  int kv_heads = 2;
  int head_dim = 64;
  int chunk = 8;
  int window = 16;        ///< W, a multiple of C (config::validate)
  int local_chunks = 2;   ///< local_capacity = (local_chunks + 1) * C - 1 rows before the ring
  int rank = 48;          ///< 0: full rank, kv_heads * head_dim
  int rotary_dim = 0;     ///< 0: head_dim
  bool interleaved = false;
  float attention_scaling = 1.0F;
  double rope_theta = 10000.0;
  int kv_type = element_f32;
  bool bf16_factors = false;
  bool value_fp8 = false;
  int input_type = element_f32;  ///< k_new / v_new element type
  bool strided_inputs = false;   ///< k_new / v_new with gaps between elements, heads and rows
  positions_mode positions = positions_mode::last_plus_one;
  bool keys_post_rope = true;
  int steps = 40;
  int spare_chunks = 2;  ///< context chunk capacity beyond what the run can fold; < 0: 2 chunks, soon full
  bool graph = false;    ///< first step eager, then one captured launch replayed for the other steps

  [[nodiscard]] int full_rank() const { return rank > 0 ? rank : kv_heads * head_dim; }
  [[nodiscard]] int rotary() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "seed=" << seed << " B=" << batch << " Hkv=" << kv_heads << " D=" << head_dim << " C=" << chunk
      << " W=" << window << " Lc=" << local_chunks << " r=" << full_rank() << " rotary=" << rotary()
      << (interleaved ? " interleaved" : " half-split") << " scaling=" << attention_scaling << " theta=" << rope_theta
      << " kv=" << type_name(kv_type) << (bf16_factors ? " factors=bf16" : " factors=f32")
      << (value_fp8 ? " values=fp8" : "") << " inputs=" << type_name(input_type)
      << (strided_inputs ? " strided" : "") << " positions=" << positions_name(positions)
      << (keys_post_rope ? " post-rope" : " pre-rope") << " steps=" << steps << " spare=" << spare_chunks
      << (graph ? " graph" : "");
    return s.str();
  }
};

/// (x1, x2) rotated to `position` (inverse: back), as element_access.cuh's rope_pair and the CPU backend: float32
/// angle, float64 sin/cos, attention_scaling on them (divided out when inverting), the pair rotated in float64.
void host_rope_pair(float& x1, float& x2, float inv_freq, long long position, float scaling, bool inverse) {
  const float angle = static_cast<float>(position) * inv_freq;
  const double s = std::sin(static_cast<double>(angle));
  const double c = std::cos(static_cast<double>(angle));
  const double cos_a = inverse ? c / scaling : static_cast<double>(static_cast<float>(c) * scaling);
  const double sin_a = inverse ? -s / scaling : static_cast<double>(static_cast<float>(s) * scaling);
  const double a = x1;
  const double b = x2;
  x1 = static_cast<float>(a * cos_a - b * sin_a);
  x2 = static_cast<float>(b * cos_a + a * sin_a);
}

/// One unit in the last place of T at `value` (an upper bound; f32's is left to the caller's relative bound).
double unit_of(int type, double value) {
  switch (type) {
    case element_bf16: return std::ldexp(std::fabs(value), -7) + std::ldexp(1.0, -133);
    case element_f16: return std::ldexp(std::fabs(value), -10) + std::ldexp(1.0, -24);
    default: return 0.0;
  }
}

/// An element of a model array the device may compute differently within `allowed` (it is then taken as the
/// device wrote it, so that later steps compare the same bytes).
struct approximate {
  int array = 0;  ///< index into arrays()
  std::size_t index = 0;
  double want = 0.0;
  double allowed = 0.0;
  const char* what = "";
};

/// Host model and device buffers of one (slot, layer): byte arrays in the device layout (device_layout.cuh).
struct entry {
  int slot = 0;
  // Counters, as in layer_view.
  int prompt_len = 0;
  int context_chunks = 0;
  int outlier_chunks = 0;
  int local_len = 0;
  int generated_exact_len = 0;
  int ring_head = 0;
  long long last_position = -1;
  // Arrays; element types: factors (float32 or bf16), T (the store's), long long, float.
  std::vector<unsigned char> basis, coefficients, landmarks, exact_keys, exact_values, value_store, value_scales;
  std::vector<unsigned char> context_positions, exact_positions;
  device_buffer basis_d, coefficients_d, landmarks_d, exact_keys_d, exact_values_d, value_store_d, value_scales_d;
  device_buffer context_positions_d, exact_positions_d;

  // The arrays the kernel may write, with their device buffers and names, in one order.
  std::vector<std::vector<unsigned char>*> arrays() {
    return {&coefficients, &landmarks, &exact_keys, &exact_values, &value_store, &value_scales, &context_positions,
            &exact_positions, &basis};
  }
  std::vector<const device_buffer*> buffers() const {
    return {&coefficients_d, &landmarks_d, &exact_keys_d, &exact_values_d, &value_store_d, &value_scales_d,
            &context_positions_d, &exact_positions_d, &basis_d};
  }
  static const char* array_name(int i) {
    static const char* const names[] = {"coefficients", "landmarks",         "exact_keys",      "exact_values",
                                        "value_store",  "value_scales",      "context_positions", "exact_positions",
                                        "basis"};
    return names[i];
  }
};
constexpr int kCoefficients = 0;
constexpr int kExactKeys = 2;

long long get_long(const std::vector<unsigned char>& bytes, std::size_t index) {
  long long v;
  std::memcpy(&v, bytes.data() + index * sizeof(long long), sizeof(long long));
  return v;
}
void set_long(std::vector<unsigned char>& bytes, std::size_t index, long long v) {
  std::memcpy(bytes.data() + index * sizeof(long long), &v, sizeof(long long));
}
void set_float(std::vector<unsigned char>& bytes, std::size_t index, float v) {
  std::memcpy(bytes.data() + index * sizeof(float), &v, sizeof(float));
}

/// The host model of one launch for one entry (generated_tokens.cu's contract, docs/semantics.md Decode 0–2).
/// `key` and `value` are the new token's [Hkv*D] elements as read from the inputs; `given` its position if any.
/// Returns the elements to compare within a tolerance; counts folds and capacity stops.
std::vector<approximate> model_step(const case_config& cfg, const dims& d, const std::vector<float>& inv_freq,
                                    entry& e, const std::vector<float>& key, const std::vector<float>& value,
                                    const long long* given, int& folds, int& stops) {
  std::vector<approximate> loose;
  const int C = d.chunk;
  const int D = d.head_dim;
  const int width = d.kv_heads * D;
  const int rows = d.local_capacity + d.window;
  const int T = cfg.kv_type;
  const int F = cfg.bf16_factors ? element_bf16 : element_f32;
  const auto key_index = [&](int h, int row, int dim) {
    return (static_cast<std::size_t>(h) * rows + row) * D + dim;
  };
  const auto pair_of = [&](int dim, int& first, int& second) {
    const int half = d.rotary_dim / 2;
    const int pair = d.rope_interleaved != 0 ? dim / 2 : dim % half;
    first = d.rope_interleaved != 0 ? 2 * pair : pair;
    second = d.rope_interleaved != 0 ? 2 * pair + 1 : pair + half;
    return pair;
  };
  if (e.generated_exact_len == d.window && e.context_chunks >= d.max_chunks) {
    ++stops;  // a replay past capacity: nothing changes
    return loose;
  }
  if (e.generated_exact_len == d.window) {
    ++folds;
    const int chunk = e.context_chunks;
    std::vector<float> keys_pre(static_cast<std::size_t>(C) * width);
    for (int i = 0; i < C; ++i) {
      const int row = d.local_capacity + (e.ring_head + i) % d.window;
      const long long position = get_long(e.exact_positions, static_cast<std::size_t>(row));
      for (int h = 0; h < d.kv_heads; ++h) {
        float* out = keys_pre.data() + static_cast<std::size_t>(i) * width + static_cast<std::size_t>(h) * D;
        for (int dim = 0; dim < D; ++dim) out[dim] = load_element(T, e.exact_keys.data(), key_index(h, row, dim));
        for (int dim = 0; dim < d.rotary_dim; ++dim) {
          int first;
          int second;
          const int pair = pair_of(dim, first, second);
          if (dim != first) continue;
          host_rope_pair(out[first], out[second], inv_freq[static_cast<std::size_t>(pair)], position,
                         d.attention_scaling, true);
        }
      }
      // A row: float64 dot product with B's rows as held; the device sums in float32.
      for (int r = 0; r < d.rank; ++r) {
        double sum = 0.0;
        double magnitude = 0.0;
        for (int j = 0; j < width; ++j) {
          const double p = static_cast<double>(keys_pre[static_cast<std::size_t>(i) * width + j]) *
                           load_element(F, e.basis.data(), static_cast<std::size_t>(r) * width + j);
          sum += p;
          magnitude += std::fabs(p);
        }
        const std::size_t target = (static_cast<std::size_t>(chunk) * C + i) * d.rank + r;
        // Recursive float32 summation of `width` products: at most width units of 2^-24 of sum |p|; two more for
        // k_pre, whose un-rotation may round differently on the device.
        double allowed = (width + 2) * std::ldexp(magnitude, -24) + 1e-30;
        if (F == element_bf16) allowed = 1.01 * allowed + std::ldexp(std::fabs(sum), -8);
        loose.push_back({kCoefficients, target, sum, allowed, "A row of a folded token"});
        store_element(F, e.coefficients, target, static_cast<float>(sum));
      }
      set_long(e.context_positions, static_cast<std::size_t>(chunk) * C + i, position);
    }
    for (int h = 0; h < d.kv_heads; ++h) {
      float scale = 1.0F;
      if (cfg.value_fp8) {
        float amax = 0.0F;
        for (int i = 0; i < C; ++i) {
          const int row = d.local_capacity + (e.ring_head + i) % d.window;
          for (int dim = 0; dim < D; ++dim) {
            amax = std::max(amax, std::fabs(load_element(T, e.exact_values.data(), key_index(h, row, dim))));
          }
        }
        scale = shadowkv::fp8::scale_for(amax);
        set_float(e.value_scales, static_cast<std::size_t>(chunk) * d.kv_heads + h, scale);
      }
      for (int dim = 0; dim < D; ++dim) {
        double sum = 0.0;
        for (int i = 0; i < C; ++i) {
          const int row = d.local_capacity + (e.ring_head + i) % d.window;
          sum += load_element(T, e.exact_keys.data(), key_index(h, row, dim));
          const std::size_t target = ((static_cast<std::size_t>(chunk) * d.kv_heads + h) * C + i) * D + dim;
          const float v = load_element(T, e.exact_values.data(), key_index(h, row, dim));
          if (cfg.value_fp8) {
            e.value_store[target] = shadowkv::fp8::encode_e4m3(v / scale);
          } else {
            store_element(T, e.value_store, target, v);
          }
        }
        store_element(T, e.landmarks, (static_cast<std::size_t>(h) * d.max_chunks + chunk) * D + dim,
                      static_cast<float>(sum / C));
      }
    }
    e.context_chunks = chunk + 1;
    e.ring_head = (e.ring_head + C) % d.window;
    e.generated_exact_len -= C;
  }
  // Append.
  const int row = d.local_capacity + (e.ring_head + e.generated_exact_len) % d.window;
  const long long position = given != nullptr ? *given : e.last_position + 1;
  for (int h = 0; h < d.kv_heads; ++h) {
    const float* k = key.data() + static_cast<std::size_t>(h) * D;
    for (int dim = 0; dim < D; ++dim) {
      store_element(T, e.exact_values, key_index(h, row, dim), value[static_cast<std::size_t>(h) * D + dim]);
      if (cfg.keys_post_rope || dim >= d.rotary_dim) {
        store_element(T, e.exact_keys, key_index(h, row, dim), k[dim]);
        continue;
      }
      int first;
      int second;
      const int pair = pair_of(dim, first, second);
      float x1 = k[first];
      float x2 = k[second];
      host_rope_pair(x1, x2, inv_freq[static_cast<std::size_t>(pair)], position, d.attention_scaling, false);
      const float rotated = dim == first ? x1 : x2;
      const double allowed = 1e-6 * d.attention_scaling * (std::fabs(k[first]) + std::fabs(k[second])) +
                             unit_of(T, rotated) + 1e-30;
      store_element(T, e.exact_keys, key_index(h, row, dim), rotated);
      loose.push_back({kExactKeys, key_index(h, row, dim), round_through(T, rotated), allowed, "key given pre-RoPE"});
    }
  }
  set_long(e.exact_positions, static_cast<std::size_t>(row), position);
  e.generated_exact_len += 1;
  e.last_position = position;
  return loose;
}

void fill_normals(int type, std::vector<unsigned char>& bytes, std::size_t count, float scale, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0F, 1.0F);
  bytes.assign(count * element_bytes(type), 0);
  for (std::size_t i = 0; i < count; ++i) store_element(type, bytes, i, scale * normal(rng));
}

void fill_bytes(std::vector<unsigned char>& bytes, std::size_t count, std::mt19937_64& rng) {
  bytes.resize(count);
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng());
}

void run_case(const case_config& cfg) {
  SCOPED_TRACE(cfg.describe());
  std::printf("[ generated_tokens ] %s\n", cfg.describe().c_str());
  std::mt19937_64 rng(cfg.seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);

  const int B = cfg.batch;
  const int Hkv = cfg.kv_heads;
  const int D = cfg.head_dim;
  const int C = cfg.chunk;
  const int W = cfg.window;
  const int r = cfg.full_rank();
  const int width = Hkv * D;
  const int num_layers = 3;
  const int layer = 1;
  const int slots = B + 2;
  ASSERT_EQ(W % C, 0);
  ASSERT_LE(r, width);

  dims d{};
  d.num_layers = num_layers;
  d.q_heads = Hkv;
  d.kv_heads = Hkv;
  d.head_dim = D;
  d.group = 1;
  d.chunk = C;
  d.budget = 1;
  d.rank = r;
  d.window = W;
  d.local_capacity = (cfg.local_chunks + 1) * C - 1;
  d.rotary_dim = cfg.rotary();
  d.rope_interleaved = cfg.interleaved ? 1 : 0;
  d.attention_scaling = cfg.attention_scaling;
  d.softmax_scale = 1.0F;
  d.value_fp8 = cfg.value_fp8 ? 1 : 0;
  d.factor_bf16 = cfg.bf16_factors ? 1 : 0;
  const int rows = d.local_capacity + W;
  const int F = cfg.bf16_factors ? element_bf16 : element_f32;
  // Initial context chunks in [0, 3] (or [0, 1]); the run folds at most (W + steps) / C chunks.
  const int most_folds = (W + cfg.steps) / C;
  d.max_chunks = cfg.spare_chunks < 0 ? 2 : 3 + most_folds + cfg.spare_chunks;

  std::vector<int> slot_order(static_cast<std::size_t>(slots));
  std::iota(slot_order.begin(), slot_order.end(), 0);
  do {
    std::shuffle(slot_order.begin(), slot_order.end(), rng);
  } while (slot_order[0] == 0);
  const std::vector<int> batch_slots(slot_order.begin(), slot_order.begin() + B);

  // Views of every (slot, layer): counters only outside the batch (the kernel must not touch them).
  std::vector<layer_view> views(static_cast<std::size_t>(slots) * num_layers);
  std::memset(views.data(), 0, views.size() * sizeof(layer_view));
  for (layer_view& v : views) {
    v.context_chunks = static_cast<int>(rng() % 50);
    v.generated_exact_len = static_cast<int>(rng() % 50);
    v.ring_head = static_cast<int>(rng() % 50);
    v.last_position = static_cast<long long>(rng() % 100000);
  }
  std::vector<entry> entries(static_cast<std::size_t>(B));
  for (int b = 0; b < B; ++b) {
    entry& e = entries[static_cast<std::size_t>(b)];
    e.slot = batch_slots[static_cast<std::size_t>(b)];
    e.prompt_len = 100 + static_cast<int>(rng() % 1000);
    e.outlier_chunks = static_cast<int>(rng() % 4);
    e.local_len = static_cast<int>(rng() % static_cast<unsigned>(d.local_capacity + 1));
    e.context_chunks = static_cast<int>(rng() % (cfg.spare_chunks < 0 ? 2 : 4));
    e.generated_exact_len = b == 0 ? W : static_cast<int>(rng() % static_cast<unsigned>(W + 1));  // entry 0 folds first
    e.ring_head = C * static_cast<int>(rng() % static_cast<unsigned>(W / C));
    e.last_position = static_cast<long long>(rng() % 300000);
    // Data the fold reads: normals in T (a per-channel offset makes the landmarks non-zero); positions near the last.
    const std::size_t exact_elements = static_cast<std::size_t>(Hkv) * rows * D;
    fill_normals(cfg.kv_type, e.exact_keys, exact_elements, 1.0F, rng);
    for (std::size_t i = 0; i < exact_elements; ++i) {
      store_element(cfg.kv_type, e.exact_keys, i,
                    load_element(cfg.kv_type, e.exact_keys.data(), i) + 0.5F * static_cast<float>(i % 5));
    }
    fill_normals(cfg.kv_type, e.exact_values, exact_elements, 2.0F, rng);
    fill_normals(F, e.basis, static_cast<std::size_t>(r) * width, 1.0F / std::sqrt(static_cast<float>(width)), rng);
    e.exact_positions.assign(static_cast<std::size_t>(rows) * sizeof(long long), 0);
    for (int row = 0; row < rows; ++row) {
      set_long(e.exact_positions, static_cast<std::size_t>(row),
               e.last_position - static_cast<long long>(rng() % 5000));
    }
    // Arrays the kernel only writes: random bytes, which must stay wherever the kernel has no business.
    const std::size_t max_tokens = static_cast<std::size_t>(d.max_chunks) * C;
    fill_bytes(e.coefficients, max_tokens * r * element_bytes(F), rng);
    fill_bytes(e.context_positions, max_tokens * sizeof(long long), rng);
    fill_bytes(e.landmarks, static_cast<std::size_t>(Hkv) * d.max_chunks * D * element_bytes(cfg.kv_type), rng);
    fill_bytes(e.value_store, max_tokens * width * (cfg.value_fp8 ? 1 : element_bytes(cfg.kv_type)), rng);
    fill_bytes(e.value_scales, static_cast<std::size_t>(d.max_chunks) * Hkv * sizeof(float), rng);

    std::vector<std::vector<unsigned char>*> arrays = e.arrays();
    std::vector<device_buffer*> targets = {&e.coefficients_d, &e.landmarks_d, &e.exact_keys_d, &e.exact_values_d,
                                           &e.value_store_d, &e.value_scales_d, &e.context_positions_d,
                                           &e.exact_positions_d, &e.basis_d};
    for (std::size_t i = 0; i < arrays.size(); ++i) {
      *targets[i] = device_buffer(arrays[i]->size());
      ASSERT_TRUE(targets[i]->ok());
      CUDA_OK(upload(*targets[i], *arrays[i]));
    }
    layer_view& v = views[static_cast<std::size_t>(e.slot) * num_layers + layer];
    v = layer_view{};
    v.prompt_len = e.prompt_len;
    v.context_chunks = e.context_chunks;
    v.outlier_chunks = e.outlier_chunks;
    v.local_len = e.local_len;
    v.generated_exact_len = e.generated_exact_len;
    v.ring_head = e.ring_head;
    v.last_position = e.last_position;
    v.basis = e.basis_d.get();
    v.coefficients = e.coefficients_d.get();
    v.context_positions = e.context_positions_d.get<long long>();
    v.landmarks = e.landmarks_d.get();
    v.exact_keys = e.exact_keys_d.get();
    v.exact_values = e.exact_values_d.get();
    v.exact_positions = e.exact_positions_d.get<long long>();
    v.value_store = e.value_store_d.get();
    v.value_scales = e.value_scales_d.get<float>();
  }
  std::vector<layer_view> expected_views = views;

  std::vector<float> inv_freq(static_cast<std::size_t>(d.rotary_dim / 2));
  for (std::size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = static_cast<float>(1.0 / std::pow(cfg.rope_theta, static_cast<double>(2 * i) / d.rotary_dim));
  }

  // Inputs k_new, v_new [B, Hkv, D] of input_type, strided or not; positions [B] of 32 or 64 bits, stride 1 or 2.
  const long long e_stride = cfg.strided_inputs ? 2 : 1;
  const long long h_stride = cfg.strided_inputs ? D * e_stride + 3 : D;
  const long long b_stride = cfg.strided_inputs ? Hkv * h_stride + 5 : Hkv * h_stride;
  const std::size_t input_elements = static_cast<std::size_t>(B * b_stride);
  const std::size_t input_bytes = input_elements * element_bytes(cfg.input_type);
  const int positions_bits = cfg.positions == positions_mode::int32 ? 32 : 64;
  const long long p_stride = cfg.strided_inputs ? 2 : 1;
  const std::size_t positions_bytes = static_cast<std::size_t>(B * p_stride) * (positions_bits / 8);
  device_buffer k_device(input_bytes);
  device_buffer v_device(input_bytes);
  device_buffer positions_device(positions_bytes);
  device_buffer views_device(views.size() * sizeof(layer_view));
  device_buffer slots_device(batch_slots.size() * sizeof(int));
  device_buffer inv_freq_device(std::max<std::size_t>(inv_freq.size(), 1) * sizeof(float));
  ASSERT_TRUE(k_device.ok() && v_device.ok() && positions_device.ok() && views_device.ok() && slots_device.ok() &&
              inv_freq_device.ok());
  CUDA_OK(cudaMemcpy(views_device.get(), views.data(), views.size() * sizeof(layer_view), cudaMemcpyHostToDevice));
  CUDA_OK(upload(slots_device, batch_slots));
  CUDA_OK(upload(inv_freq_device, inv_freq));
  const strided_tensor k_new{k_device.get(), cfg.input_type, {b_stride, h_stride, e_stride, 0}};
  const strided_tensor v_new{v_device.get(), cfg.input_type, {b_stride, h_stride, e_stride, 0}};
  const strided_tensor positions{cfg.positions == positions_mode::last_plus_one ? nullptr : positions_device.get(),
                                 0, {p_stride, 0, 0, 0}};

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaGraphExec_t graph_exec = nullptr;
  const auto launch = [&] {
    shadowkv::cuda::launch_advance_generated(d, cfg.kv_type, views_device.get<layer_view>(), slots_device.get<int>(),
                                             layer, B, k_new, v_new, positions, positions_bits, cfg.keys_post_rope,
                                             inv_freq_device.get<float>(), stream);
  };

  int folds = 0;
  int stops = 0;
  std::size_t loose_compared = 0;
  double worst_ratio = 0.0;
  double landmark_norm = 0.0;
  double coefficient_norm = 0.0;
  for (int step = 0; step < cfg.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // This step's inputs: padding between strided elements holds NaN, which must not be read.
    std::vector<unsigned char> k_bytes(input_bytes);
    std::vector<unsigned char> v_bytes(input_bytes);
    for (std::size_t i = 0; i < input_elements; ++i) {
      store_element(cfg.input_type, k_bytes, i, std::nanf(""));
      store_element(cfg.input_type, v_bytes, i, std::nanf(""));
    }
    std::vector<std::vector<float>> keys(static_cast<std::size_t>(B)), values(static_cast<std::size_t>(B));
    std::vector<long long> given(static_cast<std::size_t>(B));
    std::vector<unsigned char> position_bytes(positions_bytes, 0xEE);
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < Hkv; ++h) {
        for (int dim = 0; dim < D; ++dim) {
          const auto at = static_cast<std::size_t>(b * b_stride + h * h_stride + dim * e_stride);
          store_element(cfg.input_type, k_bytes, at, normal(rng) + 0.5F * static_cast<float>(dim % 5));
          store_element(cfg.input_type, v_bytes, at, 2.0F * normal(rng));
          keys[static_cast<std::size_t>(b)].push_back(load_element(cfg.input_type, k_bytes.data(), at));
          values[static_cast<std::size_t>(b)].push_back(load_element(cfg.input_type, v_bytes.data(), at));
        }
      }
      // Positions: mostly the next one, sometimes a jump (forward or back), within int32.
      const entry& e = entries[static_cast<std::size_t>(b)];
      const long long jump = rng() % 4 == 0 ? static_cast<long long>(rng() % 20001) - 10000 : 0;
      given[static_cast<std::size_t>(b)] = std::max<long long>(0, e.last_position + 1 + jump);
      const auto at = static_cast<std::size_t>(b * p_stride);
      if (positions_bits == 32) {
        const auto p32 = static_cast<std::int32_t>(given[static_cast<std::size_t>(b)]);
        std::memcpy(position_bytes.data() + at * 4, &p32, 4);
      } else {
        std::memcpy(position_bytes.data() + at * 8, &given[static_cast<std::size_t>(b)], 8);
      }
    }
    CUDA_OK(cudaMemcpy(k_device.get(), k_bytes.data(), input_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(v_device.get(), v_bytes.data(), input_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(positions_device.get(), position_bytes.data(), positions_bytes, cudaMemcpyHostToDevice));

    if (!cfg.graph || step == 0) {
      ASSERT_NO_THROW(launch());
    } else {
      if (graph_exec == nullptr) {
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        ASSERT_NO_THROW(launch());
        cudaGraph_t graph = nullptr;
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));
        CUDA_OK(cudaGraphDestroy(graph));
      }
      CUDA_OK(cudaGraphLaunch(graph_exec, stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaGetLastError());

    // The model's step, then every array and every view compared.
    for (int b = 0; b < B; ++b) {
      entry& e = entries[static_cast<std::size_t>(b)];
      SCOPED_TRACE("entry " + std::to_string(b) + " (slot " + std::to_string(e.slot) + ")");
      const int chunk_before = e.context_chunks;
      const int folds_before = folds;
      const std::vector<approximate> loose =
          model_step(cfg, d, inv_freq, e, keys[static_cast<std::size_t>(b)], values[static_cast<std::size_t>(b)],
                     cfg.positions == positions_mode::last_plus_one ? nullptr : &given[static_cast<std::size_t>(b)],
                     folds, stops);
      layer_view& v = expected_views[static_cast<std::size_t>(e.slot) * num_layers + layer];
      v.context_chunks = e.context_chunks;
      v.generated_exact_len = e.generated_exact_len;
      v.ring_head = e.ring_head;
      v.last_position = e.last_position;

      std::vector<std::vector<unsigned char>*> arrays = e.arrays();
      const std::vector<const device_buffer*> buffers = e.buffers();
      std::vector<std::vector<unsigned char>> got(arrays.size());
      for (std::size_t i = 0; i < arrays.size(); ++i) {
        CUDA_OK(download(got[i], buffers[i]->get<unsigned char>(), arrays[i]->size()));
      }
      int loose_failures = 0;
      for (const approximate& a : loose) {
        const int type = a.array == kCoefficients ? F : cfg.kv_type;
        const double value = load_element(type, got[static_cast<std::size_t>(a.array)].data(), a.index);
        const double error = std::fabs(value - a.want);
        worst_ratio = std::max(worst_ratio, error / a.allowed);
        ++loose_compared;
        if (!(error <= a.allowed) && loose_failures++ < 5) {
          ADD_FAILURE() << a.what << ": " << entry::array_name(a.array) << "[" << a.index << "] = " << value
                        << ", want " << a.want << " (error " << error << ", allowed " << a.allowed << ")";
        }
        // Take the device's bits, so that the exact comparisons below and later steps see the same bytes.
        const std::size_t bytes = element_bytes(type);
        std::memcpy(arrays[static_cast<std::size_t>(a.array)]->data() + a.index * bytes,
                    got[static_cast<std::size_t>(a.array)].data() + a.index * bytes, bytes);
      }
      ASSERT_EQ(loose_failures, 0) << loose_failures << " elements outside their tolerance";
      for (std::size_t i = 0; i < arrays.size(); ++i) {
        const auto mismatch = std::mismatch(arrays[i]->begin(), arrays[i]->end(), got[i].begin());
        ASSERT_TRUE(mismatch.first == arrays[i]->end())
            << entry::array_name(static_cast<int>(i)) << " differs from the model at byte "
            << (mismatch.first - arrays[i]->begin()) << " of " << arrays[i]->size();
      }
      if (folds > folds_before) {
        for (int h = 0; h < Hkv; ++h) {
          for (int dim = 0; dim < D; ++dim) {
            const double x = load_element(
                cfg.kv_type, e.landmarks.data(), (static_cast<std::size_t>(h) * d.max_chunks + chunk_before) * D + dim);
            landmark_norm += x * x;
          }
        }
        for (std::size_t i = 0; i < static_cast<std::size_t>(C) * r; ++i) {
          const double x = load_element(F, e.coefficients.data(), static_cast<std::size_t>(chunk_before) * C * r + i);
          coefficient_norm += x * x;
        }
      }
    }
    std::vector<layer_view> got_views(views.size());
    CUDA_OK(cudaMemcpy(got_views.data(), views_device.get(), views.size() * sizeof(layer_view),
                       cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < views.size(); ++i) {
      SCOPED_TRACE("view of slot " + std::to_string(i / num_layers) + " layer " + std::to_string(i % num_layers));
      const layer_view& want = expected_views[i];
      const layer_view& have = got_views[i];
      ASSERT_EQ(have.prompt_len, want.prompt_len);
      ASSERT_EQ(have.context_chunks, want.context_chunks);
      ASSERT_EQ(have.outlier_chunks, want.outlier_chunks);
      ASSERT_EQ(have.local_len, want.local_len);
      ASSERT_EQ(have.generated_exact_len, want.generated_exact_len);
      ASSERT_EQ(have.ring_head, want.ring_head);
      ASSERT_EQ(have.last_position, want.last_position);
      ASSERT_EQ(std::memcmp(&have.basis, &want.basis, sizeof(layer_view) - offsetof(layer_view, basis)), 0)
          << "the kernel changed a pointer of the view";
    }
  }
  if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaStreamDestroy(stream));

  EXPECT_GT(folds, 0) << "the run must fold";
  EXPECT_GT(landmark_norm, 0.0) << "folded landmarks are all zero";
  EXPECT_GT(coefficient_norm, 0.0) << "folded A rows are all zero";
  if (cfg.spare_chunks < 0) EXPECT_GT(stops, 0) << "the run must reach the capacity guard";
  std::printf("[ generated_tokens ]   %d folds, %d capacity stops, %zu elements within tolerance (worst error / "
              "tolerance %.3g)\n",
              folds, stops, loose_compared, worst_ratio);
}

class GeneratedTokens : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!device_present()) GTEST_SKIP() << "no CUDA device: launch_advance_generated is not exercised";
  }
};

constexpr int kTypes[] = {element_f32, element_bf16, element_f16};

TEST_F(GeneratedTokens, HeadDimsChunksWindowsAndTypes) {
  // Every D x C x T; the other parameters rotate with the case index so that each value of each meets many others.
  const int kv_heads[] = {1, 2, 4};
  const int windows_in_chunks[] = {1, 2, 4};
  const float scalings[] = {1.0F, 0.75F, 1.25F, 1.0F};
  const positions_mode modes[] = {positions_mode::last_plus_one, positions_mode::int64, positions_mode::int32};
  int index = 0;
  for (int head_dim : {64, 80, 96, 128, 256}) {
    for (int chunk : {1, 8, 16}) {
      for (int type : kTypes) {
        case_config cfg;
        cfg.seed = 0x6E7ULL + 7919ULL * static_cast<std::uint64_t>(index);
        cfg.head_dim = head_dim;
        cfg.chunk = chunk;
        cfg.window = chunk * windows_in_chunks[index % 3];
        cfg.kv_heads = kv_heads[(index / 3) % 3];
        cfg.batch = 1 + (index / 2) % 3;
        cfg.rank = index % 4 == 0 ? 0 : std::min(40 + index, cfg.kv_heads * head_dim);
        cfg.rotary_dim = index % 2 == 0 ? 0 : head_dim / 2;
        cfg.interleaved = (index / 2) % 2 == 1;
        cfg.attention_scaling = scalings[index % 4];
        cfg.rope_theta = index % 3 == 1 ? 500000.0 : 10000.0;
        cfg.kv_type = type;
        cfg.bf16_factors = (index / 5) % 2 == 1;
        cfg.value_fp8 = index % 7 == 3;
        cfg.input_type = kTypes[(index / 4) % 3];
        cfg.strided_inputs = index % 5 == 2;
        cfg.positions = modes[index % 3];
        cfg.keys_post_rope = (index / 3) % 2 == 0;
        cfg.steps = 3 * cfg.window + 5;
        run_case(cfg);
        if (HasFatalFailure()) return;
        ++index;
      }
    }
  }
}

TEST_F(GeneratedTokens, RopeOfKeysGivenBeforeRotation) {
  // k_new pre-RoPE: full and partial rotary dims, both pair layouts, scaling below, at and above one, given and
  // default positions; the folds un-rotate what the appends rotated.
  std::uint64_t seed = 101;
  for (bool partial : {false, true}) {
    for (bool interleaved : {false, true}) {
      for (float scaling : {1.0F, 0.7F, 1.3F}) {
        case_config cfg;
        cfg.seed = seed++;
        cfg.batch = 3;
        cfg.kv_heads = 2;
        cfg.head_dim = 128;
        cfg.rotary_dim = partial ? 64 : 0;
        cfg.interleaved = interleaved;
        cfg.attention_scaling = scaling;
        cfg.rope_theta = 500000.0;
        cfg.kv_type = scaling == 1.0F ? element_bf16 : element_f32;
        cfg.keys_post_rope = false;
        cfg.positions = seed % 2 == 0 ? positions_mode::int64 : positions_mode::last_plus_one;
        run_case(cfg);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(GeneratedTokens, Fp8ValueStore) {
  // The folded values as e4m3 codes and one scale per (chunk, head), for each store type.
  std::uint64_t seed = 201;
  for (int type : kTypes) {
    for (int chunk : {8, 16}) {
      case_config cfg;
      cfg.seed = seed++;
      cfg.batch = 2;
      cfg.kv_heads = 4;
      cfg.head_dim = 64;
      cfg.chunk = chunk;
      cfg.window = 2 * chunk;
      cfg.kv_type = type;
      cfg.value_fp8 = true;
      cfg.steps = 3 * cfg.window;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(GeneratedTokens, CapacityGuardLeavesFullSequencesUnchanged) {
  // The context arena fills up during the run: from then on a step whose ring is full changes nothing (the graph
  // replay guard), while steps with room still append.
  std::uint64_t seed = 301;
  for (int type : {element_f32, element_bf16}) {
    for (bool graph : {false, true}) {
      case_config cfg;
      cfg.seed = seed++;
      cfg.batch = 3;
      cfg.kv_type = type;
      cfg.spare_chunks = -1;  // max_chunks = 2, and each entry starts with 0 or 1 context chunks
      cfg.steps = 40;
      cfg.graph = graph;
      run_case(cfg);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(GeneratedTokens, ReplayedFromAGraph) {
  // One captured launch replayed step after step: the counters advance on the device, so each replay appends (and
  // folds) exactly as an eager launch.
  std::uint64_t seed = 401;
  for (int type : kTypes) {
    case_config cfg;
    cfg.seed = seed++;
    cfg.batch = 3;
    cfg.kv_heads = 2;
    cfg.head_dim = 128;
    cfg.chunk = 8;
    cfg.window = 24;
    cfg.kv_type = type;
    cfg.keys_post_rope = type != element_f16;
    cfg.positions = type == element_bf16 ? positions_mode::int32 : positions_mode::last_plus_one;
    cfg.strided_inputs = type == element_f32;
    cfg.steps = 60;
    cfg.graph = true;
    run_case(cfg);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
