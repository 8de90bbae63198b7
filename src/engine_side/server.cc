#include "engine_side/server.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/failpoint.h"
#include "common/grpc_status.h"
#include "common/heap.h"
#include "common/logging.h"

namespace wsync::engine_side {
namespace {

absl::Time Deadline(const grpc::ServerContext* ctx) {
  const auto d = ctx->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

v1::HealthReply::State ToProto(HealthInfo::State s) {
  switch (s) {
    case HealthInfo::State::kServing: return v1::HealthReply::SERVING;
    case HealthInfo::State::kPaused: return v1::HealthReply::PAUSED;
    case HealthInfo::State::kNoWeights: return v1::HealthReply::NO_WEIGHTS;
    case HealthInfo::State::kUnhealthy: return v1::HealthReply::UNHEALTHY;
  }
  return v1::HealthReply::STATE_UNSPECIFIED;
}

}  // namespace

grpc::Status RolloutEngineService::Pause(grpc::ServerContext* ctx, const v1::PauseRequest* req, v1::PauseReply* reply) {
  WSYNC_AUTHORIZE(ctx, sec_);
  FailpointHit("engine.pause");  // system tests (common/failpoint.h)
  reply->set_in_flight(core_->Pause(req->mode() == v1::PauseRequest::ABORT ? PauseMode::kAbort : PauseMode::kHold));
  return grpc::Status::OK;
}

grpc::Status RolloutEngineService::Flush(grpc::ServerContext* ctx, const v1::FlushRequest*, v1::FlushReply*) {
  WSYNC_AUTHORIZE(ctx, sec_);
  return ToGrpcStatus(core_->Flush());
}

grpc::Status RolloutEngineService::Continue(grpc::ServerContext* ctx, const v1::ContinueRequest* req,
                                            v1::ContinueReply* reply) {
  WSYNC_AUTHORIZE(ctx, sec_);
  FailpointHit("engine.continue");  // system tests (common/failpoint.h)
  absl::StatusOr<uint64_t> v = core_->Continue(req->version(), Deadline(ctx));
  if (!v.ok()) return ToGrpcStatus(v.status());
  reply->set_version(*v);
  RequestHeapTrim();  // a sync ended here: hand what it freed back to the kernel (common/heap.h)
  return grpc::Status::OK;
}

grpc::Status RolloutEngineService::Health(grpc::ServerContext* ctx, const v1::HealthRequest*, v1::HealthReply* reply) {
  WSYNC_AUTHORIZE(ctx, sec_);
  const HealthInfo h = core_->Health();
  reply->set_state(ToProto(h.state));
  reply->set_version(h.version);
  reply->set_in_flight(h.in_flight);
  reply->set_detail(h.detail);
  return grpc::Status::OK;
}

grpc::Status RolloutEngineService::WeightVersion(grpc::ServerContext* ctx, const v1::WeightVersionRequest*,
                                                 v1::WeightVersionReply* reply) {
  WSYNC_AUTHORIZE(ctx, sec_);
  reply->set_version(core_->version());
  return grpc::Status::OK;
}

grpc::Status RolloutEngineService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                            v1::GenerateReply* reply) {
  WSYNC_AUTHORIZE(ctx, sec_);
  absl::StatusOr<GenerateResult> r =
      core_->Generate(absl::MakeConstSpan(req->prompt().data(), static_cast<size_t>(req->prompt_size())),
                      static_cast<int64_t>(req->max_new_tokens()), Deadline(ctx), [ctx] { return ctx->IsCancelled(); });
  if (!r.ok()) return ToGrpcStatus(r.status());
  for (int32_t t : r->tokens) reply->add_tokens(t);
  reply->set_version(r->version);
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<EngineServer>> EngineServer::Start(EngineCore* core, const std::string& listen,
                                                                  RpcSecurity security) {
  auto s = std::unique_ptr<EngineServer>(new EngineServer());
  s->service_ = std::make_unique<RolloutEngineService>(core, security);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, ServerCredentials(security), &s->port_);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) return absl::UnavailableError(absl::StrCat("engine: cannot listen on ", listen));
  const size_t colon = listen.rfind(':');
  s->address_ = absl::StrCat(colon == std::string::npos ? listen : listen.substr(0, colon), ":", s->port_);
  return s;
}

EngineServer::~EngineServer() { Shutdown(absl::Seconds(2)); }

void EngineServer::Shutdown(absl::Duration grace) {
  if (shut_down_ || !server_) return;
  shut_down_ = true;
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
}

}  // namespace wsync::engine_side
