// The names one sync uses in the coordinator's rendezvous store, in one place for both writers and
// readers: the coordinator (sends the group names in BeginSync, reads the progress for WatchSync)
// and the trainer agent (its stage sources form the groups and count progress).
//
//   sync-<id>/pp<stage>          the data-plane group of one pipeline stage (comm/rendezvous.h
//                                prefixes its own keys with it); broadcast delivery
//   sync-<id>/pp<stage>/s<k>/g<g> sharded delivery: one group per stage, sender and receiver group
//   sync-<id>/progress/bytes     data bytes the stage sources have streamed so far (summed)
//   sync-<id>/progress/buckets   buckets they have streamed so far (summed)
//   sync-<id>/abandoned          a counter the coordinator sets (> 0) when the sync fails: trainer
//                                ranks still forming its data-plane groups stop waiting for agents
//                                that have aborted
// The keys of a sync are dropped when the next one ends (a late member of an ended sync then fails
// to join within its timeout, as it would anyway).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace wsync::trainer_agent {

// Every key of one sync starts with this (the coordinator drops them once the sync is over).
inline std::string SyncKeyPrefix(uint64_t sync_id) { return absl::StrCat("sync-", sync_id, "/"); }
inline std::string SyncGroupName(uint64_t sync_id, int pp_stage) {
  return absl::StrCat(SyncKeyPrefix(sync_id), "pp", pp_stage);
}
// Sharded delivery: the data-plane group from sender `sender` (its index among the stage's
// senders, trainer_agent/sync/rank_sync.h StageSenders) to receiver group `group` in `pp_stage`.
inline std::string ShardGroupName(uint64_t sync_id, int pp_stage, int sender, int group) {
  return absl::StrCat(SyncGroupName(sync_id, pp_stage), "/s", sender, "/g", group);
}
// The prefix of a sync's progress counters; the counters are SyncProgressPrefix(id) + kProgress*.
inline std::string SyncProgressPrefix(uint64_t sync_id) { return absl::StrCat(SyncKeyPrefix(sync_id), "progress/"); }
inline constexpr char kProgressBytes[] = "bytes";
inline constexpr char kProgressBuckets[] = "buckets";
inline std::string SyncAbandonedKey(uint64_t sync_id) { return absl::StrCat(SyncKeyPrefix(sync_id), "abandoned"); }

}  // namespace wsync::trainer_agent
