// What every store on one GPU shares (as faiss's GpuResources and rmm's per-device resources): the device's facts,
// asked once (its multiprocessor count), the cuBLAS and cuSOLVER handles of prefill, and the memory resources.
// One object per device while any store holds it (device_resources::shared); each store keeps its own streams and
// events, since a stream shared between stores would couple their graph captures and their fetch ordering.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <memory>
#include <mutex>

#include "cuda_handles.hpp"
#include "memory_resources.hpp"

namespace shadowkv::cuda {

class device_resources {
 public:
  /// The resources of `device`, made on first use and kept while any caller holds the pointer. Thread-safe.
  /// Throws cuda_error when the handles cannot be made (the caller has checked that the device exists).
  static std::shared_ptr<device_resources> shared(int device);

  explicit device_resources(int device);  // through shared(); public for std::make_shared
  ~device_resources() = default;
  device_resources(const device_resources&) = delete;
  device_resources& operator=(const device_resources&) = delete;

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] int multiprocessors() const noexcept { return multiprocessors_; }
  [[nodiscard]] device_memory_resource& device_memory() noexcept { return device_memory_; }
  [[nodiscard]] pinned_host_resource& host_memory() noexcept { return host_memory_; }

  /// The cuBLAS and cuSOLVER handles bound to one stream, for one caller at a time: a store holds the lease for its
  /// prefill call, so that two stores prefilling on two threads never rebind a handle under each other.
  class library_lease {
   public:
    [[nodiscard]] cublasHandle_t cublas() const noexcept { return owner_->cublas_; }
    [[nodiscard]] cusolverDnHandle_t cusolver() const noexcept { return owner_->cusolver_; }
    /// Default options for cuSOLVER's 64-bit calls (the batched eigensolver of prefill).
    [[nodiscard]] cusolverDnParams_t cusolver_params() const noexcept { return owner_->cusolver_params_; }

   private:
    friend class device_resources;
    library_lease(device_resources& owner, std::unique_lock<std::mutex> lock) : owner_(&owner), lock_(std::move(lock)) {}
    device_resources* owner_;
    std::unique_lock<std::mutex> lock_;
  };
  /// Waits for the handles, binds them to `stream` and returns them until the lease goes.
  [[nodiscard]] library_lease libraries(cudaStream_t stream);

 private:
  int device_;
  int multiprocessors_ = 1;
  std::mutex library_mutex_;
  cublas_handle cublas_;
  cusolver_handle cusolver_;
  cusolver_params_handle cusolver_params_;
  device_memory_resource device_memory_;
  pinned_host_resource host_memory_;
};

}  // namespace shadowkv::cuda
