// The bytes of one bucket on the data plane: the constants, the framing header and the manifest
// checks that the builder (builder.h), the stream (stream.h) and their tests share. The format,
// with the life of one bucket, is docs/bucket_format.md.
//
// A bucket is two Broadcasts on the stage's communicator:
//   header    16 bytes, BucketHeader {manifest bytes, data bytes}, broadcast alone;
//   payload   three buffers of one Broadcast: the serialized BucketManifest
//             (proto/wsync/v1/tensor.proto), the data, and a 16-byte tag (the bucket's GMAC when
//             the sync authenticates its buckets, bucket_mac.h; else the manifest's own checksum,
//             ManifestChecksumTag);
//   data      entries at offsets aligned to kEntryAlignment, zeroed gaps, no tail padding.
// Thread-safety: pure functions and constants.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/bucket/bucket_mac.h"
#include "common/dtype.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::comm {

// Every entry starts at a multiple of this many bytes of the bucket's data.
inline constexpr uint64_t kEntryAlignment = 64;
// A receiver refuses a header announcing a larger manifest.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;

// The first Broadcast of a bucket, raw host-order (little-endian on every supported host).
struct BucketHeader {
  uint64_t manifest_bytes = 0;
  uint64_t data_bytes = 0;
};
static_assert(sizeof(BucketHeader) == 16);

// The offset of the entry that follows one ending at `end`.
constexpr uint64_t AlignEntry(uint64_t end) { return (end + kEntryAlignment - 1) / kEntryAlignment * kEntryAlignment; }

// "stage S bucket I": how every error about a bucket names it.
std::string DescribeBucket(const v1::BucketManifest& m);

// proto <-> wsync dtypes (kInvalidArgument for DTYPE_UNSPECIFIED or unknown values).
v1::DType ToProto(DType t);
absl::StatusOr<DType> FromProto(v1::DType t);

// Checks a received manifest against its data size: every entry named, of a known dtype, sized as
// its dtype and shape say, and inside the data. kInvalidArgument naming the stage, bucket and entry.
absl::Status ValidateManifest(const v1::BucketManifest& m, uint64_t data_bytes);

// The receiver's checks of bucket `index`'s framing, the one untrusted input of the data plane.
// CheckHeader, before anything is allocated: a manifest larger than kMaxManifestBytes.
// DecodeManifest, once the payload arrived: the manifest must be exactly the header's size, parse,
// pass ValidateManifest against the header's data size, and be bucket `index`. Every refusal is
// kDataLoss naming the bucket (a corrupt or forged framing, or a lost or reordered bucket); the
// caller then delivers nothing of it.
absl::Status CheckHeader(const BucketHeader& header, uint64_t index);

// The tag of a bucket whose sync does not authenticate its buckets: XXH3-64 of the serialized
// manifest (bytes 0..7, little-endian), zeros after. The data's checksum is in the manifest; this is
// the manifest's own, so that a damaged entry name, offset or shape is caught even where it still
// parses and passes ValidateManifest. CheckManifestChecksum: kDataLoss naming bucket `index` when
// the tag is not that of `manifest_bytes` (checked before the manifest is decoded).
BucketTag ManifestChecksumTag(absl::string_view manifest_bytes);
absl::Status CheckManifestChecksum(const BucketTag& tag, absl::string_view manifest_bytes, uint64_t index);
absl::StatusOr<v1::BucketManifest> DecodeManifest(const BucketHeader& header, absl::string_view manifest_bytes,
                                                  uint64_t index);

}  // namespace wsync::comm
