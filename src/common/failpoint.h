// Fault injection for the system tests: named points in the code that misbehave on purpose when
// the process was started with them armed, so that a test can break one step of a real sync (a
// bucket corrupted on the wire, ...) without a mock. Unarmed points cost one relaxed atomic load.
//
//   WSYNC_FAILPOINTS="NAME[:K][@ACTION],..."
//       NAME fires on every hit, NAME:K on its K-th hit only (1-based, counted per process from its
//       start). ACTION: none (the call site misbehaves: FailpointHit returns true), stop (the
//       process stops itself with SIGSTOP, as a hung process; after SIGCONT it goes on normally)
//       or kill (SIGKILL, as a crash).
//
// The points (grep FailpointHit):
//   bucket.corrupt     comm/bucket/stream.cc: the sender flips one bit of a bucket's data after
//                      hashing it, as a damaged link would; the receiver must refuse it
//   delta.corrupt      trainer_agent/sync/delta_sink.cc: the sender flips one bit of a delta entry's
//                      payload after summing its result, as a delta from the wrong base would be;
//                      the receiver must refuse it
//   rollout.begin      the rollout agent's BeginSync, before it starts receiving
//   rollout.transfer   the rollout agent, when the first bucket of a sync has arrived
//   rollout.prepare    the rollout agent's PrepareSync, before it waits for its streams
//   rollout.commit     the rollout agent's CommitSync, once its engine is paused, before the repack
//   engine.pause       the reference engine's Pause
//   engine.continue    the reference engine's Continue (the end of a commit)
//   coordinator.begin  the coordinator (trainer rank 0), each time an agent's BeginSync succeeded
//   coordinator.transfer   the coordinator, once every agent began, before the
//                      trainer ranks send
//   coordinator.prepare    the coordinator, once the trainer ranks sent everything, before PrepareSync
//   coordinator.commit the coordinator, once every agent prepared and the commit is in its state
//                      file, before any CommitSync
//   coordinator.committed  the coordinator, when the first agent's CommitSync has succeeded
//   shm.device_ring_open   comm/shm: a member (not rank 0) cannot open the device ring's IPC
//                      handle, as on another GPU without peer access: the group falls back to the host ring
// An unknown name in the variable is logged once and ignored; a malformed entry (K not a positive
// number) is logged and ignored. Thread-safety: FailpointHit is safe from any thread.
#pragma once

#include "absl/strings/string_view.h"

namespace wsync {

// Whether point `name` fires at this hit (always false unless WSYNC_FAILPOINTS arms it).
bool FailpointHit(absl::string_view name);

// Tests: re-reads `spec` as if it were WSYNC_FAILPOINTS, resetting every count.
void ArmFailpointsForTest(absl::string_view spec);

}  // namespace wsync
