// The CUDA Sum64 (compiled only with nvcc; reached through kernels/checksum.h). Same bits as
// kernels::Sum64Host. Errors: kInternal with the CUDA error. Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace wsync::kernels::cuda {

// `data[0, nbytes)` in the memory of CUDA device `device`; runs on its legacy default stream and
// waits for the result, summed in `word` (device memory; null: the thread's kept word).
absl::StatusOr<uint64_t> Sum64(int device, const void* data, size_t nbytes, void* word);

}  // namespace wsync::kernels::cuda
