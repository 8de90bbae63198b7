// Registration of an engine rank with its rollout agent (RolloutAgent.RegisterEngine,
// proto/wsync/v1/rollout.proto): the rank's parameters and where their shared memory is, its
// geometry, config and address.
//
// AgentRegistrar runs one thread that registers at start and keeps the registration alive:
//   * not registered: RegisterEngine with a fresh request (make_request() is called each time,
//     so it carries the version served now); on failure retry with exponential backoff
//     (min_backoff doubling to max_backoff), logging the first failure and then every 10th;
//   * registered: every `poll`, AgentStatus; when the call fails (agent gone), or the agent_id
//     differs from the one that accepted us (agent restarted), or the agent reports state
//     "no_engine" or another engine_id, register again (backoff from min_backoff).
// Every call has a deadline (rpc_timeout) and the bearer token (PrepareContext).
// With agent_address_file, the agent's address is read from that file (what the rollout agent's
// --address-file writes, atomically) before every registration attempt: an agent restarted on
// another port is found again, without restarting the engine. The file may be missing or empty
// for a while (the agent is starting): that counts as a failed attempt.
//
// Thread-safety: the public methods may be called from any thread. make_request is called on the
// registrar's thread and must be thread-safe with respect to the engine.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc_security.h"
#include "wsync/v1/rollout.grpc.pb.h"

namespace wsync::engine_side {

struct RegistrarOptions {
  std::string agent_address;       // the initial address (may be empty with agent_address_file)
  std::string agent_address_file;  // re-read before every registration attempt (see above)
  RpcSecurity security;
  absl::Duration rpc_timeout = absl::Seconds(10);
  absl::Duration min_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  absl::Duration poll = absl::Seconds(2);
  // Called on the registrar's thread after every successful RegisterEngine (may be empty).
  std::function<void(const v1::RegisterEngineReply&)> on_registered;
};

class AgentRegistrar {
 public:
  static std::unique_ptr<AgentRegistrar> Start(RegistrarOptions options,
                                               std::function<v1::RegisterEngineRequest()> make_request);
  ~AgentRegistrar();  // Stop()
  void Stop();        // idempotent; returns once the thread has ended (an RPC in progress ends by its deadline)

  // Successful RegisterEngine calls so far, and the agent_id of the last one.
  int registrations() const;
  std::string agent_id() const;

 private:
  AgentRegistrar(RegistrarOptions options, std::function<v1::RegisterEngineRequest()> make_request);
  void Loop();
  // Sleeps up to `d`; false when stopping.
  bool Sleep(absl::Duration d);

  // The agent's address now (from the options, or the file); false when it has none yet.
  bool ResolveAgent();

  const RegistrarOptions options_;
  const std::function<v1::RegisterEngineRequest()> make_request_;
  std::string agent_;  // the address stub_ talks to (registrar thread only)
  std::unique_ptr<v1::RolloutAgent::Stub> stub_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  std::string agent_id_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace wsync::engine_side
