// Leveled logging with a per-process prefix naming the role and rank, e.g.
//   I1121 20:41:07.123456 trainer[3] bucket.cc:88] sent bucket 4 (512.0 MiB) in 212 ms
//
// Usage:  WSYNC_LOG(INFO) << "joined group " << name;
// Levels: DEBUG < INFO < WARNING < ERROR. The threshold comes from SetLogLevel() or the
// WSYNC_LOG_LEVEL environment variable (debug|info|warning|error), read once at first use.
// Messages below the threshold cost one comparison and format nothing.
// Thread-safety: every function may be called from any thread; each message is written to stderr
// with a single write(2), so lines from different threads never interleave.
#pragma once

#include <sstream>
#include <string>

#include "absl/strings/string_view.h"

namespace wsync {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Sets the prefix of every line: role ("trainer", "rollout", "coordinator", "ctl") and rank
// (-1 to omit). Call once at start-up, before threads log.
void SetLogIdentity(absl::string_view role, int rank);
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug", "info", "warning"/"warn", "error" (case-insensitive); false if unknown.
bool ParseLogLevel(absl::string_view text, LogLevel* out);
// A --log-level flag's value: empty leaves the level as it is; a known level is set; an unknown one
// is refused (false) after a line on stderr naming it and the levels.
bool ApplyLogLevelFlag(absl::string_view flag);

// Redirects output (tests); nullptr restores stderr. The sink receives whole lines with '\n'.
using LogSink = void (*)(const std::string& line);
void SetLogSinkForTesting(LogSink sink);

namespace internal {

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Swallows the stream expression in the disabled branch of WSYNC_LOG.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace wsync

#define WSYNC_LOG_LEVEL_DEBUG ::wsync::LogLevel::kDebug
#define WSYNC_LOG_LEVEL_INFO ::wsync::LogLevel::kInfo
#define WSYNC_LOG_LEVEL_WARNING ::wsync::LogLevel::kWarning
#define WSYNC_LOG_LEVEL_ERROR ::wsync::LogLevel::kError

#define WSYNC_LOG(severity)                             \
  (WSYNC_LOG_LEVEL_##severity < ::wsync::GetLogLevel()) \
      ? (void)0                                         \
      : ::wsync::internal::Voidify() &                  \
            ::wsync::internal::LogMessage(WSYNC_LOG_LEVEL_##severity, __FILE__, __LINE__).stream()
