// Where does the zero-copy value fetch lose against the copy engine? (Issue 8: at B = 24 / 48, hit ~0, the step is
// the fetch plus a head and a tail, and the fetch moves its bytes at ~50 GB/s where cudaMemcpy moves 55.) This probe
// gathers N runs of 2 KiB (a bf16 chunk of 8 tokens x 128 dims, the store's unit) from pinned host memory into device
// memory, the way fetch_values_kernel does, and varies one thing at a time:
//   * the source order: runs in order (sequential) or at random places of a large buffer (as the selection reads);
//   * the host buffer: cudaHostAlloc, or 2 MiB-aligned memory advised as transparent huge pages and registered;
//   * the reader: warps of 16-byte loads (ldg, 1, 2 or 4 runs in flight a warp, as the store's kernel with 1), or the
//     bulk copy engine of each SM (cp.async.bulk into shared memory, `slots` runs in flight a CTA, then stored);
//   * the grid: CTAs of the persistent grid.
// It prints GB/s (best of `reps`) per variant, next to cudaMemcpyAsync of one contiguous buffer of the same bytes.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o pcie_fetch_probe bench/probes/pcie_fetch_probe.cu
//   ./pcie_fetch_probe [host_gib=8] [runs=49152] [mode=all|ldg|tma]
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "probe_check.cuh"

constexpr int kRunBytes = 2048;
constexpr int kRunVectors = kRunBytes / 16;  // int4 a run

// Warps of 16-byte loads: warp w takes runs w * kRuns .. (+kRuns), then w + warps, ...; all of a unit's loads are
// issued before any store (kRuns * 4 int4 a lane in flight). `order[i]` is the source run of target run i.
template <int kRuns>
__global__ void __launch_bounds__(256) gather_ldg(const int4* __restrict__ host, const int* __restrict__ order,
                                                  int4* __restrict__ target, int runs) {
  const int lane = threadIdx.x % 32;
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
  for (long long unit = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       unit * kRuns < runs; unit += warps) {
    int4 loaded[kRuns][4];
    int source[kRuns];
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const long long i = unit * kRuns + r;
      source[r] = i < runs ? order[i] : -1;
    }
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (source[r] >= 0) loaded[r][u] = host[static_cast<long long>(source[r]) * kRunVectors + lane + 32 * u];
      }
    }
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (source[r] >= 0) target[(unit * kRuns + r) * kRunVectors + lane + 32 * u] = loaded[r][u];
      }
    }
  }
}

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void wait_parity(unsigned barrier, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait_%=;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

// One warp a CTA; lane 0 keeps `slots` bulk copies of 2 KiB in flight (an mbarrier a slot); the warp stores each
// landed run with 16-byte stores, then lane 0 refills the slot. CTA c takes runs c, c + grid, ...
__global__ void __launch_bounds__(32) gather_tma(const unsigned char* __restrict__ host, const int* __restrict__ order,
                                                 int4* __restrict__ target, int runs, int slots) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long barriers[64];
  const int lane = threadIdx.x;
  const int mine = runs > static_cast<int>(blockIdx.x) ? (runs - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  const auto run_of = [&](int k) { return static_cast<int>(blockIdx.x) + k * static_cast<int>(gridDim.x); };
  const auto issue = [&](int k) {
    const int slot = k % slots;
    const unsigned bar = smem_address(&barriers[slot]);
    const unsigned char* from = host + static_cast<long long>(order[run_of(k)]) * kRunBytes;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kRunBytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_address(ring + static_cast<long long>(slot) * kRunBytes)),
        "l"(from), "r"(kRunBytes), "r"(bar)
        : "memory");
  };
  if (lane == 0) {
    for (int s = 0; s < slots; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_address(&barriers[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int k = 0; k < min(slots, mine); ++k) issue(k);
  }
  __syncwarp();
  for (int k = 0; k < mine; ++k) {
    const int slot = k % slots;
    wait_parity(smem_address(&barriers[slot]), static_cast<unsigned>((k / slots) & 1));
    const int4* landed = reinterpret_cast<const int4*>(ring + static_cast<long long>(slot) * kRunBytes);
    int4* to = target + static_cast<long long>(run_of(k)) * kRunVectors;
#pragma unroll
    for (int u = 0; u < 4; ++u) to[lane + 32 * u] = landed[lane + 32 * u];
    // The generic-proxy reads of this slot come before the async proxy's next write into it.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncwarp();
    if (lane == 0 && k + slots < mine) issue(k + slots);
  }
}

struct host_buffer {
  unsigned char* data = nullptr;
  std::size_t bytes = 0;
  bool registered = false;  // else cudaHostAlloc
  void release() {
    if (data == nullptr) return;
    if (registered) {
      cudaHostUnregister(data);
      munmap(data, bytes);
    } else {
      cudaFreeHost(data);
    }
    data = nullptr;
  }
};

host_buffer allocate_pinned(std::size_t bytes) {
  host_buffer b;
  b.bytes = bytes;
  CHECK(cudaHostAlloc(&b.data, bytes, cudaHostAllocDefault));
  std::memset(b.data, 1, bytes);
  return b;
}

host_buffer allocate_huge(std::size_t bytes) {
  host_buffer b;
  b.bytes = bytes;
  b.registered = true;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::printf("mmap failed\n");
    std::exit(1);
  }
  if (madvise(p, bytes, MADV_HUGEPAGE) != 0) std::printf("madvise(MADV_HUGEPAGE) failed\n");
  std::memset(p, 1, bytes);
  b.data = static_cast<unsigned char*>(p);
  CHECK(cudaHostRegister(p, bytes, cudaHostRegisterMapped));
  return b;
}

long long anon_huge_kib() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "AnonHugePages: %lld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib;
}

template <typename Launch>
double best_gbps(Launch launch, std::size_t bytes, int reps, cudaStream_t stream) {
  cudaEvent_t start;
  cudaEvent_t stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  launch();  // warm-up
  CHECK(cudaStreamSynchronize(stream));
  float best = 1e30F;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(start, stream));
    launch();
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.0F;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, ms);
  }
  CHECK(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return static_cast<double>(bytes) / (best * 1e-3) / 1e9;
}

int main(int argc, char** argv) {
  const std::size_t host_gib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 8;
  const int runs = argc > 2 ? std::atoi(argv[2]) : 49152;  // ~B = 24 at hit 0: 24 x 8 heads x 256 chunks
  const std::string mode = argc > 3 ? argv[3] : "all";
  const int reps = 10;
  const std::size_t host_bytes = host_gib << 30;
  const long long host_runs = static_cast<long long>(host_bytes / kRunBytes);
  const std::size_t bytes = static_cast<std::size_t>(runs) * kRunBytes;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; %zu GiB host buffer; %d runs of %d B (%.1f MB)\n", prop.name,
              prop.multiProcessorCount, host_gib, runs, kRunBytes, bytes / 1e6);
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char line[256] = {0};
    if (std::fgets(line, sizeof line, f) != nullptr) std::printf("transparent_hugepage: %s", line);
    std::fclose(f);
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int4* target = nullptr;
  CHECK(cudaMalloc(&target, bytes));
  int* order = nullptr;
  CHECK(cudaMalloc(&order, runs * sizeof(int)));

  std::vector<int> sequential(runs);
  for (int i = 0; i < runs; ++i) sequential[i] = i;
  std::vector<int> scattered(runs);
  {
    std::mt19937_64 rng(7);
    std::uniform_int_distribution<long long> pick(0, host_runs - 1);
    for (int i = 0; i < runs; ++i) scattered[i] = static_cast<int>(pick(rng));
    std::sort(scattered.begin(), scattered.end());  // ascending, as the store's selections are per head
  }

  for (const bool huge : {false, true}) {
    const long long before = anon_huge_kib();
    host_buffer host = huge ? allocate_huge(host_bytes) : allocate_pinned(host_bytes);
    std::printf("\n== host buffer: %s (AnonHugePages %+lld MiB)\n",
                huge ? "mmap + MADV_HUGEPAGE + cudaHostRegister" : "cudaHostAlloc",
                (anon_huge_kib() - before) / 1024);
    unsigned char* device_view = nullptr;
    CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_view), host.data, 0));
    const double memcpy_gbps = best_gbps(
        [&] { CHECK(cudaMemcpyAsync(target, host.data, bytes, cudaMemcpyHostToDevice, stream)); }, bytes, reps, stream);
    std::printf("cudaMemcpyAsync, contiguous: %.1f GB/s\n", memcpy_gbps);
    for (const bool random : {false, true}) {
      CHECK(cudaMemcpy(order, random ? scattered.data() : sequential.data(), runs * sizeof(int),
                       cudaMemcpyHostToDevice));
      const char* order_name = random ? "scattered" : "sequential";
      if (mode == "all" || mode == "ldg") {
        for (const int ctas : {33, 66, 132, 264}) {
          const auto host4 = reinterpret_cast<const int4*>(device_view);
          const double g1 = best_gbps([&] { gather_ldg<1><<<ctas, 256, 0, stream>>>(host4, order, target, runs); },
                                      bytes, reps, stream);
          const double g2 = best_gbps([&] { gather_ldg<2><<<ctas, 256, 0, stream>>>(host4, order, target, runs); },
                                      bytes, reps, stream);
          const double g4 = best_gbps([&] { gather_ldg<4><<<ctas, 256, 0, stream>>>(host4, order, target, runs); },
                                      bytes, reps, stream);
          std::printf("ldg %-10s %3d CTAs x 8 warps: 1 run a warp %.1f, 2 runs %.1f, 4 runs %.1f GB/s\n", order_name,
                      ctas, g1, g2, g4);
        }
      }
      if (mode == "all" || mode == "tma") {
        for (const int ctas : {16, 33, 66, 132, 264}) {
          for (const int slots : {4, 8, 16}) {
            const int shared = slots * kRunBytes;
            const double g = best_gbps(
                [&] { gather_tma<<<ctas, 32, shared, stream>>>(device_view, order, target, runs, slots); }, bytes,
                reps, stream);
            std::printf("tma %-10s %3d CTAs x %2d slots (%4d KiB in flight): %.1f GB/s\n", order_name, ctas, slots,
                        ctas * slots * 2, g);
          }
        }
      }
    }
    host.release();
  }
  return 0;
}
