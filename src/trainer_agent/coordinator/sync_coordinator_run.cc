// SyncCoordinator's syncs: triggers and their queue (TriggerSync, SyncLoop), and one sync, phase by
// phase (RunSync: begin -> transfer -> prepare -> commit, or abort), on the sync thread.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/bucket/bucket_mac.h"
#include "common/config.h"
#include "common/failpoint.h"
#include "common/logging.h"
#include "common/parallel_for.h"
#include "common/status.h"
#include "trainer_agent/coordinator/sync_coordinator.h"
#include "trainer_agent/coordinator/sync_coordinator_internal.h"
#include "trainer_agent/coordinator/sync_keys.h"

namespace wsync::trainer_agent {

using coordinator_internal::CounterOf;
using coordinator_internal::GaugeOf;
using coordinator_internal::HistogramOf;

namespace {

// The quantization_config every member's engine registered, when they describe one quantization
// (QuantizationConfig::Canonical; the engine layouts may differ): one of the JSON texts, "" for bf16
// engines. kFailedPrecondition naming the engines of each quantization when they differ, or an
// engine whose config does not parse.
template <typename Member>
absl::StatusOr<std::string> EnginesQuantization(const std::vector<Member>& members) {
  struct Kind {
    std::string json, description;
    std::set<std::string> engines;
  };
  std::map<std::string, Kind> by;  // QuantizationConfig::Canonical (or "bf16") -> engines
  for (const Member& m : members) {
    std::string canonical = "bf16", description = "bf16";
    if (!m.quant_json.empty()) {
      absl::StatusOr<QuantizationConfig> q =
          ParseQuantizationConfig(m.quant_json, absl::StrCat("engine ", m.engine_id, "'s quantization_config"));
      if (!q.ok()) return absl::FailedPreconditionError(q.status().message());
      canonical = q->Canonical();
      description = q->Describe();
    }
    Kind& k = by[canonical];
    if (k.engines.empty()) k = {m.quant_json, description, {}};
    k.engines.insert(m.engine_id);
  }
  if (by.size() <= 1) return by.empty() ? std::string() : by.begin()->second.json;
  std::vector<std::string> parts;
  for (const auto& [canonical, k] : by)
    parts.push_back(absl::StrCat(absl::StrJoin(k.engines, ", "), ": ", k.description));
  return absl::FailedPreconditionError(absl::StrCat(
      "the engines serve different quantizations (", absl::StrJoin(parts, "; "),
      "); one sync sends one, so every engine must declare the same quantization_config (their engine_layout "
      "may differ)"));
}

}  // namespace

// --- Triggers and the queue -----------------------------------------------------------------------

absl::Status SyncCoordinator::TriggerSync(const v1::TriggerSyncRequest& req, v1::TriggerSyncReply* reply) {
  absl::MutexLock lock(&mu_);
  if (members_.size() < std::max<size_t>(1, req.min_agents())) {
    return absl::FailedPreconditionError(absl::StrCat("a sync needs at least ", std::max<uint32_t>(1, req.min_agents()),
                                                      " rollout agents; ", members_.size(), " have joined"));
  }
  RETURN_IF_ERROR(CanSync());
  plan::Delivery delivery = opts_.delivery;
  // Versions only grow, also over a coordinator that lost its state: past every member's.
  uint64_t served = 0;
  for (const auto& [mid, m] : members_) served = std::max(served, m.version);
  if (!req.delivery().empty()) {
    ASSIGN_OR_RETURN(delivery, plan::ParseDelivery(req.delivery()));
  }
  DeltaMode delta = opts_.delta;
  if (!req.delta().empty()) {
    ASSIGN_OR_RETURN(delta, ParseDeltaMode(req.delta()));
  }
  if (const uint64_t v = req.version(); v != 0) {
    // Join a sync of the same version (queued, running, or done): one sync for all ranks.
    for (auto& [sid, rec] : syncs_) {
      if (rec.version == v && (!rec.finished || rec.phase == "done" || rec.phase == "partial")) {
        reply->set_sync_id(sid);
        reply->set_version(v);
        reply->set_coalesced(true);
        return absl::OkStatus();
      }
    }
    uint64_t newest = published_;
    for (uint64_t q : queue_) newest = std::max(newest, syncs_[q].version);
    if (running_) newest = std::max(newest, syncs_[running_id_].version);
    if (v <= std::max(newest, served)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "version ", v, " is not newer than version ", std::max(newest, served),
          newest >= served ? " (published, queued or running)" : " (an engine serves it)", "; versions only grow"));
    }
  }
  if ((running_ || !queue_.empty()) && !req.wait_if_busy()) {
    return absl::FailedPreconditionError(absl::StrCat("sync ", running_ ? running_id_ : queue_.front(),
                                                      " is in progress; retry later or pass wait_if_busy"));
  }
  const uint64_t before_id = next_sync_id_, before_version = next_version_;
  const uint64_t id = next_sync_id_++;
  SyncRecord rec;
  rec.id = id;
  rec.delivery = delivery;
  rec.delta = delta;
  if (req.version() != 0) {
    rec.version = req.version();
    next_version_ = std::max(next_version_, rec.version + 1);
  } else {
    next_version_ = std::max(next_version_, served + 1);
    rec.version = next_version_++;
  }
  syncs_[id] = rec;
  queue_.push_back(id);
  ++event_seq_;
  // The numbers are durable before any agent hears of them: a trainer job that dies during this
  // sync restarts with the next id and version, which the agents (that saw this one begin and end)
  // accept, instead of this id again, which they would refuse as ended. Numbers that cannot be made
  // durable (a full or broken state directory) are taken back and the trigger is refused: a sync
  // that started anyway could be repeated under the same numbers after a restart.
  if (absl::Status saved = SaveState(); !saved.ok()) {
    syncs_.erase(id);
    queue_.pop_back();
    next_sync_id_ = before_id;
    next_version_ = before_version;
    return Annotate(saved, absl::StrCat("the coordinator cannot make sync ", id, " (version ", rec.version,
                                        ") durable, so it was not started (free space in or fix --state-dir ",
                                        opts_.state_dir, ")"));
  }
  reply->set_sync_id(id);
  reply->set_version(rec.version);
  return absl::OkStatus();
}

void SyncCoordinator::SyncLoop() {
  for (;;) {
    uint64_t id;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      id = queue_.front();
      queue_.pop_front();
      running_ = true;
      running_id_ = id;
      syncs_[id].start = absl::Now();
    }
    RunSync(id);  // ends with running_ = false, under the same lock as the sync's outcome
  }
}

void SyncCoordinator::SetPhase(uint64_t id, const std::string& phase) {
  absl::MutexLock lock(&mu_);
  auto& rec = syncs_[id];
  rec.phase = phase;
  for (auto& m : rec.members) m.set_phase(phase);
  ++event_seq_;
}

void SyncCoordinator::SetMemberError(uint64_t id, size_t i, const absl::Status& s) {
  absl::MutexLock lock(&mu_);
  auto& rec = syncs_[id];
  if (i < rec.members.size()) rec.members[i].set_error(std::string(s.message()));
  ++event_seq_;
}

absl::Status SyncCoordinator::CallAll(uint64_t id, const std::vector<Member>& members, const char* what,
                                      absl::FunctionRef<absl::Status(AgentClient&, size_t)> call) {
  auto statuses = RunConcurrently(members.size(), [&](size_t i) {
    absl::Status s = call(*members[i].client, i);
    if (!s.ok()) {
      s = Annotate(s, absl::StrCat(what, " on ", members[i].id, " (", members[i].address, ", engine ",
                                   members[i].engine_id, " tp ", members[i].tp_rank, ")"));
      SetMemberError(id, i, s);
    }
    return s;
  });
  for (auto& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// --- One sync -------------------------------------------------------------------------------------

// One sync as its phases see it (RunSync): who takes it, the plan, and what each phase returned.
struct SyncCoordinator::Attempt {
  uint64_t id = 0;
  absl::Time start;                  // when the sync thread took it (SyncRecord::start)
  std::vector<Member> members;       // copies: the membership may change during the sync
  std::vector<std::string> sat_out;  // engines missing a rank's agent (IncompleteEngines)
  SyncPlan plan;
  plan::Grouping grouping;        // sharded delivery: the members' receiver groups
  absl::Status status;            // the first failure; no later phase runs after one
  std::vector<PhaseTime> phases;  // the coordinator's own (Timed)
  TrainerReport report;
  std::vector<v1::PrepareSyncReply> prepared;  // one per member
  std::vector<v1::CommitSyncReply> committed;  // one per member
  bool some_committed = false;                 // a failed commit that other engines had completed: they roll forward
  std::vector<uint64_t> reported;              // after a failure: the version each member said it holds
};

namespace {

// Every call to the agents ends by the sync's deadline (a hung agent fails the sync within its
// timeout, not an RPC timeout later), but never gets less than `floor`. The commit keeps at least
// kCommitFloor even past the deadline: cutting a commit short would report a failure while the
// agent may still be writing its engine.
constexpr absl::Duration kCallFloor = absl::Seconds(1), kCommitFloor = absl::Seconds(5);
absl::Duration Bounded(const SyncPlan& plan, absl::Duration nominal, absl::Duration floor) {
  return std::max(std::min(nominal, plan.deadline - absl::Now()), std::min(floor, nominal));
}

}  // namespace

// begin -> transfer -> prepare -> commit; on any failure, abort on every member and no later phase.
void SyncCoordinator::RunSync(uint64_t id) {
  Attempt a = PlanSync(id);
  if (a.status.ok()) a.status = AwaitTrainerRanks(a);
  if (a.status.ok()) a.status = Timed(a, "begin", [&] { return BeginPhase(a); });
  if (a.status.ok()) a.status = Timed(a, "transfer", [&] { return TransferPhase(a); });
  if (a.status.ok()) a.status = Timed(a, "prepare", [&] { return PreparePhase(a); });
  if (a.status.ok()) a.status = CommitPhase(a);
  if (!a.status.ok()) AbortPhase(a);
  FinishSync(a);  // ends with running_ = false, under the same lock as the sync's outcome
}

void SyncCoordinator::TakeMembers(Attempt& a) {
  a.status = CanSync();  // no engine of the fleet can take the sync: it fails before BeginSync
  // A removed engine's agents, and those of an engine missing a rank's agent, sit the sync out
  // (half an engine is never written); the latter are named as behind when it ends.
  a.sat_out = IncompleteEngines();
  for (auto& [mid, m] : members_) {
    const FleetEngine& e = fleet_[m.engine_id];
    if (!e.removed && MissingRanks(m.engine_id, e.tp_size).empty()) a.members.push_back(m);
  }
  auto& rec = syncs_[a.id];
  a.start = rec.start;
  if (recover_sync_ != 0) {
    WSYNC_LOG(WARNING) << "sync " << a.id << " supersedes the roll forward to version " << rolling_forward_;
    for (v1::VersionRecord& vr : versions_) {
      if (vr.outcome() != "rolling_forward") continue;
      vr.set_outcome("failed");  // no engine had reported it: the engines go to this sync's version instead
      vr.set_error(absl::StrCat(vr.error(), "; superseded by sync ", a.id, " before any engine reported it"));
    }
    rolling_forward_ = 0;
  }
  recover_sync_ = 0;  // this sync brings every engine forward (or fails and changes nothing)
  told_.clear();
  a.plan.sync_id = a.id;
  a.plan.version = rec.version;
  a.plan.delivery = rec.delivery;
  if (a.status.ok()) {
    absl::StatusOr<std::string> q = EnginesQuantization(a.members);
    if (q.ok()) {
      a.plan.engine_quant_json = *std::move(q);
    } else {
      a.status = q.status();
    }
  }
  PlanDelta(a, rec.delta);
  for (auto& m : a.members) {
    v1::MemberState ms;
    ms.set_agent_id(m.id);
    ms.set_engine_id(m.engine_id);
    ms.set_tp_rank(m.tp_rank);
    rec.members.push_back(ms);
  }
  rec.expected_bytes = last_bytes_;
}

void SyncCoordinator::PlanDelta(Attempt& a, DeltaMode mode) {
  a.plan.keep_delta_base = mode != DeltaMode::kOff && a.status.ok();
  const uint64_t base = trainer_base_delivery_ == a.plan.delivery ? trainer_base_ : 0;
  if (!a.plan.keep_delta_base || base == 0) return;
  // An engine takes the delta only when each of its ranks' stagings holds the base.
  std::set<std::string> off_base;
  for (const Member& m : a.members)
    if (m.staged_version != base) off_base.insert(m.engine_id);
  if (off_base.empty()) {
    a.plan.delta_base = base;
    return;
  }
  std::set<std::string> engines;
  for (const Member& m : a.members) engines.insert(m.engine_id);
  // kOn: an engine off the base sits out only if every rank of it can copy the new version from a
  // rank laid out as it is (catch-up), of an engine that takes the sync.
  std::set<std::tuple<uint32_t, uint32_t, uint32_t, bool>> peers;
  for (const Member& m : a.members)
    if (!off_base.contains(m.engine_id)) peers.insert(m.rank_layout());
  bool copyable = true;
  for (const Member& m : a.members)
    copyable = copyable && (!off_base.contains(m.engine_id) || peers.contains(m.rank_layout()));
  if (mode == DeltaMode::kAuto || !copyable) {
    WSYNC_LOG(INFO) << "sync " << a.id << " is sent in full: " << off_base.size() << " of " << engines.size()
                    << " engines do not hold version " << base << " (" << absl::StrJoin(off_base, ", ") << ")"
                    << (mode == DeltaMode::kOn ? ", and not every rank of them has a peer to copy from" : "");
    return;
  }
  // kOn: the engines off the base sit out and copy the new version from a peer after the sync.
  std::vector<Member> taking;
  for (Member& m : a.members) {
    if (!off_base.contains(m.engine_id)) taking.push_back(std::move(m));
  }
  a.members = std::move(taking);
  for (const std::string& e : off_base)
    a.sat_out.push_back(absl::StrCat(e, " (not on version ", base, ", the delta's base)"));
  a.plan.delta_base = base;
}

SyncCoordinator::Attempt SyncCoordinator::PlanSync(uint64_t id) {
  Attempt a;
  a.id = id;
  {
    absl::MutexLock lock(&mu_);
    TakeMembers(a);
  }
  SyncPlan& plan = a.plan;
  plan.backend = opts_.backend;
  plan.num_agents = static_cast<int>(a.members.size());
  plan.timeout = opts_.sync_timeout;
  plan.deadline = a.start + opts_.sync_timeout;
  if (opts_.bucket_mac && a.status.ok()) {
    auto key = comm::NewSyncMacKey();
    if (key.ok()) {
      plan.bucket_mac_key = std::move(*key);
    } else {
      a.status = Annotate(key.status(), "making the sync's bucket key");
    }
  }
  for (int p = 0; p < trainer_->num_stages(); ++p) plan.group_names.push_back(SyncGroupName(id, p));
  // Sharded delivery: agents grouped by the blocks their engine ranks keep; each agent joins its
  // group's stream of every stage, as rank 1 + its place in the group.
  if (plan.delivery == plan::Delivery::kSharded || plan.keep_delta_base) {
    std::vector<engine_model::EngineParallel> ranks;
    for (const Member& m : a.members) {
      ranks.push_back(
          {static_cast<int>(m.tp_size), static_cast<int>(m.tp_rank), static_cast<int>(m.ep_size), m.mtp_draft});
    }
    a.grouping = plan::GroupReceivers(ranks);
    plan.receiver_groups = a.grouping.groups;
    for (const auto& g : a.grouping.members) plan.group_agents.push_back(static_cast<int>(g.size()));
  }
  a.prepared.resize(a.members.size());
  a.committed.resize(a.members.size());
  a.reported.assign(a.members.size(), 0);
  WSYNC_LOG(INFO) << "sync " << id << " -> version " << plan.version << " with " << a.members.size() << " agents, "
                  << plan::DeliveryName(plan.delivery) << " delivery"
                  << (plan.delta_base != 0 ? absl::StrCat(", deltas from version ", plan.delta_base) : "")
                  << (plan.delivery == plan::Delivery::kSharded
                          ? absl::StrCat(" to ", a.grouping.groups.size(), " receiver groups")
                          : "");
  return a;
}

absl::Status SyncCoordinator::Timed(Attempt& a, const std::string& phase, absl::FunctionRef<absl::Status()> fn) {
  SetPhase(a.id, phase);
  const absl::Time t0 = absl::Now();
  absl::Status s = fn();
  a.phases.push_back({phase, absl::ToDoubleSeconds(absl::Now() - t0), 0});
  HistogramOf(opts_.metrics, "wsync_sync_phase_seconds", "Duration of each sync phase", {{"phase", phase}})
      ->Observe(a.phases.back().seconds);
  return s;
}

// A sync given up on keeps running on the trainer ranks until its collectives end (their own
// timeouts). Wait for them before any agent hears of this sync, for at most one sync timeout, and
// give this sync its whole timeout from when they are free: it would otherwise wait in the trainer's
// queue while its own clock ran.
absl::Status SyncCoordinator::AwaitTrainerRanks(Attempt& a) {
  const uint64_t draining = trainer_->draining_sync();
  if (draining == 0) return absl::OkStatus();
  WSYNC_LOG(WARNING) << "sync " << a.id << " waits for the trainer ranks to finish sync " << draining
                     << ", which was given up on after its timeout";
  absl::Status s = Timed(a, "wait_trainer", [&] {
    return Annotate(trainer_->AwaitIdle(absl::Now() + opts_.sync_timeout),
                    absl::StrCat("sync ", a.id, " was not started (no agent or engine was touched)"));
  });
  a.plan.deadline = absl::Now() + opts_.sync_timeout;
  return s;
}

v1::BeginSyncRequest SyncCoordinator::BeginRequest(const Attempt& a, size_t i) const {
  const SyncPlan& plan = a.plan;
  v1::BeginSyncRequest r;
  r.set_sync_id(a.id);
  r.set_version(plan.version);
  r.set_backend(plan.backend);
  r.set_store_address(store_address_);
  const bool sharded = plan.delivery == plan::Delivery::kSharded;
  const int group = sharded ? a.grouping.group_of[i] : -1;
  r.set_agent_rank(static_cast<uint32_t>(sharded ? a.grouping.rank_in_group[i] + 1 : i + 1));
  for (int p = 0; p < trainer_->num_stages(); ++p) {
    for (int k = 0; k < (sharded ? trainer_->num_senders(p) : 1); ++k) {
      auto* g = r.add_groups();
      g->set_pp_stage(p);
      g->set_name(sharded ? ShardGroupName(a.id, p, k, group) : plan.group_names[p]);
      g->set_size(static_cast<uint32_t>(sharded ? plan.group_agents[group] + 1 : a.members.size() + 1));
    }
  }
  r.set_timeout_ms(absl::ToInt64Milliseconds(opts_.sync_timeout));
  // A recording holds whole tensors: sharded syncs (blocks) and delta syncs are not recorded.
  r.set_record(!sharded && plan.delta_base == 0);
  r.set_delta_base(plan.delta_base);
  r.set_sync_key(absl::StrCat(run_id_, "-", a.id));
  r.set_bucket_mac_key(plan.bucket_mac_key);
  return r;
}

absl::Status SyncCoordinator::BeginPhase(Attempt& a) {
  return CallAll(a.id, a.members, "BeginSync", [&](AgentClient& agent, size_t i) {
    v1::BeginSyncReply reply;
    absl::Status st = agent.BeginSync(BeginRequest(a, i), Bounded(a.plan, opts_.rpc_timeout, kCallFloor), &reply);
    if (st.ok()) FailpointHit("coordinator.begin");  // system tests: some agents have begun
    return st;
  });
}

absl::Status SyncCoordinator::TransferPhase(Attempt& a) {
  FailpointHit("coordinator.transfer");
  auto r = trainer_->RunSync(a.plan);
  absl::MutexLock lock(&mu_);
  trainer_base_ = r.ok() ? r->delta_held : 0;  // after a failure: unknown, the next sync in full
  trainer_base_delivery_ = a.plan.delivery;
  if (!r.ok()) return r.status();
  a.report = *r;
  return absl::OkStatus();
}

absl::Status SyncCoordinator::PreparePhase(Attempt& a) {
  FailpointHit("coordinator.prepare");
  return CallAll(a.id, a.members, "PrepareSync", [&](AgentClient& agent, size_t i) {
    v1::PrepareSyncRequest r;
    r.set_sync_id(a.id);
    return agent.PrepareSync(r, Bounded(a.plan, opts_.sync_timeout, kCallFloor), &a.prepared[i]);
  });
}

absl::Status SyncCoordinator::CommitPhase(Attempt& a) {
  {
    // Durable before the first CommitSync: a successor of a coordinator that stops from here on
    // rolls the fleet forward to this version (every agent has it prepared).
    absl::MutexLock lock(&mu_);
    committing_sync_ = a.id;
    committing_version_ = a.plan.version;
    SaveState().IgnoreError();  // logged; without it a crash here leaves the fleet to the next sync
  }
  FailpointHit("coordinator.commit");
  return Timed(a, "commit", [&] {
    return CallAll(a.id, a.members, "CommitSync", [&](AgentClient& agent, size_t i) {
      v1::CommitSyncRequest r;
      r.set_sync_id(a.id);
      absl::Status st = agent.CommitSync(r, Bounded(a.plan, opts_.rpc_timeout, kCommitFloor), &a.committed[i]);
      if (st.ok()) FailpointHit("coordinator.committed");
      return st;
    });
  });
}

void SyncCoordinator::AbortPhase(Attempt& a) {
  const uint64_t version = a.plan.version;
  WSYNC_LOG(ERROR) << "sync " << a.id << " failed: " << a.status;
  SetPhase(a.id, "abort");
  // Trainer ranks that reach the sync late (one was hung, say) stop forming its groups at once
  // rather than after their join timeout, and the next sync need not wait for them.
  (void)store_->Add(SyncAbandonedKey(a.id), 1);
  // Engines that committed already: the others roll forward to the version from their staging
  // (every agent prepared it, or no commit would have started), so the fleet converges on it.
  a.some_committed = std::any_of(a.committed.begin(), a.committed.end(),
                                 [&](const v1::CommitSyncReply& c) { return c.version() == version; });
  std::vector<v1::AbortSyncReply> aborted(a.members.size());
  absl::Status s = CallAll(a.id, a.members, "AbortSync", [&](AgentClient& agent, size_t i) {
    v1::AbortSyncRequest r;
    r.set_sync_id(a.id);
    r.set_reason(std::string(a.status.message()));
    r.set_roll_forward(a.some_committed && a.committed[i].version() != version);
    // Best effort and short (2 s): an agent that cannot be reached, or is hung, aborts on its own
    // when the sync's timeout (sent in BeginSync) passes, so the sync ends now rather than an
    // RPC timeout later; a healthy agent answers in milliseconds.
    return agent.AbortSync(r, std::min(opts_.rpc_timeout, absl::Seconds(2)), &aborted[i]);
  });
  if (!s.ok()) WSYNC_LOG(ERROR) << "sync " << a.id << ": abort incomplete: " << s;
  // A commit that failed on some engines after others committed: say so first, by engine (each
  // engine's replies name the version it serves).
  std::vector<std::string> live, behind;
  for (size_t i = 0; i < a.members.size(); ++i) {
    const uint64_t v = a.committed[i].version() != 0 ? a.committed[i].version() : aborted[i].version();
    a.reported[i] = v;
    const std::string who = absl::StrCat("engine ", a.members[i].engine_id, " tp ", a.members[i].tp_rank);
    if (v == version) {
      live.push_back(who);
    } else {
      behind.push_back(v != 0 ? absl::StrCat(who, " (on version ", v, ")") : absl::StrCat(who, " (unreachable)"));
    }
  }
  // An engine rank whose agent holds the version (its commit wrote the engine's memory, and then
  // Continue or the reply failed) counts as committed: it serves the version once its engine runs.
  a.some_committed = a.some_committed || !live.empty();
  if (!live.empty() && behind.empty())
    a.status =
        Annotate(a.status, absl::StrCat("version ", version, " was committed on every engine (",
                                        absl::StrJoin(live, ", "), ") but the commit did not complete everywhere"));
  else if (!live.empty())
    a.status = Annotate(a.status, absl::StrCat("version ", version, " was committed on ", absl::StrJoin(live, ", "),
                                               " but not on ", absl::StrJoin(behind, ", "),
                                               ": published to part of the fleet; the others roll forward to it from "
                                               "their staging as soon as their engines take it (until then the "
                                               "engines serve different versions, every reply naming its own)"));
}

// The trainer's phases, the agents' (slowest member), the coordinator's, and the total.
std::vector<PhaseTime> SyncCoordinator::SyncTimings(const Attempt& a, double total) {
  double load = 0, transfer = 0, repack = 0, cont = 0, downtime = 0;
  uint64_t bytes = 0;
  for (const auto& p : a.prepared) {
    load = std::max(load, p.load_seconds());
    transfer = std::max(transfer, p.transfer_seconds());
    bytes = std::max<uint64_t>(bytes, p.bytes());
  }
  for (const auto& c : a.committed) {
    repack = std::max(repack, c.repack_seconds());
    cont = std::max(cont, c.continue_seconds());
    downtime = std::max(downtime, c.downtime_seconds());
  }
  std::vector<PhaseTime> all = a.report.phases;
  all.push_back({"transfer(agents)", transfer, bytes});
  all.push_back({"load", load, bytes});
  all.push_back({"repack", repack, 0});
  all.push_back({"continue", cont, 0});
  all.push_back({"downtime", downtime, 0});  // the longest engine pause (Pause sent -> Continue answered)
  for (auto& p : a.phases) all.push_back(p);
  all.push_back({"total", total, a.report.bytes});
  return all;
}

// An agent whose CommitSync answered this version serves it from now on: record it at once rather
// than at its next heartbeat, so that a member joining meanwhile (a restarted engine) is told which
// peers can give it the version.
// Its staging's version too, as its commit said (CommitSyncReply.staged_version: the base of the next
// delta sync; 0 for a staging no delta can apply to); a member that took the sync and did not
// commit may hold anything there until its next heartbeat says.
void SyncCoordinator::NoteCommittedMembers(const Attempt& a) {
  for (size_t i = 0; i < a.members.size() && i < a.committed.size(); ++i) {
    auto it = members_.find(a.members[i].id);
    if (it == members_.end() || it->second.address != a.members[i].address) continue;
    const bool committed = a.committed[i].version() == a.plan.version || a.reported[i] == a.plan.version;
    it->second.staged_version = committed ? a.committed[i].staged_version() : 0;
    if (committed) it->second.version = std::max(it->second.version, a.plan.version);
  }
}

// The engines behind the sync's version now, each as "ENGINE (why)" (docs/sync.md "Versions").
std::vector<std::string> SyncCoordinator::BehindAfter(const Attempt& a) {
  std::map<std::string, std::string> behind_by = EnginesBehind(FleetVersions(), a.plan.version);
  if (!a.status.ok()) {  // a member whose commit did not complete is behind, whatever its agent holds
    for (size_t i = 0; i < a.members.size(); ++i) {
      if (a.committed[i].version() == a.plan.version) continue;
      std::string& why = behind_by[a.members[i].engine_id];
      if (why.empty()) why = absl::StrCat("tp ", a.members[i].tp_rank, ": its commit did not complete");
    }
  }
  std::vector<std::string> behind;
  for (const auto& [engine, why] : behind_by) behind.push_back(absl::StrCat(engine, " (", why, ")"));
  return behind;
}

// The outcome, from what the engines hold now (docs/sync.md "Versions"): done when every engine of
// the fleet has the version, partial when some engine rank committed it, failed when none did.
void SyncCoordinator::FinishSync(Attempt& a) {
  const double total = absl::ToDoubleSeconds(absl::Now() - a.start);
  std::vector<PhaseTime> all = SyncTimings(a, total);
  absl::MutexLock lock(&mu_);
  NoteCommittedMembers(a);
  auto& rec = syncs_[a.id];
  rec.phases = std::move(all);
  rec.finished = true;
  rec.bytes = a.report.bytes;
  rec.delta_figures.set_delta_base(a.plan.delta_base);
  rec.delta_figures.set_tensor_bytes(a.report.tensor_bytes);
  rec.delta_figures.set_sent_bytes(a.report.sent_bytes);
  rec.delta_figures.set_delta_items(a.report.delta_items);
  rec.delta_figures.set_changed_items(a.report.changed_items);
  rec.delta_figures.set_quant_groups(a.report.quant_groups);
  rec.delta_figures.set_reused_groups(a.report.reused_groups);
  rec.delta_figures.set_undigested_groups(a.report.undigested_groups);
  if (a.report.tensor_bytes > 0) {  // the trainer kept a delta base: what this sync sent of a full one
    GaugeOf(opts_.metrics, "wsync_sync_sent_fraction",
            "The last sync's bytes sent over a full sync's (delta delivery; 1 when it went in full)")
        ->Set(static_cast<double>(a.report.sent_bytes) / static_cast<double>(a.report.tensor_bytes));
    GaugeOf(opts_.metrics, "wsync_sync_changed_fraction",
            "The last delta sync's changed elements over the elements of its delta entries")
        ->Set(a.report.delta_items ? static_cast<double>(a.report.changed_items) / a.report.delta_items : 0.0);
  }
  const std::vector<std::string> behind = BehindAfter(a);
  std::string outcome = "failed";
  if (a.status.ok()) outcome = behind.empty() ? "done" : "partial";
  if (!a.status.ok() && a.some_committed) outcome = "partial";
  if (outcome == "partial" && a.status.ok())
    a.status = absl::UnavailableError(
        absl::StrCat("version ", rec.version, " was committed on every engine that took the sync; ",
                     a.sat_out.empty() ? absl::StrJoin(behind, ", ") : absl::StrJoin(a.sat_out, ", "),
                     a.sat_out.empty() ? " did not take it (it joined during the sync)" : " sat it out",
                     ": it catches up when its agents are back (a copy from a peer, or the next sync)"));
  rec.phase = outcome;
  rec.error = a.status.ok() ? "" : std::string(a.status.message());
  for (auto& m : rec.members) m.set_phase(rec.phase);
  running_ = false;  // with the outcome: whoever sees the sync finished sees the coordinator idle
  RecordOutcome(rec, outcome, behind, total);
  RefreshVersions();
  ++event_seq_;
  PruneHistory();
  // The store keys of the sync before this one (its groups are long gone; this one's stay until
  // the next sync ends, for members still leaving it).
  if (previous_sync_keys_ != 0) store_->DeletePrefix(SyncKeyPrefix(previous_sync_keys_));
  previous_sync_keys_ = a.id;
  SaveState().IgnoreError();  // logged; the next trigger saves again (and is refused if it cannot)
}

void SyncCoordinator::RecordOutcome(const SyncRecord& rec, const std::string& outcome,
                                    const std::vector<std::string>& behind, double total) {
  v1::VersionRecord vr;
  vr.set_version(rec.version);
  vr.set_sync_id(rec.id);
  vr.set_ok(outcome != "failed");
  vr.set_outcome(outcome);
  vr.set_error(rec.error);
  for (const std::string& b : behind)
    if (outcome == "partial") vr.add_behind(b);
  vr.set_seconds(total);
  vr.set_bytes(rec.bytes);
  vr.set_finished_unix_ms(absl::ToUnixMillis(absl::Now()));
  versions_.push_back(vr);
  committing_sync_ = committing_version_ = 0;
  if (outcome != "failed") {
    published_ = rec.version;
    last_bytes_ = rec.bytes;
    CounterOf(opts_.metrics, "wsync_sync_bytes_total", "Bytes streamed by syncs that published a version")
        ->Increment(static_cast<double>(rec.bytes));
  }
  if (outcome == "done") {
    CounterOf(opts_.metrics, "wsync_syncs_total", "Syncs that every engine of the fleet committed")->Increment();
    WSYNC_LOG(INFO) << "sync " << rec.id << ": version " << rec.version << " published in " << total << " s ("
                    << rec.bytes << " bytes)";
  } else if (outcome == "partial") {
    last_error_ = rec.error;
    CounterOf(opts_.metrics, "wsync_syncs_partial_total",
              "Syncs committed on part of the fleet (the others left behind, catching up)")
        ->Increment();
    WSYNC_LOG(WARNING) << "sync " << rec.id << ": version " << rec.version << " published to part of the fleet in "
                       << total << " s; behind: " << absl::StrJoin(behind, ", ");
  } else {
    last_error_ = rec.error;
    CounterOf(opts_.metrics, "wsync_sync_failures_total", "Syncs that no engine committed (aborted everywhere)")
        ->Increment();
  }
}

}  // namespace wsync::trainer_agent
