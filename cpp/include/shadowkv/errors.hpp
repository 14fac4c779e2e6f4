// Exceptions thrown by shadowkv_core and the macros that raise them.
//
// Every exception derives from a std:: type so that bindings map it naturally:
//   invalid_argument -> std::invalid_argument (Python ValueError)
//   capacity_error   -> std::length_error     (Python ValueError)
//   out_of_memory    -> std::bad_alloc        (Python MemoryError)
//   logic_error      -> std::logic_error      (Python RuntimeError; a bug in shadowkv_core)
//   cuda_error       -> std::runtime_error    (Python RuntimeError)
//   io_error         -> std::runtime_error    (Python OSError with its errno: FileNotFoundError, PermissionError, ...)
#pragma once

#include <charconv>
#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace shadowkv {

/// A precondition on an argument or on the store's configuration does not hold.
class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A request would exceed a configured capacity (max_batch, max_seq_len).
class capacity_error : public std::length_error {
 public:
  using std::length_error::length_error;
};

/// An internal invariant does not hold: a bug in shadowkv_core, never the caller's fault.
class logic_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// A CUDA runtime, cuBLAS or cuSOLVER call failed.
class cuda_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A file could not be read or written (kv_store::save / load): `code()` is the errno of the failed call (0 when
/// there was none, e.g. a short read) and `path()` the file it concerns.
class io_error : public std::runtime_error {
 public:
  io_error(int code, std::string path, const std::string& message)
      : std::runtime_error(message), code_(code), path_(std::move(path)) {}
  [[nodiscard]] int code() const noexcept { return code_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  int code_;
  std::string path_;
};

/// An allocation failed; the message names the requested and the available bytes.
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string message) : message_(std::move(message)) {}
  [[nodiscard]] const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

namespace detail {

// Message text without iostreams: an ostream operator<< compiled into this library (e.g. instantiated by nvcc's
// front end, which does not keep libstdc++'s extern templates) crashed the Python module on the H200 image while
// formatting a number, because two copies of the stream machinery then disagree about the locale's facets.
inline void append_to(std::string& out, std::string_view text) { out.append(text); }
inline void append_to(std::string& out, const char* text) { out.append(text != nullptr ? text : "(null)"); }
inline void append_to(std::string& out, const std::string& text) { out.append(text); }
inline void append_to(std::string& out, char character) { out.push_back(character); }
inline void append_to(std::string& out, bool value) { out.append(value ? "true" : "false"); }
template <typename Number, std::enable_if_t<std::is_arithmetic_v<Number>, int> = 0>
void append_to(std::string& out, Number value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, result.ptr);
}

/// Joins any number of values into one string: format_message("rank ", r, " > ", n). Numbers are written with
/// std::to_chars (shortest round-trip form for floating point).
template <typename... Parts>
std::string format_message(const Parts&... parts) {
  std::string message;
  (append_to(message, parts), ...);
  return message;
}

}  // namespace detail
}  // namespace shadowkv

/// Throws shadowkv::invalid_argument with the streamed message when `condition` is false.
#define SHADOWKV_EXPECTS(condition, ...)                                                     \
  do {                                                                                       \
    if (!(condition)) {                                                                      \
      throw ::shadowkv::invalid_argument(::shadowkv::detail::format_message(__VA_ARGS__));   \
    }                                                                                        \
  } while (0)

/// Throws shadowkv::capacity_error with the streamed message when `condition` is false.
#define SHADOWKV_EXPECTS_CAPACITY(condition, ...)                                            \
  do {                                                                                       \
    if (!(condition)) {                                                                      \
      throw ::shadowkv::capacity_error(::shadowkv::detail::format_message(__VA_ARGS__));     \
    }                                                                                        \
  } while (0)

/// Throws shadowkv::logic_error naming the failed invariant, file and line.
#define SHADOWKV_ASSERT(condition)                                                           \
  do {                                                                                       \
    if (!(condition)) {                                                                      \
      throw ::shadowkv::logic_error(::shadowkv::detail::format_message(                      \
          "shadowkv internal error: ", #condition, " failed at ", __FILE__, ":", __LINE__)); \
    }                                                                                        \
  } while (0)
