// What the pieces of SyncCoordinator share (sync_coordinator.cc, sync_coordinator_membership.cc,
// sync_coordinator_state.cc, sync_coordinator_run.cc); nothing outside coordinator/ includes it.
// Member and SyncRecord are plain values owned by SyncCoordinator (members_, syncs_) and guarded by
// its mu_; a sync's thread works on copies of the Members (their clients are shared_ptrs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "plan/delivery_plan.h"
#include "trainer_agent/coordinator/agent_client.h"
#include "trainer_agent/coordinator/sync_coordinator.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::trainer_agent {

// One rollout agent in the membership (Join), as of its last Join or Heartbeat.
struct SyncCoordinator::Member {
  std::string id, address, engine_id;
  std::string quant_json;  // the engine's quantization_config ("" = bf16)
  uint32_t tp_rank = 0, tp_size = 1, ep_size = 1;
  bool mtp_draft = false;  // the engine serves the NextN draft too (JoinRequest.mtp_draft)
  uint64_t version = 0;
  uint64_t staged_version = 0;  // what a delta can apply to (JoinRequest.staged_version)
  absl::Time last_seen;
  std::shared_ptr<AgentClient> client;

  // What makes two members' engine ranks hold the same bytes (the peers of a catch-up): TP size
  // and rank, EP size, NextN draft.
  std::tuple<uint32_t, uint32_t, uint32_t, bool> rank_layout() const { return {tp_size, tp_rank, ep_size, mtp_draft}; }
};

// One sync from its trigger to its end (and, finished, its timings: the newest kKeptTimings).
struct SyncCoordinator::SyncRecord {
  uint64_t id = 0, version = 0;
  plan::Delivery delivery = plan::Delivery::kBroadcast;
  DeltaMode delta = DeltaMode::kOff;
  // What the sync sent as deltas (TimingsReply's delta_base .. changed_items; base 0: in full).
  v1::TimingsReply delta_figures;
  std::string phase = "queued";
  std::string error;
  absl::Time start;
  bool finished = false;
  std::vector<v1::MemberState> members;
  std::vector<PhaseTime> phases;
  uint64_t bytes = 0;
  uint64_t expected_bytes = 0;
};

namespace coordinator_internal {

// TimingsReply's delta fields (delta_base .. undigested_groups) from `from` into `to`.
inline void CopyDeltaFigures(const v1::TimingsReply& from, v1::TimingsReply* to) {
  to->set_delta_base(from.delta_base());
  to->set_tensor_bytes(from.tensor_bytes());
  to->set_sent_bytes(from.sent_bytes());
  to->set_delta_items(from.delta_items());
  to->set_changed_items(from.changed_items());
  to->set_quant_groups(from.quant_groups());
  to->set_reused_groups(from.reused_groups());
  to->set_undigested_groups(from.undigested_groups());
}

// The history a coordinator keeps, in memory and in its state file: the newest attempts
// (`wsyncctl versions`) and the newest finished syncs' records (timings, members).
inline constexpr size_t kKeptVersions = 1000, kKeptTimings = 64;

// The registry's metric, or a private one that nobody reads when there is no registry (`m` null).
Gauge* GaugeOf(MetricsRegistry* m, absl::string_view name, absl::string_view help, const Labels& labels = {});
Counter* CounterOf(MetricsRegistry* m, absl::string_view name, absl::string_view help);
Histogram* HistogramOf(MetricsRegistry* m, absl::string_view name, absl::string_view help, const Labels& labels);

}  // namespace coordinator_internal
}  // namespace wsync::trainer_agent
