// Test helper: an n-member Gloo group inside one process (one thread per member joins), over a
// store the caller owns. Real Gloo/TCP on loopback, for tests of code that takes a Communicator.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/store/store.h"

namespace wsync::comm::testing {

// The members in rank order; the first formation error if any member failed to join.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalGroup(Store& store, const std::string& name,
                                                                          int size,
                                                                          absl::Duration timeout = absl::Seconds(30));

}  // namespace wsync::comm::testing
