// Does cuSOLVER's batched symmetric eigensolver return to the host before its work is done? (Issue 13: prefill waits
// on the host inside every cusolverDnDsyevdx; bench/NOTES.md, "Prefill: cuSOLVER's dense solvers wait on the host".)
// A 40 ms spin kernel is queued first, then the solver; if the call returns long before the spin ends, it does not
// wait for the stream. Compared with cusolverDnDsyevdx on one matrix of the same size.
//   nvcc -O2 -std=c++17 -o syev_batched_probe bench/probes/syev_batched_probe.cu -lcusolver && ./syev_batched_probe
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                       \
  do {                                                                                 \
    const auto status_ = (x);                                                          \
    if (static_cast<int>(status_) != 0) {                                              \
      std::printf("%s failed (%d) at line %d\n", #x, static_cast<int>(status_), __LINE__); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void fill_symmetric(double* a, int n, int batch) {
  const long long total = static_cast<long long>(batch) * n * n;
  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const long long k = i / (static_cast<long long>(n) * n);
    const int r = static_cast<int>(i % n);
    const int c = static_cast<int>((i / n) % n);
    const int lo = r < c ? r : c;
    const int hi = r < c ? c : r;
    a[i] = sin(0.001 * (lo + 1) * (hi + 3) + k) + (r == c ? 2.0 * n : 0.0);
  }
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

int main() {
  const int n = 1024;
  const int batch = 8;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cusolverDnHandle_t handle;
  CHECK(cusolverDnCreate(&handle));
  CHECK(cusolverDnSetStream(handle, stream));
  cusolverDnParams_t params;
  CHECK(cusolverDnCreateParams(&params));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const long long spin_cycles = 40LL * clock_khz;  // ~40 ms

  double* a = nullptr;
  double* w = nullptr;
  int* info = nullptr;
  CHECK(cudaMalloc(&a, sizeof(double) * n * n * batch));
  CHECK(cudaMalloc(&w, sizeof(double) * n * batch));
  CHECK(cudaMalloc(&info, sizeof(int) * batch));
  size_t device_bytes = 0;
  size_t host_bytes = 0;
  CHECK(cusolverDnXsyevBatched_bufferSize(handle, params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n,
                                          CUDA_R_64F, a, n, CUDA_R_64F, w, CUDA_R_64F, &device_bytes, &host_bytes,
                                          batch));
  void* device_work = nullptr;
  CHECK(cudaMalloc(&device_work, device_bytes > 0 ? device_bytes : 1));
  void* host_work = std::malloc(host_bytes > 0 ? host_bytes : 1);
  std::printf("XsyevBatched n=%d batch=%d: device workspace %zu B, host workspace %zu B\n", n, batch, device_bytes,
              host_bytes);

  for (int round = 0; round < 3; ++round) {  // round 0 warms up
    fill_symmetric<<<512, 256, 0, stream>>>(a, n, batch);
    CHECK(cudaStreamSynchronize(stream));
    spin<<<1, 1, 0, stream>>>(spin_cycles);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(cusolverDnXsyevBatched(handle, params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, a,
                                 n, CUDA_R_64F, w, CUDA_R_64F, device_work, device_bytes, host_work, host_bytes, info,
                                 batch));
    const double returned = ms_since(t0);
    CHECK(cudaStreamSynchronize(stream));
    const double done = ms_since(t0);
    int host_info[batch];
    CHECK(cudaMemcpy(host_info, info, sizeof(host_info), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < batch; ++i) bad += host_info[i] != 0;
    std::printf("XsyevBatched round %d: call returned after %.2f ms, stream done after %.2f ms (spin ~40 ms), "
                "info != 0 for %d of %d\n", round, returned, done, bad, batch);
  }

  // The single-matrix solver the backend uses today, for comparison.
  int lwork = 0;
  int found = 0;
  const int rank = 160;
  CHECK(cusolverDnDsyevdx_bufferSize(handle, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER,
                                     n, a, n, 0.0, 0.0, n - rank + 1, n, &found, w, &lwork));
  double* work = nullptr;
  CHECK(cudaMalloc(&work, sizeof(double) * (lwork > 0 ? lwork : 1)));
  for (int round = 0; round < 2; ++round) {
    fill_symmetric<<<512, 256, 0, stream>>>(a, n, 1);
    CHECK(cudaStreamSynchronize(stream));
    spin<<<1, 1, 0, stream>>>(spin_cycles);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(cusolverDnDsyevdx(handle, CUSOLVER_EIG_MODE_VECTOR, CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER, n, a, n,
                            0.0, 0.0, n - rank + 1, n, &found, w, work, lwork, info));
    const double returned = ms_since(t0);
    CHECK(cudaStreamSynchronize(stream));
    std::printf("Dsyevdx (one matrix) round %d: call returned after %.2f ms, stream done after %.2f ms\n", round,
                returned, ms_since(t0));
  }
  return 0;
}
