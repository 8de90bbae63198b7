// Data-plane scenarios shared by the multi-process tests (Gloo members started separately, and
// the MPI ranks under mpirun): every collective over several sizes with every byte checked, and
// the > 2 GiB cases. Each returns OK when its expectations hold, else an error saying which failed.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "comm/communicator.h"

namespace wsync::comm::testing {

absl::Status Expect(bool cond, const std::string& what);
absl::Status CheckBytes(const void* p, size_t n, uint64_t seed, const std::string& what);

// Broadcast / AllGather / AllGatherV / AllReduceSum / Barrier over 0 B .. 9 MiB, many buffers per
// call, in place and not, plus argument checks.
absl::Status Collectives(comm::Communicator& comm);

// A Broadcast of 2 GiB + 4097 B and an AllGatherV of 1 GiB + 3 B per rank.
absl::Status BigTransfers(comm::Communicator& comm);

}  // namespace wsync::comm::testing
