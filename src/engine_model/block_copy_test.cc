// CopyBlock / Transpose against an element-by-element reference: every element size, with and
// without transpose, random sub-blocks at random offsets of random (odd) leading dimensions, so
// the 4 x 4 SIMD path and its scalar edges are both exercised. Seed 20261122.
#include "engine_model/block_copy.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace wsync::engine_model::internal {
namespace {

void Reference(const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0, int64_t rows, int64_t cols, std::byte* dst,
               int64_t dst_ld, int64_t dr, int64_t dc, size_t item, bool transpose) {
  const auto it = static_cast<int64_t>(item);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const std::byte* s = src + ((r0 + i) * src_ld + c0 + j) * it;
      std::byte* d = transpose ? dst + ((dr + j) * dst_ld + dc + i) * it : dst + ((dr + i) * dst_ld + dc + j) * it;
      std::memcpy(d, s, item);
    }
  }
}

TEST(BlockCopyTest, MatchesTheReferenceOnRandomBlocks) {
  std::mt19937_64 rng(20261122);
  auto pick = [&rng](int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  for (int trial = 0; trial < 400; ++trial) {
    const size_t item = size_t{1} << (trial % 4);
    const bool transpose = (trial / 4) % 2 == 1;
    const int64_t rows = pick(0, 70), cols = pick(0, 70);
    const int64_t r0 = pick(0, 5), c0 = pick(0, 5);
    const int64_t src_rows = r0 + rows + pick(0, 3), src_ld = c0 + cols + pick(0, 3);
    const int64_t out_rows = transpose ? cols : rows, out_cols = transpose ? rows : cols;
    const int64_t dr = pick(0, 5), dc = pick(0, 5);
    const int64_t dst_rows = dr + out_rows + pick(0, 3), dst_ld = dc + out_cols + pick(0, 3);
    std::vector<std::byte> src(static_cast<size_t>(src_rows * src_ld) * item);
    for (auto& b : src) b = static_cast<std::byte>(rng());
    std::vector<std::byte> got(static_cast<size_t>(dst_rows * dst_ld) * item), want;
    for (auto& b : got) b = static_cast<std::byte>(rng());
    want = got;  // bytes outside the block must stay as they are
    CopyBlock(src.data(), src_ld, r0, c0, rows, cols, got.data(), dst_ld, dr, dc, item, transpose);
    Reference(src.data(), src_ld, r0, c0, rows, cols, want.data(), dst_ld, dr, dc, item, transpose);
    ASSERT_EQ(got, want) << "trial " << trial << ": item " << item << (transpose ? " transposed" : "") << ", block "
                         << rows << "x" << cols << " at (" << r0 << "," << c0 << ") of ld " << src_ld << " -> (" << dr
                         << "," << dc << ") of ld " << dst_ld;
  }
}

TEST(BlockCopyTest, ThreadedTransposeMatches) {
  std::mt19937_64 rng(7);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1537, 259}, {4, 4}, {1, 1000}, {1000, 1}, {0, 5}}) {
    for (size_t item : {size_t{2}, size_t{4}}) {
      std::vector<std::byte> src(static_cast<size_t>(rows * cols) * item), got(src.size()), want(src.size());
      for (auto& b : src) b = static_cast<std::byte>(rng());
      for (int threads : {1, 3}) {
        Transpose(src.data(), rows, cols, got.data(), item, threads);
        Reference(src.data(), cols, 0, 0, rows, cols, want.data(), rows, 0, 0, item, true);
        ASSERT_EQ(got, want) << rows << "x" << cols << " item " << item << " threads " << threads;
      }
    }
  }
}

}  // namespace
}  // namespace wsync::engine_model::internal
