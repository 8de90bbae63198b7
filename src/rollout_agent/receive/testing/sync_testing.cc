#include "rollout_agent/receive/testing/sync_testing.h"

#include <algorithm>
#include <cstring>

#include "comm/bucket/stream.h"
#include "common/checksum.h"
#include "common/status.h"

namespace wsync::rollout_agent::testing {

absl::StatusOr<std::vector<PackedBucket>> PackBuckets(const std::vector<std::pair<std::string, TensorView>>& tensors,
                                                      const PackOptions& o) {
  std::vector<PackedBucket> out;
  size_t i = 0;
  while (i < tensors.size()) {
    // Take tensors while they fit (at least one).
    size_t j = i;
    uint64_t bytes = 0;
    while (j < tensors.size()) {
      const uint64_t at = (bytes + 63) / 64 * 64;
      const uint64_t end = at + tensors[j].second.nbytes();
      if (j > i && end > o.bucket_bytes) break;
      bytes = end;
      ++j;
    }
    PackedBucket b;
    ASSIGN_OR_RETURN(b.data, Buffer::AllocateZeroed(std::max<uint64_t>(bytes, 1)));
    b.nbytes = bytes;
    b.manifest.set_version(o.version);
    b.manifest.set_pp_stage(o.pp_stage);
    b.manifest.set_index(static_cast<uint32_t>(out.size()));
    uint64_t off = 0;
    for (size_t k = i; k < j; ++k) {
      const TensorView& v = tensors[k].second;
      off = (off + 63) / 64 * 64;
      v1::BucketEntry* e = b.manifest.add_entries();
      e->mutable_tensor()->set_name(tensors[k].first);
      e->mutable_tensor()->set_dtype(comm::ToProto(v.dtype()));
      for (int64_t d : v.shape()) e->mutable_tensor()->add_shape(d);
      e->set_offset(off);
      e->set_nbytes(v.nbytes());
      e->set_total_nbytes(v.nbytes());
      if (v.nbytes() > 0) std::memcpy(b.data.data() + off, v.data(), v.nbytes());
      off += v.nbytes();
    }
    out.push_back(std::move(b));
    i = j;
  }
  if (o.empty_last || out.empty()) {
    PackedBucket b;
    ASSIGN_OR_RETURN(b.data, Buffer::AllocateZeroed(1));
    b.manifest.set_version(o.version);
    b.manifest.set_pp_stage(o.pp_stage);
    b.manifest.set_index(static_cast<uint32_t>(out.size()));
    out.push_back(std::move(b));
  }
  out.back().manifest.set_last(true);
  return out;
}

absl::Status SendBuckets(comm::Communicator& comm, std::vector<PackedBucket> buckets) {
  comm::BucketSender sender(comm, 0, 2);
  for (PackedBucket& b : buckets) RETURN_IF_ERROR(sender.Send(std::move(b.manifest), std::move(b.data), b.nbytes));
  return sender.Finish();
}

absl::Status SendRawBucket(comm::Communicator& comm, v1::BucketManifest m, const Buffer& data, uint64_t nbytes,
                           bool corrupt_checksum) {
  m.set_nbytes(nbytes);
  uint64_t sum = Xxh3_64({data.data(), nbytes});
  if (corrupt_checksum) sum ^= 1;
  m.set_xxh3_64(sum);
  std::string ms = m.SerializeAsString();
  uint64_t header[2] = {ms.size(), nbytes};
  comm::MutableBytes hb{header, sizeof(header)};
  RETURN_IF_ERROR(comm::Await(comm.Broadcast({&hb, 1}, 0)));
  comm::MutableBytes payload[2] = {{ms.data(), ms.size()}, {data.data(), nbytes}};
  return comm::Await(comm.Broadcast(payload, 0));
}

}  // namespace wsync::rollout_agent::testing
