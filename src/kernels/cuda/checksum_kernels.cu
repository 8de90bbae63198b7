// The CUDA Sum64 (kernels/format/sum64.h): every thread adds the terms of a grid-stride share of
// the words, a warp adds its threads' sums by shuffles, and one atomicAdd per warp adds that into
// the result word. Addition mod 2^64 is associative and commutative, so the order in which warps
// arrive does not change a bit.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/checksum_cuda.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device.h"
#include "kernels/format/sum64.h"

namespace wsync::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// `aligned`: p is 8-byte aligned, so whole words are read as uint64 (the last, partial one byte
// by byte); otherwise every word is read byte by byte.
__global__ void Sum64Kernel(const unsigned char* p, uint64_t n, bool aligned, unsigned long long* out) {
  const uint64_t words = (n + 7) / 8, whole = n / 8;
  uint64_t sum = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    const uint64_t w = aligned && i < whole ? reinterpret_cast<const uint64_t*>(p)[i] : format::Sum64WordAt(p, n, i);
    sum += format::Sum64Term(w, i);
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_down_sync(0xFFFFFFFFu, sum, off);
  if ((threadIdx.x & 31) == 0 && sum != 0) atomicAdd(out, static_cast<unsigned long long>(sum));
}

}  // namespace

absl::StatusOr<uint64_t> Sum64(int device, const void* data, size_t nbytes, void* word) {
  WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  unsigned long long* sum = static_cast<unsigned long long*>(word);
  unsigned long long* host = nullptr;  // page-locked, with the kept word
  if (sum == nullptr) {
    ASSIGN_OR_RETURN(const KeptWord kept, ThreadKeptWord());
    sum = kept.device;
    host = kept.host;
  }
  const cudaStream_t stream = cudaStreamLegacy;
  WSYNC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sum, 0, sizeof(*sum), stream));
  const uint64_t words = (nbytes + 7) / 8;
  if (words > 0) {
    int sms = 0;
    WSYNC_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    // Enough blocks to fill the device a few times over; each thread then loops over its share.
    const uint64_t want = (words + kThreads - 1) / kThreads;
    const unsigned blocks = static_cast<unsigned>(want < uint64_t(8) * sms ? want : uint64_t(8) * sms);
    const bool aligned = reinterpret_cast<uintptr_t>(data) % 8 == 0;
    Sum64Kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const unsigned char*>(data), nbytes, aligned, sum);
    WSYNC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  unsigned long long result = 0;
  if (host != nullptr) {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, sum, sizeof(*host), cudaMemcpyDeviceToHost, stream));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    result = *host;
  } else {
    // Into pageable memory: returns once the copy (and the kernel before it) is done.
    WSYNC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&result, sum, sizeof(result), cudaMemcpyDeviceToHost, stream));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  return format::Sum64Final(result, nbytes);
}

}  // namespace wsync::kernels::cuda
