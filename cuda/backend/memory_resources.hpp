// Memory resources and RAII buffers of the CUDA backend (in the style of rmm).
//
// device_memory_resource: stream-ordered device allocations through CUDA's own pool allocator (cudaMallocAsync), so
//   prefill workspaces are recycled without a device synchronisation.
// pinned_host_resource: page-locked, device-mapped host memory for the value store (a kernel can read it directly).
// device_buffer / host_buffer: owners of one allocation; non-copyable, movable; destructors never throw.
// Allocation checks free device memory first and throws shadowkv::out_of_memory naming requested and available
// bytes, before anything is allocated.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

namespace shadowkv::cuda {

class device_memory_resource {
 public:
  explicit device_memory_resource(int device) : device_(device) {}
  /// Allocates `bytes` ordered on `stream`. Throws out_of_memory (with requested/available bytes) or cuda_error.
  void* allocate(std::size_t bytes, cudaStream_t stream);
  /// Frees `pointer` ordered on `stream`; never throws.
  void deallocate(void* pointer, std::size_t bytes, cudaStream_t stream) noexcept;
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  int device_;
};

class pinned_host_resource {
 public:
  /// Allocates page-locked, device-mapped host memory. Throws out_of_memory naming the request.
  void* allocate(std::size_t bytes);
  void deallocate(void* pointer, std::size_t bytes) noexcept;
};

/// One device allocation.
class device_buffer {
 public:
  device_buffer() = default;
  device_buffer(std::size_t bytes, cudaStream_t stream, device_memory_resource& resource);
  ~device_buffer();
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& other) noexcept { swap(other); }
  device_buffer& operator=(device_buffer&& other) noexcept {
    device_buffer moved(std::move(other));
    swap(moved);
    return *this;
  }

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Frees now, ordered on `stream` (the stream that last used the memory).
  void release(cudaStream_t stream) noexcept;

 private:
  void swap(device_buffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(stream_, other.stream_);
    std::swap(resource_, other.resource_);
  }
  void* data_ = nullptr;
  std::size_t size_ = 0;
  cudaStream_t stream_ = nullptr;
  device_memory_resource* resource_ = nullptr;
};

/// One pinned, mapped host allocation; `device_pointer()` is its address as kernels see it.
class host_buffer {
 public:
  host_buffer() = default;
  host_buffer(std::size_t bytes, pinned_host_resource& resource);
  ~host_buffer();
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  host_buffer(host_buffer&& other) noexcept { swap(other); }
  host_buffer& operator=(host_buffer&& other) noexcept {
    host_buffer moved(std::move(other));
    swap(moved);
    return *this;
  }

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] void* device_pointer() const noexcept { return device_pointer_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  void swap(host_buffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(device_pointer_, other.device_pointer_);
    std::swap(size_, other.size_);
    std::swap(resource_, other.resource_);
  }
  void* data_ = nullptr;
  void* device_pointer_ = nullptr;
  std::size_t size_ = 0;
  pinned_host_resource* resource_ = nullptr;
};

}  // namespace shadowkv::cuda
