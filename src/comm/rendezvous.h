// Group formation through the rendezvous Store, shared by the store-bootstrapped backends (Gloo,
// NCCL): every member announces itself under "<group>/joined/<rank>" (the value is free-form, e.g.
// its host) and waits for all others; a member that does not come is named.
// Thread-safety: stateless; safe from any thread.
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/store/store.h"

namespace wsync::comm {

// OK once all `size` members of `group` have joined; kDeadlineExceeded after `timeout` with
// "ranks [2, 5] did not join within 30s"; kUnavailable if the store is unreachable.
// `cancelled` (may be empty) is polled every 200 ms: true gives kCancelled.
absl::Status JoinGroup(Store& store, const std::string& group, int rank, int size, const std::string& value,
                       absl::Duration timeout, const std::function<bool()>& cancelled = {});

}  // namespace wsync::comm
