// SyncCoordinator's life (construction, Start, Stop) and what operators read (WatchSync, Status,
// Members, Versions, Timings). Membership is sync_coordinator_membership.cc, the durable state
// sync_coordinator_state.cc, triggers and the sync itself sync_coordinator_run.cc.
#include "trainer_agent/coordinator/sync_coordinator.h"

#include <unistd.h>

#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer_agent/coordinator/sync_coordinator_internal.h"
#include "trainer_agent/coordinator/sync_keys.h"

namespace wsync::trainer_agent {
namespace coordinator_internal {

Gauge* GaugeOf(MetricsRegistry* m, absl::string_view name, absl::string_view help, const Labels& labels) {
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

}  // namespace coordinator_internal

absl::StatusOr<DeltaMode> ParseDeltaMode(absl::string_view name) {
  if (name == "off") return DeltaMode::kOff;
  if (name == "auto") return DeltaMode::kAuto;
  if (name == "on") return DeltaMode::kOn;
  return absl::InvalidArgumentError(absl::StrCat("delta \"", name, "\": off, auto or on"));
}

absl::string_view DeltaModeName(DeltaMode mode) {
  switch (mode) {
    case DeltaMode::kAuto: return "auto";
    case DeltaMode::kOn: return "on";
    default: return "off";
  }
}

namespace {

using coordinator_internal::CopyDeltaFigures;
using coordinator_internal::kKeptTimings;

std::string NewRunId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

}  // namespace

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
  CopyDeltaFigures(found->delta_figures, reply);
  for (const auto& p : found->phases) {
    auto* out = reply->add_phases();
    out->set_phase(p.phase);
    out->set_seconds(p.seconds);
    out->set_bytes(p.bytes);
  }
  return absl::OkStatus();
}

}  // namespace wsync::trainer_agent
