// The smallest useful shadowkv_core program: one layer, GQA 8/2, head_dim 64, a 512-token random prompt, a few
// decode steps. Prints the output norm, the memory report and the selection hit rate; exits non-zero when the
// output is not finite or is zero.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

#include <shadowkv/build_info.hpp>
#include <shadowkv/config.hpp>
#include <shadowkv/errors.hpp>
#include <shadowkv/store.hpp>
#include <shadowkv/tensor_view.hpp>

namespace {

std::vector<float> random_normals(std::mt19937& rng, std::size_t count) {
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

shadowkv::tensor_view view(const std::vector<float>& data, std::initializer_list<std::int64_t> shape) {
  return shadowkv::make_contiguous_view(data.data(), shadowkv::dtype::float32, shadowkv::device{}, shape);
}

int run() {
  shadowkv::config cfg;
  cfg.num_layers = 1;
  cfg.num_q_heads = 8;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.max_batch = 1;
  cfg.max_seq_len = 1024;
  cfg.rank = 64;
  cfg.chunk_size = 8;
  cfg.budget = 64;  // tokens selected per KV head per step: 8 chunks of 8
  cfg.outlier_chunks = 4;
  cfg.local_chunks = 4;
  cfg.generation_window = 32;
  cfg.kv_dtype = shadowkv::dtype::bfloat16;

  const shadowkv::build_info info = shadowkv::get_build_info();
  std::printf("shadowkv %s (blas: %s, cuda compiled: %s)\n", info.version.c_str(), info.blas.c_str(),
              info.cuda_compiled ? "yes" : "no");

  shadowkv::kv_store store(cfg);
  const std::vector<int> slots = store.add_sequences(1);

  const std::int64_t prompt = 512;
  const std::int64_t heads = cfg.num_kv_heads;
  const std::int64_t q_heads = cfg.num_q_heads;
  const std::int64_t dim = cfg.head_dim;
  std::mt19937 rng(2024);
  const std::vector<float> keys = random_normals(rng, static_cast<std::size_t>(prompt * heads * dim));
  const std::vector<float> values = random_normals(rng, static_cast<std::size_t>(prompt * heads * dim));
  // Keys are post-RoPE in both calls (what an attention function of transformers receives): prefill's keys and
  // decode's k_new carry RoPE at their positions (0..prompt-1, then prompt, prompt+1, ...). Pre-RoPE keys are taken
  // too: prefill_options::keys_post_rope = false and decode_options::keys_post_rope = false.
  shadowkv::prefill_options options;
  options.keys_post_rope = true;
  store.prefill(0, slots, view(keys, {1, prompt, heads, dim}), view(values, {1, prompt, heads, dim}), options);

  // decode writes the attention output [B, Hq, D] into the caller's memory through a mutable view.
  std::vector<float> out(static_cast<std::size_t>(q_heads * dim));
  const shadowkv::mutable_tensor_view out_view =
      shadowkv::make_contiguous_output_view(out.data(), shadowkv::dtype::float32, shadowkv::device{}, {1, q_heads, dim});
  const std::vector<float> q = random_normals(rng, out.size());
  double squared = 0.0;
  bool finite = true;
  for (int step = 0; step < 4; ++step) {
    const std::vector<float> k_new = random_normals(rng, static_cast<std::size_t>(heads * dim));
    const std::vector<float> v_new = random_normals(rng, static_cast<std::size_t>(heads * dim));
    store.decode(0, slots, view(q, {1, q_heads, dim}), view(k_new, {1, heads, dim}), view(v_new, {1, heads, dim}),
                 out_view);
    squared = 0.0;
    for (const float v : out) {
      finite = finite && std::isfinite(v);
      squared += static_cast<double>(v) * v;
    }
  }
  const double norm = std::sqrt(squared);

  const shadowkv::memory_report memory = store.memory();
  const shadowkv::store_stats stats = store.stats();
  std::printf("output norm: %.6f\n", norm);
  std::printf("memory (bytes): low_rank_factors=%lld landmarks=%lld outliers=%lld exact_tokens=%lld "
              "value_store=%lld selection_cache=%lld total=%lld full_attention_equivalent=%lld\n",
              static_cast<long long>(memory.low_rank_factors), static_cast<long long>(memory.landmarks),
              static_cast<long long>(memory.outliers), static_cast<long long>(memory.exact_tokens),
              static_cast<long long>(memory.value_store), static_cast<long long>(memory.selection_cache),
              static_cast<long long>(memory.total()), static_cast<long long>(memory.full_attention_equivalent));
  std::printf("decode steps: %lld, hit rate: %.3f\n", static_cast<long long>(stats.decode_steps), stats.hit_rate());

  if (!finite || !(norm > 0.0)) {
    std::fprintf(stderr, "FAILED: the attention output is %s\n", finite ? "zero" : "not finite");
    return 1;
  }
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "FAILED: %s\n", error.what());
    return 2;
  }
}
