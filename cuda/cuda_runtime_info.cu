#include <cuda_runtime_api.h>

#include "cuda_runtime_info.hpp"

namespace shadowkv::detail {

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver/device" error
    return 0;
  }
  return count;
}

}  // namespace shadowkv::detail
