// Error checks for CUDA runtime, cuBLAS and cuSOLVER calls: failures throw shadowkv::cuda_error naming the call,
// file and line; allocation failures throw shadowkv::out_of_memory.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include "shadowkv/errors.hpp"

namespace shadowkv::cuda::detail {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* expression, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expression, const char* file, int line);
[[noreturn]] void throw_cusolver_error(cusolverStatus_t status, const char* expression, const char* file, int line);

}  // namespace shadowkv::cuda::detail

#define SHADOWKV_CUDA_TRY(expression)                                                                  \
  do {                                                                                                 \
    const cudaError_t shadowkv_status_ = (expression);                                                 \
    if (shadowkv_status_ != cudaSuccess) {                                                             \
      ::shadowkv::cuda::detail::throw_cuda_error(shadowkv_status_, #expression, __FILE__, __LINE__);   \
    }                                                                                                  \
  } while (0)

#define SHADOWKV_CUBLAS_TRY(expression)                                                                \
  do {                                                                                                 \
    const cublasStatus_t shadowkv_status_ = (expression);                                              \
    if (shadowkv_status_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      ::shadowkv::cuda::detail::throw_cublas_error(shadowkv_status_, #expression, __FILE__, __LINE__); \
    }                                                                                                  \
  } while (0)

#define SHADOWKV_CUSOLVER_TRY(expression)                                                                \
  do {                                                                                                   \
    const cusolverStatus_t shadowkv_status_ = (expression);                                              \
    if (shadowkv_status_ != CUSOLVER_STATUS_SUCCESS) {                                                   \
      ::shadowkv::cuda::detail::throw_cusolver_error(shadowkv_status_, #expression, __FILE__, __LINE__); \
    }                                                                                                    \
  } while (0)

/// Checks the last kernel launch.
#define SHADOWKV_CUDA_CHECK_LAUNCH() SHADOWKV_CUDA_TRY(cudaGetLastError())
