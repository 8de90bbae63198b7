// The coordinator, hosted by trainer rank 0: membership of the rollout agents, the rendezvous
// store of the data plane, and the sync state machine (SYSTEM.md "One sync, step by step"):
//
//   pause   BeginSync on every agent (each pauses and flushes its engine, then starts joining
//           the per-stage data-plane groups and receiving);
//   transfer  the trainer side (TrainerSide::RunSync, i.e. every trainer rank through rank 0's
//           command channel) gathers, converts, quantizes and streams the buckets;
//   prepare PrepareSync on every agent (all buckets arrived, verified, loaded into staging);
//   commit  CommitSync on every agent (repack into engine memory, continue the engine);
//   on any failure: AbortSync on every agent (engines continue on their previous version).
// One sync at a time: a trigger during a sync is refused (FAILED_PRECONDITION) or, with
// wait_if_busy, queued. Versions increase by one per attempt and are published only on success.
// Every RPC the coordinator makes has a deadline; every handler checks the bearer token.
//
// Thread-safety: all public methods may be called from any thread. Syncs run on one internal
// thread; TrainerSide::RunSync is called from it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/store/store.h"
#include "common/metrics.h"
#include "common/rpc_security.h"

namespace wsync::trainer_agent {

// What one sync asks of the trainer side.
struct SyncPlan {
  uint64_t sync_id = 0;
  uint64_t version = 0;
  std::string backend;                   // "gloo" | "nccl"
  std::vector<std::string> group_names;  // one per pipeline stage: "sync-<id>/pp<p>"
  int num_agents = 0;                    // rollout agents, ranks 1..num_agents of every group
  absl::Duration timeout;
};

struct PhaseTime {
  std::string phase;
  double seconds = 0;
  uint64_t bytes = 0;
};

struct TrainerReport {
  std::vector<PhaseTime> phases;  // gather, convert, quantize, bucket, send (summed over stage sources)
  uint64_t bytes = 0;
  uint64_t buckets = 0;
  uint64_t tensors = 0;
};

// The trainer ranks as the coordinator sees them (rank 0's command channel).
class TrainerSide {
 public:
  virtual ~TrainerSide() = default;
  virtual int num_stages() const = 0;
  virtual int world_size() const = 0;
  // Runs the trainer part of a sync on every rank; blocks until all are done. Errors name the
  // rank and the cause.
  virtual absl::StatusOr<TrainerReport> RunSync(const SyncPlan& plan) = 0;
};

struct CoordinatorOptions {
  std::string listen = "127.0.0.1:7070";
  RpcSecurity security;
  std::string backend = "gloo";
  absl::Duration heartbeat = absl::Seconds(2);          // agents heartbeat this often
  absl::Duration member_timeout = absl::Seconds(10);    // dropped after this much silence
  absl::Duration sync_timeout = absl::Minutes(10);      // bound on one whole sync
  absl::Duration rpc_timeout = absl::Seconds(60);       // Begin/Commit/Abort round trips
  MetricsRegistry* metrics = nullptr;                   // optional
};

class Coordinator {
 public:
  // Starts serving the Coordinator and Store services on options.listen.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(const CoordinatorOptions& options, TrainerSide* trainer);
  ~Coordinator();  // stops serving; a running sync is aborted

  std::string address() const;  // "host:port" actually bound
  comm::MemoryStore& store();

 private:
  class Impl;
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::trainer_agent
