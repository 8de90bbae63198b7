// Multi-process tests of the store-bootstrapped data plane (Gloo over TCP, and shm: one segment on
// one host): the test hosts the rendezvous store (as the coordinator does) and starts every member
// as a separate process (wsync-comm-member), then checks each one's verdict and that nothing hangs.
// Every scenario runs on both backends, and on the shm backend's device ring where a GPU is.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "comm/testing/local_group.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dispatch.h"

extern char** environ;

namespace wsync {
namespace {

// wsync-comm-member: where the build put it, else beside this test binary (the device bundle's bin/).
std::string MemberBinary() {
  if (access(WSYNC_COMM_MEMBER, X_OK) == 0) return WSYNC_COMM_MEMBER;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return (self.parent_path() / "wsync-comm-member").string();
}

struct Member {
  pid_t pid = -1;
  int rank = 0;
  std::string log;
  int status = -1;
};

class CommGroupTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "shm_device") {
      const bool gpu = kernels::GpuAvailable();
      const bool without_gpu =
          absl::StrContains(::testing::UnitTest::GetInstance()->current_test_info()->name(), "WithoutAGpu");
      if (gpu && without_gpu) GTEST_SKIP() << "a GPU is present: the device ring forms";
      if (!gpu && !without_gpu) GTEST_SKIP() << "no GPU: the device ring's collectives run on the GPU machine";
    }
    auto server = comm::StoreServer::Start(&store_, "127.0.0.1:0");
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  Member Spawn(const std::string& group, int rank, int size, const std::string& scenario) {
    Member m;
    m.rank = rank;
    m.log = ::testing::TempDir() + absl::StrCat("member-", GetParam(), "-", group, "-", rank, ".log");
    std::vector<std::string> args = {MemberBinary(),
                                     "--store",
                                     server_->address(),
                                     "--group",
                                     group,
                                     "--rank",
                                     std::to_string(rank),
                                     "--size",
                                     std::to_string(size),
                                     "--scenario",
                                     scenario,
                                     "--backend",
                                     GetParam()};
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, m.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    EXPECT_EQ(posix_spawn(&m.pid, argv[0], &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    return m;
  }

  static std::string Log(const Member& m) {
    std::ifstream f(m.log);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

  // Waits for all members; kills the rest and fails if `limit` passes.
  static void WaitAll(std::vector<Member>& members, absl::Duration limit) {
    const absl::Time deadline = absl::Now() + limit;
    size_t left = members.size();
    while (left > 0) {
      for (auto& m : members) {
        if (m.status != -1 || m.pid < 0) continue;
        int st = 0;
        if (waitpid(m.pid, &st, WNOHANG) == m.pid) {
          m.status = st;
          --left;
        }
      }
      if (left > 0 && absl::Now() > deadline) {
        for (auto& m : members) {
          if (m.status == -1) kill(m.pid, SIGKILL);
        }
        ADD_FAILURE() << "members still running after " << limit << ": a hang";
        for (auto& m : members) {
          if (m.status == -1) waitpid(m.pid, &m.status, 0);
        }
        return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  static void ExpectAllPassed(const std::vector<Member>& members) {
    for (const auto& m : members) {
      EXPECT_TRUE(WIFEXITED(m.status) && WEXITSTATUS(m.status) == 0)
          << "member " << m.rank
          << (WIFSIGNALED(m.status) ? absl::StrCat(" killed by signal ", WTERMSIG(m.status)) : "") << ":\n"
          << Log(m);
    }
  }

  std::vector<Member> Start(const std::string& group, int size, const std::string& scenario, int launched = -1) {
    std::vector<Member> ms;
    for (int r = 0; r < (launched < 0 ? size : launched); ++r) ms.push_back(Spawn(group, r, size, scenario));
    return ms;
  }

  comm::MemoryStore store_;
  std::unique_ptr<comm::StoreServer> server_;
};

TEST_P(CommGroupTest, CollectivesOnTwoThreeAndFiveMembers) {
  for (int n : {2, 3, 5}) {
    auto ms = Start(absl::StrCat("coll", n), n, "collectives");
    WaitAll(ms, absl::Seconds(120));
    ExpectAllPassed(ms);
  }
}

TEST_P(CommGroupTest, MoreThanTwoGiBSplitCorrectly) {
  auto ms = Start("big", 2, "big");
  WaitAll(ms, absl::Seconds(240));
  ExpectAllPassed(ms);
}

TEST_P(CommGroupTest, AMemberThatNeverJoinsIsNamedWithinTheTimeout) {
  auto ms = Start("absent", 3, "never_joins", /*launched=*/2);
  WaitAll(ms, absl::Seconds(20));
  ExpectAllPassed(ms);
}

TEST_P(CommGroupTest, AMemberKilledMidBroadcastGivesUnavailable) {
  auto ms = Start("killed", 3, "killed");
  // Wait until rank 1 is broadcasting, then kill it.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (Log(ms[1]).find("READY") == std::string::npos && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time killed = absl::Now();
  kill(ms[1].pid, SIGKILL);
  std::vector<Member> survivors = {ms[0], ms[2]};
  WaitAll(survivors, absl::Seconds(20));
  EXPECT_LT(absl::Now() - killed, absl::Seconds(15)) << "survivors must notice the loss, not wait out the 60 s timeout";
  ExpectAllPassed(survivors);
  waitpid(ms[1].pid, nullptr, 0);
}

TEST_P(CommGroupTest, AbortFromAnotherThreadMidBroadcast) {
  auto ms = Start("abort", 3, "abort");
  WaitAll(ms, absl::Seconds(30));
  ExpectAllPassed(ms);
}

TEST_P(CommGroupTest, ASilentMemberTimesOut) {
  auto ms = Start("silent", 3, "timeout");
  WaitAll(ms, absl::Seconds(30));
  ExpectAllPassed(ms);
}

// A device ring rank 0 cannot allocate (no GPU here): every member fails formation at once,
// naming why, instead of waiting out its join timeout for a ring that will not come.
TEST_P(CommGroupTest, ADeviceRingWithoutAGpuFailsEveryMemberAtOnce) {
  if (GetParam() != "shm_device") GTEST_SKIP() << "the shm backend's device ring only";
  auto ms = Start("no-device", 3, "no_device");
  WaitAll(ms, absl::Seconds(20));
  ExpectAllPassed(ms);
}

// A member that cannot open rank 0's device ring (another GPU without peer access; here a failpoint
// on rank 1): the group forms on the host ring instead, on every member, and moves every byte.
TEST_P(CommGroupTest, AMemberThatCannotOpenTheDeviceRingMovesTheGroupToTheHostRing) {
  if (GetParam() != "shm_device") GTEST_SKIP() << "the shm backend's device ring only";
  auto ms = Start("no-peer", 3, "no_peer");
  WaitAll(ms, absl::Seconds(60));
  ExpectAllPassed(ms);
}

INSTANTIATE_TEST_SUITE_P(Backends, CommGroupTest, ::testing::Values("gloo", "shm", "shm_device"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(CommFactoryTest, BackendsAndErrors) {
  EXPECT_TRUE(comm::BackendCompiledIn(comm::Backend::kGloo));
  EXPECT_TRUE(comm::BackendCompiledIn(comm::Backend::kMpi));
  EXPECT_EQ(*comm::ParseBackend("gloo"), comm::Backend::kGloo);
  EXPECT_EQ(*comm::ParseBackend("shm"), comm::Backend::kShm);
  EXPECT_TRUE(comm::BackendCompiledIn(comm::Backend::kShm));
  EXPECT_EQ(*comm::ParseBackend("cuda-ipc"), comm::Backend::kCudaIpc);
  EXPECT_EQ(comm::BackendName(comm::Backend::kCudaIpc), "cuda-ipc");
  EXPECT_EQ(comm::BackendCompiledIn(comm::Backend::kCudaIpc), CudaIpcCompiled());
  EXPECT_TRUE(comm::MovesDeviceMemory(comm::Backend::kCudaIpc) && comm::MovesDeviceMemory(comm::Backend::kNccl));
  EXPECT_FALSE(comm::MovesDeviceMemory(comm::Backend::kShm) || comm::MovesDeviceMemory(comm::Backend::kGloo));
  EXPECT_TRUE(absl::IsInvalidArgument(comm::ParseBackend("tcp").status()));
  comm::GroupOptions opts;
  opts.name = "x";
  EXPECT_TRUE(absl::IsInvalidArgument(comm::CreateGroup(comm::Backend::kGloo, opts).status()));  // no store
  comm::MemoryStore store;
  opts.store = &store;
  opts.rank = 2;
  opts.size = 2;
  EXPECT_TRUE(absl::IsInvalidArgument(comm::CreateGroup(comm::Backend::kGloo, opts).status()));  // rank out of range
  EXPECT_TRUE(absl::IsInvalidArgument(comm::CreateGroup(comm::Backend::kMpi, opts).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(comm::CreateGroup(comm::Backend::kShm, opts).status()));
}

// Members that do not share a host (here: rank 1 announces another identity) are refused, naming both.
TEST(CommFactoryTest, ShmRefusesMembersOnAnotherHost) {
  comm::MemoryStore store;
  ASSERT_TRUE(store.Set("cross/joined/1", "another-boot-id/dev42/uid0").ok());
  comm::GroupOptions opts;
  opts.store = &store;
  opts.name = "cross";
  opts.size = 2;
  opts.join_timeout = absl::Seconds(5);
  auto comm = comm::CreateGroup(comm::Backend::kShm, opts);
  EXPECT_TRUE(absl::IsFailedPrecondition(comm.status())) << comm.status();
  EXPECT_NE(comm.status().message().find("another-boot-id"), std::string::npos) << comm.status();
}

TEST(CommFactoryTest, SingleMemberGroupWorksInProcess) {
  for (comm::Backend backend : {comm::Backend::kGloo, comm::Backend::kShm}) {
    SCOPED_TRACE(comm::BackendName(backend));
    comm::MemoryStore store;
    comm::GroupOptions opts;
    opts.store = &store;
    opts.name = "solo";
    auto comm = comm::CreateGroup(backend, opts);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::vector<char> buf(10, 3);
    comm::MutableBytes b{buf.data(), buf.size()};
    EXPECT_TRUE(comm::Await((*comm)->Broadcast({&b, 1}, 0)).ok());
    EXPECT_TRUE(comm::Await((*comm)->Barrier()).ok());
    (*comm)->Abort("done");
    absl::Status later = comm::Await((*comm)->Barrier());
    EXPECT_TRUE(absl::IsAborted(later)) << later;
    EXPECT_NE(later.message().find("done"), std::string::npos) << later;
  }
}

// Gloo's Split (the world of trainer agents started without mpirun): five members, colours by
// parity, keys reversing the order; each subgroup holds exactly its colour, ordered by key, and
// runs a collective. A subgroup without a name is refused on the member that asked.
TEST(CommFactoryTest, GlooSplitsByColourOrderedByKey) {
  comm::MemoryStore store;
  auto formed = comm::testing::MakeLocalGroup(store, "split", 5);
  ASSERT_TRUE(formed.ok()) << formed.status();
  auto& world = *formed;
  std::vector<std::vector<int>> members(5);
  std::vector<absl::Status> status(5);
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < 5; ++r)
      threads.emplace_back([&, r] {
        auto sub = world[r]->Split(r % 2, -r, absl::StrCat("parity", r % 2));
        if (!sub.ok()) {
          status[r] = sub.status();
          return;
        }
        std::vector<int> got((*sub)->size());
        comm::ConstBytes in{&r, sizeof(int)};
        comm::MutableBytes out{got.data(), got.size() * sizeof(int)};
        status[r] = comm::Await((*sub)->AllGather({&in, 1}, {&out, 1}));
        members[r] = got;
        EXPECT_EQ((*sub)->group(), absl::StrCat("split/parity", r % 2));
      });
  }
  for (int r = 0; r < 5; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(members[r], (r % 2 == 0 ? std::vector<int>{4, 2, 0} : std::vector<int>{3, 1})) << r;
  }
  auto solo = comm::CreateGroup(comm::Backend::kGloo, comm::testing::LocalMemberOptions(store, "one", 0, 1));
  ASSERT_TRUE(solo.ok()) << solo.status();
  auto unnamed = (*solo)->Split(0, 0, "");
  EXPECT_TRUE(absl::IsInvalidArgument(unnamed.status())) << unnamed.status();
}

// A member that joined the rendezvous and then went away (an agent that aborted its sync): the one
// still forming the group stops when its `cancelled` says so, while joining and after it (Gloo's
// mesh, shm's mapping, NCCL's ncclCommInitRankConfig waiting for the member's bootstrap), not
// after its join timeout. The peer "joins" with rank 0's own value (its address, or for shm its
// host identity), copied once rank 0 has written it.
void ExpectACancelledFormationEndsAtOnce(comm::Backend backend) {
  for (const bool peer_joined : {false, true}) {
    SCOPED_TRACE(absl::StrCat(comm::BackendName(backend), peer_joined ? ", after joining" : ", joining"));
    comm::MemoryStore store;
    std::atomic<bool> cancel{false};
    comm::GroupOptions opts;
    opts.store = &store;
    opts.name = "gone";
    opts.size = 2;
    opts.join_timeout = absl::Seconds(30);
    opts.cancelled = [&cancel] { return cancel.load(); };
    std::thread peer([&] {
      if (peer_joined) {
        auto mine = store.Get("gone/joined/0", absl::Seconds(10));
        if (mine.ok()) (void)store.Set("gone/joined/1", *mine);
      }
      absl::SleepFor(absl::Milliseconds(300));
      cancel = true;
    });
    const absl::Time t0 = absl::Now();
    auto comm = comm::CreateGroup(backend, opts);
    const absl::Duration took = absl::Now() - t0;
    peer.join();
    EXPECT_TRUE(absl::IsCancelled(comm.status())) << comm.status();
    if (peer_joined) {
      EXPECT_EQ(comm.status().message().find("joining group"), std::string::npos) << comm.status();
    } else {
      EXPECT_NE(comm.status().message().find("joining group"), std::string::npos) << comm.status();
    }
    EXPECT_LT(took, absl::Seconds(3));
  }
}

TEST(CommFactoryTest, ACancelledFormationEndsAtOnce) {
  ExpectACancelledFormationEndsAtOnce(comm::Backend::kGloo);
  ExpectACancelledFormationEndsAtOnce(comm::Backend::kShm);
}

// NCCL (one GPU is enough): a one-member group forms; then the cancellation above, where after
// joining rank 0 sits in ncclCommInitRankConfig waiting for the member's bootstrap and is aborted
// there. Skips without a GPU.
TEST(CommFactoryTest, NcclFormsAndACancelledNcclFormationEndsAtOnce) {
  if (!comm::BackendCompiledIn(comm::Backend::kNccl)) GTEST_SKIP() << "built without NCCL";
  comm::MemoryStore store;
  comm::GroupOptions opts;
  opts.store = &store;
  opts.name = "nccl-probe";
  auto solo = comm::CreateGroup(comm::Backend::kNccl, opts);
  if (absl::IsFailedPrecondition(solo.status())) GTEST_SKIP() << solo.status();
  ASSERT_TRUE(solo.ok()) << solo.status();
  ExpectACancelledFormationEndsAtOnce(comm::Backend::kNccl);
}

// NCCL over a parent group (the trainer's device gathers): every member takes part in the id
// exchange, so on a host without the GPU each member fails at once (not in NCCL's formation),
// naming the first member that cannot join; with one GPU a one-member group forms over a
// one-member parent and gathers device memory. Another backend is refused.
TEST(CommFactoryTest, NcclOverAParentGroupFailsOnEveryMemberWithoutItsGpu) {
  comm::MemoryStore store;
  auto parent = comm::testing::MakeLocalGroup(store, "over-parent", 2);
  ASSERT_TRUE(parent.ok()) << parent.status();
  comm::GroupOptions o;
  o.name = "over-gloo";
  auto gloo = comm::CreateGroupOver(comm::Backend::kGloo, *(*parent)[0], o);
  EXPECT_EQ(gloo.status().code(), absl::StatusCode::kUnimplemented) << gloo.status();
  if (!comm::BackendCompiledIn(comm::Backend::kNccl)) GTEST_SKIP() << "built without NCCL";
  // Member 1 asks for a GPU no host has; member 0 for cuda:0 (there or not).
  std::vector<absl::Status> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      comm::GroupOptions g;
      g.name = "nccl-over";
      g.cuda_device = r == 0 ? 0 : 4096;
      g.join_timeout = absl::Seconds(20);
      got[static_cast<size_t>(r)] =
          comm::CreateGroupOver(comm::Backend::kNccl, *(*parent)[static_cast<size_t>(r)], g).status();
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    const absl::Status& s = got[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << "member " << r << ": " << s;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("nccl group \"nccl-over\" over gloo group")) << s;
  }
  EXPECT_THAT(got[1].message(), ::testing::HasSubstr("rank 1 has no CUDA device 4096")) << got[1];
  if (kernels::GpuAvailable()) {
    EXPECT_THAT(got[0].message(), ::testing::HasSubstr("rank 1 cannot join")) << got[0];
  } else {
    EXPECT_THAT(got[0].message(), ::testing::HasSubstr("rank 0 has no CUDA device 0")) << got[0];
  }
  for (auto& c : *parent) EXPECT_TRUE(c->Shutdown().ok());
}

TEST(CommFactoryTest, NcclOverAOneMemberParentGathersOnTheGpu) {
  if (!comm::BackendCompiledIn(comm::Backend::kNccl) || !kernels::GpuAvailable()) GTEST_SKIP() << "no NCCL or GPU";
  comm::MemoryStore store;
  auto parent = comm::testing::MakeLocalGroup(store, "over-solo", 1);
  ASSERT_TRUE(parent.ok()) << parent.status();
  comm::GroupOptions g;
  g.name = "nccl-solo";
  auto nccl = comm::CreateGroupOver(comm::Backend::kNccl, *(*parent)[0], g);
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ((*nccl)->space(), MemorySpace::Cuda(0));
  const MemorySpace gpu = MemorySpace::Cuda(0);
  auto in = gpu.Allocate(4096);
  auto out = gpu.Allocate(4096);
  ASSERT_TRUE(in.ok() && out.ok());
  std::vector<std::byte> pattern(4096);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::byte>(i * 7 + 3);
  ASSERT_TRUE(gpu.Copy(in->data(), pattern.data(), pattern.size()).ok());
  comm::ConstBytes cin{in->data(), 4096};
  comm::MutableBytes cout{out->data(), 4096};
  ASSERT_TRUE(comm::Await((*nccl)->AllGather({&cin, 1}, {&cout, 1})).ok());
  std::vector<std::byte> back(4096);
  ASSERT_TRUE(gpu.CopyToHost(back.data(), out->data(), back.size()).ok());
  EXPECT_EQ(back, pattern);
  EXPECT_TRUE((*nccl)->Shutdown().ok());
}

}  // namespace
}  // namespace wsync
