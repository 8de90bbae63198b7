#include "rollout_agent/receive/testing/sync_testing.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "comm/bucket/stream.h"
#include "common/checksum.h"
#include "common/status.h"

namespace wsync::rollout_agent::testing {

absl::StatusOr<std::unique_ptr<ShmEngineMemory>> ShmEngineMemory::Create(const EngineLayout& layout,
                                                                         const std::string& tag, mode_t mode) {
  static std::atomic<int> counter{0};
  std::unique_ptr<ShmEngineMemory> m(new ShmEngineMemory());
  m->name_ = absl::StrCat("/wsync-test-", getpid(), "-", tag, "-", counter.fetch_add(1));
  uint64_t off = 0;
  for (const EngineParam& p : layout.params()) {
    ASSIGN_OR_RETURN(const int64_t bytes, NumBytes(p.dtype, p.engine_shape));
    m->params_.push_back({p.name, p.dtype, p.engine_shape, off, static_cast<uint64_t>(bytes)});
    off += (static_cast<uint64_t>(bytes) + 63) / 64 * 64;
  }
  m->size_ = std::max<uint64_t>(off, 64);
  const int fd = shm_open(m->name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("shm_open ", m->name_));
  absl::Status st;
  if (fchmod(fd, mode) != 0) st = ErrnoToStatus(errno, "fchmod");
  if (st.ok() && ftruncate(fd, static_cast<off_t>(m->size_)) != 0) st = ErrnoToStatus(errno, "ftruncate");
  if (st.ok()) {
    m->addr_ = mmap(nullptr, m->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m->addr_ == MAP_FAILED) {
      m->addr_ = nullptr;
      st = ErrnoToStatus(errno, "mmap");
    }
  }
  close(fd);
  if (!st.ok()) return st;  // the destructor unlinks
  for (const Param& p : m->params_) {
    RETURN_IF_ERROR(m->weights_.Add({p.name, p.dtype, p.shape, m->data() + p.offset, p.nbytes}));
  }
  return m;
}

ShmEngineMemory::~ShmEngineMemory() {
  if (addr_ != nullptr) munmap(addr_, size_);
  if (!name_.empty()) shm_unlink(name_.c_str());
}

void ShmEngineMemory::FillParams(google::protobuf::RepeatedPtrField<v1::EngineParam>* params) const {
  for (const Param& p : params_) {
    v1::EngineParam* e = params->Add();
    e->set_name(p.name);
    e->set_dtype(comm::ToProto(p.dtype));
    for (int64_t d : p.shape) e->add_shape(d);
    e->set_nbytes(p.nbytes);
    e->mutable_memory()->set_shm_name(name_);
    e->mutable_memory()->set_offset(p.offset);
  }
}

uint64_t ShmEngineMemory::Checksum() const { return Xxh3_64({data(), size_}); }

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
