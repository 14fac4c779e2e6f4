// Micro-benchmark (f): one layer's whole decode step through the public C++ API — shadowkv::kv_store with the CUDA
// backend: append, selection, key rebuild and value fetch on two streams, sparse attention — for B sequences.
//
// Set-up (untimed): a store for the shape (max_seq_len = S + kExtraTokens), every sequence prefilled with keys like
// bench/step_benchmark.py's (low rank + noise, post-RoPE) and random values, then two warm-up steps. The temporal hit
// rate is steered as step_benchmark.py does: consecutive queries q_t = a·q_{t-1} + sqrt(1 - a²)·noise, `a` found by
// bisection on the measured hit rate; the hit rate of the timed steps is measured and reported.
//
// Each iteration: the next query is uploaded on the stream (before the start event), then one decode call on the
// caller's stream between two events. Iterations are synchronised, so the time includes the host's launch latency
// of the call (step_benchmark.py's back-to-back loop hides it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "shadowkv/config.hpp"
#include "shadowkv/dtype.hpp"
#include "shadowkv/store.hpp"
#include "shadowkv/tensor_view.hpp"

namespace shadowkv::bench {
namespace {

constexpr int kExtraTokens = 2048;     // decode capacity beyond the prompt
constexpr int kTimedSteps = 50;        // fixed, so the tokens a run appends are known
constexpr int kCalibrationRounds = 6;  // bisection rounds, 3 steps each
constexpr int kWarmupSteps = 2;

const device kDevice{device_type::cuda, 0};

class store_state {
 public:
  explicit store_state(const shape& s);
  ~store_state() {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
  store_state(const store_state&) = delete;
  store_state& operator=(const store_state&) = delete;

  [[nodiscard]] const shape& which() const { return shape_; }
  [[nodiscard]] cudaStream_t stream() const { return stream_; }
  [[nodiscard]] kv_store& store() { return *store_; }
  /// Decode steps still possible before a sequence is full.
  [[nodiscard]] int steps_left() const { return kExtraTokens - steps_; }

  /// Moves the query chain one step with correlation `a` and uploads it on the stream.
  void next_query(double a);
  /// One decode call on the stream (asynchronous).
  void decode();
  /// The query correlation that gives about `target` temporal hit rate (bisection, cached).
  double correlation_for(double target);
  /// Runs `steps` synchronised steps at correlation `a`; returns their measured hit rate.
  double run_steps(double a, int steps);

 private:
  shape shape_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kv_store> store_;
  std::vector<int> slots_;
  device_memory q_, k_new_, v_new_, out_;
  pinned_memory q_staging_;
  std::vector<float> q_state_;
  std::mt19937_64 rng_{20261130};
  std::normal_distribution<float> normal_{0.0F, 1.0F};
  std::vector<std::pair<double, double>> correlations_;  // (target hit, a)
  int steps_ = 0;
};

store_state::store_state(const shape& s) : shape_(s) {
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  config cfg;
  cfg.num_layers = 1;
  cfg.num_q_heads = shape::q_heads;
  cfg.num_kv_heads = shape::kv_heads;
  cfg.head_dim = shape::head_dim;
  cfg.max_batch = s.batch;
  cfg.max_seq_len = static_cast<std::int64_t>(s.seq_len) + kExtraTokens;
  cfg.rope_theta = shape::rope_theta;
  cfg.rank = shape::rank;
  cfg.chunk_size = shape::chunk;
  cfg.budget = s.budget_tokens;
  cfg.outlier_chunks = shape::outliers;
  cfg.local_chunks = shape::local_chunks;
  cfg.generation_window = shape::generation_window;
  cfg.kv_dtype = dtype::bfloat16;
  cfg.value_store = value_store_policy::host;
  store_ = std::make_unique<kv_store>(cfg, kDevice);
  slots_ = store_->add_sequences(s.batch);

  // Prefill one sequence at a time (bounds the input buffers to one sequence).
  const int width = shape::kv_heads * shape::head_dim;
  const std::size_t elements = static_cast<std::size_t>(s.seq_len) * width;
  device_memory keys(elements * shape::element_bytes);
  device_memory values(elements * shape::element_bytes);
  device_memory scratch((static_cast<std::size_t>(s.seq_len) + width) * 32 * sizeof(float));
  const tensor_view key_view =
      make_contiguous_view(keys.get(), dtype::bfloat16, kDevice, {1, s.seq_len, shape::kv_heads, shape::head_dim});
  const tensor_view value_view =
      make_contiguous_view(values.get(), dtype::bfloat16, kDevice, {1, s.seq_len, shape::kv_heads, shape::head_dim});
  prefill_options options;
  options.keys_post_rope = true;
  for (int b = 0; b < s.batch; ++b) {
    fill_low_rank_bf16(keys.get(), s.seq_len, width, 1000 + 2 * static_cast<std::uint64_t>(b), scratch.get<float>(),
                       stream_);
    fill_uniform_bf16(values.get(), elements, 1.7320508F, 1001 + 2 * static_cast<std::uint64_t>(b), stream_);
    check(cudaStreamSynchronize(stream_), "prefill inputs");
    const int slot = slots_[static_cast<std::size_t>(b)];
    store_->prefill(0, std::span<const int>(&slot, 1), key_view, value_view, options);  // completes before return
  }

  const std::size_t q_elements = static_cast<std::size_t>(s.batch) * shape::q_heads * shape::head_dim;
  const std::size_t kv_elements = static_cast<std::size_t>(s.batch) * width;
  q_ = device_memory(q_elements * shape::element_bytes);
  out_ = device_memory(q_elements * shape::element_bytes);
  k_new_ = device_memory(kv_elements * shape::element_bytes);
  v_new_ = device_memory(kv_elements * shape::element_bytes);
  q_staging_ = pinned_memory(q_elements * shape::element_bytes);
  fill_uniform_bf16(k_new_.get(), kv_elements, 1.7320508F, 7, stream_);
  fill_uniform_bf16(v_new_.get(), kv_elements, 1.7320508F, 8, stream_);
  q_state_.resize(q_elements);
  for (float& x : q_state_) x = normal_(rng_);
  check(cudaStreamSynchronize(stream_), "decode inputs");
  (void)run_steps(0.0, kWarmupSteps);
}

void store_state::next_query(double a) {
  const float keep = static_cast<float>(a);
  const float fresh = static_cast<float>(std::sqrt(std::max(0.0, 1.0 - a * a)));
  auto* staged = q_staging_.get<std::uint16_t>();
  for (std::size_t i = 0; i < q_state_.size(); ++i) {
    q_state_[i] = keep * q_state_[i] + fresh * normal_(rng_);
    staged[i] = float_to_bfloat16(2.0F * q_state_[i]);
  }
  check(cudaMemcpyAsync(q_.get(), q_staging_.get(), q_.size(), cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync(query)");
}

void store_state::decode() {
  const auto B = static_cast<std::int64_t>(shape_.batch);
  const tensor_view q = make_contiguous_view(q_.get(), dtype::bfloat16, kDevice, {B, shape::q_heads, shape::head_dim});
  const tensor_view k_new =
      make_contiguous_view(k_new_.get(), dtype::bfloat16, kDevice, {B, shape::kv_heads, shape::head_dim});
  const tensor_view v_new =
      make_contiguous_view(v_new_.get(), dtype::bfloat16, kDevice, {B, shape::kv_heads, shape::head_dim});
  const mutable_tensor_view out =
      make_contiguous_output_view(out_.get(), dtype::bfloat16, kDevice, {B, shape::q_heads, shape::head_dim});
  decode_options options;
  options.stream = shadowkv::stream_view(stream_);
  store_->decode(0, slots_, q, k_new, v_new, out, options);
  ++steps_;
}

double store_state::run_steps(double a, int steps) {
  store_->reset_stats();
  for (int i = 0; i < steps; ++i) {
    next_query(a);
    decode();
    check(cudaStreamSynchronize(stream_), "decode step");
  }
  return store_->stats().hit_rate();
}

double store_state::correlation_for(double target) {
  for (const auto& [hit, a] : correlations_) {
    if (hit == target) return a;
  }
  double a = 0.0;
  if (target > 0) {
    double lo = 0.0;
    double hi = 1.0;
    for (int round = 0; round < kCalibrationRounds; ++round) {
      a = 0.5 * (lo + hi);
      if (run_steps(a, 3) < target) {
        lo = a;
      } else {
        hi = a;
      }
    }
  }
  correlations_.emplace_back(target, a);
  return a;
}

std::unique_ptr<store_state>& current_state() {
  static std::unique_ptr<store_state> state;
  return state;
}

/// The store of shape `s`, rebuilt when a run of the benchmark could fill its sequences.
store_state& state_for(const shape& s) {
  constexpr int kStepsPerCall = kCalibrationRounds * 3 + kWarmupSteps + kTimedSteps;
  std::unique_ptr<store_state>& state = current_state();
  if (!state || !(state->which() == s) || state->steps_left() < 2 * kStepsPerCall) {
    state.reset();
    release_kernel_state();
    state = std::make_unique<store_state>(s);
  }
  return *state;
}

void run_step(benchmark::State& bench, const shape& s, double hit) {
  try {
    store_state& st = state_for(s);
    const ceilings& limits = measured_ceilings();
    const double a = st.correlation_for(hit);
    (void)st.run_steps(a, kWarmupSteps);  // the chain settles at `a`
    st.store().reset_stats();
    event_timer timer;
    double total = 0;
    for (auto _ : bench) {
      st.next_query(a);  // on the stream before the start event: not timed
      timer.start(st.stream());
      st.decode();
      const double seconds = timer.stop(st.stream());
      bench.SetIterationTime(seconds);
      total += seconds;
    }
    const store_stats stats = st.store().stats();
    const double steps = static_cast<double>(bench.iterations());
    op_report r;
    r.seconds_total = total;
    r.hit = stats.hit_rate();
    r.misses = static_cast<double>(stats.misses) / steps;
    // Bytes a step must move: landmarks once (HBM) and the missed values (PCIe).
    const double missed_bytes = static_cast<double>(stats.bytes_fetched) / steps;
    r.bytes_per_iteration = s.landmark_bytes() + missed_bytes;
    r.floor_seconds = s.landmark_bytes() / limits.hbm_copy + missed_bytes / limits.pcie_h2d;
    report(bench, r);
    bench.counters["target_hit"] = hit;
    bench.counters["query_correlation"] = a;
  } catch (const std::exception& error) {
    bench.SkipWithError(error.what());
  }
}

}  // namespace

void release_store_state() { current_state().reset(); }

void register_store_benchmarks(const shape& s) {
  for (const double hit : design_hit_rates()) {
    const std::string name = "decode_step/" + s.label() + "/" + hit_label(hit);
    benchmark::RegisterBenchmark(name.c_str(), [s, hit](benchmark::State& bench) { run_step(bench, s, hit); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond)
        ->Iterations(kTimedSteps);
  }
}

}  // namespace shadowkv::bench
