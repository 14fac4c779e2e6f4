// The value store's fp8 format on the device (shadowkv/fp8.hpp holds the rule, shared with the CPU backend).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_layout.cuh"

namespace shadowkv::cuda {

/// Quantizes `runs` consecutive runs of `run` values (T = the store's dtype, kv_type) into e4m3 codes
/// [runs, run] and one float32 scale per run (amax / 448), on `stream`. One warp per run.
void launch_quantize_value_runs(int kv_type, const void* values, long long runs, int run, std::uint8_t* codes,
                                float* scales, cudaStream_t stream);

}  // namespace shadowkv::cuda
