// Test helpers for the rollout agent, used by its unit and integration tests (not by the agent):
//
//   ShmEngineMemory  an engine rank's parameters in one POSIX shared-memory segment, laid out in
//                    the EngineLayout's engine form (each param 64-byte aligned), as an engine
//                    registers them: FillParams() writes RegisterEngineRequest.params.
//   PackBuckets      the trainer side's bucketing: sent HF tensors -> flat buffers + manifests.
//   SendBuckets      broadcasts them as the stage source (group rank 0) through BucketSender;
//   SendRawBucket    one bucket without BucketSender, optionally with a wrong checksum.
//
// Ownership: ShmEngineMemory creates the segment (O_EXCL, the given mode), maps it, and unmaps
// and unlinks it on destruction. Thread-safety: plain values / one owner.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "common/tensor.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "rollout_agent/load/engine_layout.h"
#include "rollout_agent/repack/engine_weights.h"
#include "wsync/v1/engine.pb.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::rollout_agent::testing {

class ShmEngineMemory {
 public:
  // A new segment "/wsync-test-<pid>-<tag>-<n>" of mode `mode` holding every param of `layout`
  // (engine form), zero-filled.
  static absl::StatusOr<std::unique_ptr<ShmEngineMemory>> Create(const EngineLayout& layout, const std::string& tag,
                                                                 mode_t mode = 0600);
  ~ShmEngineMemory();

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  std::byte* data() const { return static_cast<std::byte*>(addr_); }
  EngineWeights& weights() { return weights_; }
  const EngineWeights& weights() const { return weights_; }
  // Appends one EngineParam per param (SGLang name, dtype, engine shape, nbytes, {name(), offset}).
  void FillParams(google::protobuf::RepeatedPtrField<v1::EngineParam>* params) const;
  // XXH3-64 of the whole segment.
  uint64_t Checksum() const;

 private:
  ShmEngineMemory() = default;
  struct Param {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t offset, nbytes;
  };
  std::string name_;
  void* addr_ = nullptr;
  size_t size_ = 0;
  std::vector<Param> params_;
  EngineWeights weights_;
};

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
