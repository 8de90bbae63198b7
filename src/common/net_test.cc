#include "common/net.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace wsync {
namespace {

using ::testing::HasSubstr;

TEST(NetTest, SplitAndJoinHostPort) {
  auto a = SplitHostPort("10.0.0.7:7070");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "10.0.0.7");
  EXPECT_EQ(a->port, 7070);
  auto b = SplitHostPort("[fd00::1]:0");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "fd00::1");
  EXPECT_EQ(b->port, 0);
  EXPECT_EQ(JoinHostPort("fd00::1", 5), "[fd00::1]:5");
  EXPECT_EQ(JoinHostPort("trainer-0", 7070), "trainer-0:7070");
  for (const char* bad : {"10.0.0.7", "10.0.0.7:", "10.0.0.7:70000", "fd00::1:80", "[fd00::1]80", ":x"}) {
    auto r = SplitHostPort(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr(bad));
  }
}

TEST(NetTest, LocalAddressFacingLoopbackIsLoopback) {
  auto a = LocalAddressFacing("127.0.0.1:7070");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, "127.0.0.1");
  auto w = LocalAddressFacing("0.0.0.0:7070");
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IsWildcardHost("0.0.0.0") && IsWildcardHost("::") && !IsWildcardHost("127.0.0.1"));
  auto n = LocalAddressFacing("no-such-host.invalid:1");
  EXPECT_EQ(n.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace wsync
