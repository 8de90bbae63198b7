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
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "trainer_agent/layout/parallel_layout.h"

namespace wsync::trainer_agent {

struct TrainerComms {
  std::unique_ptr<comm::Communicator> tp, etp, ep;
  comm::Communicator* world = nullptr;  // not owned
  // The device gathers' groups: NCCL groups of the same members on this rank's GPU, formed by
  // EnsureDeviceComms for the GPUs every rank's tensors are on (`devices`, by world rank); null for
  // a group of one member (nothing to gather), one this rank does not gather in, and until formed.
  // `stale`: a device gather failed (the group is aborted): the next EnsureDeviceComms forms anew.
  struct Device {
    std::vector<int> devices;
    bool stale = false;
    std::unique_ptr<comm::Communicator> tp, etp, ep;
  } device;
};

absl::StatusOr<TrainerComms> MakeTrainerComms(comm::Communicator& world, const ParallelLayout& layout,
                                              const comm::CollectiveOptions& options = {});

// Forms the NCCL groups (comm::CreateGroupOver the host ones) of `comms` on the GPUs `devices` says
// (world rank -> CUDA device; this rank's is its own): the TP group when `dense` (this rank gathers
// dense parameters), the ETP and EP groups when `experts`; groups of one member are not formed.
// Groups formed for the same `devices` by an earlier sync are kept unless some rank's are stale.
// Collective over the world: every rank calls it with the same `devices` (agreed: rank_sync's
// AgreeOnStart); whether to form anew and whether forming succeeded are voted over the world, so
// every rank returns the same (a failure: every group dropped). Errors: kInvalidArgument for
// `devices` of another size than the world or a host entry (-1); CreateGroupOver's on the rank
// where forming failed (kUnimplemented without NCCL, kFailedPrecondition without the GPU), and
// kFailedPrecondition naming that rank on the others; the world's errors.
absl::Status EnsureDeviceComms(TrainerComms& comms, const std::vector<int>& devices, bool dense, bool experts,
                               const comm::CollectiveOptions& options = {});

}  // namespace wsync::trainer_agent
