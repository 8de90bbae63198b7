#include "rollout_agent/agent/engine_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status.h"

namespace wsync::rollout_agent {

EngineClient::EngineClient(std::string address, const RpcSecurity& sec, EngineClientOptions options)
    : address_(std::move(address)),
      sec_(sec),
      options_(options),
      stub_(v1::RolloutEngine::NewStub(MakeChannel(address_, sec_))) {}

absl::Status EngineClient::Convert(const grpc::Status& s, absl::string_view call) const {
  if (s.ok()) return absl::OkStatus();
  return Annotate(FromGrpcStatus(s), absl::StrCat("engine at ", address_, ": ", call));
}

absl::StatusOr<uint32_t> EngineClient::Pause(v1::PauseRequest::Mode mode) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, sec_, options_.rpc_timeout);
  v1::PauseRequest req;
  req.set_mode(mode);
  v1::PauseReply reply;
  RETURN_IF_ERROR(Convert(stub_->Pause(&ctx, req, &reply), "Pause"));
  return reply.in_flight();
}

absl::StatusOr<int> EngineClient::Flush(absl::Time deadline, const std::function<bool()>& cancelled) {
  int refused = 0;
  std::string last;  // the engine's last refusal: why it is still busy
  auto out_of_time = [&] {
    return absl::DeadlineExceededError(absl::StrCat("engine at ", address_, ": Flush: the engine refused ", refused,
                                                    " times until the deadline",
                                                    last.empty() ? "" : absl::StrCat("; last: ", last)));
  };
  for (;;) {
    if (cancelled && cancelled()) {
      return absl::AbortedError(
          absl::StrCat("engine at ", address_, ": Flush: cancelled after ", refused, " refusals"));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return out_of_time();
    grpc::ClientContext ctx;
    PrepareContext(&ctx, sec_, std::min(left, options_.rpc_timeout));
    v1::FlushReply reply;
    const grpc::Status s = stub_->Flush(&ctx, v1::FlushRequest(), &reply);
    if (s.ok()) return refused;
    // A call cut short by the flush deadline (not by the RPC timeout) after refusals: the engine
    // is still draining, and its last refusal says why.
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && refused > 0 && absl::Now() >= deadline)
      return out_of_time();
    if (s.error_code() != grpc::StatusCode::FAILED_PRECONDITION) return Convert(s, "Flush");
    ++refused;  // the engine still runs requests: ask again until the deadline
    last = s.error_message();
    if (absl::Now() + options_.flush_retry >= deadline) return out_of_time();
    absl::SleepFor(options_.flush_retry);
  }
}

absl::StatusOr<uint64_t> EngineClient::Continue(uint64_t version) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, sec_, options_.rpc_timeout);
  v1::ContinueRequest req;
  req.set_version(version);
  v1::ContinueReply reply;
  RETURN_IF_ERROR(Convert(stub_->Continue(&ctx, req, &reply), absl::StrCat("Continue(", version, ")")));
  return reply.version();
}

absl::StatusOr<v1::HealthReply> EngineClient::Health() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, sec_, options_.rpc_timeout);
  v1::HealthReply reply;
  RETURN_IF_ERROR(Convert(stub_->Health(&ctx, v1::HealthRequest(), &reply), "Health"));
  return reply;
}

}  // namespace wsync::rollout_agent
