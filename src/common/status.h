// Error handling for wsync: absl::Status / absl::StatusOr everywhere failure is possible.
//
// Codes carry meaning across the whole project:
//   kInvalidArgument   bad input (shape, dtype, file contents); the message names the file/tensor/values
//   kDeadlineExceeded  a timeout
//   kAborted           an explicit abort (Communicator::Abort, a failed sync)
//   kUnavailable       a lost or unreachable peer
//   kNotFound          a missing file, tensor or key
//   kFailedPrecondition  an operation in the wrong state (e.g. a sync while one is running)
//   kInternal          a bug or an invariant broken inside wsync
// No exception crosses a thread or a library boundary; code that calls throwing libraries
// catches at the call site and converts.
//
// Thread-safety: the macros are expression helpers with no shared state.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define WSYNC_STATUS_CONCAT_INNER_(a, b) a##b
#define WSYNC_STATUS_CONCAT_(a, b) WSYNC_STATUS_CONCAT_INNER_(a, b)

// The one spelling of the status macros in wsync (STYLE.md §3). Kernel code adds
// WSYNC_CUDA_RETURN_IF_ERROR (kernels/cuda/cuda_status.h).

// Evaluates `expr` (an absl::Status) once and returns it from the current function if not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status wsync_status_ = (expr);         \
    if (!wsync_status_.ok()) return wsync_status_; \
  } while (0)

// `lhs = value of rexpr` for an absl::StatusOr<T> rexpr, or returns its error. `lhs` may declare
// a variable: ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  WSYNC_ASSIGN_OR_RETURN_IMPL_(WSYNC_STATUS_CONCAT_(wsync_statusor_, __LINE__), lhs, rexpr)
#define WSYNC_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace wsync {

// Returns `status` with `context + ": "` prepended to its message, same code. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

// POSIX errno -> Status: ENOENT -> kNotFound, EACCES/EPERM -> kPermissionDenied, ENOSPC ->
// kResourceExhausted, others -> kInternal. The message is "<what>: <strerror(errno)>".
absl::Status ErrnoToStatus(int err, absl::string_view what);

}  // namespace wsync
