// Runtime element type and shapes -> template parameters (the one place each choice is made), and the shared-memory
// opt-in of kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <type_traits>
#include <utility>

#include "cuda_check.hpp"
#include "device_layout.cuh"
#include "shadowkv/errors.hpp"
#include "shape_support.hpp"

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

template <typename Body, std::size_t... kIndex>
bool shadowkv_dispatch_head_dim_in(int head_dim, Body& body, std::index_sequence<kIndex...>) {
  using shadowkv::cuda::kSupportedHeadDims;
  return ((head_dim == kSupportedHeadDims[kIndex]
               ? (body(std::integral_constant<int, kSupportedHeadDims[kIndex]>{}), true)
               : false) ||
          ...);
}

/// Calls `body` (a generic lambda taking a std::integral_constant<int, D>) with D = head_dim, which must be one of
/// kSupportedHeadDims (shape_support.hpp: the list the backend checks stores against, so the kernels are instantiated
/// for exactly those). Throws invalid_argument naming `what` for any other head_dim.
template <typename Body>
void shadowkv_dispatch_head_dim(int head_dim, const char* what, Body&& body) {
  constexpr std::size_t kCount = std::size(shadowkv::cuda::kSupportedHeadDims);
  if (shadowkv_dispatch_head_dim_in(head_dim, body, std::make_index_sequence<kCount>{})) return;
  throw shadowkv::invalid_argument(shadowkv::detail::format_message(what, ": unsupported head_dim ", head_dim));
}

/// Calls `body` (a generic lambda taking a std::integral_constant<int, G_t>) with the query-head tile of a KV head's
/// group of `group` query heads: the group rounded up to a power of two, at most 8 (larger groups loop over tiles of
/// 8). A kernel keeps per-head state of G_t heads in registers or shared memory, so G_t bounds its footprint.
template <typename Body>
void shadowkv_dispatch_head_tile(int group, Body&& body) {
  if (group >= 5) {
    body(std::integral_constant<int, 8>{});
  } else if (group >= 3) {
    body(std::integral_constant<int, 4>{});
  } else if (group == 2) {
    body(std::integral_constant<int, 2>{});
  } else {
    body(std::integral_constant<int, 1>{});
  }
}

/// Lets `kernel` take as much dynamic shared memory as the current device allows per block: the opt-in limit less
/// the kernel's own static shared memory (CUDA rejects a larger value with cudaErrorInvalidValue, and a kernel with
/// static arrays would then launch with the 48 KiB default and fail). Throws on a CUDA error rather than leaving the
/// launch to fail later with a less telling one.
template <typename Kernel>
void shadowkv_allow_max_shared_memory(Kernel kernel) {
  int device = 0;
  int optin = 0;
  cudaFuncAttributes attributes{};
  SHADOWKV_CUDA_TRY(cudaGetDevice(&device));
  SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  SHADOWKV_CUDA_TRY(cudaFuncGetAttributes(&attributes, kernel));
  const int dynamic_limit = optin - static_cast<int>(attributes.sharedSizeBytes);
  SHADOWKV_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_limit));
}

/// Above 48 KiB a kernel needs the opt-in limit. The attribute belongs to each device's copy of the kernel, so it is
/// set once per device (`devices`: a bit per device index, one word per instantiation), not once per process and not
/// on every launch (a slow path); after the first launch on a device this costs a cudaGetDevice.
template <typename Kernel>
void shadowkv_allow_large_shared_memory(Kernel kernel, std::atomic<std::uint64_t>& devices) {
  int device = 0;
  SHADOWKV_CUDA_TRY(cudaGetDevice(&device));
  const std::uint64_t bit = device < 64 ? std::uint64_t{1} << device : 0;  // beyond 64 devices: every launch
  if ((devices.load(std::memory_order_acquire) & bit) != 0) return;
  shadowkv_allow_max_shared_memory(kernel);
  devices.fetch_or(bit, std::memory_order_acq_rel);
}
