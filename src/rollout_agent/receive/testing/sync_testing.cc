#include "rollout_agent/receive/testing/sync_testing.h"

#include <algorithm>

#include "comm/bucket/builder.h"
#include "comm/bucket/stream.h"
#include "common/checksum.h"
#include "common/memory_space.h"
#include "common/status.h"

namespace wsync::rollout_agent::testing {
namespace {

// Keeps every bucket the builder hands over, in order.
class KeepSink final : public comm::BucketSink {
 public:
  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override {
    buckets_.push_back({std::move(manifest), std::move(data), nbytes});
    return absl::OkStatus();
  }
  Buffer Recycle(uint64_t) override { return Buffer(); }  // every buffer is kept
  absl::Status Finish() override { return absl::OkStatus(); }
  std::vector<PackedBucket> Take() { return std::move(buckets_); }

 private:
  std::vector<PackedBucket> buckets_;
};

}  // namespace

absl::StatusOr<std::vector<PackedBucket>> PackBuckets(const std::vector<std::pair<std::string, TensorView>>& tensors,
                                                      const PackOptions& o) {
  KeepSink sink;
  comm::BucketBuilder builder(sink, {.bucket_bytes = o.bucket_bytes, .version = o.version, .pp_stage = o.pp_stage});
  for (const auto& [name, view] : tensors) RETURN_IF_ERROR(builder.Add(name, view));
  RETURN_IF_ERROR(builder.Finish());
  return sink.Take();
}

absl::Status SendBuckets(comm::Communicator& comm, std::vector<PackedBucket> buckets,
                         std::optional<comm::BucketMac> mac) {
  comm::BucketSender sender(comm, 0, 2, {}, nullptr, std::move(mac));
  const MemorySpace space = comm.space();
  for (PackedBucket& b : buckets) {
    if (MemorySpace::Of(b.data) != space) {  // an NCCL group: the bucket goes up to its GPU first
      ASSIGN_OR_RETURN(Buffer up, space.Allocate(std::max<uint64_t>(b.nbytes, 1)));
      RETURN_IF_ERROR(space.Copy(up.data(), b.data.data(), b.nbytes));
      b.data = std::move(up);
    }
    RETURN_IF_ERROR(sender.Send(std::move(b.manifest), std::move(b.data), b.nbytes));
  }
  return sender.Finish();
}

absl::Status SendRawBucket(comm::Communicator& comm, v1::BucketManifest m, const Buffer& data, uint64_t nbytes,
                           bool corrupt_checksum) {
  m.set_nbytes(nbytes);
  uint64_t sum = Xxh3_64({data.data(), nbytes});
  if (corrupt_checksum) sum ^= 1;
  m.set_xxh3_64(sum);
  std::string ms = m.SerializeAsString();
  comm::BucketHeader header{.manifest_bytes = ms.size(), .data_bytes = nbytes};
  comm::MutableBytes hb{&header, sizeof(header)};
  RETURN_IF_ERROR(comm::Await(comm.Broadcast({&hb, 1}, 0)));
  comm::BucketTag tag = comm::ManifestChecksumTag(ms);  // not authenticated
  comm::MutableBytes payload[3] = {{ms.data(), ms.size()}, {data.data(), nbytes}, {tag.data(), tag.size()}};
  return comm::Await(comm.Broadcast(payload, 0));
}

}  // namespace wsync::rollout_agent::testing
