// CUDA device discovery (compiled only with nvcc; reached through kernels/dispatch.h).
#pragma once

#include "absl/status/statusor.h"

namespace wsync::kernels::cuda {

// See kernels::CudaDeviceCount(): 0 for "no device" and "driver insufficient/missing".
absl::StatusOr<int> DeviceCount();

}  // namespace wsync::kernels::cuda
