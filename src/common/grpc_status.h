// The one mapping between absl::Status (inside wsync) and grpc::Status (on the wire).
//
// absl and gRPC share the canonical code numbering, so codes map one to one; the message is kept.
// Every RPC handler returns ToGrpcStatus(...) and every client converts back with FromGrpcStatus,
// so a kDeadlineExceeded inside a rollout agent reaches wsyncctl as kDeadlineExceeded.
// Thread-safety: pure functions.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace wsync {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace wsync
