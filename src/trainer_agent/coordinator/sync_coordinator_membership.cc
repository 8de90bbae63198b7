// SyncCoordinator's membership: agents joining, heartbeating (their leases: member_timeout),
// leaving and being reaped; engines taken out of the fleet; which engines can take a sync and which
// are behind the fleet's version; the roll forward after a restart during a commit (ReapLoop).
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "trainer_agent/coordinator/sync_coordinator.h"
#include "trainer_agent/coordinator/sync_coordinator_internal.h"

namespace wsync::trainer_agent {

using coordinator_internal::GaugeOf;

absl::Status SyncCoordinator::Join(const v1::JoinRequest& req, v1::JoinReply* reply) {
  if (req.agent_address().empty()) return absl::InvalidArgumentError("agent_address is empty");
  absl::MutexLock lock(&mu_);
  // A restarted agent re-joins from the same address, or from a new one for the same engine rank
  // (one agent serves one engine rank): its old entry goes now, not after a heartbeat timeout, so
  // the next sync does not call a dead address.
  for (auto it = members_.begin(); it != members_.end();) {
    const Member& old = it->second;
    const bool same_rank = !req.engine_id().empty() && old.engine_id == req.engine_id() && old.tp_rank == req.tp_rank();
    if (old.address == req.agent_address() || same_rank) {
      if (old.address != req.agent_address())
        WSYNC_LOG(WARNING) << "member " << old.id << " (" << old.address << ") replaced: " << req.agent_address()
                           << " joined for the same engine " << old.engine_id << " tp " << old.tp_rank;
      it = members_.erase(it);
    } else {
      ++it;
    }
  }
  Member m;
  m.id = absl::StrCat("agent-", next_member_++);
  m.address = req.agent_address();
  m.engine_id = req.engine_id();
  m.tp_rank = req.tp_rank();
  m.tp_size = req.tp_size();
  m.ep_size = std::max<uint32_t>(req.ep_size(), 1);
  m.mtp_draft = req.mtp_draft();
  m.quant_json = req.quantization_config_json();
  m.version = req.version();
  m.staged_version = req.staged_version();
  m.last_seen = absl::Now();
  m.client = connect_(m.address);
  WSYNC_LOG(INFO) << "member " << m.id << " joined: " << m.address << " engine " << m.engine_id << " tp " << m.tp_rank
                  << "/" << m.tp_size << (m.mtp_draft ? " with the NextN draft" : "") << " at version " << m.version;
  reply->set_agent_id(absl::StrCat(m.id, "@", run_id_));
  reply->set_heartbeat_ms(absl::ToInt64Milliseconds(opts_.heartbeat));
  FleetEngine& e = fleet_[m.engine_id];
  if (e.removed) WSYNC_LOG(INFO) << "engine " << m.engine_id << " is back in the fleet (" << m.id << " joined)";
  e.removed = false;
  e.tp_size = std::max<uint32_t>(m.tp_size, 1);
  FillCatchUp(m, reply->mutable_catch_up());
  if (reply->catch_up().version() > 0)
    WSYNC_LOG(INFO) << "member " << m.id << " is behind version " << published_ << ": "
                    << reply->catch_up().peers_size() << " peer(s) can give it";
  members_[m.id] = std::move(m);
  GaugeOf(opts_.metrics, "wsync_members", "Rollout agents in the membership")->Set(members_.size());
  RefreshVersions();
  return absl::OkStatus();
}

// JoinReply.agent_id is "<member id>@<run id>": the run id is this coordinator's, so an agent that
// joined an earlier coordinator (restarted on the same address, numbering members from 0 again)
// is told it is unknown, re-joins, and never borrows a new member's id.
std::string SyncCoordinator::MemberKey(absl::string_view agent_id) const {
  const size_t at = agent_id.rfind('@');
  if (at == absl::string_view::npos || agent_id.substr(at + 1) != run_id_) return "";
  return std::string(agent_id.substr(0, at));
}

absl::Status SyncCoordinator::Heartbeat(const v1::HeartbeatRequest& req, v1::HeartbeatReply* reply) {
  absl::MutexLock lock(&mu_);
  auto it = members_.find(MemberKey(req.agent_id()));
  reply->set_known(it != members_.end());
  if (it != members_.end()) {
    it->second.last_seen = absl::Now();
    it->second.version = req.version();
    it->second.staged_version = req.staged_version();
    FillCatchUp(it->second, reply->mutable_catch_up());
    RefreshVersions();
  }
  return absl::OkStatus();
}

void SyncCoordinator::FillCatchUp(const Member& m, v1::CatchUpHint* hint) const {
  // The version the fleet converges on: the published one, or one that engines committed and the
  // rest roll forward to (a member that restarted has no staging to roll forward from).
  const uint64_t target = std::max(published_, rolling_forward_);
  if (m.version >= target || target == 0) return;
  hint->set_version(target);
  for (const auto& [id, p] : members_) {
    if (p.engine_id != m.engine_id && p.rank_layout() == m.rank_layout() && p.version == target)
      hint->add_peers(p.address);
  }
}

// The partial versions' `behind` follow the members' reports; a version being rolled forward to
// after a coordinator restart is published as soon as an engine serves it.
void SyncCoordinator::RefreshVersions() {
  const RankVersions fleet = FleetVersions();  // once: a heartbeat of a large fleet stays cheap
  bool changed = false;
  if (rolling_forward_ > published_ && !running_) {
    for (const auto& [mid, m] : members_) {
      auto f = fleet_.find(m.engine_id);
      if ((f != fleet_.end() && f->second.removed) || m.version < rolling_forward_) continue;
      published_ = rolling_forward_;
      for (v1::VersionRecord& vr : versions_) {
        if (vr.version() != rolling_forward_ || vr.outcome() != "rolling_forward") continue;
        vr.set_ok(true);
        vr.set_outcome("partial");
        for (const auto& [engine, why] : EnginesBehind(fleet, vr.version()))
          vr.add_behind(absl::StrCat(engine, " (", why, ")"));
      }
      WSYNC_LOG(INFO) << "version " << published_ << " published: engine " << m.engine_id << " tp " << m.tp_rank
                      << " serves it (rolled forward after the coordinator's restart)";
      changed = true;
      break;
    }
  }
  if (rolling_forward_ != 0 && (rolling_forward_ < published_ ||
                                (rolling_forward_ == published_ && EnginesBehind(fleet, rolling_forward_).empty()))) {
    rolling_forward_ = 0;  // every engine has it, or a newer version is published: no more rolling forward
    recover_sync_ = 0;
    told_.clear();
    changed = true;
  }
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (v1::VersionRecord& vr : versions_) {
    if (vr.outcome() != "partial" || vr.behind_size() == 0) continue;
    google::protobuf::RepeatedPtrField<std::string> still;
    for (const std::string& b : vr.behind()) {  // only the engines named: O(behind) per record
      const std::string engine = b.substr(0, b.find(' '));
      auto it = fleet.find(engine);
      const std::string why = it == fleet.end() ? std::string() : BehindWhy(it->second, vr.version());
      if (!why.empty()) *still.Add() = absl::StrCat(engine, " (", why, ")");
    }
    if (still.size() == vr.behind_size() && std::equal(still.begin(), still.end(), vr.behind().begin())) continue;
    vr.mutable_behind()->Swap(&still);
    changed = true;
    if (vr.behind_size() == 0) {
      vr.set_caught_up_unix_ms(now_ms);
      WSYNC_LOG(INFO) << "version " << vr.version() << ": no engine of the fleet is behind it any more";
    }
  }
  GaugeOf(opts_.metrics, "wsync_version", "The fleet's version (the newest committed on an engine)")
      ->Set(static_cast<double>(published_));
  GaugeOf(opts_.metrics, "wsync_engines_behind", "Engines of the fleet not serving the fleet's version")
      ->Set(published_ == 0 ? 0.0 : static_cast<double>(EnginesBehind(fleet, published_).size()));
  for (const auto& [id, ranks] : fleet) {
    GaugeOf(opts_.metrics, "wsync_engine_version", "The version every TP rank of the engine holds (0: they differ)",
            {{"engine", id}})
        ->Set(static_cast<double>(EngineServes(ranks)));
  }
  if (changed) {
    ++event_seq_;
    SaveState().IgnoreError();  // logged; the next trigger saves again (and is refused if it cannot)
  }
}

absl::Status SyncCoordinator::Leave(const v1::LeaveRequest& req) {
  absl::MutexLock lock(&mu_);
  members_.erase(MemberKey(req.agent_id()));
  RefreshVersions();
  return absl::OkStatus();
}

absl::Status SyncCoordinator::RemoveEngine(const std::string& engine_id) {
  absl::MutexLock lock(&mu_);
  auto it = fleet_.find(engine_id);
  if (it == fleet_.end()) {
    std::vector<std::string> known;
    for (const auto& [id, e] : fleet_) known.push_back(id);
    return absl::NotFoundError(absl::StrCat("no engine \"", engine_id, "\" in the fleet (known: ",
                                            known.empty() ? "none" : absl::StrJoin(known, ", "), ")"));
  }
  it->second.removed = true;
  WSYNC_LOG(WARNING) << "engine " << engine_id << " taken out of the fleet: syncs no longer include it";
  RefreshVersions();
  SaveState().IgnoreError();  // logged; a restarted coordinator would otherwise count the engine behind
  return absl::OkStatus();
}

std::vector<uint32_t> SyncCoordinator::MissingRanks(const std::string& engine_id, uint32_t tp_size) const {
  std::vector<bool> present(tp_size, false);
  for (const auto& [id, m] : members_)
    if (m.engine_id == engine_id && m.tp_rank < tp_size) present[m.tp_rank] = true;
  std::vector<uint32_t> missing;
  for (uint32_t r = 0; r < tp_size; ++r)
    if (!present[r]) missing.push_back(r);
  return missing;
}

std::vector<std::string> SyncCoordinator::IncompleteEngines() const {
  std::vector<std::string> out;
  for (const auto& [id, e] : fleet_) {
    if (e.removed) continue;
    const std::vector<uint32_t> missing = MissingRanks(id, e.tp_size);
    if (!missing.empty())
      out.push_back(absl::StrCat(id, " (no agent for TP rank", missing.size() > 1 ? "s " : " ",
                                 absl::StrJoin(missing, ", "), " of ", e.tp_size, ")"));
  }
  return out;
}

absl::Status SyncCoordinator::CanSync() const {
  for (const auto& [mid, m] : members_) {
    auto f = fleet_.find(m.engine_id);
    if (f != fleet_.end() && !f->second.removed && MissingRanks(m.engine_id, f->second.tp_size).empty())
      return absl::OkStatus();
  }
  const std::vector<std::string> incomplete = IncompleteEngines();
  if (incomplete.empty())
    return absl::FailedPreconditionError("every engine with a member agent is out of the fleet: nothing to sync");
  return absl::FailedPreconditionError(
      absl::StrCat("no engine of the fleet has an agent for every TP rank (", absl::StrJoin(incomplete, ", "),
                   "): nothing can take a sync; bring the agents back, or take an engine out with `wsyncctl "
                   "remove-engine ENGINE`"));
}

SyncCoordinator::RankVersions SyncCoordinator::FleetVersions() const {
  RankVersions out;
  for (const auto& [id, e] : fleet_)
    if (!e.removed) out[id].resize(e.tp_size);
  for (const auto& [mid, m] : members_) {
    auto it = out.find(m.engine_id);
    if (it != out.end() && m.tp_rank < it->second.size()) it->second[m.tp_rank] = m.version;
  }
  return out;
}

uint64_t SyncCoordinator::EngineServes(const std::vector<std::optional<uint64_t>>& ranks) {
  uint64_t v = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!ranks[r].has_value() || (r > 0 && *ranks[r] != v)) return 0;
    v = *ranks[r];
  }
  return v;
}

std::string SyncCoordinator::BehindWhy(const std::vector<std::optional<uint64_t>>& ranks, uint64_t version) {
  std::vector<std::string> parts;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].has_value() && *ranks[r] >= version) continue;
    const std::string what = ranks[r].has_value() ? absl::StrCat("on version ", *ranks[r]) : "no agent";
    parts.push_back(ranks.size() > 1 ? absl::StrCat("tp ", r, ": ", what) : what);
  }
  return absl::StrJoin(parts, "; ");
}

std::map<std::string, std::string> SyncCoordinator::EnginesBehind(const RankVersions& fleet, uint64_t version) {
  std::map<std::string, std::string> out;
  for (const auto& [id, ranks] : fleet) {
    std::string why = BehindWhy(ranks, version);
    if (!why.empty()) out[id] = std::move(why);
  }
  return out;
}

void SyncCoordinator::ReapLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(500));
    // After a restart during a commit: tell every member behind to roll forward (once per member).
    if (recover_sync_ != 0 && !running_) {
      std::vector<Member> behind;
      for (const auto& [mid, m] : members_) {
        if (m.version < rolling_forward_ && told_.insert(mid).second) behind.push_back(m);
      }
      const uint64_t sync = recover_sync_, version = rolling_forward_;
      if (!behind.empty()) {
        mu_.Unlock();  // no agent call under mu_
        for (const Member& m : behind) {
          v1::AbortSyncRequest r;
          r.set_sync_id(sync);
          r.set_roll_forward(true);
          r.set_reason(absl::StrCat("the coordinator stopped during the commit of version ", version));
          v1::AbortSyncReply reply;
          absl::Status st = m.client->AbortSync(r, absl::Seconds(2), &reply);
          WSYNC_LOG(INFO) << "member " << m.id << " (engine " << m.engine_id << " tp " << m.tp_rank << ", version "
                          << m.version << ") told to roll forward to version " << version << " from sync " << sync
                          << "'s staging" << (st.ok() ? "" : absl::StrCat(": ", st.ToString()));
        }
        mu_.Lock();
      }
    }
    const absl::Time now = absl::Now();
    for (auto it = members_.begin(); it != members_.end();) {
      if (now - it->second.last_seen > opts_.member_timeout && !(running_ && InRunningSync(it->first))) {
        WSYNC_LOG(WARNING) << "member " << it->first << " (" << it->second.address << ") silent for "
                           << absl::FormatDuration(now - it->second.last_seen) << ": dropped";
        it = members_.erase(it);
        RefreshVersions();
      } else {
        ++it;
      }
    }
  }
}

bool SyncCoordinator::InRunningSync(const std::string& id) {
  auto it = syncs_.find(running_id_);
  if (it == syncs_.end()) return false;
  for (const auto& m : it->second.members) {
    if (m.agent_id() == id) return true;
  }
  return false;
}

}  // namespace wsync::trainer_agent
