// device_resources (cuda/backend/device_resources.hpp): one object per device while anyone holds it, shared by every
// store on that device; its library lease binds the handles to the caller's stream and serialises callers.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "backend/device_resources.hpp"
#include "backend/cuda_handles.hpp"
#include "cuda_test_support.cuh"

namespace {

using shadowkv::cuda::device_resources;
using shadowkv::cuda::testing::device_present;

TEST(DeviceResources, OneObjectPerDeviceWhileHeld) {
  if (!device_present()) GTEST_SKIP() << "no CUDA device";
  std::shared_ptr<device_resources> first = device_resources::shared(0);
  std::shared_ptr<device_resources> second = device_resources::shared(0);
  EXPECT_EQ(first.get(), second.get());
  EXPECT_EQ(first->device(), 0);
  int multiprocessors = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(first->multiprocessors(), multiprocessors);
  const std::weak_ptr<device_resources> watch = first;
  first.reset();
  second.reset();
  EXPECT_TRUE(watch.expired()) << "the registry must not keep the resources alive";
  const std::shared_ptr<device_resources> again = device_resources::shared(0);
  EXPECT_NE(again, nullptr);
}

TEST(DeviceResources, LeaseBindsTheStreamAndExcludesOtherCallers) {
  if (!device_present()) GTEST_SKIP() << "no CUDA device";
  const std::shared_ptr<device_resources> resources = device_resources::shared(0);
  const shadowkv::cuda::stream_handle stream = shadowkv::cuda::make_stream();
  std::atomic<bool> second_got_it{false};
  std::thread other;
  {
    const device_resources::library_lease lease = resources->libraries(stream);
    cudaStream_t bound = nullptr;
    ASSERT_EQ(cublasGetStream(lease.cublas(), &bound), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(bound, static_cast<cudaStream_t>(stream));
    ASSERT_EQ(cusolverDnGetStream(lease.cusolver(), &bound), CUSOLVER_STATUS_SUCCESS);
    EXPECT_EQ(bound, static_cast<cudaStream_t>(stream));
    other = std::thread([&] {
      const device_resources::library_lease theirs = resources->libraries(nullptr);
      second_got_it = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(second_got_it) << "a second caller got the handles while the first lease was held";
  }
  other.join();
  EXPECT_TRUE(second_got_it);
}

}  // namespace
