// The shm: weight source against the real client library (wsync_trainer_client.h), both sides in
// this process: registration validated against the rank's plan (errors named, nothing changed),
// shards equal the tensors the client wrote, the update lock keeps syncs and updates apart,
// disconnects, re-registration, sync requests, and the shared memory left behind (none).
#include "trainer_agent/source/shm_source.h"

#include <dirent.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "common/cuda_ipc.h"
#include "tools/synth/testing/world.h"
#include "trainer_agent/source/dir_source.h"
#include "trainer_client/protocol.h"
#include "trainer_client/wsync_trainer_client.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr uint64_t kSeed = 20261121;

// /dev/shm entries of this process's segments.
std::vector<std::string> OurSegments() {
  std::vector<std::string> out;
  const std::string mark = absl::StrCat(".", getpid(), ".");
  for (const auto& e : fs::directory_iterator("/dev/shm")) {
    const std::string n = e.path().filename().string();
    if (absl::StartsWith(n, "wsync.shmtest") && n.find(mark) != std::string::npos) out.push_back(n);
  }
  return out;
}

class ShmSourceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(::testing::TempDir() + "/shm_source_model");
    fs::remove_all(*dir_);
    auto m = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kQwen3Moe), kSeed);
    ASSERT_TRUE(m.ok()) << m.status();
    // TP 2, EP 2, DP 1: 2 ranks; this test plays rank 1.
    auto stats = tools::WriteMegatronSource(m->config_json, m->config, m->weights,
                                            tools::testing::Parallel(2, 1, 2, 1, 1), *dir_);
    ASSERT_TRUE(stats.ok()) << stats.status();
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override {
    runtime_ = ::testing::TempDir() + "/shm_rt_" + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(runtime_);
    setenv("WSYNC_RUNTIME_DIR", runtime_.c_str(), 1);
    auto d = DirSource::Open(*dir_);
    ASSERT_TRUE(d.ok()) << d.status();
    dir_source_ = std::make_unique<DirSource>(std::move(*d));
    auto shard = dir_source_->OpenRank(kRank);
    ASSERT_TRUE(shard.ok());
    expected_ = std::move(*shard);
    config_ = ReadText(*dir_ + "/config.json");
    parallel_ = ReadText(*dir_ + "/parallel.json");
    auto src = ShmSource::Start({.name = "shmtest",
                                 .rank = kRank,
                                 .world_size = 2,
                                 .runtime_dir = runtime_,
                                 .lock_timeout = absl::Milliseconds(300)});
    ASSERT_TRUE(src.ok()) << src.status();
    source_ = std::move(*src);
  }
  void TearDown() override {
    for (wsync_client* c : clients_) wsync_client_close(c);
    source_.reset();
    EXPECT_THAT(OurSegments(), ::testing::IsEmpty()) << "shared memory left behind";
    fs::remove_all(runtime_);
  }
  static std::string ReadText(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  wsync_client* Open() {
    wsync_client* c = nullptr;
    EXPECT_EQ(wsync_client_open("shmtest", kRank, 5000, &c), WSYNC_OK) << wsync_last_error();
    clients_.push_back(c);
    return c;
  }
  // Declares rank 1's tensors (optionally changed by `edit`), registers and fills them.
  int DeclareAndRegister(wsync_client* c,
                         const std::function<void(std::string&, std::string&, std::vector<int64_t>&)>& edit = nullptr) {
    for (size_t i = 0; i < expected_.params.size(); ++i) {
      std::string name = expected_.params[i].local_name;
      std::string dtype(SafetensorsName(expected_.tensors[i].dtype()));
      std::vector<int64_t> shape(expected_.tensors[i].shape().begin(), expected_.tensors[i].shape().end());
      if (edit) edit(name, dtype, shape);
      if (name.empty()) continue;
      const int rc =
          wsync_client_add_tensor(c, name.c_str(), dtype.c_str(), shape.data(), static_cast<int>(shape.size()));
      if (rc != WSYNC_OK) return rc;
    }
    const int rc = wsync_client_register(c, config_.c_str(), parallel_.c_str(), 10000);
    if (rc != WSYNC_OK) return rc;
    Update(c, 0);
    return WSYNC_OK;
  }
  // Writes the expected tensors, each byte plus `delta`.
  void Fill(wsync_client* c, int delta) {
    for (size_t i = 0; i < expected_.params.size(); ++i) {
      uint64_t n = 0;
      auto* p = static_cast<unsigned char*>(wsync_client_tensor(c, expected_.params[i].local_name.c_str(), &n));
      ASSERT_NE(p, nullptr) << wsync_last_error();
      ASSERT_EQ(n, expected_.tensors[i].nbytes());
      const auto* src = reinterpret_cast<const unsigned char*>(expected_.tensors[i].data());
      for (uint64_t k = 0; k < n; ++k) p[k] = static_cast<unsigned char>(src[k] + delta);
    }
  }
  void Update(wsync_client* c, int delta) {
    ASSERT_EQ(wsync_client_begin_update(c, 5000), WSYNC_OK) << wsync_last_error();
    Fill(c, delta);
    ASSERT_EQ(wsync_client_end_update(c), WSYNC_OK);
  }
  // Every byte of the shard equals the expected tensor's plus `delta`.
  void ExpectShard(const RankShard& s, int delta) {
    ASSERT_EQ(s.params.size(), expected_.params.size());
    for (size_t i = 0; i < s.params.size(); ++i) {
      ASSERT_EQ(s.params[i].local_name, expected_.params[i].local_name);
      ASSERT_EQ(s.tensors[i].nbytes(), expected_.tensors[i].nbytes());
      const auto* got = reinterpret_cast<const unsigned char*>(s.tensors[i].data());
      const auto* want = reinterpret_cast<const unsigned char*>(expected_.tensors[i].data());
      size_t bad = 0;
      for (size_t k = 0; k < s.tensors[i].nbytes(); ++k) bad += got[k] != static_cast<unsigned char>(want[k] + delta);
      EXPECT_EQ(bad, 0u) << s.params[i].local_name;
    }
  }

  static constexpr int kRank = 1;
  static std::string* dir_;
  std::string runtime_, config_, parallel_;
  std::unique_ptr<DirSource> dir_source_;
  RankShard expected_;
  std::unique_ptr<ShmSource> source_;
  std::vector<wsync_client*> clients_;
};
std::string* ShmSourceTest::dir_ = nullptr;

TEST_F(ShmSourceTest, RegisteredTensorsAreTheShardAndUpdatesAreSeenNextTime) {
  EXPECT_TRUE(absl::IsDeadlineExceeded(source_->WaitForRegistration(absl::Milliseconds(50), nullptr)));
  EXPECT_TRUE(absl::IsFailedPrecondition(source_->OpenRank(kRank).status()));
  wsync_client* c = Open();
  ASSERT_EQ(DeclareAndRegister(c), WSYNC_OK) << wsync_last_error();
  ASSERT_TRUE(source_->WaitForRegistration(absl::Seconds(5), nullptr).ok());
  EXPECT_EQ(source_->layout().world_size(), 2);
  EXPECT_EQ(source_->config_json(), config_);
  EXPECT_EQ(source_->Describe(), "shm:shmtest");
  struct stat st;
  ASSERT_EQ(stat(source_->socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat(runtime_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_THAT(OurSegments(), ::testing::IsEmpty()) << "the segment name is unlinked once both sides hold it";
  {
    auto shard = source_->OpenRank(kRank);
    ASSERT_TRUE(shard.ok()) << shard.status();
    ExpectShard(*shard, 0);
  }
  // The trainer updates in place; the next shard sees it.
  Update(c, 3);
  auto shard = source_->OpenRank(kRank);
  ASSERT_TRUE(shard.ok());
  ExpectShard(*shard, 3);
  EXPECT_TRUE(absl::IsInvalidArgument(source_->OpenRank(0).status()));
}

TEST_F(ShmSourceTest, TheUpdateLockKeepsSyncsAndUpdatesApart) {
  wsync_client* c = Open();
  ASSERT_EQ(DeclareAndRegister(c), WSYNC_OK) << wsync_last_error();
  {
    auto shard = source_->OpenRank(kRank);  // a sync is reading
    ASSERT_TRUE(shard.ok());
    RankShard copy = *shard;  // copies share the lease
    EXPECT_EQ(wsync_client_begin_update(c, 100), WSYNC_DEADLINE_EXCEEDED);
    EXPECT_THAT(wsync_last_error(), HasSubstr("a sync kept reading"));
    shard->backing.reset();
    EXPECT_EQ(wsync_client_begin_update(c, 100), WSYNC_DEADLINE_EXCEEDED) << "the copy still holds the lease";
  }
  ASSERT_EQ(wsync_client_begin_update(c, 1000), WSYNC_OK);
  EXPECT_EQ(wsync_client_begin_update(c, 0), WSYNC_FAILED_PRECONDITION);
  // A sync while the trainer writes waits for lock_timeout (300 ms here), then names the process.
  auto blocked = source_->OpenRank(kRank);
  EXPECT_TRUE(absl::IsDeadlineExceeded(blocked.status())) << blocked.status();
  EXPECT_THAT(blocked.status().message(), HasSubstr(absl::StrCat("pid ", getpid())));
  // ... and proceeds as soon as the update ends.
  std::thread trainer([c] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    wsync_client_end_update(c);
  });
  auto shard = source_->OpenRank(kRank);
  trainer.join();
  EXPECT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(wsync_client_request_sync(c, 1, 1, 0, nullptr), WSYNC_UNAVAILABLE) << "no requester installed yet";
}

TEST_F(ShmSourceTest, BadRegistrationsAreNamedAndChangeNothing) {
  wsync_client* c = Open();
  const std::string victim = expected_.params[3].local_name;
  struct Case {
    const char* what;
    std::function<void(std::string&, std::string&, std::vector<int64_t>&)> edit;
    int code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"missing",
       [&](std::string& n, std::string&, std::vector<int64_t>&) {
         if (n == victim) n.clear();
       },
       WSYNC_INVALID_ARGUMENT, victim},
      {"misshaped",
       [&](std::string& n, std::string&, std::vector<int64_t>& s) {
         if (n == victim) s[0] += 1;
       },
       WSYNC_INVALID_ARGUMENT, victim},
      {"wrong dtype",
       [&](std::string& n, std::string& d, std::vector<int64_t>&) {
         if (n == victim) d = "F16";
       },
       WSYNC_INVALID_ARGUMENT, victim},
      {"unknown",
       [&](std::string& n, std::string&, std::vector<int64_t>&) {
         if (n == victim) n += ".extra";
       },
       WSYNC_INVALID_ARGUMENT, victim + ".extra"},
  };
  for (const Case& k : cases) {
    wsync_client* fresh = Open();
    EXPECT_EQ(DeclareAndRegister(fresh, k.edit), k.code) << k.what;
    EXPECT_THAT(wsync_last_error(), HasSubstr(k.message)) << k.what;
    EXPECT_TRUE(absl::IsFailedPrecondition(source_->OpenRank(kRank).status())) << k.what << ": nothing registered";
  }
  // Bad configs: another world size, unparsable JSON.
  const std::string good_parallel = parallel_;
  parallel_ =
      absl::StrReplaceAll(good_parallel, {{"\"world_size\": 2", "\"world_size\": 4"}, {"\"dp\": 1", "\"dp\": 2"}});
  ASSERT_NE(parallel_, good_parallel);
  EXPECT_NE(DeclareAndRegister(Open()), WSYNC_OK);
  EXPECT_THAT(wsync_last_error(), HasSubstr("world_size"));
  parallel_ = "{";
  EXPECT_EQ(DeclareAndRegister(Open()), WSYNC_INVALID_ARGUMENT);
  parallel_ = good_parallel;
  // Client-side refusals.
  int64_t shape[1] = {4};
  EXPECT_EQ(wsync_client_add_tensor(c, "x", "bfloat16", shape, 1), WSYNC_INVALID_ARGUMENT);
  EXPECT_EQ(wsync_client_add_tensor(c, "x", "BF16", shape, 9), WSYNC_INVALID_ARGUMENT);
  ASSERT_EQ(wsync_client_add_tensor(c, "x", "BF16", shape, 1), WSYNC_OK);
  EXPECT_EQ(wsync_client_add_tensor(c, "x", "BF16", shape, 1), WSYNC_ALREADY_EXISTS);
  EXPECT_EQ(wsync_client_tensor(c, "x", nullptr), nullptr);
  // Finally a good registration on a new connection works.
  ASSERT_EQ(DeclareAndRegister(Open()), WSYNC_OK) << wsync_last_error();
  auto shard = source_->OpenRank(kRank);
  ASSERT_TRUE(shard.ok());
  ExpectShard(*shard, 0);
}

TEST_F(ShmSourceTest, OneLiveClientPerRankAndADisconnectStopsSyncs) {
  wsync_client* a = Open();
  ASSERT_EQ(DeclareAndRegister(a), WSYNC_OK) << wsync_last_error();
  wsync_client* b = Open();
  EXPECT_EQ(DeclareAndRegister(b), WSYNC_ALREADY_EXISTS);
  EXPECT_THAT(wsync_last_error(), HasSubstr("still connected"));
  auto held = source_->OpenRank(kRank);  // a shard in use survives the disconnect
  ASSERT_TRUE(held.ok());
  wsync_client_close(a);
  clients_.erase(std::find(clients_.begin(), clients_.end(), a));
  absl::Status s;
  for (int i = 0; i < 200; ++i) {  // the agent notices the disconnect asynchronously
    s = source_->OpenRank(kRank).status();
    if (!s.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("disconnected"));
  ExpectShard(*held, 0);
  // A restarted trainer registers again.
  wsync_client* c = Open();
  ASSERT_EQ(DeclareAndRegister(c), WSYNC_OK) << wsync_last_error();
  Update(c, 1);
  auto shard = source_->OpenRank(kRank);
  ASSERT_TRUE(shard.ok()) << shard.status();
  ExpectShard(*shard, 1);
}

TEST_F(ShmSourceTest, SyncRequestsReachTheRequester) {
  wsync_client* c = Open();
  EXPECT_EQ(wsync_client_request_sync(c, 1, 0, 1000, nullptr), WSYNC_FAILED_PRECONDITION) << "before register";
  ASSERT_EQ(DeclareAndRegister(c), WSYNC_OK) << wsync_last_error();
  std::vector<std::tuple<uint64_t, bool, absl::Duration>> calls;
  source_->SetSyncRequester(
      [&](uint64_t version, bool wait, absl::Duration timeout) -> absl::StatusOr<SyncRequestResult> {
        calls.emplace_back(version, wait, timeout);
        if (version == 13)
          return absl::FailedPreconditionError("version 13 is not newer than the published version 20");
        return SyncRequestResult{.sync_id = 7, .version = version, .coalesced = version == 5};
      });
  wsync_sync_info info{};
  ASSERT_EQ(wsync_client_request_sync(c, 5, 1, 2500, &info), WSYNC_OK) << wsync_last_error();
  EXPECT_EQ(info.sync_id, 7u);
  EXPECT_EQ(info.version, 5u);
  EXPECT_EQ(info.coalesced, 1);
  EXPECT_EQ(wsync_client_request_sync(c, 13, 0, -1, &info), WSYNC_FAILED_PRECONDITION);
  EXPECT_THAT(wsync_last_error(), HasSubstr("not newer"));
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0], std::make_tuple(uint64_t{5}, true, absl::Milliseconds(2500)));
  EXPECT_EQ(calls[1], std::make_tuple(uint64_t{13}, false, absl::InfiniteDuration()));
  // A request while the weights are being written is refused by the client.
  ASSERT_EQ(wsync_client_begin_update(c, 1000), WSYNC_OK);
  EXPECT_EQ(wsync_client_request_sync(c, 6, 0, 1000, nullptr), WSYNC_FAILED_PRECONDITION);
  EXPECT_EQ(calls.size(), 2u);
  ASSERT_EQ(wsync_client_end_update(c), WSYNC_OK);
}

TEST_F(ShmSourceTest, ASyncReadsEachRankAtTheVersionItDeclaredNeverTorn) {
  wsync_client* c = Open();
  ASSERT_EQ(DeclareAndRegister(c), WSYNC_OK) << wsync_last_error();
  source_->SetSyncRequester([](uint64_t version, bool, absl::Duration) -> absl::StatusOr<SyncRequestResult> {
    return SyncRequestResult{.sync_id = version, .version = version};
  });
  // The sync of version 1 starts before this rank has declared it: it waits for the declaration.
  absl::StatusOr<RankShard> early = absl::UnknownError("not run");
  std::thread sync([&] { early = source_->OpenRank(kRank, 1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_EQ(wsync_client_request_sync(c, 1, 0, 1000, nullptr), WSYNC_OK) << wsync_last_error();
  sync.join();
  ASSERT_TRUE(early.ok()) << early.status();
  ExpectShard(*early, 0);
  early->backing.reset();
  // Written again but not declared: reading it as version 1 would publish a different step.
  Update(c, 2);
  auto torn = source_->OpenRank(kRank, 1);
  EXPECT_TRUE(absl::IsFailedPrecondition(torn.status())) << torn.status();
  EXPECT_THAT(torn.status().message(), HasSubstr("changed after it declared version 1"));
  ASSERT_EQ(wsync_client_request_sync(c, 2, 0, 1000, nullptr), WSYNC_OK);
  auto stale = source_->OpenRank(kRank, 1);
  EXPECT_TRUE(absl::IsFailedPrecondition(stale.status()));
  EXPECT_THAT(stale.status().message(), HasSubstr("already declared version 2"));
  auto two = source_->OpenRank(kRank, 2);
  ASSERT_TRUE(two.ok()) << two.status();
  ExpectShard(*two, 2);
  two->backing.reset();
  // A version the trainer never declares (e.g. a sync triggered by an operator) times out, named.
  auto never = source_->OpenRank(kRank, 3);
  EXPECT_TRUE(absl::IsDeadlineExceeded(never.status())) << never.status();
  EXPECT_THAT(never.status().message(), HasSubstr("has not declared version 3"));
}

TEST_F(ShmSourceTest, CudaTensorsNeedACudaBuildAndADevice) {
  wsync_client* c = Open();
  const char handle[64] = {1, 2, 3};
  int64_t shape[1] = {8};
  EXPECT_EQ(wsync_client_add_cuda_tensor(c, "x", "BF16", shape, 1, handle, 63, 0, 0), WSYNC_INVALID_ARGUMENT);
  // Rank 1's first parameter, declared as a device tensor; the rest on the host.
  bool first = true;
  ASSERT_EQ(
      wsync_client_add_cuda_tensor(
          c, expected_.params[0].local_name.c_str(), std::string(SafetensorsName(expected_.tensors[0].dtype())).c_str(),
          std::vector<int64_t>(expected_.tensors[0].shape().begin(), expected_.tensors[0].shape().end()).data(),
          static_cast<int>(expected_.tensors[0].shape().size()), handle, 64, 0, 0),
      WSYNC_OK);
  const int rc = DeclareAndRegister(c, [&](std::string& n, std::string&, std::vector<int64_t>&) {
    if (first) n.clear();
    first = false;
  });
  if (CudaIpcCompiled()) {
    EXPECT_EQ(rc, WSYNC_FAILED_PRECONDITION) << "no GPU (or a bogus handle) here";
  } else {
    EXPECT_EQ(rc, WSYNC_UNIMPLEMENTED);
    EXPECT_THAT(wsync_last_error(), HasSubstr("built with CUDA"));
  }
  EXPECT_THAT(wsync_last_error(), HasSubstr(expected_.params[0].local_name));
}

TEST_F(ShmSourceTest, SegmentsThatAreNotPrivateOrTooSmallAreRefused) {
  // A hand-made client (the library always creates 0600 segments of the right size).
  auto raw_register = [&](mode_t mode, uint64_t size, uint64_t claimed, bool header = true) {
    const std::string seg = absl::StrCat("/wsync.shmtest.raw.", getpid(), ".1");
    const int fd = shm_open(seg.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0);
    fchmod(fd, mode);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    if (header) {
      void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      EXPECT_NE(p, MAP_FAILED);
      static_cast<trainer_client::SegmentHeader*>(p)->magic = trainer_client::kSegmentMagic;
      munmap(p, size);
    }
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, source_->socket_path().c_str());
    EXPECT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    trainer_client::RegisterRequest req;
    req.source_name = "shmtest";
    req.rank = kRank;
    req.config_json = config_;
    req.parallel_json = parallel_;
    req.segment = seg;
    req.segment_bytes = claimed;
    std::string error, payload;
    EXPECT_EQ(trainer_client::SendFrame(s, trainer_client::MsgType::kRegister, trainer_client::Encode(req), -1, &error),
              0);
    trainer_client::MsgType type;
    EXPECT_EQ(trainer_client::RecvFrame(s, &type, &payload, trainer_client::NowMs() + 5000, &error), 0);
    trainer_client::Reply reply;
    EXPECT_TRUE(trainer_client::Decode(payload, &reply, &error));
    close(s);
    close(fd);
    shm_unlink(seg.c_str());
    return reply;
  };
  auto r = raw_register(0644, 4096, 4096);
  EXPECT_EQ(r.code, WSYNC_PERMISSION_DENIED);
  EXPECT_THAT(r.message, HasSubstr("mode 0644"));
  r = raw_register(0600, 4096, 8192);
  EXPECT_EQ(r.code, WSYNC_INVALID_ARGUMENT);
  EXPECT_THAT(r.message, HasSubstr("has 4096 bytes"));
  r = raw_register(0600, 4096, 4096, /*header=*/false);
  EXPECT_EQ(r.code, WSYNC_INVALID_ARGUMENT);
  EXPECT_THAT(r.message, HasSubstr("no wsync segment header"));
  r = raw_register(0600, 4096, 4096);  // right segment, no tensors: the plan's are missing
  EXPECT_EQ(r.code, WSYNC_INVALID_ARGUMENT);
  EXPECT_THAT(r.message, HasSubstr("missing"));
}

TEST(ShmSourceStart, RefusesBadNamesSharedDirectoriesAndASecondAgent) {
  const std::string rt = ::testing::TempDir() + "/shm_rt_start";
  fs::remove_all(rt);
  EXPECT_TRUE(absl::IsInvalidArgument(ShmSource::Start({.name = "a/b", .runtime_dir = rt}).status()));
  auto first = ShmSource::Start({.name = "job", .rank = 0, .runtime_dir = rt});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ShmSource::Start({.name = "job", .rank = 0, .runtime_dir = rt});
  EXPECT_TRUE(absl::IsAlreadyExists(second.status())) << second.status();
  const std::string path = (*first)->socket_path();
  first->reset();
  EXPECT_FALSE(fs::exists(path)) << "the socket is removed at shutdown";
  // A stale socket file (an agent that died) is replaced.
  {
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, path.c_str());
    ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    close(s);
  }
  auto third = ShmSource::Start({.name = "job", .rank = 0, .runtime_dir = rt});
  EXPECT_TRUE(third.ok()) << third.status();
  third->reset();
  fs::remove_all(rt);
}

}  // namespace
}  // namespace wsync::trainer_agent
