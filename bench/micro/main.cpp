// decode_ops_bench: Google Benchmark micro-benchmarks of the CUDA backend's decode operations (bench/README.md).
//
//   build/<dir>/bench/decode_ops_bench [--benchmark_filter=REGEX] [--benchmark_out=FILE.json]
//
// Exits with 77 (the conventional "skipped" status) and a message when no CUDA device is present;
// --benchmark_list_tests works without one.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <string>
#include <string_view>

#include "bench_common.hpp"

namespace {

constexpr int kNoDevice = 77;

std::string format_gb(double bytes_per_second) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", bytes_per_second * 1e-9);
  return text;
}

/// True when the command line asks only for the list of benchmarks (no device needed).
bool listing_only(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    if (arg == "--benchmark_list_tests" || arg == "--benchmark_list_tests=true" || arg == "--benchmark_list_tests=1") {
      return true;
    }
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  namespace sb = shadowkv::bench;
  const bool listing = listing_only(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // Registration touches no device; each benchmark builds its state (and measures the ceilings) when it runs.
  sb::register_ceiling_benchmarks();
  for (const sb::shape& s : sb::design_shapes()) {
    sb::register_kernel_benchmarks(s);
    sb::register_store_benchmarks(s);
  }
  if (listing) {
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  }

  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr,
                 "decode_ops_bench: no CUDA device (%s): these micro-benchmarks time GPU work and measure nothing "
                 "here; exiting with status %d (skipped)\n",
                 status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount found 0 devices",
                 kNoDevice);
    return kNoDevice;
  }

  try {
    sb::check(cudaSetDevice(0), "cudaSetDevice(0)");
    cudaDeviceProp properties{};
    sb::check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
    int driver = 0;
    int runtime = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    benchmark::AddCustomContext("gpu", properties.name);
    benchmark::AddCustomContext("gpu_memory_GB", format_gb(static_cast<double>(properties.totalGlobalMem)));
    benchmark::AddCustomContext("cuda_driver", std::to_string(driver));
    benchmark::AddCustomContext("cuda_runtime", std::to_string(runtime));
    const sb::ceilings& limits = sb::measured_ceilings();
    benchmark::AddCustomContext("hbm_copy_GBps", format_gb(limits.hbm_copy));
    benchmark::AddCustomContext("pcie_h2d_GBps", format_gb(limits.pcie_h2d));
    benchmark::RunSpecifiedBenchmarks();
    sb::release_kernel_state();
    sb::release_store_state();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "decode_ops_bench: %s\n", error.what());
    return 1;
  }
  benchmark::Shutdown();
  return 0;
}
