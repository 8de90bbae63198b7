// SpaceBridge on a host without a GPU: Check's verdicts for every pair of spaces (no device is
// touched), host -> host passing buckets through untouched (loaded and recorded from the received
// buffer, no copy, each buffer back in the pool it came from), and which pool buckets are
// received into. The device paths (copies to and from a GPU) run in rollout_receive_test's NCCL /
// device-staging cases on a GPU host; here they only compile.
#include "rollout_agent/receive/space_bridge.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace wsync::rollout_agent {
namespace {

using ::testing::HasSubstr;

TEST(SpaceBridgeTest, CheckRefusesOnlyBucketsOnAnotherGpuThanTheStaging) {
  EXPECT_TRUE(SpaceBridge::Check(MemorySpace::Host(), MemorySpace::Host()).ok());
  EXPECT_TRUE(SpaceBridge::Check(MemorySpace::Cuda(0), MemorySpace::Host()).ok());
  EXPECT_TRUE(SpaceBridge::Check(MemorySpace::Host(), MemorySpace::Cuda(1)).ok());
  EXPECT_TRUE(SpaceBridge::Check(MemorySpace::Cuda(1), MemorySpace::Cuda(1)).ok());
  const absl::Status s = SpaceBridge::Check(MemorySpace::Cuda(0), MemorySpace::Cuda(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("arrive in cuda:0 but the staging is in cuda:1"));
}

TEST(SpaceBridgeTest, HostToHostPassesTheReceivedBufferThrough) {
  for (const bool record : {false, true}) {
    BufferPool pool(2);
    SpaceBridge bridge(
        {.arrive = MemorySpace::Host(), .load = MemorySpace::Host(), .record = record, .host_receive_pool = &pool});
    EXPECT_EQ(bridge.receive_pool(), &pool);
    absl::StatusOr<Buffer> received = pool.Get(100);
    ASSERT_TRUE(received.ok());
    std::memset(received->data(), 0x5a, 100);
    std::byte* const at = received->data();
    Bridged b;
    ASSERT_TRUE(bridge.Bridge(std::move(*received), 100, "stage 0", "bucket 3", &b).ok());
    EXPECT_EQ(bridge.Loadable(b).data(), at) << "record " << record;
    EXPECT_EQ(bridge.HostBytes(b), at);
    EXPECT_EQ(b.host_copy.size(), 0u);
    EXPECT_EQ(b.uploaded.size(), 0u);
    EXPECT_EQ(bridge.Loadable(b).data()[99], std::byte{0x5a});
    EXPECT_EQ(bridge.stats().to_host, absl::ZeroDuration());
    EXPECT_EQ(bridge.stats().to_device, absl::ZeroDuration());
    EXPECT_EQ(bridge.stats().to_host_bytes + bridge.stats().to_device_bytes, 0u);  // no copy between spaces
    EXPECT_EQ(pool.idle_buffers(), 0u);
    bridge.GiveBack(b);
    EXPECT_EQ(pool.idle_buffers(), 1u);
    EXPECT_EQ(b.received.size(), 0u);
    EXPECT_EQ(pool.TryGet(100).data(), at);  // the same buffer, for the next bucket
  }
}

TEST(SpaceBridgeTest, HostToHostWithoutAPoolLeavesReceivingToTheReceiver) {
  SpaceBridge bridge({.arrive = MemorySpace::Host(), .load = MemorySpace::Host()});
  EXPECT_EQ(bridge.receive_pool(), nullptr);
  absl::StatusOr<Buffer> received = Buffer::Allocate(8);
  ASSERT_TRUE(received.ok());
  Bridged b;
  ASSERT_TRUE(bridge.Bridge(std::move(*received), 8, "stage 0", "bucket 0", &b).ok());
  EXPECT_EQ(bridge.Loadable(b).size(), 8u);
  bridge.GiveBack(b);         // no pool: freed
  bridge.GiveBack(Buffer());  // empty: ignored
}

TEST(SpaceBridgeTest, DeviceArrivalReceivesIntoTheGivenDevicePoolOrItsOwn) {
  // Nothing is allocated until a bucket arrives: this runs without a GPU.
  BufferPool device(2), pinned(3);
  SpaceBridge given(
      {.arrive = MemorySpace::Cuda(0), .load = MemorySpace::Host(), .device_pool = &device, .pinned_pool = &pinned});
  EXPECT_EQ(given.receive_pool(), &device);
  SpaceBridge own({.arrive = MemorySpace::Cuda(0), .load = MemorySpace::Cuda(0)});
  EXPECT_NE(own.receive_pool(), nullptr);
  EXPECT_NE(own.receive_pool(), &device);
}

}  // namespace
}  // namespace wsync::rollout_agent
