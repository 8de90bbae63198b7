// The BucketSink of a stage source in sharded delivery: every full bucket the BucketBuilder hands
// it is cut into one bucket per receiver group, holding only the blocks that group keeps
// (ShardPlan::BlockFor), and each goes to that group's own data-plane stream (a BroadcastSink over
// the group's communicator: the source and the group's agents). A tensor a group keeps whole is a
// plain entry; a cut one an entry with `block` set (docs/bucket_format.md §7). Every group's stream
// has its own indices and ends with its own `last` bucket; a group that keeps nothing of a bucket
// gets no bucket for it (except the last one).
//
// Cost: the cut copies every kept byte once on the source (a row cut is one copy, a column cut
// one 2D copy), one thread per group; the full bucket's buffer is free again as soon as Send
// returns (Recycle hands it back to the builder).
// Memory spaces: the cut runs where the group streams send from (space(): the first group sink's;
// host memory for gloo / shm, the GPU for nccl, where the copies are enqueued on the device's
// legacy default stream, ordered before the NCCL broadcasts and the builder's next bucket). A
// bucket in another space is refused (kFailedPrecondition; stage it first: comm/bucket/space_staging.h).
//
// Failures: a group stream that fails aborts every group's stream (the sync fails anyway) and the
// sink drains: later Sends return OK at once, status() holds the first error. A tensor the plan
// refuses (unknown to the engine layout, wrong shape) fails Send with that error.
// Ownership: owns the group sinks; `plan` is not owned and must outlive the sink.
// Thread-safety: used by one thread (the BucketBuilder's), as every BucketSink.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/bucket/broadcast_sink.h"
#include "comm/bucket/builder.h"
#include "plan/delivery_plan.h"

namespace wsync::plan {

class ShardedSink final : public comm::BucketSink {
 public:
  // `groups[g]` sends group g's stream (ShardPlan group g). `sinks` may be any BucketSinks (tests
  // capture them); for the data plane they are BroadcastSinks and `broadcast` lists them again
  // (same order) so that a failure can abort all of them.
  ShardedSink(const ShardPlan* plan, std::vector<std::unique_ptr<comm::BucketSink>> groups,
              std::vector<comm::BroadcastSink*> broadcast = {});

  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override;
  Buffer Recycle(uint64_t min_bytes) override;
  absl::Status Finish() override;
  MemorySpace space() const override { return groups_.empty() ? MemorySpace::Host() : groups_[0]->space(); }

  // OK, or the first error of a group stream (a plan refusal is returned by Send instead).
  absl::Status status() const;
  // Bytes handed to each group's stream (alignment gaps included), and the time spent cutting.
  const std::vector<uint64_t>& group_bytes() const { return group_bytes_; }
  absl::Duration cut_time() const { return cut_; }

 private:
  struct Cut {  // one group's bucket of a full bucket
    v1::BucketManifest manifest;
    Buffer data;
    uint64_t nbytes = 0;
    bool send = false;
  };
  // Cuts group g's blocks of `full` into a bucket of its own (cut->send false: nothing to send).
  absl::Status CutGroup(int g, const v1::BucketManifest& full, const Buffer& data, Cut* cut);

  const ShardPlan* plan_;
  std::vector<std::unique_ptr<comm::BucketSink>> groups_;
  std::vector<comm::BroadcastSink*> broadcast_;
  std::vector<uint32_t> next_index_;
  std::vector<uint64_t> group_bytes_;
  Buffer spare_;  // the last full bucket's buffer, for Recycle
  absl::Duration cut_;
};

}  // namespace wsync::plan
