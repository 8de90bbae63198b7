// wsync-bench-comm: data-plane bandwidth, nccl-tests style, for Broadcast and AllGather on one
// backend and member count. The broadcast figures are the ceiling an end-to-end sync is compared
// with.
//
//   wsync-bench-comm --backend gloo --ranks 3 [-b 1K] [-e 1G] [-f 4] [-n 5] [-w 1] [-c 1]
//   mpirun -np 3 wsync-bench-comm --backend mpi [...]
//
// Gloo: this process hosts the rendezvous store and starts the other members itself (as separate
// processes of this binary, on loopback). MPI: run it under mpirun.
// Columns: time = the slowest member's average per iteration; algbw = bytes / time (bytes = the
// buffer for broadcast, the gathered output for all-gather); busbw = algbw x factor, where the
// factor is 1 for broadcast (every link carries the buffer once, as a chain/pipeline does) and
// (n-1)/n for all-gather (nccl-tests' convention); #wrong = bytes that differ from the expected
// pattern after one checked iteration (-c 1), summed over members; cpu = CPU time of every
// member process (all its threads) per iteration, summed over the members (core-microseconds):
// what the operation costs the hosts, beside how long it takes.
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "comm/testing/pattern.h"
#include "common/units.h"

extern char** environ;

namespace wsync {
namespace {

using comm::testing::CountWrong;
using comm::testing::FillPattern;

struct Flags {
  std::string backend = "gloo", min_bytes = "1K", max_bytes = "1G", store;
  int ranks = 2, rank = 0, factor = 4, iters = 5, warmup = 1, check = 1;
  bool member = false;
};

size_t ParseSize(const std::string& s) {
  auto v = ParseByteSize(s);
  if (!v.ok()) {
    std::fprintf(stderr, "%s\n", v.status().ToString().c_str());
    std::exit(2);
  }
  return static_cast<size_t>(*v);
}

// The slowest member's value, and a sum, over the group.
double MaxOver(comm::Communicator& c, double v) {
  std::vector<double> all(c.size());
  comm::ConstBytes in{&v, sizeof(v)};
  comm::MutableBytes out{all.data(), all.size() * sizeof(double)};
  if (!comm::Await(c.AllGather({&in, 1}, {&out, 1})).ok()) return -1;
  return *std::max_element(all.begin(), all.end());
}
double ProcessCpuMicros() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}
uint64_t SumOver(comm::Communicator& c, uint64_t v) {
  std::vector<uint64_t> all(c.size());
  comm::ConstBytes in{&v, sizeof(v)};
  comm::MutableBytes out{all.data(), all.size() * sizeof(uint64_t)};
  if (!comm::Await(c.AllGather({&in, 1}, {&out, 1})).ok()) return ~uint64_t{0};
  uint64_t s = 0;
  for (uint64_t x : all) s += x;
  return s;
}

int RunTable(comm::Communicator& c, const Flags& f) {
  const int n = c.size(), me = c.rank();
  const bool lead = me == 0;
  const size_t lo = ParseSize(f.min_bytes), hi = ParseSize(f.max_bytes);
  if (lead) {
    std::printf("# wsync-bench-comm: backend %s, %d members, %d iterations (+%d warm-up)\n",
                std::string(c.Name()).c_str(), n, f.iters, f.warmup);
  }
  double bus_sum = 0;
  int bus_count = 0;
  for (const char* op : {"broadcast", "allgather"}) {
    const bool bcast = std::string(op) == "broadcast";
    if (lead) {
      std::printf("#\n# %s\n#%12s %12s %6s %6s %10s %8s %8s %8s %10s\n", op, "size", "count", "type", "root", "time",
                  "algbw", "busbw", "#wrong", "cpu");
      std::printf("#%12s %12s %6s %6s %10s %8s %8s %8s %10s\n", "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)",
                  "", "(core-us)");
    }
    for (size_t bytes = lo; bytes <= hi; bytes *= f.factor) {
      const size_t per_rank = bcast ? bytes : bytes / n;
      const size_t total = bcast ? bytes : per_rank * n;
      std::vector<char> buf(total), in(bcast ? 0 : per_rank);
      auto once = [&]() -> absl::Status {
        if (bcast) {
          comm::MutableBytes b{buf.data(), total};
          return comm::Await(c.Broadcast({&b, 1}, 0));
        }
        comm::ConstBytes i{in.data(), per_rank};
        comm::MutableBytes o{buf.data(), total};
        return comm::Await(c.AllGather({&i, 1}, {&o, 1}));
      };
      uint64_t wrong = 0;
      if (f.check) {
        if (bcast && me == 0) FillPattern(buf.data(), total, bytes);
        if (!bcast) FillPattern(in.data(), per_rank, bytes + me);
        if (!once().ok()) return 1;
        if (bcast) {
          wrong = CountWrong(buf.data(), total, bytes);
        } else {
          for (int r = 0; r < n; ++r) wrong += CountWrong(buf.data() + per_rank * r, per_rank, bytes + r);
        }
      }
      for (int i = 0; i < f.warmup; ++i) {
        if (!once().ok()) return 1;
      }
      if (!comm::Await(c.Barrier()).ok()) return 1;
      const absl::Time t0 = absl::Now();
      const double cpu0 = ProcessCpuMicros();
      for (int i = 0; i < f.iters; ++i) {
        absl::Status s = once();
        if (!s.ok()) {
          std::fprintf(stderr, "%s\n", s.ToString().c_str());
          return 1;
        }
      }
      const double us = MaxOver(c, absl::ToDoubleMicroseconds(absl::Now() - t0) / f.iters);
      // CPU time of every member (all its threads) per operation, summed over the members.
      const uint64_t cpu_us = SumOver(c, static_cast<uint64_t>((ProcessCpuMicros() - cpu0) / f.iters));
      wrong = SumOver(c, wrong);
      const double algbw = total / us / 1e3;
      const double busbw = algbw * (bcast ? 1.0 : static_cast<double>(n - 1) / n);
      if (bytes >= (size_t{1} << 20)) {
        bus_sum += busbw;
        ++bus_count;
      }
      if (lead) {
        std::printf(" %12zu %12zu %6s %6s %10.1f %8.3f %8.3f %8llu %10llu\n", total, total, "int8", bcast ? "0" : "-",
                    us, algbw, busbw, static_cast<unsigned long long>(wrong), static_cast<unsigned long long>(cpu_us));
        std::fflush(stdout);
      }
    }
  }
  if (lead) std::printf("# Avg bus bandwidth (sizes >= 1 MiB): %.3f GB/s\n", bus_count ? bus_sum / bus_count : 0.0);
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app("wsync-bench-comm: Broadcast and AllGather bandwidth, nccl-tests style");
  Flags f;
  app.add_option("--backend", f.backend, "gloo (starts its own members) or mpi (run under mpirun)");
  app.add_option("--ranks", f.ranks, "Gloo: number of members, this process included")->check(CLI::Range(1, 64));
  app.add_option("-b,--minbytes", f.min_bytes, "Smallest size (K/M/G suffixes)");
  app.add_option("-e,--maxbytes", f.max_bytes, "Largest size");
  app.add_option("-f,--stepfactor", f.factor, "Size multiplier")->check(CLI::Range(2, 1024));
  app.add_option("-n,--iters", f.iters, "Timed iterations per size")->check(CLI::Range(1, 100000));
  app.add_option("-w,--warmup_iters", f.warmup, "Warm-up iterations per size");
  app.add_option("-c,--check", f.check, "1: one checked iteration per size (#wrong)");
  app.add_flag("--member", f.member)->group("");  // internal: a Gloo member started by the lead
  app.add_option("--store", f.store)->group("");
  app.add_option("--rank", f.rank)->group("");
  CLI11_PARSE(app, argc, argv);

  auto backend = comm::ParseBackend(f.backend);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 2;
  }
  if (*backend == comm::Backend::kMpi) {
    auto w = comm::CreateMpiWorld();
    if (!w.ok()) {
      std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
      return 1;
    }
    return RunTable(**w, f);
  }
  // Gloo (or NCCL): the lead hosts the store and starts the members.
  comm::MemoryStore memory;
  std::unique_ptr<comm::StoreServer> server;
  std::unique_ptr<comm::Store> client;
  std::vector<pid_t> children;
  comm::Store* store = &memory;
  if (f.member) {
    client = comm::GrpcStoreClient::Connect(f.store);
    store = client.get();
  } else {
    auto s = comm::StoreServer::Start(&memory, "127.0.0.1:0");
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    server = std::move(*s);
    for (int r = 1; r < f.ranks; ++r) {
      std::vector<std::string> args(argv, argv + argc);
      args.insert(args.end(), {"--member", "--store", server->address(), "--rank", std::to_string(r)});
      std::vector<char*> cargs;
      for (auto& a : args) cargs.push_back(a.data());
      cargs.push_back(nullptr);
      pid_t pid;
      if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, cargs.data(), environ) == 0) children.push_back(pid);
    }
  }
  comm::GroupOptions opts;
  opts.store = store;
  opts.name = "bench";
  opts.rank = f.rank;
  opts.size = f.ranks;
  auto comm = comm::CreateGroup(*backend, opts);
  int rc = 1;
  if (comm.ok()) {
    rc = RunTable(**comm, f);
  } else {
    std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
  }
  comm = absl::UnknownError("done");
  for (pid_t pid : children) {
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  return rc;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) { return wsync::Main(argc, argv); }
