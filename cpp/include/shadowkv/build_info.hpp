// What this build of shadowkv_core contains.
#pragma once

#include <string>
#include <vector>

namespace shadowkv {

struct build_info {
  std::string version;                ///< library version, e.g. "0.1.0"
  bool cuda_compiled = false;         ///< the CUDA sources were compiled into this build
  bool cuda_backend = false;          ///< device="cuda" stores are available
  int cuda_devices = 0;               ///< CUDA devices visible now (0 without CUDA or without a GPU)
  std::vector<std::string> backends;  ///< devices a store can be created on, e.g. {"cpu"}
  std::string blas;                   ///< the BLAS/LAPACK the CPU backend links
  /// CUDA architectures the kernels were compiled for, in CMake's syntax (e.g. {"90a-real", "90-virtual"}: sm_90a
  /// machine code and compute_90 PTX); empty without CUDA. A store on a GPU none of them runs on is rejected.
  std::vector<std::string> cuda_architectures;
};

/// Describes this build; cheap, never throws for lack of a GPU.
build_info get_build_info();

}  // namespace shadowkv
