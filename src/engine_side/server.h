// The RPC shell of every engine process (wsync-ref-engine, libwsync_engine_host.so): the
// RolloutEngine gRPC service over an EngineCore (proto/wsync/v1/engine.proto), and the server that
// listens for it.
//
// Every handler begins with WSYNC_AUTHORIZE (bearer token; UNAUTHENTICATED before anything
// changes) and maps absl::Status with ToGrpcStatus. Generate passes the caller's deadline and
// cancellation to the core (they bound how long a request is held by a pause); Continue waits for
// running requests at most until the caller's deadline. Pause with MODE_UNSPECIFIED means HOLD.
//
// Thread-safety: handlers run on gRPC's threads concurrently; the core is thread-safe.
// Ownership: the service and server borrow the core, which must outlive them.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/rpc_security.h"
#include "engine_side/core.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::engine_side {

class RolloutEngineService final : public v1::RolloutEngine::Service {
 public:
  RolloutEngineService(EngineCore* core, RpcSecurity security) : core_(core), sec_(std::move(security)) {}

  grpc::Status Pause(grpc::ServerContext* ctx, const v1::PauseRequest* req, v1::PauseReply* reply) override;
  grpc::Status Flush(grpc::ServerContext* ctx, const v1::FlushRequest* req, v1::FlushReply* reply) override;
  grpc::Status Continue(grpc::ServerContext* ctx, const v1::ContinueRequest* req, v1::ContinueReply* reply) override;
  grpc::Status Health(grpc::ServerContext* ctx, const v1::HealthRequest* req, v1::HealthReply* reply) override;
  grpc::Status WeightVersion(grpc::ServerContext* ctx, const v1::WeightVersionRequest* req,
                             v1::WeightVersionReply* reply) override;
  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req, v1::GenerateReply* reply) override;

 private:
  EngineCore* core_;
  const RpcSecurity sec_;
};

class EngineServer {
 public:
  // Listens on `listen` ("HOST:PORT"; port 0 picks one). kUnavailable if it cannot bind.
  static absl::StatusOr<std::unique_ptr<EngineServer>> Start(EngineCore* core, const std::string& listen,
                                                             RpcSecurity security);
  ~EngineServer();  // Shutdown(2 s)

  // "HOST:PORT" actually bound (HOST as given in `listen`).
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // Stops accepting calls; calls still running after `grace` are cancelled. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  EngineServer() = default;
  std::unique_ptr<RolloutEngineService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace wsync::engine_side
