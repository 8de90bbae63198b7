// The sub-communicators one trainer agent uses in a sync, cut out of the `mpirun` world with
// Split (MPI_Comm_split) following the Megatron rank layout (layout/parallel_layout.h):
//   tp   the dense tensor-parallel group      ParallelLayout::TpGroup,  comm rank == tp coordinate
//   etp  the expert tensor-parallel group     ParallelLayout::EtpGroup, comm rank == etp coordinate
//   ep   the expert-parallel group            ParallelLayout::EpGroup,  comm rank == ep coordinate
// Each Split uses the group's lowest global rank as colour and the rank's position in the group's
// (ascending) member list as key, and the result is checked: size, rank, and the members' world
// ranks (one small AllGather per group), so a communicator whose rank order differed from the
// layout's would be refused rather than silently mixing up shards or expert ids.
//
// Every rank of the world must call MakeTrainerComms (same order as any other world collective).
// Errors: kInvalidArgument when the world's size differs from the layout's; the Split / AllGather
// errors of the world (kDeadlineExceeded, kAborted, kUnimplemented for a non-MPI world); kInternal
// if a sub-communicator's members differ from the layout's group (named).
// Thread-safety: a TrainerComms is owned by one sync at a time; the communicators themselves are
// thread-safe (comm/communicator.h). `world` is not owned and must outlive the TrainerComms.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "trainer_agent/layout/parallel_layout.h"

namespace wsync::trainer_agent {

struct TrainerComms {
  std::unique_ptr<comm::Communicator> tp, etp, ep;
  comm::Communicator* world = nullptr;  // not owned
};

absl::StatusOr<TrainerComms> MakeTrainerComms(comm::Communicator& world, const ParallelLayout& layout,
                                              const comm::CollectiveOptions& options = {});

}  // namespace wsync::trainer_agent
