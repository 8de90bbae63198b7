// Test helpers for the rollout agent's unit and integration tests (not used by the agent): the
// trainer side of a stage stream.
//
//   PackBuckets      sent HF tensors -> buckets, through the real comm::BucketBuilder
//                    (comm/bucket/builder.h: its layout and manifests), kept in memory so that a
//                    test can send, edit or drop them;
//   SendBuckets      broadcasts them as the stage source (group rank 0) through BucketSender;
//   SendRawBucket    one bucket without BucketSender, optionally with a wrong checksum.
//
// Thread-safety: plain functions; a Communicator is used by one thread at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/bucket/bucket_mac.h"
#include "comm/communicator.h"
#include "common/tensor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::rollout_agent::testing {

struct PackedBucket {
  v1::BucketManifest manifest;  // as the builder made it (xxh3_64 is set by the sender)
  Buffer data;                  // at least nbytes
  uint64_t nbytes = 0;
};

struct PackOptions {
  uint64_t version = 1;
  uint32_t pp_stage = 0;
  uint64_t bucket_bytes = uint64_t{1} << 20;  // a bigger tensor gets a bucket of its own
};

// Packs `tensors` in order with a BucketBuilder; the last bucket has `last` set. Errors: the
// builder's (a bad name or view, kResourceExhausted).
absl::StatusOr<std::vector<PackedBucket>> PackBuckets(const std::vector<std::pair<std::string, TensorView>>& tensors,
                                                      const PackOptions& options);

// Sends every bucket through a BucketSender rooted at group rank 0 and waits for all of them;
// with `mac`, every bucket is tagged with it (comm/bucket/bucket_mac.h). Over NCCL each bucket is
// first copied to the group's GPU.
absl::Status SendBuckets(comm::Communicator& comm, std::vector<PackedBucket> buckets,
                         std::optional<comm::BucketMac> mac = std::nullopt);
// The wire protocol of comm/bucket/stream.h by hand: header + (manifest, data, zero tag) broadcasts
// from rank 0, with nbytes set and the XXH3 of the data (flipped in its lowest bit if `corrupt_checksum`).
absl::Status SendRawBucket(comm::Communicator& comm, v1::BucketManifest manifest, const Buffer& data, uint64_t nbytes,
                           bool corrupt_checksum);

}  // namespace wsync::rollout_agent::testing
