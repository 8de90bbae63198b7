#include "comm/bucket/builder.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/testing/capture_sink.h"
#include "gtest/gtest.h"

namespace wsync::comm {
namespace {

using testing::CaptureSink;
using testing::Pattern;

// Checks the stream's structure and returns (name, bytes) in stream order.
std::vector<std::pair<std::string, std::vector<std::byte>>> CheckStream(const CaptureSink& sink, uint64_t bucket_bytes,
                                                                        uint64_t version, uint32_t stage) {
  std::vector<std::pair<std::string, std::vector<std::byte>>> out;
  EXPECT_FALSE(sink.buckets.empty());
  for (size_t i = 0; i < sink.buckets.size(); ++i) {
    const auto& b = sink.buckets[i];
    const auto& m = b.manifest;
    EXPECT_EQ(m.index(), i);
    EXPECT_EQ(m.last(), i + 1 == sink.buckets.size());
    EXPECT_EQ(m.version(), version);
    EXPECT_EQ(m.pp_stage(), stage);
    EXPECT_EQ(m.nbytes(), b.data.size());
    EXPECT_TRUE(ValidateManifest(m, b.data.size()).ok()) << ValidateManifest(m, b.data.size());
    if (m.entries_size() > 1) {
      EXPECT_LE(b.data.size(), bucket_bytes) << "bucket " << i;
    }
    if (i + 1 < sink.buckets.size()) {
      EXPECT_GT(m.entries_size(), 0) << "only the last bucket may be empty";
    }
    uint64_t end = 0;
    for (const auto& e : m.entries()) {
      EXPECT_EQ(e.offset() % kEntryAlignment, 0u) << e.tensor().name();
      EXPECT_GE(e.offset(), end) << "entries overlap or go backwards";
      for (uint64_t g = end; g < e.offset(); ++g) EXPECT_EQ(b.data[g], std::byte{0}) << "gap byte " << g;
      end = e.offset() + e.nbytes();
      EXPECT_EQ(e.split_offset(), 0u);
      EXPECT_EQ(e.total_nbytes(), e.nbytes());
      out.emplace_back(e.tensor().name(), std::vector<std::byte>(b.data.begin() + static_cast<long>(e.offset()),
                                                                 b.data.begin() + static_cast<long>(end)));
    }
    EXPECT_EQ(end, b.data.size()) << "a bucket ends with its last entry";
  }
  return out;
}

TEST(BucketBuilderTest, RandomTensorsArriveInOrderIntactAndBucketsStayWithinTheirSize) {
  std::mt19937 rng(20261121);  // seed recorded
  for (uint64_t bucket_bytes : {uint64_t{256}, uint64_t{1000}, uint64_t{1} << 16}) {
    CaptureSink sink;
    BucketBuilder builder(sink, {bucket_bytes, 7, 3});
    std::vector<std::pair<std::string, std::vector<std::byte>>> want;
    for (int i = 0; i < 200; ++i) {
      const int64_t elems = std::uniform_int_distribution<int64_t>(0, 700)(rng);
      const std::string name = absl::StrCat("t", i, ".weight");
      auto bytes = Pattern(static_cast<size_t>(elems) * 2, static_cast<uint32_t>(i));
      TensorView v(DType::kBF16, Shape{elems}, bytes);
      ASSERT_TRUE(builder.Add(name, v).ok());
      want.emplace_back(name, std::move(bytes));
    }
    ASSERT_TRUE(builder.Finish().ok());
    EXPECT_EQ(sink.finishes, 1);
    auto got = CheckStream(sink, bucket_bytes, 7, 3);
    EXPECT_EQ(got, want) << "bucket_bytes " << bucket_bytes;
    EXPECT_EQ(builder.stats().buckets, sink.buckets.size());
    EXPECT_EQ(builder.stats().tensors, 200u);
    uint64_t total = 0, peak = 0;
    for (const auto& b : sink.buckets) total += b.data.size(), peak = std::max<uint64_t>(peak, b.data.size());
    EXPECT_EQ(builder.stats().bytes, total);
    EXPECT_EQ(builder.stats().peak_bucket_bytes, peak);
  }
}

TEST(BucketBuilderTest, ATensorLargerThanABucketGetsABucketOfItsOwn) {
  CaptureSink sink;
  BucketBuilder builder(sink, {1024, 1, 0});
  auto small = Pattern(100, 1), big = Pattern(5000, 2);
  ASSERT_TRUE(builder.Add("a", TensorView(DType::kU8, Shape{100}, small)).ok());
  ASSERT_TRUE(builder.Add("big", TensorView(DType::kU8, Shape{5000}, big)).ok());
  ASSERT_TRUE(builder.Add("b", TensorView(DType::kU8, Shape{100}, small)).ok());
  ASSERT_TRUE(builder.Finish().ok());
  ASSERT_EQ(sink.buckets.size(), 3u);
  EXPECT_EQ(sink.buckets[0].manifest.entries_size(), 1);
  ASSERT_EQ(sink.buckets[1].manifest.entries_size(), 1);
  EXPECT_EQ(sink.buckets[1].manifest.entries(0).tensor().name(), "big");
  EXPECT_EQ(sink.buckets[1].data.size(), 5000u);
  EXPECT_TRUE(sink.buckets[2].manifest.last());
  EXPECT_EQ(sink.buckets[2].manifest.entries(0).tensor().name(), "b");
  EXPECT_EQ(builder.stats().peak_bucket_bytes, 5000u);
}

TEST(BucketBuilderTest, AnEmptyStreamIsOneEmptyLastBucket) {
  CaptureSink sink;
  BucketBuilder builder(sink, {1024, 9, 1});
  ASSERT_TRUE(builder.Finish().ok());
  ASSERT_EQ(sink.buckets.size(), 1u);
  EXPECT_TRUE(sink.buckets[0].manifest.last());
  EXPECT_EQ(sink.buckets[0].manifest.entries_size(), 0);
  EXPECT_EQ(sink.buckets[0].data.size(), 0u);
  // Nothing after Finish.
  auto x = Pattern(4, 1);
  EXPECT_TRUE(absl::IsFailedPrecondition(builder.Add("x", TensorView(DType::kU8, Shape{4}, x))));
  EXPECT_TRUE(absl::IsFailedPrecondition(builder.Finish()));
}

TEST(BucketBuilderTest, AReservedGroupStaysInOneBucketAndBuffersAreRecycled) {
  CaptureSink sink;
  BucketBuilder builder(sink, {1024, 0, 0});
  auto fill = Pattern(900, 5);
  ASSERT_TRUE(builder.Add("fill", TensorView(DType::kU8, Shape{900}, fill)).ok());
  const BucketBuilder::Pending group[3] = {{"p.weight_packed", DType::kI32, {4, 8}},
                                           {"p.weight_scale", DType::kBF16, {4, 2}},
                                           {"p.weight_shape", DType::kI64, {2}}};
  auto views = builder.Reserve(group);
  ASSERT_TRUE(views.ok()) << views.status();
  ASSERT_EQ(views->size(), 3u);
  for (auto& v : *views) std::memset(v.data(), 0x5a, v.nbytes());
  ASSERT_TRUE(builder.Finish().ok());
  ASSERT_EQ(sink.buckets.size(), 2u);
  EXPECT_EQ(sink.buckets[1].manifest.entries_size(), 3) << "the group moved to the next bucket as a whole";
  EXPECT_EQ(sink.buckets[1].buffer, sink.buckets[0].buffer) << "the first bucket's buffer was reused";
}

TEST(BucketBuilderTest, BadInputsAndSinkErrorsAreReturned) {
  CaptureSink sink;
  BucketBuilder builder(sink, {64, 0, 0});
  auto bytes = Pattern(10, 1);
  EXPECT_TRUE(absl::IsInvalidArgument(builder.Add("", TensorView(DType::kU8, Shape{10}, bytes))));
  absl::Status s = builder.Add("w", TensorView(DType::kBF16, Shape{10}, bytes));  // 20 bytes needed
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "\"w\"")) << s;
  sink.error = absl::UnavailableError("wire down");
  ASSERT_TRUE(builder.Add("a", TensorView(DType::kU8, Shape{10}, bytes)).ok());
  auto big = Pattern(100, 2);
  s = builder.Add("b", TensorView(DType::kU8, Shape{100}, big));  // sends "a"'s bucket
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
}

}  // namespace
}  // namespace wsync::comm
