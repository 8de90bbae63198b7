// The `shm:NAME` weight source (weight_source.h): the training process of Megatron rank R shares
// its parameters with the trainer agent of rank R through POSIX shared memory, using the C
// client library trainer_client/wsync_trainer_client.h.
//
// The agent serves a Unix stream socket, trainer_client::SocketPath(RuntimeDir(), NAME, R), in a
// directory it creates with mode 0700 (an existing one must be the agent user's and private);
// only peers of the agent's own uid are served (SO_PEERCRED). On it the client
//   - registers: the model's config.json and parallel.json texts, the name of its shared segment
//     (mode 0600, owned by the same uid) and every tensor (name, dtype, shape, offset; or a CUDA
//     IPC handle). The agent opens and maps the segment read-only, checks the config and layout
//     (against the first registration: the agents' layout is fixed once they have started) and
//     binds the tensors to the rank's Megatron plan (PlanRank / BindToPlan: missing,
//     unknown, mis-typed or mis-shaped parameters are named). A refused registration changes
//     nothing; an accepted one replaces the previous one only if that client has disconnected.
//   - requests syncs: forwarded to the SyncRequester the agent installed (the coordinator's
//     TriggerSync / WatchSync).
// Versions: a client's sync request declares "my weights, at update generation G (the segment
// header, trainer_client/protocol.h), are version V". OpenRank(rank, V) waits (up to
// lock_timeout) until the client has declared V, takes the segment's flock(2) lock shared (the
// trainer holds it exclusively between wsync_client_begin_update and _end_update), checks that the
// generation is still G, and returns views into the mapping; the lock is released when the last
// copy of the shard's `backing` goes away. So every rank of a sync is read at the step its
// training process declared, never half-written; OpenRank(rank, 0) skips the declaration check.
// CUDA IPC tensors (cuda_ipc.h) are read in place when the agent runs the device stages
// (options.device_stages, every tensor of the rank on one CUDA device, and either no TP / EP gathers
// in the layout or options.device_gathers, see sync/rank_sync.h): the shard's views are device
// pointers and RankShard::cuda_device says which device. Otherwise they are copied to host buffers
// under the same lock.
// When the client disconnects, its registration stays mapped (a shard in use stays valid) but
// OpenRank refuses it: a sync never reads the weights of a training process that is gone.
//
// Errors: Start: kInvalidArgument (bad name), kFailedPrecondition (runtime directory not private,
// or not creatable), kAlreadyExists (another agent serves the socket). WaitForRegistration:
// kDeadlineExceeded / kCancelled. OpenRank: kInvalidArgument (another rank), kFailedPrecondition
// (nothing registered, client gone), kDeadlineExceeded (the trainer held its update lock for
// lock_timeout), CUDA copy errors. Registration errors go back to the client (same codes).
// Thread-safety: every method may be called from any thread. source_model() requires a completed
// registration (WaitForRegistration returned OK).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "trainer_agent/source/weight_source.h"
#include "trainer_client/protocol.h"

namespace wsync::trainer_agent {

struct ShmSourceOptions {
  std::string name;         // NAME of shm:NAME
  int rank = 0;             // this agent's Megatron global rank
  int world_size = 0;       // the agents' world: a registration saying otherwise is refused (0: no check)
  std::string runtime_dir;  // "" = trainer_client::RuntimeDir()
  absl::Duration lock_timeout = absl::Minutes(2);
  // Hand out CUDA tensors in place where the sync can run on the device (see above); false: always
  // copy them to the host (the host stages, e.g. to compare).
  bool device_stages = true;
  // Also for a layout with TP / EP gathers: the sync gathers on the GPUs through NCCL groups (a
  // build with NCCL); false: such a layout gets host copies and gathers on the host.
  bool device_gathers = false;
};

struct SyncRequestResult {
  uint64_t sync_id = 0;
  uint64_t version = 0;
  bool coalesced = false;
};

// Asks for a sync publishing `version` (0: next); with `wait`, returns once it has ended (its
// error if it failed). Runs on a connection thread of the source.
using SyncRequester =
    std::function<absl::StatusOr<SyncRequestResult>(uint64_t version, bool wait, absl::Duration timeout)>;

class ShmSource final : public WeightSource {
 public:
  static absl::StatusOr<std::unique_ptr<ShmSource>> Start(const ShmSourceOptions& options);
  ~ShmSource() override;  // stops serving, closes connections, removes the socket

  // Blocks until a client has registered, `stop` is set (kCancelled) or `timeout` passes.
  absl::Status WaitForRegistration(absl::Duration timeout, const std::atomic<bool>* stop) const;
  // Installs the handler of clients' sync requests (until then they get kUnavailable).
  void SetSyncRequester(SyncRequester requester);

  const SourceModel& source_model() const override;
  absl::StatusOr<RankShard> OpenRank(int global_rank, uint64_t version = 0) const override;
  std::string Describe() const override { return "shm:" + options_.name; }
  const std::string& socket_path() const { return socket_path_; }
  // The CUDA device whose memory the current registration's tensors are read from in place (the
  // device stages), else -1: where this rank's nccl data plane goes by default.
  int resident_device() const;

  struct Registration;

 private:
  struct State;
  explicit ShmSource(ShmSourceOptions options);
  void Serve(int fd, int pid, unsigned uid);  // one client connection, until it closes
  absl::StatusOr<std::shared_ptr<Registration>> Register(const trainer_client::RegisterRequest& request, unsigned uid,
                                                         bool has_one);
  ShmSourceOptions options_;
  std::string socket_path_;
  std::unique_ptr<State> state_;
};

}  // namespace wsync::trainer_agent
