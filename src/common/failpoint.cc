#include "common/failpoint.h"

#include <atomic>
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

constexpr absl::string_view kKnown[] = {"bucket.corrupt"};

struct Point {
  std::string name;
  int64_t only = 0;  // 0: every hit; K: the K-th hit only
  int64_t hits = 0;
};

struct Registry {
  absl::Mutex mu;
  std::vector<Point> points ABSL_GUARDED_BY(mu);
  std::atomic<bool> armed{false};

  void Load(absl::string_view spec) {
    absl::MutexLock lock(&mu);
    points.clear();
    for (absl::string_view entry : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
      std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits(':', 1));
      Point p;
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
  absl::MutexLock lock(&r.mu);
  for (Point& p : r.points) {
    if (p.name != name) continue;
    ++p.hits;
    if (p.only == 0 || p.hits == p.only) {
      WSYNC_LOG(WARNING) << "failpoint " << p.name << " fires (hit " << p.hits << ")";
      return true;
    }
  }
  return false;
}

void ArmFailpointsForTest(absl::string_view spec) { Get().Load(spec); }

}  // namespace wsync
