// cuda_ipc.h over the CUDA runtime (compiled when CUDA is present; runs only on GPU hosts).
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"

namespace wsync {
namespace {

absl::Status CudaError(cudaError_t e, absl::string_view what, absl::StatusCode code) {
  return absl::Status(code, absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

absl::Status SetDevice(int device) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return CudaError(e, absl::StrCat("cudaSetDevice(", device, ")"), absl::StatusCode::kFailedPrecondition);
  return absl::OkStatus();
}

// Makes `device` current after checking that it exists; `what` names the use in the errors.
absl::Status UseDevice(int device, absl::string_view what) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess)
    return CudaError(e, absl::StrCat("no CUDA device for ", what), absl::StatusCode::kFailedPrecondition);
  if (device < 0 || device >= count)
    return absl::FailedPreconditionError(
        absl::StrCat(what, " on CUDA device ", device, ", but this process sees ", count, " devices"));
  return SetDevice(device);
}

absl::Status Copy(void* dst, const void* src, size_t nbytes, int device, cudaMemcpyKind kind) {
  if (nbytes == 0) return absl::OkStatus();
  if (absl::Status s = SetDevice(device); !s.ok()) return s;
  if (cudaError_t e = cudaMemcpy(dst, src, nbytes, kind); e != cudaSuccess)
    return CudaError(
        e,
        absl::StrCat("copying ", nbytes, " bytes ", kind == cudaMemcpyHostToDevice ? "to" : "from", " device ", device),
        absl::StatusCode::kInternal);
  return absl::OkStatus();
}

// The size of the allocation at `base`, for the callers' bounds checks: the driver's
// cuMemGetAddressRange, reached through the runtime (no link against libcuda, so that binaries
// still start on hosts without a driver).
absl::Status AllocationSize(void* base, size_t* size) {
  using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found);
      e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr)
    return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  unsigned long long range_base = 0;
  if (int r = reinterpret_cast<GetAddressRange>(fn)(&range_base, size, reinterpret_cast<uintptr_t>(base)); r != 0)
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange of a CUDA IPC allocation: CUresult ", r));
  return absl::OkStatus();
}

class Allocation final : public CudaAllocation {
 public:
  Allocation(void* data, size_t size, int device) : data_(data), size_(size), device_(device) {}
  ~Allocation() override {
    int prev = 0;
    if (cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess) {
      cudaFree(data_);
      cudaSetDevice(prev);
    }
  }
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  int device() const override { return device_; }
  absl::StatusOr<std::string> IpcHandle() const override {
    if (absl::Status s = SetDevice(device_); !s.ok()) return s;
    cudaIpcMemHandle_t h;
    if (cudaError_t e = cudaIpcGetMemHandle(&h, data_); e != cudaSuccess)
      return CudaError(e, "cudaIpcGetMemHandle", absl::StatusCode::kFailedPrecondition);
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

 private:
  void* data_;
  size_t size_;
  int device_;
};

class Mapping final : public CudaIpcMapping {
 public:
  Mapping(void* base, size_t size, int device) : base_(base), size_(size), device_(device) {}
  void* data() const override { return base_; }
  size_t size() const override { return size_; }
  int device() const override { return device_; }
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
  size_t size_;
  int device_;
};

}  // namespace

bool CudaIpcCompiled() { return true; }

absl::StatusOr<std::unique_ptr<CudaAllocation>> AllocateCuda(size_t bytes, int device) {
  if (bytes == 0) return absl::InvalidArgumentError("a CUDA allocation of 0 bytes");
  if (absl::Status s = UseDevice(device, "a CUDA allocation"); !s.ok()) return s;
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of a failed allocation
    return CudaError(
        e, absl::StrCat("cudaMalloc of ", bytes, " bytes on device ", device),
        e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal);
  }
  auto a = std::make_unique<Allocation>(p, bytes, device);
  if (cudaError_t e = cudaMemset(p, 0, bytes); e != cudaSuccess)
    return CudaError(e, "cudaMemset", absl::StatusCode::kInternal);
  if (cudaError_t e = cudaStreamSynchronize(cudaStreamLegacy); e != cudaSuccess)
    return CudaError(e, "cudaMemset", absl::StatusCode::kInternal);
  return std::unique_ptr<CudaAllocation>(std::move(a));
}

namespace {

class Pinned final : public PinnedHostRange {
 public:
  explicit Pinned(void* data) : data_(data) {}
  ~Pinned() override { cudaHostUnregister(data_); }

 private:
  void* data_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PinnedHostRange>> PinHostMemory(void* data, size_t nbytes) {
  if (data == nullptr || nbytes == 0) return absl::InvalidArgumentError("pinning an empty host range");
  if (cudaError_t e = cudaHostRegister(data, nbytes, cudaHostRegisterDefault); e != cudaSuccess) {
    cudaGetLastError();
    return CudaError(
        e, absl::StrCat("cudaHostRegister of ", nbytes, " bytes"),
        e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kFailedPrecondition);
  }
  return std::unique_ptr<PinnedHostRange>(new Pinned(data));
}

absl::Status CopyHostToDevice(void* dst, const void* src, size_t nbytes, int device) {
  return Copy(dst, src, nbytes, device, cudaMemcpyHostToDevice);
}

absl::Status CopyDeviceToHost(void* dst, const void* src, size_t nbytes, int device) {
  return Copy(dst, src, nbytes, device, cudaMemcpyDeviceToHost);
}

absl::StatusOr<std::unique_ptr<CudaIpcMapping>> OpenCudaIpc(const std::string& handle, int device) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h))
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle is ", sizeof(h), " bytes, got ", handle.size()));
  std::memcpy(&h, handle.data(), sizeof(h));
  if (absl::Status s = UseDevice(device, "a CUDA IPC tensor"); !s.ok()) return s;
  void* base = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
    return CudaError(e, "cudaIpcOpenMemHandle", absl::StatusCode::kFailedPrecondition);
  size_t size = 0;
  if (absl::Status st = AllocationSize(base, &size); !st.ok()) {
    cudaIpcCloseMemHandle(base);
    return st;
  }
  return std::unique_ptr<CudaIpcMapping>(new Mapping(base, size, device));
}

namespace {

void FreeDevice(std::byte* p, int device) {
  int prev = 0;
  if (cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(device) == cudaSuccess) {
    cudaFree(p);
    cudaSetDevice(prev);
  }
}

void FreePinned(std::byte* p, int) { cudaFreeHost(p); }

}  // namespace

absl::StatusOr<Buffer> AllocateDeviceBuffer(size_t nbytes, int device) {
  if (nbytes == 0) return absl::InvalidArgumentError("allocating an empty device buffer");
  if (absl::Status s = UseDevice(device, "a device buffer"); !s.ok()) return s;
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, nbytes); e != cudaSuccess) {
    cudaGetLastError();
    return CudaError(
        e, absl::StrCat("cudaMalloc of ", nbytes, " bytes on device ", device),
        e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal);
  }
  return Buffer::Adopt(static_cast<std::byte*>(p), nbytes, &FreeDevice, device);
}

absl::StatusOr<Buffer> AllocatePinnedBuffer(size_t nbytes) {
  if (nbytes == 0) return absl::InvalidArgumentError("allocating an empty page-locked buffer");
  void* p = nullptr;
  if (cudaError_t e = cudaMallocHost(&p, nbytes); e != cudaSuccess) {
    cudaGetLastError();
    return CudaError(
        e, absl::StrCat("cudaMallocHost of ", nbytes, " bytes"),
        e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kFailedPrecondition);
  }
  return Buffer::Adopt(static_cast<std::byte*>(p), nbytes, &FreePinned, -1);
}

absl::Status CopyOnDevice(void* dst, const void* src, size_t nbytes, int device) {
  if (nbytes == 0) return absl::OkStatus();
  if (absl::Status s = SetDevice(device); !s.ok()) return s;
  if (cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, nullptr); e != cudaSuccess)
    return CudaError(e, absl::StrCat("copying ", nbytes, " bytes on device ", device), absl::StatusCode::kInternal);
  return absl::OkStatus();
}

absl::Status Copy2DOnDevice(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                            size_t rows, int device) {
  if (row_bytes == 0 || rows == 0) return absl::OkStatus();
  // One row (its pitches may be 0: a StridedCopy of one block), or rows that are contiguous on
  // both sides: one plain copy. cudaMemcpy2DAsync refuses a pitch below the row's width (and
  // above cudaDevAttrMaxPitch).
  if (rows == 1 || (dst_pitch == row_bytes && src_pitch == row_bytes))
    return CopyOnDevice(dst, src, rows * row_bytes, device);
  if (absl::Status s = SetDevice(device); !s.ok()) return s;
  if (cudaError_t e = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDefault, nullptr);
      e != cudaSuccess)
    return CudaError(e, absl::StrCat("copying ", rows, " rows of ", row_bytes, " bytes on device ", device),
                     absl::StatusCode::kInternal);
  return absl::OkStatus();
}

absl::StatusOr<std::string> DevicePciBusId(int device) {
  char id[32] = {};
  if (cudaError_t e = cudaDeviceGetPCIBusId(id, sizeof(id), device); e != cudaSuccess)
    return CudaError(e, absl::StrCat("the PCI bus id of device ", device), absl::StatusCode::kFailedPrecondition);
  return std::string(id);
}

absl::Status ZeroOnDevice(void* dst, size_t nbytes, int device) {
  if (nbytes == 0) return absl::OkStatus();
  if (absl::Status s = SetDevice(device); !s.ok()) return s;
  if (cudaError_t e = cudaMemsetAsync(dst, 0, nbytes, nullptr); e != cudaSuccess)
    return CudaError(e, absl::StrCat("zeroing ", nbytes, " bytes on device ", device), absl::StatusCode::kInternal);
  return absl::OkStatus();
}

absl::Status MakeDeviceCurrent(int device) { return SetDevice(device); }

absl::Status SynchronizeLegacyStream(int device) {
  if (absl::Status s = SetDevice(device); !s.ok()) return s;
  if (cudaError_t e = cudaStreamSynchronize(cudaStreamLegacy); e != cudaSuccess)
    return CudaError(e, absl::StrCat("work on device ", device), absl::StatusCode::kInternal);
  return absl::OkStatus();
}

}  // namespace wsync
