// RolloutAgent, membership and watchdog: the watchdog thread (a coordinator's catch-up hint
// asked for now, roll-forward and peer catch-up started, a sync its coordinator left alone
// aborted) and UpdateWeights, which waits for a version and asks the watchdog for a hint.

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "rollout_agent/agent/membership.h"
#include "rollout_agent/agent/rollout_agent.h"
#include "rollout_agent/agent/rollout_agent_state.h"

namespace wsync::rollout_agent {

void RolloutAgent::Watchdog() {
  for (;;) {
    uint64_t id = 0;
    std::string reason;
    bool catch_up = false, fetch = false, refresh = false;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || hint_wanted_; };
      mu_.AwaitWithTimeout(absl::Condition(&wake), absl::Milliseconds(100));
      if (stopping_) return;
      refresh = hint_wanted_;
    }
    if (refresh) {  // UpdateWeights: ask the coordinator now
      absl::StatusOr<v1::CatchUpHint> fresh = membership_ ? membership_->RefreshHint(absl::Seconds(5))
                                                          : absl::FailedPreconditionError("no coordinator configured");
      absl::MutexLock lock(&mu_);
      hint_wanted_ = false;
      ++hint_seq_;
      last_hint_status_ = fresh.status();
      last_hint_ = fresh.ok() ? *fresh : v1::CatchUpHint();
      if (fresh.ok() && fresh->peers_size() > 0) next_fetch_ = absl::Now();  // no backoff for an explicit ask
    }
    const v1::CatchUpHint hint = membership_ ? membership_->catch_up() : v1::CatchUpHint();
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      catch_up = owed_version_ > version_ && sync_ == nullptr && absl::Now() >= next_catch_up_;
      fetch = !catch_up && engine_ != nullptr && sync_ == nullptr && hint.peers_size() > 0 &&
              hint.version() > version_ && hint.version() > owed_version_ && hint.version() != staged_version_ &&
              absl::Now() >= next_fetch_;
    }
    if (catch_up) {
      CatchUp();
      continue;
    }
    if (fetch) {
      FetchFromPeers(hint);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      Sync* s = sync_.get();
      if (s != nullptr && s->rpcs == 0 && (s->phase == Phase::kReceiving || s->phase == Phase::kPrepared) &&
          absl::Now() - s->idle_since > s->timeout + std::min(s->timeout, absl::Seconds(10))) {
        id = s->id;
        const char* expected = s->phase == Phase::kPrepared ? "CommitSync or AbortSync"
                               : s->first_error.ok()        ? "PrepareSync or AbortSync"
                                                            : "AbortSync (the sync had failed)";
        reason = absl::StrCat("no ", expected, " from the coordinator within ", absl::FormatDuration(s->timeout),
                              " (the coordinator is lost?)");
      }
    }
    if (id != 0) {
      WSYNC_LOG(ERROR) << "sync " << id << ": " << reason << "; aborting on my own";
      uint64_t v = 0;
      absl::Status s = AbortById(id, reason, &v);
      if (!s.ok()) WSYNC_LOG(ERROR) << "sync " << id << ": aborting: " << s;
    }
  }
}

absl::Status RolloutAgent::UpdateWeights(const v1::UpdateWeightsRequest& req, absl::Time deadline,
                                         const std::function<bool()>& cancelled, v1::UpdateWeightsReply* reply) {
  absl::MutexLock lock(&mu_);
  uint64_t target = req.min_version();
  std::string how = "waiting for the next sync";
  if (target == 0 || version_ < target) {
    // Ask the coordinator now what it has published and which peers hold it (the watchdog does,
    // and starts copying from a peer at once); wait for the answer at most 6 s.
    const uint64_t seq = hint_seq_;
    hint_wanted_ = true;
    auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return hint_seq_ != seq || stopping_; };
    mu_.AwaitWithDeadline(absl::Condition(&answered), std::min(deadline, absl::Now() + absl::Seconds(6)));
    if (hint_seq_ == seq) {
      how = "the coordinator was not asked in time; waiting for the next sync";
    } else if (!last_hint_status_.ok()) {
      how = absl::StrCat("the coordinator could not be asked (", last_hint_status_.ToString(),
                         "); waiting for the next sync");
    } else {
      const uint64_t published = last_hint_.version();  // 0: this engine is not behind
      if (target == 0) target = std::max(version_, published);
      if (published >= target && published > version_) {
        how =
            last_hint_.peers_size() > 0
                ? absl::StrCat("copying version ", published, " from a peer (", absl::StrJoin(last_hint_.peers(), ", "),
                               ")")
                : absl::StrCat("version ", published, " is published but no peer holds it; waiting for the next sync");
        if (last_hint_.peers_size() > 0) WSYNC_LOG(INFO) << "UpdateWeights(" << req.min_version() << "): " << how;
      }
    }
    if (target == 0) target = version_;
  }
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return version_ >= target || stopping_; };
  while (!ready()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("UpdateWeights: version ", target,
                       " was not committed before the deadline (the engine holds version ", version_, "; ", how, ")"));
    }
    if (cancelled && cancelled()) return absl::CancelledError("UpdateWeights: the caller went away");
    mu_.AwaitWithDeadline(absl::Condition(&ready), std::min(deadline, now + absl::Milliseconds(200)));
  }
  if (version_ < target) {
    return absl::UnavailableError(absl::StrCat("UpdateWeights: the rollout agent is shutting down (version ", version_,
                                               ", waiting for ", target, ")"));
  }
  reply->set_version(version_);
  return absl::OkStatus();
}

}  // namespace wsync::rollout_agent
