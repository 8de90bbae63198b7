// Internal: strided block copies and transposes of dense row-major matrices of 1/2/4/8-byte
// elements, used by the loader (sent tensor -> staging slice) and by repack (compressed-tensors
// [N, K/8] <-> GPTQ [K/8, N]). Pointers may be unaligned (bucket payloads); elements are moved with
// memcpy. CopyBlockIn runs the same copy in a MemorySpace (a device staging: MemorySpace::Copy2D
// and kernels::TransposeBlock, enqueued on the device's legacy stream). Not a public API.
// Thread-safety: pure functions on caller memory; ParallelFor runs `fn` on disjoint ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "common/memory_space.h"

namespace wsync::engine_model::internal {

// dst[(dr + i) * dst_ld + dc + j] = src[(r0 + i) * src_ld + c0 + j] for i < rows, j < cols; with
// `transpose`, dst[(dr + j) * dst_ld + dc + i] = src[(r0 + i) * src_ld + c0 + j]. Sizes in elements.
void CopyBlock(const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols, std::byte* dst,
               int64_t dst_ld, int64_t dr, int64_t dc, size_t item, bool transpose);

// CopyBlock where `src` and `dst` are memory of `space` (on a CUDA device: enqueued, not waited
// for). Errors: those of MemorySpace::Copy2D and kernels::TransposeBlock; none on the host.
absl::Status CopyBlockIn(const MemorySpace& space, const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0,
                         int64_t rows, int64_t cols, std::byte* dst, int64_t dst_ld, int64_t dr, int64_t dc,
                         size_t item, bool transpose);

// dst [cols, rows] = src [rows, cols]^T, split over up to `threads` threads (0 = hardware).
void Transpose(const std::byte* src, int64_t rows, int64_t cols, std::byte* dst, size_t item, int threads);

}  // namespace wsync::engine_model::internal
