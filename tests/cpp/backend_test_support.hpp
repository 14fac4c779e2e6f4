// Store tests parameterised over backends (test_store.cpp): the CPU backend always; the CUDA backend where this build
// has it and a GPU is visible at run time — elsewhere its instances skip (GTEST_SKIP) and say why.
//
// A test body is one piece of code for both: it keeps its data in host vectors and hands the store views made by
// backend_memory, which are the host vectors themselves on the CPU and device copies on CUDA (outputs are copied
// back into their host vector when the view made for the call goes away, at the end of the call's full expression).
#pragma once

#include <gtest/gtest.h>

#ifdef SHADOWKV_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "shadowkv/build_info.hpp"
#include "shadowkv/tensor_view.hpp"

namespace shadowkv_test {

/// A backend the store tests run on: its name in test names and the device a store is created on.
struct backend_case {
  const char* name;
  shadowkv::device where;
};

inline void PrintTo(const backend_case& b, std::ostream* os) { *os << b.name; }

/// Every backend: instantiate a suite with ::testing::ValuesIn(all_backends()).
inline std::vector<backend_case> all_backends() {
  return {{"cpu", shadowkv::device{}}, {"cuda", shadowkv::device{shadowkv::device_type::cuda, 0}}};
}

/// Why a store on `where` cannot run in this process, or "" when it can.
inline std::string unavailable_reason(const shadowkv::device& where) {
  if (where.type == shadowkv::device_type::cpu) return {};
  const shadowkv::build_info info = shadowkv::get_build_info();
  if (!info.cuda_backend) return "this build has no CUDA backend (configure with -DSHADOWKV_CUDA=ON)";
#ifndef SHADOWKV_TEST_WITH_CUDA
  return "this test was built without the CUDA runtime (SHADOWKV_TEST_WITH_CUDA): it cannot make device tensors";
#endif
  if (info.cuda_devices <= where.index) {
    return "no CUDA device " + std::to_string(where.index) + " is visible (" + std::to_string(info.cuda_devices) +
           " devices): the CUDA backend is not exercised";
  }
  return {};
}

/// Tensors of one test in the memory of one backend's device. Device copies live as long as this object.
class backend_memory {
 public:
  explicit backend_memory(shadowkv::device where) : where_(where) {}
  backend_memory(const backend_memory&) = delete;
  backend_memory& operator=(const backend_memory&) = delete;

  [[nodiscard]] shadowkv::device where() const { return where_; }
  [[nodiscard]] bool on_host() const { return where_.type == shadowkv::device_type::cpu; }

  /// A float32 input view of the first product(shape) elements of `data`, on this backend's device.
  shadowkv::tensor_view view_of(const std::vector<float>& data, std::initializer_list<std::int64_t> shape) {
    return shadowkv::make_contiguous_view(place(data, shape), shadowkv::dtype::float32, where_, shape);
  }

  /// An int64 input view (positions) of `data`, on this backend's device.
  shadowkv::tensor_view index_view_of(const std::vector<std::int64_t>& data,
                                      std::initializer_list<std::int64_t> shape) {
    return shadowkv::make_contiguous_index_view(place(data, shape), shadowkv::index_type::int64, where_, shape);
  }

  /// A float32 view of `data` in host memory labelled as a device the store is not on (a misplaced tensor).
  shadowkv::tensor_view foreign_view_of(const std::vector<float>& data, std::initializer_list<std::int64_t> shape) {
    const shadowkv::device elsewhere = on_host() ? shadowkv::device{shadowkv::device_type::cuda, 0}
                                                 : shadowkv::device{};
    return shadowkv::make_contiguous_view(data.data(), shadowkv::dtype::float32, elsewhere, shape);
  }

  /// An output view: `data` itself on the CPU; on CUDA a device buffer whose contents are copied into `data` when
  /// the returned object is destroyed (pass it straight to the call that writes it).
  class output {
   public:
    output(backend_memory& owner, std::vector<float>& data, std::initializer_list<std::int64_t> shape)
        : data_(&data), count_(count_of(shape)) {
      check_size(data.size(), count_);
      void* target = data.data();
      if (!owner.on_host()) {
        device_ = owner.device_copy(data.data(), count_ * sizeof(float));
        target = device_.get();
      }
      view_ = shadowkv::make_contiguous_output_view(target, shadowkv::dtype::float32, owner.where(), shape);
    }
    output(const output&) = delete;
    output& operator=(const output&) = delete;
    ~output() {
#ifdef SHADOWKV_TEST_WITH_CUDA
      if (device_ != nullptr &&
          cudaMemcpy(data_->data(), device_.get(), count_ * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
        ADD_FAILURE() << "copying a decode output back from the device failed";
      }
#endif
    }
    operator const shadowkv::mutable_tensor_view&() const { return view_; }  // NOLINT: used as the call's argument

   private:
    std::vector<float>* data_;
    std::size_t count_;
    std::shared_ptr<void> device_;
    shadowkv::mutable_tensor_view view_;
  };

  output mutable_view_of(std::vector<float>& data, std::initializer_list<std::int64_t> shape) {
    return output(*this, data, shape);
  }

 private:
  static std::size_t count_of(std::initializer_list<std::int64_t> shape) {
    std::int64_t count = 1;
    for (const std::int64_t extent : shape) count *= extent;
    return static_cast<std::size_t>(count < 0 ? 0 : count);
  }

  static void check_size(std::size_t have, std::size_t need) {
    if (have < need) {
      throw std::logic_error("test data holds " + std::to_string(have) + " elements, the view " +
                             std::to_string(need));
    }
  }

  template <typename T>
  const void* place(const std::vector<T>& data, std::initializer_list<std::int64_t> shape) {
    const std::size_t count = count_of(shape);
    check_size(data.size(), count);
    if (on_host()) return data.data();
    std::shared_ptr<void> copy = device_copy(data.data(), count * sizeof(T));
    inputs_.push_back(copy);
    return copy.get();
  }

  /// A device buffer holding `bytes` bytes of `source` (at least one byte, so that an empty tensor has an address).
  std::shared_ptr<void> device_copy(const void* source, std::size_t bytes) {
#ifdef SHADOWKV_TEST_WITH_CUDA
    void* data = nullptr;
    if (cudaMalloc(&data, bytes == 0 ? 1 : bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    std::shared_ptr<void> owned(data, [](void* p) { (void)cudaFree(p); });
    if (bytes > 0 && cudaMemcpy(data, source, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpy to the device failed");
    }
    // A store given no stream works on its own non-blocking stream, and its inputs must be ready (store.hpp). cudaMemcpy
    // from pageable memory returns once the data is staged, before the legacy stream's DMA lands it on the device, and
    // a non-blocking stream does not wait for the legacy stream: wait here. (Without this the twin tests' CUDA
    // instances failed now and then with several processes on the GPU, e.g. under ctest -j: a store read an input
    // before it landed, and the two twins' outputs differed.)
    if (std::getenv("SHADOWKV_TEST_UNSYNCED_INPUTS") == nullptr && cudaDeviceSynchronize() != cudaSuccess) {
      throw std::runtime_error("waiting for a copy to the device failed");
    }
    return owned;
#else
    (void)source;
    (void)bytes;
    throw std::logic_error("device tensors need SHADOWKV_TEST_WITH_CUDA (unavailable_reason() skips such tests)");
#endif
  }

  shadowkv::device where_;
  std::vector<std::shared_ptr<void>> inputs_;
};

inline const backend_case& backend_of(const backend_case& param) { return param; }
template <typename Other>
const backend_case& backend_of(const std::tuple<backend_case, Other>& param) {
  return std::get<0>(param);
}

/// Fixture of a suite instantiated per backend (Param: backend_case, or a tuple of it and a case): skips where the
/// backend cannot run, and gives the test body `where()` for its stores and `mem` for its tensors.
template <typename Param = backend_case>
class backend_test : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const std::string why = unavailable_reason(where());
    if (!why.empty()) GTEST_SKIP() << backend_of(this->GetParam()).name << ": " << why;
  }
  [[nodiscard]] shadowkv::device where() const { return backend_of(this->GetParam()).where; }
  [[nodiscard]] bool on_cuda() const { return where().type == shadowkv::device_type::cuda; }

  backend_memory mem{backend_of(this->GetParam()).where};
};

/// Test-name suffix of a backend instance: "cpu" or "cuda".
inline std::string backend_name(const ::testing::TestParamInfo<backend_case>& info) { return info.param.name; }

}  // namespace shadowkv_test
