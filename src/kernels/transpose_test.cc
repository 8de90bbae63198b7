// kernels::TransposeBlock (kernels/transpose.h): the CUDA kernel against an element-by-element
// reference on random blocks (seeded) of every item size, aligned and unaligned pointers, blocks
// inside larger matrices with offsets on both sides, odd and tile-sized shapes; the bytes outside
// the destination block stay as they were. The argument refusals run without a GPU.
#include "kernels/transpose.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/memory_space.h"
#include "kernels/dispatch.h"

namespace wsync::kernels {
namespace {

TEST(TransposeBlockTest, RefusesHostMemoryBadItemsAndBlocksOutsideTheirRows) {
  std::vector<std::byte> a(64), b(64);
  TransposeArgs t{a.data(), 4, 0, 0, 4, 4, b.data(), 4, 0, 0, 4};
  EXPECT_EQ(TransposeBlock(MemorySpace::Host(), t).code(), absl::StatusCode::kInvalidArgument);
  t.item = 3;
  EXPECT_EQ(TransposeBlock(MemorySpace::Cuda(0), t).code(), absl::StatusCode::kInvalidArgument);
  t.item = 4;
  t.c0 = 1;  // columns [1, 5) of rows of 4
  EXPECT_EQ(TransposeBlock(MemorySpace::Cuda(0), t).code(), absl::StatusCode::kInvalidArgument);
  t.c0 = 0;
  t.dc = 2;  // destination columns [2, 6) of rows of 4
  EXPECT_EQ(TransposeBlock(MemorySpace::Cuda(0), t).code(), absl::StatusCode::kInvalidArgument);
  t.dc = 0;
  t.rows = -1;
  EXPECT_EQ(TransposeBlock(MemorySpace::Cuda(0), t).code(), absl::StatusCode::kInvalidArgument);
  if (!CudaCompiledIn()) {
    t.rows = 4;
    EXPECT_EQ(TransposeBlock(MemorySpace::Cuda(0), t).code(), absl::StatusCode::kFailedPrecondition);
  }
}

struct Case {
  size_t item;
  int64_t src_rows, src_ld, r0, c0, rows, cols, dst_rows, dst_ld, dr, dc;
  size_t misalign;  // bytes added to both base pointers
};

TEST(TransposeBlockTest, CudaEqualsTheReference) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA device";
  const MemorySpace dev = MemorySpace::Cuda(0);
  std::vector<Case> cases = {
      {4, 64, 64, 0, 0, 64, 64, 64, 64, 0, 0, 0},         // whole, tile-sized
      {4, 100, 37, 3, 5, 90, 31, 40, 97, 2, 4, 0},        // a block inside both, odd shapes
      {2, 257, 130, 1, 2, 255, 127, 130, 300, 1, 40, 0},  // scales
      {1, 33, 65, 0, 1, 33, 64, 70, 40, 3, 5, 0},         // bytes
      {8, 40, 50, 4, 3, 35, 45, 48, 41, 1, 2, 0},         // 8-byte
      {4, 70, 70, 0, 0, 70, 70, 70, 70, 0, 0, 2},         // unaligned 4-byte
      {2, 66, 66, 0, 0, 66, 66, 66, 66, 0, 0, 1},         // unaligned 2-byte
      {8, 9, 33, 0, 0, 9, 33, 33, 9, 0, 0, 4},            // unaligned 8-byte
      {4, 1, 1000, 0, 0, 1, 1000, 1000, 1, 0, 0, 0},      // one row -> one column
      {4, 3000, 8, 0, 0, 3000, 8, 8, 3000, 0, 0, 0},      // tall (the MoE w2 orientation)
  };
  std::mt19937_64 rng(20261127);
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "item " << c.item << " block " << c.rows << "x" << c.cols << " misalign "
                                      << c.misalign);
    const size_t src_bytes = static_cast<size_t>(c.src_rows * c.src_ld) * c.item + c.misalign;
    const size_t dst_bytes = static_cast<size_t>(c.dst_rows * c.dst_ld) * c.item + c.misalign;
    std::vector<std::byte> src(src_bytes), dst(dst_bytes), want(dst_bytes), got(dst_bytes);
    for (auto& x : src) x = std::byte(rng() & 0xFF);
    for (auto& x : dst) x = std::byte(rng() & 0xFF);
    want = dst;
    for (int64_t i = 0; i < c.rows; ++i)
      for (int64_t j = 0; j < c.cols; ++j)
        std::memcpy(want.data() + c.misalign + static_cast<size_t>((c.dr + j) * c.dst_ld + c.dc + i) * c.item,
                    src.data() + c.misalign + static_cast<size_t>((c.r0 + i) * c.src_ld + c.c0 + j) * c.item, c.item);
    auto ds = dev.Allocate(src_bytes);
    auto dd = dev.Allocate(dst_bytes);
    ASSERT_TRUE(ds.ok() && dd.ok());
    ASSERT_TRUE(dev.Copy(ds->data(), src.data(), src_bytes).ok());
    ASSERT_TRUE(dev.Copy(dd->data(), dst.data(), dst_bytes).ok());
    const TransposeArgs a{ds->data() + c.misalign, c.src_ld, c.r0, c.c0, c.rows, c.cols,
                          dd->data() + c.misalign, c.dst_ld, c.dr, c.dc, c.item};
    ASSERT_TRUE(TransposeBlock(dev, a).ok());
    ASSERT_TRUE(dev.CopyToHost(got.data(), dd->data(), dst_bytes).ok());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), dst_bytes), 0);
  }
}

}  // namespace
}  // namespace wsync::kernels
