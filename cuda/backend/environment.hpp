// The one environment variable the library reads (docs/api.md, "Environment variables"). Every other choice of the
// CUDA backend is made from the store's shapes, the batch and the device (pipeline_plan.cpp).
#pragma once

#include <optional>

namespace shadowkv::cuda {

/// SHADOWKV_FETCH_CTAS: the value fetch's CTAs when values cross PCIe, for a GPU whose link or multiprocessor count
/// the default (fetch_ctas_for_host_values) was not tuned on. nullopt when unset or empty; throws invalid_argument,
/// naming the variable, for anything but an integer in [1, 65535]. Read when a store is constructed.
std::optional<int> fetch_ctas_from_environment();

}  // namespace shadowkv::cuda
