#include "device_resources.hpp"

#include <map>

#include "cuda_check.hpp"

namespace shadowkv::cuda {

std::shared_ptr<device_resources> device_resources::shared(int device) {
  static std::mutex registry_mutex;
  static std::map<int, std::weak_ptr<device_resources>> registry;  // weak: the last store to go frees them
  const std::lock_guard<std::mutex> lock(registry_mutex);
  std::weak_ptr<device_resources>& entry = registry[device];
  if (std::shared_ptr<device_resources> alive = entry.lock()) return alive;
  auto made = std::make_shared<device_resources>(device);
  entry = made;
  return made;
}

device_resources::device_resources(int device) : device_(device), device_memory_(device) {
  int previous = 0;
  SHADOWKV_CUDA_TRY(cudaGetDevice(&previous));
  SHADOWKV_CUDA_TRY(cudaSetDevice(device));  // handles belong to the device current when they are made
  try {
    SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device));
    cublas_ = make_cublas();
    cusolver_ = make_cusolver();
    cusolver_params_ = make_cusolver_params();
  } catch (...) {
    (void)cudaSetDevice(previous);
    throw;
  }
  SHADOWKV_CUDA_TRY(cudaSetDevice(previous));
}

device_resources::library_lease device_resources::libraries(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(library_mutex_);
  SHADOWKV_CUBLAS_TRY(cublasSetStream(cublas_, stream));
  SHADOWKV_CUSOLVER_TRY(cusolverDnSetStream(cusolver_, stream));
  return library_lease(*this, std::move(lock));
}

}  // namespace shadowkv::cuda
