#include "common/tensor.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "common/buffer_pool.h"

namespace wsync {
namespace {

TEST(TensorTest, NumElementsAndBytes) {
  EXPECT_EQ(*NumElements(Shape{}), 1);
  EXPECT_EQ(*NumElements(Shape{0, 5}), 0);
  EXPECT_EQ(*NumElements(Shape{3, 4, 5}), 60);
  EXPECT_EQ(*NumBytes(DType::kBF16, Shape{4096, 2048}), 4096 * 2048 * 2);
  EXPECT_EQ(NumElements(Shape{3, -1}).status().code(), absl::StatusCode::kInvalidArgument);
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  EXPECT_EQ(NumElements(Shape{big, 4}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NumBytes(DType::kI64, Shape{big}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShapeToString(Shape{}), "[]");
  EXPECT_EQ(ShapeToString(Shape{2, 3}), "[2, 3]");
}

TEST(TensorTest, BufferIsAligned) {
  for (size_t n : {1u, 63u, 64u, 65u, 1000u, 1u << 20}) {
    auto b = Buffer::Allocate(n);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % Buffer::kAlignment, 0u);
    EXPECT_EQ(b->size(), n);
  }
  auto z = Buffer::AllocateZeroed(4096);
  ASSERT_TRUE(z.ok());
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(z->data()[i], std::byte{0});
  auto empty = Buffer::Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->size(), 0u);
}

// A moved-from Buffer is empty in both respects, so that a pool or a size check cannot mistake it
// for memory (a pool once got a null buffer that still claimed its old size).
TEST(TensorTest, AMovedFromBufferIsEmpty) {
  auto b = Buffer::Allocate(256);
  ASSERT_TRUE(b.ok());
  std::byte* p = b->data();
  Buffer moved(std::move(*b));
  EXPECT_EQ(b->data(), nullptr);
  EXPECT_EQ(b->size(), 0u);
  EXPECT_EQ(moved.data(), p);
  EXPECT_EQ(moved.size(), 256u);
  Buffer assigned;
  assigned = std::move(moved);
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_EQ(moved.size(), 0u);
  EXPECT_EQ(assigned.size(), 256u);
  BufferPool pool(2, [](size_t n) { return Buffer::Allocate(n); });
  pool.Put(std::move(moved));  // nothing: no memory behind it
  auto got = pool.Get(128);
  ASSERT_TRUE(got.ok());
  EXPECT_NE(got->data(), nullptr);
}

TEST(TensorTest, ViewsCheckSizes) {
  std::byte raw[24] = {};
  auto ok = TensorView::Make(DType::kF32, Shape{2, 3}, std::span<const std::byte>(raw, 24));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->numel(), 6);
  EXPECT_EQ(ok->DebugString(), "F32[2, 3]");
  auto bad = TensorView::Make(DType::kF32, Shape{2, 4}, std::span<const std::byte>(raw, 24), "w.weight");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("w.weight"), absl::string_view::npos);
  EXPECT_NE(bad.status().message().find("32"), absl::string_view::npos);
}

TEST(TensorTest, OwningTensorCopy) {
  auto t = Tensor::Zeros(DType::kI32, Shape{3});
  ASSERT_TRUE(t.ok());
  t->data_as<int32_t>()[1] = 42;
  auto c = Tensor::CopyOf(t->view());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data_as<int32_t>()[1], 42);
  EXPECT_NE(c->view().data(), t->view().data());
  // A view whose bytes disagree with its shape is refused, not over-read.
  std::byte raw[4] = {};
  TensorView lying(DType::kI32, Shape{3}, std::span<const std::byte>(raw, 4));
  EXPECT_EQ(Tensor::CopyOf(lying).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync
