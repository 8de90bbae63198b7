#include "trainer_agent/coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/parallel_for.h"
#include "common/status.h"
#include "wsync/v1/coordinator.grpc.pb.h"
#include "wsync/v1/rollout.grpc.pb.h"

namespace wsync::trainer_agent {
namespace {

struct MemberInfo {
  std::string id, address, engine_id;
  uint32_t tp_rank = 0, tp_size = 1;
  uint64_t version = 0;
  absl::Time last_seen;
  std::shared_ptr<v1::RolloutAgent::Stub> stub;
};

struct SyncRecord {
  uint64_t id = 0, version = 0;
  std::string phase = "queued";
  std::string error;
  absl::Time start;
  bool finished = false;
  std::vector<v1::MemberState> members;
  std::vector<PhaseTime> phases;
  uint64_t bytes = 0;
  uint64_t expected_bytes = 0;
};


}  // namespace

class Coordinator::Impl final : public v1::Coordinator::Service {
 public:
  Impl(CoordinatorOptions o, TrainerSide* trainer) : opts_(std::move(o)), trainer_(trainer) {
    std::random_device rd;
    run_id_ = absl::StrFormat("%08x%08x", rd(), rd());
  }

  absl::Status Start() {
    store_service_ = comm::MakeStoreService(&store_, opts_.security);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(opts_.listen, ServerCredentials(opts_.security), &port_);
    builder.RegisterService(this);
    builder.RegisterService(store_service_.get());
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0) return absl::UnavailableError(absl::StrCat("coordinator: cannot listen on ", opts_.listen));
    const size_t colon = opts_.listen.rfind(':');
    host_ = colon == std::string::npos ? opts_.listen : opts_.listen.substr(0, colon);
    worker_ = std::thread([this] { SyncLoop(); });
    reaper_ = std::thread([this] { ReapLoop(); });
    WSYNC_LOG(INFO) << "coordinator listening on " << address() << " (" << trainer_->world_size() << " trainer ranks, "
                    << trainer_->num_stages() << " stages)";
    return absl::OkStatus();
  }

  ~Impl() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (worker_.joinable()) worker_.join();
    if (reaper_.joinable()) reaper_.join();
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  }

  std::string address() const { return absl::StrCat(host_, ":", port_); }
  comm::MemoryStore& store() { return store_; }

  // --- Membership ---------------------------------------------------------------------------------
  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* req, v1::JoinReply* reply) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    if (req->agent_address().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "agent_address is empty");
    absl::MutexLock lock(&mu_);
    // A restarted agent re-joins from the same address: replace its old entry.
    for (auto it = members_.begin(); it != members_.end(); ++it) {
      if (it->second.address == req->agent_address()) {
        members_.erase(it);
        break;
      }
    }
    MemberInfo m;
    m.id = absl::StrCat("agent-", next_member_++);
    m.address = req->agent_address();
    m.engine_id = req->engine_id();
    m.tp_rank = req->tp_rank();
    m.tp_size = req->tp_size();
    m.version = req->version();
    m.last_seen = absl::Now();
    m.stub = v1::RolloutAgent::NewStub(MakeChannel(m.address, opts_.security));
    WSYNC_LOG(INFO) << "member " << m.id << " joined: " << m.address << " engine " << m.engine_id << " tp "
                    << m.tp_rank << "/" << m.tp_size << " at version " << m.version;
    reply->set_agent_id(m.id);
    reply->set_heartbeat_ms(absl::ToInt64Milliseconds(opts_.heartbeat));
    members_[m.id] = std::move(m);
    Gauge("wsync_members", "Rollout agents in the membership")->Set(members_.size());
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req, v1::HeartbeatReply* reply) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    absl::MutexLock lock(&mu_);
    auto it = members_.find(req->agent_id());
    reply->set_known(it != members_.end());
    if (it != members_.end()) {
      it->second.last_seen = absl::Now();
      it->second.version = req->version();
    }
    return grpc::Status::OK;
  }

  grpc::Status Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* req, v1::LeaveReply*) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    absl::MutexLock lock(&mu_);
    members_.erase(req->agent_id());
    return grpc::Status::OK;
  }

  void ReapLoop() {
    absl::MutexLock lock(&mu_);
    while (!stopping_) {
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(500));
      const absl::Time now = absl::Now();
      for (auto it = members_.begin(); it != members_.end();) {
        if (now - it->second.last_seen > opts_.member_timeout && !(running_ && InRunningSync(it->first))) {
          WSYNC_LOG(WARNING) << "member " << it->first << " (" << it->second.address << ") silent for "
                             << absl::FormatDuration(now - it->second.last_seen) << ": dropped";
          it = members_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  bool InRunningSync(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = syncs_.find(running_id_);
    if (it == syncs_.end()) return false;
    for (const auto& m : it->second.members) {
      if (m.agent_id() == id) return true;
    }
    return false;
  }

  // --- Triggers and the state machine -------------------------------------------------------------
  grpc::Status TriggerSync(grpc::ServerContext* ctx, const v1::TriggerSyncRequest* req,
                           v1::TriggerSyncReply* reply) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    absl::MutexLock lock(&mu_);
    if (members_.size() < std::max<size_t>(1, req->min_agents())) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("a sync needs at least ", std::max<uint32_t>(1, req->min_agents()),
                                       " rollout agents; ", members_.size(), " have joined"));
    }
    if (const uint64_t v = req->version(); v != 0) {
      // Join a sync of the same version (queued, running, or done): one sync for all ranks.
      for (auto& [sid, rec] : syncs_) {
        if (rec.version == v && (!rec.finished || rec.phase == "done")) {
          reply->set_sync_id(sid);
          reply->set_version(v);
          reply->set_coalesced(true);
          return grpc::Status::OK;
        }
      }
      uint64_t newest = published_;
      for (uint64_t q : queue_) newest = std::max(newest, syncs_[q].version);
      if (running_) newest = std::max(newest, syncs_[running_id_].version);
      if (v <= newest) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("version ", v, " is not newer than version ", newest,
                                         " (published, queued or running); versions only grow"));
      }
    }
    if ((running_ || !queue_.empty()) && !req->wait_if_busy()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("sync ", running_ ? running_id_ : queue_.front(),
                                       " is in progress; retry later or pass wait_if_busy"));
    }
    const uint64_t id = next_sync_id_++;
    SyncRecord rec;
    rec.id = id;
    if (req->version() != 0) {
      rec.version = req->version();
      next_version_ = std::max(next_version_, rec.version + 1);
    } else {
      rec.version = next_version_++;
    }
    syncs_[id] = rec;
    queue_.push_back(id);
    ++event_seq_;
    reply->set_sync_id(id);
    reply->set_version(rec.version);
    return grpc::Status::OK;
  }

  void SyncLoop() {
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
      RunSync(id);
      absl::MutexLock lock(&mu_);
      running_ = false;
      ++event_seq_;
    }
  }

  void SetPhase(uint64_t id, const std::string& phase) {
    absl::MutexLock lock(&mu_);
    auto& rec = syncs_[id];
    rec.phase = phase;
    for (auto& m : rec.members) m.set_phase(phase);
    ++event_seq_;
  }

  void SetMemberError(uint64_t id, size_t i, const absl::Status& s) {
    absl::MutexLock lock(&mu_);
    auto& rec = syncs_[id];
    if (i < rec.members.size()) rec.members[i].set_error(std::string(s.message()));
    ++event_seq_;
  }

  // Calls `rpc` on every member in parallel with a deadline; records per-member errors.
  template <typename Req, typename Reply>
  absl::Status CallAll(uint64_t id, const std::vector<MemberInfo>& members, const char* what, absl::Duration timeout,
                       const std::function<Req(size_t)>& make,
                       grpc::Status (v1::RolloutAgent::Stub::*rpc)(grpc::ClientContext*, const Req&, Reply*),
                       std::vector<Reply>* replies) {
    replies->assign(members.size(), Reply());
    auto statuses = RunConcurrently(members.size(), [&](size_t i) {
      grpc::ClientContext ctx;
      PrepareContext(&ctx, opts_.security, timeout);
      Req req = make(i);
      absl::Status s = FromGrpcStatus(((*members[i].stub).*rpc)(&ctx, req, &(*replies)[i]));
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

  void RunSync(uint64_t id) {
    std::vector<MemberInfo> members;
    SyncPlan plan;
    absl::Time start;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [mid, m] : members_) members.push_back(m);
      auto& rec = syncs_[id];
      start = rec.start;
      plan.sync_id = id;
      plan.version = rec.version;
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
    for (int p = 0; p < trainer_->num_stages(); ++p) plan.group_names.push_back(absl::StrCat("sync-", id, "/pp", p));
    WSYNC_LOG(INFO) << "sync " << id << " -> version " << plan.version << " with " << members.size() << " agents";

    std::vector<PhaseTime> phases;
    auto timed = [&](const std::string& phase, const std::function<absl::Status()>& fn) {
      SetPhase(id, phase);
      const absl::Time t0 = absl::Now();
      absl::Status s = fn();
      phases.push_back({phase, absl::ToDoubleSeconds(absl::Now() - t0), 0});
      Histogram(absl::StrCat("wsync_sync_phase_seconds"), "Duration of each sync phase", {{"phase", phase}})
          ->Observe(phases.back().seconds);
      return s;
    };

    absl::Status s = timed("pause", [&] {
      std::vector<v1::BeginSyncReply> replies;
      return CallAll<v1::BeginSyncRequest, v1::BeginSyncReply>(
          id, members, "BeginSync", opts_.rpc_timeout,
          [&](size_t i) {
            v1::BeginSyncRequest r;
            r.set_sync_id(id);
            r.set_version(plan.version);
            r.set_backend(plan.backend);
            r.set_store_address(address());
            r.set_agent_rank(static_cast<uint32_t>(i + 1));
            for (int p = 0; p < trainer_->num_stages(); ++p) {
              auto* g = r.add_groups();
              g->set_pp_stage(p);
              g->set_name(plan.group_names[p]);
              g->set_size(static_cast<uint32_t>(members.size() + 1));
            }
            r.set_timeout_ms(absl::ToInt64Milliseconds(opts_.sync_timeout));
            r.set_record(true);
            r.set_sync_key(absl::StrCat(run_id_, "-", id));
            return r;
          },
          &v1::RolloutAgent::Stub::BeginSync, &replies);
    });
    TrainerReport report;
    if (s.ok()) {
      s = timed("transfer", [&] {
        auto r = trainer_->RunSync(plan);
        if (!r.ok()) return r.status();
        report = *r;
        return absl::OkStatus();
      });
    }
    std::vector<v1::PrepareSyncReply> prepared;
    if (s.ok()) {
      s = timed("prepare", [&] {
        return CallAll<v1::PrepareSyncRequest, v1::PrepareSyncReply>(
            id, members, "PrepareSync", opts_.sync_timeout,
            [&](size_t) {
              v1::PrepareSyncRequest r;
              r.set_sync_id(id);
              return r;
            },
            &v1::RolloutAgent::Stub::PrepareSync, &prepared);
      });
    }
    std::vector<v1::CommitSyncReply> committed;
    if (s.ok()) {
      s = timed("commit", [&] {
        return CallAll<v1::CommitSyncRequest, v1::CommitSyncReply>(
            id, members, "CommitSync", opts_.rpc_timeout,
            [&](size_t) {
              v1::CommitSyncRequest r;
              r.set_sync_id(id);
              return r;
            },
            &v1::RolloutAgent::Stub::CommitSync, &committed);
      });
    }
    if (!s.ok()) {
      WSYNC_LOG(ERROR) << "sync " << id << " failed: " << s;
      SetPhase(id, "abort");
      std::vector<v1::AbortSyncReply> aborted;
      absl::Status a = CallAll<v1::AbortSyncRequest, v1::AbortSyncReply>(
          id, members, "AbortSync", opts_.rpc_timeout,
          [&](size_t) {
            v1::AbortSyncRequest r;
            r.set_sync_id(id);
            r.set_reason(std::string(s.message()));
            return r;
          },
          &v1::RolloutAgent::Stub::AbortSync, &aborted);
      if (!a.ok()) WSYNC_LOG(ERROR) << "sync " << id << ": abort incomplete: " << a;
    }

    // Timings: the trainer's phases, the agents' (slowest member), the coordinator's.
    double load = 0, transfer = 0, repack = 0, cont = 0;
    uint64_t bytes = 0;
    for (const auto& p : prepared) {
      load = std::max(load, p.load_seconds());
      transfer = std::max(transfer, p.transfer_seconds());
      bytes = std::max<uint64_t>(bytes, p.bytes());
    }
    for (const auto& c : committed) {
      repack = std::max(repack, c.repack_seconds());
      cont = std::max(cont, c.continue_seconds());
    }
    std::vector<PhaseTime> all = report.phases;
    all.push_back({"transfer(agents)", transfer, bytes});
    all.push_back({"load", load, bytes});
    all.push_back({"repack", repack, 0});
    all.push_back({"continue", cont, 0});
    for (auto& p : phases) all.push_back(p);
    const double total = absl::ToDoubleSeconds(absl::Now() - start);
    all.push_back({"total", total, report.bytes});

    absl::MutexLock lock(&mu_);
    auto& rec = syncs_[id];
    rec.phases = all;
    rec.finished = true;
    rec.bytes = report.bytes;
    rec.phase = s.ok() ? "done" : "failed";
    rec.error = s.ok() ? "" : std::string(s.message());
    for (auto& m : rec.members) m.set_phase(rec.phase);
    v1::VersionRecord vr;
    vr.set_version(rec.version);
    vr.set_sync_id(id);
    vr.set_ok(s.ok());
    vr.set_error(rec.error);
    vr.set_seconds(total);
    vr.set_bytes(report.bytes);
    vr.set_finished_unix_ms(absl::ToUnixMillis(absl::Now()));
    versions_.push_back(vr);
    if (s.ok()) {
      published_ = rec.version;
      last_bytes_ = report.bytes;
      CounterM("wsync_syncs_total", "Syncs that published a version")->Increment();
      CounterM("wsync_sync_bytes_total", "Bytes streamed by successful syncs")->Increment(static_cast<double>(report.bytes));
      Gauge("wsync_version", "Last published weight version")->Set(static_cast<double>(published_));
      WSYNC_LOG(INFO) << "sync " << id << ": version " << rec.version << " published in " << total << " s ("
                      << report.bytes << " bytes)";
    } else {
      last_error_ = rec.error;
      CounterM("wsync_sync_failures_total", "Syncs that failed and were aborted")->Increment();
    }
    ++event_seq_;
  }

  // --- Observation ------------------------------------------------------------------------------
  void FillEvent(const SyncRecord& rec, v1::SyncEvent* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    e->set_sync_id(rec.id);
    e->set_version(rec.version);
    e->set_phase(rec.phase);
    const std::string prefix = absl::StrCat("sync-", rec.id, "/progress/");
    uint64_t bytes = 0, buckets = 0;
    if (auto v = store_.Get(prefix + "bytes", absl::ZeroDuration()); v.ok()) (void)absl::SimpleAtoi(*v, &bytes);
    if (auto v = store_.Get(prefix + "buckets", absl::ZeroDuration()); v.ok()) (void)absl::SimpleAtoi(*v, &buckets);
    e->set_bytes_done(rec.finished ? rec.bytes : bytes);
    e->set_buckets_done(buckets);
    e->set_bytes_total(rec.finished ? rec.bytes : rec.expected_bytes);
    e->set_elapsed_seconds(rec.start == absl::Time() ? 0 : absl::ToDoubleSeconds(absl::Now() - rec.start));
    for (const auto& m : rec.members) *e->add_members() = m;
    e->set_error(rec.error);
  }

  grpc::Status WatchSync(grpc::ServerContext* ctx, const v1::WatchSyncRequest* req,
                         grpc::ServerWriter<v1::SyncEvent>* writer) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    uint64_t id = req->sync_id();
    uint64_t seen = ~uint64_t{0};
    for (;;) {
      v1::SyncEvent e;
      bool finished = false;
      {
        absl::MutexLock lock(&mu_);
        if (id == 0) {
          if (running_) id = running_id_;
          else if (!queue_.empty()) id = queue_.front();
        }
        auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return event_seq_ != seen || stopping_; };
        mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(200));
        seen = event_seq_;
        if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is stopping");
        auto it = syncs_.find(id);
        if (id == 0 || it == syncs_.end()) {
          if (id != 0) return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("no sync ", id));
          continue;  // nothing yet: wait for the next trigger
        }
        FillEvent(it->second, &e);
        finished = it->second.finished;
      }
      if (ctx->IsCancelled() || !writer->Write(e)) return grpc::Status::OK;
      if (finished) return grpc::Status::OK;
    }
  }

  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest*, v1::StatusReply* reply) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    absl::MutexLock lock(&mu_);
    reply->set_version(published_);
    reply->set_state(running_ ? "syncing" : "idle");
    reply->set_running_sync_id(running_ ? running_id_ : 0);
    reply->set_members(static_cast<uint32_t>(members_.size()));
    reply->set_trainer_ranks(static_cast<uint32_t>(trainer_->world_size()));
    reply->set_last_error(last_error_);
    return grpc::Status::OK;
  }

  grpc::Status Members(grpc::ServerContext* ctx, const v1::MembersRequest*, v1::MembersReply* reply) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
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
    return grpc::Status::OK;
  }

  grpc::Status Versions(grpc::ServerContext* ctx, const v1::VersionsRequest*, v1::VersionsReply* reply) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    absl::MutexLock lock(&mu_);
    for (const auto& v : versions_) *reply->add_versions() = v;
    return grpc::Status::OK;
  }

  grpc::Status Timings(grpc::ServerContext* ctx, const v1::TimingsRequest* req, v1::TimingsReply* reply) override {
    WSYNC_AUTHORIZE(ctx, opts_.security);
    absl::MutexLock lock(&mu_);
    const SyncRecord* found = nullptr;
    for (const auto& [id, rec] : syncs_) {
      if (!rec.finished) continue;
      if (req->version() == 0 ? (found == nullptr || rec.id > found->id) : rec.version == req->version()) found = &rec;
    }
    if (found == nullptr) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          req->version() == 0 ? "no sync has finished yet"
                                              : absl::StrCat("no finished sync for version ", req->version()));
    }
    reply->set_version(found->version);
    reply->set_sync_id(found->id);
    for (const auto& p : found->phases) {
      auto* out = reply->add_phases();
      out->set_phase(p.phase);
      out->set_seconds(p.seconds);
      out->set_bytes(p.bytes);
    }
    return grpc::Status::OK;
  }

 private:
  wsync::Gauge* Gauge(absl::string_view name, absl::string_view help) {
    static wsync::Gauge dummy;
    if (!opts_.metrics) return &dummy;
    auto g = opts_.metrics->GetGauge(name, help);
    return g.ok() ? *g : &dummy;
  }
  wsync::Counter* CounterM(absl::string_view name, absl::string_view help) {
    static wsync::Counter dummy;
    if (!opts_.metrics) return &dummy;
    auto c = opts_.metrics->GetCounter(name, help);
    return c.ok() ? *c : &dummy;
  }
  wsync::Histogram* Histogram(absl::string_view name, absl::string_view help, const Labels& labels) {
    static wsync::Histogram dummy(ExponentialBuckets(0.001, 2, 20));
    if (!opts_.metrics) return &dummy;
    auto h = opts_.metrics->GetHistogram(name, help, ExponentialBuckets(0.001, 2, 20), labels);
    return h.ok() ? *h : &dummy;
  }

  CoordinatorOptions opts_;
  TrainerSide* trainer_;
  comm::MemoryStore store_;
  std::unique_ptr<grpc::Service> store_service_;
  std::unique_ptr<grpc::Server> server_;
  std::string host_;
  std::string run_id_;  // random per coordinator: sync keys differ across restarts
  int port_ = 0;
  std::thread worker_, reaper_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, MemberInfo> members_ ABSL_GUARDED_BY(mu_);
  uint64_t next_member_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, SyncRecord> syncs_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t running_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_sync_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t published_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::VersionRecord> versions_ ABSL_GUARDED_BY(mu_);
  uint64_t event_seq_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options, TrainerSide* trainer) {
  if (trainer == nullptr) return absl::InvalidArgumentError("the coordinator needs its trainer side");
  auto impl = std::make_unique<Impl>(options, trainer);
  RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() = default;
std::string Coordinator::address() const { return impl_->address(); }
comm::MemoryStore& Coordinator::store() { return impl_->store(); }

}  // namespace wsync::trainer_agent
