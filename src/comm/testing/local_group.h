// Test helper: an n-member group inside one process (one thread per member joins), over a store
// the caller owns: real Gloo/TCP on loopback by default (or NCCL, one GPU per member), for tests of
// code that takes a Communicator.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/store/store.h"

namespace wsync::comm::testing {

// The options of member `rank` of a `size`-member group `name` over `store`: join and operation
// timeouts `timeout`, and (NCCL) member r on cuda:r.
GroupOptions LocalMemberOptions(Store& store, const std::string& name, int rank, int size,
                                absl::Duration timeout = absl::Seconds(30));

// The members in rank order, each joined on its own thread (LocalMemberOptions); the first
// formation error if any member failed to join.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalGroup(Store& store, const std::string& name,
                                                                          int size,
                                                                          absl::Duration timeout = absl::Seconds(30),
                                                                          Backend backend = Backend::kGloo);

}  // namespace wsync::comm::testing
