// Split-KV sparse decode attention (cuda/kernels/sparse_attention.cuh) against a float64 loop over exactly the
// documented token set: outlier rows, local rows, generated ring rows, rows of filled cache slots.
//
// Rows outside that set (beyond the counts, ring rows not holding a generated token, empty cache slots, the output's
// and the workspace's untouched elements) are filled with NaN, so reading any of them shows up as a NaN output.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_check.hpp"
#include "device_layout.cuh"
#include "shadowkv/errors.hpp"
#include "sparse_attention.cuh"

namespace {

using shadowkv::cuda::dims;
using shadowkv::cuda::element_bf16;
using shadowkv::cuda::element_f16;
using shadowkv::cuda::element_f32;
using shadowkv::cuda::layer_view;
using shadowkv::cuda::strided_tensor;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver: clear the sticky error and report no device
    return false;
  }
  return count > 0;
}

#define SKIP_WITHOUT_DEVICE()                                                    \
  do {                                                                           \
    if (!device_present()) GTEST_SKIP() << "no CUDA device: GPU test skipped";   \
  } while (0)

const char* type_name(int type) {
  return type == element_f32 ? "f32" : type == element_f16 ? "f16" : "bf16";
}

std::size_t element_bytes(int type) { return type == element_f32 ? 4 : 2; }

/// Host array of one element type; values are rounded to it when written and read back exactly as stored.
class typed_array {
 public:
  typed_array(int type, std::size_t count) : type_(type), bytes_(count * element_bytes(type)) {}

  void set(std::size_t i, float value) {
    if (type_ == element_f32) {
      std::memcpy(bytes_.data() + i * 4, &value, 4);
    } else if (type_ == element_f16) {
      const __half h = __float2half_rn(value);
      std::memcpy(bytes_.data() + i * 2, &h, 2);
    } else {
      const __nv_bfloat16 h = __float2bfloat16_rn(value);
      std::memcpy(bytes_.data() + i * 2, &h, 2);
    }
  }

  [[nodiscard]] double get(std::size_t i) const {
    if (type_ == element_f32) {
      float value;
      std::memcpy(&value, bytes_.data() + i * 4, 4);
      return value;
    }
    if (type_ == element_f16) {
      __half h;
      std::memcpy(&h, bytes_.data() + i * 2, 2);
      return __half2float(h);
    }
    __nv_bfloat16 h;
    std::memcpy(&h, bytes_.data() + i * 2, 2);
    return __bfloat162float(h);
  }

  [[nodiscard]] std::size_t size_bytes() const { return bytes_.size(); }
  [[nodiscard]] const unsigned char* data() const { return bytes_.data(); }
  [[nodiscard]] unsigned char* data() { return bytes_.data(); }

 private:
  int type_;
  std::vector<unsigned char> bytes_;
};

/// Device allocations of one test, freed together.
class device_arena {
 public:
  device_arena() = default;
  device_arena(const device_arena&) = delete;
  device_arena& operator=(const device_arena&) = delete;
  ~device_arena() {
    for (void* p : blocks_) (void)cudaFree(p);
  }

  void* allocate(std::size_t bytes) {
    void* p = nullptr;
    SHADOWKV_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)));
    blocks_.push_back(p);
    return p;
  }

  void* upload(const void* host, std::size_t bytes) {
    void* p = allocate(bytes);
    if (bytes > 0) SHADOWKV_CUDA_TRY(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    // Landed before a kernel on a non-blocking stream reads it (cudaMemcpy from pageable memory returns once the data
    // is staged, before the legacy stream's DMA lands it).
    if (bytes > 0) SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
    return p;
  }

  void* upload(const typed_array& host) { return upload(host.data(), host.size_bytes()); }

 private:
  std::vector<void*> blocks_;
};

/// Counters and arrays of one (slot, layer) on the host, laid out as layer_view documents them.
struct host_view {
  int outlier_chunks = 0;
  int local_len = 0;
  int generated_exact_len = 0;
  int ring_head = 0;
  std::vector<int> cache_chunks;    // [Hkv, K]
  std::vector<int> selected_slots;  // [Hkv, k] K > k only: the slots attention reads, ascending, -1 padding
  typed_array outlier_keys{element_f32, 0};
  typed_array outlier_values{element_f32, 0};
  typed_array exact_keys{element_f32, 0};
  typed_array exact_values{element_f32, 0};
  typed_array cache_keys{element_f32, 0};
  typed_array cache_values{element_f32, 0};
};

/// A strided [B, Hq, D] tensor layout: 0 contiguous, 1 padded rows, 2 head-major, 3 every other element.
struct tensor_layout {
  long long stride[3];
  std::size_t elements;
};

tensor_layout make_layout(int kind, int batch, int heads, int head_dim) {
  const long long b = batch;
  const long long hq = heads;
  const long long dd = head_dim;
  switch (kind) {
    case 1: return {{hq * (dd + 8), dd + 8, 1}, static_cast<std::size_t>(b * hq * (dd + 8))};
    case 2: return {{dd, b * dd, 1}, static_cast<std::size_t>(b * hq * dd)};
    case 3: return {{hq * 2 * dd, 2 * dd, 2}, static_cast<std::size_t>(b * hq * 2 * dd)};
    default: return {{hq * dd, dd, 1}, static_cast<std::size_t>(b * hq * dd)};
  }
}

long long offset_of(const tensor_layout& layout, int b, int j, int dim) {
  return b * layout.stride[0] + j * layout.stride[1] + dim * layout.stride[2];
}

struct attention_case {
  std::uint64_t seed = 0;
  int batch = 1;
  int kv_heads = 1;
  int group = 1;
  int head_dim = 64;
  int kv_type = element_bf16;
  int q_type = element_bf16;
  int out_type = element_bf16;
  int chunk = 8;
  int budget = 4;
  int cache_slots = 0;  // K; 0: the budget
  int max_outliers = 2;
  int local_chunks = 1;
  int window = 16;
  int num_layers = 2;
  int layer = 1;
  int extra_slots = 1;
  int q_layout = 0;
  int out_layout = 0;
  int max_splits = 0;  // 0: sparse_attention_max_splits(d)
  int early = 0;       // dims::attention_early: the tensor-core kernel waits only before its first copies

  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "seed=" << seed << " B=" << batch << " Hkv=" << kv_heads << " G=" << group << " D=" << head_dim
      << " kv=" << type_name(kv_type) << " q=" << type_name(q_type) << " out=" << type_name(out_type)
      << " C=" << chunk << " k=" << budget << " K=" << (cache_slots > 0 ? cache_slots : budget)
      << " O=" << max_outliers << " Lc=" << local_chunks << " W=" << window
      << " layer=" << layer << "/" << num_layers << " q_layout=" << q_layout << " out_layout=" << out_layout
      << " max_splits=" << max_splits << " early=" << early;
    return s.str();
  }
};

attention_case random_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int head_dims[] = {64, 80, 96, 128, 256};
  const int groups[] = {1, 3, 4, 8, 12};
  attention_case c;
  c.seed = seed;
  c.batch = pick(1, 4);
  c.kv_heads = pick(1, 8);
  c.group = groups[pick(0, 4)];
  c.head_dim = head_dims[pick(0, 4)];
  c.kv_type = pick(0, 2);
  c.q_type = pick(0, 2);
  c.out_type = pick(0, 2);
  c.chunk = pick(0, 1) == 0 ? 4 : 8;
  c.budget = pick(1, 12);
  c.max_outliers = pick(0, 3);
  c.local_chunks = pick(0, 3);
  c.window = c.chunk * pick(1, 4);
  c.num_layers = pick(1, 3);
  c.layer = pick(0, c.num_layers - 1);
  c.extra_slots = pick(0, 2);
  c.q_layout = pick(0, 3);
  c.out_layout = pick(0, 3);
  c.max_splits = pick(0, 3) == 0 ? pick(1, 3) : 0;
  return c;
}

dims make_dims(const attention_case& c) {
  dims d{};
  d.num_layers = c.num_layers;
  d.q_heads = c.kv_heads * c.group;
  d.kv_heads = c.kv_heads;
  d.head_dim = c.head_dim;
  d.group = c.group;
  d.chunk = c.chunk;
  d.budget = c.budget;
  d.cache_slots = c.cache_slots > 0 ? c.cache_slots : c.budget;
  d.attention_early = c.early;
  d.max_outliers = c.max_outliers;
  d.rank = 1;
  d.window = c.window;
  d.local_capacity = (c.local_chunks + 1) * c.chunk - 1;
  d.max_chunks = 64;
  d.rotary_dim = c.head_dim;
  d.attention_scaling = 1.0F;
  d.softmax_scale = 1.0F / std::sqrt(static_cast<float>(c.head_dim));
  return d;
}

/// Everything of one launch: host data, device copies, the output read back.
struct attention_run {
  attention_case c;
  dims d{};
  std::vector<int> batch_slots;
  std::vector<host_view> views;  // per batch entry
  typed_array q{element_f32, 0};
  tensor_layout q_layout{};
  tensor_layout out_layout{};
  int max_splits = 0;

  device_arena arena;
  layer_view* device_views = nullptr;
  int* device_slots = nullptr;
  void* device_q = nullptr;
  void* device_out = nullptr;
  float* device_partial = nullptr;
  std::size_t partial_floats = 0;
};

void fill_rows(typed_array& array, std::size_t first_element, int rows, int head_dim, std::mt19937_64& rng,
               float scale) {
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::size_t i = 0; i < static_cast<std::size_t>(rows) * head_dim; ++i) {
    array.set(first_element + i, scale * normal(rng));
  }
}

void fill_nan(typed_array& array, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) array.set(i, kNaN);
}

// Builds host data with ragged counts per entry and uploads it. Entry 0 has no outliers; when k >= 3 the middle
// buffer slot of every head is empty; every entry's ring starts at a non-zero slot when W > 1. With K > k slots,
// every head lists up to k of its filled slots as selected (some heads none); the other slots hold NaN rows, so
// that reading a cached but unselected slot poisons the output.
void prepare(attention_run& run) {
  const attention_case& c = run.c;
  run.d = make_dims(c);
  const dims& d = run.d;
  std::mt19937_64 rng(c.seed * 0x9E3779B97F4A7C15ULL + 1);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int D = c.head_dim;
  const int slots = c.batch + c.extra_slots;

  std::vector<int> order(static_cast<std::size_t>(slots));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  run.batch_slots.assign(order.begin(), order.begin() + c.batch);

  const std::size_t outlier_rows = static_cast<std::size_t>(d.max_outliers) * d.chunk;
  const std::size_t exact_rows = static_cast<std::size_t>(d.local_capacity) + d.window;
  const std::size_t cache_rows = static_cast<std::size_t>(d.cache_slots) * d.chunk;
  const std::size_t H = static_cast<std::size_t>(d.kv_heads);
  const float key_scale = 1.5F;
  const bool listed = d.cache_slots > d.budget;

  run.views.resize(static_cast<std::size_t>(c.batch));
  for (int b = 0; b < c.batch; ++b) {
    host_view& v = run.views[static_cast<std::size_t>(b)];
    v.outlier_chunks = b == 0 ? 0 : pick(0, d.max_outliers);
    v.local_len = pick(0, d.local_capacity);
    v.generated_exact_len = pick(0, d.window);
    v.ring_head = d.window > 1 ? pick(1, d.window - 1) : 0;
    if (!listed) {
      v.cache_chunks.assign(H * d.budget, -1);
      for (std::size_t h = 0; h < H; ++h) {
        for (int s = 0; s < d.budget; ++s) {
          v.cache_chunks[h * d.budget + s] = pick(0, 3) == 0 ? -1 : pick(0, d.max_chunks - 1);
        }
        if (d.budget >= 3) {
          v.cache_chunks[h * d.budget + d.budget / 2] = -1;
          v.cache_chunks[h * d.budget + d.budget - 1] = pick(0, d.max_chunks - 1);
        }
      }
    } else {
      const std::size_t K = static_cast<std::size_t>(d.cache_slots);
      v.cache_chunks.assign(H * K, -1);
      v.selected_slots.assign(H * d.budget, -1);
      for (std::size_t h = 0; h < H; ++h) {
        std::vector<int> filled;
        for (std::size_t s = 0; s < K; ++s) {
          if (pick(0, 5) == 0) continue;
          v.cache_chunks[h * K + s] = pick(0, d.max_chunks - 1);
          filled.push_back(static_cast<int>(s));
        }
        std::shuffle(filled.begin(), filled.end(), rng);
        // Usually a full selection, sometimes a short one, now and then none.
        const int most = std::min(d.budget, static_cast<int>(filled.size()));
        const int count = pick(0, 4) == 0 ? pick(0, most) : most;
        filled.resize(static_cast<std::size_t>(count));
        std::sort(filled.begin(), filled.end());
        std::copy(filled.begin(), filled.end(), v.selected_slots.begin() + static_cast<std::ptrdiff_t>(h * d.budget));
      }
    }
    // The slots attention reads, per head.
    auto read_slots = [&](std::size_t h) {
      std::vector<int> result;
      for (int e = 0; e < d.budget; ++e) {
        if (listed) {
          const int s = v.selected_slots[h * d.budget + e];
          if (s >= 0) result.push_back(s);
        } else if (v.cache_chunks[h * d.budget + e] >= 0) {
          result.push_back(e);
        }
      }
      return result;
    };
    // Every head needs a token (decode always has the new one).
    bool any_cached = true;
    for (std::size_t h = 0; h < H; ++h) any_cached = any_cached && !read_slots(h).empty();
    if (v.outlier_chunks == 0 && v.local_len == 0 && v.generated_exact_len == 0 && !any_cached) {
      v.generated_exact_len = 1;
    }

    v.outlier_keys = typed_array(c.kv_type, H * outlier_rows * D);
    v.outlier_values = typed_array(c.kv_type, H * outlier_rows * D);
    v.exact_keys = typed_array(c.kv_type, H * exact_rows * D);
    v.exact_values = typed_array(c.kv_type, H * exact_rows * D);
    v.cache_keys = typed_array(c.kv_type, H * cache_rows * D);
    v.cache_values = typed_array(c.kv_type, H * cache_rows * D);
    fill_nan(v.outlier_keys, H * outlier_rows * D);
    fill_nan(v.outlier_values, H * outlier_rows * D);
    fill_nan(v.exact_keys, H * exact_rows * D);
    fill_nan(v.exact_values, H * exact_rows * D);
    fill_nan(v.cache_keys, H * cache_rows * D);
    fill_nan(v.cache_values, H * cache_rows * D);

    layer_view shape{};
    shape.ring_head = v.ring_head;
    for (std::size_t h = 0; h < H; ++h) {
      const int rows = v.outlier_chunks * d.chunk;
      fill_rows(v.outlier_keys, h * outlier_rows * D, rows, D, rng, key_scale);
      fill_rows(v.outlier_values, h * outlier_rows * D, rows, D, rng, 1.0F);
      fill_rows(v.exact_keys, h * exact_rows * D, v.local_len, D, rng, key_scale);
      fill_rows(v.exact_values, h * exact_rows * D, v.local_len, D, rng, 1.0F);
      for (int i = 0; i < v.generated_exact_len; ++i) {
        const std::size_t row = static_cast<std::size_t>(shadowkv::cuda::generated_row(shape, d, i));
        fill_rows(v.exact_keys, (h * exact_rows + row) * D, 1, D, rng, key_scale);
        fill_rows(v.exact_values, (h * exact_rows + row) * D, 1, D, rng, 1.0F);
      }
      for (const int s : read_slots(h)) {
        const std::size_t first = (h * cache_rows + static_cast<std::size_t>(s) * d.chunk) * D;
        fill_rows(v.cache_keys, first, d.chunk, D, rng, key_scale);
        fill_rows(v.cache_values, first, d.chunk, D, rng, 1.0F);
      }
    }
  }

  run.q_layout = make_layout(c.q_layout, c.batch, d.q_heads, D);
  run.out_layout = make_layout(c.out_layout, c.batch, d.q_heads, D);
  run.q = typed_array(c.q_type, run.q_layout.elements);
  fill_nan(run.q, run.q_layout.elements);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (int b = 0; b < c.batch; ++b) {
    for (int j = 0; j < d.q_heads; ++j) {
      for (int dim = 0; dim < D; ++dim) {
        run.q.set(static_cast<std::size_t>(offset_of(run.q_layout, b, j, dim)), normal(rng));
      }
    }
  }
  run.max_splits = c.max_splits > 0 ? c.max_splits : shadowkv::cuda::sparse_attention_max_splits(d);

  // Device copies. Views of slots/layers not in the batch stay zero: the kernel must not touch them.
  std::vector<layer_view> all_views(static_cast<std::size_t>(slots) * d.num_layers, layer_view{});
  for (int b = 0; b < c.batch; ++b) {
    const host_view& v = run.views[static_cast<std::size_t>(b)];
    layer_view& view = all_views[static_cast<std::size_t>(run.batch_slots[static_cast<std::size_t>(b)]) *
                                     d.num_layers + c.layer];
    view.prompt_len = 1000;
    view.context_chunks = 10;
    view.outlier_chunks = v.outlier_chunks;
    view.local_len = v.local_len;
    view.generated_exact_len = v.generated_exact_len;
    view.ring_head = v.ring_head;
    view.last_position = 2000;
    view.outlier_keys = run.arena.upload(v.outlier_keys);
    view.outlier_values = run.arena.upload(v.outlier_values);
    view.exact_keys = run.arena.upload(v.exact_keys);
    view.exact_values = run.arena.upload(v.exact_values);
    view.cache_keys = run.arena.upload(v.cache_keys);
    view.cache_values = run.arena.upload(v.cache_values);
    view.cache_chunks = static_cast<int*>(run.arena.upload(v.cache_chunks.data(), v.cache_chunks.size() * sizeof(int)));
    if (listed) {
      view.selected_slots =
          static_cast<int*>(run.arena.upload(v.selected_slots.data(), v.selected_slots.size() * sizeof(int)));
    }
    view.value_store = nullptr;  // attention never reads it
  }
  run.device_views =
      static_cast<layer_view*>(run.arena.upload(all_views.data(), all_views.size() * sizeof(layer_view)));
  run.device_slots =
      static_cast<int*>(run.arena.upload(run.batch_slots.data(), run.batch_slots.size() * sizeof(int)));
  run.device_q = run.arena.upload(run.q);
  const std::size_t out_bytes = run.out_layout.elements * element_bytes(c.out_type);
  run.device_out = run.arena.allocate(out_bytes);
  SHADOWKV_CUDA_TRY(cudaMemset(run.device_out, 0xFF, out_bytes));  // NaN in every element type
  run.partial_floats = static_cast<std::size_t>(c.batch) * d.q_heads * run.max_splits * (D + 2);
  run.device_partial = static_cast<float*>(run.arena.allocate(run.partial_floats * sizeof(float)));
  SHADOWKV_CUDA_TRY(cudaMemset(run.device_partial, 0xFF, run.partial_floats * sizeof(float)));
}

void launch(attention_run& run, cudaStream_t stream) {
  const tensor_layout& ql = run.q_layout;
  const tensor_layout& ol = run.out_layout;
  const strided_tensor q{run.device_q, run.c.q_type, {ql.stride[0], ql.stride[1], ql.stride[2], 0}};
  const strided_tensor out{run.device_out, run.c.out_type, {ol.stride[0], ol.stride[1], ol.stride[2], 0}};
  shadowkv::cuda::launch_sparse_attention(run.d, run.c.kv_type, run.device_views, run.device_slots, run.c.layer,
                                          run.c.batch, q, out, run.device_partial, run.max_splits, stream);
}

typed_array read_output(const attention_run& run) {
  typed_array out(run.c.out_type, run.out_layout.elements);
  SHADOWKV_CUDA_TRY(cudaMemcpy(out.data(), run.device_out, out.size_bytes(), cudaMemcpyDeviceToHost));
  return out;
}

/// float64 attention of query head j of entry b over exactly the documented token set.
std::vector<double> reference(const attention_run& run, int b, int j) {
  const dims& d = run.d;
  const int D = d.head_dim;
  const int h = j / d.group;
  const host_view& v = run.views[static_cast<std::size_t>(b)];
  const std::size_t outlier_rows = static_cast<std::size_t>(d.max_outliers) * d.chunk;
  const std::size_t exact_rows = static_cast<std::size_t>(d.local_capacity) + d.window;
  const std::size_t cache_rows = static_cast<std::size_t>(d.cache_slots) * d.chunk;

  struct token {
    const typed_array* keys;
    const typed_array* values;
    std::size_t first;  // element offset of the row
  };
  std::vector<token> tokens;
  for (int i = 0; i < v.outlier_chunks * d.chunk; ++i) {
    tokens.push_back({&v.outlier_keys, &v.outlier_values, (h * outlier_rows + i) * D});
  }
  for (int i = 0; i < v.local_len; ++i) tokens.push_back({&v.exact_keys, &v.exact_values, (h * exact_rows + i) * D});
  layer_view shape{};
  shape.ring_head = v.ring_head;
  for (int i = 0; i < v.generated_exact_len; ++i) {
    const std::size_t row = static_cast<std::size_t>(shadowkv::cuda::generated_row(shape, d, i));
    tokens.push_back({&v.exact_keys, &v.exact_values, (h * exact_rows + row) * D});
  }
  for (int e = 0; e < d.budget; ++e) {
    // K == k: every filled slot; K > k: the listed (selected) slots only.
    const bool larger = d.cache_slots > d.budget;
    const int s = larger ? v.selected_slots[static_cast<std::size_t>(h) * d.budget + e] : e;
    if (s < 0 || (!larger && v.cache_chunks[static_cast<std::size_t>(h) * d.budget + s] < 0)) continue;
    for (int r = 0; r < d.chunk; ++r) {
      const std::size_t row = h * cache_rows + static_cast<std::size_t>(s) * d.chunk + r;
      tokens.push_back({&v.cache_keys, &v.cache_values, row * D});
    }
  }

  std::vector<double> logits(tokens.size());
  double max_logit = -std::numeric_limits<double>::infinity();
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    double dot = 0.0;
    for (int dim = 0; dim < D; ++dim) {
      dot += run.q.get(static_cast<std::size_t>(offset_of(run.q_layout, b, j, dim))) *
             tokens[t].keys->get(tokens[t].first + dim);
    }
    logits[t] = static_cast<double>(d.softmax_scale) * dot;
    max_logit = std::max(max_logit, logits[t]);
  }
  std::vector<double> out(static_cast<std::size_t>(D), 0.0);
  double total = 0.0;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const double p = std::exp(logits[t] - max_logit);
    total += p;
    for (int dim = 0; dim < D; ++dim) out[dim] += p * tokens[t].values->get(tokens[t].first + dim);
  }
  for (double& x : out) x /= total;
  return out;
}

/// Relative tolerance: float32 end to end is ~1e-6; otherwise the output's own rounding dominates.
double tolerance(const attention_case& c) {
  if (c.out_type == element_bf16) return 2e-2;
  if (c.out_type == element_f16) return 2e-3;
  return 1e-5;
}

// Compares every output element with the reference: |out - ref| <= tol * max(|ref|, max |ref| over the head).
void expect_matches_reference(const attention_run& run, const typed_array& out) {
  const double tol = tolerance(run.c);
  const int D = run.d.head_dim;
  double output_norm = 0.0;
  for (int b = 0; b < run.c.batch; ++b) {
    for (int j = 0; j < run.d.q_heads; ++j) {
      const std::vector<double> expected = reference(run, b, j);
      double head_scale = 0.0;
      for (double x : expected) head_scale = std::max(head_scale, std::fabs(x));
      ASSERT_GT(head_scale, 0.0) << "reference output of entry " << b << " head " << j << " is zero";
      int reported = 0;
      for (int dim = 0; dim < D; ++dim) {
        const double got = out.get(static_cast<std::size_t>(offset_of(run.out_layout, b, j, dim)));
        output_norm += got * got;
        const double bound = tol * std::max(std::fabs(expected[dim]), head_scale);
        const bool ok = std::isfinite(got) && std::fabs(got - expected[dim]) <= bound;
        if (!ok && reported++ < 4) {
          ADD_FAILURE() << "entry " << b << " head " << j << " dim " << dim << ": got " << got << ", expected "
                        << expected[dim] << " (bound " << bound << ")";
        }
      }
    }
  }
  EXPECT_GT(std::sqrt(output_norm), 0.0) << "output is all zeros";
}

void run_and_check(const attention_case& c) {
  SCOPED_TRACE(c.describe());
  attention_run run;
  run.c = c;
  prepare(run);
  launch(run, nullptr);
  SHADOWKV_CUDA_TRY(cudaDeviceSynchronize());
  expect_matches_reference(run, read_output(run));
}

dims valid_dims() {
  attention_case c;
  c.head_dim = 128;
  return make_dims(c);
}

// Random cases: bf16 shapes with D <= 128 go to the tensor-core kernel, every other shape to the FMA one.
TEST(SparseAttention, MatchesFloat64ReferenceOnRandomConfigurations) {
  SKIP_WITHOUT_DEVICE();
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    run_and_check(random_case(seed));
    if (HasFatalFailure()) return;
  }
}

// The tensor-core kernel at float32 output precision (1e-5 of the head's largest output): Llama-3's group of 4 and
// D = 128, a group of 20 (two tiles of 16 heads), D = 80 and 64, the listed cache (K > k), many steps a split, and
// the kernel as released early (dims::attention_early).
TEST(SparseAttention, TensorCoreKernelKeepsFloat32Accuracy) {
  SKIP_WITHOUT_DEVICE();
  std::vector<attention_case> cases;
  for (const int head_dim : {128, 80, 64}) {
    for (const int group : {4, 20}) {
      attention_case c;
      c.seed = 2000 + head_dim + group;
      c.batch = 3;
      c.kv_heads = 2;
      c.group = group;
      c.head_dim = head_dim;
      c.kv_type = element_bf16;
      c.q_type = c.out_type = element_f32;
      c.budget = 40;
      c.max_outliers = 6;
      c.local_chunks = 2;
      c.window = 24;
      cases.push_back(c);
    }
  }
  attention_case listed = cases.front();
  listed.seed = 2999;
  listed.cache_slots = 2 * listed.budget;
  cases.push_back(listed);
  // The kernel released early (its wait before the first copies instead of its first line): the same results.
  for (const int cache_slots : {0, 80}) {
    attention_case early = cases.front();
    early.seed = 2998 - cache_slots;
    early.cache_slots = cache_slots;
    early.early = 1;
    cases.push_back(early);
  }
  for (const attention_case& c : cases) {
    run_and_check(c);
    if (HasFatalFailure()) return;
  }
}

TEST(SparseAttention, MatchesReferenceOnNamedShapes) {
  SKIP_WITHOUT_DEVICE();
  std::vector<attention_case> cases;
  {  // MQA: one KV head for all query heads, full-precision end to end.
    attention_case c;
    c.seed = 1001;
    c.batch = 2;
    c.kv_heads = 1;
    c.group = 16;
    c.head_dim = 128;
    c.kv_type = c.q_type = c.out_type = element_f32;
    cases.push_back(c);
  }
  {  // MHA, f16, head_dim 64.
    attention_case c;
    c.seed = 1002;
    c.batch = 4;
    c.kv_heads = 8;
    c.group = 1;
    c.head_dim = 64;
    c.kv_type = c.q_type = c.out_type = element_f16;
    cases.push_back(c);
  }
  {  // Llama-like GQA with a large budget (many splits), bf16.
    attention_case c;
    c.seed = 1003;
    c.batch = 1;
    c.kv_heads = 8;
    c.group = 4;
    c.head_dim = 128;
    c.budget = 96;
    c.max_outliers = 6;
    c.local_chunks = 4;
    c.window = 64;
    cases.push_back(c);
  }
  {  // head_dim 256 and 80 in float32 with q/out in other types.
    attention_case c;
    c.seed = 1004;
    c.batch = 3;
    c.kv_heads = 2;
    c.group = 8;
    c.head_dim = 256;
    c.kv_type = element_f32;
    c.q_type = element_bf16;
    c.out_type = element_f32;
    c.budget = 20;
    cases.push_back(c);
    c.seed = 1005;
    c.head_dim = 80;
    c.group = 5;
    cases.push_back(c);
  }
  {  // float32, head_dim 256, 3-4 query heads per KV head: the one instantiation that takes more than the 48 KiB
     // default of shared memory (64 KiB of pipeline stages, dynamic, with the opt-in attribute); group 3 leaves its
     // head tile part empty.
    attention_case c;
    c.seed = 1007;
    c.batch = 2;
    c.kv_heads = 2;
    c.group = 4;
    c.head_dim = 256;
    c.kv_type = c.q_type = c.out_type = element_f32;
    c.budget = 24;
    c.max_outliers = 3;
    c.window = 32;
    cases.push_back(c);
    c.seed = 1008;
    c.group = 3;
    c.max_splits = 1;  // one CTA walks every row: many pipeline steps through the two 32 KiB stages
    cases.push_back(c);
  }
  {  // One split only: the whole row list in one CTA per head.
    attention_case c;
    c.seed = 1006;
    c.batch = 2;
    c.kv_heads = 3;
    c.group = 4;
    c.head_dim = 96;
    c.budget = 40;
    c.max_splits = 1;
    cases.push_back(c);
  }
  for (const attention_case& c : cases) {
    run_and_check(c);
    if (HasFatalFailure()) return;
  }
}

// A selection cache larger than the budget: the kernel reads the listed slots (selected_slots) out of K, never the
// cached but unselected ones (NaN rows here), on the random shapes above.
TEST(SparseAttention, LargerCacheReadsOnlyTheSelectedSlots) {
  SKIP_WITHOUT_DEVICE();
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    attention_case c = random_case(seed);
    c.cache_slots = c.budget * static_cast<int>(2 + seed % 3);
    run_and_check(c);
    if (HasFatalFailure()) return;
  }
}

// The launch has no host synchronisation and shapes that depend only on the dims and the batch size: it can be
// captured in a CUDA graph, and replaying the graph gives the direct launch's result bit for bit.
TEST(SparseAttention, CapturedGraphReproducesDirectLaunch) {
  SKIP_WITHOUT_DEVICE();
  attention_case c = random_case(77);
  c.batch = 3;
  c.kv_type = element_bf16;
  c.out_type = element_f32;
  SCOPED_TRACE(c.describe());
  attention_run run;
  run.c = c;
  prepare(run);

  cudaStream_t stream = nullptr;
  SHADOWKV_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  launch(run, stream);
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream));
  const typed_array direct = read_output(run);
  expect_matches_reference(run, direct);

  const std::size_t out_bytes = run.out_layout.elements * element_bytes(c.out_type);
  SHADOWKV_CUDA_TRY(cudaMemset(run.device_out, 0xFF, out_bytes));
  SHADOWKV_CUDA_TRY(cudaMemset(run.device_partial, 0xFF, run.partial_floats * sizeof(float)));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  SHADOWKV_CUDA_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch(run, stream);
  SHADOWKV_CUDA_TRY(cudaStreamEndCapture(stream, &graph));
  SHADOWKV_CUDA_TRY(cudaGraphInstantiate(&exec, graph, 0));
  SHADOWKV_CUDA_TRY(cudaGraphLaunch(exec, stream));
  SHADOWKV_CUDA_TRY(cudaGraphLaunch(exec, stream));
  SHADOWKV_CUDA_TRY(cudaStreamSynchronize(stream));
  const typed_array replayed = read_output(run);
  EXPECT_EQ(0, std::memcmp(direct.data(), replayed.data(), direct.size_bytes()));
  SHADOWKV_CUDA_TRY(cudaGraphExecDestroy(exec));
  SHADOWKV_CUDA_TRY(cudaGraphDestroy(graph));
  SHADOWKV_CUDA_TRY(cudaStreamDestroy(stream));
}

// Argument checks run on the host before anything is launched (no device needed).
TEST(SparseAttention, RejectsUnsupportedArguments) {
  int dummy = 0;
  const auto* views = reinterpret_cast<const layer_view*>(&dummy);
  float partial = 0.0F;
  const strided_tensor tensor{&dummy, element_f32, {1, 1, 1, 0}};
  dims d = valid_dims();
  d.head_dim = 100;
  EXPECT_THROW(shadowkv::cuda::launch_sparse_attention(d, element_bf16, views, &dummy, 0, 1, tensor, tensor, &partial,
                                                       1, nullptr),
               shadowkv::invalid_argument);
  d = valid_dims();
  EXPECT_THROW(shadowkv::cuda::launch_sparse_attention(d, 7, views, &dummy, 0, 1, tensor, tensor, &partial, 1, nullptr),
               shadowkv::invalid_argument);
  EXPECT_THROW(shadowkv::cuda::launch_sparse_attention(d, element_f16, views, &dummy, d.num_layers, 1, tensor, tensor,
                                                       &partial, 1, nullptr),
               shadowkv::invalid_argument);
  d.q_heads += 1;  // not kv_heads * group
  EXPECT_THROW(shadowkv::cuda::launch_sparse_attention(d, element_f16, views, &dummy, 0, 1, tensor, tensor, &partial,
                                                       1, nullptr),
               shadowkv::invalid_argument);
  d = valid_dims();
  d.cache_slots = d.budget - 1;  // fewer slots than the budget
  EXPECT_THROW(shadowkv::cuda::launch_sparse_attention(d, element_f16, views, &dummy, 0, 1, tensor, tensor, &partial,
                                                       1, nullptr),
               shadowkv::invalid_argument);
  d = valid_dims();
  EXPECT_THROW(shadowkv::cuda::launch_sparse_attention(d, element_f16, views, &dummy, 0, 1, tensor, tensor, &partial,
                                                       0, nullptr),
               shadowkv::invalid_argument);
  // An empty batch launches nothing.
  EXPECT_NO_THROW(shadowkv::cuda::launch_sparse_attention(d, element_f16, views, &dummy, 0, 0, tensor, tensor,
                                                          &partial, 1, nullptr));
}

TEST(SparseAttention, MaxSplitsIsPositiveAndBounded) {
  dims d = valid_dims();
  d.budget = 0;
  d.max_outliers = 0;
  d.window = 0;
  d.local_capacity = 0;
  EXPECT_EQ(shadowkv::cuda::sparse_attention_max_splits(d), 1);
  d = valid_dims();
  d.chunk = 8;
  d.budget = 256;
  d.max_outliers = 48;
  d.local_capacity = 39;
  d.window = 1024;
  const int splits = shadowkv::cuda::sparse_attention_max_splits(d);
  EXPECT_GE(splits, 16);
  EXPECT_LE(splits, 1024);
}

}  // namespace
