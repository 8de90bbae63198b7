#include "comm/mpi/mpi_communicator.h"

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync::comm {
namespace {

constexpr size_t kMaxPiece = size_t{1} << 30;

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, len);
}

absl::Status CheckMpi(int code, absl::string_view call) {
  if (code == MPI_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, " failed: ", MpiError(code)));
}

// Initializes MPI once per process; finalizes when the last communicator lets go of it, unless an
// abandoned request could still be running.
class MpiRuntime {
 public:
  static absl::StatusOr<std::shared_ptr<MpiRuntime>> Get() {
    static absl::Mutex mu;
    static std::weak_ptr<MpiRuntime> current;
    absl::MutexLock lock(&mu);
    if (auto rt = current.lock()) return rt;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return absl::FailedPreconditionError("MPI was already finalized in this process");
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      RETURN_IF_ERROR(CheckMpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread"));
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_MULTIPLE) {
      return absl::FailedPreconditionError(absl::StrCat("the MPI library provides thread level ", provided,
                                                        ", wsync needs MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE,
                                                        "): each communicator runs its collectives on its own thread"));
    }
    auto rt = std::shared_ptr<MpiRuntime>(new MpiRuntime(!initialized));
    current = rt;
    return rt;
  }
  ~MpiRuntime() {
    if (owns_ && !poisoned_.load()) MPI_Finalize();
  }
  void Poison() { poisoned_.store(true); }

 private:
  explicit MpiRuntime(bool owns) : owns_(owns) {}
  bool owns_;
  std::atomic<bool> poisoned_{false};
};

class MpiCommunicator final : public QueuedCommunicator {
 public:
  MpiCommunicator(std::shared_ptr<MpiRuntime> rt, MPI_Comm comm, std::string name, int rank, int size,
                  absl::Duration default_timeout)
      : QueuedCommunicator(std::move(name), rank, size, default_timeout), rt_(std::move(rt)), comm_(comm) {
    StartWorker();
  }
  ~MpiCommunicator() override {
    Shutdown().IgnoreError();
    if (!abandoned_.empty()) {
      rt_->Poison();  // requests MPI may still complete into freed memory: never finalize cleanly
    } else if (comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_NULL) {
      MPI_Comm_free(&comm_);
    }
  }

  absl::string_view Name() const override { return "mpi"; }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key, std::string name) override {
    MPI_Comm sub = MPI_COMM_NULL;
    RETURN_IF_ERROR(RunOnWorker([&] { return CheckMpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split"); }));
    int r = 0, n = 0;
    MPI_Comm_rank(sub, &r);
    MPI_Comm_size(sub, &n);
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    return std::unique_ptr<Communicator>(new MpiCommunicator(rt_, sub, std::move(name), r, n, default_timeout()));
  }

 protected:
  absl::Status DoBroadcast(const OpContext& ctx, absl::Span<const MutableBytes> buffers, int root) override {
    std::vector<MPI_Request> reqs;
    for (const auto& b : buffers) {
      for (size_t off = 0; off < b.nbytes; off += kMaxPiece) {
        const int n = static_cast<int>(std::min(kMaxPiece, b.nbytes - off));
        reqs.emplace_back();
        RETURN_IF_ERROR(CheckMpi(MPI_Ibcast(static_cast<char*>(b.data) + off, n, MPI_BYTE, root, comm_, &reqs.back()),
                                 "MPI_Ibcast"));
      }
    }
    return Poll(ctx, reqs);
  }

  absl::Status DoAllGather(const OpContext& ctx, absl::Span<const ConstBytes> inputs,
                           absl::Span<const MutableBytes> outputs) override {
    std::vector<MPI_Request> reqs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const size_t n = inputs[i].nbytes;
      if (n == 0) continue;
      auto* out = static_cast<char*>(outputs[i].data);
      if (n <= kMaxPiece) {
        const void* send = inputs[i].data == out + n * rank() ? MPI_IN_PLACE : inputs[i].data;
        reqs.emplace_back();
        RETURN_IF_ERROR(CheckMpi(MPI_Iallgather(send, static_cast<int>(n), MPI_BYTE, out, static_cast<int>(n), MPI_BYTE,
                                                comm_, &reqs.back()),
                                 "MPI_Iallgather"));
      } else {
        std::vector<size_t> sizes(size(), n);
        RETURN_IF_ERROR(BroadcastEach(inputs[i], outputs[i], sizes, reqs));
      }
    }
    return Poll(ctx, reqs);
  }

  absl::Status DoAllGatherV(const OpContext& ctx, ConstBytes input, MutableBytes output,
                            absl::Span<const size_t> bytes_per_rank) override {
    std::vector<MPI_Request> reqs;
    std::vector<int> counts(size()), displs(size());
    size_t off = 0;
    bool fits = true;
    for (int r = 0; r < size(); ++r) {
      fits = fits && bytes_per_rank[r] <= INT_MAX && off <= INT_MAX;
      counts[r] = static_cast<int>(std::min<size_t>(bytes_per_rank[r], INT_MAX));
      displs[r] = static_cast<int>(std::min<size_t>(off, INT_MAX));
      off += bytes_per_rank[r];
    }
    if (fits) {
      auto* out = static_cast<char*>(output.data);
      const void* send = input.data == out + displs[rank()] ? MPI_IN_PLACE : input.data;
      reqs.emplace_back();
      RETURN_IF_ERROR(CheckMpi(MPI_Iallgatherv(send, counts[rank()], MPI_BYTE, out, counts.data(), displs.data(),
                                               MPI_BYTE, comm_, &reqs.back()),
                               "MPI_Iallgatherv"));
    } else {
      RETURN_IF_ERROR(
          BroadcastEach(input, output, std::vector<size_t>(bytes_per_rank.begin(), bytes_per_rank.end()), reqs));
    }
    return Poll(ctx, reqs);
  }

  absl::Status DoBarrier(const OpContext& ctx) override {
    std::vector<MPI_Request> reqs(1);
    RETURN_IF_ERROR(CheckMpi(MPI_Ibarrier(comm_, &reqs[0]), "MPI_Ibarrier"));
    return Poll(ctx, reqs);
  }

  void Interrupt() override {}  // Poll() watches the aborted flag

  absl::Status ReleaseBackend() override {
    // Give abandoned requests the default timeout to finish, so the buffers are free again.
    const absl::Time deadline = absl::Now() + default_timeout();
    while (!abandoned_.empty() && absl::Now() < deadline) {
      int done = 0;
      MPI_Testall(static_cast<int>(abandoned_.size()), abandoned_.data(), &done, MPI_STATUSES_IGNORE);
      if (done)
        abandoned_.clear();
      else
        absl::SleepFor(absl::Milliseconds(1));
    }
    if (!abandoned_.empty()) {
      return absl::DeadlineExceededError(absl::StrCat("mpi group \"", group(), "\": ", abandoned_.size(),
                                                      " abandoned requests never finished; MPI will not be finalized"));
    }
    return absl::OkStatus();
  }

 private:
  // Rank r's block (sizes[r] bytes at the running offset of `output`) broadcast from r, in pieces.
  absl::Status BroadcastEach(ConstBytes input, MutableBytes output, const std::vector<size_t>& sizes,
                             std::vector<MPI_Request>& reqs) {
    size_t off = 0;
    for (int r = 0; r < size(); ++r) {
      auto* block = static_cast<char*>(output.data) + off;
      if (r == rank() && input.nbytes > 0 && block != input.data) std::memmove(block, input.data, input.nbytes);
      for (size_t p = 0; p < sizes[r]; p += kMaxPiece) {
        const int n = static_cast<int>(std::min(kMaxPiece, sizes[r] - p));
        reqs.emplace_back();
        RETURN_IF_ERROR(CheckMpi(MPI_Ibcast(block + p, n, MPI_BYTE, r, comm_, &reqs.back()), "MPI_Ibcast"));
      }
      off += sizes[r];
    }
    return absl::OkStatus();
  }

  // Tests the requests until all are done, the deadline passes or the communicator is aborted.
  // Spins (yielding) for the first millisecond, then sleeps 20 us between tests (MPI progresses
  // non-blocking collectives only inside MPI calls), and 1 ms after 50 ms, so that a rank idling
  // in a long wait (the agents' command channel) costs next to no CPU.
  absl::Status Poll(const OpContext& ctx, std::vector<MPI_Request>& reqs) {
    if (reqs.empty()) return absl::OkStatus();
    const absl::Time start = absl::Now();
    const absl::Time spin_until = start + absl::Milliseconds(1);
    const absl::Time idle_after = start + absl::Milliseconds(50);
    for (;;) {
      int done = 0;
      int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) return absl::UnavailableError(absl::StrCat("MPI_Testall: ", MpiError(rc)));
      if (done) return absl::OkStatus();
      absl::Status s = ctx.Check();
      if (!s.ok()) {
        for (auto& r : reqs) {
          if (r != MPI_REQUEST_NULL) abandoned_.push_back(r);
        }
        return s;
      }
      const absl::Time now = absl::Now();
      if (now < spin_until)
        sched_yield();
      else
        absl::SleepFor(now < idle_after ? absl::Microseconds(20) : absl::Milliseconds(1));
    }
  }

  std::shared_ptr<MpiRuntime> rt_;
  MPI_Comm comm_;
  std::vector<MPI_Request> abandoned_;  // worker thread only (and Shutdown after the worker stopped)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldCommunicator(const MpiOptions& options) {
  ASSIGN_OR_RETURN(auto rt, MpiRuntime::Get());
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<Communicator>(
      new MpiCommunicator(std::move(rt), MPI_COMM_WORLD, options.name, rank, size, options.default_timeout));
}

}  // namespace wsync::comm
