// SpaceStagingSink: the hand-off between the memory space buckets are built in and the one the
// sink behind it sends from (BucketSink::space()), when they differ:
//   device -> host   the trainer's device stages (INT4 kernels and copies on the GPU) in front of a
//                    sink of host buckets (BroadcastSink over Gloo, shm or MPI);
//   host -> device   the host stages (a layout with gathers, or --host-stages) in front of the NCCL
//                    data plane, which sends device buckets;
//   device -> other device (a peer copy), for completeness.
//
// Per bucket: one copy of its nbytes into a buffer of the inner sink's space (its recycled one,
// else a new one: page-locked on the host, so the copy runs at the link's speed), then the inner
// sink's Send; the builder's buffer is kept for its next bucket (Recycle). The copy is synchronous
// on the builder's thread in every direction (a host-to-device copy from page-locked memory would
// otherwise still be reading when the builder refills the buffer) and also surfaces the execution
// errors of the kernels that filled the bucket. The inner sink keeps broadcasting bucket k while the builder fills
// bucket k+1. A bucket already in the inner sink's space passes through untouched.
//
// Memory: at most `max_free` builder buffers kept (2: the one being filled is the builder's);
// the inner sink's buffers as it keeps them (BucketSender: up to three, kept by its pool).
// Ownership: `inner` is not owned and must outlive this sink.
// Errors: the copy's (kInternal naming the CUDA error, kResourceExhausted when no buffer can be
// had), then the inner sink's as they are.
// Thread-safety: used by one thread, as every BucketSink.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/bucket/builder.h"

namespace wsync::comm {

struct SpaceStagingStats {
  uint64_t buckets = 0;  // copied to the inner sink's space
  uint64_t bytes = 0;
  absl::Duration copy;  // in the copies (includes waiting for the kernels that filled the bucket)
};

class SpaceStagingSink final : public BucketSink {
 public:
  // `from`: the space the builder in front builds in.
  SpaceStagingSink(BucketSink& inner, MemorySpace from, int max_free = 2);

  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override;
  // A kept builder buffer of at least min_bytes, else an empty Buffer (the inner sink's buffers
  // stay with it, for the staging copies).
  Buffer Recycle(uint64_t min_bytes) override;
  absl::Status Finish() override { return inner_.Finish(); }
  MemorySpace space() const override { return from_; }

  const SpaceStagingStats& stats() const { return stats_; }

 private:
  BucketSink& inner_;
  const MemorySpace from_;
  const size_t max_free_;
  std::vector<Buffer> free_;  // the builder's, in from_
  SpaceStagingStats stats_;
};

}  // namespace wsync::comm
