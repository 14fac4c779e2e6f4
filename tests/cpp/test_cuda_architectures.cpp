// CUDA architecture lists and whether they have code for a GPU (cpp/src/cuda_architectures.hpp): the logic behind
// the check at KVStore(device="cuda:N"). Host-only; runs in every build.
#include "cuda_architectures.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shadowkv/build_info.hpp"
#include "shadowkv/errors.hpp"

namespace {

using shadowkv::detail::cuda_architecture;
using shadowkv::detail::cuda_architecture_for;
using shadowkv::detail::cuda_architecture_mismatch;
using shadowkv::detail::cuda_architecture_runs_on;
using shadowkv::detail::cuda_architectures_cover;
using shadowkv::detail::parse_cuda_architecture;
using shadowkv::detail::split_cuda_architectures;

const std::vector<std::string> kHopperDefault = {"90a-real", "90-virtual"};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(CudaArchitectures, ParsesCMakeEntries) {
  const cuda_architecture hopper = parse_cuda_architecture("90a-real");
  EXPECT_EQ(hopper.major, 9);
  EXPECT_EQ(hopper.minor, 0);
  EXPECT_EQ(hopper.suffix, 'a');
  EXPECT_TRUE(hopper.machine_code);
  EXPECT_FALSE(hopper.ptx);

  const cuda_architecture ptx = parse_cuda_architecture("90-virtual");
  EXPECT_EQ(ptx.suffix, '\0');
  EXPECT_FALSE(ptx.machine_code);
  EXPECT_TRUE(ptx.ptx);

  const cuda_architecture both = parse_cuda_architecture("86");  // no qualifier: CMake builds SASS and PTX
  EXPECT_EQ(both.major, 8);
  EXPECT_EQ(both.minor, 6);
  EXPECT_TRUE(both.machine_code);
  EXPECT_TRUE(both.ptx);

  const cuda_architecture blackwell = parse_cuda_architecture("120f");
  EXPECT_EQ(blackwell.major, 12);
  EXPECT_EQ(blackwell.minor, 0);
  EXPECT_EQ(blackwell.suffix, 'f');
}

TEST(CudaArchitectures, RejectsWhatIsNotAnEntry) {
  for (const char* bad : {"", "native", "all-major", "sm_90", "9.0", "90-real-virtual", "90b", "-real", "090", "8"}) {
    EXPECT_THROW((void)parse_cuda_architecture(bad), shadowkv::invalid_argument) << bad;
  }
  EXPECT_THROW((void)cuda_architectures_cover({"90a-real", "native"}, 9, 0), shadowkv::invalid_argument);
}

TEST(CudaArchitectures, SplitsOnSemicolonsCommasAndSpaces) {
  EXPECT_EQ(split_cuda_architectures("90a-real;90-virtual"), kHopperDefault);
  EXPECT_EQ(split_cuda_architectures("90a-real,90-virtual"), kHopperDefault);
  EXPECT_EQ(split_cuda_architectures(" 90a-real  90-virtual ;"), kHopperDefault);
  EXPECT_TRUE(split_cuda_architectures("").empty());
}

TEST(CudaArchitectures, MachineCodeRunsOnTheSameMajorFromItsMinor) {
  const cuda_architecture ampere = parse_cuda_architecture("80-real");
  EXPECT_TRUE(cuda_architecture_runs_on(ampere, 8, 0));   // A100
  EXPECT_TRUE(cuda_architecture_runs_on(ampere, 8, 6));   // RTX 30xx, A10
  EXPECT_TRUE(cuda_architecture_runs_on(ampere, 8, 9));   // L4, RTX 40xx
  EXPECT_FALSE(cuda_architecture_runs_on(ampere, 9, 0));  // no SASS across majors
  const cuda_architecture ada = parse_cuda_architecture("89-real");
  EXPECT_FALSE(cuda_architecture_runs_on(ada, 8, 6));  // not backwards
  EXPECT_TRUE(cuda_architecture_runs_on(ada, 8, 9));
}

TEST(CudaArchitectures, PtxRunsOnItsCapabilityAndNewer) {
  const cuda_architecture ptx = parse_cuda_architecture("90-virtual");
  EXPECT_FALSE(cuda_architecture_runs_on(ptx, 8, 9));
  EXPECT_TRUE(cuda_architecture_runs_on(ptx, 9, 0));
  EXPECT_TRUE(cuda_architecture_runs_on(ptx, 10, 0));  // B200, JIT-compiled
  EXPECT_TRUE(cuda_architecture_runs_on(ptx, 12, 0));  // RTX 50xx
}

TEST(CudaArchitectures, ArchSpecificRunsOnExactlyItsCapability) {
  for (const char* entry : {"90a-real", "90a-virtual", "90a"}) {
    const cuda_architecture hopper = parse_cuda_architecture(entry);
    EXPECT_TRUE(cuda_architecture_runs_on(hopper, 9, 0)) << entry;
    EXPECT_FALSE(cuda_architecture_runs_on(hopper, 10, 0)) << entry;  // arch-specific PTX does not JIT forward
    EXPECT_FALSE(cuda_architecture_runs_on(hopper, 8, 0)) << entry;
  }
  const cuda_architecture blackwell = parse_cuda_architecture("100a-real");
  EXPECT_TRUE(cuda_architecture_runs_on(blackwell, 10, 0));
  EXPECT_FALSE(cuda_architecture_runs_on(blackwell, 10, 3));
}

TEST(CudaArchitectures, FamilySpecificRunsOnItsFamilyOnly) {
  for (const char* entry : {"100f-real", "100f-virtual"}) {
    const cuda_architecture family = parse_cuda_architecture(entry);
    EXPECT_TRUE(cuda_architecture_runs_on(family, 10, 0)) << entry;
    EXPECT_TRUE(cuda_architecture_runs_on(family, 10, 3)) << entry;
    EXPECT_FALSE(cuda_architecture_runs_on(family, 12, 0)) << entry;
    EXPECT_FALSE(cuda_architecture_runs_on(family, 9, 0)) << entry;
  }
}

TEST(CudaArchitectures, TheDefaultListCoversHopperAndLaterOnly) {
  EXPECT_TRUE(cuda_architectures_cover(kHopperDefault, 9, 0));    // H100/H200: sm_90a SASS
  EXPECT_TRUE(cuda_architectures_cover(kHopperDefault, 10, 0));   // compute_90 PTX
  EXPECT_TRUE(cuda_architectures_cover(kHopperDefault, 12, 0));   // compute_90 PTX
  EXPECT_FALSE(cuda_architectures_cover(kHopperDefault, 8, 0));   // A100
  EXPECT_FALSE(cuda_architectures_cover(kHopperDefault, 8, 6));   // RTX 3090, A10
  EXPECT_FALSE(cuda_architectures_cover(kHopperDefault, 8, 9));   // L4, RTX 4090
  EXPECT_FALSE(cuda_architectures_cover({"90a-real"}, 12, 0));    // SASS only: nothing to JIT
  EXPECT_FALSE(cuda_architectures_cover({}, 9, 0));
  const std::vector<std::string> portable = {"80-real", "86-real", "89-real", "90a-real", "90-virtual"};
  for (const int minor : {0, 6, 7, 9}) EXPECT_TRUE(cuda_architectures_cover(portable, 8, minor)) << minor;
}

TEST(CudaArchitectures, SuggestsTheEntryToBuild) {
  EXPECT_EQ(cuda_architecture_for(9, 0), "90a");
  EXPECT_EQ(cuda_architecture_for(8, 0), "80");
  EXPECT_EQ(cuda_architecture_for(8, 9), "89");
  EXPECT_EQ(cuda_architecture_for(12, 0), "120");
}

TEST(CudaArchitectures, NoMismatchWhereTheListCovers) {
  EXPECT_EQ(cuda_architecture_mismatch(0, "NVIDIA H200", 9, 0, kHopperDefault), "");
  EXPECT_EQ(cuda_architecture_mismatch(0, "NVIDIA H200", 9, 0, {}), "");  // no list recorded: the runtime decides
}

TEST(CudaArchitectures, MismatchNamesTheGpuTheBuildAndTheRebuild) {
  const std::string message = cuda_architecture_mismatch(1, "NVIDIA A100-SXM4-80GB", 8, 0, kHopperDefault);
  EXPECT_TRUE(contains(message, "cuda:1")) << message;
  EXPECT_TRUE(contains(message, "NVIDIA A100-SXM4-80GB")) << message;
  EXPECT_TRUE(contains(message, "compute capability 8.0")) << message;
  EXPECT_TRUE(contains(message, "\"90a-real;90-virtual\"")) << message;
  EXPECT_TRUE(contains(message, "sm_90a machine code for 9.0 only")) << message;
  EXPECT_TRUE(contains(message, "compute_90 PTX, JIT-compiled for 9.0 and newer")) << message;
  EXPECT_TRUE(contains(message, "SHADOWKV_CUDA_ARCHITECTURES=80 pip install .")) << message;
  EXPECT_TRUE(contains(message, "-DCMAKE_CUDA_ARCHITECTURES=80")) << message;
  EXPECT_TRUE(contains(message, "\"80-real;90a-real;90-virtual\"")) << message;

  const std::string ada = cuda_architecture_mismatch(0, "NVIDIA L4", 8, 9, kHopperDefault);
  EXPECT_TRUE(contains(ada, "SHADOWKV_CUDA_ARCHITECTURES=89")) << ada;
  EXPECT_TRUE(contains(ada, "80-real;89-real;90a-real;90-virtual")) << ada;
}

TEST(CudaArchitectures, MismatchBelowTheKernelsMinimum) {
  const std::string message = cuda_architecture_mismatch(0, "Tesla T4", 7, 5, kHopperDefault);
  EXPECT_TRUE(contains(message, "Tesla T4")) << message;
  EXPECT_TRUE(contains(message, "compute capability 7.5")) << message;
  EXPECT_TRUE(contains(message, "8.0 or newer")) << message;
  EXPECT_TRUE(contains(message, "device=\"cpu\"")) << message;
}

TEST(CudaArchitectures, RuntimeDetailOverridesACoveringList) {
  // The list has compute_90 PTX for a 10.0 GPU, but the runtime could not use it (e.g. a driver older than the
  // toolkit).
  const std::string message = cuda_architecture_mismatch(0, "NVIDIA B200", 10, 0, kHopperDefault,
                                                         "cudaErrorUnsupportedPtxVersion (the provided PTX was "
                                                         "compiled with an unsupported toolchain.)");
  EXPECT_TRUE(contains(message, "cudaErrorUnsupportedPtxVersion")) << message;
  EXPECT_TRUE(contains(message, "update the driver")) << message;
  EXPECT_TRUE(contains(message, "SHADOWKV_CUDA_ARCHITECTURES=100")) << message;
  EXPECT_TRUE(contains(message, "80-real;90a-real;100-real;90-virtual")) << message;

  const std::string unrecorded =
      cuda_architecture_mismatch(0, "NVIDIA H200", 9, 0, {}, "cudaErrorNoKernelImageForDevice (no kernel image)");
  EXPECT_TRUE(contains(unrecorded, "did not record")) << unrecorded;
  EXPECT_TRUE(contains(unrecorded, "cudaErrorNoKernelImageForDevice")) << unrecorded;
}

TEST(CudaArchitectures, BuildInfoListsTheCompiledArchitectures) {
  const shadowkv::build_info info = shadowkv::get_build_info();
  if (!info.cuda_compiled) {
    EXPECT_TRUE(info.cuda_architectures.empty());
    return;
  }
  if (info.cuda_architectures.empty()) GTEST_SKIP() << "this build recorded no architecture list (configure warned)";
  for (const std::string& entry : info.cuda_architectures) EXPECT_NO_THROW((void)parse_cuda_architecture(entry));
}

}  // namespace
