#include <cuda_runtime_api.h>

#include "cuda_architectures.hpp"
#include "cuda_check.hpp"
#include "cuda_runtime_info.hpp"

#ifndef SHADOWKV_BUILT_CUDA_ARCHITECTURES
#error "SHADOWKV_BUILT_CUDA_ARCHITECTURES (the CUDA architecture list, set by cuda/CMakeLists.txt) is not defined"
#endif

namespace shadowkv::detail {
namespace {

// Compiled, like every kernel of the library, for the build's architecture list: whether the runtime has code for
// it on a device is whether it has code for the kernels. It is never launched.
__global__ void architecture_probe_kernel() {}

// Errors of cudaFuncGetAttributes that mean "no code this device can run", as opposed to a failing device or driver.
bool means_no_code(cudaError_t status) {
  switch (status) {
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDeviceFunction:
    case cudaErrorInvalidKernelImage:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorInvalidPtx:
    case cudaErrorJitCompilerNotFound:
    case cudaErrorJitCompilationDisabled:
      return true;
    default:
      return false;
  }
}

}  // namespace

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver/device" error
    return 0;
  }
  return count;
}

std::vector<std::string> compiled_cuda_architectures() {
  return split_cuda_architectures(SHADOWKV_BUILT_CUDA_ARCHITECTURES);
}

void check_cuda_architecture(int device_index) {
  cudaDeviceProp properties{};
  SHADOWKV_CUDA_TRY(cudaGetDeviceProperties(&properties, device_index));
  const std::vector<std::string> built = compiled_cuda_architectures();
  std::string problem =
      cuda_architecture_mismatch(device_index, properties.name, properties.major, properties.minor, built);
  if (problem.empty()) {
    // The list says yes; ask the runtime too (it also knows whether this driver can JIT the PTX).
    int previous = 0;
    SHADOWKV_CUDA_TRY(cudaGetDevice(&previous));
    SHADOWKV_CUDA_TRY(cudaSetDevice(device_index));
    cudaFuncAttributes attributes{};
    const cudaError_t status = cudaFuncGetAttributes(&attributes, architecture_probe_kernel);
    (void)cudaGetLastError();
    (void)cudaSetDevice(previous);
    if (status == cudaSuccess) return;
    if (!means_no_code(status)) {
      cuda::detail::throw_cuda_error(status, "cudaFuncGetAttributes(architecture probe)", __FILE__, __LINE__);
    }
    problem = cuda_architecture_mismatch(device_index, properties.name, properties.major, properties.minor, built,
                                         format_message(cudaGetErrorName(status), " (", cudaGetErrorString(status),
                                                        ")"));
  }
  throw invalid_argument(problem);
}

}  // namespace shadowkv::detail
