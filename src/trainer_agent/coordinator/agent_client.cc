#include "trainer_agent/coordinator/agent_client.h"

#include <grpcpp/grpcpp.h>

#include "common/grpc_status.h"
#include "wsync/v1/rollout.grpc.pb.h"

namespace wsync::trainer_agent {
namespace {

class GrpcAgentClient final : public AgentClient {
 public:
  GrpcAgentClient(const std::string& address, const RpcSecurity& security)
      : security_(security), stub_(v1::RolloutAgent::NewStub(MakeChannel(address, security))) {}

  absl::Status BeginSync(const v1::BeginSyncRequest& req, absl::Duration timeout, v1::BeginSyncReply* reply) override {
    return Call(&v1::RolloutAgent::Stub::BeginSync, req, timeout, reply);
  }
  absl::Status PrepareSync(const v1::PrepareSyncRequest& req, absl::Duration timeout,
                           v1::PrepareSyncReply* reply) override {
    return Call(&v1::RolloutAgent::Stub::PrepareSync, req, timeout, reply);
  }
  absl::Status CommitSync(const v1::CommitSyncRequest& req, absl::Duration timeout,
                          v1::CommitSyncReply* reply) override {
    return Call(&v1::RolloutAgent::Stub::CommitSync, req, timeout, reply);
  }
  absl::Status AbortSync(const v1::AbortSyncRequest& req, absl::Duration timeout, v1::AbortSyncReply* reply) override {
    return Call(&v1::RolloutAgent::Stub::AbortSync, req, timeout, reply);
  }

 private:
  template <typename Req, typename Reply>
  absl::Status Call(grpc::Status (v1::RolloutAgent::Stub::*rpc)(grpc::ClientContext*, const Req&, Reply*),
                    const Req& req, absl::Duration timeout, Reply* reply) {
    grpc::ClientContext ctx;
    PrepareContext(&ctx, security_, timeout);
    return FromGrpcStatus(((*stub_).*rpc)(&ctx, req, reply));
  }

  const RpcSecurity security_;
  std::unique_ptr<v1::RolloutAgent::Stub> stub_;
};

}  // namespace

std::unique_ptr<AgentClient> MakeGrpcAgentClient(const std::string& address, const RpcSecurity& security) {
  return std::make_unique<GrpcAgentClient>(address, security);
}

}  // namespace wsync::trainer_agent
