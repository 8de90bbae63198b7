// The bucket stream over NCCL with device buckets (stream.h, "Memory spaces"): the data goes from
// one GPU's memory to another's, framed through device buffers, checked by Sum64 on both GPUs.
//   one GPU    a one-member NCCL group: the sender alone (Sum64 on the device, the framing copied
//              up, NCCL launched after the device work that filled the bucket), and its refusals;
//   two GPUs   sender on device 0, receiver on device 1: every bucket byte-equal on arrival, in
//              device memory from the receiver's pool, its Sum64 and tag verified.
// Skipped without NCCL or GPUs. The CPU build covers the same stream code through host memory
// (stream_test.cc, under Sum64: intact buckets, and a damaged one refused naming it).
#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "comm/bucket/stream.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "comm/testing/local_group.h"
#include "common/memory_space.h"
#include "kernels/checksum.h"
#include "kernels/dispatch.h"

namespace wsync::comm {
namespace {

int Gpus() {
  absl::StatusOr<int> n = kernels::CudaDeviceCount();
  return n.ok() ? *n : 0;
}

v1::BucketManifest OneEntry(uint32_t index, uint64_t nbytes, bool last) {
  v1::BucketManifest m;
  m.set_index(index);
  m.set_last(last);
  auto* e = m.add_entries();
  e->mutable_tensor()->set_name("t" + std::to_string(index));
  e->mutable_tensor()->set_dtype(v1::DTYPE_U8);
  e->mutable_tensor()->add_shape(static_cast<int64_t>(nbytes));
  e->set_nbytes(nbytes);
  e->set_total_nbytes(nbytes);
  return m;
}

std::vector<std::byte> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> b(n);
  for (auto& x : b) x = std::byte(rng() & 0xFF);
  return b;
}

// `bytes` in a new buffer of `space`.
Buffer Upload(const MemorySpace& space, const std::vector<std::byte>& bytes) {
  absl::StatusOr<Buffer> b = space.Allocate(std::max<size_t>(bytes.size(), 1));
  EXPECT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(space.Copy(b->data(), bytes.data(), bytes.size()).ok());
  return std::move(*b);
}

absl::StatusOr<std::unique_ptr<Communicator>> Nccl(Store& store, const std::string& name, int rank, int size) {
  return CreateGroup(Backend::kNccl, testing::LocalMemberOptions(store, name, rank, size, absl::Seconds(60)));
}

TEST(DeviceStreamTest, ALoneSenderSendsDeviceBucketsOverNccl) {
  if (!BackendCompiledIn(Backend::kNccl) || Gpus() < 1) GTEST_SKIP() << "needs NCCL and a GPU";
  MemoryStore store;
  auto comm = Nccl(store, "device-stream-solo", 0, 1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->space(), MemorySpace::Cuda(0));
  const MemorySpace dev = MemorySpace::Cuda(0);
  BucketSender sender(**comm, 0);
  for (uint32_t i = 0; i < 4; ++i) {
    const uint64_t n = (uint64_t{1} << 20) * (i + 1) + i;
    ASSERT_TRUE(sender.Send(OneEntry(i, n, i == 3), Upload(dev, Random(n, i)), n).ok());
  }
  ASSERT_TRUE(sender.Finish().ok());
  EXPECT_EQ(sender.stats().buckets, 4u);
  // A host bucket is refused before anything is sent, naming both spaces and the way out.
  absl::StatusOr<Buffer> host = Buffer::Allocate(64);
  ASSERT_TRUE(host.ok());
  absl::Status s = sender.Send(OneEntry(4, 64, true), std::move(*host), 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "host memory; the nccl bucket stream sends buffers of cuda:0")) << s;
  // So is an XXH3 stream in device memory.
  BucketSender xxh3(**comm, 0, 2, {}, nullptr, std::nullopt, BucketChecksum::kXxh3);
  s = xxh3.Send(OneEntry(0, 64, true), Upload(dev, Random(64, 9)), 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST(DeviceStreamTest, DeviceBucketsArriveOnAnotherGpuIntactAndAuthenticated) {
  if (!BackendCompiledIn(Backend::kNccl) || Gpus() < 2) GTEST_SKIP() << "needs NCCL and two GPUs";
  MemoryStore store;
  absl::StatusOr<std::unique_ptr<Communicator>> comms[2];
  {
    std::thread second([&] { comms[1] = Nccl(store, "device-stream", 1, 2); });
    comms[0] = Nccl(store, "device-stream", 0, 2);
    second.join();
  }
  for (auto& c : comms) ASSERT_TRUE(c.ok()) << c.status();
  const std::string key(kBucketMacKeyBytes, 'k');
  auto mac = BucketMac::ForStream(key, "device-stream");
  ASSERT_TRUE(mac.ok()) << mac.status();
  constexpr int kBuckets = 6;
  const uint64_t seed = 20261127;
  std::vector<std::vector<std::byte>> sent;
  for (int i = 0; i < kBuckets; ++i) sent.push_back(Random((uint64_t{3} << 20) * (i % 3) + 17 * i + 1, seed + i));
  std::thread sender([&] {
    BucketSender s(**comms[0], 0, 2, {}, nullptr, *mac);
    for (int i = 0; i < kBuckets; ++i)
      ASSERT_TRUE(
          s.Send(OneEntry(i, sent[i].size(), i == kBuckets - 1), Upload(MemorySpace::Cuda(0), sent[i]), sent[i].size())
              .ok());
    EXPECT_TRUE(s.Finish().ok());
  });
  const MemorySpace dev1 = MemorySpace::Cuda(1);
  BufferPool pool(2, [dev1](size_t n) { return dev1.Allocate(n); });
  {
    BucketReceiver recv(**comms[1], 0, {}, &pool, *mac);
    for (int i = 0;; ++i) {
      auto next = recv.Next();
      ASSERT_TRUE(next.ok()) << next.status();
      if (!next->has_value()) {
        EXPECT_EQ(i, kBuckets);
        break;
      }
      auto& b = **next;
      EXPECT_EQ(b.data.device(), 1) << "bucket " << i << " arrived outside device 1";
      EXPECT_TRUE(b.manifest.has_sum64());
      std::vector<std::byte> got(b.manifest.nbytes());
      ASSERT_TRUE(dev1.CopyToHost(got.data(), b.data.data(), got.size()).ok());
      EXPECT_TRUE(got == sent[i]) << "bucket " << i << " seed " << seed + i;
      pool.Put(std::move(b.data));
    }
  }
  sender.join();
}

}  // namespace
}  // namespace wsync::comm
