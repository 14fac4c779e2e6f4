// SHADOWKV_HOST_DEVICE: a function compiled for the host (CPU backend, store, tests) and, under nvcc, for the device
// (CUDA kernels) — how a rule of docs/semantics.md is written once for both backends.
#pragma once

#if defined(__CUDACC__)
#define SHADOWKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SHADOWKV_HOST_DEVICE inline
#endif
