// Test helpers for the CUDA differential tests: device copies of host vectors and views of them.
// Compiled only in CUDA builds. Thread-safety: none (test code).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <span>
#include <vector>

#include "common/tensor.h"

namespace wsync::kernels::testing {

// Device copy of a host vector, freed on scope exit.
template <typename T>
class DeviceVec {
 public:
  explicit DeviceVec(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit DeviceVec(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr_, 0xAB, bytes()), cudaSuccess);
  }
  ~DeviceVec() { cudaFree(ptr_); }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  size_t bytes() const { return n_ * sizeof(T); }
  TensorView view(DType dt, Shape s) const {
    return TensorView(dt, std::move(s), std::span<const std::byte>(static_cast<const std::byte*>(ptr_), bytes()));
  }
  MutableTensorView mview(DType dt, Shape s) {
    return MutableTensorView(dt, std::move(s), std::span<std::byte>(static_cast<std::byte*>(ptr_), bytes()));
  }
  std::vector<T> ToHost() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaMemcpy(h.data(), ptr_, bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};

template <typename T>
TensorView HostView(DType dt, Shape s, const std::vector<T>& v) {
  return TensorView(dt, std::move(s), std::as_bytes(std::span(v)));
}
template <typename T>
MutableTensorView HostMView(DType dt, Shape s, std::vector<T>& v) {
  return MutableTensorView(dt, std::move(s), std::as_writable_bytes(std::span(v)));
}

}  // namespace wsync::kernels::testing
