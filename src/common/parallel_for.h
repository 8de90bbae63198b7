// The one parallel-for of wsync: CPU kernels, the loader's transposes, repack, checksums and the
// coordinator's fan-out of RPCs all split their work through these two functions.
//
//   ParallelFor(n, threads, min_per_thread, fn)  runs fn(begin, end) over [0, n) split into up to
//       `threads` contiguous ranges (0: the hardware's concurrency) of at least `min_per_thread`
//       units each; the caller's thread runs the first range. Ranges are disjoint and cover
//       [0, n) in order, so a fn that writes only its own range needs no locking.
//   RunConcurrently(n, fn)  runs fn(i) for every i in [0, n) on a thread each (for blocking
//       work such as RPCs) and returns the statuses in order.
//   RunTasks(threads, n, fn)  runs fn(0) .. fn(n - 1) on up to `threads` threads (the caller's
//       included), taking tasks in order as threads free up, and returns the error of the
//       lowest-numbered failing task, so the result does not depend on the thread count; tasks
//       numbered above a known failure are skipped.
//
// Both block until every call has returned. fn must not throw.
// Thread-safety: fn is called concurrently from several threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace wsync {

inline int DefaultThreads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

inline void ParallelFor(int64_t n, int threads, int64_t min_per_thread, absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  if (threads <= 0) threads = DefaultThreads();
  int64_t parts = std::min<int64_t>(threads, n);
  if (min_per_thread > 1) parts = std::min<int64_t>(parts, std::max<int64_t>(1, n / min_per_thread));
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(parts - 1));
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t b = n * i / parts, e = n * (i + 1) / parts;
    pool.emplace_back([fn, b, e] { fn(b, e); });
  }
  fn(0, n / parts);
  for (std::thread& t : pool) t.join();
}

inline std::vector<absl::Status> RunConcurrently(size_t n, absl::FunctionRef<absl::Status(size_t)> fn) {
  std::vector<absl::Status> out(n);
  std::vector<std::thread> pool;
  pool.reserve(n);
  for (size_t i = 0; i < n; ++i) pool.emplace_back([fn, &out, i] { out[i] = fn(i); });
  for (std::thread& t : pool) t.join();
  return out;
}

inline absl::Status RunTasks(int threads, size_t count, absl::FunctionRef<absl::Status(size_t)> fn) {
  if (count == 0) return absl::OkStatus();
  std::atomic<size_t> next{0};
  std::atomic<size_t> first_bad{std::numeric_limits<size_t>::max()};
  std::vector<absl::Status> status(count);
  auto work = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= count) return;
      if (i > first_bad.load()) continue;
      status[i] = fn(i);
      if (status[i].ok()) continue;
      size_t cur = first_bad.load();
      while (i < cur && !first_bad.compare_exchange_weak(cur, i)) {
      }
    }
  };
  const size_t n = std::min(static_cast<size_t>(std::max(threads, 1)), count);
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  for (size_t k = 1; k < n; ++k) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  const size_t bad = first_bad.load();
  return bad == std::numeric_limits<size_t>::max() ? absl::OkStatus() : status[bad];
}

}  // namespace wsync
