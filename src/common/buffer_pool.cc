#include "common/buffer_pool.h"

#include <algorithm>

namespace wsync {

Buffer BufferPool::TryGet(size_t nbytes) {
  absl::MutexLock lock(&mu_);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->size() >= nbytes && (best == free_.end() || it->size() < best->size())) best = it;
  }
  if (best == free_.end()) return Buffer();
  Buffer b = std::move(*best);
  free_.erase(best);
  return b;
}

absl::StatusOr<Buffer> BufferPool::Get(size_t nbytes) {
  if (nbytes == 0) return Buffer();
  Buffer b = TryGet(nbytes);
  if (b.size() > 0) return b;
  std::vector<Buffer> too_small;  // freed outside the lock, before the new allocation
  size_t size = nbytes;
  {
    absl::MutexLock lock(&mu_);
    if (!keep_) too_small.swap(free_);
    high_water_ = std::max(high_water_, nbytes);
    size = high_water_;
  }
  too_small.clear();
  return allocate_ ? allocate_(size) : Buffer::Allocate(size);
}

void BufferPool::Put(Buffer buffer) {
  if (buffer.size() == 0 || buffer.data() == nullptr || max_free_ == 0) return;
  Buffer dropped;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  free_.push_back(std::move(buffer));
  if (free_.size() > max_free_ && !keep_) {
    auto smallest = std::min_element(free_.begin(), free_.end(),
                                     [](const Buffer& a, const Buffer& b) { return a.size() < b.size(); });
    dropped = std::move(*smallest);
    free_.erase(smallest);
  }
}

void BufferPool::Trim() {
  std::vector<Buffer> idle;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  idle.swap(free_);
}

size_t BufferPool::idle_buffers() const {
  absl::MutexLock lock(&mu_);
  return free_.size();
}

size_t BufferPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const Buffer& b : free_) n += b.size();
  return n;
}

}  // namespace wsync
