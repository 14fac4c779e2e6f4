#include "cuda_check.hpp"

#include <string>

namespace shadowkv::cuda::detail {

void throw_cuda_error(cudaError_t status, const char* expression, const char* file, int line) {
  const std::string message = shadowkv::detail::format_message(
      "CUDA error ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ") in ", expression, " at ", file,
      ":", line);
  if (status == cudaErrorMemoryAllocation) throw out_of_memory(message);
  throw cuda_error(message);
}

void throw_cublas_error(cublasStatus_t status, const char* expression, const char* file, int line) {
  const std::string message = shadowkv::detail::format_message("cuBLAS error ", cublasGetStatusName(status), " in ",
                                                               expression, " at ", file, ":", line);
  if (status == CUBLAS_STATUS_ALLOC_FAILED) throw out_of_memory(message);
  throw cuda_error(message);
}

void throw_cusolver_error(cusolverStatus_t status, const char* expression, const char* file, int line) {
  const std::string message = shadowkv::detail::format_message("cuSOLVER error ", static_cast<int>(status), " in ",
                                                               expression, " at ", file, ":", line);
  if (status == CUSOLVER_STATUS_ALLOC_FAILED) throw out_of_memory(message);
  throw cuda_error(message);
}

}  // namespace shadowkv::cuda::detail
