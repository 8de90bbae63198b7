#include "comm/bucket/stream.h"

#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/store/store.h"
#include "comm/testing/faulty_communicator.h"
#include "comm/testing/local_group.h"
#include "common/checksum.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kernels/checksum.h"

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

// Seven buckets of random sizes (some entries empty) to two receivers, with `checksum`.
void ManyBucketsReachEveryReceiverIntact(BucketChecksum checksum) {
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
    BucketSender s(*comms[0], 0, 2, {}, nullptr, std::nullopt, checksum);
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
        // The manifest names the checksum it carries, and only that one.
        EXPECT_EQ(bucket.manifest.has_sum64(), checksum == BucketChecksum::kSum64);
        EXPECT_EQ(bucket.manifest.xxh3_64() != 0, checksum != BucketChecksum::kSum64);
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

TEST(BucketStreamTest, ManyBucketsReachEveryReceiverIntact) {
  ManyBucketsReachEveryReceiverIntact(BucketChecksum::kAuto);
}

// The device streams' checksum, run through host memory (what the CPU build covers of that path:
// the framing through a buffer of the stream's space, Sum64 on both ends).
TEST(BucketStreamTest, ManyBucketsReachEveryReceiverIntactUnderSum64) {
  ManyBucketsReachEveryReceiverIntact(BucketChecksum::kSum64);
}

// A raw sender: one bucket framed by hand (bucket_format.h), with the given checksum and tag.
// No tag ({}): an unauthenticated sender's (bucket_format.h ManifestChecksumTag).
absl::Status SendRaw(Communicator& comm, v1::BucketManifest m, std::vector<char> data, uint64_t xxh3,
                     std::optional<BucketTag> tag, std::optional<uint64_t> sum64 = std::nullopt) {
  m.set_nbytes(data.size());
  m.set_xxh3_64(xxh3);
  if (sum64) m.set_sum64(*sum64);
  std::string ms = m.SerializeAsString();
  if (!tag) tag = ManifestChecksumTag(ms);
  BucketHeader header{ms.size(), data.size()};
  MutableBytes hb{&header, sizeof(header)};
  RETURN_IF_ERROR(Await(comm.Broadcast({&hb, 1}, 0)));
  MutableBytes payload[3] = {{ms.data(), ms.size()}, {data.data(), data.size()}, {tag->data(), tag->size()}};
  return Await(comm.Broadcast(payload, 0));
}

uint64_t Xxh3Of(const std::vector<char>& data) {
  return Xxh3_64({reinterpret_cast<const std::byte*>(data.data()), data.size()});
}

TEST(BucketStreamTest, ACorruptBucketIsDataLossNamingIt) {
  MemoryStore store;
  auto comms = MakeGroup(store, "corrupt", 2);
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  std::thread sender([&] {
    // A raw sender that lies about the checksum.
    std::vector<char> data(1000, 7);
    EXPECT_TRUE(SendRaw(*comms[0], MakeManifest(0, {1000}, true), data, Xxh3Of(data) ^ 1, {}).ok());
  });
  BucketReceiver recv(*comms[1], 0);
  auto next = recv.Next();
  sender.join();
  ASSERT_FALSE(next.ok());
  EXPECT_TRUE(absl::IsDataLoss(next.status())) << next.status();
  EXPECT_NE(next.status().message().find("stage 0 bucket 0"), std::string::npos) << next.status();
}

// A framing corrupted on the way, or forged: every case is refused with kDataLoss naming what is
// wrong, and nothing of the bucket is delivered.
TEST(BucketStreamTest, ACorruptFramingIsDataLossAndDeliversNothing) {
  std::vector<char> data(1000, 7);
  const uint64_t xxh3 = Xxh3Of(data);
  auto good = [&](uint32_t index) {
    v1::BucketManifest m = MakeManifest(index, {1000}, true);
    m.set_nbytes(data.size());
    m.set_xxh3_64(xxh3);
    return m;
  };
  // One raw sender per case: the header as given, then (unless only the header goes) the payload
  // of the header's sizes, with `manifest` as its manifest bytes.
  struct Case {
    std::string name;
    BucketHeader header;
    std::string manifest;
    bool header_only = false;
    std::string says;
    std::string tagged;  // the manifest bytes the tag is the checksum of; "" for `manifest`
  };
  const std::string ms = good(0).SerializeAsString();
  v1::BucketManifest outside = good(0);
  outside.mutable_entries(0)->set_offset(64);  // [64, 1064) of a 1000-byte bucket
  v1::BucketManifest second = good(1);
  v1::BucketManifest renamed = good(0);
  renamed.mutable_entries(0)->mutable_tensor()->set_name("model.embed_tokens.weight");
  const std::string changed = renamed.SerializeAsString();
  std::vector<Case> cases = {
      {"huge manifest", {kMaxManifestBytes + 1, data.size()}, "", true, "-byte manifest (at most"},
      {"garbage manifest", {ms.size(), data.size()}, std::string(ms.size(), '\xff'), false, "does not parse"},
      {"manifest with trailing bytes",
       {ms.size() + 5, data.size()},
       ms + std::string(5, '\xff'),
       false,
       "does not parse"},
      {"data size differs",
       {ms.size(), data.size()},
       [&] {
         v1::BucketManifest m = good(0);
         m.set_nbytes(data.size() + 64);
         return m.SerializeAsString();
       }(),
       false,
       "1064 bytes, 1000 arrived"},
      {"entry outside the data",
       {outside.ByteSizeLong(), data.size()},
       outside.SerializeAsString(),
       false,
       "lie outside the 1000-byte bucket"},
      {"lost bucket",
       {second.ByteSizeLong(), data.size()},
       second.SerializeAsString(),
       false,
       "expected bucket 0 (lost or reordered)"},
      // Valid on its own (it parses, its entry lies inside the data) but not what was sent.
      {"manifest changed on the way",
       {changed.size(), data.size()},
       changed,
       false,
       "-byte manifest does not match its checksum",
       ms},
  };
  for (Case& k : cases) {
    SCOPED_TRACE(k.name);
    MemoryStore store;
    auto comms = MakeGroup(store, "framing", 2);
    for (auto& cm : comms) ASSERT_NE(cm, nullptr);
    std::thread sender([&] {
      MutableBytes hb{&k.header, sizeof(k.header)};
      if (!Await(comms[0]->Broadcast({&hb, 1}, 0)).ok() || k.header_only) return;
      std::vector<char> body(data.begin(), data.end());
      k.manifest.resize(k.header.manifest_bytes);
      BucketTag tag = ManifestChecksumTag(k.tagged.empty() ? k.manifest : k.tagged);
      MutableBytes payload[3] = {
          {k.manifest.data(), k.manifest.size()}, {body.data(), body.size()}, {tag.data(), tag.size()}};
      (void)Await(comms[0]->Broadcast(payload, 0));
    });
    BucketReceiver recv(*comms[1], 0);
    auto next = recv.Next();
    sender.join();
    ASSERT_FALSE(next.ok()) << "a bucket was delivered";
    EXPECT_TRUE(absl::IsDataLoss(next.status())) << next.status();
    EXPECT_NE(next.status().message().find(k.says), std::string::npos) << next.status();
    EXPECT_EQ(recv.stats().buckets, 0u);
  }
}

// Every fault a communicator shows, at every operation of a three-bucket stream, on the receiver
// or on the sender: the stream fails on both ends within the group's timeout (no hang), with the
// fault's code on the member it hit, and every bucket the receiver got before is intact; none
// after. A bucket is two Broadcasts (header, payload), so operation 2b + 1 is bucket b's payload.
TEST(BucketStreamTest, ACommunicatorFaultAtAnyOperationFailsTheStreamCleanly) {
  using testing::Fault;
  constexpr int kBuckets = 3;
  std::vector<std::vector<char>> contents;
  for (int b = 0; b < kBuckets; ++b) contents.emplace_back(4096 * (b + 1), static_cast<char>(b + 1));
  struct Case {
    Fault fault;
    bool on_receiver;
    absl::StatusCode code;  // on the member the fault hit
  };
  std::vector<Case> cases;
  for (int op = 0; op < 2 * kBuckets; ++op) {
    for (bool rx : {true, false})
      cases.push_back({{.kind = Fault::Kind::kError, .at = op}, rx, absl::StatusCode::kInternal});
    cases.push_back({{.kind = Fault::Kind::kPeerGone, .at = op}, op % 2 == 0, absl::StatusCode::kUnavailable});
    if (op % 3 == 0) {
      cases.push_back({{.kind = Fault::Kind::kTimeout, .at = op, .delay = absl::Milliseconds(200)},
                       true,
                       absl::StatusCode::kDeadlineExceeded});
    }
    if (op % 2 == 1) {  // what a payload carries, damaged on the way: never delivered
      // Byte 0 is the manifest's first field tag; byte 2000 is in the data (the manifest is < 100 bytes).
      cases.push_back({{.kind = Fault::Kind::kCorrupt, .at = op, .offset = 0}, true, absl::StatusCode::kDataLoss});
      cases.push_back({{.kind = Fault::Kind::kCorrupt, .at = op, .offset = 2000}, true, absl::StatusCode::kDataLoss});
      cases.push_back({{.kind = Fault::Kind::kShort, .at = op, .bytes = 64}, true, absl::StatusCode::kDataLoss});
    }
  }
  for (const Case& k : cases) {
    SCOPED_TRACE(::testing::Message() << (k.on_receiver ? "receiver" : "sender") << " op " << k.fault.at << " kind "
                                      << static_cast<int>(k.fault.kind));
    MemoryStore store;
    auto group = testing::MakeLocalGroup(store, "faulty", 2, absl::Seconds(5));
    ASSERT_TRUE(group.ok()) << group.status();
    testing::InjectFaults(*group, k.on_receiver ? 1 : 0, {k.fault});
    const absl::Time t0 = absl::Now();
    absl::Status sent;
    std::thread sender([&] {
      BucketSender s(*(*group)[0], 0);
      for (int b = 0; b < kBuckets && sent.ok(); ++b) {
        Buffer buf = *Buffer::Allocate(contents[b].size());
        std::memcpy(buf.data(), contents[b].data(), contents[b].size());
        sent = s.Send(MakeManifest(b, {contents[b].size()}, b == kBuckets - 1), std::move(buf), contents[b].size());
      }
      absl::Status f = s.Finish();
      if (sent.ok()) sent = f;
    });
    BucketReceiver recv(*(*group)[1], 0);
    int delivered = 0;
    absl::Status received;
    for (;;) {
      auto next = recv.Next();
      if (!next.ok()) {
        received = next.status();
        break;
      }
      if (!next->has_value() || delivered >= kBuckets) break;
      const auto& bucket = **next;
      EXPECT_EQ(bucket.manifest.index(), static_cast<uint32_t>(delivered));
      EXPECT_EQ(bucket.manifest.entries(0).tensor().name(), absl::StrCat("t", delivered, ".0"));
      EXPECT_EQ(std::memcmp(bucket.data.data(), contents[delivered].data(), contents[delivered].size()), 0)
          << "bucket " << delivered << " delivered damaged";
      ++delivered;
    }
    // What the rollout agent does with a failed stage: abort its side of the group, so the sender
    // fails at once instead of waiting out its timeout.
    if (!received.ok()) (*group)[1]->Abort(received.message());
    sender.join();
    EXPECT_FALSE(received.ok()) << "the receiver's stream ended as if nothing had failed";
    EXPECT_LT(absl::Now() - t0, absl::Seconds(15)) << "a member waited out its peer";
    EXPECT_LE(delivered, k.fault.at / 2) << "a bucket at or after the fault was delivered";
    EXPECT_FALSE(sent.ok() && k.on_receiver == false) << "the sender's own fault did not fail its stream";
    // The member the fault hit fails with it, or (a later operation of its broken communicator
    // surfacing first) with kAborted naming it, as a real communicator does.
    const absl::Status& hit = k.on_receiver ? received : sent;
    const bool named = hit.code() == absl::StatusCode::kAborted && absl::StrContains(hit.message(), "injected");
    EXPECT_TRUE(hit.code() == k.code || named) << hit;
    // Its peer fails too, whatever the code, unless the fault hit the last operation (the sender
    // may have finished by then).
    EXPECT_FALSE((k.on_receiver ? sent : received).ok() && k.fault.at < 2 * kBuckets - 1)
        << "the peer of the failed member finished as if nothing had failed";
  }
}

TEST(BucketStreamTest, ACorruptSum64BucketIsDataLossNamingIt) {
  MemoryStore store;
  auto comms = MakeGroup(store, "corrupt64", 2);
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  std::vector<char> data(1000, 7);
  data[999] = 8;
  const uint64_t right = kernels::Sum64Host({reinterpret_cast<const std::byte*>(data.data()), data.size()});
  std::thread sender([&] {
    // The XXH3 is right, the Sum64 one bit off: the receiver checks the one the manifest names.
    EXPECT_TRUE(SendRaw(*comms[0], MakeManifest(0, {1000}, true), data, Xxh3Of(data), {}, right ^ 1).ok());
  });
  BucketReceiver recv(*comms[1], 0);
  auto next = recv.Next();
  sender.join();
  ASSERT_FALSE(next.ok());
  EXPECT_TRUE(absl::IsDataLoss(next.status())) << next.status();
  EXPECT_NE(next.status().message().find("stage 0 bucket 0: checksum mismatch (sum64"), std::string::npos)
      << next.status();
}

TEST(BucketStreamTest, APoolOfAnotherSpaceIsRefusedNamingBoth) {
  MemoryStore store;
  auto comms = MakeGroup(store, "pool_space", 2);
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  // A pool that hands out buffers labelled as device 0's (host memory, never dereferenced as such).
  BufferPool device_pool(2, [](size_t n) -> absl::StatusOr<Buffer> {
    return Buffer::Adopt(
        static_cast<std::byte*>(std::aligned_alloc(64, (n + 63) / 64 * 64)), n, [](std::byte* p, int) { std::free(p); },
        0);
  });
  std::thread sender([&] {
    std::vector<char> data(64, 1);
    // The receiver fails before the payload and aborts: the sender's broadcast may fail too.
    SendRaw(*comms[0], MakeManifest(0, {64}, true), data, Xxh3Of(data), {}).IgnoreError();
  });
  {
    BucketReceiver recv(*comms[1], 0, {absl::Seconds(10)}, &device_pool);
    auto next = recv.Next();
    ASSERT_FALSE(next.ok());
    EXPECT_EQ(next.status().code(), absl::StatusCode::kInvalidArgument) << next.status();
    EXPECT_NE(next.status().message().find("a buffer of cuda:0; the gloo stream receives into host"), std::string::npos)
        << next.status();
  }
  comms[1]->Abort("test over");
  sender.join();
}

BucketMac StreamMac(const std::string& sync_key, const std::string& group) {
  auto m = BucketMac::ForStream(sync_key, group);
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

TEST(BucketStreamTest, AuthenticatedBucketsArriveAndCountTheirMacTime) {
  MemoryStore store;
  auto comms = MakeGroup(store, "mac", 3);
  for (auto& c : comms) ASSERT_NE(c, nullptr);
  const std::string key(kBucketMacKeyBytes, '\x5a');
  std::mt19937_64 rng(20261126);  // seed recorded
  constexpr int kBuckets = 4;
  std::vector<std::vector<char>> contents;
  for (int b = 0; b < kBuckets; ++b) {
    contents.emplace_back(2 * (rng() % 300000 + 1));
    for (auto& ch : contents.back()) ch = static_cast<char>(rng());
  }
  std::thread sender([&] {
    BucketSender s(*comms[0], 0, 2, {}, nullptr, StreamMac(key, "mac"));
    for (int b = 0; b < kBuckets; ++b) {
      Buffer buf = *Buffer::Allocate(contents[b].size());
      std::memcpy(buf.data(), contents[b].data(), contents[b].size());
      ASSERT_TRUE(
          s.Send(MakeManifest(b, {contents[b].size()}, b == kBuckets - 1), std::move(buf), contents[b].size()).ok());
    }
    EXPECT_TRUE(s.Finish().ok());
    EXPECT_GT(s.stats().mac, absl::ZeroDuration());
  });
  std::vector<std::thread> receivers;
  for (int r = 1; r < 3; ++r) {
    receivers.emplace_back([&, r] {
      BucketReceiver recv(*comms[r], 0, {}, nullptr, StreamMac(key, "mac"));
      for (int b = 0;; ++b) {
        auto next = recv.Next();
        ASSERT_TRUE(next.ok()) << next.status();
        if (!next->has_value()) break;
        EXPECT_EQ(std::memcmp((*next)->data.data(), contents[b].data(), contents[b].size()), 0);
      }
      EXPECT_EQ(recv.stats().buckets, static_cast<uint64_t>(kBuckets));
      EXPECT_GT(recv.stats().mac, absl::ZeroDuration());
    });
  }
  sender.join();
  for (auto& t : receivers) t.join();
}

// The tag SendRaw's bucket must carry on stream `group` of the sync whose key is `key`.
BucketTag TagFor(const std::string& key, const std::string& group, v1::BucketManifest m,
                 const std::vector<char>& data) {
  m.set_nbytes(data.size());
  m.set_xxh3_64(Xxh3Of(data));
  auto tag = StreamMac(key, group)
                 .Tag(m.index(), m.SerializeAsString(), {reinterpret_cast<const std::byte*>(data.data()), data.size()});
  EXPECT_TRUE(tag.ok()) << tag.status();
  return tag.ok() ? *tag : BucketTag{};
}

// What a process that joined the group without the sync's key can send: nothing the receiver takes.
TEST(BucketStreamTest, ABucketWithoutTheSyncsKeyIsRefusedBeforeItIsHandedOut) {
  const std::string key(kBucketMacKeyBytes, '\x01');
  std::string other = key;
  other[31] = '\x02';
  struct Case {
    const char* what;
    std::function<absl::Status(Communicator&)> send;
  };
  std::vector<char> data(4096, 3);
  const v1::BucketManifest m = MakeManifest(0, {4096}, true);
  std::vector<Case> cases = {
      {"no tag (an unauthenticated sender)", [&](Communicator& c) { return SendRaw(c, m, data, Xxh3Of(data), {}); }},
      {"a tag under another sync's key",
       [&](Communicator& c) { return SendRaw(c, m, data, Xxh3Of(data), TagFor(other, "forged", m, data)); }},
      {"a tag of the right key for another group (a replayed stream)",
       [&](Communicator& c) { return SendRaw(c, m, data, Xxh3Of(data), TagFor(key, "another-group", m, data)); }},
      {"the right tag with its data changed and the checksum recomputed",
       [&](Communicator& c) {
         std::vector<char> changed = data;
         changed[100] ^= 1;
         return SendRaw(c, m, changed, Xxh3Of(changed), TagFor(key, "forged", m, data));
       }},
      {"the right tag with its manifest changed",
       [&](Communicator& c) {
         v1::BucketManifest renamed = m;
         renamed.mutable_entries(0)->mutable_tensor()->set_name("model.embed_tokens.weight");
         return SendRaw(c, renamed, data, Xxh3Of(data), TagFor(key, "forged", m, data));
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    MemoryStore store;
    auto comms = MakeGroup(store, "forged", 2);
    for (auto& p : comms) ASSERT_NE(p, nullptr);
    std::thread sender([&] { EXPECT_TRUE(c.send(*comms[0]).ok()); });
    BucketReceiver recv(*comms[1], 0, {}, nullptr, StreamMac(key, "forged"));
    auto next = recv.Next();
    sender.join();
    ASSERT_FALSE(next.ok());
    EXPECT_TRUE(absl::IsDataLoss(next.status())) << next.status();
    EXPECT_NE(next.status().message().find("stage 0 bucket 0: not authenticated"), std::string::npos) << next.status();
  }
  // The control: the same bucket tagged with the stream's own key is taken.
  MemoryStore store;
  auto comms = MakeGroup(store, "forged", 2);
  std::thread sender(
      [&] { EXPECT_TRUE(SendRaw(*comms[0], m, data, Xxh3Of(data), TagFor(key, "forged", m, data)).ok()); });
  BucketReceiver recv(*comms[1], 0, {}, nullptr, StreamMac(key, "forged"));
  auto next = recv.Next();
  sender.join();
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(next->has_value());
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
  // Delta entries: a payload smaller than the tensor (or its block: sharded delivery) on a named
  // base; never without a base, split, or in an unknown encoding.
  v1::BucketManifest d = m;
  d.set_base_version(4);
  d.mutable_entries(0)->set_nbytes(40);
  d.mutable_entries(0)->mutable_delta()->set_encoding(1);
  EXPECT_TRUE(ValidateManifest(d, 150).ok());
  bad = d;
  bad.set_base_version(0);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
  bad = d;
  bad.mutable_entries(0)->mutable_delta()->set_encoding(3);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
  bad = d;
  bad.mutable_entries(0)->set_split_offset(8);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
  bad = d;
  bad.mutable_entries(0)->set_nbytes(101);  // more than the tensor
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(bad, 150)));
  v1::BucketManifest block = d;  // rows [10, 30) of the [50] tensor (a 50 x 1 matrix): 40 bytes
  v1::TensorBlock* b = block.mutable_entries(0)->mutable_block();
  b->set_row0(10);
  b->set_rows(20);
  b->set_cols(1);
  EXPECT_TRUE(ValidateManifest(block, 150).ok()) << ValidateManifest(block, 150);
  block.mutable_entries(0)->set_nbytes(41);  // more than the block
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateManifest(block, 150)));
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
