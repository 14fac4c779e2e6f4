// What the CUDA kernel tests share: device detection, an owning device buffer, host<->device copies, and the
// element types' host-side rounding/encoding (test code only: the kernels never allocate).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#include "device_layout.cuh"

namespace shadowkv::cuda::testing {

#define CUDA_OK(expression) ASSERT_EQ((expression), cudaSuccess) << #expression

inline bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver: clear the sticky error and report no device
    return false;
  }
  return count > 0;
}

/// A cudaMalloc'ed buffer freed on scope exit.
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&data_, bytes) != cudaSuccess) data_ = nullptr;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) { other.data_ = nullptr; }
  device_buffer& operator=(device_buffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~device_buffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  [[nodiscard]] bool ok() const { return bytes_ == 0 || data_ != nullptr; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Copies `source` to the device and waits until it is there: cudaMemcpy from pageable memory returns once the data is
/// staged, before the legacy stream's DMA lands it, and a kernel on a non-blocking stream does not wait for that DMA.
template <typename T>
cudaError_t upload(const device_buffer& target, const std::vector<T>& source) {
  const cudaError_t copied = cudaMemcpy(target.get(), source.data(), source.size() * sizeof(T), cudaMemcpyHostToDevice);
  return copied != cudaSuccess ? copied : cudaDeviceSynchronize();
}

template <typename T>
cudaError_t download(std::vector<T>& target, const T* source, std::size_t count) {
  target.resize(count);
  return cudaMemcpy(target.data(), source, count * sizeof(T), cudaMemcpyDeviceToHost);
}

inline std::size_t element_bytes(int type) { return type == element_f32 ? 4 : 2; }

inline const char* type_name(int type) {
  return type == element_f16 ? "f16" : (type == element_bf16 ? "bf16" : "f32");
}

/// `value` rounded to the element type and back (round to nearest even).
inline float round_through(int type, float value) {
  switch (type) {
    case element_f16: return __half2float(__float2half_rn(value));
    case element_bf16: return __bfloat162float(__float2bfloat16_rn(value));
    default: return value;
  }
}

/// Writes `value`, rounded to the element type, as element `index` of a byte array of that type.
inline void store_element(int type, std::vector<unsigned char>& bytes, std::size_t index, float value) {
  if (type == element_f16) {
    const __half h = __float2half_rn(value);
    std::memcpy(bytes.data() + index * 2, &h, 2);
  } else if (type == element_bf16) {
    const __nv_bfloat16 h = __float2bfloat16_rn(value);
    std::memcpy(bytes.data() + index * 2, &h, 2);
  } else {
    std::memcpy(bytes.data() + index * 4, &value, 4);
  }
}

/// Element `index` of a byte array of the element type, as float.
inline float load_element(int type, const unsigned char* bytes, std::size_t index) {
  if (type == element_f16) {
    __half h;
    std::memcpy(&h, bytes + index * 2, 2);
    return __half2float(h);
  }
  if (type == element_bf16) {
    __nv_bfloat16 h;
    std::memcpy(&h, bytes + index * 2, 2);
    return __bfloat162float(h);
  }
  float value;
  std::memcpy(&value, bytes + index * 4, 4);
  return value;
}

}  // namespace shadowkv::cuda::testing
