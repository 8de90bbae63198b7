// Device tensors of a training process, reached through CUDA IPC handles (the shm: source's GPU
// path). The agent opens the handle once, at registration, and copies the tensor to host memory
// at each sync (the trainer pipeline of this build runs on the host; see shm_source.h).
//
// Built from cuda_ipc_cuda.cc when CUDA is compiled in, else from cuda_ipc_none.cc (every call
// kUnimplemented naming the missing CUDA build), so no #if is needed by the callers.
// Errors: kUnimplemented (no CUDA build), kFailedPrecondition (no such device, the handle cannot
// be opened: e.g. no GPU visible, or a handle of this same process), kInternal for a failed copy,
// each naming the CUDA error string.
// Thread-safety: a CudaIpcMapping may be used from one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace wsync::source {

class CudaIpcMapping {
 public:
  virtual ~CudaIpcMapping() = default;  // closes the handle (cudaIpcCloseMemHandle)
  // Copies [offset, offset + nbytes) of the allocation into `dst` (host memory).
  virtual absl::Status CopyToHost(uint64_t offset, size_t nbytes, void* dst) = 0;
};

// True when this build can open CUDA IPC handles (the device may still be missing).
bool CudaIpcCompiled();

// Opens a cudaIpcMemHandle_t (64 bytes) of an allocation on CUDA device `device`.
absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device);

}  // namespace wsync::source
