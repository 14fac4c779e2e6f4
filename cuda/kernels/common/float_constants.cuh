// Float constants the kernels share (one definition each).
#pragma once

namespace shadowkv::cuda {

/// -inf as a constant expression: the empty softmax partial's max and the logit of a non-candidate chunk.
constexpr float kNegativeInfinity = -__builtin_huge_valf();
/// log2(e): exp(x) = exp2(x * kLog2e), so that softmax arguments can be kept in log2 units.
constexpr float kLog2e = 1.4426950408889634F;

}  // namespace shadowkv::cuda
