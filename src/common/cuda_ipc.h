// Device memory of another process, reached through a CUDA IPC handle (cudaIpcGetMemHandle of its
// allocation). Used by the trainer agent's shm: source (a training process's device tensors,
// copied to host at each sync) and by the rollout agent's engine memory (an engine's device
// parameters: a host shadow is written by the repack and published to the device at commit).
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

namespace wsync {

class CudaIpcMapping {
 public:
  virtual ~CudaIpcMapping() = default;  // closes the handle (cudaIpcCloseMemHandle)
  // Copies [offset, offset + nbytes) of the allocation into `dst` (host memory).
  virtual absl::Status CopyToHost(uint64_t offset, size_t nbytes, void* dst) = 0;
  // Copies host `src` into [offset, offset + nbytes) of the allocation.
  virtual absl::Status CopyFromHost(uint64_t offset, size_t nbytes, const void* src) = 0;
};

// True when this build can open CUDA IPC handles (the device may still be missing).
bool CudaIpcCompiled();

// Opens a cudaIpcMemHandle_t (64 bytes) of an allocation on CUDA device `device`.
absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device);

}  // namespace wsync
