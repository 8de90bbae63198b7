// How the coordinator reaches one rollout agent during a sync: the four calls of the sync protocol
// (docs/spec/SYSTEM.md "One sync, step by step"), each bounded by a timeout. The production
// client is gRPC (MakeGrpcAgentClient); tests give the coordinator fakes (coordinator_test.cc), as
// c10d tests its process groups against a fake one.
//
// Every call blocks until the agent answers or `timeout` has passed and returns the agent's status:
// kDeadlineExceeded past the deadline, kUnavailable when the agent cannot be reached, otherwise
// the code the agent returned (rollout_agent/agent/rollout_agent.h lists them).
// Thread-safety: an AgentClient may be called from several threads at once.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/rpc_security.h"
#include "wsync/v1/rollout.pb.h"

namespace wsync::trainer_agent {

class AgentClient {
 public:
  virtual ~AgentClient() = default;
  virtual absl::Status BeginSync(const v1::BeginSyncRequest& req, absl::Duration timeout,
                                 v1::BeginSyncReply* reply) = 0;
  virtual absl::Status PrepareSync(const v1::PrepareSyncRequest& req, absl::Duration timeout,
                                   v1::PrepareSyncReply* reply) = 0;
  virtual absl::Status CommitSync(const v1::CommitSyncRequest& req, absl::Duration timeout,
                                  v1::CommitSyncReply* reply) = 0;
  virtual absl::Status AbortSync(const v1::AbortSyncRequest& req, absl::Duration timeout,
                                 v1::AbortSyncReply* reply) = 0;
};

// Makes the client of the agent that joined from `address` ("host:port"); called once per Join.
using AgentConnector = std::function<std::unique_ptr<AgentClient>(const std::string& address)>;

// The RolloutAgent gRPC service at `address`, with the bearer token / TLS of `security`.
std::unique_ptr<AgentClient> MakeGrpcAgentClient(const std::string& address, const RpcSecurity& security);

}  // namespace wsync::trainer_agent
