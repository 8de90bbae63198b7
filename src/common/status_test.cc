#include "common/status.h"

#include <gtest/gtest.h>

#include <cerrno>

#include "common/grpc_status.h"

namespace wsync {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError(absl::StrCat("odd: ", x));
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status CheckQuarter(int x) {
  RETURN_IF_ERROR(Quarter(x).status());
  return absl::OkStatus();
}

TEST(StatusTest, Macros) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().message(), "odd: 3");
  EXPECT_TRUE(CheckQuarter(12).ok());
  EXPECT_EQ(CheckQuarter(5).code(), absl::StatusCode::kInvalidArgument);
}

TEST(StatusTest, AnnotateAndErrno) {
  auto s = Annotate(absl::NotFoundError("x.safetensors"), "loading rank 3");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "loading rank 3: x.safetensors");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
  EXPECT_EQ(ErrnoToStatus(ENOENT, "open a").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoToStatus(EACCES, "open a").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoToStatus(ECONNREFUSED, "connect").code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(ErrnoToStatus(ENOENT, "open a").message().find("open a: "), absl::string_view::npos);
}

TEST(StatusTest, GrpcMappingRoundTripsEveryCode) {
  for (int c = 0; c <= 16; ++c) {
    const absl::Status s(static_cast<absl::StatusCode>(c), c == 0 ? "" : "msg");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("bcast")).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(ToGrpcStatus(absl::AbortedError("x")).error_message(), "x");
  EXPECT_EQ(FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(20), "new")).code(), absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace wsync
