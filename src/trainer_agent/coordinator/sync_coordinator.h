// SyncCoordinator: the coordinator's domain, behind its gRPC service (coordinator.h). It holds the
// membership of the rollout agents, the fleet's versions and their durable state, the queue of sync
// triggers, and runs each sync, on its sync thread (docs/spec/SYSTEM.md "One sync, step by step"):
//   begin    BeginSync on every member (it joins the data-plane groups; its engine keeps serving);
//   transfer TrainerSide::RunSync (every trainer rank gathers, converts, quantizes and streams);
//   prepare  PrepareSync on every member (every bucket arrived, verified, in its staging);
//   commit   CommitSync on every member (pause, write, continue: the only time an engine stops);
//   on any failure, AbortSync on every member and no later phase.
// A sync ends done (every engine of the fleet committed), partial (some engine ranks did; the
// others are named behind and catch up) or failed (none did: every engine keeps its version); done
// or partial publishes the version, the fleet's version (docs/sync.md "Versions").
//
// Owns: the members' AgentClients (made by the AgentConnector), the sync and reaper threads, the
// lock on the state directory. Borrows: the TrainerSide and the store (they outlive it).
// It reaches agents only through AgentClient and the trainer only through TrainerSide, so tests
// drive it with fakes of both (coordinator_test.cc).
//
// Thread-safety: every public method may be called from any thread. Syncs run one at a time on one
// internal thread, started by Start(); TrainerSide::RunSync and the AgentClients are called from it
// (and from the reaper thread for a roll forward), never under the coordinator's lock.
// Errors: absl::Status, codes as each method says; the implementation is spread over
// sync_coordinator.cc (life, observation), sync_coordinator_membership.cc,
// sync_coordinator_state.cc and sync_coordinator_run.cc.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "comm/store/store.h"
#include "common/metrics.h"
#include "plan/delivery_plan.h"
#include "trainer_agent/coordinator/agent_client.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::trainer_agent {

// Delta delivery (TriggerSyncRequest.delta, --delta; docs/sync.md "Delta sync"): off (every byte),
// auto (deltas when the trainer and every member hold the base, else every byte), on (deltas when
// any member holds the base; the engines that do not sit the sync out and copy it from a peer).
enum class DeltaMode { kOff, kAuto, kOn };
// "off" | "auto" | "on"; kInvalidArgument naming the three otherwise.
absl::StatusOr<DeltaMode> ParseDeltaMode(absl::string_view name);
absl::string_view DeltaModeName(DeltaMode mode);

// What one sync asks of the trainer side.
struct SyncPlan {
  uint64_t sync_id = 0;
  uint64_t version = 0;
  std::string backend;                   // "gloo" | "nccl"
  std::vector<std::string> group_names;  // one per pipeline stage: SyncGroupName(id, p)
  int num_agents = 0;                    // rollout agents, ranks 1..num_agents of every group
  // Sharded delivery (plan/delivery_plan.h): the receiver groups (engine rank layouts) and how
  // many agents each has; stage p's stream from sender k to group g is ShardGroupName(id, p, k, g),
  // of size 1 + the group's agents. Empty for broadcast delivery.
  plan::Delivery delivery = plan::Delivery::kBroadcast;
  std::vector<engine_model::EngineParallel> receiver_groups;
  std::vector<int> group_agents;
  absl::Duration timeout;  // every trainer-side operation's bound
  // When the whole sync must have ended (its start + the sync timeout): RunSync gives up waiting
  // then with kDeadlineExceeded, and the trainer ranks finish (drain) in the background.
  absl::Time deadline = absl::InfiniteFuture();
  // The sync's bucket key (comm/bucket/bucket_mac.h): 32 random bytes, or empty when buckets are
  // not authenticated (SyncCoordinatorOptions::bucket_mac).
  std::string bucket_mac_key;
  // The quantization_config the engines registered (JoinRequest), one quantization for all of them
  // (their engine layouts may differ; otherwise the sync is refused before it starts); "" when
  // they serve bf16. The trainer quantizes as it says unless it has a --quant-config of its own.
  std::string engine_quant_json;
  // Delta delivery (docs/sync.md "Delta sync"): the senders keep a copy of what they send (sharded:
  // per receiver group) as the next sync's base, and send each tensor or block as its change from
  // delta_base (0: in full). receiver_groups then lists the members' engine-rank layouts (a checksum of each
  // one's block goes with every delta).
  bool keep_delta_base = false;
  uint64_t delta_base = 0;
};

struct PhaseTime {
  std::string phase;
  double seconds = 0;
  uint64_t bytes = 0;
};

struct TrainerReport {
  std::vector<PhaseTime>
      phases;  // open, gather, convert, quantize, bucket, send_wait, trainer_total (the slowest stage source's)
  uint64_t bytes = 0;
  uint64_t buckets = 0;
  uint64_t tensors = 0;
  // Delta delivery: the version every stage source's base holds after the sync (the sync's when it
  // kept one, else 0), and what the stage sources sent (trainer_agent/sync/delta_sink.h DeltaStats).
  uint64_t delta_held = 0;
  uint64_t tensor_bytes = 0, sent_bytes = 0, delta_items = 0, changed_items = 0;
  // Every rank's quantization groups (INT4 groups, FP8 blocks or rows, AWQ units; stage sources and experts'
  // holders) quantized or reused, those reused, and those quantized without digests (reuse paused).
  uint64_t quant_groups = 0, reused_groups = 0, undigested_groups = 0;
};

// The trainer ranks as the coordinator sees them (rank 0's command channel).
class TrainerSide {
 public:
  virtual ~TrainerSide() = default;
  virtual int num_stages() const = 0;
  // Ranks that send stage `stage` in sharded delivery (spread senders: the stage source's TP group
  // and its EP mergers); each sends every receiver group its own stream.
  virtual int num_senders(int stage) const { return 1; }
  virtual int world_size() const = 0;
  // Runs the trainer part of a sync on every rank; blocks until all are done, or until
  // plan.deadline (kDeadlineExceeded; a later sync then waits for the ranks to finish this one).
  // Errors name the rank and the cause.
  virtual absl::StatusOr<TrainerReport> RunSync(const SyncPlan& plan) = 0;
  // The sync a RunSync gave up on (its deadline passed) that the ranks are still running, finishing
  // it in the background; 0 when they are free. The coordinator waits for it before it begins a
  // sync with the agents (AwaitIdle), so that sync's timeout counts from when the ranks can run it.
  virtual uint64_t draining_sync() { return 0; }
  // Blocks until draining_sync() is 0 (OK) or until `deadline` (kDeadlineExceeded, naming the sync
  // the ranks are still running), or the ranks shut down (kUnavailable).
  virtual absl::Status AwaitIdle(absl::Time deadline) { return absl::OkStatus(); }
};

struct SyncCoordinatorOptions {
  std::string backend = "gloo";
  plan::Delivery delivery = plan::Delivery::kBroadcast;  // the default of syncs that do not choose
  DeltaMode delta = DeltaMode::kOff;                     // the same
  absl::Duration heartbeat = absl::Seconds(2);           // agents heartbeat this often
  absl::Duration member_timeout = absl::Seconds(10);     // dropped after this much silence
  absl::Duration sync_timeout = absl::Minutes(10);       // bound on one whole sync
  absl::Duration rpc_timeout = absl::Seconds(60);        // Begin/Commit/Abort round trips
  MetricsRegistry* metrics = nullptr;                    // optional, not owned
  // Durable state (DIR/coordinator-state.json; empty: none): versions, the next version and sync
  // id, the last published version and the finished syncs' timings survive a restart.
  std::string state_dir;
  // Authenticate every bucket: a fresh key per sync, given to the trainer ranks and the agents.
  bool bucket_mac = false;
};

class SyncCoordinator {
 public:
  // `trainer` and `store` are not owned and must outlive the coordinator; `connect` makes the
  // client of each agent that joins.
  SyncCoordinator(SyncCoordinatorOptions options, TrainerSide* trainer, comm::MemoryStore* store,
                  AgentConnector connect);
  ~SyncCoordinator();  // Stop()

  // Locks options.state_dir (DIR/coordinator.lock, held until Stop) and loads its state, before
  // Start (a no-op without a state dir; no file: versions start at 1). kFailedPrecondition naming
  // the holder when another coordinator holds the directory, naming the file when it cannot be read
  // or parsed (nothing is changed: fix or move the file); errno codes when the directory cannot be
  // created.
  absl::Status LoadState();
  // Starts the sync and reaper threads; agents are told to rendezvous at `store_address`. The
  // reaper drops a member silent for longer than member_timeout, unless it is in the running sync.
  void Start(const std::string& store_address);
  // Stops the threads: waits for a running sync to end; queued syncs never run. Idempotent.
  void Stop();

  // Membership. Join: kInvalidArgument for an empty agent_address; an agent that joins again from
  // the same address, or any agent that joins for the engine rank (engine id, TP rank) of an
  // existing member (a restarted agent on a new port), replaces the old entry at once. Heartbeat of
  // an unknown id: OK with known = false.
  absl::Status Join(const v1::JoinRequest& req, v1::JoinReply* reply);
  absl::Status Heartbeat(const v1::HeartbeatRequest& req, v1::HeartbeatReply* reply);
  absl::Status Leave(const v1::LeaveRequest& req);
  // Takes an engine out of the fleet (see coordinator.proto); kNotFound for an unknown id.
  absl::Status RemoveEngine(const std::string& engine_id);

  // Queues a sync. One sync at a time: while one runs, a trigger is refused (kFailedPrecondition)
  // or, with wait_if_busy, queued. Its version is the trigger's (versions only grow, also across a
  // restart: past the durable state's and every member's; a trigger for a version queued, running
  // or published joins that sync: coalesced) or the next number. The members of a sync are the
  // agents of the engines that have an agent for every TP rank when it starts; the others sit it
  // out. kFailedPrecondition: fewer members than min_agents
  // (at least 1), no engine of the fleet with an agent for every TP rank, a version not newer than
  // every published, queued or running one and every member's, or busy without wait_if_busy.
  absl::Status TriggerSync(const v1::TriggerSyncRequest& req, v1::TriggerSyncReply* reply);

  // Calls `emit` with the state of sync `sync_id` (0: the running or next queued one, waiting for
  // a trigger) at least every 200 ms and at every change, until the sync has finished (its final
  // state is emitted) or `emit` returns false. kNotFound for an unknown id; kUnavailable once the
  // coordinator stops.
  absl::Status WatchSync(uint64_t sync_id, absl::FunctionRef<bool(const v1::SyncEvent&)> emit);

  void Status(v1::StatusReply* reply);
  void Members(v1::MembersReply* reply);
  void Versions(v1::VersionsReply* reply);
  // The phases of the newest finished sync, or of the sync of `version`; kNotFound if none.
  absl::Status Timings(const v1::TimingsRequest& req, v1::TimingsReply* reply);

 private:
  struct Member;
  struct SyncRecord;

  // The member id within an agent_id this coordinator gave (JoinReply), "" for another's.
  std::string MemberKey(absl::string_view agent_id) const;
  void SyncLoop();
  void ReapLoop();
  // The engines of the fleet (not removed) that miss a TP rank's agent, each as "ENGINE (no agent
  // for TP rank R of T)"; they sit syncs out.
  std::vector<std::string> IncompleteEngines() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when some engine of the fleet (not removed) has a member agent for every TP rank; else
  // kFailedPrecondition naming the incomplete engines.
  absl::Status CanSync() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every engine of the fleet (not removed): the version each TP rank's member reports (none: no
  // member). One pass over the members; the helpers below read it.
  using RankVersions = std::map<std::string, std::vector<std::optional<uint64_t>>>;
  RankVersions FleetVersions() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why an engine's ranks are not on `version` or a newer one ("" when they are), e.g. "tp 1: on
  // version 2; tp 0: no agent" ("on version 2" for TP 1).
  static std::string BehindWhy(const std::vector<std::optional<uint64_t>>& ranks, uint64_t version);
  // The engines of `fleet` not on `version` or a newer one: engine id -> BehindWhy.
  static std::map<std::string, std::string> EnginesBehind(const RankVersions& fleet, uint64_t version);
  // The version every rank holds; 0 when they differ or a rank has no agent.
  static uint64_t EngineServes(const std::vector<std::optional<uint64_t>>& ranks);
  std::vector<uint32_t> MissingRanks(const std::string& engine_id, uint32_t tp_size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the state file (tmp + fsync + rename + directory fsync). A failure is logged and
  // returned: TriggerSync refuses a sync whose numbers it cannot save (and takes them back); at the
  // end of a sync (or a roll forward) it is only logged, and the next trigger saves again.
  absl::Status SaveState() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the attempts and finished sync records beyond the newest ones kept (kKeptVersions,
  // kKeptTimings: sync_coordinator_internal.h).
  void PruneHistory() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After members' versions changed (Join, Heartbeat, the end of a sync): publishes rolling_forward_
  // once any member reports it, empties the `behind` of the partial versions' records as engines
  // catch up (saving the state when one changed), and sets the fleet's gauges.
  void RefreshVersions() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For a member behind the published version: that version and the agents of other engines' ranks
  // with the member's (TP size, TP rank, EP size) that report it (JoinReply / HeartbeatReply).
  void FillCatchUp(const Member& m, v1::CatchUpHint* hint) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One sync (sync_coordinator_run.cc), on the sync thread: PlanSync, then each phase while the
  // attempt's status is OK, AbortPhase after a failure, FinishSync (the outcome) in any case.
  struct Attempt;
  void RunSync(uint64_t id);
  // The members that take the sync (a copy), the plan, the receiver groups; the status fails when no
  // engine can take it, the engines' quantizations differ or no bucket key could be made.
  Attempt PlanSync(uint64_t id);
  void TakeMembers(Attempt& a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Delta delivery: whether the trainer keeps a base, and the base the sync's deltas apply to; with
  // DeltaMode::kOn, the engines not on it leave a.members for a.sat_out.
  void PlanDelta(Attempt& a, DeltaMode mode) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `fn` as phase `phase` of the sync: sets the phase, times it (Attempt::phases, metrics).
  absl::Status Timed(Attempt& a, const std::string& phase, absl::FunctionRef<absl::Status()> fn);
  // Waits for trainer ranks still draining a sync given up on (a fresh deadline after).
  absl::Status AwaitTrainerRanks(Attempt& a);
  v1::BeginSyncRequest BeginRequest(const Attempt& a, size_t i) const;
  absl::Status BeginPhase(Attempt& a);
  absl::Status TransferPhase(Attempt& a);
  absl::Status PreparePhase(Attempt& a);
  // Saves the committing sync (durable before the first CommitSync), then CommitSync on every member.
  absl::Status CommitPhase(Attempt& a);
  // AbortSync on every member (roll forward where other engines committed); names them in the status.
  void AbortPhase(Attempt& a);
  static std::vector<PhaseTime> SyncTimings(const Attempt& a, double total);
  void NoteCommittedMembers(const Attempt& a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> BehindAfter(const Attempt& a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the outcome (done / partial / failed), publishes the version, ends the sync (running_).
  void FinishSync(Attempt& a);
  void RecordOutcome(const SyncRecord& rec, const std::string& outcome, const std::vector<std::string>& behind,
                     double total) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool InRunningSync(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetPhase(uint64_t id, const std::string& phase);
  void SetMemberError(uint64_t id, size_t i, const absl::Status& s);
  void FillEvent(const SyncRecord& rec, v1::SyncEvent* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `call` on every member at once; records each member's error; the first error in
  // member order.
  absl::Status CallAll(uint64_t id, const std::vector<Member>& members, const char* what,
                       absl::FunctionRef<absl::Status(AgentClient&, size_t)> call);

  const SyncCoordinatorOptions opts_;
  TrainerSide* const trainer_;
  comm::MemoryStore* const store_;
  const AgentConnector connect_;
  const std::string run_id_;  // random per coordinator: sync keys differ across restarts
  std::string store_address_;
  std::thread worker_, reaper_;
  int state_lock_fd_ = -1;  // DIR/coordinator.lock, flock()ed from LoadState to Stop

  absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, Member> members_ ABSL_GUARDED_BY(mu_);
  uint64_t next_member_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, SyncRecord> syncs_ ABSL_GUARDED_BY(mu_);
  uint64_t previous_sync_keys_ ABSL_GUARDED_BY(mu_) = 0;  // the ended sync whose store keys remain
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t running_id_ ABSL_GUARDED_BY(mu_) = 0;
  struct FleetEngine {
    uint32_t tp_size = 1;
    bool removed = false;
  };
  std::map<std::string, FleetEngine> fleet_ ABSL_GUARDED_BY(mu_);  // engine id -> what its agents said
  // The version the trainer's senders keep as their delta bases (TrainerReport::delta_held of the
  // last transfer; 0: none, or unknown after a failed one), and that transfer's delivery (broadcast
  // and sharded senders keep different bases: a base of the other delivery is none).
  uint64_t trainer_base_ ABSL_GUARDED_BY(mu_) = 0;
  plan::Delivery trainer_base_delivery_ ABSL_GUARDED_BY(mu_) = plan::Delivery::kBroadcast;
  uint64_t next_sync_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
  // The fleet's version: the newest version a sync committed on at least one engine rank.
  uint64_t published_ ABSL_GUARDED_BY(mu_) = 0;
  // The version a coordinator that stopped during its commit was committing (LoadState): every
  // engine rolls forward to it, and it is published as soon as any member reports it; 0: none.
  uint64_t rolling_forward_ ABSL_GUARDED_BY(mu_) = 0;
  // The sync whose commit is in progress (in the state file from before its first CommitSync to its
  // end; 0: none). A coordinator that stopped during a commit finds it there at start (LoadState):
  // recover_sync_ is then that sync, whose prepared staging the members roll forward from (the
  // reaper tells each member behind once, `told_`), until the version is published or a newer sync
  // starts.
  uint64_t committing_sync_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t committing_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t recover_sync_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::string> told_ ABSL_GUARDED_BY(mu_);
  uint64_t last_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::VersionRecord> versions_ ABSL_GUARDED_BY(mu_);
  uint64_t event_seq_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace wsync::trainer_agent
