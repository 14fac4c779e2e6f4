// The low-rank factors' bf16 format on the device (config::factor_dtype(); docs/semantics.md, "Low-rank factors").
#pragma once

#include <cuda_runtime.h>

namespace shadowkv::cuda {

/// Rounds `count` float32 factor elements to bf16 (nearest even) into `target`. With `round_source`, `source` is
/// overwritten with the rounded values as well, so that a projection onto B uses B as the store holds it.
void launch_factors_to_bf16(float* source, long long count, void* target, bool round_source, cudaStream_t stream);

}  // namespace shadowkv::cuda
