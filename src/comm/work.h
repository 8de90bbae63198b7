// A handle on one collective in flight, in the manner of c10d's Work.
//
// A Work is returned by every Communicator operation. The operation runs on the communicator's
// worker (CPU backends) or stream (NCCL); the buffers it was given must stay alive and untouched
// until Wait() has returned (whatever its result: after a failure the backend has stopped touching
// them, except for MPI, see mpi/mpi_communicator.h).
//
// Thread-safety: IsCompleted() and Wait() may be called from any thread, also concurrently.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace wsync::comm {

class Work {
 public:
  virtual ~Work() = default;

  // True once the operation has finished, successfully or not. Never blocks.
  virtual bool IsCompleted() const = 0;

  // Blocks until the operation finishes or `timeout` passes. Returns the operation's own result
  // (OK, kDeadlineExceeded from the operation's timeout, kAborted, kUnavailable, ...), or
  // kDeadlineExceeded if `timeout` passed first: the operation then goes on, bounded by its own
  // timeout (CollectiveOptions), and Wait() may be called again.
  virtual absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration()) = 0;

  // "Broadcast(root 0, 3 buffers, 12.0 MiB) on gloo group \"rollout\" rank 1/3", for messages.
  virtual const std::string& Description() const = 0;
};

}  // namespace wsync::comm
