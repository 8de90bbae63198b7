// The main() of every wsync gtest binary (wsync_add_test links it instead of gtest_main).
//
// ctest runs each discovered case as its own process, several at once. A case that writes under
// ::testing::TempDir() would share "/tmp/<name>" with the cases of the same binary running beside
// it: CI once saw one case's SetUpTestSuite remove the model directory another case was reading.
// So each test process gets a private directory, <TEST_TMPDIR or /tmp>/wt.<pid> (mode 0700), which
// gtest's TempDir() returns (it reads TEST_TMPDIR), removed when the process returns from main.
// Processes a test starts (members, death-test children) inherit the directory instead of making
// their own: WSYNC_TEST_TMPDIR_OWNER names the process that owns it.

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

// Makes and exports this process's directory; returns it, or "" when a parent's is inherited.
std::string IsolateTempDir() {
  if (std::getenv("WSYNC_TEST_TMPDIR_OWNER") != nullptr) return "";
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string pid = std::to_string(getpid());
  const std::string dir = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/wt." + pid;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);  // left by a crashed process whose pid is reused
  if (mkdir(dir.c_str(), 0700) != 0) {
    std::perror(("wsync test main: mkdir " + dir).c_str());
    std::exit(2);
  }
  setenv("TEST_TMPDIR", dir.c_str(), 1);
  setenv("WSYNC_TEST_TMPDIR_OWNER", pid.c_str(), 1);
  return dir;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  const std::string owned = IsolateTempDir();
  const int rc = RUN_ALL_TESTS();
  if (!owned.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(owned, ec);
  }
  return rc;
}
