#include "trainer_agent/coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/status.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::trainer_agent {
namespace {

// The Coordinator gRPC service: authorization, then the domain call, its status mapped.
class CoordinatorService final : public v1::Coordinator::Service {
 public:
  CoordinatorService(SyncCoordinator* domain, const RpcSecurity* security) : domain_(domain), security_(security) {}

  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* req, v1::JoinReply* reply) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    return ToGrpcStatus(domain_->Join(*req, reply));
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatReply* reply) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    return ToGrpcStatus(domain_->Heartbeat(*req, reply));
  }
  grpc::Status Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* req, v1::LeaveReply*) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    return ToGrpcStatus(domain_->Leave(*req));
  }
  grpc::Status TriggerSync(grpc::ServerContext* ctx, const v1::TriggerSyncRequest* req,
                           v1::TriggerSyncReply* reply) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    return ToGrpcStatus(domain_->TriggerSync(*req, reply));
  }
  grpc::Status WatchSync(grpc::ServerContext* ctx, const v1::WatchSyncRequest* req,
                         grpc::ServerWriter<v1::SyncEvent>* writer) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    return ToGrpcStatus(domain_->WatchSync(
        req->sync_id(), [&](const v1::SyncEvent& e) { return !ctx->IsCancelled() && writer->Write(e); }));
  }
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest*, v1::StatusReply* reply) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    domain_->Status(reply);
    return grpc::Status::OK;
  }
  grpc::Status Members(grpc::ServerContext* ctx, const v1::MembersRequest*, v1::MembersReply* reply) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    domain_->Members(reply);
    return grpc::Status::OK;
  }
  grpc::Status RemoveEngine(grpc::ServerContext* ctx, const v1::RemoveEngineRequest* req,
                            v1::RemoveEngineReply*) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    return ToGrpcStatus(domain_->RemoveEngine(req->engine_id()));
  }
  grpc::Status Versions(grpc::ServerContext* ctx, const v1::VersionsRequest*, v1::VersionsReply* reply) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    domain_->Versions(reply);
    return grpc::Status::OK;
  }
  grpc::Status Timings(grpc::ServerContext* ctx, const v1::TimingsRequest* req, v1::TimingsReply* reply) override {
    WSYNC_AUTHORIZE(ctx, *security_);
    return ToGrpcStatus(domain_->Timings(*req, reply));
  }

 private:
  SyncCoordinator* const domain_;
  const RpcSecurity* const security_;
};

}  // namespace

class Coordinator::Impl {
 public:
  Impl(const CoordinatorOptions& o, TrainerSide* trainer)
      : opts_(o),
        trainer_(trainer),
        domain_({.backend = o.backend,
                 .delivery = o.delivery,
                 .delta = o.delta,
                 .heartbeat = o.heartbeat,
                 .member_timeout = o.member_timeout,
                 .sync_timeout = o.sync_timeout,
                 .rpc_timeout = o.rpc_timeout,
                 .metrics = o.metrics,
                 .state_dir = o.state_dir,
                 .bucket_mac = o.bucket_mac},
                trainer, &store_,
                [security = o.security](const std::string& address) { return MakeGrpcAgentClient(address, security); }),
        service_(&domain_, &opts_.security) {}

  ~Impl() {
    domain_.Stop();  // a running sync ends first; open WatchSync streams return UNAVAILABLE
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  }

  absl::Status Start() {
    ASSIGN_OR_RETURN(const HostPort bind, SplitHostPort(opts_.listen));
    host_ = opts_.advertise_host.empty() ? bind.host : opts_.advertise_host;
    if (IsWildcardHost(host_))
      return absl::InvalidArgumentError(absl::StrCat("coordinator: listening on ", opts_.listen,
                                                     " needs an address to advertise (--coordinator HOST:PORT)"));
    RETURN_IF_ERROR(domain_.LoadState());  // before serving: a bad state file changes nothing
    store_service_ = comm::MakeStoreService(&store_, opts_.security);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(opts_.listen, ServerCredentials(opts_.security), &port_);
    builder.RegisterService(&service_);
    builder.RegisterService(store_service_.get());
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0) {
      return absl::UnavailableError(absl::StrCat("coordinator: cannot listen on ", opts_.listen));
    }
    domain_.Start(address());
    WSYNC_LOG(INFO) << "coordinator listening on " << address() << " (" << trainer_->world_size() << " trainer ranks, "
                    << trainer_->num_stages() << " stages)";
    return absl::OkStatus();
  }

  std::string address() const { return JoinHostPort(host_, port_); }
  comm::MemoryStore& store() { return store_; }

 private:
  const CoordinatorOptions opts_;
  TrainerSide* const trainer_;
  comm::MemoryStore store_;
  SyncCoordinator domain_;
  CoordinatorService service_;
  std::unique_ptr<grpc::Service> store_service_;
  std::unique_ptr<grpc::Server> server_;
  std::string host_;
  int port_ = 0;
};

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options,
                                                                TrainerSide* trainer) {
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
