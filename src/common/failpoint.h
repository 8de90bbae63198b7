// Fault injection for the system tests: named points in the code that misbehave on purpose when
// the process was started with them armed, so that a test can break one step of a real sync (a
// bucket corrupted on the wire, ...) without a mock. Unarmed points cost one relaxed atomic load.
//
//   WSYNC_FAILPOINTS="NAME[:K],..."   NAME fires on every hit, NAME:K on its K-th hit only (1-based,
//                                     counted per process from its start)
//
// The points (grep FailpointHit): "bucket.corrupt" (comm/bucket/stream.cc: the sender flips one
// bit of a bucket's data after hashing it, as a damaged link would; the receiver must refuse it).
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
