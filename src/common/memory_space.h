// Where a data-path stage's buffers live, and the few operations the stages need on them: the
// one switch between the host path (CPU builds, and hosts whose tensors are in host memory) and
// the device path (tensors in CUDA memory), so that a stage keeps one control flow for both.
//
//   MemorySpace::Host()     host memory; Copy / Zero are memcpy / memset, done when they return.
//   MemorySpace::Cuda(d)    device memory of CUDA device d; Copy / Zero are enqueued on the
//                           device's legacy default stream (common/cuda_ipc.h), in order with the
//                           kernels of kernels/ and with CopyToHost, which waits.
// Ownership: allocations are Buffers (common/tensor.h) that free themselves. Errors: the
// cuda_ipc.h ones (kUnimplemented in a build without CUDA, kFailedPrecondition for a missing
// device, kResourceExhausted, kInternal naming the CUDA error). Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"

namespace wsync {

class MemorySpace {
 public:
  static MemorySpace Host() { return MemorySpace(-1); }
  static MemorySpace Cuda(int device) { return MemorySpace(device); }
  // The space of a buffer (Buffer::device()).
  static MemorySpace Of(const Buffer& b) { return MemorySpace(b.device()); }

  bool host() const { return device_ < 0; }
  int cuda_device() const { return device_; }  // -1 for the host
  std::string Name() const;                    // "host" | "cuda:N"
  bool operator==(const MemorySpace&) const = default;

  // Uninitialized memory of `nbytes` in this space (an empty Buffer for 0).
  absl::StatusOr<Buffer> Allocate(size_t nbytes) const;
  // `nbytes` from `src` to `dst`; each is memory of this space or host memory.
  absl::Status Copy(void* dst, const void* src, size_t nbytes) const;
  // `rows` rows of `row_bytes` from `src` (rows `src_pitch` bytes apart) to `dst` (`dst_pitch`
  // apart); each as for Copy.
  absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                      size_t rows) const;
  absl::Status Zero(void* dst, size_t nbytes) const;
  // `nbytes` of this space's `src` into host `dst`, complete when it returns.
  absl::Status CopyToHost(void* dst, const void* src, size_t nbytes) const;
  // Waits for the space's enqueued work (a no-op on the host); its first error.
  absl::Status Synchronize() const;

 private:
  explicit MemorySpace(int device) : device_(device < 0 ? -1 : device) {}
  int device_;
};

}  // namespace wsync
