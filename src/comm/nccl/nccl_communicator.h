// The NCCL backend (GPU hosts): a group formed through the rendezvous Store (rank 0 publishes the
// ncclUniqueId under "<group>/nccl_id"), on `GroupOptions::cuda_device`, with device buffers.
//
// Bounded operations: the communicator is created non-blocking (ncclConfig_t.blocking = 0). Each
// operation is launched on the communicator's own stream as one NCCL group call (many buffers,
// one ncclGroupStart/End), after the work already enqueued on the device's legacy default stream
// (which filled its buffers: MemorySpace copies, kernels); the worker polls ncclCommGetAsyncError
// until the launch has left ncclInProgress, then the stream's event and ncclCommGetAsyncError
// until done, the deadline, or Abort; on timeout, abort or an asynchronous error it calls
// ncclCommAbort, after which NCCL no longer touches the buffers. AllGatherV is a group of
// ncclBroadcast calls, one per rank (the usual NCCL idiom).
//
// Formation is bounded the same way: joining the rendezvous, waiting for rank 0's unique id, and
// ncclCommInitRankConfig (polled, aborted on the deadline) all end with kCancelled within about
// 200 ms once `GroupOptions::cancelled` says so (a sync abandoned while a member never comes).
//
// Memory: operations must not wait in cudaFree / cudaFreeHost while another NCCL group on the same
// GPU has an operation in flight that waits for this process (a cudaFree waits for the whole
// device): the bucket streams' pools keep their buffers for the whole sync (docs/comm.md).
// Compiled and linked wherever CUDA and NCCL are installed; its tests skip without a GPU.
// Thread-safety: as Communicator.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace wsync::comm {

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const GroupOptions& options);
// The same members as `parent`, in its rank order, formed without a store: see CreateGroupOver.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorOver(Communicator& parent,
                                                                         const GroupOptions& options,
                                                                         const CollectiveOptions& collective,
                                                                         const absl::Status& ready);

}  // namespace wsync::comm
