// Two questions from the B = 1 phase stamps (bench/NOTES.md, session 22), each asked outside the store:
//  1. The key rebuild's CTA spends ~3.6 µs between two barriers whose only work is issuing its first two K tiles:
//     ~1500 gathered 16-byte cp.async a CTA (64 coefficient rows of 64 bytes and 32 basis rows of 256 bytes a tile).
//     Does issuing that many cp.async block for round trips? Timed against the same bytes by bulk copies (one
//     cp.async.bulk a row piece, an mbarrier a tile), 128 and 256 CTAs of 256 threads (the rebuild at B = 1 has 256,
//     two an SM, both issuing at once in the step: session 24 added the 256); the copies also as the rebuild issues
//     them (zero-fill form, .L2::128B on the coefficient pieces), and beside a value-fetch like kernel on a second
//     stream (256 CTAs copying 2048 random 2 KiB runs device to device), which runs beside the rebuild in the step.
//  2. The B = 1 landmark logits read 31.5 MB at ~2.4-2.8 TB/s: their warps stream 2 KiB batches by per-lane 16-byte
//     cp.async, two batches in flight a warp, 528 CTAs. Is that the reader, or the bytes? Timed against whole 32 KiB
//     tiles by bulk copies (264 CTAs, three stages, as the tensor-core path), 16 KiB tiles (528 CTAs), plain loads,
//     and a device copy of the same bytes.
//  3. (session 25) The same bytes read by one CTA on each of 64 or 128 SMs with 3-12 stages in flight: can a select
//     cluster that computes its own logits at B = 1 (8 or 16 CTAs a KV head) read the landmarks as fast as the
//     logits kernel's whole grid does?
// Every variant's CTA reads its bytes and folds them into one word (so the reads are real), written to `sink`.
// Prints µs per variant (median of `reps` launches, each after an L2 flush by a 256 MB read; the first run, session
// 22, flushed by a memset, whose dirty lines were written back during the launches) and, for part 1, the per-CTA
// issue and landing times (median and max over CTAs, from %globaltimer).
//   nvcc -O3 -std=c++17 -arch=sm_90a -o copy_issue_probe bench/probes/copy_issue_probe.cu && ./copy_issue_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "probe_check.cuh"

namespace {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void copy16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(shared)), "l"(global) : "memory");
}
__device__ __forceinline__ void copy16_as_rebuild(void* shared, const void* global, bool prefetch) {
  if (prefetch) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_address(shared)), "l"(global),
                 "r"(16)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(shared)), "l"(global), "r"(16)
                 : "memory");
  }
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void barrier_init(unsigned long long* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_address(barrier)) : "memory");
}
__device__ __forceinline__ void barrier_expect(unsigned long long* barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(barrier)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_copy(void* shared, const void* global, unsigned bytes,
                                          unsigned long long* barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_address(shared)),
               "l"(global), "r"(bytes), "r"(smem_address(barrier))
               : "memory");
}
__device__ __forceinline__ void barrier_wait(unsigned long long* barrier, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait_%=;\n}\n" ::"r"(smem_address(barrier)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ unsigned fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// ---- Part 1: the rebuild's first K tiles (bf16 factors, rank 160, D = 128, 8 KV heads) ----
constexpr int kRows = 64;        // gathered coefficient rows a tile
constexpr int kRank = 160;       // elements a coefficient row
constexpr int kRankTile = 32;    // elements a K tile: 64 bytes of each row
constexpr int kWidth = 8 * 128;  // basis row: Hkv * D elements
constexpr int kD = 128;
constexpr int kAStride = kRankTile + 8;  // bf16 elements a shared A row (80 bytes)
constexpr int kBStride = kD + 8;         // a shared B row (272 bytes)
constexpr int kTileElements = kRows * kAStride + kRankTile * kBStride;
constexpr int kMaxTiles = 5;
constexpr int kTileBytesMoved = kRows * kRankTile * 2 + kRankTile * kD * 2;  // 12 KiB

// `tiles` K tiles of 64 random rows into `tiles` stages; per CTA: issue end and landing, ns after the CTA's start.
// kMode: 0 plain 16-byte cp.async, 1 as the rebuild issues them (zero-fill form; .L2::128B on the coefficient pieces),
// 2 bulk copies.
template <int kMode>
__global__ void __launch_bounds__(256)
    rebuild_tiles(const std::uint16_t* coefficients, const std::uint16_t* basis, const int* tokens, int tiles,
                  unsigned long long* spans, unsigned* sink) {
  extern __shared__ __align__(128) std::uint16_t stages[];
  __shared__ __align__(8) unsigned long long barriers[kMaxTiles];
  const int head = static_cast<int>(blockIdx.x) % 8;
  const int* rows = tokens + static_cast<long long>(blockIdx.x) * kRows;
  const std::uint16_t* head_basis = basis + head * kD;
  constexpr bool kBulk = kMode == 2;
  if (kBulk && threadIdx.x == 0) {
    for (int t = 0; t < tiles; ++t) barrier_init(&barriers[t]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const unsigned long long start = global_ns();
  for (int t = 0; t < tiles; ++t) {
    std::uint16_t* stage = stages + t * kTileElements;
    const int k0 = t * kRankTile;
    if constexpr (kBulk) {
      // One thread expects the tile's bytes, then 64 threads copy a row piece each and 32 a basis row each.
      if (threadIdx.x == 0) barrier_expect(&barriers[t], kTileBytesMoved);
      __syncthreads();
      if (threadIdx.x < kRows) {
        const int row = static_cast<int>(threadIdx.x);
        bulk_copy(stage + row * kAStride, coefficients + static_cast<long long>(rows[row]) * kRank + k0, 64,
                  &barriers[t]);
      } else if (threadIdx.x < kRows + kRankTile) {
        const int k = static_cast<int>(threadIdx.x) - kRows;
        bulk_copy(stage + kRows * kAStride + k * kBStride, head_basis + static_cast<long long>(k0 + k) * kWidth, 256,
                  &barriers[t]);
      }
    } else {
      for (int v = static_cast<int>(threadIdx.x); v < kRows * 4; v += 256) {  // 4 x 16 bytes a row
        const int row = v / 4;
        const std::uint16_t* from = coefficients + static_cast<long long>(rows[row]) * kRank + k0 + (v % 4) * 8;
        if constexpr (kMode == 1) {
          copy16_as_rebuild(stage + row * kAStride + (v % 4) * 8, from, true);
        } else {
          copy16(stage + row * kAStride + (v % 4) * 8, from);
        }
      }
      for (int v = static_cast<int>(threadIdx.x); v < kRankTile * 16; v += 256) {  // 16 x 16 bytes a basis row
        const int k = v / 16;
        const std::uint16_t* from = head_basis + static_cast<long long>(k0 + k) * kWidth + (v % 16) * 8;
        if constexpr (kMode == 1) {
          copy16_as_rebuild(stage + kRows * kAStride + k * kBStride + (v % 16) * 8, from, true);
        } else {
          copy16(stage + kRows * kAStride + k * kBStride + (v % 16) * 8, from);
        }
      }
      commit();
    }
  }
  __syncthreads();
  const unsigned long long issued = global_ns();
  if constexpr (kBulk) {
    for (int t = 0; t < tiles; ++t) barrier_wait(&barriers[t], 0);
  } else {
    wait_all();
  }
  __syncthreads();
  const unsigned long long landed = global_ns();
  unsigned word = 0;
  for (int i = static_cast<int>(threadIdx.x); i < tiles * kTileElements / 8; i += 256) {
    word ^= fold(reinterpret_cast<const uint4*>(stages)[i]);
  }
  if (word == 0x12345678U) sink[0] = word;  // keeps the reads
  if (threadIdx.x == 0) {
    spans[2 * blockIdx.x] = issued - start;
    spans[2 * blockIdx.x + 1] = landed - start;
  }
}

// A value-fetch like kernel: warp w copies 2 KiB run w (of `runs`) from source run order[w], 4 x 16 bytes a lane.
__global__ void __launch_bounds__(256) gather_runs(const uint4* source, const int* order, uint4* target, int runs) {
  const int warp = static_cast<int>(blockIdx.x) * 8 + static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (warp >= runs) return;
  const uint4* from = source + static_cast<long long>(order[warp]) * 128;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) v[u] = from[lane + 32 * u];
#pragma unroll
  for (int u = 0; u < 4; ++u) target[static_cast<long long>(warp) * 128 + lane + 32 * u] = v[u];
}

// ---- Part 2: streaming 31.5 MB of landmark tiles (960 tiles of 32 KiB) ----
constexpr int kTileBytes = 32 * 1024;

// As the FMA logits path: 8 warps, each warp's share of every tile in 2 KiB batches (a lane: 4 x 16 bytes), a ring of
// three batches a warp with two in flight; a block barrier a tile. CTA c takes tiles [c * T / grid, (c+1) * T / grid).
__global__ void __launch_bounds__(256) stream_lanes(const unsigned char* data, int tiles, unsigned* sink) {
  extern __shared__ __align__(128) uint4 rings[];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  uint4* ring = rings + warp * 3 * 128;  // 3 batches of 2 KiB (128 uint4) a warp
  const int first = static_cast<int>(static_cast<long long>(blockIdx.x) * tiles / gridDim.x);
  const int end = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * tiles / gridDim.x);
  constexpr int kBatchesPerWarpTile = kTileBytes / 2048 / 8;  // 2
  const int steps = (end - first) * kBatchesPerWarpTile;
  auto issue = [&](int step) {
    if (step < steps) {
      const int tile = first + step / kBatchesPerWarpTile;
      const int batch = warp + 8 * (step % kBatchesPerWarpTile);
      const uint4* from =
          reinterpret_cast<const uint4*>(data + static_cast<long long>(tile) * kTileBytes + batch * 2048);
      uint4* to = ring + (step % 3) * 128;
#pragma unroll
      for (int u = 0; u < 4; ++u) copy16(to + lane + 32 * u, from + lane + 32 * u);
    }
    commit();
  };
  issue(0);
  issue(1);
  unsigned word = 0;
  for (int step = 0; step < steps; ++step) {
    issue(step + 2);
    wait_pending<2>();
    const uint4* landed = ring + (step % 3) * 128;
#pragma unroll
    for (int u = 0; u < 4; ++u) word ^= fold(landed[lane + 32 * u]);
    __syncwarp();
    if (step % kBatchesPerWarpTile == kBatchesPerWarpTile - 1) __syncthreads();  // a tile's end
  }
  if (word == 0x12345678U) sink[0] = word;
}

// As the tensor-core logits path: whole tiles of `tile_bytes` by one bulk copy each, kStages stages (three on that
// path), thread 0 refilling the stage the last tile freed after the tile's block barrier.
template <int kStages>
__global__ void __launch_bounds__(256)
    stream_bulk(const unsigned char* data, int tiles, int tile_bytes, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char stages_bytes[];
  __shared__ __align__(8) unsigned long long barriers[kStages];
  const int first = static_cast<int>(static_cast<long long>(blockIdx.x) * tiles / gridDim.x);
  const int end = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * tiles / gridDim.x);
  auto issue = [&](int k) {
    const int s = k % kStages;
    barrier_expect(&barriers[s], static_cast<unsigned>(tile_bytes));
    bulk_copy(stages_bytes + s * tile_bytes, data + static_cast<long long>(first + k) * tile_bytes,
              static_cast<unsigned>(tile_bytes), &barriers[s]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) barrier_init(&barriers[s]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int k = 0; k < kStages && first + k < end; ++k) issue(k);
  }
  __syncthreads();
  unsigned word = 0;
  for (int k = 0; first + k < end; ++k) {
    barrier_wait(&barriers[k % kStages], static_cast<unsigned>((k / kStages) & 1));
    const uint4* landed = reinterpret_cast<const uint4*>(stages_bytes + (k % kStages) * tile_bytes);
    for (int i = static_cast<int>(threadIdx.x); i < tile_bytes / 16; i += 256) word ^= fold(landed[i]);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0 && first + k + kStages < end) issue(k + kStages);
  }
  if (word == 0x12345678U) sink[0] = word;
}

// Plain 16-byte loads, four in flight a thread, a grid-stride loop: what the reads alone can reach.
__global__ void __launch_bounds__(256) stream_loads(const uint4* data, long long vectors, unsigned* sink) {
  unsigned word = 0;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      v[u] = i + u * stride < vectors ? __ldcg(data + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) word ^= fold(v[u]);
  }
  if (word == 0x12345678U) sink[0] = word;
}

struct timer {
  cudaEvent_t begin, end;
  timer() {
    CHECK(cudaEventCreate(&begin));
    CHECK(cudaEventCreate(&end));
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 9;
  // `./copy_issue_probe REPS TILES`: parts 2 and 3 only, over TILES tiles of 32 KiB (7680: B = 8's 252 MB of landmarks
  // at S = 122880, Hkv = 8, D = 128; session 29); part 1 is left out then.
  const int read_tiles = argc > 2 ? std::atoi(argv[2]) : 960;
  const bool part_1 = argc <= 2;
  int multiprocessors = 0;
  CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp properties{};
  CHECK(cudaGetDeviceProperties(&properties, 0));
  std::printf("device %s, %d SMs\n", properties.name, multiprocessors);
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&sink, 16));
  // An L2 flush between launches: 256 MB read.
  const std::size_t flush_bytes = 256u << 20;
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMemset(flush, 5, flush_bytes));
  timer clock;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto time_it = [&](auto&& launch) {
    std::vector<double> us;
    for (int r = 0; r < reps; ++r) {
      // L2 flushed by reading 256 MB (clean lines: a memset's dirty ones would be written back during the launch)
      stream_loads<<<8 * multiprocessors, 256>>>(static_cast<const uint4*>(flush), flush_bytes / 16, sink);
      CHECK(cudaEventRecord(clock.begin));
      launch();
      CHECK(cudaEventRecord(clock.end));
      CHECK(cudaEventSynchronize(clock.end));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, clock.begin, clock.end));
      us.push_back(ms * 1e3);
    }
    CHECK(cudaGetLastError());
    return median(us);
  };

  // Part 1.
  if (part_1) {
  const long long tokens_total = 122880;
  std::uint16_t* coefficients = nullptr;
  std::uint16_t* basis = nullptr;
  int* tokens = nullptr;
  unsigned long long* spans = nullptr;
  const int max_ctas = 256;  // as the rebuild's grid at B = 1 (two an SM); 128 = one an SM
  CHECK(cudaMalloc(&coefficients, tokens_total * kRank * 2));
  CHECK(cudaMalloc(&basis, static_cast<long long>(kRank) * kWidth * 2));
  CHECK(cudaMemset(coefficients, 1, tokens_total * kRank * 2));
  CHECK(cudaMemset(basis, 2, static_cast<long long>(kRank) * kWidth * 2));
  CHECK(cudaMalloc(&tokens, max_ctas * kRows * sizeof(int)));
  CHECK(cudaMalloc(&spans, 2 * max_ctas * sizeof(unsigned long long)));
  std::mt19937 random(7);
  std::vector<int> host_tokens(max_ctas * kRows);
  for (int c = 0; c < max_ctas; ++c) {
    for (int r = 0; r < kRows; ++r) {  // 8 chunks of 8 consecutive tokens, at random chunks
      const int chunk = static_cast<int>(random() % (tokens_total / 8));
      if (r % 8 == 0)
        host_tokens[c * kRows + r] = chunk * 8;
      else
        host_tokens[c * kRows + r] = host_tokens[c * kRows + r - 1] + 1;
    }
  }
  CHECK(cudaMemcpy(tokens, host_tokens.data(), host_tokens.size() * sizeof(int), cudaMemcpyHostToDevice));
  std::printf("\npart 1: CTAs of 256 threads, K tiles of 64 gathered 64-byte row pieces + 32 basis rows (12 KiB)\n");
  std::printf("| reader | CTAs | tiles | kernel µs | CTA issue µs median / max | CTA landed µs median / max |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  // The fetch-like kernel's buffers: 2048 runs gathered from a 256 MB store.
  const int runs = 2048;
  const long long store_runs = (256LL << 20) / 2048;
  uint4* run_store = nullptr;
  uint4* run_target = nullptr;
  int* run_order = nullptr;
  CHECK(cudaMalloc(&run_store, store_runs * 2048));
  CHECK(cudaMalloc(&run_target, static_cast<long long>(runs) * 2048));
  CHECK(cudaMalloc(&run_order, runs * sizeof(int)));
  std::vector<int> host_order(runs);
  for (int& r : host_order) r = static_cast<int>(random() % store_runs);
  CHECK(cudaMemcpy(run_order, host_order.data(), runs * sizeof(int), cudaMemcpyHostToDevice));
  cudaStream_t side = nullptr;
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t flushed = nullptr;
  CHECK(cudaEventCreateWithFlags(&flushed, cudaEventDisableTiming));
  const char* mode_names[3] = {"cp.async 16 B", "cp.async as the rebuild", "bulk copies"};
  for (const int ctas : {128, max_ctas}) {
    for (const bool beside : {false, true}) {
      for (const int tiles : {2, 5}) {
        for (const int mode : {0, 1, 2}) {
          const std::size_t shared = static_cast<std::size_t>(tiles) * kTileElements * 2;
          auto kernel = mode == 0 ? rebuild_tiles<0> : (mode == 1 ? rebuild_tiles<1> : rebuild_tiles<2>);
          CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
          const double us = time_it([&] {
            if (beside) {  // the fetch-like kernel first, on the side stream, after the flush
              CHECK(cudaEventRecord(flushed, 0));
              CHECK(cudaStreamWaitEvent(side, flushed, 0));
              gather_runs<<<runs / 8, 256, 0, side>>>(run_store, run_order, run_target, runs);
            }
            kernel<<<ctas, 256, shared>>>(coefficients, basis, tokens, tiles, spans, sink);
            if (beside) {
              CHECK(cudaEventRecord(flushed, side));
              CHECK(cudaStreamWaitEvent(0, flushed, 0));
            }
          });
          std::vector<unsigned long long> host_spans(2 * ctas);
          CHECK(cudaMemcpy(host_spans.data(), spans, host_spans.size() * 8, cudaMemcpyDeviceToHost));
          std::vector<double> issue, landed;
          for (int c = 0; c < ctas; ++c) {
            issue.push_back(host_spans[2 * c] / 1e3);
            landed.push_back(host_spans[2 * c + 1] / 1e3);
          }
          std::printf("| %s%s | %d | %d | %.1f | %.2f / %.2f | %.2f / %.2f |\n", mode_names[mode],
                      beside ? ", beside a fetch" : "", ctas, tiles, us, median(issue),
                      *std::max_element(issue.begin(), issue.end()), median(landed),
                      *std::max_element(landed.begin(), landed.end()));
        }
      }
    }
  }

  }  // part 1

  // Part 2.
  const int tiles = read_tiles;
  const long long bytes = static_cast<long long>(tiles) * kTileBytes;
  unsigned char* data = nullptr;
  unsigned char* copy_target = nullptr;
  CHECK(cudaMalloc(&data, bytes));
  CHECK(cudaMalloc(&copy_target, bytes));
  CHECK(cudaMemset(data, 3, bytes));
  std::printf("\npart 2: %.1f MB in %d tiles of 32 KiB\n", bytes / 1e6, tiles);
  std::printf("| reader | CTAs | µs | TB/s |\n| --- | --- | --- | --- |\n");
  auto row = [&](const char* name, int grid, double us) {
    std::printf("| %s | %d | %.1f | %.2f |\n", name, grid, us, bytes / us / 1e6);
  };
  const std::size_t lane_shared = 8 * 3 * 2048;
  CHECK(cudaFuncSetAttribute(stream_lanes, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(lane_shared)));
  for (const int per_sm : {4, 2}) {
    const int grid = per_sm * multiprocessors;
    row("per-lane cp.async, 2 KiB batches (FMA path)", grid,
        time_it([&] { stream_lanes<<<grid, 256, lane_shared>>>(data, tiles, sink); }));
  }
  CHECK(cudaFuncSetAttribute(stream_bulk<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * kTileBytes));
  for (const int per_sm : {2, 1}) {
    const int grid = per_sm * multiprocessors;
    row("bulk 32 KiB tiles, 3 stages (MMA path)", grid,
        time_it([&] { stream_bulk<3><<<grid, 256, 3 * kTileBytes>>>(data, tiles, kTileBytes, sink); }));
  }
  for (const int per_sm : {4, 2}) {
    const int grid = per_sm * multiprocessors;
    row("bulk 16 KiB tiles, 3 stages", grid,
        time_it([&] { stream_bulk<3><<<grid, 256, 3 * kTileBytes / 2>>>(data, 2 * tiles, kTileBytes / 2, sink); }));
  }
  for (const int per_sm : {4, 8}) {
    const int grid = per_sm * multiprocessors;
    row("plain loads, 4 x 16 B in flight a thread", grid,
        time_it([&] { stream_loads<<<grid, 256>>>(reinterpret_cast<const uint4*>(data), bytes / 16, sink); }));
  }
  row("cudaMemcpyAsync device to device (read + write)", 0,
      time_it([&] { CHECK(cudaMemcpyAsync(copy_target, data, bytes, cudaMemcpyDeviceToDevice)); }));
  // Part 3: the same bytes read by one CTA on each of fewer SMs, with more in flight an SM: what a select cluster
  // that computed its own logits would read at B = 1 (8 CTAs a KV head: 64 SMs; 16 a head: 128), bench/NOTES.md
  // session 24's plan. 6 stages of 32 KiB = 192 KiB in flight a CTA; 12 of 16 KiB the same bytes in smaller pieces.
  std::printf("\npart 3: the same bytes by one CTA an SM on part of the SMs (bulk copies, more stages)\n");
  std::printf("| reader | CTAs | µs | TB/s |\n| --- | --- | --- | --- |\n");
  CHECK(cudaFuncSetAttribute(stream_bulk<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 6 * kTileBytes));
  CHECK(cudaFuncSetAttribute(stream_bulk<12>, cudaFuncAttributeMaxDynamicSharedMemorySize, 12 * kTileBytes / 2));
  for (const int grid : {64, 128, multiprocessors}) {
    if (!part_1 && grid != multiprocessors) continue;  // the whole-GPU readers only, for B = 8's bytes
    row("bulk 32 KiB tiles, 3 stages", grid,
        time_it([&] { stream_bulk<3><<<grid, 256, 3 * kTileBytes>>>(data, tiles, kTileBytes, sink); }));
    row("bulk 32 KiB tiles, 6 stages", grid,
        time_it([&] { stream_bulk<6><<<grid, 256, 6 * kTileBytes>>>(data, tiles, kTileBytes, sink); }));
    row("bulk 16 KiB tiles, 12 stages", grid,
        time_it([&] { stream_bulk<12><<<grid, 256, 12 * kTileBytes / 2>>>(data, 2 * tiles, kTileBytes / 2, sink); }));
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
