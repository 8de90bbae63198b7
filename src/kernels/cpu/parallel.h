// Internal: how the CPU kernels split their work over threads (common/parallel_for.h) and collect
// the smallest failing index from them. Thread-safety: ParallelForBytes calls fn concurrently on
// disjoint ranges; AtomicMin is lock-free.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common/parallel_for.h"

namespace wsync::kernels::cpu {

// fn(begin, end) over [0, units) on up to `threads` threads, giving each range at least
// `min_bytes` of input (`unit_bytes` per unit; min_bytes 0 = no minimum).
template <typename Fn>
void ParallelForBytes(int64_t units, int threads, int64_t unit_bytes, int64_t min_bytes, Fn fn) {
  const int64_t min_units = min_bytes > 0 ? (min_bytes + unit_bytes - 1) / std::max<int64_t>(1, unit_bytes) : 1;
  ::wsync::ParallelFor(units, std::max(threads, 1), min_units, fn);
}

// target = min(target, value).
inline void AtomicMin(std::atomic<int64_t>& target, int64_t value) {
  int64_t cur = target.load();
  while (value < cur && !target.compare_exchange_weak(cur, value)) {
  }
}

}  // namespace wsync::kernels::cpu
