#include "comm/queued_communicator.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "common/units.h"

namespace wsync::comm {

absl::Status OpContext::Check() const {
  if (Aborted()) return absl::AbortedError("aborted");
  if (Expired()) return absl::DeadlineExceededError("timed out");
  return absl::OkStatus();
}

std::string DescribeOp(absl::string_view op, absl::string_view detail, absl::string_view backend,
                       absl::string_view group, int rank, int size) {
  return absl::StrFormat("%s(%s) on %s group \"%s\" rank %d/%d", op, detail, backend, group, rank, size);
}

// One queued operation and its result, shared by the queue and every Work handle.
struct QueuedCommunicator::Op {
  std::string description;
  absl::Duration timeout;
  std::function<absl::Status(const OpContext&)> body;

  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);

  void Finish(absl::Status s) {
    absl::MutexLock lock(&mu);
    status = std::move(s);
    done = true;
  }
};

class QueuedCommunicator::WorkImpl : public Work {
 public:
  explicit WorkImpl(std::shared_ptr<Op> op) : op_(std::move(op)) {}
  bool IsCompleted() const override {
    absl::MutexLock lock(&op_->mu);
    return op_->done;
  }
  absl::Status Wait(absl::Duration timeout) override {
    absl::MutexLock lock(&op_->mu);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_->mu) { return op_->done; };
    if (!op_->mu.AwaitWithTimeout(absl::Condition(&done), timeout)) {
      return absl::DeadlineExceededError(absl::StrCat(
          op_->description, ": not finished after waiting ", absl::FormatDuration(timeout),
          " (the operation goes on, bounded by its own timeout of ", absl::FormatDuration(op_->timeout), ")"));
    }
    return op_->status;
  }
  const std::string& Description() const override { return op_->description; }

 private:
  std::shared_ptr<Op> op_;
};

QueuedCommunicator::QueuedCommunicator(std::string group, int rank, int size, absl::Duration default_timeout)
    : group_(std::move(group)), rank_(rank), size_(size), default_timeout_(default_timeout) {}

QueuedCommunicator::~QueuedCommunicator() {
  // Derived destructors call Shutdown() first; this is the safety net for the base's own thread.
  if (worker_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    worker_.join();
  }
}

void QueuedCommunicator::StartWorker() {
  worker_ = std::thread([this] { WorkerLoop(); });
}

absl::StatusOr<std::unique_ptr<Work>> QueuedCommunicator::Enqueue(std::string description, absl::Duration timeout,
                                                                  std::function<absl::Status(const OpContext&)> body) {
  auto op = std::make_shared<Op>();
  op->description = std::move(description);
  op->timeout = timeout <= absl::ZeroDuration() ? default_timeout_ : timeout;
  op->body = std::move(body);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || shut_down_) {
      op->Finish(absl::AbortedError(absl::StrCat(op->description, ": the communicator is shut down")));
    } else if (!broken_status_.ok()) {
      op->Finish(absl::AbortedError(absl::StrCat(
          op->description, ": the communicator is broken by an earlier failure: ", broken_status_.message())));
    } else {
      queue_.push_back(op);
    }
  }
  return std::unique_ptr<Work>(new WorkImpl(std::move(op)));
}

void QueuedCommunicator::MarkBroken(const absl::Status& cause) {
  absl::MutexLock lock(&mu_);
  if (broken_status_.ok()) broken_status_ = cause;
  if (first_failure_.ok()) first_failure_ = cause;
  broken_.store(true, std::memory_order_release);
}

void QueuedCommunicator::WorkerLoop() {
  for (;;) {
    std::shared_ptr<Op> op;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      op = queue_.front();
      queue_.pop_front();
    }
    absl::Status broken_before;
    {
      absl::MutexLock lock(&mu_);
      broken_before = broken_status_;
    }
    if (!broken_before.ok()) {
      op->Finish(absl::AbortedError(absl::StrCat(
          op->description, ": the communicator is broken by an earlier failure: ", broken_before.message())));
      continue;
    }
    OpContext ctx(absl::Now() + op->timeout, &aborted_);
    absl::Status s = op->body(ctx);
    if (!s.ok()) {
      // Name the cause by what the context says happened, whatever the backend noticed first.
      if (ctx.Aborted()) {
        absl::Status abort_status;
        {
          absl::MutexLock lock(&mu_);
          abort_status = broken_status_;
        }
        s = absl::AbortedError(absl::StrCat(op->description, ": ", abort_status.message()));
      } else if (ctx.Expired() || absl::IsDeadlineExceeded(s)) {
        s = absl::DeadlineExceededError(absl::StrCat(op->description, ": timed out after ",
                                                     absl::FormatDuration(op->timeout), " (", s.message(), ")"));
      } else {
        s = absl::Status(s.code(), absl::StrCat(op->description, ": ", s.message()));
      }
      MarkBroken(s);
      OnBroken();
    }
    op->Finish(std::move(s));
  }
}

void QueuedCommunicator::Abort(absl::string_view reason) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.load()) return;
    absl::Status s = absl::AbortedError(absl::StrCat("aborted: ", reason));
    if (broken_status_.ok()) broken_status_ = s;
    if (first_failure_.ok()) first_failure_ = s;
    broken_.store(true, std::memory_order_release);
    aborted_.store(true, std::memory_order_release);
  }
  Interrupt();
}

absl::Status QueuedCommunicator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return first_failure_;
    stopping_ = true;
  }
  if (worker_.joinable()) worker_.join();
  absl::Status release = ReleaseBackend();
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  if (first_failure_.ok() && !release.ok()) first_failure_ = release;
  return first_failure_;
}

absl::Status QueuedCommunicator::RunOnWorker(std::function<absl::Status()> fn) {
  auto work = Enqueue(DescribeOp("Setup", "", Name(), group_, rank_, size_), absl::InfiniteDuration(),
                      [fn = std::move(fn)](const OpContext&) { return fn(); });
  return Await(std::move(work));
}

// --- Argument checks, descriptions, and queuing ------------------------------------------------

namespace {

template <typename B>
uint64_t TotalBytes(absl::Span<const B> bufs) {
  uint64_t n = 0;
  for (const auto& b : bufs) n += b.nbytes;
  return n;
}

template <typename B>
absl::Status CheckPointers(absl::Span<const B> bufs, absl::string_view what) {
  for (size_t i = 0; i < bufs.size(); ++i) {
    if (bufs[i].data == nullptr && bufs[i].nbytes > 0) {
      return absl::InvalidArgumentError(absl::StrFormat("%s[%d] is null with %d bytes", what, i, bufs[i].nbytes));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Work>> QueuedCommunicator::Broadcast(absl::Span<const MutableBytes> buffers, int root,
                                                                    const CollectiveOptions& options) {
  std::string desc = DescribeOp(
      "Broadcast", absl::StrFormat("root %d, %d buffers, %s", root, buffers.size(), FormatBytes(TotalBytes(buffers))),
      Name(), group_, rank_, size_);
  if (root < 0 || root >= size_) {
    return absl::InvalidArgumentError(absl::StrCat(desc, ": root out of range [0, ", size_, ")"));
  }
  RETURN_IF_ERROR(Annotate(CheckPointers(buffers, "buffers"), desc));
  std::vector<MutableBytes> bufs(buffers.begin(), buffers.end());
  return Enqueue(std::move(desc), options.timeout,
                 [this, bufs = std::move(bufs), root](const OpContext& ctx) { return DoBroadcast(ctx, bufs, root); });
}

absl::StatusOr<std::unique_ptr<Work>> QueuedCommunicator::AllGather(absl::Span<const ConstBytes> inputs,
                                                                    absl::Span<const MutableBytes> outputs,
                                                                    const CollectiveOptions& options) {
  std::string desc = DescribeOp(
      "AllGather", absl::StrFormat("%d buffers, %s per rank", inputs.size(), FormatBytes(TotalBytes(inputs))), Name(),
      group_, rank_, size_);
  if (inputs.size() != outputs.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %d inputs but %d outputs", desc, inputs.size(), outputs.size()));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (outputs[i].nbytes != inputs[i].nbytes * static_cast<size_t>(size_)) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: outputs[%d] holds %d bytes, needs %d x %d = %d", desc, i,
                                                        outputs[i].nbytes, size_, inputs[i].nbytes,
                                                        inputs[i].nbytes * size_));
    }
  }
  RETURN_IF_ERROR(Annotate(CheckPointers(inputs, "inputs"), desc));
  RETURN_IF_ERROR(Annotate(CheckPointers(outputs, "outputs"), desc));
  std::vector<ConstBytes> in(inputs.begin(), inputs.end());
  std::vector<MutableBytes> out(outputs.begin(), outputs.end());
  return Enqueue(
      std::move(desc), options.timeout,
      [this, in = std::move(in), out = std::move(out)](const OpContext& ctx) { return DoAllGather(ctx, in, out); });
}

absl::StatusOr<std::unique_ptr<Work>> QueuedCommunicator::AllGatherV(ConstBytes input, MutableBytes output,
                                                                     absl::Span<const size_t> bytes_per_rank,
                                                                     const CollectiveOptions& options) {
  uint64_t total = 0;
  for (size_t n : bytes_per_rank) total += n;
  std::string desc = DescribeOp(
      "AllGatherV", absl::StrFormat("%s from this rank, %s in all", FormatBytes(input.nbytes), FormatBytes(total)),
      Name(), group_, rank_, size_);
  if (bytes_per_rank.size() != static_cast<size_t>(size_)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %d sizes given for %d ranks", desc, bytes_per_rank.size(), size_));
  }
  if (bytes_per_rank[rank_] != input.nbytes) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: input holds %d bytes but bytes_per_rank[%d] = %d", desc,
                                                      input.nbytes, rank_, bytes_per_rank[rank_]));
  }
  if (output.nbytes != total) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: output holds %d bytes, the sizes add up to %d", desc, output.nbytes, total));
  }
  RETURN_IF_ERROR(Annotate(CheckPointers(absl::Span<const ConstBytes>(&input, 1), "input"), desc));
  RETURN_IF_ERROR(Annotate(CheckPointers(absl::Span<const MutableBytes>(&output, 1), "output"), desc));
  std::vector<size_t> sizes(bytes_per_rank.begin(), bytes_per_rank.end());
  return Enqueue(std::move(desc), options.timeout,
                 [this, input, output, sizes = std::move(sizes)](const OpContext& ctx) {
                   return DoAllGatherV(ctx, input, output, sizes);
                 });
}

absl::StatusOr<std::unique_ptr<Work>> QueuedCommunicator::AllReduceSum(absl::Span<float> data,
                                                                       const CollectiveOptions& options) {
  std::string desc =
      DescribeOp("AllReduceSum", absl::StrFormat("%d floats", data.size()), Name(), group_, rank_, size_);
  if (data.data() == nullptr && !data.empty()) return absl::InvalidArgumentError(absl::StrCat(desc, ": null data"));
  return Enqueue(std::move(desc), options.timeout,
                 [this, data](const OpContext& ctx) { return DoAllReduceSum(ctx, data); });
}

absl::Status QueuedCommunicator::DoAllReduceSum(const OpContext& ctx, absl::Span<float> data) {
  if (data.empty()) return absl::OkStatus();
  std::vector<float> all(data.size() * size_);
  ConstBytes in{data.data(), data.size() * sizeof(float)};
  MutableBytes out{all.data(), all.size() * sizeof(float)};
  RETURN_IF_ERROR(DoAllGather(ctx, absl::MakeConstSpan(&in, 1), absl::MakeConstSpan(&out, 1)));
  for (size_t i = 0; i < data.size(); ++i) {
    float s = all[i];
    for (int r = 1; r < size_; ++r) s += all[r * data.size() + i];
    data[i] = s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Work>> QueuedCommunicator::Barrier(const CollectiveOptions& options) {
  std::string desc = DescribeOp("Barrier", "", Name(), group_, rank_, size_);
  return Enqueue(std::move(desc), options.timeout, [this](const OpContext& ctx) { return DoBarrier(ctx); });
}

}  // namespace wsync::comm
