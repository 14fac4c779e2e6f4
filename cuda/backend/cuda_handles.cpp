#include "cuda_handles.hpp"

#include "cuda_check.hpp"

namespace shadowkv::cuda {

stream_handle make_stream(bool with_legacy_stream) {
  cudaStream_t stream = nullptr;
  SHADOWKV_CUDA_TRY(
      cudaStreamCreateWithFlags(&stream, with_legacy_stream ? cudaStreamDefault : cudaStreamNonBlocking));
  return stream_handle(stream);
}

event_handle make_event() {
  cudaEvent_t event = nullptr;
  SHADOWKV_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event_handle(event);
}

cublas_handle make_cublas() {
  cublasHandle_t handle = nullptr;
  SHADOWKV_CUBLAS_TRY(cublasCreate(&handle));
  return cublas_handle(handle);
}

cusolver_handle make_cusolver() {
  cusolverDnHandle_t handle = nullptr;
  SHADOWKV_CUSOLVER_TRY(cusolverDnCreate(&handle));
  return cusolver_handle(handle);
}

cusolver_params_handle make_cusolver_params() {
  cusolverDnParams_t params = nullptr;
  SHADOWKV_CUSOLVER_TRY(cusolverDnCreateParams(&params));
  return cusolver_params_handle(params);
}

}  // namespace shadowkv::cuda
