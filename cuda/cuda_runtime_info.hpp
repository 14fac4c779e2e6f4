// Facts about the CUDA runtime that host code may ask without a GPU present, and the check that a GPU can run this
// build's kernels.
#pragma once

#include <string>
#include <vector>

namespace shadowkv::detail {

/// Number of CUDA devices visible now; 0 when there is no driver or no device (never throws).
int cuda_device_count() noexcept;

/// The CUDA architectures this build's kernels were compiled for, in CMake's syntax (e.g. {"90a-real",
/// "90-virtual"}; CMake's keywords such as "native" resolved); empty when the build could not record them.
std::vector<std::string> compiled_cuda_architectures();

/// Throws invalid_argument when device `device_index` cannot run this build's kernels: its compute capability is
/// below 8.0, or compiled_cuda_architectures() has no machine code or PTX for it, or the CUDA runtime finds no
/// kernel image for it. The message names the GPU, its compute capability, the build's architectures and how to
/// rebuild. Other CUDA failures throw cuda_error. Leaves the caller's current device as it was.
void check_cuda_architecture(int device_index);

}  // namespace shadowkv::detail
