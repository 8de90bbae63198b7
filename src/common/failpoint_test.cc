// Failpoints: unarmed by default, NAME fires on every hit, NAME:K on the K-th hit only; unknown
// names and malformed counts are ignored.
#include "common/failpoint.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

TEST(FailpointTest, ArmedPointsFireAsTold) {
  ArmFailpointsForTest("");
  EXPECT_FALSE(FailpointHit("bucket.corrupt"));
  ArmFailpointsForTest("bucket.corrupt:2");
  EXPECT_FALSE(FailpointHit("bucket.corrupt"));
  EXPECT_TRUE(FailpointHit("bucket.corrupt"));
  EXPECT_FALSE(FailpointHit("bucket.corrupt"));
  EXPECT_FALSE(FailpointHit("something.else"));
  ArmFailpointsForTest(" bucket.corrupt ");
  EXPECT_TRUE(FailpointHit("bucket.corrupt"));
  EXPECT_TRUE(FailpointHit("bucket.corrupt"));
  ArmFailpointsForTest("no.such.point, bucket.corrupt:0, bucket.corrupt:x, bucket.corrupt@explode");
  EXPECT_FALSE(FailpointHit("bucket.corrupt"));
  EXPECT_FALSE(FailpointHit("no.such.point"));
  ArmFailpointsForTest("");
}

}  // namespace
}  // namespace wsync
