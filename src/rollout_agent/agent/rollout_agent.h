// The rollout agent (proto/wsync/v1/rollout.proto, service RolloutAgent): one per engine rank.
//
//   RegisterEngine  the engine's config, quantization, TP rank and parameter memory (POSIX shm or CUDA IPC) ->
//                   EngineLayout, mapped EngineWeights checked against it (CheckMatches), one
//                   Staging allocated for all syncs. Replaces a previous engine (refused while a
//                   sync is active). Then Join + heartbeats at the coordinator, if one is configured.
//   BeginSync       reset staging coverage (a delta sync: check the staging holds its base, which
//                   every tensor then updates), start one receive thread per SyncGroup
//                   (receive/stage_receiver.h) and return at once; the engine keeps serving (with
//                   --pause-for-whole-sync it is paused here instead of at the commit).
//                   FAILED_PRECONDITION without an engine, during another sync, or for a version
//                   not newer than the engine's; the same sync_id again is a no-op. A sync of
//                   another coordinator run, or a newer one, supersedes one not committing.
//   PrepareSync     waits (until the RPC deadline) for the receive threads; returns the first
//                   error (data plane as is, checksum DATA_LOSS, loader INVALID_ARGUMENT, ...) or
//                   the staging's CheckComplete (NOT_FOUND naming missing tensors); engine memory
//                   untouched.
//   CommitSync      after a successful Prepare of that sync: Pause(HOLD) + Flush the engine
//                   (retried every 50 ms while it refuses, until min(flush deadline, timeout)),
//                   Commit (repack) staging into the engine memory, publish the version,
//                   Continue(version) the engine, wake UpdateWeights waiters, publish the recording.
//   AbortSync       any time: cancel group formation, abort the communicators (the trainer side
//                   fails fast), join the threads, Continue(previous version) if the sync paused
//                   the engine; engine memory untouched (with roll_forward: the staged version is
//                   committed as soon as the engine takes it). Idempotent (unknown / finished sync
//                   ids return the current version).
//   UpdateWeights   the engine's version once it is >= min_version (0: the newest version the
//                   coordinator has published). Asks the coordinator at once (not at the next
//                   heartbeat) what is published and which peers hold it; a version a peer holds
//                   is copied from it and committed (catch-up, below), else the call waits for the
//                   next sync, until the RPC deadline (DEADLINE_EXCEEDED says which case it was).
//   AgentStatus     ids, TP rank, version, state (idle | receiving | prepared | no_engine).
//   EngineChecksums XXH3-64 of every engine parameter as the engine holds it, with the version and
//                   the engine's config (for `wsyncctl verify`); never mixes two versions (a
//                   commit waits for it and vice versa). FAILED_PRECONDITION without an engine.
//   FetchStaging    streams the staging (the version committed here, complete and verified) to a
//                   peer agent whose engine rank has the same layout (catch-up, below).
//   ReadEngine      streams the engine's memory as it holds it (for `wsyncctl verify
//                   --independent`), under the commit's lock: one version throughout.
// Catch-up. An engine that re-registers (it restarted) behind the version this agent's staging
// holds is committed that version at once (CatchUp). An agent that restarted with its engine (no
// staging) learns from the coordinator (CatchUpHint in Join / Heartbeat replies) the published
// version and the peer agents that hold it, copies it from one of them into its staging
// (FetchStaging, each param's XXH3-64 checked), then commits it the same way. Either way the
// engine is told in RegisterEngineReply.catch_up_version, so it can hold requests until then.
// A sync left alone by its coordinator (no RPC for it for timeout_ms while none is running) is
// aborted by the agent itself: the engine continues on its previous version.
// Every failure leaves the engine's memory as it was and continues it on its previous version;
// the only exception is a repack that fails after validation (a kernel bug, kInternal): then the
// engine is left paused (its memory may be partly written) and the error says so.
//
// Ownership: the agent owns the mappings of the engine's memory, the staging, its threads and,
// unless AgentOptions::metrics is set, its metrics registry. AgentServer owns a RolloutAgent and
// the gRPC server in front of it (every handler starts with WSYNC_AUTHORIZE).
// Thread-safety: every method may be called from any thread; sync operations are serialized.
// RolloutAgent is defined in one file per phase (agent/README.md); its private state types are in
// agent/rollout_agent_state.h.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "common/buffer_pool.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "common/metrics.h"
#include "common/rpc_security.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/rollout.grpc.pb.h"

namespace grpc {
class Server;
}

namespace wsync::rollout_agent {

struct AgentOptions {
  std::string record_dir;         // --record-dir; empty: BeginSyncRequest.record is ignored
  RpcSecurity security;           // token + TLS, for the server and for calls to engine/coordinator
  std::string coordinator;        // --coordinator; empty: no Join / heartbeats
  std::string advertise_address;  // the agent address sent in Join; default: the bound address
  // The address this agent's Gloo endpoints listen on (--data-host); empty: the local address that
  // faces the coordinator, chosen by AgentServer::Start (127.0.0.1 without a coordinator, or for an
  // agent built directly).
  std::string data_host;
  // Pause the engine at BeginSync for the whole sync, instead of only
  // for the commit (the default: the engine serves while the sync is received into the staging).
  // Costs the engine the whole sync as downtime; saves nothing in memory here, since the staging
  // is a separate copy either way (--pause-for-whole-sync).
  bool pause_whole_sync = false;
  // Refuse a BeginSync without a bucket key (--bucket-mac): every bucket must be authenticated
  // (comm/bucket/bucket_mac.h). A sync that has a key is authenticated either way.
  bool require_bucket_mac = false;
  absl::Duration heartbeat = absl::Seconds(2);
  absl::Duration engine_rpc_timeout = absl::Seconds(10);
  absl::Duration flush_deadline = absl::Seconds(30);       // bounded further by the sync's timeout
  absl::Duration default_sync_timeout = absl::Minutes(5);  // when BeginSyncRequest.timeout_ms == 0
  int load_threads = 0;                                    // entries loaded at once per bucket; 0: min(4, cores)
  int repack_threads = 0;                                  // Commit; 0: the kernels' default
  // The GPU the NCCL data plane receives on (--cuda-device); -1: the device of the engine's CUDA
  // parameters (without them an nccl sync is refused: two agents of a host on one GPU would hang NCCL).
  int cuda_device = -1;
  // Where the staging lives (--staging): host memory (page-locked for a CUDA engine; the default),
  // or the GPU of a CUDA engine's parameters (a device staging: the sync is loaded and repacked on
  // the GPU and nothing crosses the host link, at the cost of a second copy of the engine rank's
  // weights in GPU memory; docs/gpu.md "Device staging"). With `device_staging` an engine whose
  // parameters are not all on one CUDA device is refused at registration, and NCCL syncs receive
  // on the staging's GPU (--cuda-device must then name it, or be left out).
  bool device_staging = false;
  MetricsRegistry* metrics = nullptr;  // not owned; null: the agent's own registry
  bool set_log_identity = false;       // log as "rollout[tp_rank]" once an engine registered
};

// What makes two engine ranks' stagings byte-compatible: model config, quantization, TP size / rank,
// EP size, a NextN draft or not, as registered. FetchStagingRequest.layout_key is its XXH3-64.
std::string LayoutKey(const v1::RegisterEngineRequest& req);
// Whether the registering engine also holds the checkpoint's MTP layer as SGLang's NextN draft
// (EngineParallel::mtp_draft): one of its params is an MTP layer's model.layers.{L}.eh_proj.weight,
// a name no target model has. The registration then checks the whole draft (CheckMatches).
bool ServesMtpDraft(const v1::RegisterEngineRequest& req);
uint64_t LayoutKeyHash(const v1::RegisterEngineRequest& req);

class RolloutAgent {
 public:
  explicit RolloutAgent(AgentOptions options);
  ~RolloutAgent();  // Stop()

  // The address the agent serves on (set by AgentServer before any RPC); used for Join.
  void SetAddress(const std::string& address);
  // Aborts an active sync (the engine continues on its previous version), wakes UpdateWeights
  // waiters, leaves the coordinator. Later RPCs fail with UNAVAILABLE. Idempotent.
  void Stop();

  // The RPCs (after authorization). `deadline`: the RPC's; `cancelled`: the client went away.
  absl::Status RegisterEngine(const v1::RegisterEngineRequest& req, v1::RegisterEngineReply* reply);
  absl::Status UpdateWeights(const v1::UpdateWeightsRequest& req, absl::Time deadline,
                             const std::function<bool()>& cancelled, v1::UpdateWeightsReply* reply);
  // `deadline` (the RPC's) also bounds the Flush retries: a caller that gave up leaves no engine paused.
  absl::Status BeginSync(const v1::BeginSyncRequest& req, v1::BeginSyncReply* reply,
                         absl::Time deadline = absl::InfiniteFuture());
  absl::Status PrepareSync(const v1::PrepareSyncRequest& req, absl::Time deadline, v1::PrepareSyncReply* reply);
  // Pauses and flushes the engine first (unless --pause-for-whole-sync paused it at BeginSync);
  // `deadline` bounds the Flush retries.
  absl::Status CommitSync(const v1::CommitSyncRequest& req, v1::CommitSyncReply* reply,
                          absl::Time deadline = absl::InfiniteFuture());
  absl::Status AbortSync(const v1::AbortSyncRequest& req, v1::AbortSyncReply* reply);
  absl::Status AgentStatus(v1::AgentStatusReply* reply);
  absl::Status EngineChecksums(v1::EngineChecksumsReply* reply);
  // ReadEngine, served: `write` sends one chunk (false: the caller went away, kCancelled). A commit
  // waits for the read to end (engine memory is read under memory_mu_). FAILED_PRECONDITION
  // without an engine.
  absl::Status ReadEngine(const std::function<bool(const v1::EngineChunk&)>& write);
  // FetchStaging, served: `write` sends one chunk (false: the caller went away, kCancelled). A sync
  // that starts meanwhile waits for the copy to end (the staging is read under staging_mu_).
  absl::Status ServeStaging(const v1::FetchStagingRequest& req,
                            const std::function<bool(const v1::StagingChunk&)>& write);

  uint64_t version() const;
  MetricsRegistry& metrics() const;
  // The gRPC service over this agent (owned by the agent).
  grpc::Service* service();

 private:
  struct Engine;
  struct Sync;
  // Pause(HOLD) then Flush (retried until `deadline`, bounded by the flush deadline and the sync's
  // timeout); marks the engine paused first, so a failure continues it. Returns a log line.
  absl::StatusOr<std::string> PauseEngine(Sync* s, absl::Time deadline);
  class Service;
  struct Metrics;
  enum class Phase;

  // RegisterEngine's first half, under op_mu_: checks the request, maps the engine's memory, makes
  // or keeps the staging, installs the engine and updates the coordinator's join request. The rest
  // (waiting for the join, the paused-engine check) runs without op_mu_ on what this returns.
  struct Registered {
    std::shared_ptr<class EngineClient> client;    // the installed engine's
    std::shared_ptr<class Membership> membership;  // null without a coordinator
    bool catch_up = false;                         // the kept staging's version is committed into it
    uint64_t staged = 0;                           // that version
  };
  absl::StatusOr<Registered> InstallEngine(const v1::RegisterEngineRequest& req, const std::string& who);
  // InstallEngine's staging for `engine` (its layout and memory set): the installed engine's, moved,
  // when `keep`; else a new one in `space`, the installed engine (and its staging) dropped first so
  // that one staging at most is allocated at a time. Page-locked for a CUDA engine (a failure to
  // pin is logged: it costs speed only). Errors: the allocation's, annotated with `who`.
  absl::Status StageEngine(Engine& engine, bool keep, MemorySpace space, const std::string& who)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  static std::string SyncRun(const v1::BeginSyncRequest& req);
  // The version a delta sync can be applied to: the staging's (complete and verified) when it is
  // in host memory, else 0 (JoinRequest.staged_version). Takes mu_.
  uint64_t DeltaBaseVersion() const;
  absl::Status CheckBegin(const v1::BeginSyncRequest& req, bool* duplicate, v1::BeginSyncReply* reply)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // StartSync's checks of the request alone (backend, groups, bucket key): its backend, or the error
  // (`who` names the call).
  absl::StatusOr<comm::Backend> CheckSyncRequest(const v1::BeginSyncRequest& req, const std::string& who) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  absl::Status StartSync(const v1::BeginSyncRequest& req, v1::BeginSyncReply* reply, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  void RunStage(Sync* sync, size_t index);
  // The GPU a device sync (nccl, cuda-ipc) receives on: --cuda-device, else the device of the
  // engine's CUDA parameters, else -1 (unknown: such a sync is refused). Under op_mu_ or mu_ (reads engine_).
  int ReceiveDevice() const;
  BufferPool* DevicePool(int device);
  // Frees the device pools' idle buffers: after a sync's stage threads have ended (no device
  // operation runs), so that no cudaFree waits beside one; the engine's GPU gets the memory back
  // between syncs.
  void TrimDevicePools();
  // Ends `sync` (cancel, join threads, drop the recording, continue the engine on the previous
  // version if the agent paused it). Returns the status of Continue.
  absl::Status EndFailedSync(Sync* sync, const std::string& reason, bool continue_engine)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // CommitSync's failed CommitStaging (`st`): a refusal (nothing written) ends the sync and
  // continues the engine on its previous version, returning `st` annotated; a failure after
  // validation (kInternal) ends it and leaves the engine paused, returning kInternal saying so.
  absl::Status FailCommit(Sync* s, const absl::Status& st, const std::string& who)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // Records `s`, the active sync, as the last that ended (id, run, outcome; committed when
  // `outcome` is OK) and drops it (`s` dangles after).
  void RetireSync(Sync* s, const absl::Status& outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AbortById(uint64_t sync_id, const std::string& reason, uint64_t* version);
  void Watchdog();
  // Roll forward: commits the owed version from the staging into the engine (Pause, Flush, Commit,
  // Continue) when no sync runs; a no-op when nothing is owed. Failures are logged and retried.
  void CatchUp();
  // Writes the staging into the engine's memory (Commit, under memory_mu_) and, on success, makes
  // `version` the agent's version. The engine must be paused. The CommitSync and CatchUp step.
  absl::Status CommitStaging(Engine& e, uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // Catch-up from a peer: copies `hint.version` from the first of `hint.peers` that has it into the
  // staging, then owes it to the engine (CatchUp commits it). On failure retried with backoff; an
  // engine told to hold for it is continued on its version meanwhile.
  void FetchFromPeers(const v1::CatchUpHint& hint);
  absl::Status FetchFrom(const std::string& peer, uint64_t version, Engine& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_);
  // This agent's id (AgentStatus, RegisterEngineReply): "agent@<address>/pid<pid>-<random>", fixed
  // for the process's lifetime. The coordinator's own id for it is used for heartbeats only.
  std::string AgentId() const;

  const AgentOptions options_;
  const std::string agent_id_salt_;  // see AgentId()
  std::unique_ptr<MetricsRegistry> own_metrics_;
  std::unique_ptr<Metrics> m_;
  std::unique_ptr<Service> service_;

  // op_mu_ serializes the operations that change the engine or the sync (held across engine RPCs,
  // repacks and thread joins); mu_ guards the state below and is only held briefly.
  absl::Mutex op_mu_ ABSL_ACQUIRED_BEFORE(memory_mu_);
  // Held exclusively while the engine's memory is written (Commit) or the engine replaced, shared
  // while it is read for checksums. Order: op_mu_, memory_mu_, mu_.
  absl::Mutex memory_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // Shared while a peer copies the staging out (ServeStaging); exclusive while the staging starts
  // being written (a sync starting, a copy in from a peer) or is replaced. Order: op_mu_,
  // staging_mu_, memory_mu_, mu_.
  absl::Mutex staging_mu_ ABSL_ACQUIRED_BEFORE(memory_mu_);
  mutable absl::Mutex mu_;
  std::string address_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Engine> engine_;  // written under op_mu_ and mu_; read under either
  std::unique_ptr<Sync> sync_;      // the same
  // Received bucket buffers kept across syncs: one being received while the previous one loads.
  BufferPool bucket_pool_{2};
  // A device data plane (nccl, cuda-ipc): receive buffers on each GPU (DevicePool), and the page-locked host buffers
  // every device bucket is copied into for the loader. Shared by the stages of a sync; nothing is
  // freed while its streams run (keep_until_trim), all of it after (TrimDevicePools).
  absl::Mutex pools_mu_;
  std::map<int, std::unique_ptr<BufferPool>> device_pools_ ABSL_GUARDED_BY(pools_mu_);
  BufferPool pinned_pool_{3, [](size_t n) { return AllocatePinnedBuffer(n); }, /*keep_until_trim=*/true};
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The last sync that ended: its id and outcome (for idempotent / late RPCs).
  uint64_t last_sync_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_sync_run_ ABSL_GUARDED_BY(mu_);  // SyncRun of the last sync that ended
  bool last_committed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status last_outcome_ ABSL_GUARDED_BY(mu_);
  // The staging holds sync staged_sync_id_'s version, complete and verified (set when a sync is
  // prepared, cleared when another starts receiving or the engine is replaced).
  uint64_t staged_sync_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t staged_version_ ABSL_GUARDED_BY(mu_) = 0;
  // A version the coordinator asked to roll forward to (AbortSync.roll_forward); 0: none.
  uint64_t owed_version_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time next_catch_up_ ABSL_GUARDED_BY(mu_);
  int catch_up_failures_ ABSL_GUARDED_BY(mu_) = 0;
  // Catch-up from a peer: when to try again, and whether the engine was told to hold for it.
  absl::Time next_fetch_ ABSL_GUARDED_BY(mu_);
  int fetch_failures_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t promised_version_ ABSL_GUARDED_BY(mu_) = 0;
  // The context of a copy from a peer in progress (FetchFrom), which BeginSync cancels.
  grpc::ClientContext* fetch_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  // UpdateWeights asks the watchdog to ask the coordinator now (hint_wanted_); the answer is
  // last_hint_ / last_hint_status_, hint_seq_ counts answers.
  bool hint_wanted_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t hint_seq_ ABSL_GUARDED_BY(mu_) = 0;
  v1::CatchUpHint last_hint_ ABSL_GUARDED_BY(mu_);
  absl::Status last_hint_status_ ABSL_GUARDED_BY(mu_);
  // Used under op_mu_ (reset by Stop); RegisterEngine keeps a reference while it waits for the join.
  std::shared_ptr<class Membership> membership_;
  std::thread watchdog_;
};

class AgentServer {
 public:
  // Listens on `listen` ("127.0.0.1:0" picks a port) with ServerCredentials(options.security).
  // kUnavailable if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<AgentServer>> Start(const std::string& listen, AgentOptions options);
  ~AgentServer();  // Shutdown()

  // "host:port" as bound (the port resolved).
  const std::string& address() const { return address_; }
  RolloutAgent& agent() { return *agent_; }
  // Stops the agent (see RolloutAgent::Stop), then the server. Idempotent.
  void Shutdown();

 private:
  AgentServer() = default;
  std::unique_ptr<RolloutAgent> agent_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace wsync::rollout_agent
