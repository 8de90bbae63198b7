// A rollout agent's membership at the coordinator (proto/wsync/v1/coordinator.proto): Join once an
// engine is registered, Heartbeat every period (the agent's --heartbeat-ms, or the coordinator's
// JoinReply.heartbeat_ms if shorter), Join again when a heartbeat comes back `known = false` (the
// coordinator restarted or dropped the agent) or after Update() (a re-registered engine), Leave on
// destruction. Failures are logged (once per change of state) and retried at the next period: a
// coordinator that is down does not stop the agent from serving its engine.
//
// Ownership: one background thread, joined by the destructor.
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc_security.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::rollout_agent {

class Membership {
 public:
  // `staged` (optional) says, at every Join and Heartbeat, the version the agent's staging holds
  // that a delta sync can be applied to (JoinRequest.staged_version); it is called without the
  // membership's lock held.
  Membership(std::string coordinator, const RpcSecurity& sec, absl::Duration heartbeat,
             std::function<uint64_t()> staged = nullptr);
  ~Membership();  // Leave (bounded by one heartbeat period) and stop

  // What to join with (agent_address, engine_id, tp_rank, tp_size, version); starts joining.
  void Update(const v1::JoinRequest& join);
  // The version reported by heartbeats (and the next Join).
  void SetVersion(uint64_t version);
  // The id the coordinator gave us (used in heartbeats), or "" before the first successful Join.
  std::string agent_id() const;
  // Successful Joins so far (tests).
  int joins() const;
  // Waits up to `timeout` until the request of the last Update() has joined; false otherwise.
  bool AwaitJoined(absl::Duration timeout);
  // The coordinator's last catch-up hint (JoinReply / HeartbeatReply): empty unless this member's
  // engine is behind the published version.
  v1::CatchUpHint catch_up() const;
  // Asks the coordinator now (one Heartbeat from the caller's thread, bounded by `timeout`) and
  // returns its catch-up hint, which catch_up() then returns too. kFailedPrecondition before the
  // first Join; the RPC's error otherwise.
  absl::StatusOr<v1::CatchUpHint> RefreshHint(absl::Duration timeout);

 private:
  void Run();
  bool DoJoin(const v1::JoinRequest& join, uint64_t seq, absl::Duration* period);
  absl::Duration RpcTimeout() const;

  const std::string coordinator_;
  const RpcSecurity sec_;
  const absl::Duration heartbeat_;
  const std::function<uint64_t()> staged_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;

  mutable absl::Mutex mu_;
  v1::JoinRequest join_ ABSL_GUARDED_BY(mu_);
  bool have_join_ ABSL_GUARDED_BY(mu_) = false;
  bool need_join_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string agent_id_ ABSL_GUARDED_BY(mu_);
  int joins_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t update_seq_ ABSL_GUARDED_BY(mu_) = 0;  // Update() calls
  uint64_t joined_seq_ ABSL_GUARDED_BY(mu_) = 0;  // the Update() the last successful Join carried
  v1::CatchUpHint catch_up_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace wsync::rollout_agent
