// The coordinator process role, hosted by trainer rank 0: the Coordinator gRPC service (a thin
// layer over SyncCoordinator, sync_coordinator.h, which holds the membership and the sync state
// machine) and the data plane's rendezvous Store service (comm/store/store.h), on one listener.
// Every handler checks the bearer token (common/rpc_security.h) and returns the domain's
// absl::Status through ToGrpcStatus (common/grpc_status.h).
//
// Thread-safety: all public methods may be called from any thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/store/store.h"
#include "common/metrics.h"
#include "common/rpc_security.h"
#include "plan/delivery_plan.h"
#include "trainer_agent/coordinator/sync_coordinator.h"

namespace wsync::trainer_agent {

struct CoordinatorOptions {
  std::string listen = "127.0.0.1:7070";
  // The host the coordinator is reached at (address() = advertise_host:bound port); empty: the
  // listen host, which must then not be a wildcard (0.0.0.0, ::).
  std::string advertise_host;
  RpcSecurity security;
  std::string backend = "gloo";
  plan::Delivery delivery = plan::Delivery::kBroadcast;  // of syncs that do not choose (--delivery)
  DeltaMode delta = DeltaMode::kOff;                     // of syncs that do not choose (--delta)
  absl::Duration heartbeat = absl::Seconds(2);           // agents heartbeat this often
  absl::Duration member_timeout = absl::Seconds(10);     // dropped after this much silence
  absl::Duration sync_timeout = absl::Minutes(10);       // bound on one whole sync
  absl::Duration rpc_timeout = absl::Seconds(60);        // Begin/Commit/Abort round trips
  MetricsRegistry* metrics = nullptr;                    // optional
  std::string state_dir;                                 // durable state (SyncCoordinatorOptions::state_dir)
  bool bucket_mac = false;                               // SyncCoordinatorOptions::bucket_mac
};

class Coordinator {
 public:
  // Starts serving the Coordinator and Store services on options.listen; agents are reached over
  // gRPC. kUnavailable when it cannot listen; kInvalidArgument without a trainer side.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(const CoordinatorOptions& options, TrainerSide* trainer);
  ~Coordinator();  // waits for a running sync to end, then stops serving

  std::string address() const;  // "host:port" actually bound
  comm::MemoryStore& store();

 private:
  class Impl;
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::trainer_agent
