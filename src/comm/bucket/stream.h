// Buckets on the data plane: the stream of flat buffers + manifests that one pipeline stage's
// source broadcasts to every rollout agent of its sync group (proto/wsync/v1/tensor.proto).
//
// Per bucket, two Broadcasts from the root in issue order: the BucketHeader, then the serialized
// BucketManifest, the data and the 16-byte tag as three buffers of one Broadcast (bucket_format.h). The stream ends
// with the bucket whose manifest has `last` set (it may be empty). The sender fills in manifest.nbytes and
// manifest.xxh3_64; the receiver checks both, and that every entry lies inside the data and has the size its dtype and
// shape say. With a BucketMac (bucket_mac.h; both ends from the same sync key) the sender fills in the tag (else it is
// zero) and the receiver refuses a bucket whose tag does not verify (kDataLoss "not authenticated"), after the XXH3
// check; a receiver without one ignores the tag.
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

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/bucket/bucket_format.h"
#include "comm/bucket/bucket_mac.h"
#include "comm/communicator.h"
#include "common/buffer_pool.h"
#include "common/dtype.h"
#include "common/tensor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::comm {

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
               BufferPool* pool = nullptr, std::optional<BucketMac> mac = std::nullopt);
  ~BucketSender();  // waits for buckets still in flight (errors are dropped: call Finish())

  // Starts broadcasting `data[0, nbytes)` under `manifest` and returns once it is queued; if
  // `max_in_flight` buckets are already on the wire, first waits for the oldest. Errors of the
  // data plane (kDeadlineExceeded, kAborted, kUnavailable) come back from here or from Finish().
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
  const int root_;
  const int max_in_flight_;
  const CollectiveOptions options_;
  std::deque<std::unique_ptr<InFlight>> in_flight_;
  std::unique_ptr<BufferPool> own_pool_;  // when the caller gave none
  BufferPool* pool_;
  const std::optional<BucketMac> mac_;
  BucketStats stats_;
};

class BucketReceiver {
 public:
  struct Bucket {
    v1::BucketManifest manifest;
    Buffer data;  // holds manifest.nbytes() bytes; a pooled buffer may be larger
  };
  // Starts receiving at once on its own thread.
  BucketReceiver(Communicator& comm, int root, CollectiveOptions options = {}, BufferPool* pool = nullptr,
                 std::optional<BucketMac> mac = std::nullopt);
  ~BucketReceiver();  // aborts the communicator if the stream is unfinished, then joins

  // The next bucket, in order; std::nullopt after the last one. Errors: the data plane's, or
  // kDataLoss (checksum, tag), kInvalidArgument (manifest), each naming the stage and bucket index.
  absl::StatusOr<std::optional<Bucket>> Next();
  BucketStats stats() const;

 private:
  void Run();

  Communicator& comm_;
  const int root_;
  const CollectiveOptions options_;
  BufferPool* const pool_;  // null: plain allocations
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
