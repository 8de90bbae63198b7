// The MPI backend: the trainer agents' `mpirun` world and its sub-communicators (TP, EP, ETP, PP,
// DP groups through Split = MPI_Comm_split).
//
// Threads: every communicator runs its operations on its own worker thread, so the process makes
// MPI calls from several threads at once; MPI is therefore initialized with MPI_THREAD_MULTIPLE,
// and creation fails with kFailedPrecondition if the library provides less.
//
// Bounded operations: each collective is issued non-blocking (MPI_Ibcast, MPI_Iallgather(v)) and
// polled with MPI_Test until done, its deadline, or Abort. Counts above INT_MAX bytes are split:
// broadcasts into pieces of at most 1 GiB; gathers whose counts or displacements do not fit an int
// run as one chunked broadcast per rank.
// MPI cannot cancel a collective. After a timeout or an Abort the operation returns at once, but
// its requests stay posted and MPI may still write the buffers until the peers finish their part:
// the communicator is broken, and the owning process is expected to exit (the trainer agents are
// one `mpirun` job, which mpirun tears down as a whole). Shutdown() waits up to the default timeout
// for such requests before releasing the communicator, and skips MPI_Finalize if they never finish.
// A dead rank is handled by mpirun, which terminates the job.
//
// Thread-safety: as Communicator.
#pragma once

#include <memory>

#include "comm/queued_communicator.h"

namespace wsync::comm {

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorldCommunicator(const MpiOptions& options);

}  // namespace wsync::comm
