// What a step in a CUDA graph pays for the node that writes its query before its first kernel: a device-to-device
// memcpy node (what bench/step_benchmark.py's --graph-steps records with copy_) against a kernel node (what a model's
// projection is), against nothing. Standalone, outside the store: 8 steps a graph, each a 16 MB read by 528 CTAs (a
// stand-in for the landmark logits' one-wave grid) after its query write of 8 KiB; the time per step of each variant,
// median of 30 replays of 8 steps.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/gnp bench/probes/graph_node_probe.cu && /tmp/gnp
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    const cudaError_t status = (call);                                                               \
    if (status != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(status));            \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

// Reads `count` uint4 (grid-stride) and folds them into one word per CTA, so that the reads are not removed.
__global__ void read_kernel(const uint4* data, long long count, unsigned* sink) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const uint4 v = data[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678U) sink[blockIdx.x] = acc;
}

// The query's write as a kernel: one CTA copies `count` uint4.
__global__ void copy_kernel(uint4* dst, const uint4* src, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) dst[i] = src[i];
}

int main() {
  constexpr int kSteps = 8;
  constexpr int kReplays = 30;
  constexpr long long kReadBytes = 16LL << 20;
  constexpr int kQueryBytes = 8192;
  uint4* data = nullptr;
  uint4* query = nullptr;
  uint4* bank = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&data, kReadBytes));
  CHECK(cudaMalloc(&query, kQueryBytes));
  CHECK(cudaMalloc(&bank, kQueryBytes * kSteps));
  CHECK(cudaMalloc(&sink, 4096 * sizeof(unsigned)));
  CHECK(cudaMemset(data, 1, kReadBytes));
  CHECK(cudaMemset(bank, 2, kQueryBytes * kSteps));
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const char* names[] = {"no query write", "memcpy node (copy_)", "kernel node (1 CTA)"};
  std::printf("| query write before each step's first kernel | µs a step (median of %d graphs of %d steps) | min |\n",
              kReplays, kSteps);
  std::printf("| --- | --- | --- |\n");
  for (int variant = 0; variant < 3; ++variant) {
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int s = 0; s < kSteps; ++s) {
      if (variant == 1) {
        CHECK(cudaMemcpyAsync(query, bank + s * (kQueryBytes / 16), kQueryBytes, cudaMemcpyDeviceToDevice, stream));
      } else if (variant == 2) {
        copy_kernel<<<1, 256, 0, stream>>>(query, bank + s * (kQueryBytes / 16), kQueryBytes / 16);
      }
      read_kernel<<<528, 256, 0, stream>>>(data, kReadBytes / 16, sink);
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t begin = nullptr;
    cudaEvent_t end = nullptr;
    CHECK(cudaEventCreate(&begin));
    CHECK(cudaEventCreate(&end));
    CHECK(cudaGraphLaunch(exec, stream));  // warm-up
    CHECK(cudaStreamSynchronize(stream));
    std::vector<float> per_step;
    for (int r = 0; r < kReplays; ++r) {
      CHECK(cudaEventRecord(begin, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(end, stream));
      CHECK(cudaEventSynchronize(end));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, begin, end));
      per_step.push_back(ms * 1000.0F / kSteps);
    }
    std::sort(per_step.begin(), per_step.end());
    std::printf("| %s | %.2f | %.2f |\n", names[variant], per_step[per_step.size() / 2], per_step[0]);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
  }
  return 0;
}
