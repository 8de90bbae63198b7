// The MPI backend under a real `mpirun` (ctest runs this with -np 2, 3, 4 and 8): every collective
// on the world and on Split sub-communicators, > 2 GiB counts (np 2), a timeout and an Abort.
// Every rank runs the same gtest cases in the same order, as collectives require.
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "comm/communicator.h"
#include "gtest/gtest.h"
#include "tests/integration/comm_scenarios.h"

namespace wsync {
namespace {

comm::Communicator* world = nullptr;

TEST(CommMpi, CollectivesOnTheWorld) {
  ASSERT_EQ(world->Name(), "mpi");
  absl::Status s = comm::testing::Collectives(*world);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(CommMpi, SplitIntoGroupsLikeTpAndDp) {
  // TP-like: contiguous blocks of 2; DP-like: strided.
  auto tp = world->Split(world->rank() / 2, world->rank(), "tp");
  ASSERT_TRUE(tp.ok()) << tp.status();
  auto dp = world->Split(world->rank() % 2, world->rank(), "dp");
  ASSERT_TRUE(dp.ok()) << dp.status();
  const int n = world->size();
  EXPECT_EQ((*tp)->rank(), world->rank() % 2);
  EXPECT_EQ((*tp)->size(), std::min(2, n - (world->rank() / 2) * 2));
  EXPECT_EQ((*dp)->rank(), world->rank() / 2);
  absl::Status s = comm::testing::Collectives(**tp);
  EXPECT_TRUE(s.ok()) << s;
  s = comm::testing::Collectives(**dp);
  EXPECT_TRUE(s.ok()) << s;
  // Which ranks a sub-communicator's members are: gather the world ranks.
  int me = world->rank();
  std::vector<int> members((*tp)->size());
  comm::ConstBytes in{&me, sizeof(int)};
  comm::MutableBytes out{members.data(), members.size() * sizeof(int)};
  ASSERT_TRUE(comm::Await((*tp)->AllGather({&in, 1}, {&out, 1})).ok());
  for (int r = 0; r < (*tp)->size(); ++r) EXPECT_EQ(members[r], (world->rank() / 2) * 2 + r);
}

TEST(CommMpi, MoreThanTwoGiB) {
  if (world->size() != 2) GTEST_SKIP() << "run with -np 2 (memory)";
  absl::Status s = comm::testing::BigTransfers(*world);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(CommMpi, ALateRankGivesDeadlineExceededAndTheGroupRecovers) {
  auto dup = world->Split(0, world->rank(), "late");
  ASSERT_TRUE(dup.ok()) << dup.status();
  std::vector<char> buf(1 << 20, 1);
  comm::MutableBytes b{buf.data(), buf.size()};
  if (world->rank() == 1) absl::SleepFor(absl::Seconds(2));
  const absl::Time t0 = absl::Now();
  absl::Status s = comm::Await((*dup)->Broadcast({&b, 1}, 0, comm::CollectiveOptions{absl::Milliseconds(500)}));
  const absl::Duration took = absl::Now() - t0;
  if (world->rank() != 1) {
    // Rank 0 (and ranks that depend on rank 1 in MPI's tree) time out; the others may finish.
    if (!s.ok()) {
      EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "Broadcast(root 0")) << s;
      EXPECT_LT(took, absl::Seconds(2));
      // A broken communicator refuses further work at once.
      EXPECT_TRUE(absl::IsAborted(comm::Await((*dup)->Barrier()))) << "after a timeout";
    }
  }
  // Destroying `dup` waits for the abandoned request (rank 1 joins it late), then frees it.
  dup->reset();
  EXPECT_TRUE(comm::Await(world->Barrier()).ok());
}

TEST(CommMpi, AbortFromAnotherThreadDuringABroadcast) {
  auto dup = world->Split(0, world->rank(), "abort");
  ASSERT_TRUE(dup.ok()) << dup.status();
  comm::Communicator* c = dup->get();
  std::vector<char> buf(size_t{64} << 20, 1);
  comm::MutableBytes b{buf.data(), buf.size()};
  if (world->rank() == 1) absl::SleepFor(absl::Seconds(2));  // the root is late: rank 0 waits
  if (world->rank() == 0) {
    // Rank 0 aborts while its broadcast waits for the root.
    std::thread t([c] {
      absl::SleepFor(absl::Milliseconds(300));
      c->Abort("test abort");
    });
    absl::Status s = comm::Await(c->Broadcast({&b, 1}, 1, comm::CollectiveOptions{absl::Seconds(30)}));
    t.join();
    EXPECT_TRUE(absl::IsAborted(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "test abort")) << s;
  } else {
    absl::Status s = comm::Await(c->Broadcast({&b, 1}, 1, comm::CollectiveOptions{absl::Seconds(30)}));
    EXPECT_TRUE(s.ok() || absl::IsDeadlineExceeded(s)) << s;
  }
  dup->reset();
  EXPECT_TRUE(comm::Await(world->Barrier()).ok());
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto w = wsync::comm::CreateMpiWorld();
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
    return 1;
  }
  wsync::world = w->get();
  // Only rank 0 prints gtest's report; every rank's failures still fail the run (exit code).
  if (wsync::world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  w->reset();  // finalizes MPI
  return rc;
}
