// The CUDA block transpose (kernels/transpose.h): a 32 x 32 tile of the source block is read by
// rows into shared memory (a padded column keeps the transposed reads free of bank conflicts) and
// written by rows of the destination, so both global accesses are coalesced. 32 x 8 threads per
// tile, four elements each; the grid's rows stride over the block's tile rows (gridDim.y is
// bounded).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/transpose_cuda.h"

namespace wsync::kernels::cuda {
namespace {

constexpr int kTile = 32, kRowsPerPass = 8;

// An element of N bytes with alignment 1: for pointers that are not aligned to the item size.
template <int N>
struct Unaligned {
  unsigned char b[N];
};

template <typename T>
__global__ void TransposeKernel(const unsigned char* src, int64_t src_ld, int64_t r0, int64_t c0, int64_t rows,
                                int64_t cols, unsigned char* dst, int64_t dst_ld, int64_t dr, int64_t dc) {
  __shared__ T tile[kTile][kTile + 1];
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int64_t tb = blockIdx.y; tb * kTile < rows; tb += gridDim.y) {
    const int64_t i0 = tb * kTile;
    for (int k = threadIdx.y; k < kTile; k += kRowsPerPass) {
      const int64_t i = i0 + k, j = j0 + threadIdx.x;
      if (i < rows && j < cols) tile[k][threadIdx.x] = s[(r0 + i) * src_ld + c0 + j];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < kTile; k += kRowsPerPass) {
      const int64_t j = j0 + k, i = i0 + threadIdx.x;
      if (i < rows && j < cols) d[(dr + j) * dst_ld + dc + i] = tile[threadIdx.x][k];
    }
    __syncthreads();
  }
}

template <typename T>
absl::Status Launch(const TransposeArgs& a) {
  const int64_t col_tiles = (a.cols + kTile - 1) / kTile, row_tiles = (a.rows + kTile - 1) / kTile;
  if (col_tiles > 0x7FFFFFFF) return absl::InvalidArgumentError("TransposeBlock: more than 2^31 column tiles");
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles < 65535 ? row_tiles : 65535));
  const dim3 block(kTile, kRowsPerPass);
  TransposeKernel<T><<<grid, block, 0, cudaStreamLegacy>>>(static_cast<const unsigned char*>(a.src), a.src_ld, a.r0,
                                                           a.c0, a.rows, a.cols, static_cast<unsigned char*>(a.dst),
                                                           a.dst_ld, a.dr, a.dc);
  WSYNC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <typename Aligned, int N>
absl::Status LaunchFor(const TransposeArgs& a) {
  const bool aligned = reinterpret_cast<uintptr_t>(a.src) % N == 0 && reinterpret_cast<uintptr_t>(a.dst) % N == 0;
  return aligned ? Launch<Aligned>(a) : Launch<Unaligned<N>>(a);
}

}  // namespace

absl::Status TransposeBlock(int device, const TransposeArgs& a) {
  if (a.rows == 0 || a.cols == 0) return absl::OkStatus();
  WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  switch (a.item) {
    case 1: return Launch<uint8_t>(a);
    case 2: return LaunchFor<uint16_t, 2>(a);
    case 4: return LaunchFor<uint32_t, 4>(a);
    default: return LaunchFor<uint64_t, 8>(a);
  }
}

}  // namespace wsync::kernels::cuda
