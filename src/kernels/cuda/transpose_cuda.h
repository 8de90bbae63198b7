// The CUDA block transpose (compiled only with nvcc; reached through kernels/transpose.h, which
// checks the arguments). Errors: kInternal with the CUDA error. Thread-safety: reentrant.
#pragma once

#include "absl/status/status.h"
#include "kernels/transpose.h"

namespace wsync::kernels::cuda {

// On `device`'s legacy default stream; returns once the kernel is enqueued.
absl::Status TransposeBlock(int device, const TransposeArgs& a);

}  // namespace wsync::kernels::cuda
