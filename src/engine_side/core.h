// EngineCore: one engine rank's state machine, shared by every engine process wsync runs (the
// reference engine, wsync-ref-engine, and the engines behind libwsync_engine_host.so). It owns the
// rank's ServedModel (which reads the parameter memory the rollout agent writes) and implements the
// RolloutEngine semantics of proto/wsync/v1/engine.proto: Generate on one weight version, Pause
// (HOLD / ABORT), Flush, Continue(version) with a re-Prepare, Health and WeightVersion.
//
// Versions. The forward pass reads the parameter memory the rollout agent writes IN PLACE (bf16
// rows, Marlin INT4 tiles; weights.h "Serving"). EngineModel::Prepare() validates that
// memory (names, dtypes, shapes, no NaN / Inf once dequantized) and refreshes the few float32
// copies it keeps (norms, biases); it runs only inside Continue, after new admissions are stopped
// and the running requests have finished. So the memory may be written only while this rank is
// paused AND flushed (Flush returned OK: no request in flight), and every write must be followed
// by a Continue with a new version number (or, after a failed Prepare, any Continue): a Continue
// on the served version does not re-Prepare and would serve what the memory then holds. The
// rollout agent does exactly that (Pause(HOLD) + Flush retried until it succeeds, write, then
// Continue(version); an aborted sync never wrote, so Continue(previous version) is right), so a
// request never spans two versions. A failed Prepare (the memory was already overwritten with
// something invalid) makes the rank UNHEALTHY: it refuses every request (the model would read the
// new, invalid memory) until a Continue prepares successfully; the version it reports stays the
// last good one.
//
// Tensor parallelism (T > 1). Every rank has an EngineCore; they share a Communicator (the engine's
// own Gloo TP group). Rank 0 is the entry point: its Generate
//   1. waits locally while rank 0 is paused with HOLD (or preparing), up to the request's deadline
//      and EngineCoreOptions::hold_timeout;
//   2. takes the TP channel and broadcasts the request (a 32-byte header, then the prompt);
//   3. all ranks try to admit it without blocking and AllGather {admission, version};
//   4. if every rank admitted it on the same version, all compute in lockstep (every forward pass
//      first AllGathers the ranks' abort flags, so a Pause(ABORT) on any rank stops all of them
//      at the same step); otherwise every rank drops it and rank 0 decides: a peer paused with
//      ABORT, unhealthy or without weights fails the request at once; a peer paused with HOLD or
//      preparing, or ranks on different versions (a sync committing rank by rank), make rank 0 retry
//      every 20 ms; different versions fail with UNAVAILABLE after EngineCoreOptions::version_wait.
// Other ranks' Generate returns FAILED_PRECONDITION naming rank 0. Their requests arrive through a
// follower thread that listens to rank 0; when rank 0 is idle it broadcasts a heartbeat every
// `heartbeat`, and a follower that hears nothing for `idle_timeout` declares the group broken. A
// failed collective also breaks the group: the rank turns UNHEALTHY and refuses requests until
// the group is formed again (tp_group.h re-forms it: AwaitBroken, DetachGroup, AttachGroup of a new
// communicator). A rank keeps its weights and version across a re-formation; a restarted rank
// comes back with its own (a checkpoint's, or none), so requests wait until every rank holds the
// same version again (its rollout agent catches it up). On Shutdown rank 0 broadcasts a shutdown
// command; followers then call the shutdown callback.
//
// Status codes: INVALID_ARGUMENT (bad prompt / lengths), FAILED_PRECONDITION (no weights yet, not
// the entry rank), UNAVAILABLE (paused with ABORT, unhealthy, TP group broken or forming, versions
// disagree too long, HOLD outlasting hold_timeout, shutting down), DEADLINE_EXCEEDED (the caller's
// deadline passed while held), CANCELLED (the caller went away while held).
//
// Thread-safety: every public method may be called from any thread, concurrently. Ownership: the
// core owns the model and the communicator; the ParamLookup's memory must outlive the core.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "common/config.h"
#include "engine_model/engine_layout.h"
#include "engine_side/tp_collectives.h"

namespace wsync::engine_side {

using engine_model::EngineRank;

enum class PauseMode { kHold, kAbort };

struct HealthInfo {
  enum class State { kServing, kPaused, kNoWeights, kUnhealthy };
  State state = State::kNoWeights;
  uint64_t version = 0;
  uint32_t in_flight = 0;
  std::string detail;
};
absl::string_view HealthStateName(HealthInfo::State s);  // "SERVING", "PAUSED", ...

struct GenerateResult {
  std::vector<int32_t> tokens;
  uint64_t version = 0;
};

// What an EngineCore serves: the reference engine's EngineModel (ref_engine/ref_core.h), or
// another engine behind an adapter (src/engine_host: an engine in Python through callbacks).
// Prepare and Generate are called by the core only, never concurrently with each other's
// Prepare: Prepare only while no request is admitted (the core's pause protocol above).
class ServedModel {
 public:
  // Called before every forward pass with the number of tokens generated so far; a non-OK status
  // stops generation and is returned.
  using StepHook = std::function<absl::Status(int step)>;
  virtual ~ServedModel() = default;
  // Reads the weights the parameter memory holds now, to serve them as `version`. On error the
  // core turns UNHEALTHY until a later Prepare succeeds.
  virtual absl::Status Prepare(uint64_t version) = 0;
  // Greedy decoding of max_new_tokens tokens; `before_step` (may be null) is called before every
  // forward pass and stops generation with its error.
  virtual absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int max_new_tokens,
                                                        const StepHook& before_step) = 0;
  // Hooks for an engine that also serves requests the core does not admit (an HTTP server of its
  // own): called after the core paused (errors are logged) and after every successful Continue,
  // with the version served (an error fails the Continue). No-ops by default.
  virtual absl::Status OnPause(PauseMode) { return absl::OkStatus(); }
  virtual absl::Status OnContinue(uint64_t) { return absl::OkStatus(); }
};

struct EngineCoreOptions {
  absl::Duration hold_timeout = absl::Minutes(10);        // longest a Generate waits for a HOLD
  absl::Duration version_wait = absl::Seconds(10);        // longest the TP ranks may disagree on versions
  absl::Duration heartbeat = absl::Seconds(1);            // rank 0's idle broadcast period
  absl::Duration idle_timeout = absl::Seconds(30);        // a follower's longest silence from rank 0
  absl::Duration collective_timeout = absl::Seconds(60);  // every other TP collective
  absl::Duration step_delay = absl::ZeroDuration();       // test seam: sleep before every forward pass
  std::string engine_id;                                  // for messages
};

class EngineCore {
 public:
  // A model served by T ranks in lockstep (the file comment): `make_model` is called once, with
  // the collectives over the TP group (empty with T = 1), which its forward pass may call; its
  // errors pass through. The core starts with no weights; T > 1 ranks are "forming" until
  // AttachGroup or GroupFailed.
  using ModelFactory = std::function<absl::StatusOr<std::unique_ptr<ServedModel>>(TpCollectives)>;
  static absl::StatusOr<std::unique_ptr<EngineCore>> Create(const ModelConfig& config, EngineRank rank,
                                                            const ModelFactory& make_model, EngineCoreOptions options);
  ~EngineCore();  // Shutdown()
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  // A core over another engine's model (one rank: T must be 1, since the lockstep TP protocol is
  // the reference model's; an engine that shards does so itself). kInvalidArgument for T != 1.
  static absl::StatusOr<std::unique_ptr<EngineCore>> Create(const ModelConfig& config, EngineRank rank,
                                                            std::unique_ptr<ServedModel> model,
                                                            EngineCoreOptions options);

  // Prepares the weights in memory as `version` (start-up from a checkpoint); Prepare's errors.
  absl::Status PrepareInitial(uint64_t version, std::string source);

  // T > 1: the formed TP group (rank r of T). Rank 0 starts its heartbeat thread, other ranks
  // their follower thread. `leader_address` names rank 0's RolloutEngine for redirections. Called
  // once at start and again after each DetachGroup.
  void AttachGroup(std::unique_ptr<comm::Communicator> comm, std::string leader_address);
  // T > 1: the group could not be formed (yet); the rank stays UNHEALTHY with this reason until an
  // AttachGroup.
  void GroupFailed(const absl::Status& status);
  // T > 1, with a group attached: blocks until the group breaks (returns true, *why = what broke
  // it) or the core shuts down or `cancelled()` (polled every 100 ms) returns true (false).
  bool AwaitBroken(const std::function<bool()>& cancelled, absl::Status* why);
  // T > 1, after the group broke: aborts the communicator (peers' pending collectives fail at once,
  // so they notice too), stops the heartbeat / follower thread, waits for a request using the
  // group to fail, drops the communicator; the rank is "re-forming" until the next AttachGroup.
  void DetachGroup(const absl::Status& why);
  // Called (once, from the follower thread) when rank 0 shuts the engine down.
  void SetShutdownCallback(std::function<void()> callback);

  // See the file comment. `deadline` bounds waiting (not computing); `cancelled` is polled while
  // waiting (may be null).
  absl::StatusOr<GenerateResult> Generate(absl::Span<const int32_t> prompt, int64_t max_new_tokens, absl::Time deadline,
                                          const std::function<bool()>& cancelled);
  // Admission for requests an embedding process computes itself (T = 1; engine_host): waits as
  // Generate does while the rank is held (up to `deadline` and hold_timeout), then counts the
  // request in flight and returns the version it must be computed with; the caller must call
  // EndRequest() once it is done. Generate's refusals (UNAVAILABLE, FAILED_PRECONDITION, ...).
  absl::StatusOr<uint64_t> BeginRequest(absl::Time deadline, const std::function<bool()>& cancelled);
  void EndRequest() { Release(); }
  // Whether a running request admitted by BeginRequest should stop now (paused with ABORT, or
  // shutting down): the error to return, else OK.
  absl::Status RequestStopped() const;

  // Stops admitting requests; ABORT also stops running ones at their next step. Returns the
  // number of requests in flight at the time. Idempotent; a later call sets the mode.
  uint32_t Pause(PauseMode mode);
  // FAILED_PRECONDITION while requests are in flight on this rank. The engine keeps no cache across
  // requests, so there is nothing else to drop. OK (while paused) means the memory may be written.
  absl::Status Flush();
  // Resumes. Re-prepares from memory when `version` differs from the served one, or the rank is
  // unhealthy, or it has no weights and `version` > 0 (waits up to `deadline` for running requests);
  // otherwise serves the memory as it is (see "Versions").
  // Returns the served version; Prepare's error (the rank is then UNHEALTHY), UNAVAILABLE when the
  // TP group is broken or the core shutting down, FAILED_PRECONDITION for a concurrent Continue.
  absl::StatusOr<uint64_t> Continue(uint64_t version, absl::Time deadline);
  HealthInfo Health() const;
  uint64_t version() const;
  // The rollout agent's answer to a registration (RegisterEngineReply.catch_up_version): it is about
  // to commit version `v` into this rank's memory. When `v` is newer than the served version, new
  // requests are held (as by Pause(HOLD)) until the agent's Continue, so that a restarted rank does
  // not serve its older weights meanwhile; otherwise (the commit came first, or `v` == 0: a new
  // agent that holds nothing) a hold set by an earlier call is released. An explicit Pause or
  // Continue takes the hold over.
  void HoldForCatchUp(uint64_t v);

  // Fails held requests, stops running ones at their next step, tells the followers (rank 0),
  // stops the threads and shuts the communicator down. Idempotent.
  void Shutdown();

  const EngineRank& rank() const { return rank_; }
  const ModelConfig& config() const { return config_; }

 private:
  enum Admit : int32_t { kOk = 0, kHold = 1, kAbort = 2, kNoWeights = 3, kUnhealthy = 4, kStopping = 5 };
  enum class Group { kSingle, kForming, kReady, kBroken };
  enum class Weights { kNone, kReady, kBad };
  struct RankStatus {
    int32_t admit = 0;
    int32_t reserved = 0;
    uint64_t version = 0;
  };
  static_assert(sizeof(RankStatus) == 16);
  struct Header;

  EngineCore(ModelConfig config, EngineRank rank, EngineCoreOptions options);

  Admit TryAdmitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits while TryAdmitLocked() says kHold (until hold_until / the deadline / cancelled); then
  // the version admitted, or the refusal. `held_by` says why, for the timeout message.
  absl::StatusOr<uint64_t> AdmitWaiting(const std::string& where, absl::Time start, absl::Time hold_until,
                                        absl::Time deadline, const std::function<bool()>& cancelled,
                                        const std::string& held_by) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release();
  // Continue without the model's OnContinue hook.
  absl::StatusOr<uint64_t> ContinueServing(uint64_t version, absl::Time deadline);
  // 2 when shutting down, 1 when paused with ABORT, else 0 (what a running request checks).
  int32_t StopFlag() const;
  absl::Status Refusal(Admit admit, int tp_rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkBroken(const absl::Status& status);
  std::string WhereLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lockstep generation (admission held); every rank calls it with the same arguments.
  absl::StatusOr<std::vector<int32_t>> Compute(absl::Span<const int32_t> prompt, int max_new_tokens);
  // Collectives (T > 1); a failure breaks the group.
  absl::Status Collective(absl::StatusOr<std::unique_ptr<comm::Work>> work);
  absl::Status SendHeader(uint32_t type, uint32_t prompt_len, uint32_t max_new, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(channel_mu_);
  absl::StatusOr<std::vector<RankStatus>> Agree(RankStatus mine);
  absl::StatusOr<GenerateResult> LeaderRound(absl::Span<const int32_t> prompt, int max_new_tokens, uint64_t version,
                                             bool* retry, bool* versions_differ);
  void HeartbeatLoop();
  void FollowerLoop();

  const ModelConfig config_;
  const EngineRank rank_;
  const EngineCoreOptions options_;
  std::unique_ptr<ServedModel> model_;
  // Set by AttachGroup, before any Generate is admitted; replaced only by DetachGroup (under
  // channel_mu_, with the heartbeat / follower thread joined and the group broken, so no request
  // can be using it).
  std::unique_ptr<comm::Communicator> comm_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool held_for_catch_up_ ABSL_GUARDED_BY(mu_) = false;  // paused_ set by HoldForCatchUp
  PauseMode mode_ ABSL_GUARDED_BY(mu_) = PauseMode::kHold;
  bool preparing_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  Weights weights_ ABSL_GUARDED_BY(mu_) = Weights::kNone;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  std::string weights_detail_ ABSL_GUARDED_BY(mu_);
  Group group_ ABSL_GUARDED_BY(mu_) = Group::kSingle;
  std::string group_detail_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_by_ ABSL_GUARDED_BY(mu_);  // what broke the group (MarkBroken)
  std::string leader_address_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> shutdown_callback_ ABSL_GUARDED_BY(mu_);

  // Serializes rank 0's use of the TP group (requests and heartbeats) so that every rank sees the
  // same sequence of collectives.
  absl::Mutex channel_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  uint64_t seq_ ABSL_GUARDED_BY(channel_mu_) = 0;
  absl::Time last_send_ ABSL_GUARDED_BY(channel_mu_);

  std::atomic<bool> shut_down_{false};
  std::thread heartbeat_;
  std::thread follower_;
};

}  // namespace wsync::engine_side
