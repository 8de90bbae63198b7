// CUDA runtime errors -> absl::Status, with the failing call and its file:line in the message.
// Included only by CUDA-enabled translation units (kernels/cuda/*, comm/nccl/*).
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace wsync::kernels::cuda {

inline absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(call, " failed at ", file, ":", line, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

}  // namespace wsync::kernels::cuda

// Returns the error of a CUDA runtime call as kInternal("cudaMalloc(&p, n) failed at f.cc:12: ...").
#define WSYNC_CUDA_RETURN_IF_ERROR(call)                                                                       \
  do {                                                                                                         \
    ::absl::Status wsync_cuda_status_ = ::wsync::kernels::cuda::CudaStatus((call), #call, __FILE__, __LINE__); \
    if (!wsync_cuda_status_.ok()) return wsync_cuda_status_;                                                   \
  } while (0)
