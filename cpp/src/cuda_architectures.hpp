// CUDA architecture lists (CMake's CUDA_ARCHITECTURES syntax) and whether a list has code for a GPU. Host code with
// no CUDA dependency: the CUDA backend's construction-time check uses it (cuda/cuda_runtime_info.cu), and
// tests/cpp/test_cuda_architectures.cpp tests it in every build, with or without a GPU.
//
// Which code runs where (CUDA C++ Programming Guide, "Binary Compatibility" and "PTX Compatibility"):
//   machine code (SASS) for sm_XY  runs on compute capability X.z with z >= Y (same major);
//   PTX for compute_XY              is JIT-compiled by the driver for any compute capability >= X.Y;
//   arch-specific sm_XYa/compute_XYa (e.g. 90a: Hopper's wgmma/setmaxnreg) run on exactly X.Y, neither forward nor
//   across the family;
//   family-specific sm_XYf/compute_XYf run on X.z with z >= Y (same major).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace shadowkv::detail {

/// One entry of a CUDA_ARCHITECTURES list, e.g. "90a-real": compute capability 9.0, arch-specific, machine code.
struct cuda_architecture {
  int major = 0;
  int minor = 0;
  char suffix = '\0';        ///< 'a' (arch-specific), 'f' (family-specific) or '\0'
  bool machine_code = true;  ///< SASS for sm_<major><minor><suffix>: "-real", or no qualifier
  bool ptx = true;           ///< PTX for compute_<major><minor><suffix>: "-virtual", or no qualifier
};

/// Parses one entry: the compute capability as digits (the last one is the minor version: "90" = 9.0, "120" = 12.0),
/// then optionally 'a' or 'f', then optionally "-real" or "-virtual" (neither: both, as CMake reads it).
/// Throws invalid_argument for anything else (CMake's keywords "native", "all", "all-major" included: the build
/// records the list they resolve to).
cuda_architecture parse_cuda_architecture(std::string_view entry);

/// Splits a list on ';', ',' or whitespace, dropping empty entries.
std::vector<std::string> split_cuda_architectures(std::string_view list);

/// Whether code built for `arch` runs on a GPU of compute capability major.minor (see the table at the top).
bool cuda_architecture_runs_on(const cuda_architecture& arch, int major, int minor);

/// Whether any entry of `built` runs on a GPU of compute capability major.minor. Throws invalid_argument for an
/// entry parse_cuda_architecture rejects.
bool cuda_architectures_cover(const std::vector<std::string>& built, int major, int minor);

/// The list entry to build for a GPU of compute capability major.minor: "90a" for 9.0 (Hopper's arch-specific
/// target, what the default build uses there), "<major><minor>" otherwise.
std::string cuda_architecture_for(int major, int minor);

/// Lowest compute capability the CUDA kernels run on (cp.async, CUTLASS's SM80 MMA atoms).
inline constexpr int kMinCudaMajor = 8;

/// Why a build compiled for `built` cannot run on device cuda:`device_index` (`gpu_name`, compute capability
/// major.minor), naming the GPU, its compute capability, the build's architectures and how to rebuild; empty when
/// it can. `runtime_detail`, when not empty, is what the CUDA runtime said (e.g. no kernel image for the device),
/// and makes the answer "cannot" even where the list looks as if it covered the GPU.
std::string cuda_architecture_mismatch(int device_index, std::string_view gpu_name, int major, int minor,
                                       const std::vector<std::string>& built, std::string_view runtime_detail = {});

}  // namespace shadowkv::detail
