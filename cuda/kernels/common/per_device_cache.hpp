// Host-side answers kept per device: attribute and occupancy queries cost a slow path on every launch, and a cache
// per process only would give a second, different GPU the first one's numbers.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "cuda_check.hpp"

namespace shadowkv::cuda {

/// Values computed once per (current device ordinal, key) and kept for the process. Thread-safe: the value is
/// computed under the lock, so concurrent first calls compute it once (and host-side attributes the computation sets
/// are never seen half-set). A computation that throws stores nothing. Key needs operator<.
template <typename Value, typename Key = int>
class per_device_cache {
 public:
  /// The value of (current device, key); `compute(device, key)` makes it on the first call for that pair.
  template <typename Compute>
  Value get(const Key& key, Compute&& compute) {
    int device = 0;
    SHADOWKV_CUDA_TRY(cudaGetDevice(&device));
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = known_.find({device, key});
    if (found != known_.end()) return found->second;
    const Value value = compute(device, key);
    known_.emplace(std::make_pair(device, key), value);
    return value;
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<int, Key>, Value> known_;
};

}  // namespace shadowkv::cuda
