// The rollout agent's frame: the gRPC service in front of it, construction and metrics, Stop,
// its identity, AgentStatus, and AgentServer. The phases live beside it: engine_install.cc,
// sync_begin.cc, sync_end.cc, catch_up.cc, watchdog.cc (agent/README.md).

#include "rollout_agent/agent/rollout_agent.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/status.h"
#include "rollout_agent/agent/membership.h"
#include "rollout_agent/agent/rollout_agent_state.h"

namespace wsync::rollout_agent {

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
    // The agent's own DEADLINE_EXCEEDED says what it waited for; it answers a tenth of the call's
    // time early (at most 250 ms), so that on a loaded host it still reaches the caller in time.
    absl::Time answer_by = Deadline(ctx);
    if (answer_by != absl::InfiniteFuture())
      answer_by -= std::min(absl::Milliseconds(250), std::max(absl::ZeroDuration(), answer_by - absl::Now()) / 10);
    return ToGrpcStatus(agent_->UpdateWeights(
        *req, answer_by, [ctx] { return ctx->IsCancelled(); }, reply));
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
    membership_ = std::make_shared<Membership>(options_.coordinator, options_.security, options_.heartbeat,
                                               [this] { return DeltaBaseVersion(); });
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
