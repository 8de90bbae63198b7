// CUDA device discovery and the small per-thread state the kernels share (compiled only with
// nvcc; reached through kernels/dispatch.h and the kernels' entry points).
#pragma once

#include "absl/status/statusor.h"

namespace wsync::kernels::cuda {

// See kernels::CudaDeviceCount(): 0 for "no device" and "driver insufficient/missing".
absl::StatusOr<int> DeviceCount();

// One 8-byte result word of the calling thread on the current device: device memory, and a
// page-locked host word to read it back into. Made once per thread and device and kept until the
// thread ends: a cudaMalloc / cudaFree per call synchronizes the whole device, and made up most of
// the time of quantizing a model's many small tensors in a sync. Each thread has its own, so
// concurrent kernel calls from several threads never share one. Used by the INT4 quantizer (its
// refusal word) and Sum64 (its sum). Errors: kInternal naming the CUDA error.
struct KeptWord {
  unsigned long long* device = nullptr;
  unsigned long long* host = nullptr;
  int ordinal = -1;
};
absl::StatusOr<KeptWord> ThreadKeptWord();

}  // namespace wsync::kernels::cuda
