#include "common/memory_space.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "common/cuda_ipc.h"
#include "kernels/dispatch.h"

namespace wsync {
namespace {

int released = 0;
void CountRelease(std::byte* p, int device) {
  EXPECT_EQ(device, 7);
  std::free(p);
  ++released;
}

TEST(Buffer, AdoptFreesWithItsReleaseAndKeepsTheDevice) {
  released = 0;
  {
    Buffer b = Buffer::Adopt(static_cast<std::byte*>(std::malloc(128)), 128, &CountRelease, 7);
    EXPECT_EQ(b.size(), 128u);
    EXPECT_EQ(b.device(), 7);
    Buffer moved = std::move(b);
    EXPECT_EQ(moved.device(), 7);
  }
  EXPECT_EQ(released, 1);
  Buffer host;
  ASSERT_TRUE((host = *Buffer::Allocate(64)).size() == 64);
  EXPECT_EQ(host.device(), -1);
  EXPECT_EQ(Buffer().device(), -1);
}

TEST(Tensor, FromBufferChecksTheSize) {
  auto t = Tensor::FromBuffer(DType::kBF16, {4, 8}, *Buffer::Allocate(64));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->nbytes(), 64u);
  EXPECT_EQ(t->device(), -1);
  auto bad = Tensor::FromBuffer(DType::kBF16, {4, 8}, *Buffer::Allocate(63));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("needs 64 bytes"), std::string::npos) << bad.status();
}

// The same sequence in both spaces: allocate, copy in from the host, copy within the space, zero
// a range, read back.
void RoundTrip(const MemorySpace& space) {
  std::vector<uint8_t> in(4096);
  std::iota(in.begin(), in.end(), uint8_t{3});
  auto a = space.Allocate(in.size());
  auto b = space.Allocate(in.size());
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->device(), space.cuda_device());
  ASSERT_TRUE(space.Copy(a->data(), in.data(), in.size()).ok());
  ASSERT_TRUE(space.Copy(b->data(), a->data(), in.size()).ok());
  ASSERT_TRUE(space.Zero(b->data() + 100, 50).ok());
  std::vector<uint8_t> out(in.size(), 0xEE);
  ASSERT_TRUE(space.CopyToHost(out.data(), b->data(), out.size()).ok());
  ASSERT_TRUE(space.Synchronize().ok());
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], i >= 100 && i < 150 ? 0 : in[i]) << space.Name() << " " << i;
  EXPECT_TRUE(space.Allocate(0)->size() == 0);
  // A block: 7 rows of 24 bytes from column 40 of a 64-byte-pitch matrix (a), into a dense
  // 24-byte-pitch block (b), then back out at column 8 of another matrix (a) with pitch 32: the
  // column cut of sharded delivery, on the space's own memory.
  ASSERT_TRUE(space.Zero(b->data(), in.size()).ok());
  ASSERT_TRUE(space.Copy2D(b->data(), 24, a->data() + 40, 64, 24, 7).ok());
  ASSERT_TRUE(space.Zero(a->data(), in.size()).ok());
  ASSERT_TRUE(space.Copy2D(a->data() + 8, 32, b->data(), 24, 24, 7).ok());
  ASSERT_TRUE(space.Copy2D(a->data(), 0, b->data(), 0, 0, 7).ok());  // nothing to copy
  ASSERT_TRUE(space.CopyToHost(out.data(), a->data(), out.size()).ok());
  for (size_t r = 0; r < 7; ++r)
    for (size_t c = 0; c < 32; ++c) {
      const uint8_t want = c >= 8 ? in[r * 64 + 40 + (c - 8)] : 0;
      ASSERT_EQ(out[r * 32 + c], want) << space.Name() << " row " << r << " column " << c;
    }
  // One row with pitches 0 (a shard merge's single block: GLU halves, dim-0 shards), and rows
  // contiguous on both sides: plain copies (cudaMemcpy2D refuses a pitch below the width).
  ASSERT_TRUE(space.Copy(a->data(), in.data(), in.size()).ok());
  ASSERT_TRUE(space.Zero(b->data(), in.size()).ok());
  ASSERT_TRUE(space.Copy2D(b->data() + 1000, 0, a->data() + 7, 0, 1500, 1).ok());
  ASSERT_TRUE(space.Copy2D(b->data() + 3000, 16, a->data() + 100, 16, 16, 5).ok());
  ASSERT_TRUE(space.CopyToHost(out.data(), b->data(), out.size()).ok());
  for (size_t i = 0; i < out.size(); ++i) {
    const uint8_t want = i >= 1000 && i < 2500 ? in[i - 1000 + 7] : i >= 3000 && i < 3080 ? in[i - 3000 + 100] : 0;
    ASSERT_EQ(out[i], want) << space.Name() << " byte " << i;
  }
}

TEST(MemorySpace, HostRoundTrip) {
  EXPECT_EQ(MemorySpace::Host().Name(), "host");
  EXPECT_TRUE(MemorySpace::Host().host());
  EXPECT_EQ(MemorySpace::Cuda(3).Name(), "cuda:3");
  EXPECT_EQ(MemorySpace::Of(Buffer()), MemorySpace::Host());
  RoundTrip(MemorySpace::Host());
}

TEST(MemorySpace, CudaRoundTrip) {
  if (!kernels::GpuAvailable()) {
    // Without a device (or a CUDA build) every device operation says why instead of pretending.
    auto a = MemorySpace::Cuda(0).Allocate(64);
    EXPECT_FALSE(a.ok());
    GTEST_SKIP() << "no CUDA device: " << a.status();
  }
  RoundTrip(MemorySpace::Cuda(0));
  auto pinned = AllocatePinnedBuffer(1 << 20);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(pinned->device(), -1);
  std::memset(pinned->data(), 0x5A, pinned->size());  // host memory: writable in place
  auto missing = MemorySpace::Cuda(999).Allocate(64);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition) << missing.status();
}

}  // namespace
}  // namespace wsync
