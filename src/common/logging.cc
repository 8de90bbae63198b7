#include "common/logging.h"

#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"

namespace wsync {
namespace {

std::atomic<int> g_level{-1};  // -1: not yet read from the environment
std::atomic<LogSink> g_sink{nullptr};
std::mutex g_identity_mu;
std::string g_identity = "wsync";  // guarded by g_identity_mu for writes; read after start-up

int LevelFromEnv() {
  LogLevel level = LogLevel::kInfo;
  if (const char* env = std::getenv("WSYNC_LOG_LEVEL")) ParseLogLevel(env, &level);
  return static_cast<int>(level);
}

}  // namespace

void SetLogIdentity(absl::string_view role, int rank) {
  std::lock_guard<std::mutex> lock(g_identity_mu);
  g_identity = rank >= 0 ? absl::StrFormat("%s[%d]", role, rank) : std::string(role);
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

LogLevel GetLogLevel() {
  int l = g_level.load(std::memory_order_relaxed);
  if (l < 0) {
    l = LevelFromEnv();
    g_level.store(l);
  }
  return static_cast<LogLevel>(l);
}

bool ParseLogLevel(absl::string_view text, LogLevel* out) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "debug")
    *out = LogLevel::kDebug;
  else if (t == "info")
    *out = LogLevel::kInfo;
  else if (t == "warning" || t == "warn")
    *out = LogLevel::kWarning;
  else if (t == "error")
    *out = LogLevel::kError;
  else
    return false;
  return true;
}

bool ApplyLogLevelFlag(absl::string_view flag) {
  if (flag.empty()) return true;
  LogLevel level;
  if (!ParseLogLevel(flag, &level)) {
    std::fprintf(stderr, "--log-level: unknown level \"%.*s\" (debug, info, warning or error)\n",
                 static_cast<int>(flag.size()), flag.data());
    return false;
  }
  SetLogLevel(level);
  return true;
}

void SetLogSinkForTesting(LogSink sink) { g_sink.store(sink); }

namespace internal {

LogMessage::LogMessage(LogLevel level, const char* file, int line) {
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm;
  localtime_r(&tv.tv_sec, &tm);
  const char* base = std::strrchr(file, '/');
  std::string identity;
  {
    std::lock_guard<std::mutex> lock(g_identity_mu);
    identity = g_identity;
  }
  stream_ << absl::StrFormat("%c%02d%02d %02d:%02d:%02d.%06d %s %s:%d] ", kLetters[static_cast<int>(level)],
                             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(tv.tv_usec),
                             identity, base ? base + 1 : file, line);
}

LogMessage::~LogMessage() {
  std::string line = stream_.str();
  line.push_back('\n');
  if (LogSink sink = g_sink.load()) {
    sink(line);
    return;
  }
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t w = ::write(STDERR_FILENO, line.data() + off, line.size() - off);
    if (w <= 0) break;
    off += static_cast<size_t>(w);
  }
}

}  // namespace internal
}  // namespace wsync
