#include "comm/bucket/space_staging.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/bucket/stream.h"
#include "comm/store/store.h"
#include "comm/testing/capture_sink.h"
#include "comm/testing/local_group.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kernels/dispatch.h"

namespace wsync::comm {
namespace {

using testing::CaptureSink;
using testing::Pattern;

// Host memory labelled as device 0's: what a device Buffer looks like to code that must refuse
// it before touching its bytes (no device needed, nothing is dereferenced).
Buffer FakeDeviceBuffer(size_t n) {
  return Buffer::Adopt(
      static_cast<std::byte*>(std::malloc(n)), n, [](std::byte* p, int) { std::free(p); }, 0);
}

// The same tensors through a builder in `space` (+ staging) and a builder on the host give the
// same buckets, byte for byte (offsets, zeroed gaps, manifests).
void BuildBoth(const MemorySpace& space, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::byte>> tensors;
  for (int i = 0; i < 40; ++i) tensors.push_back(Pattern(1 + rng() % 20000, seed + i));
  auto build = [&](const MemorySpace& where, BucketSink& sink) {
    BucketBuilderOptions o;
    o.bucket_bytes = 64 << 10;
    o.version = 9;
    o.space = where;
    BucketBuilder b(sink, o);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      ASSERT_TRUE(b.Add(absl::StrCat("t", i), TensorView(DType::kU8, {static_cast<int64_t>(t.size())}, t)).ok());
    }
    ASSERT_TRUE(b.Finish().ok());
  };
  CaptureSink host_sink, staged_sink;
  SpaceStagingSink staging(staged_sink, space);
  build(MemorySpace::Host(), host_sink);
  build(space, staging);
  ASSERT_EQ(host_sink.buckets.size(), staged_sink.buckets.size());
  for (size_t i = 0; i < host_sink.buckets.size(); ++i) {
    EXPECT_EQ(host_sink.buckets[i].manifest.SerializeAsString(), staged_sink.buckets[i].manifest.SerializeAsString());
    EXPECT_TRUE(host_sink.buckets[i].data == staged_sink.buckets[i].data) << "bucket " << i << " seed " << seed;
  }
  EXPECT_EQ(staging.stats().buckets, space.host() ? 0u : host_sink.buckets.size());
  EXPECT_EQ(staged_sink.finishes, 1);
}

TEST(SpaceStagingSinkTest, HostBucketsPassThrough) { BuildBoth(MemorySpace::Host(), 11); }

TEST(SpaceStagingSinkTest, DeviceBucketsArriveAsTheHostBuildsThem) {
  if (!kernels::GpuAvailable()) GTEST_SKIP() << "no CUDA device";
  for (uint32_t seed : {1u, 2u, 3u}) BuildBoth(MemorySpace::Cuda(0), seed);
}

// A sink that sends device buckets (what a BroadcastSink over NCCL is): it takes buckets in device
// 0's memory and keeps a host copy of each, for comparison.
class DeviceCaptureSink final : public BucketSink {
 public:
  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override {
    if (data.device() != 0) return absl::InvalidArgumentError("not a cuda:0 bucket");
    CaptureSink::Bucket c;
    c.manifest = std::move(manifest);
    c.data.resize(nbytes);
    RETURN_IF_ERROR(MemorySpace::Cuda(0).CopyToHost(c.data.data(), data.data(), nbytes));
    inner.buckets.push_back(std::move(c));
    return absl::OkStatus();
  }
  Buffer Recycle(uint64_t) override { return Buffer(); }
  absl::Status Finish() override {
    ++inner.finishes;
    return absl::OkStatus();
  }
  MemorySpace space() const override { return MemorySpace::Cuda(0); }
  CaptureSink inner;  // its buckets and finishes only
};

// Host stages in front of the NCCL data plane: host buckets uploaded, one copy each.
TEST(SpaceStagingSinkTest, HostBucketsGoUpToADeviceSinkAsTheyWereBuilt) {
  if (!kernels::GpuAvailable()) GTEST_SKIP() << "no CUDA device";
  std::vector<std::vector<std::byte>> tensors;
  for (int i = 0; i < 30; ++i) tensors.push_back(Pattern(1 + (i * 7919) % 20000, 40 + i));
  CaptureSink host_sink;
  DeviceCaptureSink device_sink;
  SpaceStagingSink staging(device_sink, MemorySpace::Host());
  for (BucketSink* sink : {static_cast<BucketSink*>(&host_sink), static_cast<BucketSink*>(&staging)}) {
    BucketBuilderOptions o;
    o.bucket_bytes = 64 << 10;
    BucketBuilder b(*sink, o);
    for (size_t i = 0; i < tensors.size(); ++i)
      ASSERT_TRUE(
          b.Add(absl::StrCat("t", i), TensorView(DType::kU8, {static_cast<int64_t>(tensors[i].size())}, tensors[i]))
              .ok());
    ASSERT_TRUE(b.Finish().ok());
  }
  ASSERT_EQ(host_sink.buckets.size(), device_sink.inner.buckets.size());
  for (size_t i = 0; i < host_sink.buckets.size(); ++i)
    EXPECT_TRUE(host_sink.buckets[i].data == device_sink.inner.buckets[i].data) << "bucket " << i;
  EXPECT_EQ(staging.stats().buckets, host_sink.buckets.size());
}

TEST(SpaceStagingSinkTest, HostSinksRefuseDeviceBuffersBeforeReadingThem) {
  CaptureSink capture;
  absl::Status s = capture.Send(v1::BucketManifest(), FakeDeviceBuffer(64), 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // The bucket stream (any host backend) says what to do instead.
  MemoryStore store;
  auto groups = testing::MakeLocalGroup(store, "staging", 2);
  ASSERT_TRUE(groups.ok()) << groups.status();
  BucketSender sender(*(*groups)[0], 0);
  v1::BucketManifest m;
  m.set_index(3);
  s = sender.Send(m, FakeDeviceBuffer(64), 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "SpaceStagingSink")) << s;
  // A device bucket larger than its buffer is refused by the staging sink itself.
  SpaceStagingSink staging(capture, MemorySpace::Cuda(0));
  s = staging.Send(m, FakeDeviceBuffer(64), 65);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace wsync::comm
