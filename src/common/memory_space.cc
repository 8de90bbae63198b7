#include "common/memory_space.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"

namespace wsync {

std::string MemorySpace::Name() const { return host() ? "host" : absl::StrCat("cuda:", device_); }

absl::StatusOr<Buffer> MemorySpace::Allocate(size_t nbytes) const {
  if (nbytes == 0) return Buffer();
  return host() ? Buffer::Allocate(nbytes) : AllocateDeviceBuffer(nbytes, device_);
}

absl::Status MemorySpace::Copy(void* dst, const void* src, size_t nbytes) const {
  if (nbytes == 0) return absl::OkStatus();
  if (!host()) return CopyOnDevice(dst, src, nbytes, device_);
  std::memcpy(dst, src, nbytes);
  return absl::OkStatus();
}

absl::Status MemorySpace::Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                                 size_t rows) const {
  if (row_bytes == 0 || rows == 0) return absl::OkStatus();
  if (!host()) return Copy2DOnDevice(dst, dst_pitch, src, src_pitch, row_bytes, rows, device_);
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  if (row_bytes == dst_pitch && row_bytes == src_pitch) {
    std::memcpy(d, s, row_bytes * rows);
    return absl::OkStatus();
  }
  for (size_t r = 0; r < rows; ++r) std::memcpy(d + r * dst_pitch, s + r * src_pitch, row_bytes);
  return absl::OkStatus();
}

absl::Status MemorySpace::Zero(void* dst, size_t nbytes) const {
  if (nbytes == 0) return absl::OkStatus();
  if (!host()) return ZeroOnDevice(dst, nbytes, device_);
  std::memset(dst, 0, nbytes);
  return absl::OkStatus();
}

absl::Status MemorySpace::CopyToHost(void* dst, const void* src, size_t nbytes) const {
  if (nbytes == 0) return absl::OkStatus();
  if (!host()) return CopyDeviceToHost(dst, src, nbytes, device_);
  std::memcpy(dst, src, nbytes);
  return absl::OkStatus();
}

absl::Status MemorySpace::Synchronize() const { return host() ? absl::OkStatus() : SynchronizeLegacyStream(device_); }

}  // namespace wsync
