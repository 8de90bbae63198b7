// Bucket authentication: a keyed MAC over every byte of a bucket, so that a process that does not
// hold the sync's key (handed out only over the authenticated control plane) cannot feed a rollout
// agent a bucket, nor alter one unnoticed. XXH3 (stream.h) detects damage; this detects forgery.
// A device bucket (the NCCL data plane) is tagged with empty data: the tag then covers its framing
// and manifest, whose Sum64 stands for the data (stream.h, docs/bucket_format.md §3).
//
// Construction (docs/bucket_format.md §2):
//   sync key     32 random bytes per sync, made by the coordinator (NewSyncMacKey), sent to the
//                trainer ranks in the sync command and to the agents in BeginSyncRequest;
//   stream key   HMAC-SHA256(sync key, "wsync bucket stream v1\0" || group name): one per
//                data-plane group, so the streams of a sync never share a (key, nonce) pair;
//   tag          GMAC-AES-256 (NIST SP 800-38D: GCM with the bucket as additional data only),
//                IV = 4 zero bytes || bucket index (uint64, little-endian), over
//                uint64le(manifest bytes) || uint64le(data bytes) || manifest || data; 16 bytes.
// Each bucket index is sent once per stream, and the key is new every sync, so an IV is never used
// twice under one key (GMAC's requirement). OpenSSL 3 (libcrypto) computes it: ~10 GB/s per core
// on this machine with AES-NI and VPCLMULQDQ.
//
// Errors: kInvalidArgument for a sync key of the wrong size; kInternal if OpenSSL fails.
// Thread-safety: a BucketMac is immutable; Tag() may run on several threads at once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace wsync::comm {

inline constexpr size_t kBucketMacKeyBytes = 32;
inline constexpr size_t kBucketMacTagBytes = 16;
using BucketTag = std::array<std::byte, kBucketMacTagBytes>;

// 32 bytes from OpenSSL's CSPRNG (RAND_bytes); kInternal if it is not seeded.
absl::StatusOr<std::string> NewSyncMacKey();

class BucketMac {
 public:
  // The MAC of the stream on data-plane group `group` of the sync whose key is `sync_key`.
  static absl::StatusOr<BucketMac> ForStream(std::string_view sync_key, std::string_view group);

  // The tag of bucket `index` with this manifest (serialized) and data.
  absl::StatusOr<BucketTag> Tag(uint64_t index, std::string_view manifest, std::span<const std::byte> data) const;
  // True when `tag` is Tag(index, manifest, data) (compared in constant time).
  absl::StatusOr<bool> Verify(uint64_t index, std::string_view manifest, std::span<const std::byte> data,
                              const BucketTag& tag) const;

 private:
  explicit BucketMac(const std::array<unsigned char, 32>& key) : key_(key) {}
  std::array<unsigned char, 32> key_;
};

}  // namespace wsync::comm
