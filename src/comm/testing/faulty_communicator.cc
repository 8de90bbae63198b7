#include "comm/testing/faulty_communicator.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace wsync::comm::testing {
namespace {

// The Work of an operation that was not issued: fails with `status`, after `delay`.
class FailedWork final : public Work {
 public:
  FailedWork(absl::Status status, std::string description, absl::Duration delay)
      : status_(std::move(status)), description_(std::move(description)), done_at_(absl::Now() + delay) {}
  bool IsCompleted() const override { return absl::Now() >= done_at_; }
  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    if (deadline < done_at_) {
      absl::SleepFor(deadline - absl::Now());
      return absl::DeadlineExceededError(absl::StrCat(description_, ": still running"));
    }
    absl::SleepFor(done_at_ - absl::Now());
    return status_;
  }
  const std::string& Description() const override { return description_; }

 private:
  const absl::Status status_;
  const std::string description_;
  const absl::Time done_at_;
};

// The inner operation's Work; once it succeeds, `mutate` changes what was received (once).
class MutatingWork final : public Work {
 public:
  MutatingWork(std::unique_ptr<Work> inner, std::function<void()> mutate)
      : inner_(std::move(inner)), mutate_(std::move(mutate)) {}
  bool IsCompleted() const override { return inner_->IsCompleted(); }
  absl::Status Wait(absl::Duration timeout) override {
    absl::Status s = inner_->Wait(timeout);
    absl::MutexLock lock(&mu_);
    if (s.ok() && mutate_) std::exchange(mutate_, nullptr)();
    return s;
  }
  const std::string& Description() const override { return inner_->Description(); }

 private:
  std::unique_ptr<Work> inner_;
  absl::Mutex mu_;
  std::function<void()> mutate_ ABSL_GUARDED_BY(mu_);
};

uint64_t Total(const std::vector<MutableBytes>& bufs) {
  uint64_t n = 0;
  for (const MutableBytes& b : bufs) n += b.nbytes;
  return n;
}

// Byte `at` (0 <= at < Total) of the buffers, in order.
std::byte* ByteAt(const std::vector<MutableBytes>& bufs, uint64_t at) {
  for (const MutableBytes& b : bufs) {
    if (at < b.nbytes) return static_cast<std::byte*>(b.data) + at;
    at -= b.nbytes;
  }
  return nullptr;
}

}  // namespace

FaultyCommunicator::FaultyCommunicator(std::unique_ptr<Communicator> inner, std::vector<Fault> faults)
    : inner_(std::move(inner)), faults_(std::move(faults)) {}

FaultyCommunicator::~FaultyCommunicator() = default;

int FaultyCommunicator::operations() const {
  absl::MutexLock lock(&mu_);
  return ops_;
}

int FaultyCommunicator::fired() const {
  absl::MutexLock lock(&mu_);
  return fired_;
}

template <typename Issue>
absl::StatusOr<std::unique_ptr<Work>> FaultyCommunicator::Run(const char* what, std::vector<MutableBytes> received,
                                                              const CollectiveOptions& options, Issue issue) {
  const std::string desc = absl::StrCat(what, " on ", inner_->Name(), " group \"", inner_->group(), "\" rank ",
                                        inner_->rank(), "/", inner_->size(), " (faulty)");
  std::optional<Fault> hit;
  {
    absl::MutexLock lock(&mu_);
    const int op = ops_++;
    if (!broken_.ok()) {
      return std::unique_ptr<Work>(std::make_unique<FailedWork>(
          absl::AbortedError(absl::StrCat(desc, ": the communicator is broken: ", broken_.message())), desc,
          absl::ZeroDuration()));
    }
    for (const Fault& f : faults_) {
      if (f.at == op) hit = f;
    }
    if (hit) ++fired_;
    if (hit && (hit->kind == Fault::Kind::kError || hit->kind == Fault::Kind::kTimeout ||
                hit->kind == Fault::Kind::kPeerGone)) {
      absl::Status s = hit->kind == Fault::Kind::kError ? hit->status
                       : hit->kind == Fault::Kind::kTimeout
                           ? absl::DeadlineExceededError(absl::StrCat(desc, ": timed out (injected)"))
                           : absl::UnavailableError(absl::StrCat(desc, ": peer gone (injected)"));
      broken_ = s;
      const absl::Duration delay = hit->kind != Fault::Kind::kTimeout       ? absl::ZeroDuration()
                                   : hit->delay > absl::ZeroDuration()      ? hit->delay
                                   : options.timeout > absl::ZeroDuration() ? options.timeout
                                                                            : absl::Seconds(1);
      inner_->Abort(absl::StrCat("member ", inner_->rank(), ": ", s.message()));
      return std::unique_ptr<Work>(std::make_unique<FailedWork>(std::move(s), desc, delay));
    }
  }
  absl::StatusOr<std::unique_ptr<Work>> work = issue();
  if (!work.ok() || !hit || Total(received) == 0) return work;
  const uint64_t total = Total(received);
  std::function<void()> mutate;
  if (hit->kind == Fault::Kind::kCorrupt) {
    mutate = [received, at = hit->offset % total] { *ByteAt(received, at) ^= std::byte{0x5a}; };
  } else {
    const uint64_t n = std::min<uint64_t>(hit->bytes, total);
    mutate = [received, total, n] {
      for (uint64_t i = total - n; i < total; ++i) *ByteAt(received, i) = std::byte{0};
    };
  }
  return std::unique_ptr<Work>(std::make_unique<MutatingWork>(std::move(*work), std::move(mutate)));
}

absl::StatusOr<std::unique_ptr<Work>> FaultyCommunicator::Broadcast(absl::Span<const MutableBytes> buffers, int root,
                                                                    const CollectiveOptions& options) {
  std::vector<MutableBytes> received;
  if (root != inner_->rank()) received.assign(buffers.begin(), buffers.end());
  return Run("Broadcast", std::move(received), options, [&] { return inner_->Broadcast(buffers, root, options); });
}

absl::StatusOr<std::unique_ptr<Work>> FaultyCommunicator::AllGather(absl::Span<const ConstBytes> inputs,
                                                                    absl::Span<const MutableBytes> outputs,
                                                                    const CollectiveOptions& options) {
  return Run("AllGather", std::vector<MutableBytes>(outputs.begin(), outputs.end()), options,
             [&] { return inner_->AllGather(inputs, outputs, options); });
}

absl::StatusOr<std::unique_ptr<Work>> FaultyCommunicator::AllGatherV(ConstBytes input, MutableBytes output,
                                                                     absl::Span<const size_t> bytes_per_rank,
                                                                     const CollectiveOptions& options) {
  return Run("AllGatherV", {output}, options,
             [&] { return inner_->AllGatherV(input, output, bytes_per_rank, options); });
}

absl::StatusOr<std::unique_ptr<Work>> FaultyCommunicator::AllReduceSum(absl::Span<float> data,
                                                                       const CollectiveOptions& options) {
  return Run("AllReduceSum", {MutableBytes{data.data(), data.size() * sizeof(float)}}, options,
             [&] { return inner_->AllReduceSum(data, options); });
}

absl::StatusOr<std::unique_ptr<Work>> FaultyCommunicator::Barrier(const CollectiveOptions& options) {
  return Run("Barrier", {}, options, [&] { return inner_->Barrier(options); });
}

void FaultyCommunicator::Abort(absl::string_view reason) { inner_->Abort(reason); }

absl::Status FaultyCommunicator::Shutdown() { return inner_->Shutdown(); }

void InjectFaults(std::vector<std::unique_ptr<Communicator>>& group, size_t index, std::vector<Fault> faults) {
  group[index] = std::make_unique<FaultyCommunicator>(std::move(group[index]), std::move(faults));
}

}  // namespace wsync::comm::testing
