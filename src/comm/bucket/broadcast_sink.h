// The BucketSink of a pipeline stage's source in a real sync: the bucket stream (stream.h) from
// rank 0 of the stage's data-plane group to every rollout agent, with the progress of the sync
// counted in the rendezvous store (`<progress_prefix>bytes`, `<progress_prefix>buckets`; wsyncctl's
// progress bar reads them through the coordinator).
//
// A data-plane failure (a rollout agent lost mid-stream, a timeout) turns the sink into a drain:
// the communicator is aborted, every later Send / Finish returns OK at once without sending, and
// status() holds the failure. The trainer's own collectives (the gathers every rank runs) thus
// complete on every rank, and the caller reports status() when the sync ends.
//
// Ownership: the sink owns its communicator; `store` and `pool` are not owned and must outlive it.
// Thread-safety: used by one thread (the BucketBuilder's), as every BucketSink.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "comm/bucket/builder.h"
#include "comm/bucket/stream.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "common/buffer_pool.h"

namespace wsync::comm {

class BroadcastSink final : public BucketSink {
 public:
  // `mac`: the stream's BucketMac when the sync authenticates its buckets (bucket_mac.h).
  BroadcastSink(std::unique_ptr<Communicator> comm, Store* store, std::string progress_prefix,
                CollectiveOptions options, BufferPool* pool, std::optional<BucketMac> mac = std::nullopt);

  // Always OK; a data-plane error starts the drain and is kept in status().
  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override;
  Buffer Recycle(uint64_t min_bytes) override;
  absl::Status Finish() override;
  MemorySpace space() const override { return comm_->space(); }  // the communicator's

  // Starts the drain with `s` (aborting the communicator) unless it has already started: a sharded
  // stage source stops every group's stream when one of them fails.
  void Abort(const absl::Status& s) {
    if (error_.ok()) Drain(s);
  }
  // OK, or the data-plane error that started the drain.
  const absl::Status& status() const { return error_; }
  const BucketStats& stats() const { return sender_.stats(); }

 private:
  void Drain(const absl::Status& s);

  std::unique_ptr<Communicator> comm_;
  BucketSender sender_;
  Store* store_;
  std::string prefix_;
  absl::Status error_;
};

}  // namespace wsync::comm
