// Test helper: a Communicator that fails the way a real one fails, at the operation a test names.
// It wraps a real member of a group (local_group.h) and passes every operation through, but for
// the faults it was given, each at the Nth operation (0-based, counting every Broadcast,
// AllGather, AllGatherV, AllReduceSum and Barrier issued on this member):
//
//   kError     the operation is not issued; its Work fails with `status`; the inner communicator
//              is aborted, so the peers' matching operation fails too (kAborted / kUnavailable)
//              instead of waiting for this member.
//   kTimeout   as kError with kDeadlineExceeded, after the operation's timeout (or `delay`).
//   kPeerGone  the inner communicator is shut down (this member leaves the group): this operation
//              and every later one fail with kUnavailable "peer gone", and so do the peers'.
//   kCorrupt   the operation runs; then one byte of what this member received (a Broadcast's
//              buffers on a non-root, an AllGather's outputs) is flipped at `offset` (modulo the
//              bytes received, counted over the buffers in order).
//   kShort     the operation runs; then the last `bytes` of what this member received are zeroed:
//              a transfer that ended early.
//
// After an injected failure the communicator is broken, as a real one is: later operations fail
// at once with kAborted naming the first failure. Split is not supported (kUnimplemented).
// Ownership: owns the inner communicator. Thread-safety: as Communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "comm/communicator.h"

namespace wsync::comm::testing {

struct Fault {
  enum class Kind { kError, kTimeout, kPeerGone, kCorrupt, kShort };
  Kind kind = Kind::kError;
  int at = 0;                                                   // the operation (0-based) it hits
  absl::Status status = absl::InternalError("injected fault");  // kError
  absl::Duration delay = absl::ZeroDuration();                  // kTimeout: else the op's timeout
  uint64_t offset = 0;                                          // kCorrupt
  uint64_t bytes = 1;                                           // kShort
};

class FaultyCommunicator final : public Communicator {
 public:
  FaultyCommunicator(std::unique_ptr<Communicator> inner, std::vector<Fault> faults);
  ~FaultyCommunicator() override;

  // Operations issued so far, and the faults that fired.
  int operations() const;
  int fired() const;

  absl::string_view Name() const override { return inner_->Name(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& group() const override { return inner_->group(); }
  MemorySpace space() const override { return inner_->space(); }

  absl::StatusOr<std::unique_ptr<Work>> Broadcast(absl::Span<const MutableBytes> buffers, int root,
                                                  const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::unique_ptr<Work>> AllGather(absl::Span<const ConstBytes> inputs,
                                                  absl::Span<const MutableBytes> outputs,
                                                  const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::unique_ptr<Work>> AllGatherV(ConstBytes input, MutableBytes output,
                                                   absl::Span<const size_t> bytes_per_rank,
                                                   const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::unique_ptr<Work>> AllReduceSum(absl::Span<float> data,
                                                     const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::unique_ptr<Work>> Barrier(const CollectiveOptions& options = {}) override;
  void Abort(absl::string_view reason) override;
  absl::Status Shutdown() override;

 private:
  // Runs `issue` on the inner communicator unless a fault hits this operation; `received` are the
  // bytes this member receives (for kCorrupt / kShort).
  template <typename Issue>
  absl::StatusOr<std::unique_ptr<Work>> Run(const char* what, std::vector<MutableBytes> received,
                                            const CollectiveOptions& options, Issue issue);

  std::unique_ptr<Communicator> inner_;
  mutable absl::Mutex mu_;
  std::vector<Fault> faults_ ABSL_GUARDED_BY(mu_);
  int ops_ ABSL_GUARDED_BY(mu_) = 0;
  int fired_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

// Wraps member `index` of `group` in a FaultyCommunicator with `faults` (the others unchanged).
void InjectFaults(std::vector<std::unique_ptr<Communicator>>& group, size_t index, std::vector<Fault> faults);

}  // namespace wsync::comm::testing
