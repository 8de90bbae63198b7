#include <cuda_runtime_api.h>

#include <vector>

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

namespace {
struct ThreadKeptWords {
  std::vector<KeptWord> words;
  ~ThreadKeptWords() {
    for (const KeptWord& w : words) {
      cudaFree(w.device);  // errors ignored: the runtime may already be unloading at exit
      cudaFreeHost(w.host);
    }
  }
};
}  // namespace

absl::StatusOr<KeptWord> ThreadKeptWord() {
  thread_local ThreadKeptWords mine;
  int ordinal = 0;
  WSYNC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&ordinal));
  for (const KeptWord& w : mine.words)
    if (w.ordinal == ordinal) return w;
  KeptWord w;
  w.ordinal = ordinal;
  WSYNC_CUDA_RETURN_IF_ERROR(cudaMalloc(&w.device, sizeof(*w.device)));
  if (cudaError_t e = cudaMallocHost(&w.host, sizeof(*w.host)); e != cudaSuccess) {
    cudaFree(w.device);
    WSYNC_CUDA_RETURN_IF_ERROR(e);
  }
  mine.words.push_back(w);
  return w;
}

}  // namespace wsync::kernels::cuda
