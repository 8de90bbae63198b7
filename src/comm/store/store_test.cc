#include "comm/store/store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace wsync::comm {
namespace {

TEST(MemoryStoreTest, SetGetWaitAdd) {
  MemoryStore s;
  ASSERT_TRUE(s.Set("a", "1").ok());
  EXPECT_EQ(*s.Get("a", absl::Seconds(1)), "1");
  ASSERT_TRUE(s.Set("a", "2").ok());
  EXPECT_EQ(*s.Get("a", absl::Seconds(1)), "2");
  EXPECT_EQ(*s.Add("n", 3), 3);
  EXPECT_EQ(*s.Add("n", -1), 2);
  EXPECT_EQ(*s.Get("n", absl::Seconds(1)), "2");
  EXPECT_EQ(s.Add("a", 1).value(), 3);  // "2" is a valid counter
  ASSERT_TRUE(s.Set("text", "abc").ok());
  EXPECT_EQ(s.Add("text", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.Set("", "x").code(), absl::StatusCode::kInvalidArgument);
}

TEST(MemoryStoreTest, DeletePrefixRemovesExactlyThatPrefix) {
  MemoryStore s;
  for (const char* k : {"sync-1/pp0/a", "sync-1/progress/bytes", "sync-10/pp0/a", "sync-2/x", "sync-1"})
    ASSERT_TRUE(s.Set(k, "v").ok());
  EXPECT_EQ(s.DeletePrefix("sync-1/"), 2u);
  EXPECT_EQ(s.size(), 3u);
  EXPECT_TRUE(s.Get("sync-10/pp0/a", absl::ZeroDuration()).ok()) << "sync-10 is not sync-1";
  EXPECT_TRUE(s.Get("sync-1", absl::ZeroDuration()).ok());
  EXPECT_EQ(s.DeletePrefix(""), 0u) << "an empty prefix deletes nothing";
  EXPECT_EQ(s.DeletePrefix("nothing/"), 0u);
  EXPECT_EQ(s.size(), 3u);
}

TEST(MemoryStoreTest, WaitTimesOutNamingTheMissingKeys) {
  MemoryStore s;
  ASSERT_TRUE(s.Set("rank/0", "x").ok());
  const absl::Time t0 = absl::Now();
  auto st = s.Wait({"rank/0", "rank/1", "rank/2"}, absl::Milliseconds(200));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.message().find("[rank/1, rank/2]"), std::string_view::npos) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  // A key that arrives later releases the waiter.
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(50));
    (void)s.Set("late", "v");
  });
  EXPECT_EQ(*s.Get("late", absl::Seconds(5)), "v");
  late.join();
}

class StoreServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StoreServer::Start(&store_, "127.0.0.1:0");
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  MemoryStore store_;
  std::unique_ptr<StoreServer> server_;
};

TEST_F(StoreServerTest, RendezvousOfManyClients) {
  constexpr int kN = 8;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int r = 0; r < kN; ++r)
    threads.emplace_back([&, r] {
      auto c = GrpcStoreClient::Connect(server_->address());
      if (!c->Set(absl::StrCat("addr/", r), absl::StrCat("host", r)).ok()) return;
      std::vector<std::string> keys;
      for (int i = 0; i < kN; ++i) keys.push_back(absl::StrCat("addr/", i));
      if (!c->Wait(keys, absl::Seconds(10)).ok()) return;
      auto v = c->Get(absl::StrCat("addr/", (r + 1) % kN), absl::Seconds(1));
      auto n = c->Add("joined", 1);
      if (v.ok() && *v == absl::StrCat("host", (r + 1) % kN) && n.ok()) ok.fetch_add(1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kN);
  EXPECT_EQ(*store_.Get("joined", absl::Seconds(1)), absl::StrCat(kN));
  // Binary values survive the wire.
  auto c = GrpcStoreClient::Connect(server_->address());
  std::string bin("\0\1\2\xff", 4);
  ASSERT_TRUE(c->Set("bin", bin).ok());
  EXPECT_EQ(*c->Get("bin", absl::Seconds(1)), bin);
}

TEST_F(StoreServerTest, MissingMemberFailsWithinTimeoutNamingIt) {
  auto c = GrpcStoreClient::Connect(server_->address());
  ASSERT_TRUE(c->Set("gloo/rank/0", "a").ok());
  const absl::Time t0 = absl::Now();
  auto st = c->Wait({"gloo/rank/0", "gloo/rank/1"}, absl::Milliseconds(300));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_NE(st.message().find("gloo/rank/1"), std::string_view::npos) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  auto g = c->Get("never", absl::Milliseconds(100));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(c->Set("", "x").code(), absl::StatusCode::kInvalidArgument);
}

TEST(StoreClientTest, UnreachableCoordinatorIsUnavailable) {
  // Take a free port and close it again: nothing listens there.
  MemoryStore store;
  std::string address;
  {
    auto server = StoreServer::Start(&store, "127.0.0.1:0");
    ASSERT_TRUE(server.ok());
    address = (*server)->address();
  }
  auto c = GrpcStoreClient::Connect(address, absl::Milliseconds(500));
  const absl::Time t0 = absl::Now();
  auto st = c->Set("k", "v");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find(address), std::string_view::npos) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

}  // namespace
}  // namespace wsync::comm

namespace wsync::comm {
namespace {

TEST(StoreAuthTest, AWrongOrMissingTokenIsRefusedAndChangesNothing) {
  MemoryStore store;
  RpcSecurity sec;
  sec.token = "right";
  auto server = StoreServer::Start(&store, "127.0.0.1:0", sec);
  ASSERT_TRUE(server.ok()) << server.status();
  RpcSecurity wrong;
  wrong.token = "wrong";
  auto anonymous = GrpcStoreClient::Connect((*server)->address(), absl::Seconds(5));
  auto intruder = GrpcStoreClient::Connect((*server)->address(), absl::Seconds(5), wrong);
  auto friendly = GrpcStoreClient::Connect((*server)->address(), absl::Seconds(5), sec);
  EXPECT_TRUE(absl::IsUnauthenticated(anonymous->Set("k", "x")));
  EXPECT_TRUE(absl::IsUnauthenticated(intruder->Set("k", "x")));
  EXPECT_TRUE(absl::IsUnauthenticated(intruder->Add("n", 1).status()));
  EXPECT_FALSE(store.Get("k", absl::ZeroDuration()).ok()) << "a refused Set changed the store";
  EXPECT_TRUE(friendly->Set("k", "y").ok());
  EXPECT_EQ(*friendly->Get("k", absl::Seconds(1)), "y");
}

}  // namespace
}  // namespace wsync::comm
