#include "comm/bucket/stream.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/failpoint.h"
#include "common/status.h"
#include "kernels/checksum.h"

namespace wsync::comm {
namespace {

// The framing buffer of one bucket, in the stream's space: the header at 0, the receiver's Sum64
// word at kSumAt, the manifest at kManifestAt, the tag after the manifest at the next 64 bytes.
// Beside NCCL, framing buffers are never freed while the stream runs (a cudaFree waits for the
// whole device, nccl_communicator.h): the sender keeps every one it made, the receiver retires
// the ones it outgrew; both free them when they end.
constexpr uint64_t kSumAt = 16;
constexpr uint64_t kManifestAt = 64;
uint64_t TagAt(uint64_t manifest_bytes) { return AlignEntry(kManifestAt + manifest_bytes); }
uint64_t ControlBytes(uint64_t manifest_bytes) { return TagAt(manifest_bytes) + kBucketMacTagBytes; }

std::byte* At(const Buffer& b, uint64_t offset) { return b.data() + offset; }

// The span a BucketMac covers: the data of a host bucket; nothing of a device bucket (its tag
// covers the framing and the manifest, whose Sum64 stands for the data).
std::span<const std::byte> MacData(const MemorySpace& space, const Buffer& data, uint64_t nbytes) {
  if (!space.host()) return {};
  return {data.data(), nbytes};
}

// A link that damages the bucket after the sender summed it (system tests, common/failpoint.h):
// one bit of the middle byte flipped, wherever the data is.
absl::Status CorruptForTest(const MemorySpace& space, const Buffer& data, uint64_t nbytes) {
  std::byte b;
  std::byte* at = data.data() + nbytes / 2;
  RETURN_IF_ERROR(space.CopyToHost(&b, at, 1));
  b ^= std::byte{0x10};
  return space.Copy(at, &b, 1);
}

}  // namespace
// --- Sender -------------------------------------------------------------------------------------

struct BucketSender::InFlight {
  BucketHeader header;
  std::string manifest;
  Buffer data;
  Buffer control;  // the framing, in the stream's space
  BucketTag tag{};
  std::unique_ptr<Work> header_work, payload_work;
};

BucketSender::BucketSender(Communicator& comm, int root, int max_in_flight, CollectiveOptions options, BufferPool* pool,
                           std::optional<BucketMac> mac, BucketChecksum checksum)
    : comm_(comm),
      space_(comm.space()),
      sum64_(checksum == BucketChecksum::kSum64 || (checksum == BucketChecksum::kAuto && !space_.host())),
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
  if (MemorySpace::Of(data) != space_)
    return absl::InvalidArgumentError(absl::StrCat(DescribeBucket(manifest), " is in ", MemorySpace::Of(data).Name(),
                                                   " memory; the ", comm_.Name(), " bucket stream sends buffers of ",
                                                   space_.Name(),
                                                   " (put a SpaceStagingSink, comm/bucket/space_staging.h, in front)"));
  if (!sum64_ && !space_.host())
    return absl::InvalidArgumentError(absl::StrCat(DescribeBucket(manifest), ": an XXH3 checksum of a bucket in ",
                                                   space_.Name(), " (device buckets carry Sum64)"));
  const absl::Time t0 = absl::Now();
  manifest.set_nbytes(nbytes);
  if (sum64_) {
    if (!space_.host() && sum_word_.size() == 0) {
      ASSIGN_OR_RETURN(sum_word_, space_.Allocate(64));
    }
    absl::StatusOr<uint64_t> sum = kernels::Sum64(space_, data.data(), nbytes, sum_word_.data());
    if (!sum.ok()) return Annotate(sum.status(), absl::StrCat("the Sum64 of ", DescribeBucket(manifest)));
    manifest.set_xxh3_64(0);
    manifest.set_sum64(*sum);
  } else {
    manifest.set_xxh3_64(Xxh3_64({data.data(), nbytes}));
    manifest.clear_sum64();
  }
  const absl::Time t1 = absl::Now();
  stats_.checksum += t1 - t0;
  auto f = std::make_unique<InFlight>();
  f->manifest = manifest.SerializeAsString();
  if (mac_) {
    ASSIGN_OR_RETURN(f->tag, mac_->Tag(manifest.index(), f->manifest, MacData(space_, data, nbytes)));
    stats_.mac += absl::Now() - t1;
  } else {
    f->tag = ManifestChecksumTag(f->manifest);
  }
  if (nbytes > 0 && FailpointHit("bucket.corrupt")) RETURN_IF_ERROR(CorruptForTest(space_, data, nbytes));
  while (static_cast<int>(in_flight_.size()) >= max_in_flight_) RETURN_IF_ERROR(WaitOldest());

  // The framing, in a buffer of the stream's space (kept from an earlier bucket when one fits).
  const uint64_t m = f->manifest.size();
  for (size_t i = 0; i < free_control_.size(); ++i) {
    if (free_control_[i].size() < ControlBytes(m)) continue;
    f->control = std::move(free_control_[i]);
    free_control_.erase(free_control_.begin() + static_cast<std::ptrdiff_t>(i));
    break;
  }
  if (f->control.size() == 0) {
    ASSIGN_OR_RETURN(f->control, space_.Allocate(ControlBytes(std::max<uint64_t>(m, 4096))));
  }
  f->header = {m, nbytes};
  RETURN_IF_ERROR(space_.Copy(At(f->control, 0), &f->header, sizeof(BucketHeader)));
  RETURN_IF_ERROR(space_.Copy(At(f->control, kManifestAt), f->manifest.data(), m));
  RETURN_IF_ERROR(space_.Copy(At(f->control, TagAt(m)), f->tag.data(), f->tag.size()));
  f->data = std::move(data);
  MutableBytes header{At(f->control, 0), sizeof(BucketHeader)};
  ASSIGN_OR_RETURN(f->header_work, comm_.Broadcast({&header, 1}, root_, options_));
  MutableBytes payload[3] = {
      {At(f->control, kManifestAt), m}, {f->data.data(), nbytes}, {At(f->control, TagAt(m)), f->tag.size()}};
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
  if (s.ok()) {
    pool_->Put(std::move(f->data));
    free_control_.push_back(std::move(f->control));
  }
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
    : comm_(comm), space_(comm.space()), root_(root), options_(options), pool_(pool), mac_(std::move(mac)) {
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
  Buffer control;               // the framing, in space_; grows to the largest manifest seen
  std::vector<Buffer> retired;  // outgrown framing buffers, freed when the stream ends
  auto ensure_control = [&](uint64_t manifest_bytes) -> absl::Status {
    if (control.size() >= ControlBytes(manifest_bytes)) return absl::OkStatus();
    ASSIGN_OR_RETURN(Buffer bigger, space_.Allocate(ControlBytes(std::max<uint64_t>(manifest_bytes, 64 << 10))));
    retired.push_back(std::exchange(control, std::move(bigger)));
    return absl::OkStatus();
  };
  for (uint64_t index = 0;; ++index) {
    const absl::Time t0 = absl::Now();
    BucketHeader header;
    absl::Status s = ensure_control(0);
    if (s.ok()) {
      MutableBytes hb{At(control, 0), sizeof(header)};
      s = Await(comm_.Broadcast({&hb, 1}, root_, options_));
    }
    if (s.ok()) s = space_.CopyToHost(&header, At(control, 0), sizeof(header));
    std::string manifest_bytes;
    absl::StatusOr<Buffer> data = absl::InternalError("unset");
    if (s.ok()) s = CheckHeader(header, index);
    if (s.ok()) s = ensure_control(header.manifest_bytes);
    if (s.ok()) {
      manifest_bytes.resize(header.manifest_bytes);
      const uint64_t want = std::max<uint64_t>(header.data_bytes, 1);
      data = pool_ != nullptr ? pool_->Get(want) : space_.Allocate(want);
      s = data.status();
      if (s.ok() && MemorySpace::Of(*data) != space_) {
        s = absl::InvalidArgumentError(absl::StrCat("bucket ", index, ": the receiver's pool gave a buffer of ",
                                                    MemorySpace::Of(*data).Name(), "; the ", comm_.Name(),
                                                    " stream receives into ", space_.Name()));
      }
    }
    BucketTag tag{};
    const uint64_t tag_at = TagAt(header.manifest_bytes);
    if (s.ok()) {
      MutableBytes payload[3] = {{At(control, kManifestAt), header.manifest_bytes},
                                 {data->data(), header.data_bytes},
                                 {At(control, tag_at), tag.size()}};
      s = Await(comm_.Broadcast(payload, root_, options_));
    }
    if (s.ok()) s = space_.CopyToHost(manifest_bytes.data(), At(control, kManifestAt), header.manifest_bytes);
    if (s.ok()) s = space_.CopyToHost(tag.data(), At(control, tag_at), tag.size());
    const absl::Duration wire = absl::Now() - t0;
    Bucket bucket;
    if (s.ok() && !mac_) s = CheckManifestChecksum(tag, manifest_bytes, index);  // a MAC covers the manifest
    if (s.ok()) {
      absl::StatusOr<v1::BucketManifest> m = DecodeManifest(header, manifest_bytes, index);
      if (m.ok()) bucket.manifest = std::move(*m);
      s = m.status();
    }
    absl::Duration hashing, authenticating;
    if (s.ok()) {
      const absl::Time h0 = absl::Now();
      const bool sum64 = bucket.manifest.has_sum64();
      absl::StatusOr<uint64_t> sum = uint64_t{0};
      if (sum64) {
        sum = kernels::Sum64(space_, data->data(), header.data_bytes, At(control, kSumAt));
      } else if (space_.host()) {
        sum = Xxh3_64({data->data(), header.data_bytes});
      } else {
        sum = absl::InvalidArgumentError(absl::StrCat(DescribeBucket(bucket.manifest), " arrived in ", space_.Name(),
                                                      " with an XXH3 checksum, which only host buckets carry"));
      }
      hashing = absl::Now() - h0;
      const uint64_t want = sum64 ? bucket.manifest.sum64() : bucket.manifest.xxh3_64();
      if (!sum.ok()) {
        s = sum.status();
      } else if (*sum != want) {
        s = absl::DataLossError(absl::StrCat(DescribeBucket(bucket.manifest), ": checksum mismatch (",
                                             sum64 ? "sum64 " : "xxh3 ", *sum, ", manifest says ", want, ")"));
      }
    }
    if (s.ok() && mac_) {
      const absl::Time m0 = absl::Now();
      absl::StatusOr<bool> good = mac_->Verify(index, manifest_bytes, MacData(space_, *data, header.data_bytes), tag);
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
