#include "comm/rendezvous.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace wsync::comm {

absl::Status JoinGroup(Store& store, const std::string& group, int rank, int size, const std::string& value,
                       absl::Duration timeout, const std::function<bool()>& cancelled) {
  RETURN_IF_ERROR(store.Set(absl::StrCat(group, "/joined/", rank), value));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(absl::StrCat(group, "/joined/", r));
  const absl::Status joined =
      WaitUnlessCancelled(store, keys, timeout, cancelled, absl::StrCat("joining group \"", group, "\""));
  if (!absl::IsDeadlineExceeded(joined)) return joined;
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (!store.Get(keys[r], absl::ZeroDuration()).ok()) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat("ranks [", absl::StrJoin(missing, ", "), "] of ", size,
                                                  " did not join within ", absl::FormatDuration(timeout)));
}

absl::Status WaitUnlessCancelled(Store& store, const std::vector<std::string>& keys, absl::Duration timeout,
                                 const std::function<bool()>& cancelled, absl::string_view what) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const absl::Duration slice =
        cancelled ? std::min(absl::Milliseconds(200), deadline - absl::Now()) : deadline - absl::Now();
    absl::Status s = store.Wait(keys, std::max(slice, absl::ZeroDuration()));
    if (!absl::IsDeadlineExceeded(s) || absl::Now() >= deadline) return s;
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat(what, " was cancelled"));
  }
}

}  // namespace wsync::comm
