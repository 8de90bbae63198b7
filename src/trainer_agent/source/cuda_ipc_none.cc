// cuda_ipc.h for builds without CUDA.
#include "absl/strings/str_cat.h"
#include "trainer_agent/source/cuda_ipc.h"

namespace wsync::source {

bool CudaIpcCompiled() { return false; }

absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device) {
  return absl::UnimplementedError(absl::StrCat("a CUDA IPC tensor (device ", device,
                                               ") needs a wsync-trainer-agent built with CUDA (WSYNC_WITH_CUDA)"));
}

}  // namespace wsync::source
