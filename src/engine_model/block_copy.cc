#include "engine_model/block_copy.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/parallel_for.h"
#include "kernels/transpose.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace wsync::engine_model::internal {
namespace {

constexpr int64_t kTile = 32;

#if defined(__SSE2__)
// 4-byte elements: 16 x 16 tiles of 4 x 4 register transposes (SSE2, part of every x86-64 CPU).
// Twice the scalar loop's rate on this VM (1.6 -> 3.2 GB/s for the loader's expert transposes).
constexpr int64_t kTile4 = 16;

inline void Transpose4x4(const std::byte* s, int64_t ss, std::byte* d, int64_t ds) {
  const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + ss));
  const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * ss));
  const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 3 * ss));
  const __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3);  // a0 b0 a1 b1 | c0 d0 c1 d1
  const __m128i t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);  // a2 b2 a3 b3 | c2 d2 c3 d3
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_unpacklo_epi64(t0, t1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + ds), _mm_unpackhi_epi64(t0, t1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * ds), _mm_unpacklo_epi64(t2, t3));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 3 * ds), _mm_unpackhi_epi64(t2, t3));
}

void TransposeBlock4(const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                     std::byte* dst, int64_t dst_ld, int64_t dr, int64_t dc) {
  auto s_at = [&](int64_t i, int64_t j) { return src + ((r0 + i) * src_ld + c0 + j) * 4; };
  auto d_at = [&](int64_t i, int64_t j) { return dst + ((dr + j) * dst_ld + dc + i) * 4; };  // element (i, j) of src
  for (int64_t ib = 0; ib < rows; ib += kTile4) {
    const int64_t ie = std::min(rows, ib + kTile4);
    for (int64_t jb = 0; jb < cols; jb += kTile4) {
      const int64_t je = std::min(cols, jb + kTile4);
      int64_t i = ib;
      for (; i + 4 <= ie; i += 4) {
        int64_t j = jb;
        for (; j + 4 <= je; j += 4) Transpose4x4(s_at(i, j), src_ld * 4, d_at(i, j), dst_ld * 4);
        for (; j < je; ++j)
          for (int64_t k = i; k < i + 4; ++k) std::memcpy(d_at(k, j), s_at(k, j), 4);
      }
      for (; i < ie; ++i)
        for (int64_t j = jb; j < je; ++j) std::memcpy(d_at(i, j), s_at(i, j), 4);
    }
  }
}
#endif

template <size_t kItem>
void TransposeBlock(const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols,
                    std::byte* dst, int64_t dst_ld, int64_t dr, int64_t dc) {
  // Tiles of kTile x kTile keep both the read rows and the written rows in cache.
  for (int64_t ib = 0; ib < rows; ib += kTile) {
    const int64_t ie = std::min(rows, ib + kTile);
    for (int64_t jb = 0; jb < cols; jb += kTile) {
      const int64_t je = std::min(cols, jb + kTile);
      for (int64_t j = jb; j < je; ++j) {
        std::byte* d = dst + ((dr + j) * dst_ld + dc) * static_cast<int64_t>(kItem);
        for (int64_t i = ib; i < ie; ++i) {
          std::memcpy(d + i * static_cast<int64_t>(kItem),
                      src + ((r0 + i) * src_ld + c0 + j) * static_cast<int64_t>(kItem), kItem);
        }
      }
    }
  }
}

}  // namespace

void CopyBlock(const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols, std::byte* dst,
               int64_t dst_ld, int64_t dr, int64_t dc, size_t item, bool transpose) {
  const auto it = static_cast<int64_t>(item);
  if (!transpose) {
    if (cols == src_ld && cols == dst_ld && c0 == 0 && dc == 0) {
      std::memcpy(dst + dr * dst_ld * it, src + r0 * src_ld * it, static_cast<size_t>(rows * cols * it));
      return;
    }
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + ((dr + i) * dst_ld + dc) * it, src + ((r0 + i) * src_ld + c0) * it,
                  static_cast<size_t>(cols * it));
    }
    return;
  }
  switch (item) {
    case 1: return TransposeBlock<1>(src, src_ld, r0, c0, rows, cols, dst, dst_ld, dr, dc);
    case 2: return TransposeBlock<2>(src, src_ld, r0, c0, rows, cols, dst, dst_ld, dr, dc);
#if defined(__SSE2__)
    case 4: return TransposeBlock4(src, src_ld, r0, c0, rows, cols, dst, dst_ld, dr, dc);
#else
    case 4: return TransposeBlock<4>(src, src_ld, r0, c0, rows, cols, dst, dst_ld, dr, dc);
#endif
    default: return TransposeBlock<8>(src, src_ld, r0, c0, rows, cols, dst, dst_ld, dr, dc);
  }
}

absl::Status CopyBlockIn(const MemorySpace& space, const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0,
                         int64_t rows, int64_t cols, std::byte* dst, int64_t dst_ld, int64_t dr, int64_t dc,
                         size_t item, bool transpose) {
  if (space.host()) {
    CopyBlock(src, src_ld, r0, c0, rows, cols, dst, dst_ld, dr, dc, item, transpose);
    return absl::OkStatus();
  }
  if (transpose) return kernels::TransposeBlock(space, {src, src_ld, r0, c0, rows, cols, dst, dst_ld, dr, dc, item});
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const auto it = static_cast<int64_t>(item);
  return space.Copy2D(dst + (dr * dst_ld + dc) * it, static_cast<size_t>(dst_ld * it), src + (r0 * src_ld + c0) * it,
                      static_cast<size_t>(src_ld * it), static_cast<size_t>(cols * it), static_cast<size_t>(rows));
}

void Transpose(const std::byte* src, int64_t rows, int64_t cols, std::byte* dst, size_t item, int threads) {
  // Split over source row tiles: each thread writes disjoint columns of dst.
  const int64_t tiles = (rows + kTile - 1) / kTile;
  const int64_t min_tiles =
      std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, kTile * cols * static_cast<int64_t>(item)));
  ParallelFor(tiles, threads, min_tiles, [&](int64_t tb, int64_t te) {
    const int64_t r0 = tb * kTile, r1 = std::min(rows, te * kTile);
    CopyBlock(src, cols, r0, 0, r1 - r0, cols, dst, rows, 0, r0, item, /*transpose=*/true);
  });
}

}  // namespace wsync::engine_model::internal
