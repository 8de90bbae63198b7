#include "common/heap.h"

#include <thread>

#include "absl/synchronization/mutex.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace wsync {
namespace {

// One detached thread per process, started on the first request; it lives as long as the process.
class Trimmer {
 public:
  Trimmer() {
    std::thread([this] { Run(); }).detach();
  }
  void Request() {
    absl::MutexLock lock(&mu_);
    pending_ = true;
  }

 private:
  void Run() {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(&pending_));
        pending_ = false;
      }
#if defined(__GLIBC__)
      malloc_trim(0);  // every arena, and the free pages inside them (madvise), not only the top
#endif
    }
  }
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

void RequestHeapTrim() {
  static Trimmer* const trimmer = new Trimmer();  // never destroyed: its thread outlives main's statics
  trimmer->Request();
}

}  // namespace wsync
