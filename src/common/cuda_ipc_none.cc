// cuda_ipc.h for builds without CUDA.
#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"

namespace wsync {
namespace {

absl::Status NoCuda(absl::string_view what, int device) {
  return absl::UnimplementedError(
      absl::StrCat(what, " (device ", device, ") needs wsync built with CUDA (WSYNC_WITH_CUDA)"));
}

}  // namespace

bool CudaIpcCompiled() { return false; }

absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device) {
  return NoCuda("CUDA IPC memory", device);
}

absl::StatusOr<std::unique_ptr<CudaAllocation>> AllocateCuda(size_t, int device) {
  return NoCuda("CUDA device memory", device);
}

absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void*, size_t) {
  return NoCuda("pinning host memory", -1);
}

absl::Status CopyHostToDevice(void*, const void*, size_t, int device) {
  return NoCuda("a host-to-device copy", device);
}

absl::Status CopyDeviceToHost(void*, const void*, size_t, int device) {
  return NoCuda("a device-to-host copy", device);
}

absl::StatusOr<Buffer> AllocateDeviceBuffer(size_t, int device) { return NoCuda("CUDA device memory", device); }

absl::StatusOr<Buffer> AllocatePinnedBuffer(size_t) { return NoCuda("page-locked host memory", -1); }

absl::Status CopyOnDevice(void*, const void*, size_t, int device) { return NoCuda("a device copy", device); }

absl::Status Copy2DOnDevice(void*, size_t, const void*, size_t, size_t, size_t, int device) {
  return NoCuda("a device copy", device);
}

absl::Status ZeroOnDevice(void*, size_t, int device) { return NoCuda("a device memset", device); }

absl::Status MakeDeviceCurrent(int device) { return NoCuda("a current device", device); }

absl::Status SynchronizeLegacyStream(int device) { return NoCuda("synchronizing a device", device); }

absl::StatusOr<std::string> DevicePciBusId(int device) { return NoCuda("a device's PCI bus id", device); }

}  // namespace wsync
