// Sum64 (kernels/format/sum64.h, where it is defined): the checksum of the buckets that travel in
// device memory, run where the bytes are. Both functions give the same bits for the same bytes.
//
//   Sum64Host     host memory; 4.2 GB/s on one core of this machine, XXH3 6.6 in the same run
//                 (wsync-bench-kernels -k xxh3 sum64): the host streams keep XXH3.
//   Sum64         a MemorySpace's memory: Sum64Host on the host; on a CUDA device, one kernel on
//                 the device's legacy default stream (ordered after the copies and kernels that
//                 filled the bytes, common/memory_space.h), then 8 bytes back to the host. Its
//                 sum goes to `device_word` (8 bytes of that device's memory, 8-byte aligned) when
//                 given, else to a word the calling thread keeps (cuda/device.h): the bucket
//                 streams give one of their framing buffer, so that no receive thread allocates
//                 device or page-locked memory beside running NCCL operations.
// Errors (Sum64): kFailedPrecondition for device memory in a build without CUDA; kInternal naming
// the CUDA error. Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "common/memory_space.h"

namespace wsync::kernels {

uint64_t Sum64Host(std::span<const std::byte> bytes);

absl::StatusOr<uint64_t> Sum64(const MemorySpace& space, const void* data, size_t nbytes, void* device_word = nullptr);

}  // namespace wsync::kernels
