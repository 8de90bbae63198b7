#include "comm/shm/shm_communicator.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "comm/rendezvous.h"
#include "comm/store/store.h"
#include "common/cuda_ipc.h"
#include "common/failpoint.h"
#include "common/logging.h"
#include "common/status.h"

namespace wsync::comm {
namespace {

constexpr uint64_t kMagic = 0x31306d6873797377;  // "wsyshm01"

struct alignas(64) RankSlot {
  std::atomic<uint64_t> consumed;  // global chunks this member has consumed (the root: published)
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_time;  // /proc/<pid>/stat field 22: tells a reused pid apart
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free,
              "the segment's counters must be lock-free to be shared between processes");

// The process's state letter and start time, from /proc/<pid>/stat; false if it is gone.
bool ProcStat(int pid, char* state, uint64_t* start_time) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(text.substr(close + 1));
  std::string field;
  rest >> *state;  // field 3
  for (int i = 4; i < 22 && (rest >> field); ++i) {
  }
  return static_cast<bool>(rest >> *start_time);  // field 22
}

// What members of one group must share: the kernel (boot id) and the /dev/shm they map.
absl::StatusOr<std::string> HostIdentity() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(f, boot);
  struct stat st;
  if (stat("/dev/shm", &st) != 0) return ErrnoToStatus(errno, "stat /dev/shm (the shm backend needs it)");
  return absl::StrCat(boot.empty() ? "unknown-boot" : boot, "/dev", st.st_dev, "/uid", geteuid());
}

// The store's value under "<group>/shm/segment": the segment's name, then for a device ring its
// IPC handle in hex; or "!" and why rank 0 could not form the group.
constexpr char kFailed = '!';

// Joins the group's rendezvous (JoinGroup) announcing this host's identity, and checks that every
// member announced the same: kFailedPrecondition naming a member on another host or /dev/shm.
absl::Status JoinOnOneHost(const GroupOptions& o) {
  ASSIGN_OR_RETURN(const std::string identity, HostIdentity());
  RETURN_IF_ERROR(JoinGroup(*o.store, o.name, o.rank, o.size, identity, o.join_timeout, o.cancelled));
  for (int r = 0; r < o.size; ++r) {
    ASSIGN_OR_RETURN(const std::string other, o.store->Get(absl::StrCat(o.name, "/joined/", r), o.join_timeout));
    if (other != identity)
      return absl::FailedPreconditionError(absl::StrCat(
          "shm group \"", o.name, "\": the shm backend needs every member on one host with one /dev/shm, but rank ", r,
          " is on ", other, " and rank ", o.rank, " on ", identity, " (use gloo or nccl across hosts)"));
  }
  return absl::OkStatus();
}

// Each member says it has mapped the segment, and whether it opened the device ring (`no_ring`: why
// not), or why it failed (`mine`), then waits for every other's word. The first failure (its own, or
// kFailedPrecondition naming another member and its reason); else OK with, when some member could not
// open the device ring, the first such member's reason in *host_ring_because (every member reads the
// same words, so all of them fall back to the host ring together).
constexpr char kNoRing = '~';
absl::Status AllMapped(const GroupOptions& o, const absl::Status& mine, const absl::Status& no_ring,
                       std::string* host_ring_because) {
  const std::string key = absl::StrCat(o.name, "/shm/mapped/");
  const std::string word = !mine.ok()      ? absl::StrCat(std::string(1, kFailed), mine.ToString())
                           : !no_ring.ok() ? absl::StrCat(std::string(1, kNoRing), no_ring.ToString())
                                           : std::string("1");
  RETURN_IF_ERROR(o.store->Set(absl::StrCat(key, o.rank), word));
  RETURN_IF_ERROR(mine);
  std::vector<std::string> mapped;
  for (int r = 0; r < o.size; ++r) mapped.push_back(absl::StrCat(key, r));
  RETURN_IF_ERROR(WaitUnlessCancelled(*o.store, mapped, o.join_timeout, o.cancelled, "forming the group"));
  host_ring_because->clear();
  for (int r = 0; r < o.size; ++r) {
    ASSIGN_OR_RETURN(const std::string v, o.store->Get(mapped[static_cast<size_t>(r)], o.join_timeout));
    if (!v.empty() && v[0] == kFailed)
      return absl::FailedPreconditionError(absl::StrCat("rank ", r, " could not join: ", v.substr(1)));
    if (!v.empty() && v[0] == kNoRing && host_ring_because->empty())
      *host_ring_because = absl::StrCat("rank ", r, " cannot open the device ring: ", v.substr(1));
  }
  return absl::OkStatus();
}

}  // namespace

struct ShmCommunicator::DeviceRing {
  std::unique_ptr<CudaAllocation> owned;   // rank 0
  std::unique_ptr<CudaIpcMapping> mapped;  // every other member
};

struct ShmCommunicator::Header {
  uint64_t magic;
  uint32_t size;
  uint32_t slots;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint64_t> published;  // global chunks published by the roots so far
  alignas(64) std::atomic<int32_t> broken_by;   // 0, or 1 + the rank whose operation failed / aborted
  RankSlot ranks[kMaxRanks];
};

absl::StatusOr<std::unique_ptr<Communicator>> ShmCommunicator::Create(const GroupOptions& o, Ring ring) {
  if (o.store == nullptr) return absl::InvalidArgumentError("shm group: no rendezvous store");
  const bool device = ring == Ring::kDevice;
  if (device && !CudaIpcCompiled())
    return absl::UnimplementedError(absl::StrCat("shm group \"", o.name, "\": a device ring needs a CUDA build"));
  if (device && o.cuda_device < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("shm group \"", o.name, "\": a device ring needs a CUDA device, got ", o.cuda_device));
  if (o.size < 1 || o.size > kMaxRanks || o.rank < 0 || o.rank >= o.size)
    return absl::InvalidArgumentError(
        absl::StrCat("shm group \"", o.name, "\": rank ", o.rank, " of ", o.size, " (1..", kMaxRanks, " members)"));
  RETURN_IF_ERROR(JoinOnOneHost(o));

  // The host ring's slots are in the segment for a device ring too (untouched pages cost nothing): a
  // group whose members cannot all open the device ring falls back to them.
  const size_t header_bytes = (sizeof(Header) + 4095) / 4096 * 4096;
  const size_t bytes = header_bytes + kSlots * kSlotBytes;
  const std::string key = absl::StrCat(o.name, "/shm/segment");
  std::string segment, ring_handle;
  int fd = -1;
  if (o.rank == 0) {
    std::random_device rd;
    segment = absl::StrFormat("/wsync-comm-%d-%08x%08x", getpid(), rd(), rd());
    fd = shm_open(segment.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("creating the shm group segment ", segment));
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      close(fd);
      shm_unlink(segment.c_str());
      return ErrnoToStatus(err, absl::StrCat("sizing the shm group segment ", segment, " to ", bytes, " bytes"));
    }
  } else {
    RETURN_IF_ERROR(WaitUnlessCancelled(*o.store, {key}, o.join_timeout, o.cancelled,
                                        absl::StrCat("shm group \"", o.name, "\": waiting for the segment's name")));
    ASSIGN_OR_RETURN(segment, o.store->Get(key, o.join_timeout));
    if (!segment.empty() && segment[0] == kFailed)
      return absl::FailedPreconditionError(
          absl::StrCat("shm group \"", o.name, "\": rank 0 could not form the group: ", segment.substr(1)));
    std::vector<std::string> parts = absl::StrSplit(segment, absl::MaxSplits('\n', 1));
    segment = parts[0];
    if (parts.size() > 1) {
      if (parts[1].size() % 2 != 0 || parts[1].find_first_not_of("0123456789abcdef") != std::string::npos)
        return absl::DataLossError(absl::StrCat("shm group \"", o.name, "\": rank 0's device ring handle is not hex"));
      ring_handle = absl::HexStringToBytes(parts[1]);
    }
    if (device != (parts.size() > 1))
      return absl::FailedPreconditionError(absl::StrCat("shm group \"", o.name, "\": rank 0 formed a ",
                                                        device ? "host" : "device", " ring, this member a ",
                                                        device ? "device" : "host", " one"));
    fd = shm_open(segment.c_str(), O_RDWR, 0);
    if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("opening the shm group segment ", segment));
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
      close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat("shm group segment ", segment, " is not the ", bytes, "-byte segment of this wsync build"));
    }
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    if (o.rank == 0) shm_unlink(segment.c_str());
    return ErrnoToStatus(map_err, absl::StrCat("mapping the shm group segment ", segment));
  }
  std::unique_ptr<ShmCommunicator> c(new ShmCommunicator(o, base, bytes));
  if (device) {
    c->space_ = MemorySpace::Cuda(o.cuda_device);
    c->slots_ = kDeviceSlots;
    c->slot_bytes_ = kDeviceSlotBytes;
  }
  Header* h = c->header_;
  if (o.rank == 0) {
    h->size = static_cast<uint32_t>(o.size);
    h->slots = static_cast<uint32_t>(c->slots_);
    h->slot_bytes = c->slot_bytes_;
    std::atomic_thread_fence(std::memory_order_release);
    h->magic = kMagic;
  } else if (h->magic != kMagic || h->size != static_cast<uint32_t>(o.size) || h->slot_bytes != c->slot_bytes_) {
    return absl::FailedPreconditionError(absl::StrCat("shm group segment ", segment, " belongs to another group (size ",
                                                      h->size, ", ", h->slot_bytes, "-byte ring slots)"));
  }
  char state = 0;
  uint64_t start = 0;
  ProcStat(getpid(), &state, &start);
  h->ranks[o.rank].start_time.store(start, std::memory_order_relaxed);
  h->ranks[o.rank].pid.store(getpid(), std::memory_order_release);
  // The device ring: made by rank 0 before it publishes the segment, opened by the others after.
  absl::StatusOr<std::string> ring_ok = std::string();
  if (device) ring_ok = c->MakeDeviceRing(o, ring_handle);
  if (o.rank == 0) {
    const std::string value = !ring_ok.ok() ? absl::StrCat(std::string(1, kFailed), ring_ok.status().ToString())
                              : device      ? absl::StrCat(segment, "\n", absl::BytesToHexString(*ring_ok))
                                            : segment;
    absl::Status set = o.store->Set(key, value);
    if (!ring_ok.ok() || !set.ok()) shm_unlink(segment.c_str());
    RETURN_IF_ERROR(ring_ok.status());
    RETURN_IF_ERROR(set);
  }
  // A member whose GPU cannot open rank 0's allocation (another GPU without peer access) does not
  // fail the group: every member then uses the host ring.
  absl::Status no_ring = absl::OkStatus();
  if (o.rank != 0 && absl::IsFailedPrecondition(ring_ok.status()) && c->device_ring_->mapped == nullptr) {
    no_ring = ring_ok.status();
    ring_ok = std::string();
  }
  std::string host_ring_because;
  const absl::Status published = AllMapped(o, ring_ok.status(), no_ring, &host_ring_because);
  if (o.rank == 0) shm_unlink(segment.c_str());  // every member has it mapped (or formation failed)
  RETURN_IF_ERROR(
      Annotate(published, absl::StrCat("shm group \"", o.name, "\": waiting for every member to map ", segment)));
  if (!host_ring_because.empty()) c->UseHostRing(host_ring_because);
  c->StartWorker();
  return std::unique_ptr<Communicator>(std::move(c));
}

ShmCommunicator::ShmCommunicator(const GroupOptions& o, void* base, size_t bytes)
    : QueuedCommunicator(o.name, o.rank, o.size, o.default_timeout),
      header_(static_cast<Header*>(base)),
      ring_(static_cast<std::byte*>(base) + (sizeof(Header) + 4095) / 4096 * 4096),
      bytes_(bytes) {}

ShmCommunicator::~ShmCommunicator() { (void)Shutdown(); }

absl::StatusOr<std::string> ShmCommunicator::MakeDeviceRing(const GroupOptions& o, const std::string& handle) {
  device_ring_ = std::make_unique<DeviceRing>();
  const size_t bytes = static_cast<size_t>(slots_) * slot_bytes_;
  if (o.rank == 0) {
    absl::StatusOr<std::unique_ptr<CudaAllocation>> a = AllocateCuda(bytes, o.cuda_device);
    if (!a.ok())
      return Annotate(a.status(), absl::StrCat("allocating the ", bytes, "-byte device ring on cuda:", o.cuda_device));
    device_ring_->owned = std::move(*a);
    ring_ = static_cast<std::byte*>(device_ring_->owned->data());
    return device_ring_->owned->IpcHandle();
  }
  absl::StatusOr<std::unique_ptr<CudaIpcMapping>> m =
      FailpointHit("shm.device_ring_open")
          ? absl::FailedPreconditionError("failpoint shm.device_ring_open: the handle cannot be opened here")
          : OpenCudaIpc(handle, o.cuda_device);
  if (!m.ok())
    return Annotate(m.status(), absl::StrCat("rank ", o.rank, " opening rank 0's device ring on cuda:", o.cuda_device,
                                             " (another GPU without peer access? then use the host ring)"));
  device_ring_->mapped = std::move(*m);
  if (device_ring_->mapped->size() < bytes)
    return absl::FailedPreconditionError(
        absl::StrCat("rank 0's device ring holds ", device_ring_->mapped->size(), " bytes, this build's ", bytes));
  ring_ = static_cast<std::byte*>(device_ring_->mapped->data());
  return handle;
}

void ShmCommunicator::UseHostRing(const std::string& because) {
  // Rank 0 keeps its allocation until the group ends (a member may still have it open); the others
  // close theirs now.
  if (device_ring_ != nullptr) device_ring_->mapped.reset();
  WSYNC_LOG(WARNING) << "shm group \"" << group() << "\" (rank " << rank() << "): " << because
                     << "; the group moves its bytes through the host ring instead (device -> host -> device)";
  space_ = MemorySpace::Host();
  slots_ = kSlots;
  slot_bytes_ = kSlotBytes;
  ring_ = reinterpret_cast<std::byte*>(header_) + (sizeof(Header) + 4095) / 4096 * 4096;
}

absl::Status ShmCommunicator::ReleaseBackend() {
  device_ring_.reset();  // every operation has finished: no member reads the ring any more
  if (header_ != nullptr) munmap(header_, bytes_);
  header_ = nullptr;
  return absl::OkStatus();
}

void ShmCommunicator::OnBroken() {
  int32_t none = 0;
  if (header_ != nullptr) header_->broken_by.compare_exchange_strong(none, rank() + 1, std::memory_order_acq_rel);
}

absl::Status ShmCommunicator::CheckPeers() const {
  const int32_t b = header_->broken_by.load(std::memory_order_acquire);
  if (b != 0 && b - 1 != rank())
    return absl::UnavailableError(absl::StrCat("rank ", b - 1, " left the group (its operation failed or it aborted)"));
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) continue;
    const int32_t pid = header_->ranks[r].pid.load(std::memory_order_acquire);
    if (pid <= 0) continue;
    char state = 0;
    uint64_t start = 0;
    if (!ProcStat(pid, &state, &start) || state == 'Z' || state == 'X' ||
        start != header_->ranks[r].start_time.load(std::memory_order_relaxed))
      return absl::UnavailableError(absl::StrCat("rank ", r, " (pid ", pid, ") exited"));
  }
  return absl::OkStatus();
}

template <typename Ready>
absl::Status ShmCommunicator::WaitFor(const OpContext& ctx, Ready&& ready, const char* what) {
  absl::Time next_check = absl::InfinitePast();
  for (int i = 0;; ++i) {
    if (ready()) return absl::OkStatus();
    if (i < 4096) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    const absl::Time now = absl::Now();
    if (now >= next_check) {
      absl::Status s = ctx.Check();
      if (s.ok()) s = CheckPeers();
      if (!s.ok()) return Annotate(s, absl::StrCat("waiting for ", what));
      next_check = now + absl::Milliseconds(20);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(i < 20000 ? 20 : 200));
  }
}

absl::Status ShmCommunicator::Stream(const OpContext& ctx, absl::Span<const MutableBytes> pieces, int root) {
  size_t total = 0;
  for (const MutableBytes& p : pieces) total += p.nbytes;
  if (size() == 1 || total == 0) return absl::OkStatus();
  const uint64_t slots = static_cast<uint64_t>(slots_);
  const uint64_t begin = next_chunk_, end = begin + (total + slot_bytes_ - 1) / slot_bytes_;
  next_chunk_ = end;
  const bool is_root = rank() == root;
  RankSlot* ranks = header_->ranks;
  auto all_consumed = [&](uint64_t at_least) {
    for (int r = 0; r < size(); ++r)
      if (ranks[r].consumed.load(std::memory_order_acquire) < at_least) return false;
    return true;
  };
  size_t piece = 0, offset = 0;  // cursor into `pieces`
  for (uint64_t g = begin; g < end; ++g) {
    std::byte* slot = ring_ + (g % slots) * slot_bytes_;
    const size_t n = std::min(slot_bytes_, total - static_cast<size_t>(g - begin) * slot_bytes_);
    if (is_root) {
      if (g >= slots) {
        RETURN_IF_ERROR(WaitFor(
            ctx, [&] { return all_consumed(g + 1 - slots); }, "a free ring slot"));
      }
    } else {
      RETURN_IF_ERROR(WaitFor(
          ctx, [&] { return header_->published.load(std::memory_order_acquire) >= g + 1; },
          absl::StrFormat("rank %d's data", root).c_str()));
    }
    for (size_t done = 0; done < n;) {  // copy n bytes between the slot and the pieces
      while (pieces[piece].nbytes == offset) {
        ++piece;
        offset = 0;
      }
      const size_t m = std::min(n - done, pieces[piece].nbytes - offset);
      std::byte* user = static_cast<std::byte*>(pieces[piece].data) + offset;
      RETURN_IF_ERROR(is_root ? space_.Copy(slot + done, user, m) : space_.Copy(user, slot + done, m));
      done += m;
      offset += m;
    }
    // A device chunk counts (published, or consumed: its slot free again) once its copy finished.
    if (!space_.host()) RETURN_IF_ERROR(space_.Synchronize());
    if (is_root) header_->published.store(g + 1, std::memory_order_release);
    ranks[rank()].consumed.store(g + 1, std::memory_order_release);
  }
  return WaitFor(
      ctx, [&] { return all_consumed(end); }, "every member to receive");
}

absl::Status ShmCommunicator::DoBroadcast(const OpContext& ctx, absl::Span<const MutableBytes> buffers, int root) {
  return Stream(ctx, buffers, root);
}

absl::Status ShmCommunicator::DoAllGather(const OpContext& ctx, absl::Span<const ConstBytes> inputs,
                                          absl::Span<const MutableBytes> outputs) {
  std::vector<MutableBytes> blocks(inputs.size());
  for (int q = 0; q < size(); ++q) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      blocks[i] = {static_cast<std::byte*>(outputs[i].data) + q * inputs[i].nbytes, inputs[i].nbytes};
      if (q == rank() && blocks[i].data != inputs[i].data)
        RETURN_IF_ERROR(space_.Copy(blocks[i].data, inputs[i].data, inputs[i].nbytes));
    }
    RETURN_IF_ERROR(Stream(ctx, blocks, q));
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::DoAllGatherV(const OpContext& ctx, ConstBytes input, MutableBytes output,
                                           absl::Span<const size_t> bytes_per_rank) {
  size_t offset = 0;
  for (int q = 0; q < size(); ++q) {
    MutableBytes block{static_cast<std::byte*>(output.data) + offset, bytes_per_rank[q]};
    if (q == rank() && block.data != input.data) RETURN_IF_ERROR(space_.Copy(block.data, input.data, input.nbytes));
    RETURN_IF_ERROR(Stream(ctx, {&block, 1}, q));
    offset += bytes_per_rank[q];
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::DoBarrier(const OpContext& ctx) {
  uint8_t byte = 0;
  MutableBytes b{&byte, 1};
  return Stream(ctx, {&b, 1}, 0);
}

}  // namespace wsync::comm
