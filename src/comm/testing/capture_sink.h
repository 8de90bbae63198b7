// Test helper: a BucketSink that keeps a copy of every bucket it is handed, in order, for tests of
// whatever builds buckets (the builder, a rank's sync, packed test streams).
//
// Send copies the bucket's nbytes of data and keeps the buffer for Recycle, which hands buffers
// back oldest first (an empty Buffer when none is free); Send fails with `error` while it is set;
// Finish counts its calls. Thread-safety: used by one thread, as every BucketSink. Pattern() makes
// the seeded bytes such tests send.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "comm/bucket/builder.h"
#include "common/tensor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::comm::testing {

class CaptureSink : public BucketSink {
 public:
  struct Bucket {
    v1::BucketManifest manifest;
    std::vector<std::byte> data;        // a copy of the bucket's nbytes
    const std::byte* buffer = nullptr;  // the memory it was sent from (to see buffers reused)
  };

  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override {
    if (!error.ok()) return error;
    if (nbytes > data.size()) return absl::InternalError("nbytes beyond the buffer");
    if (data.device() >= 0) return absl::InvalidArgumentError("CaptureSink takes host buckets");
    Bucket b;
    b.manifest = std::move(manifest);
    b.data.assign(data.data(), data.data() + nbytes);
    b.buffer = data.data();
    buckets.push_back(std::move(b));
    free.push_back(std::move(data));
    return absl::OkStatus();
  }
  Buffer Recycle(uint64_t) override {
    if (free.empty()) return Buffer();
    Buffer b = std::move(free.front());
    free.pop_front();
    return b;
  }
  absl::Status Finish() override {
    ++finishes;
    return absl::OkStatus();
  }

  std::vector<Bucket> buckets;
  std::deque<Buffer> free;  // sent buffers not yet recycled
  absl::Status error;       // when set, Send fails with it
  int finishes = 0;
};

// n bytes of a seeded pseudo-random pattern (mt19937), the same for the same seed: test tensors.
inline std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

}  // namespace wsync::comm::testing
