// Shared pieces of the decode micro-benchmarks (bench/README.md "Micro-benchmarks"): the docs/performance.md shapes,
// event timing, RAII buffers, random fills on the device, the bandwidth ceilings measured in the same run, and the
// counters every benchmark reports next to its time.
//
// Included by CUDA (C++17, nvcc) and C++20 (g++) translation units alike: plain declarations only.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shadowkv::bench {

/// Throws std::runtime_error naming `what` and the CUDA error when `status` is not cudaSuccess.
void check(cudaError_t status, const char* what);

/// One docs/performance.md case: Llama-3-8B attention (Hq 32, Hkv 8, D 128, rank 160, C 8, 48 outliers, 4 local chunks,
/// bf16), B sequences of S prompt tokens, a budget of `budget_tokens` per KV head.
struct shape {
  static constexpr int q_heads = 32;
  static constexpr int kv_heads = 8;
  static constexpr int head_dim = 128;
  static constexpr int rank = 160;
  static constexpr int chunk = 8;
  static constexpr int outliers = 48;
  static constexpr int local_chunks = 4;
  static constexpr int generation_window = 256;
  static constexpr double rope_theta = 500000.0;
  static constexpr std::size_t element_bytes = 2;  // bf16

  int batch = 1;
  int seq_len = 0;
  int budget_tokens = 0;

  [[nodiscard]] int budget_chunks() const { return budget_tokens / chunk; }
  [[nodiscard]] int prompt_chunks() const { return seq_len / chunk; }
  /// Context chunks after the prefill: floor(S/C) - local chunks (docs/semantics.md prefill 1).
  [[nodiscard]] int context_chunks() const { return prompt_chunks() - local_chunks; }
  [[nodiscard]] int local_len() const { return seq_len - context_chunks() * chunk; }
  /// Bytes of one (chunk, KV head) value run: C*D elements.
  [[nodiscard]] static std::size_t run_bytes() { return static_cast<std::size_t>(chunk) * head_dim * element_bytes; }
  /// Landmark bytes the selection reads: B * context chunks * Hkv * D * 2.
  [[nodiscard]] double landmark_bytes() const {
    return static_cast<double>(batch) * context_chunks() * kv_heads * head_dim * element_bytes;
  }
  /// "B:24/S:122880/budget:2048" (Google Benchmark's arg:value style; bench/gpu_check.sh parses it).
  [[nodiscard]] std::string label() const;
  friend bool operator==(const shape& a, const shape& b) {
    return a.batch == b.batch && a.seq_len == b.seq_len && a.budget_tokens == b.budget_tokens;
  }
};

/// B=1 and B=24 at S=122880, budget 2048; B=48 at S=61440, budget 1024.
std::vector<shape> design_shapes();
/// Target temporal hit rates: 0 and 0.6.
std::vector<double> design_hit_rates();
/// "hit:60" for 0.6.
std::string hit_label(double hit);

/// Bandwidths measured once at start-up on this device (bench/micro/ceilings.cu), in bytes per second.
struct ceilings {
  double hbm_copy = 0;  ///< device-to-device cudaMemcpyAsync, read + write bytes counted (as step_benchmark.py)
  double pcie_h2d = 0;  ///< one large cudaMemcpyAsync from pinned host memory
};
/// Measures on the first call (a few copies of 512 MiB), then returns the same values.
const ceilings& measured_ceilings();

/// Registers the ceiling benchmarks (HBM copy, pinned host->device copy).
void register_ceiling_benchmarks();
/// Registers (a)–(e) for one shape: selection, key rebuild, value fetch (zero-copy kernel, one batched copy, one
/// copy per run), sparse attention (bench/micro/kernel_ops.cu).
void register_kernel_benchmarks(const shape& s);
/// Registers (f): one layer's kv_store::decode through the public API with the CUDA backend (store_step.cpp).
void register_store_benchmarks(const shape& s);
/// Frees the per-shape state of the kernel benchmarks / the store benchmark (only one lives at a time, to bound
/// pinned and device memory).
void release_kernel_state();
void release_store_state();

/// Device time of work on one stream between two events; `stop` waits for it.
class event_timer {
 public:
  event_timer();
  ~event_timer();
  event_timer(const event_timer&) = delete;
  event_timer& operator=(const event_timer&) = delete;
  void start(cudaStream_t stream);
  /// Records the end on `stream`, waits for it and returns the elapsed seconds.
  double stop(cudaStream_t stream);

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

/// cudaMalloc'ed memory (benchmark set-up only).
class device_memory {
 public:
  device_memory() = default;
  explicit device_memory(std::size_t bytes);
  ~device_memory();
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  device_memory(device_memory&& other) noexcept;
  device_memory& operator=(device_memory&& other) noexcept;
  template <typename T = void>
  [[nodiscard]] T* get() const {
    return static_cast<T*>(data_);
  }
  [[nodiscard]] std::size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Pinned, device-mapped host memory (cudaHostAlloc with cudaHostAllocMapped, as the backend's value store).
class pinned_memory {
 public:
  pinned_memory() = default;
  explicit pinned_memory(std::size_t bytes);
  ~pinned_memory();
  pinned_memory(const pinned_memory&) = delete;
  pinned_memory& operator=(const pinned_memory&) = delete;
  pinned_memory(pinned_memory&& other) noexcept;
  pinned_memory& operator=(pinned_memory&& other) noexcept;
  template <typename T = void>
  [[nodiscard]] T* get() const {
    return static_cast<T*>(data_);
  }
  /// The address kernels use (cudaHostGetDevicePointer).
  [[nodiscard]] void* device_pointer() const { return device_pointer_; }
  [[nodiscard]] std::size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  void* device_pointer_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Uniform values in [-scale, scale) from a counter-based hash of (seed, index), written as bf16 / float.
void fill_uniform_bf16(void* data, std::size_t count, float scale, std::uint64_t seed, cudaStream_t stream);
void fill_uniform_f32(float* data, std::size_t count, float scale, std::uint64_t seed, cudaStream_t stream);
/// data[i] = i.
void fill_iota_i64(long long* data, std::size_t count, cudaStream_t stream);
/// Keys like bench/step_benchmark.py's: bf16 [rows, cols] = U[rows, 32] · W[32, cols] + 0.3 · noise, with U, W and
/// the noise uniform of unit variance. `scratch` holds (rows + cols) * 32 floats.
void fill_low_rank_bf16(void* data, int rows, int cols, std::uint64_t seed, float* scratch, cudaStream_t stream);

/// What one benchmark reports next to its time (Google Benchmark counters; times in microseconds).
struct op_report {
  double seconds_total = 0;     ///< sum of the timed iterations
  double bytes_per_iteration = 0;
  double floor_seconds = 0;     ///< byte floor: bytes over the relevant measured ceiling
  double ceiling = 0;           ///< that ceiling, bytes per second
  double hit = -1;              ///< measured temporal hit rate (< 0: not applicable)
  double misses = -1;           ///< missed (chunk, head) runs per step, whole batch (< 0: not applicable)
};
/// Sets bytes processed and the counters floor_us, x_floor, GBps, ceiling_GBps, of_ceiling, hit, misses.
void report(benchmark::State& state, const op_report& r);

}  // namespace shadowkv::bench
