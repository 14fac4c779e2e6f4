// Shared pieces of the decode micro-benchmarks: see bench_common.hpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "bench_common.hpp"

namespace shadowkv::bench {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
  }
}

std::string shape::label() const {
  return "B:" + std::to_string(batch) + "/S:" + std::to_string(seq_len) + "/budget:" + std::to_string(budget_tokens);
}

std::vector<shape> design_shapes() { return {{1, 122880, 2048}, {24, 122880, 2048}, {48, 61440, 1024}}; }

std::vector<double> design_hit_rates() { return {0.0, 0.6}; }

std::string hit_label(double hit) { return "hit:" + std::to_string(static_cast<int>(std::lround(hit * 100))); }

// --- timing and memory ----------------------------------------------------------------------------------------------

event_timer::event_timer() {
  check(cudaEventCreate(&start_), "cudaEventCreate");
  check(cudaEventCreate(&stop_), "cudaEventCreate");
}

event_timer::~event_timer() {
  (void)cudaEventDestroy(start_);
  (void)cudaEventDestroy(stop_);
}

void event_timer::start(cudaStream_t stream) { check(cudaEventRecord(start_, stream), "cudaEventRecord(start)"); }

double event_timer::stop(cudaStream_t stream) {
  check(cudaEventRecord(stop_, stream), "cudaEventRecord(stop)");
  check(cudaEventSynchronize(stop_), "cudaEventSynchronize");
  float milliseconds = 0;
  check(cudaEventElapsedTime(&milliseconds, start_, stop_), "cudaEventElapsedTime");
  return static_cast<double>(milliseconds) * 1e-3;
}

namespace {

std::string gigabytes(std::size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GB", static_cast<double>(bytes) * 1e-9);
  return text;
}

}  // namespace

device_memory::device_memory(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t status = cudaMalloc(&data_, bytes);
  if (status != cudaSuccess) {
    data_ = nullptr;
    (void)cudaGetLastError();
    std::size_t free_bytes = 0;
    std::size_t total = 0;
    (void)cudaMemGetInfo(&free_bytes, &total);
    throw std::runtime_error("cudaMalloc of " + gigabytes(bytes) + " failed (" + cudaGetErrorString(status) + "; " +
                             gigabytes(free_bytes) + " free of " + gigabytes(total) + ")");
  }
}

device_memory::~device_memory() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

device_memory::device_memory(device_memory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

device_memory& device_memory::operator=(device_memory&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

pinned_memory::pinned_memory(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t status = cudaHostAlloc(&data_, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (status != cudaSuccess) {
    data_ = nullptr;
    (void)cudaGetLastError();
    throw std::runtime_error("cudaHostAlloc of " + gigabytes(bytes) + " pinned, mapped host memory failed (" +
                             cudaGetErrorString(status) + ")");
  }
  const cudaError_t mapped = cudaHostGetDevicePointer(&device_pointer_, data_, 0);
  if (mapped != cudaSuccess) {
    (void)cudaFreeHost(data_);
    data_ = nullptr;
    check(mapped, "cudaHostGetDevicePointer");
  }
}

pinned_memory::~pinned_memory() {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
}

pinned_memory::pinned_memory(pinned_memory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      device_pointer_(std::exchange(other.device_pointer_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

pinned_memory& pinned_memory::operator=(pinned_memory&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(device_pointer_, other.device_pointer_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

// --- random fills -----------------------------------------------------------------------------------------------------

namespace {

constexpr int kFillThreads = 256;
constexpr int kFillBlocks = 4096;

__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/// Uniform in [-1, 1) from (seed, index).
__device__ __forceinline__ float uniform(unsigned long long seed, unsigned long long index) {
  const unsigned long long bits = mix64(mix64(seed) ^ index);
  return static_cast<float>(bits >> 40) * (2.0F / 16777216.0F) - 1.0F;
}

__global__ void fill_bf16_kernel(__nv_bfloat16* data, std::size_t count, float scale, unsigned long long seed) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) {
    data[i] = __float2bfloat16_rn(scale * uniform(seed, i));
  }
}

__global__ void fill_f32_kernel(float* data, std::size_t count, float scale, unsigned long long seed) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) {
    data[i] = scale * uniform(seed, i);
  }
}

__global__ void iota_kernel(long long* data, std::size_t count) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) {
    data[i] = static_cast<long long>(i);
  }
}

constexpr int kLowRank = 32;

// out[t, j] = sum_i u[t, i] * w[i, j] + 0.3 * noise; consecutive threads take consecutive j (u row broadcast).
__global__ void low_rank_kernel(__nv_bfloat16* out, int rows, int cols, const float* u, const float* w,
                                unsigned long long seed) {
  const std::size_t count = static_cast<std::size_t>(rows) * cols;
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) {
    const std::size_t t = i / static_cast<std::size_t>(cols);
    const int j = static_cast<int>(i % static_cast<std::size_t>(cols));
    float sum = 0.0F;
#pragma unroll
    for (int r = 0; r < kLowRank; ++r) sum += u[t * kLowRank + r] * w[static_cast<std::size_t>(r) * cols + j];
    out[i] = __float2bfloat16_rn(sum + 0.3F * 1.7320508F * uniform(seed, i));
  }
}

int blocks_for(std::size_t count) {
  return static_cast<int>(std::min<std::size_t>(kFillBlocks, (count + kFillThreads - 1) / kFillThreads));
}

}  // namespace

void fill_uniform_bf16(void* data, std::size_t count, float scale, std::uint64_t seed, cudaStream_t stream) {
  if (count == 0) return;
  fill_bf16_kernel<<<blocks_for(count), kFillThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(data), count, scale,
                                                                    seed);
  check(cudaGetLastError(), "fill_bf16_kernel launch");
}

void fill_uniform_f32(float* data, std::size_t count, float scale, std::uint64_t seed, cudaStream_t stream) {
  if (count == 0) return;
  fill_f32_kernel<<<blocks_for(count), kFillThreads, 0, stream>>>(data, count, scale, seed);
  check(cudaGetLastError(), "fill_f32_kernel launch");
}

void fill_iota_i64(long long* data, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  iota_kernel<<<blocks_for(count), kFillThreads, 0, stream>>>(data, count);
  check(cudaGetLastError(), "iota_kernel launch");
}

void fill_low_rank_bf16(void* data, int rows, int cols, std::uint64_t seed, float* scratch, cudaStream_t stream) {
  const std::size_t u_count = static_cast<std::size_t>(rows) * kLowRank;
  const std::size_t w_count = static_cast<std::size_t>(kLowRank) * cols;
  const float unit = 1.7320508F;  // uniform [-1, 1) has variance 1/3
  fill_uniform_f32(scratch, u_count, unit, seed * 3 + 1, stream);
  fill_uniform_f32(scratch + u_count, w_count, unit, seed * 3 + 2, stream);
  const std::size_t count = static_cast<std::size_t>(rows) * cols;
  low_rank_kernel<<<blocks_for(count), kFillThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(data), rows, cols,
                                                                   scratch, scratch + u_count, seed * 3 + 3);
  check(cudaGetLastError(), "low_rank_kernel launch");
}

// --- counters ---------------------------------------------------------------------------------------------------------

void report(benchmark::State& state, const op_report& r) {
  const auto iterations = static_cast<double>(state.iterations());
  if (iterations <= 0 || r.seconds_total <= 0) return;
  const double mean = r.seconds_total / iterations;
  state.SetBytesProcessed(static_cast<std::int64_t>(r.bytes_per_iteration * iterations));
  state.counters["floor_us"] = r.floor_seconds * 1e6;
  if (r.floor_seconds > 0) state.counters["x_floor"] = mean / r.floor_seconds;
  state.counters["GBps"] = r.bytes_per_iteration / mean * 1e-9;
  if (r.ceiling > 0) {
    state.counters["ceiling_GBps"] = r.ceiling * 1e-9;
    state.counters["of_ceiling"] = r.bytes_per_iteration / mean / r.ceiling;
  }
  if (r.hit >= 0) state.counters["hit"] = r.hit;
  if (r.misses >= 0) state.counters["misses"] = r.misses;
}

// --- ceilings ---------------------------------------------------------------------------------------------------------

namespace {

constexpr std::size_t kCeilingBytes = std::size_t{512} << 20;

/// Buffers of the ceiling measurements, kept for the whole run (1 GiB device, 0.5 GiB pinned).
struct ceiling_buffers {
  device_memory source{kCeilingBytes};
  device_memory target{kCeilingBytes};
  pinned_memory host{kCeilingBytes};
  cudaStream_t stream = nullptr;
  ceiling_buffers() {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaMemsetAsync(source.get(), 1, kCeilingBytes, stream), "cudaMemsetAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  ~ceiling_buffers() { (void)cudaStreamDestroy(stream); }
  ceiling_buffers(const ceiling_buffers&) = delete;
  ceiling_buffers& operator=(const ceiling_buffers&) = delete;
};

ceiling_buffers& buffers() {
  static ceiling_buffers instance;
  return instance;
}

/// Seconds of one copy: device->device (hbm) or pinned host->device.
double time_copy(bool hbm, event_timer& timer) {
  ceiling_buffers& b = buffers();
  timer.start(b.stream);
  if (hbm) {
    check(cudaMemcpyAsync(b.target.get(), b.source.get(), kCeilingBytes, cudaMemcpyDeviceToDevice, b.stream),
          "cudaMemcpyAsync(device to device)");
  } else {
    check(cudaMemcpyAsync(b.target.get(), b.host.get(), kCeilingBytes, cudaMemcpyHostToDevice, b.stream),
          "cudaMemcpyAsync(host to device)");
  }
  return timer.stop(b.stream);
}

double copy_bytes(bool hbm) { return hbm ? 2.0 * kCeilingBytes : static_cast<double>(kCeilingBytes); }

/// Best of a few copies after one warm-up.
double measure(bool hbm) {
  event_timer timer;
  (void)time_copy(hbm, timer);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) best = std::min(best, time_copy(hbm, timer));
  return copy_bytes(hbm) / best;
}

void run_ceiling(benchmark::State& state, bool hbm) {
  try {
    event_timer timer;
    (void)time_copy(hbm, timer);
    op_report r;
    for (auto _ : state) {
      const double seconds = time_copy(hbm, timer);
      state.SetIterationTime(seconds);
      r.seconds_total += seconds;
    }
    r.bytes_per_iteration = copy_bytes(hbm);
    r.ceiling = hbm ? measured_ceilings().hbm_copy : measured_ceilings().pcie_h2d;
    r.floor_seconds = r.bytes_per_iteration / r.ceiling;
    report(state, r);
  } catch (const std::exception& error) {
    state.SkipWithError(error.what());
  }
}

}  // namespace

const ceilings& measured_ceilings() {
  static const ceilings values = [] {
    ceilings c;
    c.hbm_copy = measure(true);
    c.pcie_h2d = measure(false);
    return c;
  }();
  return values;
}

void register_ceiling_benchmarks() {
  benchmark::RegisterBenchmark("ceiling_hbm_copy", [](benchmark::State& state) { run_ceiling(state, true); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->MinTime(0.05);
  benchmark::RegisterBenchmark("ceiling_pcie_h2d", [](benchmark::State& state) { run_ceiling(state, false); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->MinTime(0.05);
}

}  // namespace shadowkv::bench
