// Whether a select launch in clusters fits on the device at once. plan_select_cluster (selection_plan.cuh) takes
// clusters of 8 when rows x 8 <= multiprocessors (B = 2 at Hkv 8: 16 clusters, 128 CTAs), but a cluster must sit in
// one GPC, so how many clusters of 8 run at once depends on the GPCs' sizes, and a kernel beside the select (the
// append's one CTA) may take the SM one of them needs. At B = 2 the select took 31.8 us where B = 1's took 19.3
// (bench/NOTES.md, session 27) for the same work a CTA.
// Part 1: cudaOccupancyMaxActiveClusters for a kernel shaped like select_cluster_kernel (1024 threads, one CTA an
// SM) at cluster sizes 1-8 (and 16, non-portable) and three dynamic shared-memory sizes.
// Part 2: waves. `rows` clusters of `cluster` CTAs that each spin 20 us, event-timed; a CTA that starts more than
// 10 us after the first is counted late (a second wave). With and without a one-CTA kernel spinning 5 us on another
// stream, launched just before (as the append runs beside the select).
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/cop bench/probes/cluster_occupancy_probe.cu && /tmp/cop
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "probe_check.cuh"

namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// One CTA an SM, like select_cluster_kernel (__launch_bounds__(1024, 1) and most of the SM's shared memory).
__global__ void __launch_bounds__(kThreads, 1) spin_kernel(unsigned long long spin_ns, unsigned long long* starts) {
  extern __shared__ unsigned char shared[];
  const unsigned long long start = global_ns();
  if (threadIdx.x == 0) {
    shared[0] = 1;
    starts[blockIdx.x + static_cast<unsigned long long>(blockIdx.y) * gridDim.x] = start;
  }
  while (global_ns() - start < spin_ns) {
  }
}

__global__ void beside_kernel(unsigned long long spin_ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < spin_ns) {
  }
}

cudaLaunchConfig_t cluster_config(int rows, int cluster, int shared_bytes, cudaStream_t stream,
                                  cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(rows * cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<std::size_t>(shared_bytes);
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

}  // namespace

int main() {
  int multiprocessors = 0;
  int optin = 0;
  CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  cudaDeviceProp properties{};
  CHECK(cudaGetDeviceProperties(&properties, 0));
  std::printf("%s: %d SMs, %d bytes of shared memory a block (opt-in)\n", properties.name, multiprocessors, optin);
  CHECK(cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  CHECK(cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));

  std::printf("\npart 1: cudaOccupancyMaxActiveClusters, 1024 threads a CTA\n| dynamic shared bytes |");
  const int clusters[] = {1, 2, 4, 8, 16};
  for (int c : clusters) std::printf(" cluster %d |", c);
  std::printf("\n| --- |");
  for (int c : clusters) std::printf(" --- |"), (void)c;
  std::printf("\n");
  const int shared_sizes[] = {16 * 1024, 100 * 1024, optin - 16 * 1024};
  for (int shared_bytes : shared_sizes) {
    std::printf("| %d |", shared_bytes);
    for (int c : clusters) {
      cudaLaunchAttribute attribute{};
      cudaLaunchConfig_t config = cluster_config(c, c, shared_bytes, nullptr, &attribute);
      int active = 0;
      const cudaError_t status = cudaOccupancyMaxActiveClusters(&active, spin_kernel, &config);
      if (status != cudaSuccess) {
        std::printf(" %s |", cudaGetErrorString(status));
        (void)cudaGetLastError();
      } else {
        std::printf(" %d |", active);
      }
    }
    std::printf("\n");
  }

  std::printf("\npart 2: rows clusters spinning 20 us each (shared %d bytes), event-timed\n", optin - 16 * 1024);
  std::printf("| cluster | rows | CTAs | beside | us | late CTAs |\n| --- | --- | --- | --- | --- | --- |\n");
  constexpr unsigned long long kSpin = 20000;
  unsigned long long* starts = nullptr;
  CHECK(cudaMalloc(&starts, sizeof(unsigned long long) * 1024));
  cudaStream_t stream, side;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t begin, end, side_start;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  CHECK(cudaEventCreate(&side_start));
  struct shape {
    int cluster, rows;
  };
  const shape shapes[] = {{8, 8}, {8, 15}, {8, 16}, {8, 17}, {4, 16}, {4, 32}, {4, 33}, {2, 32}, {2, 64}, {2, 66},
                          {1, 128}, {1, 132}};
  for (const shape& s : shapes) {
    for (int beside = 0; beside < 2; ++beside) {
      std::vector<double> times;
      int late = 0;
      for (int repeat = 0; repeat < 5; ++repeat) {
        cudaLaunchAttribute attribute{};
        cudaLaunchConfig_t config = cluster_config(s.rows, s.cluster, optin - 16 * 1024, stream, &attribute);
        CHECK(cudaDeviceSynchronize());
        if (beside) {
          CHECK(cudaEventRecord(side_start, stream));
          CHECK(cudaStreamWaitEvent(side, side_start, 0));
          beside_kernel<<<1, 128, 0, side>>>(5000);
          CHECK(cudaGetLastError());
        }
        CHECK(cudaEventRecord(begin, stream));
        CHECK(cudaLaunchKernelEx(&config, spin_kernel, kSpin, starts));
        CHECK(cudaEventRecord(end, stream));
        CHECK(cudaDeviceSynchronize());
        float ms = 0.0F;
        CHECK(cudaEventElapsedTime(&ms, begin, end));
        times.push_back(ms * 1e3);
        std::vector<unsigned long long> host(static_cast<std::size_t>(s.rows * s.cluster));
        CHECK(cudaMemcpy(host.data(), starts, host.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        const unsigned long long first = *std::min_element(host.begin(), host.end());
        int late_now = 0;
        for (unsigned long long t : host) late_now += t - first > kSpin / 2 ? 1 : 0;
        late = std::max(late, late_now);
      }
      std::sort(times.begin(), times.end());
      std::printf("| %d | %d | %d | %s | %.1f | %d |\n", s.cluster, s.rows, s.rows * s.cluster,
                  beside ? "1 CTA, 5 us" : "none", times[times.size() / 2], late);
    }
  }
  CHECK(cudaFree(starts));
  return 0;
}
