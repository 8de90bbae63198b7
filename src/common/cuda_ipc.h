// CUDA device memory for the data path's device stages, in three forms:
//   CudaIpcMapping   device memory of another process, reached through a CUDA IPC handle
//                    (cudaIpcGetMemHandle of its allocation): the trainer agent's shm: source (a
//                    training process's device tensors) and the rollout agent's engine memory (an
//                    engine's device parameters, which Commit writes in place on the device);
//   CudaAllocation   device memory this process allocates (zero-filled), exportable by IPC handle:
//                    device scratch of the repack, an engine's device parameter arena;
//   CopyHostToDevice / CopyDeviceToHost   synchronous copies between host and device pointers.
//
// Built from cuda_ipc_cuda.cc when CUDA is compiled in, else from cuda_ipc_none.cc (every call
// kUnimplemented naming the missing CUDA build), so no #if is needed by the callers.
// Errors: kUnimplemented (no CUDA build), kFailedPrecondition (no such device, the handle cannot
// be opened: e.g. no GPU visible, or a handle of this same process), kResourceExhausted (an
// allocation the device cannot hold), kInternal for a failed copy, each naming the CUDA error string.
// Thread-safety: a CudaIpcMapping or CudaAllocation may be used from one thread at a time; the
// copy functions are reentrant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/tensor.h"

namespace wsync {

class CudaIpcMapping {
 public:
  virtual ~CudaIpcMapping() = default;  // closes the handle (cudaIpcCloseMemHandle)
  // Copies [offset, offset + nbytes) of the allocation into `dst` (host memory).
  virtual absl::Status CopyToHost(uint64_t offset, size_t nbytes, void* dst) = 0;
  // Copies host `src` into [offset, offset + nbytes) of the allocation.
  virtual absl::Status CopyFromHost(uint64_t offset, size_t nbytes, const void* src) = 0;
  // The allocation's base address in this process (a device pointer: never dereference on the host).
  virtual void* data() const = 0;
  virtual size_t size() const = 0;  // bytes of the allocation (cudaMemGetAddressRange)
  virtual int device() const = 0;
};

class CudaAllocation {
 public:
  virtual ~CudaAllocation() = default;  // cudaFree
  virtual void* data() const = 0;       // device pointer, 256-byte aligned
  virtual size_t size() const = 0;
  virtual int device() const = 0;
  // The cudaIpcMemHandle_t (64 bytes) that another process opens with OpenCudaIpc.
  virtual absl::StatusOr<std::string> IpcHandle() const = 0;
};

// True when this build can open CUDA IPC handles (the device may still be missing).
bool CudaIpcCompiled();

// Opens a cudaIpcMemHandle_t (64 bytes) of an allocation on CUDA device `device`.
absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device);

// cudaMalloc of `bytes` (> 0) on `device`, zero-filled.
absl::StatusOr<std::unique_ptr<CudaAllocation>> AllocateCuda(size_t bytes, int device);

// Page-locked host memory: cudaHostRegister of a caller's range (unregistered on destruction), so
// that copies between it and a device run at the link's speed instead of through the driver's
// pageable bounce buffers. The range must stay allocated while pinned.
class PinnedHostRange {
 public:
  virtual ~PinnedHostRange() = default;
};
absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void* data, size_t nbytes);

// Synchronous copies of `nbytes` between host memory and device memory on `device`.
absl::Status CopyHostToDevice(void* dst, const void* src, size_t nbytes, int device);
absl::Status CopyDeviceToHost(void* dst, const void* src, size_t nbytes, int device);

// Buffers (common/tensor.h) of device memory on `device` (cudaMalloc, uninitialized) and of
// page-locked host memory (cudaMallocHost; device() == -1), freed by the Buffer. nbytes > 0.
absl::StatusOr<Buffer> AllocateDeviceBuffer(size_t nbytes, int device);
absl::StatusOr<Buffer> AllocatePinnedBuffer(size_t nbytes);

// Enqueued on `device`'s legacy default stream (ordered with every kernel of kernels/ and every
// synchronous copy above): a copy of `nbytes` from `src` to `dst`, each a device pointer of
// `device` or host memory (cudaMemcpyDefault; from pageable host memory the call returns once the
// source has been read), and a memset to zero of device memory. Execution errors surface at the
// next SynchronizeLegacyStream or synchronous call.
absl::Status CopyOnDevice(void* dst, const void* src, size_t nbytes, int device);
// The same for `rows` rows of `row_bytes` bytes, `src_pitch` / `dst_pitch` bytes apart (cudaMemcpy2DAsync).
absl::Status Copy2DOnDevice(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                            size_t rows, int device);
absl::Status ZeroOnDevice(void* dst, size_t nbytes, int device);
// Makes `device` the calling thread's current CUDA device (the kernels of kernels/ run on it).
absl::Status MakeDeviceCurrent(int device);
// Waits for every operation enqueued on `device`'s legacy default stream (the copies above, the
// kernels of kernels/); their first execution error. Not for work on non-blocking streams (NCCL's):
// a stage that waits for its own copies never waits for another stage's transfer in flight.
absl::Status SynchronizeLegacyStream(int device);
// The PCI bus id of `device` ("0000:3b:00.0"): names one physical GPU of a host whatever
// CUDA_VISIBLE_DEVICES each process has (device ordinals do not).
absl::StatusOr<std::string> DevicePciBusId(int device);

}  // namespace wsync
