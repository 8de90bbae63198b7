// One member of a Gloo, shm (or NCCL) group formed through a rendezvous store, for the
// multi-process data-plane tests (comm_group_test.cc starts several of these, separately, as real
// processes).
//
//   wsync-comm-member --store ADDR --group NAME --rank R --size N --scenario S [--backend gloo]
//
// --backend shm_device (or cuda-ipc): the shm backend with its ring on CUDA device 0 (cuda-ipc).
//
// Scenarios (each checks its own expectations and exits 0 when they hold, 1 otherwise):
//   collectives  Broadcast / AllGather / AllGatherV / AllReduceSum / Barrier over several sizes
//                (0 B, odd sizes, multi-piece), many buffers per call, every byte checked
//   big          > 2 GiB: a Broadcast of 2 GiB + 4097 B and an AllGatherV of 1 GiB + 3 B per rank
//   never_joins  launched with one member missing: formation must fail in time, naming it
//   killed       repeated large broadcasts until a member is killed: survivors see kUnavailable
//   abort        rank 0 aborts from another thread mid-broadcast: it sees kAborted with the
//                reason, the others kUnavailable
//   timeout      rank 1 never calls the broadcast: the others see kDeadlineExceeded in time
//   no_device    (shm_device on a host without a GPU) formation fails on every member within
//                5 s, kFailedPrecondition naming the device ring (kUnimplemented without CUDA)
//   no_peer      (shm_device) rank 1 cannot open the device ring (failpoint shm.device_ring_open,
//                as on another GPU without peer access): every member falls back to the host ring
//                (space() host) and runs the collectives through it
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "common/cuda_ipc.h"
#include "common/failpoint.h"
#include "common/status.h"
#include "tests/integration/comm_scenarios.h"

namespace wsync {
namespace {

using comm::testing::BigTransfers;
using comm::testing::Collectives;
using comm::testing::Expect;

struct Args {
  std::string store, group, scenario, backend = "gloo";
  int rank = 0, size = 1;
};

// Broadcasts 64 MiB again and again until one fails; returns that failure (or OK after 600).
absl::Status BroadcastUntilFailure(comm::Communicator& comm, absl::Duration timeout) {
  std::vector<char> buf(size_t{64} << 20, 1);
  comm::MutableBytes b{buf.data(), buf.size()};
  std::printf("READY rank %d\n", comm.rank());
  std::fflush(stdout);
  for (int i = 0; i < 600; ++i) {
    absl::Status s = comm::Await(comm.Broadcast({&b, 1}, 0, comm::CollectiveOptions{timeout}));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Run(const Args& a) {
  auto store = comm::GrpcStoreClient::Connect(a.store, absl::Seconds(10));
  ASSIGN_OR_RETURN(comm::Backend backend, comm::ParseBackend(a.backend == "shm_device" ? "cuda-ipc" : a.backend));
  comm::GroupOptions opts;
  opts.store = store.get();
  opts.name = a.group;
  opts.rank = a.rank;
  opts.size = a.size;
  opts.join_timeout = a.scenario == "never_joins" ? absl::Seconds(2) : absl::Seconds(30);
  opts.default_timeout = absl::Seconds(60);
  opts.cuda_device = 0;
  const absl::Time start = absl::Now();
  if (a.scenario == "no_peer" && a.rank == 1) ArmFailpointsForTest("shm.device_ring_open");
  auto comm = comm::CreateGroup(backend, opts);
  if (a.scenario == "no_device") {
    const absl::Duration took = absl::Now() - start;
    std::fprintf(stderr, "rank %d: %s (after %s)\n", a.rank, comm.status().ToString().c_str(),
                 absl::FormatDuration(took).c_str());
    if (!CudaIpcCompiled()) return Expect(absl::IsUnimplemented(comm.status()), "kUnimplemented without CUDA");
    RETURN_IF_ERROR(Expect(absl::IsFailedPrecondition(comm.status()), "formation fails with kFailedPrecondition"));
    RETURN_IF_ERROR(Expect(absl::StrContains(comm.status().message(),
                                             a.rank == 0 ? "-byte device ring on cuda:0" : "rank 0 could not form"),
                           "the message says why"));
    return Expect(took < absl::Seconds(5), "every member fails at once, not after its join timeout");
  }
  if (a.scenario == "never_joins") {
    const absl::Duration took = absl::Now() - start;
    std::fprintf(stderr, "rank %d: %s (after %s)\n", a.rank, comm.status().ToString().c_str(),
                 absl::FormatDuration(took).c_str());
    RETURN_IF_ERROR(Expect(absl::IsDeadlineExceeded(comm.status()), "formation fails with kDeadlineExceeded"));
    RETURN_IF_ERROR(Expect(absl::StrContains(comm.status().message(), absl::StrCat("ranks [", a.size - 1, "]")),
                           "the message names the missing rank"));
    return Expect(took < absl::Seconds(6), "formation fails within its timeout");
  }
  RETURN_IF_ERROR(comm.status());
  comm::Communicator& c = **comm;
  if (a.scenario == "collectives") return Collectives(c);
  if (a.scenario == "no_peer") {
    RETURN_IF_ERROR(Expect(c.space().host(), "every member fell back to the host ring"));
    return Collectives(c);
  }
  if (a.scenario == "big") return BigTransfers(c);
  if (a.scenario == "killed") {
    absl::Status s = BroadcastUntilFailure(c, absl::Seconds(60));
    const absl::Time failed = absl::Now();
    std::fprintf(stderr, "rank %d: %s\n", a.rank, s.ToString().c_str());
    RETURN_IF_ERROR(Expect(absl::IsUnavailable(s), "a killed peer gives kUnavailable"));
    // The op timeout is 60 s: failing fast means the loss was detected, not waited out.
    (void)failed;
    return Expect(absl::StrContains(s.message(), "Broadcast(root 0"), "the message names the operation");
  }
  if (a.scenario == "abort") {
    std::thread aborter;
    if (a.rank == 0) {
      aborter = std::thread([&c] {
        absl::SleepFor(absl::Milliseconds(500));
        c.Abort("operator asked to stop");
      });
    }
    absl::Status s = BroadcastUntilFailure(c, absl::Seconds(60));
    if (aborter.joinable()) aborter.join();
    std::fprintf(stderr, "rank %d: %s\n", a.rank, s.ToString().c_str());
    if (a.rank == 0) {
      RETURN_IF_ERROR(Expect(absl::IsAborted(s), "the aborting rank sees kAborted"));
      RETURN_IF_ERROR(Expect(absl::StrContains(s.message(), "operator asked to stop"), "the reason is kept"));
      // Later operations fail fast too.
      absl::Status later = comm::Await(c.Barrier());
      return Expect(absl::IsAborted(later), "operations after Abort fail with kAborted");
    }
    return Expect(absl::IsUnavailable(s), "peers of an aborted member see kUnavailable");
  }
  if (a.scenario == "timeout") {
    if (a.rank == 1) {
      absl::SleepFor(absl::Seconds(4));
      return absl::OkStatus();
    }
    std::vector<char> buf(1 << 20, 2);
    comm::MutableBytes b{buf.data(), buf.size()};
    const absl::Time t0 = absl::Now();
    absl::Status s = comm::Await(c.Broadcast({&b, 1}, 0, comm::CollectiveOptions{absl::Seconds(1)}));
    const absl::Duration took = absl::Now() - t0;
    std::fprintf(stderr, "rank %d: %s (after %s)\n", a.rank, s.ToString().c_str(), absl::FormatDuration(took).c_str());
    if (absl::IsUnavailable(s) && a.rank != 0) return absl::OkStatus();  // its predecessor timed out first and closed
    RETURN_IF_ERROR(Expect(absl::IsDeadlineExceeded(s), "a silent member gives kDeadlineExceeded"));
    return Expect(took < absl::Seconds(3), "within about the op timeout");
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown scenario ", a.scenario));
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  CLI::App app("one member of a data-plane test group");
  wsync::Args a;
  app.add_option("--store", a.store)->required();
  app.add_option("--group", a.group)->required();
  app.add_option("--rank", a.rank)->required();
  app.add_option("--size", a.size)->required();
  app.add_option("--scenario", a.scenario)->required();
  app.add_option("--backend", a.backend);
  CLI11_PARSE(app, argc, argv);
  absl::Status s = wsync::Run(a);
  if (!s.ok()) {
    std::fprintf(stderr, "member %d FAILED: %s\n", a.rank, s.ToString().c_str());
    return 1;
  }
  std::printf("member %d OK\n", a.rank);
  return 0;
}
