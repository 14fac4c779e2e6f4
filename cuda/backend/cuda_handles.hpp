// Owners of the CUDA runtime, cuBLAS and cuSOLVER handles of the backend: each is destroyed exactly once, also when
// the backend's constructor throws half-way (e.g. MemoryError while reserving the arenas).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <utility>

namespace shadowkv::cuda {

/// A handle and the function that destroys it. Converts to the raw handle for API calls; movable, not copyable.
template <typename Handle, auto Destroy>
class unique_handle {
 public:
  unique_handle() = default;
  explicit unique_handle(Handle handle) noexcept : handle_(handle) {}
  ~unique_handle() { reset(); }
  unique_handle(const unique_handle&) = delete;
  unique_handle& operator=(const unique_handle&) = delete;
  unique_handle(unique_handle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  unique_handle& operator=(unique_handle&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }

  operator Handle() const noexcept { return handle_; }  // NOLINT(google-explicit-constructor): used as the raw handle
  void reset() noexcept {
    if (handle_ != nullptr) (void)Destroy(std::exchange(handle_, nullptr));
  }

 private:
  Handle handle_ = nullptr;
};

using stream_handle = unique_handle<cudaStream_t, cudaStreamDestroy>;
using event_handle = unique_handle<cudaEvent_t, cudaEventDestroy>;
using cublas_handle = unique_handle<cublasHandle_t, cublasDestroy>;
using cusolver_handle = unique_handle<cusolverDnHandle_t, cusolverDnDestroy>;
/// The options of cuSOLVER's 64-bit API (cusolverDnX*); the defaults are all the backend uses.
using cusolver_params_handle = unique_handle<cusolverDnParams_t, cusolverDnDestroyParams>;

/// A stream, an event without timing, and library handles; each throws cuda_error on failure. The stream is
/// non-blocking unless `with_legacy_stream` (then it is ordered with the legacy default stream, both ways, as
/// cudaStreamCreate's streams are).
stream_handle make_stream(bool with_legacy_stream = false);
event_handle make_event();
cublas_handle make_cublas();
cusolver_handle make_cusolver();
cusolver_params_handle make_cusolver_params();

}  // namespace shadowkv::cuda
