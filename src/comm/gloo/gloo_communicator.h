// The Gloo backend: a TCP group formed at run time among processes launched separately (the trainer
// stage sources and the rollout agents), bootstrapped through the rendezvous Store.
//
// Formation: every member announces itself under "<name>/joined/<rank>" and waits for the others
// (join_timeout; a miss names the absent ranks), then Gloo's full mesh is connected through the
// same store under "<name>/mesh/".
//
// Algorithms, on Gloo's unbound buffers (point-to-point, abortable):
//   Broadcast   a pipelined chain root -> root+1 -> ... in pieces of kPieceBytes, a window of
//               pieces in flight per link: every link carries the bytes once, so the bus bandwidth
//               stays near one link's whatever the group size (nccl's ring broadcast).
//   AllGather   a ring (size-1 steps, each rank forwards the block it received last).
//   AllGatherV  the same ring with per-rank block sizes (empty blocks are skipped on both sides).
//   Barrier     a one-byte ring all-gather.
// Liveness: Gloo does not wake a receive whose data was streaming in when its peer died, so a
// LinkMonitor (link_monitor.h) watches the ring links on its own sockets and wakes the worker's
// waits: a dead neighbour gives kUnavailable at once.
// Split: the members' (color, key) are all-gathered over this group, then each color forms a new
// Gloo group through the same store under "<this group's name>/<name>" (ranks ordered by key, then
// rank), with this group's host and timeouts. The store must outlive every group split from it.
// Abort: the worker's pending waits are released (abortWaitRecv/abortWaitSend) and the group's
// connections are closed before the operation returns, so peers see kUnavailable at once and no
// buffer is touched afterwards.
//
// Process-wide effect: creating a group sets SIGPIPE to ignored (a dead peer must be an error,
// not a signal).
// Thread-safety: as Communicator.
#pragma once

#include <memory>
#include <vector>

#include "comm/gloo/link_monitor.h"
#include "comm/queued_communicator.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}
}  // namespace gloo

namespace wsync::comm {

class GlooCommunicator final : public QueuedCommunicator {
 public:
  static constexpr size_t kPieceBytes = size_t{4} << 20;
  static constexpr int kWindow = 8;

  // See GroupOptions. Blocks until the group is connected.
  static absl::StatusOr<std::unique_ptr<Communicator>> Create(const GroupOptions& options);
  ~GlooCommunicator() override;

  absl::string_view Name() const override { return "gloo"; }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key, std::string name) override;

 protected:
  absl::Status DoBroadcast(const OpContext& ctx, absl::Span<const MutableBytes> buffers, int root) override;
  absl::Status DoAllGather(const OpContext& ctx, absl::Span<const ConstBytes> inputs,
                           absl::Span<const MutableBytes> outputs) override;
  absl::Status DoAllGatherV(const OpContext& ctx, ConstBytes input, MutableBytes output,
                            absl::Span<const size_t> bytes_per_rank) override;
  absl::Status DoBarrier(const OpContext& ctx) override;
  void Interrupt() override;
  absl::Status ReleaseBackend() override;
  // A failed op closes the connections before it finishes: gloo's loop thread may still be
  // receiving into the op's buffers (an abort wakes the waiter first), and closing takes each
  // pair's lock, so once it returns gloo no longer touches them and the caller may free them.
  void OnBroken() override;

 private:
  struct Block {  // one transfer: `nbytes` at `offset` of buffer `buffer`
    size_t buffer;
    size_t offset;
    size_t nbytes;
  };
  class InFlight;
  GlooCommunicator(const GroupOptions& options, std::shared_ptr<gloo::Context> context,
                   std::unique_ptr<LinkMonitor> monitor);
  // kUnavailable once the monitor saw the needed neighbour go.
  absl::Status LinkStatus(bool need_prev, bool need_next);
  // A ring exchange: in step s every rank sends blocks send[s] to its successor and receives
  // blocks recv[s] from its predecessor, over `buffers`.
  absl::Status Ring(const OpContext& ctx, const std::vector<void*>& buffers, const std::vector<size_t>& sizes,
                    const std::vector<std::vector<Block>>& send, const std::vector<std::vector<Block>>& recv);
  void CloseConnections();
  void WakeWaits();  // releases the worker's pending Gloo waits (never blocks)

  const GroupOptions options_;  // how this group was formed: Split forms its subgroups the same way
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<LinkMonitor> monitor_;
  // Held for the whole of CloseConnections, so that a second caller returns only once the
  // connections are closed. Before inflight_mu_.
  absl::Mutex close_mu_ ABSL_ACQUIRED_BEFORE(inflight_mu_);
  absl::Mutex inflight_mu_;
  std::vector<gloo::transport::UnboundBuffer*> inflight_ ABSL_GUARDED_BY(inflight_mu_);
  bool closed_ ABSL_GUARDED_BY(inflight_mu_) = false;
  absl::Status prev_lost_ ABSL_GUARDED_BY(inflight_mu_);
  absl::Status next_lost_ ABSL_GUARDED_BY(inflight_mu_);
};

}  // namespace wsync::comm
