#include "memory_resources.hpp"

#include "cuda_check.hpp"

namespace shadowkv::cuda {

void* device_memory_resource::allocate(std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  // No cudaMemGetInfo before the allocation: it ignores what the stream-ordered pool already holds (a request the
  // pool can serve was refused when the device's free bytes were fewer), and it costs a driver call on every
  // allocation. The free bytes are asked only to word the error.
  void* pointer = nullptr;
  const cudaError_t status = cudaMallocAsync(&pointer, bytes, stream);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    const bool known = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    (void)cudaGetLastError();
    throw out_of_memory(known ? shadowkv::detail::format_message("cannot allocate ", bytes, " bytes on cuda:", device_,
                                                                 ": ", free_bytes, " of ", total_bytes,
                                                                 " bytes are free")
                              : shadowkv::detail::format_message("cannot allocate ", bytes, " bytes on cuda:",
                                                                 device_));
  }
  SHADOWKV_CUDA_TRY(status);
  return pointer;
}

void device_memory_resource::deallocate(void* pointer, std::size_t /*bytes*/, cudaStream_t stream) noexcept {
  if (pointer != nullptr) (void)cudaFreeAsync(pointer, stream);
}

void* pinned_host_resource::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* pointer = nullptr;
  const cudaError_t status = cudaHostAlloc(&pointer, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw out_of_memory(shadowkv::detail::format_message("cannot allocate ", bytes,
                                                         " bytes of pinned host memory for the value store"));
  }
  SHADOWKV_CUDA_TRY(status);
  return pointer;
}

void pinned_host_resource::deallocate(void* pointer, std::size_t /*bytes*/) noexcept {
  if (pointer != nullptr) (void)cudaFreeHost(pointer);
}

device_buffer::device_buffer(std::size_t bytes, cudaStream_t stream, device_memory_resource& resource)
    : data_(resource.allocate(bytes, stream)), size_(bytes), stream_(stream), resource_(&resource) {}

device_buffer::~device_buffer() { release(stream_); }

void device_buffer::release(cudaStream_t stream) noexcept {
  if (resource_ != nullptr && data_ != nullptr) resource_->deallocate(data_, size_, stream);
  data_ = nullptr;
  size_ = 0;
}

host_buffer::host_buffer(std::size_t bytes, pinned_host_resource& resource)
    : data_(resource.allocate(bytes)), size_(bytes), resource_(&resource) {
  if (data_ != nullptr) {
    const cudaError_t status = cudaHostGetDevicePointer(&device_pointer_, data_, 0);
    if (status != cudaSuccess) {
      resource.deallocate(data_, bytes);
      data_ = nullptr;
      SHADOWKV_CUDA_TRY(status);
    }
  }
}

host_buffer::~host_buffer() {
  if (resource_ != nullptr) resource_->deallocate(data_, size_);
}

}  // namespace shadowkv::cuda
