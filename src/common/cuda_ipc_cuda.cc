// cuda_ipc.h over the CUDA runtime (compiled when CUDA is present; runs only on GPU hosts).
#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"

namespace wsync {
namespace {

absl::Status CudaError(cudaError_t e, absl::string_view what, absl::StatusCode code) {
  return absl::Status(code, absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

class Mapping final : public CudaIpcMapping {
 public:
  Mapping(void* base, int device) : base_(base), device_(device) {}
  ~Mapping() override {
    int prev = 0;
    if (cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess) {
      cudaIpcCloseMemHandle(base_);
      cudaSetDevice(prev);
    }
  }
  absl::Status CopyToHost(uint64_t offset, size_t nbytes, void* dst) override {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess)
      return CudaError(e, absl::StrCat("cudaSetDevice(", device_, ")"), absl::StatusCode::kFailedPrecondition);
    if (cudaError_t e = cudaMemcpy(dst, static_cast<const char*>(base_) + offset, nbytes, cudaMemcpyDeviceToHost);
        e != cudaSuccess)
      return CudaError(e, absl::StrCat("copying ", nbytes, " bytes from device ", device_),
                       absl::StatusCode::kInternal);
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(uint64_t offset, size_t nbytes, const void* src) override {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess)
      return CudaError(e, absl::StrCat("cudaSetDevice(", device_, ")"), absl::StatusCode::kFailedPrecondition);
    if (cudaError_t e = cudaMemcpy(static_cast<char*>(base_) + offset, src, nbytes, cudaMemcpyHostToDevice);
        e != cudaSuccess)
      return CudaError(e, absl::StrCat("copying ", nbytes, " bytes to device ", device_), absl::StatusCode::kInternal);
    return absl::OkStatus();
  }

 private:
  void* base_;
  int device_;
};

}  // namespace

bool CudaIpcCompiled() { return true; }

absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h))
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle is ", sizeof(h), " bytes, got ", handle.size()));
  std::memcpy(&h, handle.data(), sizeof(h));
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess)
    return CudaError(e, "no CUDA device for a CUDA IPC tensor", absl::StatusCode::kFailedPrecondition);
  if (device < 0 || device >= count)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC tensor on device ", device, ", but this agent sees ", count, " devices"));
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return CudaError(e, absl::StrCat("cudaSetDevice(", device, ")"), absl::StatusCode::kFailedPrecondition);
  void* base = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
    return CudaError(e, "cudaIpcOpenMemHandle", absl::StatusCode::kFailedPrecondition);
  return std::unique_ptr<CudaIpcMapping>(new Mapping(base, device));
}

}  // namespace wsync
