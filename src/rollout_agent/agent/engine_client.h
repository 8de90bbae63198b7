// The rollout agent's client of its engine's control surface (proto/wsync/v1/engine.proto,
// service RolloutEngine): Pause, Flush (retried while the engine still drains requests), Continue.
// Every call carries the agent's bearer token and a deadline (rpc_timeout); channels come from
// MakeChannel (TLS when the agent is configured with it).
//
// Errors: the engine's gRPC status converted back (FromGrpcStatus) and prefixed with the call and
// the engine's address ("engine at 127.0.0.1:5000: Flush: ..."); Flush gives kDeadlineExceeded
// naming the last refusal when the engine kept refusing until the deadline, kAborted when
// `cancelled` turned true.
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/rpc_security.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::rollout_agent {

struct EngineClientOptions {
  absl::Duration rpc_timeout = absl::Seconds(10);       // per call
  absl::Duration flush_retry = absl::Milliseconds(50);  // between refused Flush calls
};

class EngineClient {
 public:
  EngineClient(std::string address, const RpcSecurity& sec, EngineClientOptions options = {});

  const std::string& address() const { return address_; }
  // Returns the number of requests in flight the engine reported.
  absl::StatusOr<uint32_t> Pause(v1::PauseRequest::Mode mode);
  // Calls Flush until it succeeds, retrying every flush_retry while the engine answers
  // FAILED_PRECONDITION, until `deadline`; `cancelled` (optional) is polled between tries.
  // Returns the number of refused attempts on success.
  absl::StatusOr<int> Flush(absl::Time deadline, const std::function<bool()>& cancelled);
  // Returns the version the engine reports it serves.
  absl::StatusOr<uint64_t> Continue(uint64_t version);
  absl::StatusOr<v1::HealthReply> Health();

 private:
  absl::Status Convert(const grpc::Status& s, absl::string_view call) const;

  const std::string address_;
  const RpcSecurity sec_;
  const EngineClientOptions options_;
  std::unique_ptr<v1::RolloutEngine::Stub> stub_;
};

}  // namespace wsync::rollout_agent
