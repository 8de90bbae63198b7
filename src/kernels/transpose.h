// Block transposes of row-major matrices in device memory: what a device staging needs where the
// host path uses engine_model/block_copy.h (the loader's MoE w13 / w2 and TensorRT-LLM
// blocks into GPTQ orientation, the repack's dense INT4 [N, K/8] <-> [K/8, N]).
//
//   TransposeBlock(space, a)   dst[(dr + j) * dst_ld + dc + i] = src[(r0 + i) * src_ld + c0 + j]
//                              for i < rows, j < cols; elements of `item` bytes (1, 2, 4 or 8),
//                              sizes in elements. One kernel on the device's legacy default stream
//                              (in order with MemorySpace's copies and the INT4 kernels; nothing is
//                              waited for): 32 x 32 tiles through shared memory, so that reads and
//                              writes are both coalesced. Any alignment (unaligned pointers move
//                              elements byte by byte).
// The host's transposes are the CPU loader's own (block_copy.h); `space` must be a CUDA device.
// Errors: kInvalidArgument for a host space, an item size other than 1 / 2 / 4 / 8 or negative
// sizes; kFailedPrecondition in a build without CUDA; kInternal naming the CUDA error.
// Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/memory_space.h"

namespace wsync::kernels {

struct TransposeArgs {
  const void* src = nullptr;
  int64_t src_ld = 0, r0 = 0, c0 = 0;  // source row stride, first row and column (elements)
  int64_t rows = 0, cols = 0;          // the source block
  void* dst = nullptr;
  int64_t dst_ld = 0, dr = 0, dc = 0;  // destination row stride, where source (0, 0) lands
  size_t item = 4;                     // element bytes
};

absl::Status TransposeBlock(const MemorySpace& space, const TransposeArgs& a);

}  // namespace wsync::kernels
