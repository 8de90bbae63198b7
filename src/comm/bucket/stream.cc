#include "comm/bucket/stream.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/failpoint.h"
#include "common/status.h"

namespace wsync::comm {
// --- Sender -------------------------------------------------------------------------------------

struct BucketSender::InFlight {
  BucketHeader header;
  std::string manifest;
  Buffer data;
  BucketTag tag{};
  std::unique_ptr<Work> header_work, payload_work;
};

BucketSender::BucketSender(Communicator& comm, int root, int max_in_flight, CollectiveOptions options, BufferPool* pool,
                           std::optional<BucketMac> mac)
    : comm_(comm),
      root_(root),
      max_in_flight_(std::max(1, max_in_flight)),
      options_(options),
      own_pool_(pool == nullptr ? std::make_unique<BufferPool>(static_cast<size_t>(max_in_flight_)) : nullptr),
      pool_(pool == nullptr ? own_pool_.get() : pool),
      mac_(std::move(mac)) {}

BucketSender::~BucketSender() {
  while (!in_flight_.empty()) WaitOldest().IgnoreError();
}

absl::Status BucketSender::Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) {
  if (nbytes > data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(DescribeBucket(manifest), ": ", nbytes, " bytes from a ", data.size(), "-byte buffer"));
  }
  if (data.device() >= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        DescribeBucket(manifest), " is in the memory of CUDA device ", data.device(), "; the ", comm_.Name(),
        " bucket stream sends host buffers (put a DeviceStagingSink, comm/bucket/device_staging.h, in front)"));
  const absl::Time t0 = absl::Now();
  manifest.set_nbytes(nbytes);
  manifest.set_xxh3_64(Xxh3_64({data.data(), nbytes}));
  const absl::Time t1 = absl::Now();
  stats_.checksum += t1 - t0;
  auto f = std::make_unique<InFlight>();
  f->manifest = manifest.SerializeAsString();
  if (mac_) {
    ASSIGN_OR_RETURN(f->tag, mac_->Tag(manifest.index(), f->manifest, {data.data(), nbytes}));
    stats_.mac += absl::Now() - t1;
  }
  // A link that damages the bucket after the sender hashed it (system tests, common/failpoint.h).
  if (nbytes > 0 && FailpointHit("bucket.corrupt")) data.data()[nbytes / 2] ^= std::byte{0x10};
  while (static_cast<int>(in_flight_.size()) >= max_in_flight_) RETURN_IF_ERROR(WaitOldest());

  f->header = {f->manifest.size(), nbytes};
  f->data = std::move(data);
  MutableBytes header{&f->header, sizeof(BucketHeader)};
  ASSIGN_OR_RETURN(f->header_work, comm_.Broadcast({&header, 1}, root_, options_));
  MutableBytes payload[3] = {
      {f->manifest.data(), f->manifest.size()}, {f->data.data(), nbytes}, {f->tag.data(), f->tag.size()}};
  ASSIGN_OR_RETURN(f->payload_work, comm_.Broadcast(payload, root_, options_));
  in_flight_.push_back(std::move(f));
  ++stats_.buckets;
  stats_.bytes += nbytes;
  return absl::OkStatus();
}

absl::Status BucketSender::WaitOldest() {
  std::unique_ptr<InFlight> f = std::move(in_flight_.front());
  in_flight_.pop_front();
  const absl::Time t0 = absl::Now();
  absl::Status s = f->header_work->Wait();
  if (s.ok()) s = f->payload_work->Wait();
  stats_.wire += absl::Now() - t0;
  if (s.ok()) pool_->Put(std::move(f->data));
  return s;
}

Buffer BucketSender::Recycle(uint64_t min_bytes) { return pool_->TryGet(min_bytes); }

absl::Status BucketSender::Finish() {
  absl::Status first;
  while (!in_flight_.empty()) {
    absl::Status s = WaitOldest();
    if (first.ok()) first = s;
  }
  return first;
}

// --- Receiver -----------------------------------------------------------------------------------

BucketReceiver::BucketReceiver(Communicator& comm, int root, CollectiveOptions options, BufferPool* pool,
                               std::optional<BucketMac> mac)
    : comm_(comm), root_(root), options_(options), pool_(pool), mac_(std::move(mac)) {
  thread_ = std::thread([this] { Run(); });
}

BucketReceiver::~BucketReceiver() {
  bool unfinished;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    unfinished = !finished_ && error_.ok();
  }
  if (unfinished) comm_.Abort("the bucket receiver was destroyed before the stream ended");
  thread_.join();
}

void BucketReceiver::Run() {
  for (uint64_t index = 0;; ++index) {
    const absl::Time t0 = absl::Now();
    BucketHeader header;
    MutableBytes hb{&header, sizeof(header)};
    absl::Status s = Await(comm_.Broadcast({&hb, 1}, root_, options_));
    std::string manifest_bytes;
    absl::StatusOr<Buffer> data = absl::InternalError("unset");
    if (s.ok() && header.manifest_bytes > kMaxManifestBytes) {
      s = absl::InvalidArgumentError(absl::StrCat("bucket ", index, ": a ", header.manifest_bytes, "-byte manifest"));
    }
    if (s.ok()) {
      manifest_bytes.resize(header.manifest_bytes);
      const uint64_t want = std::max<uint64_t>(header.data_bytes, 1);
      data = pool_ != nullptr ? pool_->Get(want) : Buffer::Allocate(want);
      s = data.status();
    }
    BucketTag tag{};
    if (s.ok()) {
      MutableBytes payload[3] = {
          {manifest_bytes.data(), manifest_bytes.size()}, {data->data(), header.data_bytes}, {tag.data(), tag.size()}};
      s = Await(comm_.Broadcast(payload, root_, options_));
    }
    const absl::Duration wire = absl::Now() - t0;
    Bucket bucket;
    if (s.ok() && !bucket.manifest.ParseFromString(manifest_bytes)) {
      s = absl::InvalidArgumentError(absl::StrCat("bucket ", index, ": the manifest does not parse"));
    }
    absl::Duration hashing, authenticating;
    if (s.ok()) s = ValidateManifest(bucket.manifest, header.data_bytes);
    if (s.ok() && bucket.manifest.index() != index) {
      s = absl::InvalidArgumentError(
          absl::StrCat(DescribeBucket(bucket.manifest), ": expected bucket ", index, " (lost or reordered)"));
    }
    if (s.ok()) {
      const absl::Time h0 = absl::Now();
      const uint64_t sum = Xxh3_64({data->data(), header.data_bytes});
      hashing = absl::Now() - h0;
      if (sum != bucket.manifest.xxh3_64()) {
        s = absl::DataLossError(absl::StrCat(DescribeBucket(bucket.manifest), ": checksum mismatch (xxh3 ", sum,
                                             ", manifest says ", bucket.manifest.xxh3_64(), ")"));
      }
    }
    if (s.ok() && mac_) {
      const absl::Time m0 = absl::Now();
      absl::StatusOr<bool> good = mac_->Verify(index, manifest_bytes, {data->data(), header.data_bytes}, tag);
      authenticating = absl::Now() - m0;
      if (!good.ok()) {
        s = good.status();
      } else if (!*good) {
        s = absl::DataLossError(absl::StrCat(DescribeBucket(bucket.manifest),
                                             ": not authenticated (its tag does not verify under the sync's bucket "
                                             "key: sent by a process without the key, or altered on the way)"));
      }
    }
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      error_ = s;
      return;
    }
    stats_.buckets++;
    stats_.bytes += header.data_bytes;
    stats_.wire += wire;
    stats_.checksum += hashing;
    stats_.mac += authenticating;
    const bool last = bucket.manifest.last();
    bucket.data = std::move(*data);
    // Wait until the consumer took the previous bucket (a queue of one), or stop.
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ready_.has_value() || stop_; };
    mu_.Await(absl::Condition(&room));
    if (stop_) return;
    ready_ = std::move(bucket);
    if (last) {
      finished_ = true;
      return;
    }
  }
}

absl::StatusOr<std::optional<BucketReceiver::Bucket>> BucketReceiver::Next() {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_.has_value() || !error_.ok() || drained_; };
  mu_.Await(absl::Condition(&ready));
  if (ready_.has_value()) {
    std::optional<Bucket> b = std::move(ready_);
    ready_.reset();
    if (b->manifest.last()) drained_ = true;
    return b;
  }
  if (!error_.ok()) return error_;
  return std::optional<Bucket>();
}

BucketStats BucketReceiver::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace wsync::comm
