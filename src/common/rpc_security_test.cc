#include "common/rpc_security.h"

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"

namespace wsync {
namespace {

TEST(RpcSecurityTest, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(RpcSecurityTest, BucketMacFollowsTheTokenUnlessSet) {
  RpcSecurity none, token;
  token.token = "secret";
  for (const RpcSecurity* sec : {&none, &token}) {
    EXPECT_TRUE(*ResolveBucketMac("on", *sec));
    EXPECT_FALSE(*ResolveBucketMac("off", *sec));
  }
  EXPECT_FALSE(*ResolveBucketMac("auto", none));
  EXPECT_TRUE(*ResolveBucketMac("auto", token));
  auto bad = ResolveBucketMac("yes", token);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_NE(bad.status().message().find("\"yes\""), std::string::npos) << bad.status();
}

TEST(RpcSecurityTest, TokenFromFileAndErrors) {
  const std::string path = ::testing::TempDir() + "/token";
  std::ofstream(path) << "  s3cret\n";
  RpcSecurityOptions o;
  o.token_file = path;
  auto sec = LoadRpcSecurity(o);
  ASSERT_TRUE(sec.ok()) << sec.status();
  EXPECT_EQ(sec->token, "s3cret");
  std::ofstream(path) << "\n";
  EXPECT_TRUE(absl::IsInvalidArgument(LoadRpcSecurity(o).status()));
  o.token_file = ::testing::TempDir() + "/missing-token";
  EXPECT_TRUE(absl::IsNotFound(LoadRpcSecurity(o).status()));
  RpcSecurityOptions cert_only;
  cert_only.tls_cert_file = path;
  EXPECT_TRUE(absl::IsInvalidArgument(LoadRpcSecurity(cert_only).status()));
}

}  // namespace
}  // namespace wsync
