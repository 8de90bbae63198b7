#include "trainer_agent/coordinator/sync_coordinator.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/bucket/bucket_mac.h"
#include "common/config.h"
#include "common/failpoint.h"
#include "common/logging.h"
#include "common/parallel_for.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "trainer_agent/coordinator/sync_keys.h"

namespace wsync::trainer_agent {
namespace {

std::string NewRunId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

// The registry's metric, or a private one that nobody reads when there is no registry.
Gauge* GaugeOf(MetricsRegistry* m, absl::string_view name, absl::string_view help, const Labels& labels = {}) {
  static Gauge unused;
  if (m == nullptr) return &unused;
  auto g = m->GetGauge(name, help, labels);
  return g.ok() ? *g : &unused;
}
Counter* CounterOf(MetricsRegistry* m, absl::string_view name, absl::string_view help) {
  static Counter unused;
  if (m == nullptr) return &unused;
  auto c = m->GetCounter(name, help);
  return c.ok() ? *c : &unused;
}
Histogram* HistogramOf(MetricsRegistry* m, absl::string_view name, absl::string_view help, const Labels& labels) {
  static Histogram unused(ExponentialBuckets(0.001, 2, 20));
  if (m == nullptr) return &unused;
  auto h = m->GetHistogram(name, help, ExponentialBuckets(0.001, 2, 20), labels);
  return h.ok() ? *h : &unused;
}

}  // namespace

struct SyncCoordinator::Member {
  std::string id, address, engine_id;
  std::string quant_json;  // the engine's quantization_config ("" = bf16)
  uint32_t tp_rank = 0, tp_size = 1, ep_size = 1;
  uint64_t version = 0;
  absl::Time last_seen;
  std::shared_ptr<AgentClient> client;
};

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

struct SyncCoordinator::SyncRecord {
  uint64_t id = 0, version = 0;
  plan::Delivery delivery = plan::Delivery::kBroadcast;
  std::string phase = "queued";
  std::string error;
  absl::Time start;
  bool finished = false;
  std::vector<v1::MemberState> members;
  std::vector<PhaseTime> phases;
  uint64_t bytes = 0;
  uint64_t expected_bytes = 0;
};

SyncCoordinator::SyncCoordinator(SyncCoordinatorOptions options, TrainerSide* trainer, comm::MemoryStore* store,
                                 AgentConnector connect)
    : opts_(std::move(options)), trainer_(trainer), store_(store), connect_(std::move(connect)), run_id_(NewRunId()) {}

SyncCoordinator::~SyncCoordinator() { Stop(); }

void SyncCoordinator::Start(const std::string& store_address) {
  absl::MutexLock lock(&mu_);
  if (started_ || stopping_) return;
  started_ = true;
  store_address_ = store_address;
  worker_ = std::thread([this] { SyncLoop(); });
  reaper_ = std::thread([this] { ReapLoop(); });
}

void SyncCoordinator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (worker_.joinable()) worker_.join();
  if (reaper_.joinable()) reaper_.join();
  if (state_lock_fd_ >= 0) close(state_lock_fd_);  // the state directory is free for a successor
  state_lock_fd_ = -1;
}

// --- Membership -----------------------------------------------------------------------------------

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
  m.quant_json = req.quantization_config_json();
  m.version = req.version();
  m.last_seen = absl::Now();
  m.client = connect_(m.address);
  WSYNC_LOG(INFO) << "member " << m.id << " joined: " << m.address << " engine " << m.engine_id << " tp " << m.tp_rank
                  << "/" << m.tp_size << " at version " << m.version;
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
    if (p.engine_id != m.engine_id && p.tp_size == m.tp_size && p.tp_rank == m.tp_rank && p.ep_size == m.ep_size &&
        p.version == target)
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

// --- Triggers and the state machine ---------------------------------------------------------------

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

void SyncCoordinator::RunSync(uint64_t id) {
  std::vector<Member> members;
  absl::Status fleet;  // no engine of the fleet can take the sync: it fails before BeginSync
  std::vector<std::string> sat_out;
  SyncPlan plan;
  absl::Time start;
  {
    absl::MutexLock lock(&mu_);
    fleet = CanSync();
    // A removed engine's agents, and those of an engine missing a rank's agent, sit the sync out
    // (half an engine is never written); the latter are named as behind when it ends.
    sat_out = IncompleteEngines();
    for (auto& [mid, m] : members_) {
      const FleetEngine& e = fleet_[m.engine_id];
      if (!e.removed && MissingRanks(m.engine_id, e.tp_size).empty()) members.push_back(m);
    }
    auto& rec = syncs_[id];
    start = rec.start;
    if (recover_sync_ != 0) {
      WSYNC_LOG(WARNING) << "sync " << id << " supersedes the roll forward to version " << rolling_forward_;
      for (v1::VersionRecord& vr : versions_) {
        if (vr.outcome() != "rolling_forward") continue;
        vr.set_outcome("failed");  // no engine had reported it: the engines go to this sync's version instead
        vr.set_error(absl::StrCat(vr.error(), "; superseded by sync ", id, " before any engine reported it"));
      }
      rolling_forward_ = 0;
    }
    recover_sync_ = 0;  // this sync brings every engine forward (or fails and changes nothing)
    told_.clear();
    plan.sync_id = id;
    plan.version = rec.version;
    plan.delivery = rec.delivery;
    if (fleet.ok()) {
      absl::StatusOr<std::string> q = EnginesQuantization(members);
      if (q.ok()) {
        plan.engine_quant_json = *std::move(q);
      } else {
        fleet = q.status();
      }
    }
    for (auto& m : members) {
      v1::MemberState ms;
      ms.set_agent_id(m.id);
      ms.set_engine_id(m.engine_id);
      ms.set_tp_rank(m.tp_rank);
      rec.members.push_back(ms);
    }
    rec.expected_bytes = last_bytes_;
  }
  plan.backend = opts_.backend;
  plan.num_agents = static_cast<int>(members.size());
  plan.timeout = opts_.sync_timeout;
  plan.deadline = start + opts_.sync_timeout;
  if (opts_.bucket_mac && fleet.ok()) {
    auto key = comm::NewSyncMacKey();
    if (key.ok()) {
      plan.bucket_mac_key = std::move(*key);
    } else {
      fleet = Annotate(key.status(), "making the sync's bucket key");
    }
  }
  for (int p = 0; p < trainer_->num_stages(); ++p) plan.group_names.push_back(SyncGroupName(id, p));
  // Sharded delivery: agents grouped by the blocks their engine ranks keep; each agent joins its
  // group's stream of every stage, as rank 1 + its place in the group.
  plan::Grouping grouping;
  if (plan.delivery == plan::Delivery::kSharded) {
    std::vector<engine_model::EngineParallel> ranks;
    for (const Member& m : members)
      ranks.push_back({static_cast<int>(m.tp_size), static_cast<int>(m.tp_rank), static_cast<int>(m.ep_size)});
    grouping = plan::GroupReceivers(ranks);
    plan.receiver_groups = grouping.groups;
    for (const auto& g : grouping.members) plan.group_agents.push_back(static_cast<int>(g.size()));
  }
  WSYNC_LOG(INFO) << "sync " << id << " -> version " << plan.version << " with " << members.size() << " agents, "
                  << plan::DeliveryName(plan.delivery) << " delivery"
                  << (plan.delivery == plan::Delivery::kSharded
                          ? absl::StrCat(" to ", grouping.groups.size(), " receiver groups")
                          : "");

  // Every call to the agents ends by the sync's deadline (a hung agent fails the sync within its
  // timeout, not an RPC timeout later), but never gets less than `floor`. The commit keeps at least
  // kCommitFloor even past the deadline: cutting a commit short would report a failure while the
  // agent may still be writing its engine.
  auto bounded = [&](absl::Duration nominal, absl::Duration floor) {
    return std::max(std::min(nominal, plan.deadline - absl::Now()), std::min(floor, nominal));
  };
  constexpr absl::Duration kCallFloor = absl::Seconds(1), kCommitFloor = absl::Seconds(5);
  std::vector<PhaseTime> phases;
  auto timed = [&](const std::string& phase, absl::FunctionRef<absl::Status()> fn) {
    SetPhase(id, phase);
    const absl::Time t0 = absl::Now();
    absl::Status s = fn();
    phases.push_back({phase, absl::ToDoubleSeconds(absl::Now() - t0), 0});
    HistogramOf(opts_.metrics, "wsync_sync_phase_seconds", "Duration of each sync phase", {{"phase", phase}})
        ->Observe(phases.back().seconds);
    return s;
  };

  absl::Status s = fleet.ok() ? absl::OkStatus() : fleet;
  // A sync given up on keeps running on the trainer ranks until its collectives end (their own
  // timeouts). Wait for them before any agent hears of this sync, for at most one sync timeout, and
  // give this sync its whole timeout from when they are free: it would otherwise wait in the trainer's
  // queue while its own clock ran.
  if (const uint64_t draining = s.ok() ? trainer_->draining_sync() : 0; draining != 0) {
    WSYNC_LOG(WARNING) << "sync " << id << " waits for the trainer ranks to finish sync " << draining
                       << ", which was given up on after its timeout";
    s = timed("wait_trainer", [&] {
      return Annotate(trainer_->AwaitIdle(absl::Now() + opts_.sync_timeout),
                      absl::StrCat("sync ", id, " was not started (no agent or engine was touched)"));
    });
    plan.deadline = absl::Now() + opts_.sync_timeout;
  }
  if (s.ok())
    s = timed("begin", [&] {
      return CallAll(id, members, "BeginSync", [&](AgentClient& agent, size_t i) {
        v1::BeginSyncRequest r;
        r.set_sync_id(id);
        r.set_version(plan.version);
        r.set_backend(plan.backend);
        r.set_store_address(store_address_);
        const bool sharded = plan.delivery == plan::Delivery::kSharded;
        const int group = sharded ? grouping.group_of[i] : -1;
        r.set_agent_rank(static_cast<uint32_t>(sharded ? grouping.rank_in_group[i] + 1 : i + 1));
        for (int p = 0; p < trainer_->num_stages(); ++p) {
          for (int k = 0; k < (sharded ? trainer_->num_senders(p) : 1); ++k) {
            auto* g = r.add_groups();
            g->set_pp_stage(p);
            g->set_name(sharded ? ShardGroupName(id, p, k, group) : plan.group_names[p]);
            g->set_size(static_cast<uint32_t>(sharded ? plan.group_agents[group] + 1 : members.size() + 1));
          }
        }
        r.set_timeout_ms(absl::ToInt64Milliseconds(opts_.sync_timeout));
        // A recording holds whole tensors: sharded syncs (blocks) are not recorded.
        r.set_record(!sharded);
        r.set_sync_key(absl::StrCat(run_id_, "-", id));
        r.set_bucket_mac_key(plan.bucket_mac_key);
        v1::BeginSyncReply reply;
        absl::Status st = agent.BeginSync(r, bounded(opts_.rpc_timeout, kCallFloor), &reply);
        if (st.ok()) FailpointHit("coordinator.begin");  // system tests: some agents have begun
        return st;
      });
    });
  TrainerReport report;
  if (s.ok()) {
    s = timed("transfer", [&] {
      FailpointHit("coordinator.transfer");
      auto r = trainer_->RunSync(plan);
      if (!r.ok()) return r.status();
      report = *r;
      return absl::OkStatus();
    });
  }
  std::vector<v1::PrepareSyncReply> prepared(members.size());
  if (s.ok()) {
    s = timed("prepare", [&] {
      FailpointHit("coordinator.prepare");
      return CallAll(id, members, "PrepareSync", [&](AgentClient& agent, size_t i) {
        v1::PrepareSyncRequest r;
        r.set_sync_id(id);
        return agent.PrepareSync(r, bounded(opts_.sync_timeout, kCallFloor), &prepared[i]);
      });
    });
  }
  std::vector<v1::CommitSyncReply> committed(members.size());
  if (s.ok()) {
    {
      // Durable before the first CommitSync: a successor of a coordinator that stops from here on
      // rolls the fleet forward to this version (every agent has it prepared).
      absl::MutexLock lock(&mu_);
      committing_sync_ = id;
      committing_version_ = plan.version;
      SaveState().IgnoreError();  // logged; without it a crash here leaves the fleet to the next sync
    }
    FailpointHit("coordinator.commit");
    s = timed("commit", [&] {
      return CallAll(id, members, "CommitSync", [&](AgentClient& agent, size_t i) {
        v1::CommitSyncRequest r;
        r.set_sync_id(id);
        absl::Status st = agent.CommitSync(r, bounded(opts_.rpc_timeout, kCommitFloor), &committed[i]);
        if (st.ok()) FailpointHit("coordinator.committed");
        return st;
      });
    });
  }
  bool some_committed = false;  // a failed commit that other engines had completed: they roll forward
  std::vector<uint64_t> reported(members.size(), 0);  // after a failure: the version each member said it holds
  if (!s.ok()) {
    WSYNC_LOG(ERROR) << "sync " << id << " failed: " << s;
    SetPhase(id, "abort");
    // Trainer ranks that reach the sync late (one was hung, say) stop forming its groups at once
    // rather than after their join timeout, and the next sync need not wait for them.
    (void)store_->Add(SyncAbandonedKey(id), 1);
    // Engines that committed already: the others roll forward to the version from their staging
    // (every agent prepared it, or no commit would have started), so the fleet converges on it.
    some_committed = std::any_of(committed.begin(), committed.end(),
                                 [&](const v1::CommitSyncReply& c) { return c.version() == plan.version; });
    std::vector<v1::AbortSyncReply> aborted(members.size());
    absl::Status a = CallAll(id, members, "AbortSync", [&](AgentClient& agent, size_t i) {
      v1::AbortSyncRequest r;
      r.set_sync_id(id);
      r.set_reason(std::string(s.message()));
      r.set_roll_forward(some_committed && committed[i].version() != plan.version);
      v1::AbortSyncReply& reply = aborted[i];
      // Best effort and short (2 s): an agent that cannot be reached, or is hung, aborts on its own
      // when the sync's timeout (sent in BeginSync) passes, so the sync ends now rather than an
      // RPC timeout later; a healthy agent answers in milliseconds.
      return agent.AbortSync(r, std::min(opts_.rpc_timeout, absl::Seconds(2)), &reply);
    });
    if (!a.ok()) WSYNC_LOG(ERROR) << "sync " << id << ": abort incomplete: " << a;
    // A commit that failed on some engines after others committed: say so first, by engine (each
    // engine's replies name the version it serves).
    std::vector<std::string> live, behind;
    for (size_t i = 0; i < members.size(); ++i) {
      const uint64_t v = committed[i].version() != 0 ? committed[i].version() : aborted[i].version();
      reported[i] = v;
      const std::string who = absl::StrCat("engine ", members[i].engine_id, " tp ", members[i].tp_rank);
      if (v == plan.version) {
        live.push_back(who);
      } else {
        behind.push_back(v != 0 ? absl::StrCat(who, " (on version ", v, ")") : absl::StrCat(who, " (unreachable)"));
      }
    }
    // An engine rank whose agent holds the version (its commit wrote the engine's memory, and then
    // Continue or the reply failed) counts as committed: it serves the version once its engine runs.
    some_committed = some_committed || !live.empty();
    if (!live.empty() && behind.empty())
      s = Annotate(s, absl::StrCat("version ", plan.version, " was committed on every engine (",
                                   absl::StrJoin(live, ", "), ") but the commit did not complete everywhere"));
    else if (!live.empty())
      s = Annotate(s, absl::StrCat("version ", plan.version, " was committed on ", absl::StrJoin(live, ", "),
                                   " but not on ", absl::StrJoin(behind, ", "),
                                   ": published to part of the fleet; the others roll forward to it from their "
                                   "staging as soon as their engines take it (until then the engines serve different "
                                   "versions, every reply naming its own)"));
  }

  // Timings: the trainer's phases, the agents' (slowest member), the coordinator's.
  double load = 0, transfer = 0, repack = 0, cont = 0, downtime = 0;
  uint64_t bytes = 0;
  for (const auto& p : prepared) {
    load = std::max(load, p.load_seconds());
    transfer = std::max(transfer, p.transfer_seconds());
    bytes = std::max<uint64_t>(bytes, p.bytes());
  }
  for (const auto& c : committed) {
    repack = std::max(repack, c.repack_seconds());
    cont = std::max(cont, c.continue_seconds());
    downtime = std::max(downtime, c.downtime_seconds());
  }
  std::vector<PhaseTime> all = report.phases;
  all.push_back({"transfer(agents)", transfer, bytes});
  all.push_back({"load", load, bytes});
  all.push_back({"repack", repack, 0});
  all.push_back({"continue", cont, 0});
  all.push_back({"downtime", downtime, 0});  // the longest engine pause (Pause sent -> Continue answered)
  for (auto& p : phases) all.push_back(p);
  const double total = absl::ToDoubleSeconds(absl::Now() - start);
  all.push_back({"total", total, report.bytes});

  absl::MutexLock lock(&mu_);
  // An agent whose CommitSync answered this version serves it from now on: record it at once
  // rather than at its next heartbeat, so that a member joining meanwhile (a restarted engine) is
  // told which peers can give it the version.
  for (size_t i = 0; i < members.size() && i < committed.size(); ++i) {
    if (committed[i].version() != plan.version && reported[i] != plan.version) continue;
    auto it = members_.find(members[i].id);
    if (it != members_.end() && it->second.address == members[i].address)
      it->second.version = std::max(it->second.version, plan.version);
  }
  auto& rec = syncs_[id];
  rec.phases = all;
  rec.finished = true;
  rec.bytes = report.bytes;
  // The outcome, from what the engines hold now (docs/sync.md "Versions"): done when every engine
  // of the fleet has the version, partial when some engine rank committed it, failed when none did.
  std::map<std::string, std::string> behind_by = EnginesBehind(FleetVersions(), rec.version);
  if (!s.ok()) {  // a member whose commit did not complete is behind, whatever its agent holds
    for (size_t i = 0; i < members.size(); ++i) {
      if (committed[i].version() == plan.version) continue;
      std::string& why = behind_by[members[i].engine_id];
      if (why.empty()) why = absl::StrCat("tp ", members[i].tp_rank, ": its commit did not complete");
    }
  }
  std::vector<std::string> behind;
  for (const auto& [engine, why] : behind_by) behind.push_back(absl::StrCat(engine, " (", why, ")"));
  std::string outcome = "failed";
  if (s.ok()) outcome = behind.empty() ? "done" : "partial";
  if (!s.ok() && some_committed) outcome = "partial";
  if (outcome == "partial" && s.ok())
    s = absl::UnavailableError(
        absl::StrCat("version ", rec.version, " was committed on every engine that took the sync; ",
                     sat_out.empty() ? absl::StrJoin(behind, ", ") : absl::StrJoin(sat_out, ", "),
                     sat_out.empty() ? " did not take it (it joined during the sync)" : " sat it out",
                     ": it catches up when its agents are back (a copy from a peer, or the next sync)"));
  rec.phase = outcome;
  rec.error = s.ok() ? "" : std::string(s.message());
  for (auto& m : rec.members) m.set_phase(rec.phase);
  running_ = false;  // with the outcome: whoever sees the sync finished sees the coordinator idle
  v1::VersionRecord vr;
  vr.set_version(rec.version);
  vr.set_sync_id(id);
  vr.set_ok(outcome != "failed");
  vr.set_outcome(outcome);
  vr.set_error(rec.error);
  for (const std::string& b : behind)
    if (outcome == "partial") vr.add_behind(b);
  vr.set_seconds(total);
  vr.set_bytes(report.bytes);
  vr.set_finished_unix_ms(absl::ToUnixMillis(absl::Now()));
  versions_.push_back(vr);
  committing_sync_ = committing_version_ = 0;
  if (outcome != "failed") {
    published_ = rec.version;
    last_bytes_ = report.bytes;
    CounterOf(opts_.metrics, "wsync_sync_bytes_total", "Bytes streamed by syncs that published a version")
        ->Increment(static_cast<double>(report.bytes));
  }
  if (outcome == "done") {
    CounterOf(opts_.metrics, "wsync_syncs_total", "Syncs that every engine of the fleet committed")->Increment();
    WSYNC_LOG(INFO) << "sync " << id << ": version " << rec.version << " published in " << total << " s ("
                    << report.bytes << " bytes)";
  } else if (outcome == "partial") {
    last_error_ = rec.error;
    CounterOf(opts_.metrics, "wsync_syncs_partial_total",
              "Syncs committed on part of the fleet (the others left behind, catching up)")
        ->Increment();
    WSYNC_LOG(WARNING) << "sync " << id << ": version " << rec.version << " published to part of the fleet in " << total
                       << " s; behind: " << absl::StrJoin(behind, ", ");
  } else {
    last_error_ = rec.error;
    CounterOf(opts_.metrics, "wsync_sync_failures_total", "Syncs that no engine committed (aborted everywhere)")
        ->Increment();
  }
  RefreshVersions();
  ++event_seq_;
  PruneHistory();
  // The store keys of the sync before this one (its groups are long gone; this one's stay until
  // the next sync ends, for members still leaving it).
  if (previous_sync_keys_ != 0) store_->DeletePrefix(SyncKeyPrefix(previous_sync_keys_));
  previous_sync_keys_ = id;
  SaveState().IgnoreError();  // logged; the next trigger saves again (and is refused if it cannot)
}

// --- Durable state --------------------------------------------------------------------------------

namespace {

constexpr size_t kKeptVersions = 1000, kKeptTimings = 64;

}  // namespace

// A coordinator runs for as many syncs as the training job takes (tens of thousands): it keeps the
// newest kKeptVersions attempts (`wsyncctl versions`) and the newest kKeptTimings finished syncs'
// records (timings, members), as the state file does, so its memory does not grow with them.
void SyncCoordinator::PruneHistory() {
  if (versions_.size() > kKeptVersions)
    versions_.erase(versions_.begin(), versions_.end() - static_cast<std::ptrdiff_t>(kKeptVersions));
  size_t finished = 0;
  for (const auto& [id, rec] : syncs_) finished += rec.finished ? 1 : 0;
  for (auto it = syncs_.begin(); it != syncs_.end() && finished > kKeptTimings;) {
    if (it->second.finished) {  // std::map: oldest sync ids first
      it = syncs_.erase(it);
      --finished;
    } else {
      ++it;
    }
  }
}

namespace {

std::string StatePath(const std::string& dir) { return dir + "/coordinator-state.json"; }

absl::Status WriteDurably(const std::string& dir, const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("writing ", tmp));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      unlink(tmp.c_str());
      return ErrnoToStatus(err, absl::StrCat("writing ", tmp));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = fsync(fd) == 0;
  const int err = errno;
  close(fd);
  if (!synced || rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = synced ? errno : err;
    unlink(tmp.c_str());
    return ErrnoToStatus(e, absl::StrCat("replacing ", path));
  }
  if (const int d = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); d >= 0) {
    fsync(d);  // the rename itself
    close(d);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SyncCoordinator::LoadState() {
  if (opts_.state_dir.empty()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(opts_.state_dir, ec);
  if (ec)
    return absl::PermissionDeniedError(
        absl::StrCat("creating the state directory ", opts_.state_dir, ": ", ec.message()));
  // One coordinator per state directory: a second job started on it (a forgotten one still running,
  // a test beside another) would overwrite the first's numbers. The lock goes with the process.
  const std::string lock_path = opts_.state_dir + "/coordinator.lock";
  const int lock_fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) return ErrnoToStatus(errno, absl::StrCat("opening ", lock_path));
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    if (auto t = ReadTextFile(lock_path); t.ok()) holder = std::string(absl::StripAsciiWhitespace(*t));
    close(lock_fd);
    if (err != EWOULDBLOCK) return ErrnoToStatus(err, absl::StrCat("locking ", lock_path));
    return absl::FailedPreconditionError(absl::StrCat(
        "the state directory ", opts_.state_dir, " is in use by another coordinator (", holder.empty() ? "?" : holder,
        "): one trainer job per --state-dir; stop the other job, or give this one its own --state-dir"));
  }
  if (ftruncate(lock_fd, 0) == 0) {
    const std::string me = absl::StrCat("pid ", getpid(), "\n");
    (void)!write(lock_fd, me.data(), me.size());
  }
  if (state_lock_fd_ >= 0) close(state_lock_fd_);
  state_lock_fd_ = lock_fd;
  const std::string path = StatePath(opts_.state_dir);
  if (!std::filesystem::exists(path)) {
    WSYNC_LOG(INFO) << "coordinator state: none in " << opts_.state_dir << " yet; versions start at 1";
    return absl::OkStatus();
  }
  auto text = ReadTextFile(path);
  if (!text.ok())
    return absl::FailedPreconditionError(absl::StrCat("coordinator state ", path, ": ", text.status().message()));
  v1::CoordinatorState st;
  google::protobuf::util::JsonParseOptions jo;
  if (auto parsed = google::protobuf::util::JsonStringToMessage(*text, &st, jo); !parsed.ok())
    return absl::FailedPreconditionError(absl::StrCat("coordinator state ", path, " is not valid (", parsed.ToString(),
                                                      "); fix it or move it away to start afresh"));
  absl::MutexLock lock(&mu_);
  published_ = st.published();
  next_version_ = std::max<uint64_t>({st.next_version(), st.published() + 1, 1});
  next_sync_id_ = std::max<uint64_t>(st.next_sync_id(), 1);
  last_error_ = st.last_error();
  versions_.assign(st.versions().begin(), st.versions().end());
  for (v1::VersionRecord& v : versions_)
    if (v.outcome().empty()) v.set_outcome(v.ok() ? "done" : "failed");  // a state file from before outcomes
  for (const v1::VersionRecord& v : versions_) next_sync_id_ = std::max(next_sync_id_, v.sync_id() + 1);
  for (const v1::TimingsReply& t : st.timings()) {
    SyncRecord& rec = syncs_[t.sync_id()];
    rec.id = t.sync_id();
    rec.version = t.version();
    rec.finished = true;
    rec.phase = "done";
    if (!t.delivery().empty()) {
      auto d = plan::ParseDelivery(t.delivery());
      if (d.ok()) rec.delivery = *d;
    }
    for (const v1::VersionRecord& v : versions_) {
      if (v.sync_id() != t.sync_id()) continue;
      rec.phase = v.outcome();
      rec.error = v.error();
    }
    for (const v1::PhaseTiming& p : t.phases()) rec.phases.push_back({p.phase(), p.seconds(), p.bytes()});
    next_sync_id_ = std::max(next_sync_id_, rec.id + 1);
  }
  rolling_forward_ = st.rolling_forward();
  for (const v1::FleetEngineState& f : st.fleet()) {
    FleetEngine& e = fleet_[f.engine_id()];
    e.tp_size = std::max<uint32_t>(f.tp_size(), 1);
    e.removed = f.removed();
  }
  if (st.committing_sync_id() != 0 && st.committing_version() > published_) {
    // The previous coordinator stopped during this sync's commit: some engines may hold the version,
    // every agent has it prepared. Roll them all forward to it (the reaper tells each one behind).
    recover_sync_ = st.committing_sync_id();
    rolling_forward_ = std::max(rolling_forward_, st.committing_version());
    v1::VersionRecord vr;
    vr.set_version(st.committing_version());
    vr.set_sync_id(st.committing_sync_id());
    vr.set_ok(false);
    vr.set_outcome("rolling_forward");
    vr.set_error(
        "the coordinator stopped during this sync's commit: the engines roll forward to it from their staging");
    versions_.push_back(vr);
    last_error_ = vr.error();
    WSYNC_LOG(WARNING) << "sync " << recover_sync_ << " was committing version " << st.committing_version()
                       << " when the previous coordinator stopped: every engine rolls forward to it from its "
                          "agent's staging, and it is published as soon as one reports it";
  }
  if (rolling_forward_ <= published_) rolling_forward_ = 0;
  RefreshVersions();
  WSYNC_LOG(INFO) << "coordinator state from " << path << ": version " << published_ << " published, "
                  << versions_.size() << " attempts; the next sync is " << next_sync_id_ << ", version "
                  << next_version_ << "; a fleet of " << fleet_.size() << " engine(s)";
  return absl::OkStatus();
}

absl::Status SyncCoordinator::SaveState() {
  if (opts_.state_dir.empty()) return absl::OkStatus();
  v1::CoordinatorState st;
  st.set_next_version(next_version_);
  st.set_next_sync_id(next_sync_id_);
  st.set_published(published_);
  st.set_last_error(last_error_);
  st.set_committing_sync_id(committing_sync_);
  st.set_committing_version(committing_version_);
  st.set_rolling_forward(rolling_forward_);
  for (const auto& [id, e] : fleet_) {
    v1::FleetEngineState* f = st.add_fleet();
    f->set_engine_id(id);
    f->set_tp_size(e.tp_size);
    f->set_removed(e.removed);
  }
  const size_t first = versions_.size() > kKeptVersions ? versions_.size() - kKeptVersions : 0;
  for (size_t i = first; i < versions_.size(); ++i) *st.add_versions() = versions_[i];
  std::vector<const SyncRecord*> done;
  for (const auto& [id, rec] : syncs_)
    if (rec.finished) done.push_back(&rec);
  std::sort(done.begin(), done.end(), [](const SyncRecord* a, const SyncRecord* b) { return a->id < b->id; });
  for (size_t i = done.size() > kKeptTimings ? done.size() - kKeptTimings : 0; i < done.size(); ++i) {
    v1::TimingsReply* t = st.add_timings();
    t->set_version(done[i]->version);
    t->set_sync_id(done[i]->id);
    t->set_delivery(std::string(plan::DeliveryName(done[i]->delivery)));
    for (const PhaseTime& p : done[i]->phases) {
      v1::PhaseTiming* pt = t->add_phases();
      pt->set_phase(p.phase);
      pt->set_seconds(p.seconds);
      pt->set_bytes(p.bytes);
    }
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions po;
  po.add_whitespace = true;
  absl::Status s;
  if (auto printed = google::protobuf::util::MessageToJsonString(st, &json, po); !printed.ok())
    s = absl::InternalError(printed.ToString());
  if (s.ok()) s = WriteDurably(opts_.state_dir, StatePath(opts_.state_dir), json);
  if (!s.ok()) WSYNC_LOG(ERROR) << "saving the coordinator state in " << opts_.state_dir << ": " << s;
  return s;
}

// --- Observation ----------------------------------------------------------------------------------

void SyncCoordinator::FillEvent(const SyncRecord& rec, v1::SyncEvent* e) {
  e->set_sync_id(rec.id);
  e->set_version(rec.version);
  e->set_phase(rec.phase);
  const std::string prefix = SyncProgressPrefix(rec.id);
  uint64_t bytes = 0, buckets = 0;
  if (auto v = store_->Get(prefix + kProgressBytes, absl::ZeroDuration()); v.ok()) (void)absl::SimpleAtoi(*v, &bytes);
  if (auto v = store_->Get(prefix + kProgressBuckets, absl::ZeroDuration()); v.ok()) {
    (void)absl::SimpleAtoi(*v, &buckets);
  }
  e->set_bytes_done(rec.finished ? rec.bytes : bytes);
  e->set_buckets_done(buckets);
  e->set_bytes_total(rec.finished ? rec.bytes : rec.expected_bytes);
  e->set_elapsed_seconds(rec.start == absl::Time() ? 0 : absl::ToDoubleSeconds(absl::Now() - rec.start));
  for (const auto& m : rec.members) *e->add_members() = m;
  e->set_error(rec.error);
}

absl::Status SyncCoordinator::WatchSync(uint64_t sync_id, absl::FunctionRef<bool(const v1::SyncEvent&)> emit) {
  uint64_t id = sync_id;
  uint64_t seen = ~uint64_t{0};
  for (;;) {
    v1::SyncEvent e;
    bool finished = false;
    {
      absl::MutexLock lock(&mu_);
      if (id == 0) {
        if (running_) {
          id = running_id_;
        } else if (!queue_.empty()) {
          id = queue_.front();
        }
      }
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return event_seq_ != seen || stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(200));
      seen = event_seq_;
      if (stopping_) return absl::UnavailableError("the coordinator is stopping");
      auto it = syncs_.find(id);
      if (id == 0 || it == syncs_.end()) {
        if (id != 0) return absl::NotFoundError(absl::StrCat("no sync ", id));
        continue;  // nothing yet: wait for the next trigger
      }
      FillEvent(it->second, &e);
      finished = it->second.finished;
    }
    if (!emit(e) || finished) return absl::OkStatus();
  }
}

void SyncCoordinator::Status(v1::StatusReply* reply) {
  absl::MutexLock lock(&mu_);
  reply->set_version(published_);
  reply->set_state(running_ ? "syncing" : "idle");
  reply->set_running_sync_id(running_ ? running_id_ : 0);
  reply->set_members(static_cast<uint32_t>(members_.size()));
  reply->set_trainer_ranks(static_cast<uint32_t>(trainer_->world_size()));
  reply->set_last_error(last_error_);
  const RankVersions fleet = FleetVersions();
  const std::map<std::string, std::string> behind =
      published_ == 0 ? std::map<std::string, std::string>() : EnginesBehind(fleet, published_);
  reply->set_engines_behind(static_cast<uint32_t>(behind.size()));
  for (const auto& [id, e] : fleet_) {
    v1::EngineVersion* ev = reply->add_engines();
    ev->set_engine_id(id);
    ev->set_tp_size(e.tp_size);
    auto ranks = fleet.find(id);
    ev->set_version(ranks == fleet.end() ? 0 : EngineServes(ranks->second));
    ev->set_behind(behind.count(id) > 0);
    ev->set_removed(e.removed);
    for (uint32_t r = 0; r < e.tp_size; ++r) {
      v1::RankVersion* rv = ev->add_rank_versions();
      rv->set_tp_rank(r);
      for (const auto& [mid, m] : members_) {
        if (m.engine_id != id || m.tp_rank != r) continue;
        rv->set_has_agent(true);
        rv->set_version(m.version);
      }
    }
  }
}

void SyncCoordinator::Members(v1::MembersReply* reply) {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, m] : members_) {
    auto* out = reply->add_members();
    out->set_agent_id(id);
    out->set_agent_address(m.address);
    out->set_engine_id(m.engine_id);
    out->set_tp_rank(m.tp_rank);
    out->set_tp_size(m.tp_size);
    out->set_version(m.version);
    out->set_last_heartbeat_age_seconds(absl::ToDoubleSeconds(absl::Now() - m.last_seen));
  }
  for (const auto& [id, e] : fleet_) {
    v1::EngineState* out = reply->add_engines();
    out->set_engine_id(id);
    out->set_tp_size(e.tp_size);
    out->set_removed(e.removed);
    for (uint32_t r : MissingRanks(id, e.tp_size)) out->add_missing_ranks(r);
  }
}

void SyncCoordinator::Versions(v1::VersionsReply* reply) {
  absl::MutexLock lock(&mu_);
  for (const auto& v : versions_) *reply->add_versions() = v;
}

absl::Status SyncCoordinator::Timings(const v1::TimingsRequest& req, v1::TimingsReply* reply) {
  absl::MutexLock lock(&mu_);
  const SyncRecord* found = nullptr;
  for (const auto& [id, rec] : syncs_) {
    if (!rec.finished) continue;
    if (req.version() == 0 ? (found == nullptr || rec.id > found->id) : rec.version == req.version()) found = &rec;
  }
  if (found == nullptr) {
    return absl::NotFoundError(req.version() == 0 ? "no sync has finished yet"
                                                  : absl::StrCat("no finished sync for version ", req.version(),
                                                                 " among the newest ", kKeptTimings, " syncs"));
  }
  reply->set_version(found->version);
  reply->set_sync_id(found->id);
  reply->set_delivery(std::string(plan::DeliveryName(found->delivery)));
  for (const auto& p : found->phases) {
    auto* out = reply->add_phases();
    out->set_phase(p.phase);
    out->set_seconds(p.seconds);
    out->set_bytes(p.bytes);
  }
  return absl::OkStatus();
}

}  // namespace wsync::trainer_agent
