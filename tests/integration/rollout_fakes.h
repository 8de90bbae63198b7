// Fixtures of the rollout agent's integration tests (tests/integration/rollout_agent_test.cc):
//
//   FakeEngine       the engine *control surface* only (RolloutEngine Pause / Flush / Continue /
//                    Health / WeightVersion over real gRPC on loopback), recording every call so
//                    that tests can assert their order, plus the engine's real parameter memory:
//                    a ParamArena (engine_memory/param_arena.h, the engine's end of
//                    the shm protocol), registered with the agent through RegisterEngine. It stands
//                    in for the reference engine; the data path through it is the real one.
//   FakeCoordinator  Join / Heartbeat / Leave of the Coordinator service, recorded.
//   AgentProcess     a wsync-rollout-agent process (posix_spawn), its address from --address-file,
//                    its log, a RolloutAgent stub, SIGTERM + wait on destruction.
//   TrainerStage     the trainer side of one stage group: forms the Gloo group as rank 0 through the
//                    test's MemoryStore (served to the agents by a StoreServer) and sends buckets.
// Thread-safety: FakeEngine / FakeCoordinator are gRPC services (thread-safe); the rest belong to
// the test's main thread.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "common/rpc_security.h"
#include "engine_memory/param_arena.h"
#include "engine_model/engine_layout.h"
#include "wsync/v1/coordinator.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"
#include "wsync/v1/rollout.grpc.pb.h"

namespace wsync::rollout_agent::testing {
using engine_memory::ParamArena;
using engine_model::EngineLayout;
using engine_model::EngineParallel;

class FakeEngine final : public v1::RolloutEngine::Service {
 public:
  struct Options {
    std::string engine_id = "engine-a";
    std::string config_json;
    std::string quant_json;  // empty: bf16
    EngineParallel parallel;
    uint64_t version = 0;
    RpcSecurity security;  // the token the agent must present; also used to call the agent
  };
  static absl::StatusOr<std::unique_ptr<FakeEngine>> Start(Options options);
  ~FakeEngine() override;

  const std::string& address() const { return address_; }
  const EngineLayout& layout() const { return *layout_; }
  ParamArena& memory() { return *memory_; }
  const Options& options() const { return options_; }

  // The RegisterEngineRequest describing this engine (params in its shm segment).
  v1::RegisterEngineRequest RegisterRequest() const;
  // Registers with the agent at `agent` (token from options().security).
  grpc::Status Register(const std::string& agent);

  // "pause:HOLD", "flush:refused", "flush", "continue:<version>", in order.
  std::vector<std::string> calls() const;
  void ClearCalls();
  uint64_t version() const;
  bool paused() const;
  // Flush answers FAILED_PRECONDITION the next `n` times (-1: always).
  void RefuseFlushes(int n);
  // While held, Health does not answer (a hung or stopped engine) until released or 30 s passed;
  // health_waiting() counts the Health calls waiting now.
  void HoldHealth(bool hold);
  int health_waiting() const;

  grpc::Status Pause(grpc::ServerContext*, const v1::PauseRequest*, v1::PauseReply*) override;
  grpc::Status Flush(grpc::ServerContext*, const v1::FlushRequest*, v1::FlushReply*) override;
  grpc::Status Continue(grpc::ServerContext*, const v1::ContinueRequest*, v1::ContinueReply*) override;
  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*, v1::HealthReply*) override;
  grpc::Status WeightVersion(grpc::ServerContext*, const v1::WeightVersionRequest*, v1::WeightVersionReply*) override;

 private:
  FakeEngine() = default;
  Options options_;
  std::unique_ptr<EngineLayout> layout_;
  std::unique_ptr<ParamArena> memory_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  mutable absl::Mutex mu_;
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  int refuse_flushes_ ABSL_GUARDED_BY(mu_) = 0;
  bool hold_health_ ABSL_GUARDED_BY(mu_) = false;
  int health_waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  static absl::StatusOr<std::unique_ptr<FakeCoordinator>> Start(RpcSecurity security);
  ~FakeCoordinator() override;
  const std::string& address() const { return address_; }

  std::vector<v1::JoinRequest> joins() const;
  int heartbeats() const;
  std::vector<std::string> leaves() const;
  // The next heartbeat is answered known = false (the agent must join again).
  void ForgetAgents();
  // What Join replies tell the agents to use as their heartbeat period (default 100 ms), and the
  // catch-up hint every Join / Heartbeat reply carries (default empty: not behind).
  void SetHeartbeatMs(uint64_t ms);
  void SetCatchUp(v1::CatchUpHint hint);

  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest*, v1::JoinReply*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*, v1::HeartbeatReply*) override;
  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest*, v1::LeaveReply*) override;

 private:
  FakeCoordinator() = default;
  RpcSecurity sec_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  mutable absl::Mutex mu_;
  std::vector<v1::JoinRequest> joins_ ABSL_GUARDED_BY(mu_);
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> leaves_ ABSL_GUARDED_BY(mu_);
  bool forget_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t heartbeat_ms_ ABSL_GUARDED_BY(mu_) = 100;
  v1::CatchUpHint catch_up_ ABSL_GUARDED_BY(mu_);
};

// A rollout agent peer that never sends: its FetchStaging holds the stream open until the caller
// cancels it (or 60 s pass). For tests of what a copy from a peer in progress must not block.
class HangingPeer final : public v1::RolloutAgent::Service {
 public:
  static absl::StatusOr<std::unique_ptr<HangingPeer>> Start(RpcSecurity security);
  ~HangingPeer() override;
  const std::string& address() const { return address_; }
  int fetches() const;    // FetchStaging calls so far
  int cancelled() const;  // of which the caller cancelled

  grpc::Status FetchStaging(grpc::ServerContext*, const v1::FetchStagingRequest*,
                            grpc::ServerWriter<v1::StagingChunk>*) override;

 private:
  HangingPeer() = default;
  RpcSecurity sec_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  mutable absl::Mutex mu_;
  int fetches_ ABSL_GUARDED_BY(mu_) = 0;
  int cancelled_ ABSL_GUARDED_BY(mu_) = 0;
};

class AgentProcess {
 public:
  // Starts `binary` with --listen 127.0.0.1:0 --address-file ... plus `args`; waits (10 s) for the
  // address file. `token` is what the stub presents.
  static absl::StatusOr<std::unique_ptr<AgentProcess>> Start(const std::string& binary, const std::string& tag,
                                                             const std::vector<std::string>& args, RpcSecurity sec);
  ~AgentProcess();  // Terminate()

  const std::string& address() const { return address_; }
  v1::RolloutAgent::Stub& stub() { return *stub_; }
  const RpcSecurity& security() const { return sec_; }
  std::string Log() const;
  // Removes the log and address files (after a passing test).
  void RemoveFiles() const;
  // SIGTERM, wait up to 15 s (then SIGKILL); returns the wait status. Idempotent.
  int Terminate();
  bool running() const { return pid_ > 0; }

 private:
  AgentProcess() = default;
  pid_t pid_ = -1;
  int status_ = -1;
  std::string log_, address_file_, address_;
  RpcSecurity sec_;
  std::unique_ptr<v1::RolloutAgent::Stub> stub_;
};

// Polls `done` every 20 ms until it holds or `limit` has passed; returns its last answer. For
// states another process reaches shortly after an event the test saw.
bool WaitUntil(const std::function<bool()>& done, absl::Duration limit);

// A client context with the token and a deadline.
std::unique_ptr<grpc::ClientContext> Context(const RpcSecurity& sec, absl::Duration timeout = absl::Seconds(30));

// The trainer side: a rendezvous store served to the agents, and one stage source per group.
class TrainerSide {
 public:
  static absl::StatusOr<std::unique_ptr<TrainerSide>> Start(RpcSecurity sec);
  ~TrainerSide() { (void)Join(); }  // a test that stopped at a failed ASSERT still ends cleanly
  const std::string& store_address() const { return address_; }
  comm::MemoryStore& store() { return store_; }

  // Forms group `name` of `size` as rank 0 and runs `send` on it, on a thread (one per stage;
  // several may run at once). Join() waits for all of them and returns the first failure of
  // forming a group or of `send`.
  void Run(const std::string& name, int size, std::function<absl::Status(comm::Communicator&)> send);
  absl::Status Join();

 private:
  comm::MemoryStore store_;
  std::unique_ptr<comm::StoreServer> server_;
  std::string address_;
  std::vector<std::thread> threads_;
  std::vector<std::unique_ptr<absl::Status>> results_;
};

}  // namespace wsync::rollout_agent::testing
