#include "common/failpoint.h"

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace wsync {
namespace {

constexpr absl::string_view kKnown[] = {
    "bucket.corrupt",        "delta.corrupt",       "rollout.begin",     "rollout.transfer",     "rollout.prepare",
    "rollout.commit",        "engine.pause",        "engine.continue",   "coordinator.transfer", "coordinator.commit",
    "coordinator.committed", "coordinator.prepare", "coordinator.begin", "shm.device_ring_open"};

enum class Action { kReturn, kStop, kKill };

struct Point {
  std::string name;
  int64_t only = 0;  // 0: every hit; K: the K-th hit only
  int64_t hits = 0;
  Action action = Action::kReturn;
};

struct Registry {
  absl::Mutex mu;
  std::vector<Point> points ABSL_GUARDED_BY(mu);
  std::atomic<bool> armed{false};

  void Load(absl::string_view spec) {
    absl::MutexLock lock(&mu);
    points.clear();
    for (absl::string_view entry : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
      Point p;
      std::vector<absl::string_view> with_action = absl::StrSplit(entry, absl::MaxSplits('@', 1));
      if (with_action.size() == 2) {
        const absl::string_view a = absl::StripAsciiWhitespace(with_action[1]);
        if (a == "stop") {
          p.action = Action::kStop;
        } else if (a == "kill") {
          p.action = Action::kKill;
        } else {
          WSYNC_LOG(ERROR) << "WSYNC_FAILPOINTS: \"" << entry << "\": the action must be stop or kill; ignored";
          continue;
        }
      }
      std::vector<absl::string_view> parts = absl::StrSplit(with_action[0], absl::MaxSplits(':', 1));
      p.name = std::string(absl::StripAsciiWhitespace(parts[0]));
      if (parts.size() == 2 && (!absl::SimpleAtoi(parts[1], &p.only) || p.only <= 0)) {
        WSYNC_LOG(ERROR) << "WSYNC_FAILPOINTS: \"" << entry << "\": the hit count must be a positive number; ignored";
        continue;
      }
      bool known = false;
      for (absl::string_view k : kKnown) known = known || k == p.name;
      if (!known) {
        WSYNC_LOG(ERROR) << "WSYNC_FAILPOINTS: no failpoint named \"" << p.name << "\"; ignored";
        continue;
      }
      WSYNC_LOG(WARNING) << "failpoint " << p.name << " armed"
                         << (p.only > 0 ? absl::StrCat(" for hit ", p.only) : std::string(" for every hit"));
      points.push_back(std::move(p));
    }
    armed.store(!points.empty(), std::memory_order_release);
  }
};

Registry& Get() {
  static Registry* r = [] {
    auto* reg = new Registry;
    if (const char* spec = std::getenv("WSYNC_FAILPOINTS"); spec != nullptr) reg->Load(spec);
    return reg;
  }();
  return *r;
}

}  // namespace

bool FailpointHit(absl::string_view name) {
  Registry& r = Get();
  if (!r.armed.load(std::memory_order_acquire)) return false;
  Action action = Action::kReturn;
  {
    absl::MutexLock lock(&r.mu);
    bool fires = false;
    for (Point& p : r.points) {
      if (p.name != name) continue;
      ++p.hits;
      if (p.only == 0 || p.hits == p.only) {
        WSYNC_LOG(WARNING) << "failpoint " << p.name << " fires (hit " << p.hits << ")"
                           << (p.action == Action::kStop   ? ": stopping this process (SIGSTOP)"
                               : p.action == Action::kKill ? ": killing this process (SIGKILL)"
                                                           : "");
        fires = true;
        action = p.action;
        break;
      }
    }
    if (!fires) return false;
  }
  if (action == Action::kStop) {
    std::raise(SIGSTOP);
    return false;  // continued: go on as if nothing happened
  }
  if (action == Action::kKill) std::raise(SIGKILL);
  return true;
}

void ArmFailpointsForTest(absl::string_view spec) { Get().Load(spec); }

}  // namespace wsync
