// Buckets on the data plane: the stream of flat buffers + manifests that one pipeline stage's
// source broadcasts to every rollout agent of its sync group (proto/wsync/v1/tensor.proto).
//
// Per bucket, two Broadcasts from the root in issue order: the BucketHeader, then the serialized
// BucketManifest, the data and the 16-byte tag as three buffers of one Broadcast (bucket_format.h). The stream ends
// with the bucket whose manifest has `last` set (it may be empty). The sender fills in manifest.nbytes and a
// checksum; the receiver checks both, and that every entry lies inside the data and has the size its dtype and
// shape say. With a BucketMac (bucket_mac.h; both ends from the same sync key) the sender fills in the tag (else it is
// zero) and the receiver refuses a bucket whose tag does not verify (kDataLoss "not authenticated"), after the
// checksum; a receiver without one ignores the tag.
//
// Memory spaces: every buffer of a bucket is in the communicator's space (Communicator::space(): host memory for
// MPI, Gloo and shm; the CUDA device's memory for NCCL). The data is sent from and received into buffers of that
// space (a device bucket goes from the GPU that built it to the GPU that loads it, never through host memory); the
// header, manifest and tag travel through a small buffer of the same space, copied from and to the host. One
// control flow for both: on the host those copies are memcpys.
// Checksums, chosen by the sender (BucketChecksum) and named by the manifest: XXH3-64 (manifest.xxh3_64) for host
// buckets; Sum64 (manifest.sum64, kernels/checksum.h) for device buckets, which both ends compute on their GPU, as
// there is no XXH3 on the device. The receiver checks the one the manifest carries, where its buffer is.
// The tag of a device bucket covers its framing and manifest, Sum64 included, not the data bytes themselves (no
// GMAC on the device): it proves who sent the bucket, and Sum64 that the bytes arrived as sent, but Sum64 is not a
// MAC, so a party that can write into the NCCL transport could alter data undetected. docs/comm.md, "Device buckets".
//
// Ownership and memory: the sender keeps at most `max_in_flight` buckets on the wire (double
// buffering: the caller builds bucket k+1 while k moves) and hands finished buffers back through
// Recycle(). The receiver runs one thread that receives into a queue of one bucket, so the
// consumer loads bucket k while k+1 arrives. Both take an optional BufferPool (not owned; must
// outlive them): the sender puts finished buffers there, the receiver takes its buffers from it and
// the consumer may Put() a loaded bucket's data back, so an agent that keeps one pool across syncs
// receives and builds buckets in memory that is already mapped (common/buffer_pool.h).
//
// Thread-safety: a BucketSender is used by one thread; BucketReceiver::Next by one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/bucket/bucket_format.h"
#include "comm/bucket/bucket_mac.h"
#include "comm/communicator.h"
#include "common/buffer_pool.h"
#include "common/dtype.h"
#include "common/memory_space.h"
#include "common/tensor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::comm {

// What the sender puts in the manifest. kAuto: XXH3 for a host stream, Sum64 for a device stream.
// kSum64 on a host stream runs the device streams' checks through host memory (tests, and the
// CPU build's coverage of that path); kXxh3 on a device stream is refused by Send.
enum class BucketChecksum { kAuto, kXxh3, kSum64 };

struct BucketStats {
  uint64_t buckets = 0;
  uint64_t bytes = 0;       // data bytes (manifests excluded)
  absl::Duration wire;      // sender: time the caller waited for the wire; receiver: time in Broadcasts
  absl::Duration checksum;  // time spent hashing (XXH3)
  absl::Duration mac;       // time spent computing / verifying tags (BucketMac)
};

class BucketSender {
 public:
  BucketSender(Communicator& comm, int root, int max_in_flight = 2, CollectiveOptions options = {},
               BufferPool* pool = nullptr, std::optional<BucketMac> mac = std::nullopt,
               BucketChecksum checksum = BucketChecksum::kAuto);
  ~BucketSender();  // waits for buckets still in flight (errors are dropped: call Finish())

  // Starts broadcasting `data[0, nbytes)` under `manifest` and returns once it is queued; if
  // `max_in_flight` buckets are already on the wire, first waits for the oldest. `data` must be in
  // the communicator's space (kInvalidArgument naming both spaces, before anything is sent). Errors
  // of the data plane (kDeadlineExceeded, kAborted, kUnavailable) come back from here or from Finish().
  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes);
  // A buffer of a finished bucket of at least `min_bytes`, for reuse (an empty Buffer if none).
  Buffer Recycle(uint64_t min_bytes);
  // Waits until every bucket has been sent.
  absl::Status Finish();
  const BucketStats& stats() const { return stats_; }

 private:
  struct InFlight;
  absl::Status WaitOldest();

  Communicator& comm_;
  const MemorySpace space_;  // comm_.space()
  const bool sum64_;         // the checksum is Sum64
  const int root_;
  const int max_in_flight_;
  const CollectiveOptions options_;
  std::deque<std::unique_ptr<InFlight>> in_flight_;
  std::unique_ptr<BufferPool> own_pool_;  // when the caller gave none
  BufferPool* pool_;
  const std::optional<BucketMac> mac_;
  std::vector<Buffer> free_control_;  // framing buffers of finished buckets, in space_ (all kept)
  Buffer sum_word_;                   // a device stream's Sum64 word
  BucketStats stats_;
};

class BucketReceiver {
 public:
  struct Bucket {
    v1::BucketManifest manifest;
    Buffer data;  // holds manifest.nbytes() bytes, in the communicator's space; a pooled buffer may be larger
  };
  // Starts receiving at once on its own thread, into buffers of the communicator's space: `pool`'s
  // (which must allocate there: a bucket in another space fails the stream with kInvalidArgument),
  // else the space's own allocations.
  BucketReceiver(Communicator& comm, int root, CollectiveOptions options = {}, BufferPool* pool = nullptr,
                 std::optional<BucketMac> mac = std::nullopt);
  ~BucketReceiver();  // aborts the communicator if the stream is unfinished, then joins

  // The next bucket, in order; std::nullopt after the last one. Errors: the data plane's, or
  // kDataLoss (checksum, tag, a corrupt framing: header, manifest, index; bucket_format.h DecodeManifest), each naming
  // the stage and bucket index.
  absl::StatusOr<std::optional<Bucket>> Next();
  BucketStats stats() const;

 private:
  void Run();

  Communicator& comm_;
  const MemorySpace space_;  // comm_.space()
  const int root_;
  const CollectiveOptions options_;
  BufferPool* const pool_;  // null: allocations of space_
  const std::optional<BucketMac> mac_;
  mutable absl::Mutex mu_;
  std::optional<Bucket> ready_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // the last bucket was received
  bool drained_ ABSL_GUARDED_BY(mu_) = false;   // ... and handed out
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  BucketStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace wsync::comm
