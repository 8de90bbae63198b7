// Group formation through the rendezvous Store, shared by the store-bootstrapped backends (Gloo,
// NCCL): every member announces itself under "<group>/joined/<rank>" (the value is free-form, e.g.
// its host) and waits for all others; a member that does not come is named.
// Thread-safety: stateless; safe from any thread.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/store/store.h"

namespace wsync::comm {

// OK once all `size` members of `group` have joined; kDeadlineExceeded after `timeout` with
// "ranks [2, 5] did not join within 30s"; kUnavailable if the store is unreachable.
// `cancelled` (may be empty) is polled every 200 ms: true gives kCancelled.
absl::Status JoinGroup(Store& store, const std::string& group, int rank, int size, const std::string& value,
                       absl::Duration timeout, const std::function<bool()>& cancelled = {});

// store.Wait(keys, timeout), in slices of 200 ms between which `cancelled` (may be empty: one
// plain Wait) is polled: true gives kCancelled naming `what`.
absl::Status WaitUnlessCancelled(Store& store, const std::vector<std::string>& keys, absl::Duration timeout,
                                 const std::function<bool()>& cancelled, absl::string_view what);

}  // namespace wsync::comm
