#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device.h"

namespace wsync::kernels::cuda {

absl::StatusOr<int> DeviceCount() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || err == cudaErrorInitializationError ||
      err == cudaErrorCompatNotSupportedOnDevice) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  WSYNC_CUDA_RETURN_IF_ERROR(err);
  return n;
}

}  // namespace wsync::kernels::cuda
