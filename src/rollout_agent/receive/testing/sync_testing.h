// Test helpers for the rollout agent, used by its unit and integration tests (not by the agent):
//
//   PackBuckets      the trainer side's bucketing: sent HF tensors -> flat buffers + manifests.
//   SendBuckets      broadcasts them as the stage source (group rank 0) through BucketSender;
//   SendRawBucket    one bucket without BucketSender, optionally with a wrong checksum.
//
// Thread-safety: plain values / one owner.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "common/tensor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::rollout_agent::testing {

struct PackedBucket {
  v1::BucketManifest manifest;  // version, pp_stage, index, last, entries (nbytes / xxh3 set by the sender)
  Buffer data;
  uint64_t nbytes = 0;
};

struct PackOptions {
  uint64_t version = 1;
  uint32_t pp_stage = 0;
  uint64_t bucket_bytes = uint64_t{1} << 20;  // a bigger tensor gets a bucket of its own
  bool empty_last = false;                    // end with an empty bucket carrying `last`
};

// Packs `tensors` in order; entries are 64-byte aligned inside a bucket.
absl::StatusOr<std::vector<PackedBucket>> PackBuckets(const std::vector<std::pair<std::string, TensorView>>& tensors,
                                                      const PackOptions& options);

// Sends every bucket through a BucketSender rooted at group rank 0 and waits for all of them.
absl::Status SendBuckets(comm::Communicator& comm, std::vector<PackedBucket> buckets);
// The wire protocol of comm/bucket/stream.h by hand: header + (manifest, data) broadcasts from rank 0,
// with nbytes set and the XXH3 of the data (flipped in its lowest bit if `corrupt_checksum`).
absl::Status SendRawBucket(comm::Communicator& comm, v1::BucketManifest manifest, const Buffer& data, uint64_t nbytes,
                           bool corrupt_checksum);

}  // namespace wsync::rollout_agent::testing
