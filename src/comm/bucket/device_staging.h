// DeviceStagingSink: the hand-off from buckets built in device memory (the trainer's device
// stages: INT4 kernels and copies on the GPU, comm/bucket/builder.h with a CUDA MemorySpace) to a
// sink of host buckets (BroadcastSink over Gloo, shm or MPI).
//
// Per bucket: one copy of its nbytes from the device into a host buffer (the inner sink's recycled
// one, else a new page-locked one, so the copy runs at the link's speed), then the inner sink's
// Send; the device buffer is kept for the builder's next bucket (Recycle). The copy is synchronous
// on the builder's thread and also surfaces the execution errors of the kernels that filled the
// bucket. The inner sink keeps broadcasting bucket k while the device fills bucket k+1. A host
// bucket passes through untouched.
//
// Memory: at most `max_free_device` device buffers kept (2: the one being filled is the builder's);
// host buffers as the inner sink's (BucketSender: up to three bucket buffers, kept by its pool).
// Ownership: `inner` is not owned and must outlive this sink.
// Errors: the device copy's (kInternal naming the CUDA error, kResourceExhausted when no
// page-locked buffer can be had), then the inner sink's as they are.
// Thread-safety: used by one thread, as every BucketSink.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/bucket/builder.h"

namespace wsync::comm {

struct DeviceStagingStats {
  uint64_t buckets = 0;  // copied from a device
  uint64_t bytes = 0;
  absl::Duration copy;  // in the device-to-host copies (includes waiting for the bucket's kernels)
};

class DeviceStagingSink final : public BucketSink {
 public:
  explicit DeviceStagingSink(BucketSink& inner, int max_free_device = 2);

  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override;
  // A kept device buffer of at least min_bytes, else an empty Buffer (the builder in front builds
  // in device memory; the inner sink's host buffers stay for the staging copies).
  Buffer Recycle(uint64_t min_bytes) override;
  absl::Status Finish() override { return inner_.Finish(); }

  const DeviceStagingStats& stats() const { return stats_; }

 private:
  BucketSink& inner_;
  const size_t max_free_device_;
  std::vector<Buffer> free_device_;
  DeviceStagingStats stats_;
};

}  // namespace wsync::comm
