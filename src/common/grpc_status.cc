#include "common/grpc_status.h"

#include <string>

namespace wsync {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  // Codes 1..16 are shared by both enums; anything else (a peer speaking a newer dialect) is kUnknown.
  const absl::StatusCode mapped =
      (code >= 1 && code <= 16) ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return absl::Status(mapped, status.error_message());
}

}  // namespace wsync
