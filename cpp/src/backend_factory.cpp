#include <memory>

#include "cpu_backend.hpp"
#include "shadowkv/backend.hpp"
#include "shadowkv/build_info.hpp"
#include "shadowkv/errors.hpp"

#ifdef SHADOWKV_WITH_CUDA
#include "cuda_backend.hpp"
#include "cuda_runtime_info.hpp"
#endif

namespace shadowkv {

// The store asks supports_extend / supports_truncate before it calls these, so reaching them is a store bug.
void backend::extend_block(int /*layer*/, std::span<const batch_entry> /*entries*/, const block_inputs& /*inputs*/,
                           const mutable_tensor_view& /*out*/) {
  throw invalid_argument(detail::format_message("the ", to_string(where()),
                                                " backend cannot extend by more than one token per call"));
}

void backend::truncate_generated(int /*layer*/, std::span<const batch_entry> /*entries*/,
                                 std::span<const layer_state> /*targets*/) {
  throw invalid_argument(detail::format_message("the ", to_string(where()), " backend cannot truncate sequences"));
}

namespace {
[[noreturn]] void no_keeping(const backend& b) {
  throw invalid_argument(detail::format_message("the ", to_string(b.where()),
                                                " backend cannot fork, park or save sequences"));
}
}  // namespace

void backend::fork_sequence(int /*source*/, std::span<const int> /*children*/, std::span<const layer_state> /*layers*/) {
  no_keeping(*this);
}
std::unique_ptr<parked_state> backend::park_sequence(int /*slot*/, std::span<const layer_state> /*layers*/) {
  no_keeping(*this);
}
// park_sequence never returns an object here: there is nothing to undo.
void backend::unpark_sequence(int /*slot*/, parked_state& /*parked*/) noexcept {}
void backend::resume_sequence(int /*slot*/, parked_state& /*parked*/, std::span<const layer_state> /*layers*/) {
  no_keeping(*this);
}
void backend::unresume_sequence(int /*slot*/, parked_state& /*parked*/) noexcept {}
std::vector<state_section> backend::state_sections(std::span<const layer_state> /*layers*/) const { no_keeping(*this); }
void backend::write_state(int /*slot*/, std::span<const layer_state> /*layers*/, const state_sink& /*sink*/) const {
  no_keeping(*this);
}
void backend::read_state(int /*slot*/, value_place /*values_on*/, std::span<const layer_state> /*layers*/,
                         std::span<const std::span<const std::byte>> /*sections*/) {
  no_keeping(*this);
}

std::unique_ptr<backend> make_backend(const config& cfg, device where) {
  if (where.type == device_type::cpu) return std::make_unique<detail::cpu_backend>(cfg);
#ifdef SHADOWKV_WITH_CUDA
  return std::make_unique<cuda::cuda_backend>(cfg, where.index);
#else
  throw invalid_argument(detail::format_message(
      "no backend for device '", to_string(where),
      "' in this build: it was compiled without CUDA (build_info() lists the available backends)"));
#endif
}

build_info get_build_info() {
  build_info info;
  info.version = SHADOWKV_VERSION;
  info.backends = {"cpu"};
  info.blas = SHADOWKV_BLAS_NAME;
#ifdef SHADOWKV_WITH_CUDA
  info.cuda_compiled = true;
  info.cuda_backend = true;
  info.backends.push_back("cuda");
  info.cuda_devices = detail::cuda_device_count();
  info.cuda_architectures = detail::compiled_cuda_architectures();
#endif
  return info;
}

}  // namespace shadowkv
