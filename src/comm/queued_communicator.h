// The machinery every CPU-driven backend shares: argument checks, a FIFO worker thread that runs
// the operations in issue order, per-operation deadlines, Abort from any thread, the broken state
// after a failure, and error messages that name the operation, group, rank and sizes.
//
// A backend derives from QueuedCommunicator and implements the Do* methods, which run on the worker
// thread one at a time and block until done. They must return within the OpContext's deadline or
// soon after Interrupt() is called (which Abort() calls from another thread), and must not touch
// the caller's buffers after returning. Their messages need not repeat the operation: the base
// prefixes "<description>: ".
//
// Lifetime: the derived constructor calls StartWorker() when its backend is ready; the derived
// destructor calls Shutdown() first, so the worker is gone before the backend's members are.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"

namespace wsync::comm {

// What a running operation knows about its limits.
class OpContext {
 public:
  OpContext(absl::Time deadline, const std::atomic<bool>* aborted) : deadline_(deadline), aborted_(aborted) {}
  absl::Time deadline() const { return deadline_; }
  absl::Duration Remaining() const { return std::max(deadline_ - absl::Now(), absl::ZeroDuration()); }
  bool Expired() const { return absl::Now() >= deadline_; }
  bool Aborted() const { return aborted_->load(std::memory_order_acquire); }
  // kAborted / kDeadlineExceeded when the operation must stop now, else OK.
  absl::Status Check() const;

 private:
  absl::Time deadline_;
  const std::atomic<bool>* aborted_;
};

class QueuedCommunicator : public Communicator {
 public:
  ~QueuedCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& group() const override { return group_; }

  absl::StatusOr<std::unique_ptr<Work>> Broadcast(absl::Span<const MutableBytes> buffers, int root,
                                                  const CollectiveOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> AllGather(absl::Span<const ConstBytes> inputs,
                                                  absl::Span<const MutableBytes> outputs,
                                                  const CollectiveOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> AllGatherV(ConstBytes input, MutableBytes output,
                                                   absl::Span<const size_t> bytes_per_rank,
                                                   const CollectiveOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> AllReduceSum(absl::Span<float> data, const CollectiveOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> Barrier(const CollectiveOptions& options) override;
  void Abort(absl::string_view reason) override;
  absl::Status Shutdown() override;

 protected:
  QueuedCommunicator(std::string group, int rank, int size, absl::Duration default_timeout);

  void StartWorker();

  virtual absl::Status DoBroadcast(const OpContext& ctx, absl::Span<const MutableBytes> buffers, int root) = 0;
  virtual absl::Status DoAllGather(const OpContext& ctx, absl::Span<const ConstBytes> inputs,
                                   absl::Span<const MutableBytes> outputs) = 0;
  virtual absl::Status DoAllGatherV(const OpContext& ctx, ConstBytes input, MutableBytes output,
                                    absl::Span<const size_t> bytes_per_rank) = 0;
  // Default: AllGather into a temporary, then a sum in rank order (same bits everywhere).
  virtual absl::Status DoAllReduceSum(const OpContext& ctx, absl::Span<float> data);
  virtual absl::Status DoBarrier(const OpContext& ctx) = 0;

  // Called by Abort() on the aborting thread, after the aborted flag is set: wake whatever the
  // worker is blocked on. Must not block for long.
  virtual void Interrupt() = 0;
  // Called on the worker after an operation failed, before it is reported: e.g. close
  // connections so the peers see kUnavailable and no buffer is touched any more.
  virtual void OnBroken() {}
  // Called once by Shutdown() on the calling thread after the worker has stopped.
  virtual absl::Status ReleaseBackend() { return absl::OkStatus(); }

  // Runs `fn` on the worker and waits: for backend set-up steps that must happen there (MPI).
  absl::Status RunOnWorker(std::function<absl::Status()> fn);

  absl::Duration default_timeout() const { return default_timeout_; }
  bool broken() const { return broken_.load(std::memory_order_acquire); }

 private:
  struct Op;
  class WorkImpl;
  absl::StatusOr<std::unique_ptr<Work>> Enqueue(std::string description, absl::Duration timeout,
                                                std::function<absl::Status(const OpContext&)> body);
  void WorkerLoop();
  void MarkBroken(const absl::Status& cause);

  const std::string group_;
  const int rank_;
  const int size_;
  const absl::Duration default_timeout_;

  std::atomic<bool> aborted_{false};  // Abort() was called: in-flight ops stop
  std::atomic<bool> broken_{false};   // an op failed or Abort() was called: new ops fail fast
  absl::Mutex mu_;
  std::deque<std::shared_ptr<Op>> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_status_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status first_failure_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

// "Broadcast(root 0, 3 buffers, 12.00 MiB) on gloo group "rollout" rank 1/3".
std::string DescribeOp(absl::string_view op, absl::string_view detail, absl::string_view backend,
                       absl::string_view group, int rank, int size);

}  // namespace wsync::comm
