#include "environment.hpp"

#include <cstdlib>

#include "shadowkv/errors.hpp"

namespace shadowkv::cuda {

std::optional<int> fetch_ctas_from_environment() {
  const char* text = std::getenv("SHADOWKV_FETCH_CTAS");
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  SHADOWKV_EXPECTS(*end == '\0' && value >= 1 && value <= 65535,
                   "SHADOWKV_FETCH_CTAS must be an integer in [1, 65535], got '", text, "'");
  return static_cast<int>(value);
}

}  // namespace shadowkv::cuda
