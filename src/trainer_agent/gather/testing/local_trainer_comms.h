// Test helper: every world rank's TrainerComms for a ParallelLayout inside one process, so that
// RunRankSync can run on all ranks in threads without mpirun. The world is a local Gloo group
// (comm/testing/local_group.h) over a store the caller owns, named "<name>/world"; every rank then
// splits it with MakeTrainerComms (gather/trainer_comms.h), as the agent does, into its TP / ETP /
// EP groups ("<name>/world/tp@<lowest rank>", ...): all three communicators on every rank (a group
// of one where the layout's group has one member), with comm rank == the rank's position in the
// layout's (ascending) group == its coordinate on that axis.
//
// Ownership: LocalTrainerComms owns every communicator; TrainerComms::world points into `world`,
// so the TrainerComms must not outlive the LocalTrainerComms they came from.
// Errors: the first group formation error (kDeadlineExceeded after `timeout`, ...).
// Thread-safety: each rank's TrainerComms is used by one thread at a time; Abort from any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "trainer_agent/gather/trainer_comms.h"
#include "trainer_agent/layout/parallel_layout.h"

namespace wsync::trainer_agent::testing {

struct LocalTrainerComms {
  std::vector<std::unique_ptr<comm::Communicator>> world;  // world rank order
  std::vector<TrainerComms> ranks;                         // ranks[r]: world rank r's communicators

  // Aborts every communicator (comm::Communicator::Abort): in-flight and later operations of every
  // rank fail with kAborted. For tests that must not hang when a rank does.
  void Abort(absl::string_view reason);
};

// Forms the world (layout.world_size() members) and every TP, ETP and EP group of `layout`.
absl::StatusOr<LocalTrainerComms> MakeLocalTrainerComms(comm::Store& store, const std::string& name,
                                                        const ParallelLayout& layout,
                                                        absl::Duration timeout = absl::Seconds(30));

}  // namespace wsync::trainer_agent::testing
