#include "comm/bucket/stream.h"

#include <random>
#include <set>
#include <thread>
#include <vector>

#include "comm/store/store.h"
#include "comm/testing/local_group.h"
#include "common/checksum.h"
#include "gtest/gtest.h"

namespace wsync::comm {
namespace {

// A Gloo group of `n` members inside this process, over an in-memory store.
std::vector<std::unique_ptr<Communicator>> MakeGroup(MemoryStore& store, const std::string& name, int n) {
  auto g = testing::MakeLocalGroup(store, name, n);
  return g.ok() ? std::move(*g) : std::vector<std::unique_ptr<Communicator>>(n);
}

v1::BucketManifest MakeManifest(uint32_t index, const std::vector<uint64_t>& sizes, bool last) {
  v1::BucketManifest m;
  m.set_pp_stage(0);
  m.set_index(index);
  m.set_last(last);
  uint64_t off = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto* e = m.add_entries();
    e->mutable_tensor()->set_name("t" + std::to_string(index) + "." + std::to_string(i));
    e->mutable_tensor()->set_dtype(v1::DTYPE_BF16);
    e->mutable_tensor()->add_shape(sizes[i] / 2);
    e->set_offset(off);
    e->set_nbytes(sizes[i]);
    e->set_total_nbytes(sizes[i]);
    off += sizes[i];
  }
  return m;
}

TEST(BucketStreamTest, ManyBucketsReachEveryReceiverIntact) {
  MemoryStore store;
  auto comms = MakeGroup(store, "buckets", 3);
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  constexpr int kBuckets = 7;
  std::mt19937_64 rng(20261121);  // seed recorded
  std::vector<std::vector<uint64_t>> sizes;
  std::vector<std::vector<char>> contents;
  for (int b = 0; b < kBuckets; ++b) {
    sizes.push_back({2 * (rng() % 70000 + 1), 2 * (rng() % 3), 2 * (rng() % 900000 + 1)});
    uint64_t total = 0;
    for (auto s : sizes.back()) total += s;
    contents.emplace_back(total);
    for (auto& ch : contents.back()) ch = static_cast<char>(rng());
  }
  std::thread sender([&] {
    BucketSender s(*comms[0], 0, 2);
    for (int b = 0; b < kBuckets; ++b) {
      Buffer buf = s.Recycle(contents[b].size());
      if (buf.size() < contents[b].size()) buf = *Buffer::Allocate(contents[b].size() + 1);
      std::memcpy(buf.data(), contents[b].data(), contents[b].size());
      ASSERT_TRUE(s.Send(MakeManifest(b, sizes[b], b == kBuckets - 1), std::move(buf), contents[b].size()).ok());
    }
    EXPECT_TRUE(s.Finish().ok());
    EXPECT_EQ(s.stats().buckets, static_cast<uint64_t>(kBuckets));
  });
  // Receiver 1 takes its buffers from a pool and gives each loaded bucket back (so later buckets
  // land in buffers that still hold older ones' bytes); receiver 2 allocates every bucket.
  BufferPool pool(3);
  std::set<const std::byte*> pooled;
  std::vector<std::thread> receivers;
  for (int r = 1; r < 3; ++r) {
    receivers.emplace_back([&, r] {
      BucketReceiver recv(*comms[r], 0, {}, r == 1 ? &pool : nullptr);
      for (int b = 0;; ++b) {
        auto next = recv.Next();
        ASSERT_TRUE(next.ok()) << next.status();
        if (!next->has_value()) {
          EXPECT_EQ(b, kBuckets);
          break;
        }
        auto& bucket = **next;
        EXPECT_EQ(bucket.manifest.index(), static_cast<uint32_t>(b));
        ASSERT_EQ(bucket.manifest.nbytes(), contents[b].size());
        ASSERT_GE(bucket.data.size(), contents[b].size());
        EXPECT_EQ(std::memcmp(bucket.data.data(), contents[b].data(), contents[b].size()), 0) << "bucket " << b;
        if (r == 1) {
          pooled.insert(bucket.data.data());
          pool.Put(std::move(bucket.data));
        }
      }
    });
  }
  sender.join();
  for (auto& t : receivers) t.join();
  // Seven buckets through at most three buffers in circulation (receiving, queued, loading) plus
  // the ones a larger bucket needed: fewer distinct buffers than buckets.
  EXPECT_LT(pooled.size(), static_cast<size_t>(kBuckets));
  EXPECT_LE(pool.idle_buffers(), 3u);
}

TEST(BucketStreamTest, ACorruptBucketIsDataLossNamingIt) {
  MemoryStore store;
  auto comms = MakeGroup(store, "corrupt", 2);
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  std::thread sender([&] {
    // A raw sender that lies about the checksum.
    std::vector<char> data(1000, 7);
    v1::BucketManifest m = MakeManifest(0, {1000}, true);
    m.set_nbytes(1000);
    m.set_xxh3_64(Xxh3_64({reinterpret_cast<std::byte*>(data.data()), data.size()}) ^ 1);
    std::string ms = m.SerializeAsString();
    uint64_t header[2] = {ms.size(), data.size()};
    MutableBytes hb{header, sizeof(header)};
    ASSERT_TRUE(Await(comms[0]->Broadcast({&hb, 1}, 0)).ok());
    MutableBytes payload[2] = {{ms.data(), ms.size()}, {data.data(), data.size()}};
    ASSERT_TRUE(Await(comms[0]->Broadcast(payload, 0)).ok());
  });
  BucketReceiver recv(*comms[1], 0);
  auto next = recv.Next();
  sender.join();
  ASSERT_FALSE(next.ok());
  EXPECT_TRUE(absl::IsDataLoss(next.status())) << next.status();
  EXPECT_NE(next.status().message().find("stage 0 bucket 0"), std::string::npos) << next.status();
}

TEST(BucketStreamTest, ManifestValidation) {
  v1::BucketManifest m = MakeManifest(3, {100, 50}, false);
  m.set_nbytes(150);
  EXPECT_TRUE(ValidateManifest(m, 150).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(m, 149)));  // size differs
  auto bad = m;
  bad.mutable_entries(1)->set_offset(120);  // runs past the end
  bad.set_nbytes(150);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
  bad = m;
  bad.mutable_entries(0)->mutable_tensor()->add_shape(3);  // shape says 300 bytes
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
  bad = m;
  bad.mutable_entries(0)->mutable_tensor()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
  bad = m;
  bad.mutable_entries(0)->mutable_tensor()->set_name("");
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
}

TEST(BucketStreamTest, AReceiverWhoseSenderAbortsGetsAnError) {
  MemoryStore store;
  auto comms = MakeGroup(store, "abort", 2);
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  BucketReceiver recv(*comms[1], 0, CollectiveOptions{absl::Seconds(10)});
  comms[0]->Abort("trainer failed");
  auto next = recv.Next();
  ASSERT_FALSE(next.ok());
  EXPECT_TRUE(absl::IsUnavailable(next.status())) << next.status();
}

}  // namespace
}  // namespace wsync::comm
