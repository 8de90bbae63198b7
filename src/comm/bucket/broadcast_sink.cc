#include "comm/bucket/broadcast_sink.h"

#include <utility>

#include "common/logging.h"

namespace wsync::comm {

BroadcastSink::BroadcastSink(std::unique_ptr<Communicator> comm, Store* store, std::string progress_prefix,
                             CollectiveOptions options, BufferPool* pool, std::optional<BucketMac> mac)
    : comm_(std::move(comm)),
      sender_(*comm_, 0, 2, options, pool, std::move(mac)),
      store_(store),
      prefix_(std::move(progress_prefix)) {}

absl::Status BroadcastSink::Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) {
  if (!error_.ok()) return absl::OkStatus();  // draining
  absl::Status s = sender_.Send(std::move(manifest), std::move(data), nbytes);
  if (!s.ok()) {
    Drain(s);
    return absl::OkStatus();
  }
  store_->Add(prefix_ + "bytes", static_cast<int64_t>(nbytes)).IgnoreError();
  store_->Add(prefix_ + "buckets", 1).IgnoreError();
  return absl::OkStatus();
}

Buffer BroadcastSink::Recycle(uint64_t min_bytes) { return error_.ok() ? sender_.Recycle(min_bytes) : Buffer(); }

absl::Status BroadcastSink::Finish() {
  if (error_.ok()) {
    absl::Status s = sender_.Finish();
    if (!s.ok()) Drain(s);
  }
  return absl::OkStatus();
}

void BroadcastSink::Drain(const absl::Status& s) {
  error_ = s;
  WSYNC_LOG(ERROR) << "data plane failed, draining the rest of the sync: " << s;
  comm_->Abort(s.message());
}

}  // namespace wsync::comm
