// Internal to the rollout agent (agent/*.cc only): the state RolloutAgent keeps of its engine and
// of the sync in progress, its metrics, and small helpers the phase files share.
//
// Ownership: RolloutAgent owns one Engine (engine_) and at most one Sync (sync_); an Engine owns
// the layout, the mapping of the engine's memory and the staging; a Sync owns its store client,
// recorder, loader and receive threads. Metrics points into the agent's registry (not owned).
// Thread-safety: none of its own; the fields are guarded by RolloutAgent's mutexes as noted
// (rollout_agent.h: op_mu_ serializes, mu_ guards the per-sync progress fields).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/store/store.h"
#include "common/metrics.h"
#include "engine_memory/engine_memory.h"
#include "engine_model/engine_layout.h"
#include "engine_model/loader.h"
#include "rollout_agent/agent/engine_client.h"
#include "rollout_agent/agent/rollout_agent.h"
#include "rollout_agent/receive/recorder.h"
#include "rollout_agent/receive/stage_receiver.h"

namespace wsync::rollout_agent {

enum class RolloutAgent::Phase { kBeginning, kReceiving, kPrepared, kCommitting };

// The name of a RolloutAgent::Phase (as int: the enum is private), for error messages.
inline const char* PhaseName(int p) {
  static const char* kNames[] = {"beginning", "receiving", "prepared", "committing"};
  return kNames[p];
}

inline double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// Chunks of FetchStaging and ReadEngine: well under gRPC's 4 MiB message limit.
inline constexpr size_t kStagingChunk = size_t{1} << 20;

struct RolloutAgent::Engine {
  v1::RegisterEngineRequest info;  // without params
  std::string layout_key;          // equal keys: equal layouts (config, quantization, parallel)
  std::unique_ptr<engine_model::EngineLayout> layout;
  std::unique_ptr<engine_memory::EngineMemory> memory;
  std::unique_ptr<engine_model::Staging> staging;  // points at *layout
  std::shared_ptr<EngineClient> client;            // shared: RegisterEngine checks the engine outside op_mu_
};

struct RolloutAgent::Sync {
  v1::BeginSyncRequest req;
  uint64_t id = 0;
  uint64_t previous_version = 0;
  absl::Duration timeout;
  comm::Backend backend = comm::Backend::kGloo;
  int cuda_device = 0;                     // the GPU an NCCL sync receives on (ReceiveDevice)
  std::unique_ptr<FormationLatch> formed;  // NCCL: every stage's group formed before any receives
  SyncCancel cancel;
  std::unique_ptr<comm::GrpcStoreClient> store;
  std::unique_ptr<Recorder> recorder;
  std::unique_ptr<engine_model::Loader> loader;
  std::vector<std::thread> threads;  // touched under op_mu_ only
  // Guarded by the agent's mu_:
  Phase phase = Phase::kBeginning;
  bool engine_paused = false;
  absl::Time paused_at;      // when Pause was sent (the engine's downtime runs from here to Continue)
  int running = 0;           // receive threads not yet finished
  absl::Status first_error;  // the first stage error, or the staging's CheckComplete
  StageStats totals;         // summed over stages (transfer: the longest)
  int rpcs = 0;              // RPCs for this sync in progress (the watchdog waits while > 0)
  absl::Time idle_since;
  v1::PrepareSyncReply prepared;
};

struct RolloutAgent::Metrics {
  Counter* syncs = nullptr;
  Counter* failures = nullptr;
  Counter* bytes = nullptr;
  Counter* buckets = nullptr;
  Counter* tensors = nullptr;
  Gauge* version = nullptr;
  Gauge* active = nullptr;
  Gauge* registered = nullptr;
  std::map<std::string, Histogram*> phase;

  void Observe(const std::string& p, absl::Duration d) const {
    auto it = phase.find(p);
    if (it != phase.end()) it->second->Observe(Seconds(d));
  }
};

}  // namespace wsync::rollout_agent
