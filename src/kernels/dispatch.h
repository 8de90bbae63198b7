// Where kernels run: the one place that knows whether CUDA was compiled in (STYLE.md §1:
// `#if WSYNC_WITH_CUDA` appears only in kernels/dispatch.cc and comm/factory.cc).
//
// Callers ask here whether a GPU path exists and is usable, and tests use GpuAvailable() to
// GTEST_SKIP() GPU cases on machines without a device (CI, development boxes).
// Thread-safety: all functions are safe to call from any thread.
#pragma once

#include "absl/status/statusor.h"

namespace wsync::kernels {

// True when this binary was built with the CUDA kernels (nvcc found at configure time).
bool CudaCompiledIn();

// Number of usable CUDA devices: 0 when CUDA is not compiled in, when no device is present, or
// when the driver is missing or too old for the runtime ("CUDA driver version is insufficient").
// Other runtime failures are kInternal with the CUDA error string.
absl::StatusOr<int> CudaDeviceCount();

// CudaDeviceCount() > 0, errors counted as "no".
bool GpuAvailable();

}  // namespace wsync::kernels
