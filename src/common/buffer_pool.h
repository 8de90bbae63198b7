// BufferPool: large buffers kept for reuse across buckets and across syncs.
//
// Why: a bucket is hundreds of MiB. A fresh allocation of that size is a fresh mmap, and the first
// write to each 4 KiB page costs a page fault, a zeroed page and a memory-cgroup charge; on the
// end-to-end bench that was about a tenth of all CPU time of a sync (perf, docs/sync.md). Agents
// keep one pool for their lifetime, so after the first sync the buckets land in pages that are
// already mapped.
//
// Ownership: Get() hands out a Buffer the caller owns; Put() gives it back (or the caller simply
// drops it). The pool keeps at most `max_free` idle buffers; when a Put() would exceed that, the
// smallest idle buffer is freed. Memory stays bounded by what is in use: when no idle buffer fits
// a Get(), the idle ones (all too small) are freed before allocating, and the new buffer takes the
// largest size ever asked for, so buckets of varying sizes converge on buffers that fit them all
// (the memory of K buffers in use is then at most K x the largest bucket).
// Memory: host memory by default; a pool may allocate elsewhere (device memory of a CUDA device
// for the NCCL data plane's buckets, page-locked host memory for the copies to and from it), given
// an allocator: every buffer it hands out comes from it.
// Thread-safety: all methods may be called from any thread.
// Errors: Get() returns kResourceExhausted when a needed allocation fails (or the allocator's error).
#pragma once

#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/tensor.h"

namespace wsync {

class BufferPool {
 public:
  using Allocator = std::function<absl::StatusOr<Buffer>(size_t nbytes)>;
  // `keep_until_trim`: the pool frees nothing until Trim() (Put keeps every buffer, past
  // max_free; Get allocates beside idle buffers that are too small instead of freeing them). For
  // device and page-locked memory used beside NCCL: a cudaFree / cudaFreeHost waits for the whole
  // device, and must not run while an NCCL operation there waits for this process.
  explicit BufferPool(size_t max_free = 2, Allocator allocate = nullptr, bool keep_until_trim = false)
      : max_free_(max_free), allocate_(std::move(allocate)), keep_(keep_until_trim) {}

  // A buffer of at least `nbytes` (size() may be larger): the smallest idle one that fits, else a
  // new allocation of max(nbytes, the largest size asked for so far), after freeing the idle
  // buffers. Its contents are unspecified.
  absl::StatusOr<Buffer> Get(size_t nbytes);
  // The smallest idle buffer of at least `nbytes`, or an empty Buffer if none fits.
  Buffer TryGet(size_t nbytes);
  // Returns `buffer` to the pool (empty buffers are ignored).
  void Put(Buffer buffer);

  // Frees every idle buffer (a keep_until_trim pool's owner calls it when no NCCL operation runs).
  void Trim();

  size_t idle_buffers() const;
  size_t idle_bytes() const;
  size_t max_free() const { return max_free_; }

 private:
  const size_t max_free_;
  const Allocator allocate_;  // null: Buffer::Allocate
  const bool keep_;
  mutable absl::Mutex mu_;
  std::vector<Buffer> free_ ABSL_GUARDED_BY(mu_);
  size_t high_water_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace wsync
