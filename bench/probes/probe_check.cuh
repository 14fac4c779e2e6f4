// The CUDA error check of the stand-alone probes in bench/probes (built with nvcc alone, outside the library): a failed
// call prints itself, the error and the line, and ends the probe.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                                        \
  do {                                                                                                  \
    const cudaError_t status_ = (x);                                                                    \
    if (status_ != cudaSuccess) {                                                                       \
      std::printf("%s failed: %s at line %d\n", #x, cudaGetErrorString(status_), __LINE__);            \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)
