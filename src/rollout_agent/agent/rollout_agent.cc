#include "rollout_agent/agent/rollout_agent.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "comm/bucket/bucket_mac.h"
#include "comm/store/store.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/failpoint.h"
#include "common/grpc_status.h"
#include "common/heap.h"
#include "common/logging.h"
#include "common/memory_space.h"
#include "common/net.h"
#include "common/status.h"
#include "engine_memory/engine_memory.h"
#include "engine_model/block_copy.h"
#include "engine_model/engine_layout.h"
#include "engine_model/loader.h"
#include "engine_model/repack.h"
#include "kernels/dispatch.h"
#include "rollout_agent/agent/engine_client.h"
#include "rollout_agent/agent/membership.h"
#include "rollout_agent/receive/recorder.h"
#include "rollout_agent/receive/stage_receiver.h"

namespace wsync::rollout_agent {
using engine_memory::EngineMemory;
using engine_memory::MapEngineMemory;

enum class RolloutAgent::Phase { kBeginning, kReceiving, kPrepared, kCommitting };

namespace {

const char* PhaseName(int p) {
  static const char* kNames[] = {"beginning", "receiving", "prepared", "committing"};
  return kNames[p];
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

// --- state ------------------------------------------------------------------------------------------

struct RolloutAgent::Engine {
  v1::RegisterEngineRequest info;  // without params
  std::string layout_key;          // equal keys: equal layouts (config, quantization, parallel)
  std::unique_ptr<engine_model::EngineLayout> layout;
  std::unique_ptr<EngineMemory> memory;
  std::unique_ptr<engine_model::Staging> staging;  // points at *layout
  std::shared_ptr<EngineClient> client;            // shared: RegisterEngine checks the engine outside op_mu_
};

struct RolloutAgent::Sync {
  v1::BeginSyncRequest req;
  uint64_t id = 0;
  uint64_t previous_version = 0;
  absl::Duration timeout;
  comm::Backend backend = comm::Backend::kGloo;
  int cuda_device = 0;                     // the GPU an NCCL sync receives on (ReceiveDevice)
  std::unique_ptr<FormationLatch> formed;  // NCCL: every stage's group formed before any receives
  SyncCancel cancel;
  std::unique_ptr<comm::GrpcStoreClient> store;
  std::unique_ptr<Recorder> recorder;
  std::unique_ptr<engine_model::Loader> loader;
  std::vector<std::thread> threads;  // touched under op_mu_ only
  // Guarded by the agent's mu_:
  Phase phase = Phase::kBeginning;
  bool engine_paused = false;
  absl::Time paused_at;      // when Pause was sent (the engine's downtime runs from here to Continue)
  int running = 0;           // receive threads not yet finished
  absl::Status first_error;  // the first stage error, or the staging's CheckComplete
  StageStats totals;         // summed over stages (transfer: the longest)
  int rpcs = 0;              // RPCs for this sync in progress (the watchdog waits while > 0)
  absl::Time idle_since;
  v1::PrepareSyncReply prepared;
};

struct RolloutAgent::Metrics {
  Counter* syncs = nullptr;
  Counter* failures = nullptr;
  Counter* bytes = nullptr;
  Counter* buckets = nullptr;
  Counter* tensors = nullptr;
  Gauge* version = nullptr;
  Gauge* active = nullptr;
  Gauge* registered = nullptr;
  std::map<std::string, Histogram*> phase;

  void Observe(const std::string& p, absl::Duration d) const {
    auto it = phase.find(p);
    if (it != phase.end()) it->second->Observe(Seconds(d));
  }
};

namespace {

template <typename T>
T* OrDie(absl::StatusOr<T*> m, const char* name) {
  if (!m.ok()) {
    WSYNC_LOG(ERROR) << "metric " << name << ": " << m.status();
    static T dummy_storage = [] {
      if constexpr (std::is_same_v<T, Histogram>)
        return T(std::vector<double>{1.0});
      else
        return T();
    }();
    return &dummy_storage;
  }
  return *m;
}

}  // namespace

// --- the gRPC service ---------------------------------------------------------------------------------

class RolloutAgent::Service final : public v1::RolloutAgent::Service {
 public:
  Service(RolloutAgent* agent, const RpcSecurity& sec) : agent_(agent), sec_(sec) {}

  grpc::Status RegisterEngine(grpc::ServerContext* ctx, const v1::RegisterEngineRequest* req,
                              v1::RegisterEngineReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->RegisterEngine(*req, reply));
  }
  grpc::Status UpdateWeights(grpc::ServerContext* ctx, const v1::UpdateWeightsRequest* req,
                             v1::UpdateWeightsReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->UpdateWeights(
        *req, Deadline(ctx), [ctx] { return ctx->IsCancelled(); }, reply));
  }
  grpc::Status BeginSync(grpc::ServerContext* ctx, const v1::BeginSyncRequest* req,
                         v1::BeginSyncReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->BeginSync(*req, reply, Deadline(ctx)));
  }
  grpc::Status PrepareSync(grpc::ServerContext* ctx, const v1::PrepareSyncRequest* req,
                           v1::PrepareSyncReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->PrepareSync(*req, Deadline(ctx), reply));
  }
  grpc::Status CommitSync(grpc::ServerContext* ctx, const v1::CommitSyncRequest* req,
                          v1::CommitSyncReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->CommitSync(*req, reply, Deadline(ctx)));
  }
  grpc::Status AbortSync(grpc::ServerContext* ctx, const v1::AbortSyncRequest* req,
                         v1::AbortSyncReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->AbortSync(*req, reply));
  }
  grpc::Status AgentStatus(grpc::ServerContext* ctx, const v1::AgentStatusRequest*,
                           v1::AgentStatusReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->AgentStatus(reply));
  }
  grpc::Status EngineChecksums(grpc::ServerContext* ctx, const v1::EngineChecksumsRequest*,
                               v1::EngineChecksumsReply* reply) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(agent_->EngineChecksums(reply));
  }
  grpc::Status FetchStaging(grpc::ServerContext* ctx, const v1::FetchStagingRequest* req,
                            grpc::ServerWriter<v1::StagingChunk>* writer) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(
        agent_->ServeStaging(*req, [&](const v1::StagingChunk& c) { return !ctx->IsCancelled() && writer->Write(c); }));
  }
  grpc::Status ReadEngine(grpc::ServerContext* ctx, const v1::ReadEngineRequest*,
                          grpc::ServerWriter<v1::EngineChunk>* writer) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(
        agent_->ReadEngine([&](const v1::EngineChunk& c) { return !ctx->IsCancelled() && writer->Write(c); }));
  }

 private:
  // The RPC's deadline, a little early so that the reply still reaches the caller in time.
  static absl::Time Deadline(const grpc::ServerContext* ctx) {
    const auto d = ctx->deadline();
    if (d >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
    return absl::FromChrono(d) - absl::Milliseconds(20);
  }
  RolloutAgent* agent_;
  const RpcSecurity sec_;
};

// --- RolloutAgent -------------------------------------------------------------------------------------

namespace {

// "pid<pid>-<random>": with the address, the agent's identity (see AgentId()).
std::string MakeAgentIdSalt() {
  std::random_device rd;
  return absl::StrCat("pid", getpid(), "-", absl::Hex(static_cast<uint32_t>(rd()), absl::kZeroPad8));
}

}  // namespace

namespace {

// AgentServer::Start resolves an empty data host to the address facing the coordinator; an agent
// built without it (tests, one machine) listens on loopback.
AgentOptions WithDataHost(AgentOptions o) {
  if (o.data_host.empty()) o.data_host = "127.0.0.1";
  return o;
}

}  // namespace

RolloutAgent::RolloutAgent(AgentOptions options)
    : options_(WithDataHost(std::move(options))), agent_id_salt_(MakeAgentIdSalt()) {
  MetricsRegistry* reg = options_.metrics;
  if (reg == nullptr) {
    own_metrics_ = std::make_unique<MetricsRegistry>();
    reg = own_metrics_.get();
  }
  m_ = std::make_unique<Metrics>();
  m_->syncs = OrDie(reg->GetCounter("wsync_rollout_syncs_total", "Syncs committed into the engine"), "syncs");
  m_->failures = OrDie(reg->GetCounter("wsync_rollout_sync_failures_total",
                                       "Syncs that failed or were aborted (the engine kept its previous version)"),
                       "failures");
  m_->bytes = OrDie(reg->GetCounter("wsync_rollout_received_bytes_total", "Bucket bytes received"), "bytes");
  m_->buckets = OrDie(reg->GetCounter("wsync_rollout_received_buckets_total", "Buckets received"), "buckets");
  m_->tensors = OrDie(reg->GetCounter("wsync_rollout_received_tensors_total", "HF tensors received"), "tensors");
  m_->version =
      OrDie(reg->GetGauge("wsync_rollout_weight_version", "The weight version in the engine's memory"), "version");
  m_->active = OrDie(reg->GetGauge("wsync_rollout_sync_active", "1 while a sync is in progress"), "active");
  m_->registered = OrDie(reg->GetGauge("wsync_rollout_engine_registered", "1 once an engine registered"), "registered");
  for (const char* p : {"pause", "flush", "join", "transfer", "load", "repack", "continue", "downtime"}) {
    m_->phase[p] = OrDie(reg->GetHistogram("wsync_rollout_phase_seconds", "Duration of each phase of a sync",
                                           ExponentialBuckets(0.001, 2.0, 20), {{"phase", p}}),
                         "phase");
  }
  service_ = std::make_unique<Service>(this, options_.security);
  if (!options_.coordinator.empty()) {
    membership_ = std::make_shared<Membership>(options_.coordinator, options_.security, options_.heartbeat);
  }
  watchdog_ = std::thread([this] { Watchdog(); });
}

RolloutAgent::~RolloutAgent() { Stop(); }

MetricsRegistry& RolloutAgent::metrics() const { return options_.metrics ? *options_.metrics : *own_metrics_; }

grpc::Service* RolloutAgent::service() { return service_.get(); }

void RolloutAgent::SetAddress(const std::string& address) {
  absl::MutexLock lock(&mu_);
  address_ = address;
}

uint64_t RolloutAgent::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

// The identity engines see: stable for the life of this process (an engine re-registers when it
// changes, i.e. when the agent restarted), whatever id the coordinator's membership gives it. The
// random part tells a restart apart even when the address and pid repeat (pid 1 in a container).
std::string RolloutAgent::AgentId() const {
  absl::MutexLock lock(&mu_);
  return absl::StrCat("agent@", address_, "/", agent_id_salt_);
}

void RolloutAgent::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  uint64_t v = 0;
  absl::Status s = AbortById(0, "the rollout agent is shutting down", &v);
  if (!s.ok()) WSYNC_LOG(ERROR) << "shutting down: " << s;
  absl::MutexLock op(&op_mu_);  // RegisterEngine and CommitSync use membership_ under op_mu_
  membership_.reset();
}

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

absl::Status RolloutAgent::CommitStaging(Engine& e, uint64_t version) {
  absl::MutexLock mem(&memory_mu_);
  absl::Status st =
      engine_model::Commit(*e.staging, e.memory->weights(), {.num_threads = options_.repack_threads, .verify = false});
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    version_ = version;  // wakes UpdateWeights waiters
  }
  return st;
}

void RolloutAgent::CatchUp() {
  absl::MutexLock op(&op_mu_);
  uint64_t owed = 0, current = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || sync_ != nullptr || engine_ == nullptr || owed_version_ <= version_) return;
    owed = owed_version_;
    current = version_;
  }
  Engine& e = *engine_;
  const std::string who = absl::StrCat("rolling forward to version ", owed, " (from ", current, ")");
  auto retry_later = [&](const absl::Status& st) {
    absl::MutexLock lock(&mu_);
    const int n = catch_up_failures_++;
    next_catch_up_ = absl::Now() + std::min(absl::Seconds(1) * (1 << std::min(n, 4)), absl::Seconds(10));
    if (n % 10 == 0) WSYNC_LOG(WARNING) << who << ": " << st << " (retrying; attempt " << n + 1 << ")";
  };
  auto paused = e.client->Pause(v1::PauseRequest::HOLD);
  if (!paused.ok()) return retry_later(paused.status());
  auto flushed = e.client->Flush(absl::Now() + options_.flush_deadline, [] { return false; });
  absl::Status st = flushed.status();
  if (st.ok()) st = CommitStaging(e, owed);
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    owed_version_ = 0;
    catch_up_failures_ = 0;
    if (promised_version_ <= owed) promised_version_ = 0;
  }
  if (!st.ok()) {
    if (absl::IsInternal(st)) {  // possibly partly written: the engine stays paused, the next try rewrites it
      WSYNC_LOG(ERROR) << who << ": the commit failed after validation; the engine stays paused: " << st;
      return retry_later(st);
    }
    auto cont = e.client->Continue(current);
    if (!cont.ok())
      WSYNC_LOG(ERROR) << who << ": continuing the engine on version " << current << ": " << cont.status();
    return retry_later(st);
  }
  m_->version->Set(static_cast<double>(owed));
  if (membership_) membership_->SetVersion(owed);
  auto cont = e.client->Continue(owed);
  if (!cont.ok()) {
    WSYNC_LOG(ERROR) << who << ": committed, but the engine did not continue: " << cont.status();
    return;
  }
  WSYNC_LOG(INFO) << who << ": committed from the staging; the engine serves version " << owed
                  << " as the other engines do";
}

// --- Catch-up from a peer ---------------------------------------------------------------------------

namespace {

constexpr size_t kStagingChunk = size_t{1} << 20;  // well under gRPC's 4 MiB message limit

uint64_t HashOf(const std::string& key) {
  return Xxh3_64(std::as_bytes(std::span<const char>(key.data(), key.size())));
}

}  // namespace

std::string LayoutKey(const v1::RegisterEngineRequest& req) {
  return absl::StrCat(req.model_config_json(), "\n--\n", req.quantization_config_json(), "\n--\n", req.tp_size(), "/",
                      req.tp_rank(), "/", std::max<uint32_t>(req.ep_size(), 1));
}

uint64_t LayoutKeyHash(const v1::RegisterEngineRequest& req) { return HashOf(LayoutKey(req)); }

absl::Status RolloutAgent::ServeStaging(const v1::FetchStagingRequest& req,
                                        const std::function<bool(const v1::StagingChunk&)>& write) {
  absl::ReaderMutexLock staging(&staging_mu_);
  const engine_model::Staging* st = nullptr;
  std::string who;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("FetchStaging: the rollout agent is shutting down");
    if (engine_ == nullptr) return absl::FailedPreconditionError("FetchStaging: no engine has registered here");
    const v1::RegisterEngineRequest& info = engine_->info;
    who = absl::StrCat("FetchStaging(version ", req.version(), ") from engine ", info.engine_id(), " tp ",
                       info.tp_rank(), "/", info.tp_size(), " ep ", info.ep_size());
    if (HashOf(engine_->layout_key) != req.layout_key())
      return absl::FailedPreconditionError(absl::StrCat(
          who, ": the caller's engine rank has another layout (model config, quantization, TP rank / size, EP)"));
    if (staged_version_ != req.version() || version_ != req.version())
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": the staging holds ",
                       staged_version_ == 0 ? "no complete version" : absl::StrCat("version ", staged_version_),
                       " and the engine version ", version_));
    st = engine_->staging.get();
    if (st == nullptr) return absl::UnavailableError(absl::StrCat(who, ": the engine is being replaced"));
  }
  // The staging cannot change while staging_mu_ is held (a sync starting takes it exclusively).
  // A device staging's chunks are copied to the host one at a time.
  const auto& params = st->layout().params();
  const MemorySpace& space = st->space();
  Buffer host_chunk;
  if (!space.host()) {
    ASSIGN_OR_RETURN(host_chunk, Buffer::Allocate(kStagingChunk));
  }
  v1::StagingChunk c;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::span<const std::byte> bytes = st->param(static_cast<int>(i)).bytes();
    Xxh3Stream sum;
    size_t off = 0;
    do {
      const size_t n = std::min(kStagingChunk, bytes.size() - off);
      std::span<const std::byte> chunk = bytes.subspan(off, n);
      if (!space.host()) {
        RETURN_IF_ERROR(Annotate(space.CopyToHost(host_chunk.data(), chunk.data(), n),
                                 absl::StrCat(who, ": reading the staging in ", space.Name())));
        chunk = host_chunk.span().first(n);
      }
      c.Clear();
      c.set_param(static_cast<uint32_t>(i));
      c.set_offset(off);
      c.set_data(chunk.data(), n);
      sum.Update(chunk);
      off += n;
      if (off == bytes.size()) {
        c.set_param_done(true);
        c.set_xxh3_64(sum.Digest());
      }
      if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
    } while (off < bytes.size());
  }
  c.Clear();
  c.set_last(true);
  c.set_version(req.version());
  if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
  return absl::OkStatus();
}

absl::Status RolloutAgent::ReadEngine(const std::function<bool(const v1::EngineChunk&)>& write) {
  absl::ReaderMutexLock mem(&memory_mu_);  // no commit while the engine is read: one version
  uint64_t version = 0;
  std::string who;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("ReadEngine: the rollout agent is shutting down");
    if (engine_ == nullptr) return absl::FailedPreconditionError("ReadEngine: no engine has registered here");
    version = version_;
    who = absl::StrCat("ReadEngine of engine ", engine_->info.engine_id(), " tp ", engine_->info.tp_rank());
  }
  // engine_ cannot change while memory_mu_ is held. Device params are copied to the host a chunk at
  // a time.
  const std::vector<engine_model::EngineBuffer>& buffers = engine_->memory->weights().buffers();
  Buffer host_chunk;
  v1::EngineChunk c;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const engine_model::EngineBuffer& b = buffers[i];
    const MemorySpace space = b.on_device() ? MemorySpace::Cuda(b.cuda_device) : MemorySpace::Host();
    if (!space.host() && host_chunk.size() == 0) {
      ASSIGN_OR_RETURN(host_chunk, Buffer::Allocate(kStagingChunk));
    }
    size_t off = 0;
    do {
      const size_t n = std::min(kStagingChunk, b.nbytes - off);
      const std::byte* src = static_cast<const std::byte*>(b.data) + off;
      if (!space.host()) {
        RETURN_IF_ERROR(Annotate(space.CopyToHost(host_chunk.data(), src, n),
                                 absl::StrCat(who, ": reading ", b.name, " in ", space.Name())));
        src = host_chunk.data();
      }
      c.Clear();
      c.set_param(static_cast<uint32_t>(i));
      if (off == 0) {
        c.set_name(b.name);
        c.set_dtype(std::string(SafetensorsName(b.dtype)));
        for (int64_t d : b.shape) c.add_shape(d);
        c.set_nbytes(b.nbytes);
      }
      c.set_offset(off);
      c.set_data(src, n);
      c.set_version(version);
      off += n;
      if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
    } while (off < b.nbytes);
  }
  c.Clear();
  c.set_last(true);
  c.set_version(version);
  if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
  return absl::OkStatus();
}

absl::Status RolloutAgent::FetchFrom(const std::string& peer, uint64_t version, Engine& e) {
  const std::string who = absl::StrCat("copying version ", version, " from the rollout agent at ", peer);
  engine_model::Staging& st = *e.staging;
  const auto& params = st.layout().params();
  const int64_t total = e.layout->TotalBytes(engine_model::ParamForm::kLoaded);
  auto stub = v1::RolloutAgent::NewStub(MakeChannel(peer, options_.security));
  grpc::ClientContext ctx;
  // Generous: a gRPC stream moves >= 0.5 GB/s even on a slow host.
  PrepareContext(&ctx, options_.security, absl::Seconds(30) + absl::Seconds(static_cast<double>(total) / 5e8));
  v1::FetchStagingRequest req;
  req.set_version(version);
  req.set_layout_key(HashOf(e.layout_key));
  absl::MutexLock staging(&staging_mu_);
  {
    absl::MutexLock lock(&mu_);
    staged_sync_id_ = staged_version_ = 0;  // the staging is being overwritten
    fetch_ctx_ = &ctx;                      // a BeginSync cancels the copy (it will write the staging)
  }
  struct Unregister {
    RolloutAgent* agent;
    ~Unregister() {
      absl::MutexLock lock(&agent->mu_);
      agent->fetch_ctx_ = nullptr;
    }
  } unregister{this};
  std::unique_ptr<grpc::ClientReader<v1::StagingChunk>> reader = stub->FetchStaging(&ctx, req);
  // Each param's chunks are hashed as they arrive and copied into the staging's space (a device
  // staging: uploaded, then waited for once at the end).
  const MemorySpace& space = st.space();
  std::vector<uint64_t> got(params.size(), 0);
  std::vector<bool> param_done(params.size(), false);
  Xxh3Stream sum;
  size_t done = 0;
  bool last = false;
  absl::Status bad;
  v1::StagingChunk c;
  while (bad.ok() && !last && reader->Read(&c)) {
    if (c.last()) {
      last = c.version() == version;
      if (!last) bad = absl::DataLossError(absl::StrCat("the copy ended with version ", c.version()));
      break;
    }
    if (c.param() >= params.size()) {
      bad = absl::DataLossError(absl::StrCat("chunk of param ", c.param(), " of ", params.size()));
      break;
    }
    if (param_done[c.param()]) {
      bad = absl::DataLossError(absl::StrCat("a chunk of ", params[c.param()].name, " after its last one"));
      break;
    }
    const std::span<std::byte> dst = st.param(static_cast<int>(c.param())).bytes();
    uint64_t& at = got[c.param()];
    if (c.offset() != at || c.data().size() > dst.size() - at) {
      bad = absl::DataLossError(absl::StrCat("chunk at ", c.offset(), " of ", c.data().size(), " bytes of ",
                                             params[c.param()].name, " (", dst.size(), " bytes, ", at, " received)"));
      break;
    }
    if (at == 0) sum = Xxh3Stream();
    const auto data = std::as_bytes(std::span<const char>(c.data().data(), c.data().size()));
    if (absl::Status cp = space.Copy(dst.data() + at, data.data(), data.size()); !cp.ok()) {
      bad = Annotate(cp, absl::StrCat(params[c.param()].name, " into the staging in ", space.Name()));
      break;
    }
    sum.Update(data);
    at += c.data().size();
    if (c.param_done()) {
      if (at != dst.size()) {
        bad = absl::DataLossError(absl::StrCat(params[c.param()].name, ": ", at, " of ", dst.size(), " bytes"));
      } else if (sum.Digest() != c.xxh3_64()) {
        bad = absl::DataLossError(absl::StrCat(params[c.param()].name, ": checksum mismatch"));
      } else {
        param_done[c.param()] = true;
        ++done;
      }
    }
  }
  if (!bad.ok()) ctx.TryCancel();
  const absl::Status finished = FromGrpcStatus(reader->Finish());
  if (!bad.ok()) return Annotate(bad, who);
  if (!finished.ok()) return Annotate(finished, who);
  if (!last || done != params.size())
    return absl::DataLossError(absl::StrCat(who, ": the copy ended after ", done, " of ", params.size(), " params"));
  RETURN_IF_ERROR(Annotate(st.Synchronize(), absl::StrCat(who, ": into the staging in ", space.Name())));
  st.MarkAllRestored();
  absl::MutexLock lock(&mu_);
  staged_version_ = version;  // complete and verified: owed to the engine, and servable to others
  owed_version_ = version;
  next_catch_up_ = absl::Now();
  catch_up_failures_ = 0;
  return absl::OkStatus();
}

void RolloutAgent::FetchFromPeers(const v1::CatchUpHint& hint) {
  absl::MutexLock op(&op_mu_);
  uint64_t current = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || sync_ != nullptr || engine_ == nullptr || hint.version() <= version_) return;
    current = version_;
  }
  Engine& e = *engine_;
  const absl::Time start = absl::Now();
  std::vector<std::string> errors;
  for (const std::string& peer : hint.peers()) {
    absl::Status st = FetchFrom(peer, hint.version(), e);
    if (st.ok()) {
      const double s = absl::ToDoubleSeconds(absl::Now() - start);
      const int64_t bytes = e.layout->TotalBytes(engine_model::ParamForm::kLoaded);
      WSYNC_LOG(INFO) << "copied version " << hint.version() << " from the rollout agent at " << peer << ": " << bytes
                      << " bytes in " << absl::StrFormat("%.2f s (%.2f GB/s)", s, s > 0 ? bytes / s / 1e9 : 0.0)
                      << "; committing it into the engine";
      absl::MutexLock lock(&mu_);
      fetch_failures_ = 0;
      return;
    }
    errors.push_back(st.ToString());
  }
  if (hint.peers().empty()) errors.push_back("no agent of an engine rank with this layout reports that version");
  uint64_t promised = 0;
  {
    absl::MutexLock lock(&mu_);
    const int n = fetch_failures_++;
    next_fetch_ = absl::Now() + std::min(absl::Seconds(1) * (1 << std::min(n, 4)), absl::Seconds(10));
    if (n % 10 == 0)
      WSYNC_LOG(WARNING) << "catching up to version " << hint.version() << " from a peer failed (attempt " << n + 1
                         << "; retrying): " << absl::StrJoin(errors, "; ");
    std::swap(promised, promised_version_);
  }
  if (promised > 0) {  // the engine holds requests for it: let it serve what it has meanwhile
    auto cont = e.client->Continue(current);
    if (!cont.ok()) WSYNC_LOG(ERROR) << "continuing the engine on version " << current << ": " << cont.status();
  }
}

// --- RegisterEngine -----------------------------------------------------------------------------------

absl::Status RolloutAgent::RegisterEngine(const v1::RegisterEngineRequest& req, v1::RegisterEngineReply* reply) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the rollout agent is shutting down");
  }
  const std::string who =
      absl::StrCat("RegisterEngine(engine \"", req.engine_id(), "\", tp rank ", req.tp_rank(), "/", req.tp_size(), ")");
  ASSIGN_OR_RETURN(Registered r, InstallEngine(req, who));
  // What follows waits on the coordinator and the engine, so it runs without op_mu_: an engine that
  // stops answering here (it hangs, or is stopped right after it asked) must not hold a BeginSync
  // that the coordinator sends meanwhile for the engine RPC timeout.
  uint64_t promise = r.catch_up ? r.staged : 0;  // RegisterEngineReply.catch_up_version
  // A restarted agent: the coordinator's answer says whether a peer can give the engine the
  // published version; if so the engine may hold requests until it is committed.
  if (r.membership && !r.catch_up && r.membership->AwaitJoined(absl::Seconds(2))) {
    const v1::CatchUpHint hint = r.membership->catch_up();
    if (hint.version() > req.version() && hint.peers_size() > 0) {
      absl::MutexLock lock(&mu_);
      // Not replaced meanwhile, and no sync has started or committed that version since (the
      // engine would hold requests for a version it is not going to be given).
      if (engine_ != nullptr && engine_->client == r.client && sync_ == nullptr && version_ < hint.version()) {
        promise = hint.version();
        promised_version_ = promise;
        next_fetch_ = absl::Now();
        fetch_failures_ = 0;
        WSYNC_LOG(INFO) << "the fleet serves version " << promise << ": copying it from a peer (" << hint.peers(0)
                        << (hint.peers_size() > 1 ? absl::StrCat(" or ", hint.peers_size() - 1, " other(s)") : "")
                        << ") for the engine";
      }
    }
  }
  reply->set_agent_id(AgentId());
  if (promise > 0) {
    reply->set_catch_up_version(promise);
    return absl::OkStatus();
  }
  // An engine left paused by an agent that died mid-commit (it re-registers with this one) must not
  // stay paused. Continue only while no sync runs (one may pause the engine itself), the engine was
  // not replaced and no commit changed its version since; it answered Health just now, so Continue
  // is prompt.
  auto health = r.client->Health();
  if (!health.ok() || health->state() != v1::HealthReply::PAUSED) return absl::OkStatus();
  absl::MutexLock op(&op_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (sync_ != nullptr || engine_ == nullptr || engine_->client != r.client || version_ != req.version())
      return absl::OkStatus();
  }
  auto cont = r.client->Continue(req.version());
  if (cont.ok())
    WSYNC_LOG(WARNING) << who << ": the engine was paused (by an earlier agent that stopped?): continued on version "
                       << *cont;
  else
    WSYNC_LOG(WARNING) << who << ": continuing the paused engine on version " << req.version() << ": " << cont.status();
  return absl::OkStatus();
}

absl::StatusOr<RolloutAgent::Registered> RolloutAgent::InstallEngine(const v1::RegisterEngineRequest& req,
                                                                     const std::string& who) {
  absl::MutexLock op(&op_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (sync_ != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("RegisterEngine: sync ", sync_->id, " is in progress; register again once it has ended"));
    }
  }
  const uint32_t ep = req.ep_size() == 0 ? 1 : req.ep_size();
  if (req.tp_size() == 0 || req.tp_rank() >= req.tp_size()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": tp_rank must lie in [0, tp_size)"));
  }
  if (req.engine_address().empty()) return absl::InvalidArgumentError(absl::StrCat(who, ": no engine_address"));
  if (req.params_size() == 0) return absl::InvalidArgumentError(absl::StrCat(who, ": no params"));

  auto config = ParseModelConfig(req.model_config_json(), "RegisterEngineRequest.model_config_json");
  if (!config.ok()) return Annotate(config.status(), who);
  std::optional<QuantizationConfig> quant;
  if (!req.quantization_config_json().empty()) {
    auto q = ParseQuantizationConfig(req.quantization_config_json(), "RegisterEngineRequest.quantization_config_json");
    if (!q.ok()) return Annotate(q.status(), who);
    quant = std::move(*q);
  }
  const std::string key = LayoutKey(req);
  const bool reuse = engine_ != nullptr && engine_->layout_key == key;
  std::unique_ptr<engine_model::EngineLayout> new_layout;
  if (!reuse) {
    auto layout = engine_model::EngineLayout::Create(
        *config, quant ? &*quant : nullptr,
        {static_cast<int>(req.tp_size()), static_cast<int>(req.tp_rank()), static_cast<int>(ep)});
    if (!layout.ok()) return Annotate(layout.status(), who);
    new_layout = std::make_unique<engine_model::EngineLayout>(std::move(*layout));
  }
  const engine_model::EngineLayout& layout = reuse ? *engine_->layout : *new_layout;
  auto memory = MapEngineMemory(req.params());
  if (!memory.ok()) return Annotate(memory.status(), who);
  absl::Status match = (*memory)->weights().CheckMatches(layout);
  if (!match.ok()) {
    return Annotate(match, absl::StrCat(who, ": the engine's params are not the ", config->architecture,
                                        " engine layout at TP rank ", req.tp_rank(), "/", req.tp_size(), ", EP ", ep,
                                        quant ? " (INT4)" : " (bf16)"));
  }

  // --staging device: the staging goes to the GPU that holds every one of the engine's params.
  MemorySpace staging_space = MemorySpace::Host();
  if (options_.device_staging) {
    const engine_model::EngineWeights& w = (*memory)->weights();
    const int dev = w.buffers().empty() ? -1 : w.buffers().front().cuda_device;
    for (const engine_model::EngineBuffer& b : w.buffers()) {
      if (b.cuda_device != dev || dev < 0)
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": this agent keeps its staging on the engine's GPU (--staging device), but engine param ", b.name,
            " is in ", b.on_device() ? MemorySpace::Cuda(b.cuda_device).Name() : "host memory",
            dev >= 0 ? absl::StrCat(" and ", w.buffers().front().name, " in ", MemorySpace::Cuda(dev).Name()) : "",
            ": a device staging needs every param on one CUDA device"));
    }
    if (options_.cuda_device >= 0 && options_.cuda_device != dev)
      return absl::InvalidArgumentError(absl::StrCat(who, ": the engine's params are in ",
                                                     MemorySpace::Cuda(dev).Name(),
                                                     ", but NCCL syncs are received on --cuda-device ",
                                                     options_.cuda_device, ", and a device staging loads in place"));
    staging_space = MemorySpace::Cuda(dev);
  }
  // A kept staging stays only where the new one would be (the engine's GPU may have changed).
  const bool keep_staging = reuse && engine_->staging->space() == staging_space;

  auto engine = std::make_unique<Engine>();
  engine->info = req;
  engine->info.clear_params();
  engine->info.set_ep_size(ep);
  engine->layout_key = key;
  engine->memory = std::move(*memory);
  engine->client = std::make_shared<EngineClient>(req.engine_address(), options_.security,
                                                  EngineClientOptions{options_.engine_rpc_timeout});
  engine->layout = reuse ? std::move(engine_->layout) : std::move(new_layout);
  if (keep_staging) {
    engine->staging = std::move(engine_->staging);
  } else {
    // Drop the previous engine's staging before allocating the new one (peak memory: one staging).
    if (engine_ != nullptr) {
      absl::MutexLock staging(&staging_mu_);
      absl::MutexLock mem(&memory_mu_);
      absl::MutexLock lock(&mu_);
      engine_.reset();
      m_->registered->Set(0);
    }
    auto staging = engine_model::Staging::Create(*engine->layout, staging_space);
    if (!staging.ok())
      return Annotate(staging.status(),
                      absl::StrCat(who, ": allocating the staging buffers (", staging_space.Name(), ")"));
    engine->staging = std::move(*staging);
  }
  // A CUDA engine: page-lock the staging so that Commit's uploads run at the link's speed (H200,
  // docs/results/h200/2026-11-28-8a0d3c4/bench_repack.log: 50.21 vs 9.06 GB/s). Failing to pin costs speed, not
  // correctness.
  const size_t device_params = engine->memory->device_params();
  if (device_params > 0 && !engine->staging->pinned()) {
    if (absl::Status pin = engine->staging->PinForDevice(); !pin.ok())
      WSYNC_LOG(WARNING) << who << ": staging stays pageable (commits upload more slowly): " << pin;
  }
  const int64_t staging_bytes = engine->layout->TotalBytes(engine_model::ParamForm::kLoaded);
  const std::string staging_where = engine->staging->space().Name();
  const uint64_t param_bytes = engine->memory->param_bytes();
  const size_t segments = engine->memory->segments().size();
  std::string address;
  bool catch_up = false;
  uint64_t staged = 0;
  {
    absl::MutexLock staging(&staging_mu_);
    absl::MutexLock mem(&memory_mu_);
    absl::MutexLock lock(&mu_);
    engine_ = std::move(engine);
    // The same engine rank restarted (same layout, so the staging was kept) behind the version the
    // staging holds, complete and verified, and that this agent had committed or was told to roll
    // forward to: commit it into the new memory (CatchUp) instead of waiting for the next sync.
    staged = staged_version_;
    catch_up = keep_staging && staged > req.version() && (staged == version_ || staged == owed_version_);
    if (catch_up) {
      owed_version_ = staged;
      next_catch_up_ = absl::Now();
      catch_up_failures_ = 0;
    } else {
      staged_sync_id_ = staged_version_ = 0;  // a new staging for the new engine
      owed_version_ = 0;
    }
    version_ = req.version();
    address = options_.advertise_address.empty() ? address_ : options_.advertise_address;
  }
  m_->registered->Set(1);
  m_->version->Set(static_cast<double>(req.version()));
  if (options_.set_log_identity) SetLogIdentity("rollout", static_cast<int>(req.tp_rank()));
  WSYNC_LOG(INFO) << "registered engine \"" << req.engine_id() << "\" at " << req.engine_address() << ": "
                  << config->architecture << (quant ? " INT4" : " bf16") << ", tp " << req.tp_rank() << "/"
                  << req.tp_size() << ", ep " << ep << ", version " << req.version() << ", " << req.params_size()
                  << " params (" << param_bytes << " bytes in " << segments << " shm segment(s), " << device_params
                  << " on a CUDA device); staging " << staging_bytes << " bytes in " << staging_where
                  << (keep_staging ? " (kept)" : "")
                  << (catch_up ? absl::StrCat("; it holds version ", staged, ": catching the engine up to it") : "");
  Registered r;
  r.client = engine_->client;
  r.catch_up = catch_up;
  r.staged = staged;
  if (membership_) {
    v1::JoinRequest join;
    join.set_agent_address(address);
    join.set_engine_id(req.engine_id());
    join.set_tp_rank(req.tp_rank());
    join.set_tp_size(req.tp_size());
    join.set_ep_size(static_cast<uint32_t>(ep));
    join.set_version(req.version());
    join.set_quantization_config_json(req.quantization_config_json());
    membership_->Update(join);
    r.membership = membership_;
  }
  return r;
}

// --- UpdateWeights / AgentStatus ----------------------------------------------------------------------

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

absl::Status RolloutAgent::AgentStatus(v1::AgentStatusReply* reply) {
  reply->set_agent_id(AgentId());
  absl::MutexLock lock(&mu_);
  reply->set_version(version_);
  if (engine_ != nullptr) {
    reply->set_engine_id(engine_->info.engine_id());
    reply->set_tp_rank(engine_->info.tp_rank());
    reply->set_tp_size(engine_->info.tp_size());
  }
  if (engine_ == nullptr) {
    reply->set_state("no_engine");
  } else if (sync_ == nullptr) {
    reply->set_state("idle");
  } else if (sync_->phase == Phase::kPrepared || sync_->phase == Phase::kCommitting) {
    reply->set_state("prepared");
  } else {
    reply->set_state("receiving");
  }
  return absl::OkStatus();
}

absl::Status RolloutAgent::EngineChecksums(v1::EngineChecksumsReply* reply) {
  absl::ReaderMutexLock mem(&memory_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (engine_ == nullptr) return absl::FailedPreconditionError("EngineChecksums: no engine has registered yet");
    const v1::RegisterEngineRequest& info = engine_->info;
    reply->set_engine_id(info.engine_id());
    reply->set_tp_size(info.tp_size());
    reply->set_tp_rank(info.tp_rank());
    reply->set_ep_size(info.ep_size());
    reply->set_model_config_json(info.model_config_json());
    reply->set_quantization_config_json(info.quantization_config_json());
    reply->set_version(version_);
  }
  // engine_ cannot change while memory_mu_ is held.
  const std::vector<engine_model::EngineBuffer>& buffers = engine_->memory->weights().buffers();
  ASSIGN_OR_RETURN(const std::vector<uint64_t> sums, engine_->memory->weights().Checksums());
  for (size_t i = 0; i < buffers.size(); ++i) {
    v1::ParamChecksum* p = reply->add_params();
    p->set_name(buffers[i].name);
    p->set_xxh3_64(sums[i]);
    p->set_nbytes(buffers[i].nbytes);
  }
  return absl::OkStatus();
}

// --- BeginSync ----------------------------------------------------------------------------------------

// The coordinator run a sync belongs to: the run id of its sync_key ("<run id>-<sync id>"; "" from
// a coordinator that sends none).
std::string RolloutAgent::SyncRun(const v1::BeginSyncRequest& req) {
  const std::string& key = req.sync_key();
  const size_t dash = key.rfind('-');
  return dash == std::string::npos ? std::string() : key.substr(0, dash);
}

absl::Status RolloutAgent::CheckBegin(const v1::BeginSyncRequest& req, bool* duplicate, v1::BeginSyncReply* reply) {
  *duplicate = false;
  if (stopping_) return absl::UnavailableError("the rollout agent is shutting down");
  if (sync_ != nullptr) {
    if (sync_->id == req.sync_id()) {
      if (sync_->phase == Phase::kBeginning) return absl::OkStatus();  // the first call is still pausing: wait for it
      *duplicate = true;
      reply->set_previous_version(sync_->previous_version);
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginSync ", req.sync_id(), ": sync ", sync_->id, " is ", PhaseName(static_cast<int>(sync_->phase)),
        sync_->first_error.ok() ? "" : " (failed, waiting for AbortSync)", "; one sync at a time"));
  }
  if (req.sync_id() == 0) return absl::InvalidArgumentError("BeginSync: sync_id 0 is reserved");
  if (req.sync_id() == last_sync_id_ && SyncRun(req) == last_sync_run_) {
    return absl::FailedPreconditionError(
        absl::StrCat("BeginSync ", req.sync_id(), ": that sync already ended (",
                     last_committed_ ? "committed" : absl::StrCat("failed: ", last_outcome_.message()), ")"));
  }
  if (engine_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("BeginSync ", req.sync_id(), ": no engine has registered yet"));
  }
  if (req.version() <= version_) {
    return absl::FailedPreconditionError(absl::StrCat("BeginSync ", req.sync_id(), ": version ", req.version(),
                                                      " is not newer than the engine's version ", version_));
  }
  return absl::OkStatus();
}

absl::Status RolloutAgent::BeginSync(const v1::BeginSyncRequest& req, v1::BeginSyncReply* reply, absl::Time deadline) {
  FailpointHit("rollout.begin");  // system tests (common/failpoint.h)
  bool duplicate = false;
  uint64_t stale = 0;  // a sync this newer one supersedes
  std::string stale_phase;
  {
    absl::MutexLock lock(&mu_);
    // A newer sync of the same coordinator, or any sync of another one (its run id differs: a
    // restarted trainer job numbers syncs on from its state file, or from 1 without one).
    if (sync_ != nullptr && (req.sync_id() > sync_->id || SyncRun(req) != SyncRun(sync_->req)) &&
        sync_->phase != Phase::kCommitting) {
      stale = sync_->id;
      stale_phase = PhaseName(static_cast<int>(sync_->phase));
    } else {
      RETURN_IF_ERROR(CheckBegin(req, &duplicate, reply));
      if (duplicate) return absl::OkStatus();
    }
  }
  if (stale != 0) {
    // The coordinator runs one sync at a time, so a newer sync means it is done with the older one:
    // its AbortSync was lost, or the coordinator is a restarted one (its trainer job died mid-sync:
    // then the sync comes from another run, whatever its id).
    // End the old sync now (the engine was not written: it keeps its version) rather than refuse
    // syncs until the old one's timeout passes. A sync that is committing is never superseded.
    const std::string reason =
        absl::StrCat("superseded by sync ", req.sync_id(), " (version ", req.version(), ") while ", stale_phase);
    WSYNC_LOG(WARNING) << "sync " << stale << ": " << reason;
    uint64_t version = 0;
    RETURN_IF_ERROR(Annotate(AbortById(stale, reason, &version),
                             absl::StrCat("BeginSync ", req.sync_id(), ": ending sync ", stale)));
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckBegin(req, &duplicate, reply));
    if (duplicate) return absl::OkStatus();
  }
  {
    // A copy of a version from a peer (catch-up) holds op_mu_ for as long as it streams: the sync
    // rewrites the staging anyway, so the copy ends now instead of holding this BeginSync.
    absl::MutexLock lock(&mu_);
    if (fetch_ctx_ != nullptr) {
      WSYNC_LOG(INFO) << "BeginSync " << req.sync_id() << ": cancelling the copy from a peer in progress";
      fetch_ctx_->TryCancel();
    }
  }
  absl::MutexLock op(&op_mu_);
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckBegin(req, &duplicate, reply));
    if (duplicate) return absl::OkStatus();
  }
  return StartSync(req, reply, deadline);
}

absl::Status RolloutAgent::StartSync(const v1::BeginSyncRequest& req, v1::BeginSyncReply* reply, absl::Time deadline) {
  const std::string who = absl::StrCat("BeginSync ", req.sync_id(), " (version ", req.version(), ")");
  auto backend = comm::ParseBackend(req.backend());
  if (!backend.ok()) return Annotate(backend.status(), who);
  if (*backend != comm::Backend::kGloo && *backend != comm::Backend::kShm && *backend != comm::Backend::kNccl)
    return absl::InvalidArgumentError(absl::StrCat(who, ": backend ", req.backend(), " (gloo, shm or nccl)"));
  if (*backend == comm::Backend::kNccl && !comm::BackendCompiledIn(comm::Backend::kNccl))
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": backend nccl, and this agent was built without NCCL (receive with gloo)"));
  if (*backend == comm::Backend::kNccl && !kernels::GpuAvailable())
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     ": backend nccl receives into GPU memory, and this host has no CUDA device (receive with "
                     "gloo)"));
  if (*backend == comm::Backend::kNccl && ReceiveDevice() < 0)
    return absl::FailedPreconditionError(absl::StrCat(
        who,
        ": backend nccl receives on this agent's GPU, and none is known: the engine's parameters are not in "
        "CUDA memory; start the agent with --cuda-device N (each agent of a host on its own GPU)"));
  if (req.groups_size() == 0) return absl::InvalidArgumentError(absl::StrCat(who, ": no groups"));
  if (!req.bucket_mac_key().empty() && req.bucket_mac_key().size() != comm::kBucketMacKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": a ", req.bucket_mac_key().size(), "-byte bucket key (",
                                                   comm::kBucketMacKeyBytes, " or none)"));
  }
  if (req.bucket_mac_key().empty() && options_.require_bucket_mac) {
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     ": this agent accepts only authenticated buckets (--bucket-mac), and the sync has no "
                     "bucket key: start the trainer agents with --bucket-mac on (or a token)"));
  }
  if (req.store_address().empty()) return absl::InvalidArgumentError(absl::StrCat(who, ": no store_address"));
  absl::flat_hash_set<std::string> names;
  absl::flat_hash_set<uint32_t> stages;
  for (const v1::SyncGroup& g : req.groups()) {
    if (g.name().empty() || !names.insert(g.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": group names must be non-empty and distinct (\"", g.name(), "\")"));
    }
    // Sharded delivery sends a stage over several streams (one per sender); a recording names its
    // files by stage and bucket index, so a recorded sync has one stream per stage.
    if (!stages.insert(g.pp_stage()).second && req.record()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": two groups for pipeline stage ", g.pp_stage(), " in a recorded sync"));
    }
    if (g.size() < 2 || req.agent_rank() < 1 || req.agent_rank() >= g.size()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": agent_rank ", req.agent_rank(), " does not fit group \"",
                                                     g.name(), "\" of size ", g.size(),
                                                     " (rank 0 is the stage source)"));
    }
  }

  Sync* s = nullptr;
  {
    absl::MutexLock staging(&staging_mu_);  // a peer's copy of the staging in progress ends first
    auto sync = std::make_unique<Sync>();
    sync->req = req;
    sync->id = req.sync_id();
    sync->backend = *backend;
    sync->cuda_device = ReceiveDevice();
    sync->formed = std::make_unique<FormationLatch>(req.groups_size());
    sync->timeout = req.timeout_ms() > 0 ? absl::Milliseconds(req.timeout_ms()) : options_.default_sync_timeout;
    sync->rpcs = 1;
    absl::MutexLock lock(&mu_);
    sync->previous_version = version_;
    sync_ = std::move(sync);
    staged_sync_id_ = staged_version_ = 0;  // the staging is being overwritten
    owed_version_ = 0;                      // this newer sync brings the engine forward
    s = sync_.get();
  }
  m_->active->Set(1);
  Engine& e = *engine_;
  auto fail = [&](const absl::Status& st) {
    // Continue if the engine was asked to pause, even if Pause itself failed: it may have paused.
    absl::Status cont = EndFailedSync(s, std::string(st.message()), s->engine_paused);
    absl::Status out = Annotate(st, who);
    if (!cont.ok()) out = Annotate(out, absl::StrCat("[and continuing the engine failed too: ", cont.message(), "]"));
    return out;
  };
  std::string paused_note = "the engine keeps serving until the commit";
  if (options_.pause_whole_sync) {
    auto paused = PauseEngine(s, deadline);
    if (!paused.ok()) return fail(paused.status());
    paused_note = *paused;
  }

  e.staging->ResetCoverage();
  if (req.record() && !options_.record_dir.empty()) {
    // An older coordinator sends no key: the store address and sync id then name the sync.
    std::string key = req.sync_key();
    if (key.empty()) key = absl::StrReplaceAll(absl::StrCat(req.store_address(), "-", req.sync_id()), {{"/", "_"}});
    auto rec = Recorder::Start(options_.record_dir, req.version(), key);
    if (!rec.ok()) return fail(rec.status());
    s->recorder = std::move(*rec);
  } else if (req.record()) {
    WSYNC_LOG(DEBUG) << who << ": the sync asks for a recording, but this agent has no --record-dir";
  }
  s->store = comm::GrpcStoreClient::Connect(req.store_address(), absl::Seconds(30), options_.security);
  s->loader = std::make_unique<engine_model::Loader>(e.staging.get());
  {
    absl::MutexLock lock(&mu_);
    s->phase = Phase::kReceiving;
    s->running = req.groups_size();
  }
  for (int i = 0; i < req.groups_size(); ++i)
    s->threads.emplace_back([this, s, i] { RunStage(s, static_cast<size_t>(i)); });
  {
    absl::MutexLock lock(&mu_);
    s->rpcs--;
    s->idle_since = absl::Now();
  }
  WSYNC_LOG(INFO) << who << ": " << paused_note << "; receiving " << req.groups_size() << " stage(s) as rank "
                  << req.agent_rank()
                  << (s->recorder ? absl::StrCat(", recording to ", s->recorder->partial_dir()) : "");
  reply->set_previous_version(s->previous_version);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RolloutAgent::PauseEngine(Sync* s, absl::Time deadline) {
  Engine& e = *engine_;
  const absl::Time t0 = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    s->engine_paused = true;  // from here on a failure must Continue the engine
    s->paused_at = t0;
  }
  auto paused = e.client->Pause(v1::PauseRequest::HOLD);
  if (!paused.ok()) return paused.status();
  const absl::Time t1 = absl::Now();
  m_->Observe("pause", t1 - t0);
  if (s->cancel.cancelled()) return absl::AbortedError(s->cancel.reason());
  const absl::Time flush_deadline = std::min(t1 + std::min(options_.flush_deadline, s->timeout), deadline);
  auto flushed = e.client->Flush(flush_deadline, [s] { return s->cancel.cancelled(); });
  if (!flushed.ok()) return flushed.status();
  const absl::Time t2 = absl::Now();
  m_->Observe("flush", t2 - t1);
  if (s->cancel.cancelled()) return absl::AbortedError(s->cancel.reason());
  return absl::StrCat("engine paused (", *paused, " in flight) and flushed",
                      *flushed > 0 ? absl::StrCat(" after ", *flushed, " refusals") : "", " in ",
                      absl::FormatDuration(t2 - t0));
}

int RolloutAgent::ReceiveDevice() const {
  if (options_.cuda_device >= 0) return options_.cuda_device;
  if (engine_ != nullptr && engine_->staging != nullptr && !engine_->staging->space().host())
    return engine_->staging->space().cuda_device();
  if (engine_ != nullptr && engine_->memory != nullptr) {
    for (const engine_model::EngineBuffer& b : engine_->memory->weights().buffers())
      if (b.on_device()) return b.cuda_device;
  }
  return -1;
}

BufferPool* RolloutAgent::DevicePool(int device) {
  absl::MutexLock lock(&pools_mu_);
  std::unique_ptr<BufferPool>& p = device_pools_[device];
  if (p == nullptr)
    p = std::make_unique<BufferPool>(
        2, [space = MemorySpace::Cuda(device)](size_t n) { return space.Allocate(n); }, /*keep_until_trim=*/true);
  return p.get();
}

void RolloutAgent::TrimNcclPools() {
  {
    absl::MutexLock lock(&pools_mu_);
    for (auto& [device, pool] : device_pools_) pool->Trim();
  }
  pinned_pool_.Trim();
}

void RolloutAgent::RunStage(Sync* s, size_t index) {
  const v1::SyncGroup& g = s->req.groups(static_cast<int>(index));
  StageOptions o;
  o.backend = s->backend;
  o.store = s->store.get();
  o.group = g.name();
  o.pp_stage = g.pp_stage();
  o.rank = static_cast<int>(s->req.agent_rank());
  o.size = static_cast<int>(g.size());
  o.host = options_.data_host;
  o.version = s->req.version();
  o.join_timeout = s->timeout;
  o.op_timeout = s->timeout;
  o.loader = s->loader.get();
  o.recorder = s->recorder.get();
  o.load_threads = options_.load_threads > 0
                       ? options_.load_threads
                       : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  o.cancel = &s->cancel;
  o.pool = &bucket_pool_;
  if (s->backend == comm::Backend::kNccl) {
    o.formed = s->formed.get();
    o.cuda_device = s->cuda_device;
    o.device_pool = DevicePool(s->cuda_device);
    o.host_pool = &pinned_pool_;
  }
  o.bucket_mac_key = s->req.bucket_mac_key();
  auto r = ReceiveStage(o);
  bool cancel_others = false;
  {
    absl::MutexLock lock(&mu_);
    --s->running;
    if (r.ok()) {
      s->totals.buckets += r->buckets;
      s->totals.bytes += r->bytes;
      s->totals.tensors += r->tensors;
      s->totals.join = std::max(s->totals.join, r->join);
      s->totals.transfer = std::max(s->totals.transfer, r->transfer);
      s->totals.load += r->load;
      s->totals.record += r->record;
      s->totals.to_host += r->to_host;
      s->totals.to_device += r->to_device;
    } else if (s->first_error.ok()) {
      s->first_error = r.status();
      cancel_others = true;
    }
  }
  if (r.ok()) {
    m_->bytes->Increment(static_cast<double>(r->bytes));
    m_->buckets->Increment(static_cast<double>(r->buckets));
    m_->tensors->Increment(static_cast<double>(r->tensors));
    WSYNC_LOG(INFO) << "sync " << s->id << ": stage " << g.pp_stage() << " received " << r->buckets << " buckets, "
                    << r->tensors << " tensors, " << r->bytes << " bytes in " << absl::FormatDuration(r->transfer)
                    << " (group formed in " << absl::FormatDuration(r->join) << ", loading "
                    << absl::FormatDuration(r->load) << ")";
  } else {
    WSYNC_LOG(ERROR) << "sync " << s->id << ": stage " << g.pp_stage() << " failed: " << r.status();
    if (cancel_others) s->cancel.Cancel(absl::StrCat("stage ", g.pp_stage(), " failed: ", r.status().message()));
  }
}

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
  if (s->backend == comm::Backend::kNccl) TrimNcclPools();
  absl::Status st;
  {
    absl::MutexLock lock(&mu_);
    st = s->first_error;
  }
  if (st.ok()) {
    st = engine_->staging->CheckComplete();
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
                  << reply->load_seconds() << " s)";
  return absl::OkStatus();
}

// --- CommitSync ---------------------------------------------------------------------------------------

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
  if (!st.ok()) {
    if (absl::IsInternal(st)) {
      // Validation passed, so the engine's memory may be partly written: it must not serve.
      if (s->recorder) s->recorder->Discard();
      {
        absl::MutexLock lock(&mu_);
        last_sync_id_ = s->id;
        last_sync_run_ = SyncRun(s->req);
        last_committed_ = false;
        last_outcome_ = st;
        sync_.reset();
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
    last_sync_id_ = s->id;
    last_sync_run_ = SyncRun(s->req);
    last_committed_ = true;
    last_outcome_ = absl::OkStatus();
    sync_.reset();
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
  if (s->backend == comm::Backend::kNccl) TrimNcclPools();
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
    last_sync_id_ = id;
    last_sync_run_ = SyncRun(s->req);
    last_committed_ = false;
    last_outcome_ = absl::AbortedError(reason);
    sync_.reset();
  }
  m_->failures->Increment();
  m_->active->Set(0);
  RequestHeapTrim();
  return cont;
}

// --- AgentServer --------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<AgentServer>> AgentServer::Start(const std::string& listen, AgentOptions options) {
  std::unique_ptr<AgentServer> s(new AgentServer());
  RpcSecurity sec = options.security;
  ASSIGN_OR_RETURN(const HostPort bind, SplitHostPort(listen));
  // Defaults that work across hosts: the address facing the coordinator, for the data plane and,
  // when the service binds a wildcard address, for what the coordinator is told to call.
  std::string facing = "127.0.0.1";
  if (!options.coordinator.empty() &&
      (options.data_host.empty() || (options.advertise_address.empty() && IsWildcardHost(bind.host)))) {
    auto f = LocalAddressFacing(options.coordinator);
    if (!f.ok())
      return Annotate(f.status(), absl::StrCat("choosing this agent's address facing the coordinator ",
                                               options.coordinator, " (give --data-host / --advertise-address)"));
    facing = *f;
  }
  if (options.data_host.empty()) options.data_host = facing;
  const std::string advertise = options.advertise_address;
  s->agent_ = std::make_unique<RolloutAgent>(std::move(options));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, ServerCredentials(sec), &port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterService(s->agent_->service());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || port == 0) return absl::UnavailableError(absl::StrCat("rollout agent: cannot listen on ", listen));
  s->address_ = JoinHostPort(bind.host, port);
  s->agent_->SetAddress(!advertise.empty()          ? advertise
                        : IsWildcardHost(bind.host) ? JoinHostPort(facing, port)
                                                    : s->address_);
  return s;
}

AgentServer::~AgentServer() { Shutdown(); }

void AgentServer::Shutdown() {
  if (agent_) agent_->Stop();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
    server_.reset();
  }
}

}  // namespace wsync::rollout_agent
