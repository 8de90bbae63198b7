// The test main's promise: every test process writes under its own TempDir(), private, inherited by
// the processes it starts.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::EndsWith;

TEST(TestMain, TempDirIsPrivateToThisProcess) {
  const std::string dir = ::testing::TempDir();
  EXPECT_THAT(dir, EndsWith(absl::StrCat("/wt.", getpid(), "/")));
  struct stat st;
  ASSERT_EQ(stat(dir.c_str(), &st), 0) << dir;
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_NE(std::getenv("WSYNC_TEST_TMPDIR_OWNER"), nullptr);
  EXPECT_EQ(std::string(std::getenv("WSYNC_TEST_TMPDIR_OWNER")), std::to_string(getpid()));
}

TEST(TestMain, AChildProcessInheritsTheDirectory) {
  const std::string marker = ::testing::TempDir() + "from_child";
  // A shell started by the test writes where TEST_TMPDIR points: the parent's directory.
  ASSERT_EQ(std::system("echo ok > \"$TEST_TMPDIR/from_child\""), 0);
  struct stat st;
  EXPECT_EQ(stat(marker.c_str(), &st), 0) << marker;
}

}  // namespace
