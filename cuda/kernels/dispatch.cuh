// Runtime element type -> template parameter.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "device_layout.cuh"
#include "shadowkv/errors.hpp"

/// Calls `body` (a generic lambda taking a T* tag) with T = float, __half or __nv_bfloat16 for `kv_type`.
template <typename Body>
void shadowkv_dispatch_element(int kv_type, Body&& body) {
  switch (kv_type) {
    case shadowkv::cuda::element_f32: body(static_cast<float*>(nullptr)); return;
    case shadowkv::cuda::element_f16: body(static_cast<__half*>(nullptr)); return;
    case shadowkv::cuda::element_bf16: body(static_cast<__nv_bfloat16*>(nullptr)); return;
    default: break;
  }
  throw shadowkv::invalid_argument(shadowkv::detail::format_message("unknown element type code ", kv_type));
}

/// Lets `kernel` use up to the device's opt-in shared memory per block. Call it from a function-local static
/// initialiser so that it runs once per kernel, not on every launch (attributes on every launch are a slow path).
template <typename Kernel>
bool shadowkv_allow_max_shared_memory(Kernel kernel) {
  int device = 0;
  int optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}
