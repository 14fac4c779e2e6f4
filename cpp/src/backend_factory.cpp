#include <memory>

#include "cpu_backend.hpp"
#include "shadowkv/backend.hpp"
#include "shadowkv/build_info.hpp"
#include "shadowkv/errors.hpp"

#ifdef SHADOWKV_WITH_CUDA
#include "cuda_runtime_info.hpp"
#endif

namespace shadowkv {

std::unique_ptr<backend> make_backend(const config& cfg, device where) {
  if (where.type == device_type::cpu) return std::make_unique<detail::cpu_backend>(cfg);
  throw invalid_argument(detail::format_message(
      "no backend for device '", to_string(where),
      "' in this build: the CUDA backend is not implemented yet (build_info() lists the available backends)"));
}

build_info get_build_info() {
  build_info info;
  info.version = SHADOWKV_VERSION;
  info.backends = {"cpu"};
  info.blas = SHADOWKV_BLAS_NAME;
#ifdef SHADOWKV_WITH_CUDA
  info.cuda_compiled = true;
  info.cuda_devices = detail::cuda_device_count();
#endif
  return info;
}

}  // namespace shadowkv
