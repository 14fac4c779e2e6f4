// A CUDA stream the caller owns, as the store's options take it (rmm's cuda_stream_view, without the CUDA runtime in
// this header: a CPU-only build of the library and its callers never include cuda_runtime.h).
#pragma once

#include <cstdint>
#include <type_traits>

namespace shadowkv {

/// A cudaStream_t the caller owns: the store orders its work on it and never creates, synchronises or destroys it.
/// Default: the legacy default stream (handle 0).
class stream_view {
 public:
  constexpr stream_view() noexcept = default;
  /// From a cudaStream_t (a pointer type), e.g. `stream_view(stream)`.
  template <typename Stream, typename = std::enable_if_t<std::is_pointer_v<Stream>>>
  explicit stream_view(Stream stream) noexcept : handle_(reinterpret_cast<std::uintptr_t>(stream)) {}
  /// From the integer form of a handle (Python's `torch.cuda.Stream.cuda_stream`; 0 = the legacy default stream).
  [[nodiscard]] static constexpr stream_view from_integer(std::uintptr_t handle) noexcept {
    stream_view view;
    view.handle_ = handle;
    return view;
  }
  /// The handle, to be cast back to cudaStream_t where the CUDA runtime is included.
  [[nodiscard]] constexpr std::uintptr_t handle() const noexcept { return handle_; }
  [[nodiscard]] constexpr bool is_legacy_default() const noexcept { return handle_ == 0; }

 private:
  std::uintptr_t handle_ = 0;
};

}  // namespace shadowkv
