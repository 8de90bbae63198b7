// RolloutAgent, a sync ending: PrepareSync (wait for the stages, check the staging), CommitSync
// (pause, flush, write the staging into the engine, continue), AbortSync and EndFailedSync.

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/failpoint.h"
#include "common/heap.h"
#include "common/logging.h"
#include "common/status.h"
#include "rollout_agent/agent/membership.h"
#include "rollout_agent/agent/rollout_agent.h"
#include "rollout_agent/agent/rollout_agent_state.h"

namespace wsync::rollout_agent {

// --- PrepareSync --------------------------------------------------------------------------------------

namespace {

absl::Status NoSuchSync(absl::string_view rpc, uint64_t id, uint64_t last_id, bool last_committed,
                        const absl::Status& last_outcome) {
  if (id != 0 && id == last_id) {
    if (last_committed)
      return absl::FailedPreconditionError(absl::StrCat(rpc, " ", id, ": the sync was already committed"));
    return absl::AbortedError(absl::StrCat(rpc, " ", id, ": the sync was aborted: ", last_outcome.message()));
  }
  return absl::FailedPreconditionError(absl::StrCat(rpc, " ", id, ": no such sync is active"));
}

}  // namespace

absl::Status RolloutAgent::PrepareSync(const v1::PrepareSyncRequest& req, absl::Time deadline,
                                       v1::PrepareSyncReply* reply) {
  FailpointHit("rollout.prepare");  // system tests (common/failpoint.h)
  {
    absl::MutexLock lock(&mu_);
    if (sync_ == nullptr || sync_->id != req.sync_id())
      return NoSuchSync("PrepareSync", req.sync_id(), last_sync_id_, last_committed_, last_outcome_);
  }
  absl::MutexLock op(&op_mu_);
  Sync* s = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (sync_ == nullptr || sync_->id != req.sync_id())
      return NoSuchSync("PrepareSync", req.sync_id(), last_sync_id_, last_committed_, last_outcome_);
    s = sync_.get();
    if (s->phase == Phase::kPrepared) {
      *reply = s->prepared;
      return absl::OkStatus();
    }
    s->rpcs++;
  }
  const std::string who = absl::StrCat("PrepareSync ", s->id, " (version ", s->req.version(), ")");
  auto done_rpc = [&] {
    absl::MutexLock lock(&mu_);
    s->rpcs--;
    s->idle_since = absl::Now();
  };
  // Bounded by the RPC's deadline and, without one, by the sync's own timeout (its threads are).
  const absl::Time limit = std::min(deadline, absl::Now() + s->timeout + absl::Seconds(30));
  {
    absl::MutexLock lock(&mu_);
    auto finished = [s]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return s->running == 0; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&finished), limit)) {
      s->rpcs--;
      s->idle_since = absl::Now();
      return absl::DeadlineExceededError(absl::StrCat(who, ": still receiving at the deadline (",
                                                      s->req.groups_size() - s->running, " of ", s->req.groups_size(),
                                                      " stages done); call PrepareSync again or AbortSync"));
    }
  }
  for (auto& t : s->threads) t.join();
  s->threads.clear();
  if (comm::MovesDeviceMemory(s->backend)) TrimDevicePools();
  absl::Status st;
  {
    absl::MutexLock lock(&mu_);
    st = s->first_error;
  }
  if (st.ok()) {
    st = engine_->staging->CheckComplete(/*loaded_only=*/s->req.delta_base() != 0);
    if (!st.ok()) {
      st = Annotate(st, absl::StrCat("the stream ended without every tensor this engine rank needs"));
      absl::MutexLock lock(&mu_);
      s->first_error = st;
    }
  }
  if (!st.ok()) {
    done_rpc();
    WSYNC_LOG(ERROR) << who << ": " << st;
    return Annotate(st, who);
  }
  {
    absl::MutexLock lock(&mu_);
    s->phase = Phase::kPrepared;
    staged_sync_id_ = s->id;
    staged_version_ = s->req.version();
    s->prepared.set_buckets(s->totals.buckets);
    s->prepared.set_bytes(s->totals.bytes);
    s->prepared.set_tensors(s->totals.tensors);
    s->prepared.set_transfer_seconds(Seconds(s->totals.transfer));
    s->prepared.set_load_seconds(Seconds(s->totals.load));
    *reply = s->prepared;
  }
  m_->Observe("join", s->totals.join);
  m_->Observe("transfer", s->totals.transfer);
  m_->Observe("load", s->totals.load);
  done_rpc();
  WSYNC_LOG(INFO) << who << ": prepared: " << reply->buckets() << " buckets, " << reply->tensors() << " tensors, "
                  << reply->bytes() << " bytes in " << reply->transfer_seconds() << " s (loading "
                  << reply->load_seconds() << " s); host<->device: " << s->totals.to_host_bytes << " bytes down, "
                  << s->totals.to_device_bytes << " bytes up";
  return absl::OkStatus();
}

// --- CommitSync ---------------------------------------------------------------------------------------

absl::Status RolloutAgent::FailCommit(Sync* s, const absl::Status& st, const std::string& who) {
  if (absl::IsInternal(st)) {
    // Validation passed, so the engine's memory may be partly written: it must not serve.
    if (s->recorder) s->recorder->Discard();
    {
      absl::MutexLock lock(&mu_);
      RetireSync(s, st);
    }
    m_->failures->Increment();
    m_->active->Set(0);
    WSYNC_LOG(ERROR) << who << ": repack failed after validation; the engine stays paused: " << st;
    return absl::InternalError(absl::StrCat(who, ": the repack failed after validation (", st.message(),
                                            "); the engine's memory may be partly written, so it stays paused "
                                            "until a later sync succeeds"));
  }
  absl::Status cont = EndFailedSync(s, std::string(st.message()), true);
  absl::Status out = Annotate(st, absl::StrCat(who, ": refused before writing (the engine's memory is untouched)"));
  if (!cont.ok()) out = Annotate(out, absl::StrCat("[and continuing the engine failed too: ", cont.message(), "]"));
  return out;
}

void RolloutAgent::RetireSync(Sync* s, const absl::Status& outcome) {
  last_sync_id_ = s->id;
  last_sync_run_ = SyncRun(s->req);
  last_committed_ = outcome.ok();
  last_outcome_ = outcome;
  sync_.reset();  // frees *s
}

absl::Status RolloutAgent::CommitSync(const v1::CommitSyncRequest& req, v1::CommitSyncReply* reply,
                                      absl::Time deadline) {
  auto idempotent = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> std::optional<absl::Status> {
    if (sync_ != nullptr && sync_->id == req.sync_id()) return std::nullopt;
    if (req.sync_id() != 0 && req.sync_id() == last_sync_id_ && last_committed_) {
      reply->set_version(version_);
      return absl::OkStatus();
    }
    return NoSuchSync("CommitSync", req.sync_id(), last_sync_id_, last_committed_, last_outcome_);
  };
  {
    absl::MutexLock lock(&mu_);
    if (auto r = idempotent()) return *r;
  }
  absl::MutexLock op(&op_mu_);
  Sync* s = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (auto r = idempotent()) return *r;
    s = sync_.get();
    if (s->phase != Phase::kPrepared) {
      return absl::FailedPreconditionError(
          absl::StrCat("CommitSync ", s->id, ": the sync is ", PhaseName(static_cast<int>(s->phase)), ", not prepared",
                       s->first_error.ok() ? "" : absl::StrCat(" (it failed: ", s->first_error.message(), ")")));
    }
    s->phase = Phase::kCommitting;
    s->rpcs++;
  }
  const uint64_t version = s->req.version();
  const std::string who = absl::StrCat("CommitSync ", s->id, " (version ", version, ")");
  Engine& e = *engine_;
  // The engine served while the sync was received and staged; it pauses only now, to be written.
  bool paused_now;
  {
    absl::MutexLock lock(&mu_);
    paused_now = !s->engine_paused;
  }
  if (paused_now) {
    auto paused = PauseEngine(s, deadline);
    if (!paused.ok()) {
      absl::Status cont = EndFailedSync(s, std::string(paused.status().message()), /*continue_engine=*/true);
      absl::Status out = Annotate(paused.status(), absl::StrCat(who,
                                                                ": pausing the engine to commit; nothing was "
                                                                "written, it continues on the previous version"));
      if (!cont.ok()) out = Annotate(out, absl::StrCat("[and continuing the engine failed too: ", cont.message(), "]"));
      return out;
    }
    WSYNC_LOG(INFO) << who << ": " << *paused;
  }
  FailpointHit("rollout.commit");  // system tests (common/failpoint.h): the engine is paused
  const absl::Time t0 = absl::Now();
  // CUDA engines: the commit repacks on the device straight into the engine's memory (kInternal on
  // a device failure: the memory may be partly written, handled as a failed repack below).
  absl::Status st = CommitStaging(e, version);
  const absl::Duration repack = absl::Now() - t0;
  if (!st.ok()) return FailCommit(s, st, who);
  m_->version->Set(static_cast<double>(version));
  if (membership_) membership_->SetVersion(version);
  const absl::Time t1 = absl::Now();
  auto cont = e.client->Continue(version);
  const absl::Time t2 = absl::Now();
  const absl::Duration continued = t2 - t1;
  absl::Time paused_at;
  {
    absl::MutexLock lock(&mu_);
    paused_at = s->paused_at;
  }
  const absl::Duration downtime = t2 - paused_at;
  if (s->recorder) {
    absl::Status rs = s->recorder->Finish();
    if (!rs.ok()) WSYNC_LOG(ERROR) << who << ": publishing the recording: " << rs;
  }
  {
    absl::MutexLock lock(&mu_);
    RetireSync(s, absl::OkStatus());
  }
  m_->Observe("repack", repack);
  m_->Observe("continue", continued);
  m_->Observe("downtime", downtime);
  m_->syncs->Increment();
  m_->active->Set(0);
  RequestHeapTrim();  // off the request path: what the syncs freed goes back to the kernel (common/heap.h)
  if (!cont.ok()) {
    WSYNC_LOG(ERROR) << who << ": committed, but the engine did not continue: " << cont.status();
    return Annotate(cont.status(),
                    absl::StrCat(who, ": the engine's memory holds the new version, but Continue failed"));
  }
  WSYNC_LOG(INFO) << who << ": committed (repack " << absl::FormatDuration(repack) << ", continue "
                  << absl::FormatDuration(continued) << "; the engine was paused for " << absl::FormatDuration(downtime)
                  << ")";
  reply->set_version(version);
  reply->set_staged_version(DeltaBaseVersion());
  reply->set_repack_seconds(Seconds(repack));
  reply->set_continue_seconds(Seconds(continued));
  reply->set_downtime_seconds(Seconds(downtime));
  return absl::OkStatus();
}

// --- AbortSync ----------------------------------------------------------------------------------------

absl::Status RolloutAgent::AbortSync(const v1::AbortSyncRequest& req, v1::AbortSyncReply* reply) {
  if (req.roll_forward()) {
    absl::MutexLock lock(&mu_);
    // The version is owed once its staging is complete: now (prepared, or a failed commit left it
    // there), or when the sync in progress gets there (it cannot: a commit had started elsewhere,
    // so this agent had prepared).
    const bool staged =
        staged_sync_id_ == req.sync_id() || (sync_ != nullptr && sync_->id == req.sync_id() &&
                                             (sync_->phase == Phase::kPrepared || sync_->phase == Phase::kCommitting));
    if (staged) {
      const uint64_t v = staged_sync_id_ == req.sync_id() ? staged_version_ : sync_->req.version();
      if (v > version_) {
        owed_version_ = v;
        next_catch_up_ = absl::Now();
        catch_up_failures_ = 0;
        WSYNC_LOG(WARNING) << "sync " << req.sync_id() << ": other engines committed version " << v
                           << "; this agent rolls its engine forward to it from the staging as soon as it can";
      }
    }
  }
  uint64_t version = 0;
  absl::Status s =
      AbortById(req.sync_id(), req.reason().empty() ? "AbortSync from the coordinator" : req.reason(), &version);
  reply->set_version(version);
  return s;
}

absl::Status RolloutAgent::AbortById(uint64_t id, const std::string& reason, uint64_t* version) {
  {
    // Fast path first: cancel group formation and abort the communicators now, so the receive
    // threads (and the trainer's senders) stop while we wait for op_mu_.
    absl::MutexLock lock(&mu_);
    if (sync_ != nullptr && (id == 0 || sync_->id == id) && sync_->phase != Phase::kCommitting) {
      sync_->cancel.Cancel(reason);
    }
  }
  absl::MutexLock op(&op_mu_);
  Sync* s = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (sync_ == nullptr || (id != 0 && sync_->id != id)) {
      *version = version_;
      return absl::OkStatus();
    }
    s = sync_.get();
  }
  bool paused;
  {
    absl::MutexLock lock(&mu_);
    paused = s->engine_paused;
  }
  absl::Status st = EndFailedSync(s, reason, paused);
  absl::MutexLock lock(&mu_);
  *version = version_;
  return st;
}

absl::Status RolloutAgent::EndFailedSync(Sync* s, const std::string& reason, bool continue_engine) {
  const uint64_t id = s->id;
  s->cancel.Cancel(reason);
  for (auto& t : s->threads) t.join();
  s->threads.clear();
  if (comm::MovesDeviceMemory(s->backend)) TrimDevicePools();
  if (s->recorder) s->recorder->Discard();
  absl::Status cont;
  if (continue_engine && engine_ != nullptr) {
    const absl::Time t0 = absl::Now();
    auto c = engine_->client->Continue(s->previous_version);
    m_->Observe("continue", absl::Now() - t0);
    cont = c.status();
    if (!cont.ok())
      WSYNC_LOG(ERROR) << "sync " << id << ": continuing the engine on version " << s->previous_version << ": " << cont;
  }
  WSYNC_LOG(WARNING) << "sync " << id << " (version " << s->req.version() << ") aborted: " << reason
                     << "; the engine continues on version " << s->previous_version;
  {
    absl::MutexLock lock(&mu_);
    RetireSync(s, absl::AbortedError(reason));
  }
  m_->failures->Increment();
  m_->active->Set(0);
  RequestHeapTrim();
  return cont;
}

}  // namespace wsync::rollout_agent
