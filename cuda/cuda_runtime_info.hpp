// Facts about the CUDA runtime that host code may ask without a GPU present.
#pragma once

namespace shadowkv::detail {

/// Number of CUDA devices visible now; 0 when there is no driver or no device (never throws).
int cuda_device_count() noexcept;

}  // namespace shadowkv::detail
