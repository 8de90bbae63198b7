#include "engine_memory/param_arena.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "comm/bucket/stream.h"
#include "common/checksum.h"
#include "common/status.h"

namespace wsync::engine_memory {
namespace {

// Crash-cleanup registry: fixed slots of precomputed /dev/shm paths, so that a signal handler can
// unlink them with unlink(2) alone. A slot is live while `used` is true.
constexpr int kSlots = 16;
constexpr size_t kPathMax = 320;
struct Slot {
  std::atomic<bool> used{false};
  std::atomic<bool> ready{false};
  char path[kPathMax];
};
Slot g_slots[kSlots];

int Register(const std::string& name) {
  const std::string path = absl::StrCat("/dev/shm", name);
  if (path.size() + 1 > kPathMax) return -1;
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (g_slots[i].used.compare_exchange_strong(expected, true)) {
      std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
      g_slots[i].ready.store(true, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void Unregister(int slot) {
  if (slot < 0) return;
  g_slots[slot].ready.store(false, std::memory_order_release);
  g_slots[slot].used.store(false, std::memory_order_release);
}

void CrashHandler(int sig) {
  UnlinkAllShmSegments();
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void UnlinkAllShmSegments() {
  for (Slot& s : g_slots) {
    if (s.ready.load(std::memory_order_acquire)) unlink(s.path);
  }
}

void InstallShmCrashCleanup() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = CrashHandler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(sig, &sa, nullptr);
  }
  std::atexit(UnlinkAllShmSegments);
}

namespace {

// "wsync-engine-<id>-r<rank>-": the part of a segment's name fixed by the engine rank.
std::string ShmPrefix(absl::string_view engine_id, int tp_rank) {
  std::string id;
  for (char c : engine_id.substr(0, 64)) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    id.push_back(ok ? c : '_');
  }
  if (id.empty()) id = "engine";
  return absl::StrFormat("wsync-engine-%s-r%d-", id, tp_rank);
}

}  // namespace

absl::StatusOr<int> ParseParamMemory(absl::string_view text) {
  if (text == "shm") return -1;
  absl::string_view number = text;
  int device = -1;
  if (absl::ConsumePrefix(&number, "cuda:") && absl::SimpleAtoi(number, &device) && device >= 0) return device;
  return absl::InvalidArgumentError(absl::StrCat("param-memory ", text, ": want shm or cuda:N"));
}

std::string UniqueShmName(absl::string_view engine_id, int tp_rank) {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return absl::StrFormat("/%s%d-%016x", ShmPrefix(engine_id, tp_rank), static_cast<int>(getpid()), r);
}

absl::StatusOr<std::vector<std::string>> ReclaimStaleShmSegments(absl::string_view engine_id, int tp_rank,
                                                                 const std::string& dir) {
  const std::string prefix = ShmPrefix(engine_id, tp_rank);
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return ErrnoToStatus(errno, absl::StrCat("listing ", dir));
  std::vector<std::string> removed;
  while (const dirent* e = readdir(d)) {
    const absl::string_view name(e->d_name);
    if (!absl::StartsWith(name, prefix)) continue;
    // The rest is exactly "<pid>-<16 hex digits>" (an engine id that merely starts like ours, e.g.
    // "a" vs "a-r0-x", leaves something else).
    const absl::string_view rest = name.substr(prefix.size());
    const size_t dash = rest.find('-');
    int pid = 0;
    if (dash == absl::string_view::npos || rest.size() - dash - 1 != 16 ||
        rest.substr(dash + 1).find_first_not_of("0123456789abcdef") != absl::string_view::npos ||
        !absl::SimpleAtoi(rest.substr(0, dash), &pid) || pid <= 0)
      continue;
    if (pid == getpid() || kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    const std::string path = absl::StrCat(dir, "/", name);
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || st.st_uid != geteuid() || !S_ISREG(st.st_mode)) continue;
    if (unlink(path.c_str()) == 0) removed.push_back(std::string(name));
  }
  closedir(d);
  return removed;
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(const std::string& name, size_t size) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 250)
    return absl::InvalidArgumentError(
        absl::StrCat("shm segment name \"", name, "\" must be '/' then 1-249 characters without '/'"));
  if (size == 0) return absl::InvalidArgumentError(absl::StrCat("shm segment ", name, ": size 0"));
  const int slot = Register(name);
  if (slot < 0)
    return absl::ResourceExhaustedError(absl::StrCat("shm segment ", name, ": more than ", kSlots, " live segments"));
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const int err = errno;
    Unregister(slot);
    if (err == EEXIST) return absl::AlreadyExistsError(absl::StrCat("shm segment ", name, " already exists"));
    return ErrnoToStatus(err, absl::StrCat("shm_open(", name, ")"));
  }
  auto fail = [&](const char* what) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    Unregister(slot);
    return ErrnoToStatus(err, absl::StrCat(what, " of shm segment ", name, " (", size, " bytes)"));
  };
  if (fchmod(fd, 0600) != 0) return fail("fchmod");
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) return fail("ftruncate");
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return fail("mmap");
  close(fd);
  return std::unique_ptr<ShmSegment>(new ShmSegment(name, data, size, slot));
}

ShmSegment::~ShmSegment() {
  munmap(data_, size_);
  shm_unlink(name_.c_str());
  Unregister(slot_);
}

absl::StatusOr<std::unique_ptr<ParamArena>> ParamArena::Create(const engine_model::EngineLayout& layout,
                                                               const std::string& shm_name) {
  return Lay(layout, shm_name, -1);
}

absl::StatusOr<std::unique_ptr<ParamArena>> ParamArena::CreateOnDevice(const engine_model::EngineLayout& layout,
                                                                       int device) {
  return Lay(layout, "", device);
}

absl::StatusOr<std::unique_ptr<ParamArena>> ParamArena::Lay(const engine_model::EngineLayout& layout,
                                                            const std::string& shm_name, int device) {
  const auto& params = layout.params();
  std::vector<uint64_t> offsets;
  offsets.reserve(params.size());
  std::vector<uint64_t> sizes;
  sizes.reserve(params.size());
  uint64_t end = 0;
  for (const engine_model::EngineParam& p : params) {
    end = (end + kParamAlignment - 1) / kParamAlignment * kParamAlignment;
    offsets.push_back(end);
    ASSIGN_OR_RETURN(int64_t nbytes, NumBytes(p.dtype_in(engine_model::ParamForm::kEngine), p.engine_shape));
    sizes.push_back(static_cast<uint64_t>(nbytes));
    end += static_cast<uint64_t>(nbytes);
  }
  const uint64_t size = std::max<uint64_t>((end + kParamAlignment - 1) / kParamAlignment * kParamAlignment, 64);
  auto arena = std::unique_ptr<ParamArena>(new ParamArena());
  std::byte* base = nullptr;
  if (device >= 0) {
    ASSIGN_OR_RETURN(arena->device_, AllocateCuda(size, device));
    ASSIGN_OR_RETURN(arena->ipc_handle_, arena->device_->IpcHandle());
    base = static_cast<std::byte*>(arena->device_->data());
  } else {
    ASSIGN_OR_RETURN(arena->segment_, ShmSegment::Create(shm_name, size));
    base = static_cast<std::byte*>(arena->segment_->data());
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const engine_model::EngineParam& p = params[i];
    engine_model::EngineBuffer b;
    b.name = p.name;
    b.dtype = p.dtype_in(engine_model::ParamForm::kEngine);
    b.shape = p.engine_shape;
    b.data = base + offsets[i];
    b.nbytes = sizes[i];
    b.cuda_device = device;
    RETURN_IF_ERROR(arena->weights_.Add(std::move(b)));
  }
  RETURN_IF_ERROR(arena->weights_.CheckMatches(layout));
  arena->offsets_ = std::move(offsets);
  return arena;
}

size_t ParamArena::size() const { return on_device() ? device_->size() : segment_->size(); }

std::string ParamArena::where() const {
  return on_device() ? absl::StrCat("CUDA device ", device_->device()) : absl::StrCat("shm ", segment_->name());
}

void ParamArena::FillParams(google::protobuf::RepeatedPtrField<v1::EngineParam>* out) const {
  out->Clear();
  const auto& buffers = weights_.buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    v1::EngineParam* p = out->Add();
    p->set_name(buffers[i].name);
    p->set_dtype(comm::ToProto(buffers[i].dtype));  // comm/bucket/stream.h
    for (int64_t d : buffers[i].shape) p->add_shape(d);
    p->set_nbytes(buffers[i].nbytes);
    if (on_device()) {
      p->mutable_memory()->set_cuda_ipc_handle(ipc_handle_);
      p->mutable_memory()->set_cuda_device(device_->device());
    } else {
      p->mutable_memory()->set_shm_name(segment_->name());
    }
    p->mutable_memory()->set_offset(offsets_[i]);
  }
}

absl::StatusOr<uint64_t> ParamArena::Checksum() const {
  if (!on_device()) return Xxh3_64({static_cast<const std::byte*>(segment_->data()), segment_->size()});
  ASSIGN_OR_RETURN(Buffer host, Buffer::Allocate(device_->size()));
  RETURN_IF_ERROR(CopyDeviceToHost(host.data(), device_->data(), device_->size(), device_->device()));
  return Xxh3_64(host.span());
}

}  // namespace wsync::engine_memory
