// cuda_ipc.h for builds without CUDA.
#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"

namespace wsync {

bool CudaIpcCompiled() { return false; }

absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device) {
  return absl::UnimplementedError(
      absl::StrCat("CUDA IPC memory (device ", device, ") needs wsync built with CUDA (WSYNC_WITH_CUDA)"));
}

}  // namespace wsync
