#include "kernels/dispatch.h"

#if WSYNC_WITH_CUDA
#include "kernels/cuda/device.h"
#endif

namespace wsync::kernels {

bool CudaCompiledIn() { return WSYNC_WITH_CUDA != 0; }

absl::StatusOr<int> CudaDeviceCount() {
#if WSYNC_WITH_CUDA
  return cuda::DeviceCount();
#else
  return 0;
#endif
}

bool GpuAvailable() {
  auto n = CudaDeviceCount();
  return n.ok() && *n > 0;
}

}  // namespace wsync::kernels
