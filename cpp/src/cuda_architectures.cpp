#include "cuda_architectures.hpp"

#include <cctype>

#include "shadowkv/errors.hpp"

namespace shadowkv::detail {
namespace {

bool ends_with(std::string_view text, std::string_view tail) {
  return text.size() >= tail.size() && text.substr(text.size() - tail.size()) == tail;
}

std::string joined(const std::vector<std::string>& entries) {
  std::string out;
  for (const std::string& entry : entries) {
    if (!out.empty()) out.push_back(';');
    out.append(entry);
  }
  return out;
}

std::string capability(int major, int minor) { return format_message(major, '.', minor); }

/// "sm_90a machine code for 9.0 only", "compute_90 PTX, JIT-compiled for 9.0 and newer", ...
std::string describe(const cuda_architecture& arch) {
  const std::string number = format_message(arch.major, arch.minor);
  const std::string suffix = arch.suffix == '\0' ? std::string() : std::string(1, arch.suffix);
  const std::string cc = capability(arch.major, arch.minor);
  const std::string same_major = format_message(cc, " and later ", arch.major, ".x");
  std::string out;
  if (arch.machine_code) {
    out += format_message("sm_", number, suffix, " machine code for ", arch.suffix == 'a' ? cc + " only" : same_major);
  }
  if (arch.ptx) {
    if (!out.empty()) out += "; ";
    const std::string where = arch.suffix == 'a'   ? "for " + cc + " only"
                              : arch.suffix == 'f' ? "for " + same_major
                                                   : "JIT-compiled for " + cc + " and newer";
    out += format_message("compute_", number, suffix, " PTX, ", where);
  }
  return out;
}

std::string describe(const std::vector<std::string>& built) {
  std::string out;
  for (const std::string& entry : built) {
    if (!out.empty()) out += "; ";
    try {
      out += describe(parse_cuda_architecture(entry));
    } catch (const invalid_argument&) {
      out += entry;
    }
  }
  return out;
}

/// A list for every GPU the kernels support (sm_80 machine code runs on every 8.x) with machine code for major.minor.
std::string several_gpus(int major, int minor) {
  const std::string target = cuda_architecture_for(major, minor);
  if (major == 8 && minor != 0) return "80-real;" + target + "-real;90a-real;90-virtual";
  if (major >= 10) return "80-real;90a-real;" + target + "-real;90-virtual";
  return "80-real;90a-real;90-virtual";
}

}  // namespace

cuda_architecture parse_cuda_architecture(std::string_view entry) {
  const std::string_view original = entry;
  cuda_architecture arch;
  if (ends_with(entry, "-real")) {
    arch.ptx = false;
    entry.remove_suffix(5);
  } else if (ends_with(entry, "-virtual")) {
    arch.machine_code = false;
    entry.remove_suffix(8);
  }
  if (!entry.empty() && (entry.back() == 'a' || entry.back() == 'f')) {
    arch.suffix = entry.back();
    entry.remove_suffix(1);
  }
  bool digits = entry.size() >= 2 && entry.size() <= 4;
  for (const char c : entry) digits = digits && std::isdigit(static_cast<unsigned char>(c)) != 0;
  SHADOWKV_EXPECTS(digits && entry.front() != '0', "'", original,
                   "' is not a CUDA architecture: expected a compute capability without its dot (e.g. 80, 90, 120),"
                   " optionally followed by 'a' or 'f', then optionally by -real or -virtual");
  int number = 0;
  for (const char c : entry) number = number * 10 + (c - '0');
  arch.major = number / 10;
  arch.minor = number % 10;
  return arch;
}

std::vector<std::string> split_cuda_architectures(std::string_view list) {
  std::vector<std::string> entries;
  std::string current;
  for (const char c : list) {
    if (c == ';' || c == ',' || std::isspace(static_cast<unsigned char>(c)) != 0) {
      if (!current.empty()) entries.push_back(current);
      current.clear();
    } else {
      current.push_back(c);
    }
  }
  if (!current.empty()) entries.push_back(current);
  return entries;
}

bool cuda_architecture_runs_on(const cuda_architecture& arch, int major, int minor) {
  if (arch.suffix == 'a') return major == arch.major && minor == arch.minor;
  const bool same_major_and_newer = major == arch.major && minor >= arch.minor;
  if (arch.suffix == 'f') return same_major_and_newer;
  if (arch.machine_code && same_major_and_newer) return true;
  return arch.ptx && (major > arch.major || same_major_and_newer);
}

bool cuda_architectures_cover(const std::vector<std::string>& built, int major, int minor) {
  bool covered = false;
  for (const std::string& entry : built) {
    const cuda_architecture arch = parse_cuda_architecture(entry);  // every entry is checked, not only up to a match
    covered = covered || cuda_architecture_runs_on(arch, major, minor);
  }
  return covered;
}

std::string cuda_architecture_for(int major, int minor) {
  if (major == 9 && minor == 0) return "90a";
  return format_message(major, minor);
}

std::string cuda_architecture_mismatch(int device_index, std::string_view gpu_name, int major, int minor,
                                       const std::vector<std::string>& built, std::string_view runtime_detail) {
  const std::string cc = capability(major, minor);
  const std::string gpu = format_message("cuda:", device_index, " (", gpu_name, ", compute capability ", cc, ")");
  if (major < kMinCudaMajor) {
    return format_message(gpu, " cannot run the CUDA kernels of shadowkv_core: they need compute capability ",
                          kMinCudaMajor, ".0 or newer (cp.async and CUTLASS's SM80 tensor-core instructions); use "
                          "device=\"cpu\"");
  }
  const bool covered = cuda_architectures_cover(built, major, minor);
  // With no list recorded, only the runtime's answer can say no.
  if (runtime_detail.empty() && (covered || built.empty())) return {};

  const std::string target = cuda_architecture_for(major, minor);
  const std::string rebuild = format_message(
      "Rebuild for this GPU: SHADOWKV_CUDA_ARCHITECTURES=", target,
      " pip install . (the same environment variable works for bash tests/run.sh; with CMake, "
      "-DSHADOWKV_CUDA_ARCHITECTURES=", target, " or -DCMAKE_CUDA_ARCHITECTURES=", target,
      "), or build on a machine where this GPU is visible, which targets it by default; a list such as \"",
      several_gpus(major, minor),
      "\" covers several GPUs (each -real entry compiles the kernels once more)");
  std::string what;
  if (built.empty()) {
    what = "this build did not record its CUDA architectures (CMAKE_CUDA_ARCHITECTURES was off or not a list)";
  } else {
    what = format_message("its CUDA kernels were compiled for the CUDA architectures \"", joined(built), "\" (",
                          describe(built), ")");
  }
  if (!built.empty() && !covered) {
    return format_message(gpu, " cannot run this build of shadowkv_core: ", what, ", none of which runs on ", cc,
                          ". ", rebuild);
  }
  return format_message(gpu, " cannot run this build of shadowkv_core: ", what,
                        ", but the CUDA runtime found no code it can run there: ", runtime_detail,
                        ". If the build has only PTX for this GPU, the driver may be older than the CUDA toolkit "
                        "that compiled it (update the driver). ",
                        rebuild);
}

}  // namespace shadowkv::detail
