#include "common/buffer_pool.h"

#include <cstdlib>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace wsync {
namespace {

TEST(BufferPoolTest, ReusesTheSmallestIdleBufferThatFits) {
  BufferPool pool(3);
  auto a = Buffer::Allocate(1000), b = Buffer::Allocate(5000), c = Buffer::Allocate(3000);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const std::byte *pa = a->data(), *pb = b->data(), *pc = c->data();
  pool.Put(std::move(*a));
  pool.Put(std::move(*b));
  pool.Put(std::move(*c));
  EXPECT_EQ(pool.idle_buffers(), 3u);
  EXPECT_EQ(pool.idle_bytes(), 9000u);
  auto x = pool.Get(2000);  // 3000 fits best
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(x->data(), pc);
  EXPECT_EQ(x->size(), 3000u);
  auto y = pool.Get(4000);  // only 5000 fits
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(y->data(), pb);
  EXPECT_EQ(pool.idle_buffers(), 1u);
  EXPECT_EQ(pool.TryGet(1001).size(), 0u);  // only the 1000-byte one is idle
  EXPECT_EQ(pool.TryGet(1000).data(), pa);
  EXPECT_EQ(pool.idle_buffers(), 0u);
}

TEST(BufferPoolTest, GrowsToTheLargestSizeAndFreesIdleBuffersThatDoNotFit) {
  BufferPool pool(2);
  auto a = pool.Get(1000);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size(), 1000u);
  pool.Put(std::move(*a));
  auto b = pool.Get(3000);  // the idle 1000-byte buffer cannot serve: freed, not kept beside
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->size(), 3000u);
  EXPECT_EQ(pool.idle_buffers(), 0u);
  auto c = pool.Get(500);  // nothing idle: a new buffer of the largest size asked for so far
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->size(), 3000u);
  pool.Put(std::move(*b));
  pool.Put(std::move(*c));
  auto d = pool.Get(2999);  // from now on every request up to 3000 bytes is served without allocating
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(pool.idle_buffers(), 1u);
  EXPECT_EQ(pool.Get(0)->size(), 0u);  // zero bytes: an empty buffer, the pool untouched
  EXPECT_EQ(pool.idle_buffers(), 1u);
}

// A pool beside NCCL: every buffer from its allocator, none freed until Trim.
TEST(BufferPoolTest, AKeepingPoolFreesNothingUntilTrimmed) {
  static int live = 0;
  live = 0;
  auto allocate = [](size_t n) -> absl::StatusOr<Buffer> {
    ++live;
    return Buffer::Adopt(
        static_cast<std::byte*>(std::aligned_alloc(64, (n + 63) / 64 * 64)), n,
        [](std::byte* p, int) {
          --live;
          std::free(p);
        },
        -1);
  };
  BufferPool pool(1, allocate, /*keep_until_trim=*/true);
  auto a = pool.Get(1000);
  ASSERT_TRUE(a.ok());
  pool.Put(std::move(*a));
  auto b = pool.Get(3000);  // the idle 1000-byte buffer does not fit: allocated beside it, not freed
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(live, 2);
  auto c = pool.Get(10);
  ASSERT_TRUE(c.ok());  // the idle 1000-byte one
  EXPECT_EQ(c->size(), 1000u);
  pool.Put(std::move(*b));
  pool.Put(std::move(*c));  // past max_free 1: kept
  EXPECT_EQ(pool.idle_buffers(), 2u);
  EXPECT_EQ(live, 2);
  pool.Trim();
  EXPECT_EQ(pool.idle_buffers(), 0u);
  EXPECT_EQ(live, 0);
}

TEST(BufferPoolTest, KeepsTheLargestWhenFull) {
  BufferPool full(2);
  std::vector<Buffer> bufs;
  for (size_t n : {100u, 300u, 200u}) bufs.push_back(*Buffer::Allocate(n));
  for (Buffer& b : bufs) full.Put(std::move(b));
  EXPECT_EQ(full.idle_buffers(), 2u);
  EXPECT_EQ(full.idle_bytes(), 500u);  // 300 + 200: the 100-byte one was freed
  full.Put(Buffer());                  // empty buffers are ignored
  EXPECT_EQ(full.idle_buffers(), 2u);
  BufferPool none(0);
  none.Put(*Buffer::Allocate(64));
  EXPECT_EQ(none.idle_buffers(), 0u);
}

TEST(BufferPoolTest, ManyThreads) {
  BufferPool pool(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&pool, t] {
      for (int i = 0; i < 200; ++i) {
        auto b = pool.Get(static_cast<size_t>(64 * (1 + (t + i) % 5)));
        ASSERT_TRUE(b.ok());
        b->data()[0] = std::byte{1};
        pool.Put(std::move(*b));
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(pool.idle_buffers(), 4u);
}

TEST(BufferPoolTest, AnImpossibleSizeIsResourceExhausted) {
  BufferPool pool;
  auto b = pool.Get(~size_t{0} - 8);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace wsync
