#include "common/status.h"

#include <cerrno>
#include <cstring>

namespace wsync {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

absl::Status ErrnoToStatus(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR: return absl::NotFoundError(msg);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case ENOMEM:
    case EDQUOT: return absl::ResourceExhaustedError(msg);
    case EEXIST: return absl::AlreadyExistsError(msg);
    case EINVAL: return absl::InvalidArgumentError(msg);
    case ETIMEDOUT: return absl::DeadlineExceededError(msg);
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH: return absl::UnavailableError(msg);
    default: return absl::InternalError(msg);
  }
}

}  // namespace wsync
