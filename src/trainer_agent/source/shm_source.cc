#include "trainer_agent/source/shm_source.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda_ipc.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/status.h"
#include "trainer_client/protocol.h"

namespace wsync::trainer_agent {
namespace tc = ::wsync::trainer_client;

namespace {

absl::Status Errno(absl::string_view what) { return ::wsync::ErrnoToStatus(errno, what); }

// A private directory for the sockets: created 0700, or an existing one owned by us and not
// accessible to others.
absl::Status EnsurePrivateDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::FailedPreconditionError(absl::StrCat("creating the runtime directory ", dir, ": ", ec.message()));
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) return Errno(absl::StrCat("stat ", dir));
  if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  if (st.st_uid != geteuid())
    return absl::FailedPreconditionError(absl::StrCat("the runtime directory ", dir, " belongs to uid ", st.st_uid,
                                                      ", not to this agent (uid ", geteuid(),
                                                      "); set WSYNC_RUNTIME_DIR to a private directory"));
  if ((st.st_mode & 077) != 0 && chmod(dir.c_str(), 0700) != 0)
    return Errno(absl::StrCat("making ", dir, " private (chmod 0700)"));
  return absl::OkStatus();
}

}  // namespace

// One accepted registration: the agent's own open file description of the segment (its flock
// is the agent's side of the update lock), the read-only mapping, the tensors bound to the plan.
struct ShmSource::Registration {
  uint64_t id = 0;
  uint32_t pid = 0;
  int fd = -1;
  void* base = nullptr;
  uint64_t bytes = 0;
  std::vector<MegatronParam> params;
  std::vector<TensorView> tensors;  // plan order
  struct Device {
    std::unique_ptr<CudaIpcMapping> mapping;
    uint64_t offset = 0;
    Buffer host;  // the tensor's view points here
  };
  std::vector<Device> devices;
  int cuda_device = -1;  // >= 0: the tensors are views of this device's memory (the device stages)
  std::atomic<bool> connected{true};

  absl::Mutex mu;
  int readers ABSL_GUARDED_BY(mu) = 0;
  uint64_t declared_version ABSL_GUARDED_BY(mu) = 0;  // the client's last sync request
  uint64_t declared_generation ABSL_GUARDED_BY(mu) = 0;

  uint64_t generation() const {
    return __atomic_load_n(&static_cast<const tc::SegmentHeader*>(base)->generation, __ATOMIC_ACQUIRE);
  }
  void Declare(uint64_t version, uint64_t generation) {
    absl::MutexLock lock(&mu);
    declared_version = version;
    declared_generation = generation;
  }
  // Waits until the client has declared `version`; kFailedPrecondition if it declared a newer one.
  absl::Status AwaitDeclared(uint64_t version, absl::Duration timeout, int rank) {
    absl::MutexLock lock(&mu);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return declared_version >= version; };
    if (!mu.AwaitWithTimeout(absl::Condition(&reached), timeout))
      return absl::DeadlineExceededError(absl::StrCat(
          "the training process of rank ", rank, " (pid ", pid, ") has not declared version ", version, " within ",
          absl::FormatDuration(timeout), " (its last request was for version ", declared_version,
          "); with an shm: source the training processes request their syncs (wsync_client_request_sync)"));
    if (declared_version > version)
      return absl::FailedPreconditionError(absl::StrCat("the training process of rank ", rank, " (pid ", pid,
                                                        ") has already declared version ", declared_version,
                                                        ", newer than this sync's version ", version));
    return absl::OkStatus();
  }
  // Under the shared lock: the weights are still those declared as `version`.
  absl::Status CheckGeneration(uint64_t version, int rank) {
    absl::MutexLock lock(&mu);
    const uint64_t now = generation();
    if (declared_version != version || now != declared_generation)
      return absl::FailedPreconditionError(absl::StrCat(
          "the weights of rank ", rank, " (pid ", pid, ") changed after it declared version ", version,
          " (update generation ", now, ", declared at ", declared_generation, "); not publishing a torn version"));
    return absl::OkStatus();
  }

  ~Registration() {
    if (base != nullptr) munmap(base, bytes);
    if (fd >= 0) close(fd);
  }

  // The shared side of the update lock, counted (flock locks belong to the open file description).
  absl::Status AcquireShared(absl::Duration timeout, int rank) {
    absl::MutexLock lock(&mu);
    if (readers == 0) {
      const absl::Time deadline = absl::Now() + timeout;
      while (flock(fd, LOCK_SH | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) return Errno("flock(LOCK_SH) on the trainer's segment");
        if (absl::Now() >= deadline)
          return absl::DeadlineExceededError(absl::StrCat("the training process of rank ", rank, " (pid ", pid,
                                                          ") held its update lock for ", absl::FormatDuration(timeout),
                                                          " (between wsync_client_begin_update and _end_update)"));
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
    ++readers;
    return absl::OkStatus();
  }
  void ReleaseShared() {
    absl::MutexLock lock(&mu);
    if (--readers == 0) flock(fd, LOCK_UN);
  }
};

struct ShmSource::State {
  int listen_fd = -1;
  std::atomic<bool> stopping{false};
  std::thread acceptor;

  mutable absl::Mutex mu;
  std::vector<std::thread> connections ABSL_GUARDED_BY(mu);
  std::vector<int> connection_fds ABSL_GUARDED_BY(mu);
  std::shared_ptr<Registration> current ABSL_GUARDED_BY(mu);
  std::optional<SourceModel> model ABSL_GUARDED_BY(mu);
  std::string parallel_canonical ABSL_GUARDED_BY(mu);
  SyncRequester requester ABSL_GUARDED_BY(mu);
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
};

namespace {

struct Peer {
  uid_t uid = 0;
  pid_t pid = 0;
};

tc::Reply ToReply(const absl::Status& s) {
  tc::Reply r;
  r.code = static_cast<int32_t>(s.code());
  r.message = std::string(s.message());
  return r;
}

}  // namespace

ShmSource::ShmSource(ShmSourceOptions options) : options_(std::move(options)), state_(std::make_unique<State>()) {}

absl::StatusOr<std::unique_ptr<ShmSource>> ShmSource::Start(const ShmSourceOptions& options) {
  if (!tc::ValidSourceName(options.name))
    return absl::InvalidArgumentError(
        absl::StrCat("shm source name '", options.name, "' must match [A-Za-z0-9._-]{1,64} (not starting with '.')"));
  if (options.rank < 0) return absl::InvalidArgumentError(absl::StrCat("negative rank ", options.rank));
  std::unique_ptr<ShmSource> src(new ShmSource(options));
  const std::string dir = options.runtime_dir.empty() ? tc::RuntimeDir() : options.runtime_dir;
  RETURN_IF_ERROR(EnsurePrivateDir(dir));
  src->socket_path_ = tc::SocketPath(dir, options.name, options.rank);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (src->socket_path_.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", src->socket_path_));
  std::memcpy(addr.sun_path, src->socket_path_.c_str(), src->socket_path_.size() + 1);

  // A socket file left by an agent that died is replaced; one that answers is someone else's.
  const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (probe >= 0) {
    const bool live = ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(probe);
    if (live)
      return absl::AlreadyExistsError(absl::StrCat("another agent already serves ", src->socket_path_,
                                                   " (shm:", options.name, " rank ", options.rank, ")"));
  }
  unlink(src->socket_path_.c_str());
  State& st = *src->state_;
  st.listen_fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (st.listen_fd < 0) return Errno("socket");
  if (::bind(st.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    return Errno(absl::StrCat("bind ", src->socket_path_));
  chmod(src->socket_path_.c_str(), 0600);
  if (::listen(st.listen_fd, 8) != 0) return Errno(absl::StrCat("listen ", src->socket_path_));

  ShmSource* self = src.get();
  st.acceptor = std::thread([self] {
    State& s = *self->state_;
    while (!s.stopping.load()) {
      pollfd p{s.listen_fd, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      const int fd = ::accept4(s.listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      ucred cred{};
      socklen_t len = sizeof(cred);
      if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != geteuid()) {
        WSYNC_LOG(WARNING) << "shm source: refused a connection from uid " << cred.uid << " (pid " << cred.pid
                           << "); only uid " << geteuid() << " may register";
        close(fd);
        continue;
      }
      absl::MutexLock lock(&s.mu);
      s.connection_fds.push_back(fd);
      s.connections.emplace_back([self, fd, pid = cred.pid, uid = cred.uid] { self->Serve(fd, pid, uid); });
    }
  });
  WSYNC_LOG(INFO) << "shm source '" << options.name << "' for rank " << options.rank << ": waiting for the training "
                  << "process on " << src->socket_path_;
  return src;
}

ShmSource::~ShmSource() {
  State& st = *state_;
  st.stopping = true;
  if (st.acceptor.joinable()) st.acceptor.join();
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&st.mu);
    for (int fd : st.connection_fds) ::shutdown(fd, SHUT_RDWR);  // wakes the connection threads
    threads = std::move(st.connections);
  }
  for (auto& t : threads) t.join();
  if (st.listen_fd >= 0) {
    close(st.listen_fd);
    unlink(socket_path_.c_str());
  }
}

absl::Status ShmSource::WaitForRegistration(absl::Duration timeout, const std::atomic<bool>* stop) const {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Time next_log = absl::Now() + absl::Seconds(10);
  absl::MutexLock lock(&state_->mu);
  for (;;) {
    auto registered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) { return state_->current != nullptr; };
    state_->mu.AwaitWithDeadline(absl::Condition(&registered),
                                 std::min(deadline, absl::Now() + absl::Milliseconds(200)));
    if (registered()) return absl::OkStatus();
    if (stop != nullptr && stop->load()) return absl::CancelledError("stopped while waiting for the training process");
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(
          absl::StrCat("no training process registered on ", socket_path_, " within ", absl::FormatDuration(timeout)));
    if (absl::Now() >= next_log) {
      WSYNC_LOG(INFO) << "still waiting for the training process of rank " << options_.rank << " to register on "
                      << socket_path_;
      next_log = absl::Now() + absl::Seconds(10);
    }
  }
}

void ShmSource::SetSyncRequester(SyncRequester requester) {
  absl::MutexLock lock(&state_->mu);
  state_->requester = std::move(requester);
}

const SourceModel& ShmSource::source_model() const {
  absl::MutexLock lock(&state_->mu);
  if (!state_->model.has_value()) {
    WSYNC_LOG(ERROR) << "ShmSource::source_model() before a registration";
    std::abort();
  }
  return *state_->model;  // set once, never replaced
}

void ShmSource::Serve(int fd, int pid, unsigned uid) {
  std::shared_ptr<Registration> mine;
  for (;;) {
    tc::MsgType type;
    std::string payload, error;
    if (tc::RecvFrame(fd, &type, &payload, -1, &error) != 0) {
      if (!state_->stopping.load() && error.find("closed") == std::string::npos)
        WSYNC_LOG(WARNING) << "shm source: connection from pid " << pid << ": " << error;
      break;
    }
    tc::Reply reply;
    if (type == tc::MsgType::kRegister) {
      tc::RegisterRequest req;
      if (!tc::Decode(payload, &req, &error)) {
        reply = ToReply(absl::InvalidArgumentError(error));
      } else {
        auto reg = Register(req, uid, mine != nullptr);
        if (reg.ok()) {
          mine = *reg;
        } else {
          WSYNC_LOG(WARNING) << "shm source: refused the registration of pid " << req.client_pid << ": "
                             << reg.status();
          reply = ToReply(reg.status());
        }
      }
    } else if (type == tc::MsgType::kRequestSync) {
      tc::RequestSyncRequest req;
      if (!tc::Decode(payload, &req, &error)) {
        reply = ToReply(absl::InvalidArgumentError(error));
      } else if (mine == nullptr) {
        reply = ToReply(absl::FailedPreconditionError("register before requesting a sync"));
      } else {
        SyncRequester requester;
        {
          absl::MutexLock lock(&state_->mu);
          requester = state_->requester;
        }
        if (!requester) {
          reply = ToReply(absl::UnavailableError("the trainer agents are still starting (no coordinator yet); retry"));
        } else {
          const absl::Duration timeout =
              req.timeout_ms < 0 ? absl::InfiniteDuration() : absl::Milliseconds(req.timeout_ms);
          if (req.version != 0) mine->Declare(req.version, req.generation);
          auto r = requester(req.version, req.wait, timeout);
          if (r.ok()) {
            reply.sync_id = r->sync_id;
            reply.version = r->version;
            reply.coalesced = r->coalesced;
          } else {
            reply = ToReply(r.status());
          }
        }
      }
    } else {
      reply = ToReply(absl::InvalidArgumentError(absl::StrCat("unknown request type ", static_cast<uint32_t>(type))));
    }
    if (tc::SendFrame(fd, tc::MsgType::kReply, tc::Encode(reply), tc::NowMs() + 10000, &error) != 0) break;
  }
  if (mine) {
    mine->connected = false;
    WSYNC_LOG(WARNING) << "shm source: the training process of rank " << options_.rank << " (pid " << mine->pid
                       << ") disconnected; rank " << options_.rank << " is not synced until it registers again";
  }
  absl::MutexLock lock(&state_->mu);
  auto& fds = state_->connection_fds;
  fds.erase(std::remove(fds.begin(), fds.end(), fd), fds.end());
  close(fd);
}

absl::StatusOr<std::shared_ptr<ShmSource::Registration>> ShmSource::Register(const tc::RegisterRequest& req,
                                                                             unsigned uid, bool has_one) {
  const std::string who = absl::StrCat("the registration of pid ", req.client_pid, " (rank ", req.rank, ")");
  if (has_one) return absl::FailedPreconditionError("this connection has already registered");
  if (req.source_name != options_.name || req.rank != options_.rank)
    return absl::InvalidArgumentError(absl::StrCat(who, " is for shm:", req.source_name, " rank ", req.rank,
                                                   ", this agent serves shm:", options_.name, " rank ", options_.rank));
  ASSIGN_OR_RETURN(SourceModel model, ParseSourceModel(req.config_json, "the registered config_json", req.parallel_json,
                                                       "the registered parallel_json"));
  const std::string canonical = SourceParallelToJson(model.parallel);
  if (options_.world_size > 0 && model.parallel.world_size != options_.world_size)
    return absl::InvalidArgumentError(absl::StrCat(who, ": parallel_json says world_size ", model.parallel.world_size,
                                                   " but ", options_.world_size, " trainer agents run"));
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->model && (state_->model->config_json != model.config_json || state_->parallel_canonical != canonical))
      return absl::FailedPreconditionError(
          absl::StrCat(who,
                       ": the model config or parallel layout differs from the first registration; the agents' "
                       "layout is fixed once they have started (restart them to change the model)"));
    if (state_->current && state_->current->connected.load())
      return absl::AlreadyExistsError(absl::StrCat("rank ", options_.rank, " is already registered by pid ",
                                                   state_->current->pid, ", which is still connected"));
  }

  auto reg = std::make_shared<Registration>();
  reg->pid = req.client_pid;
  // The segment: ours to read only if it is the client's and private.
  reg->fd = shm_open(req.segment.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (reg->fd < 0) return Errno(absl::StrCat(who, ": opening its shared memory ", req.segment));
  struct stat st;
  if (fstat(reg->fd, &st) != 0) return Errno(absl::StrCat("fstat ", req.segment));
  if (st.st_uid != uid || (st.st_mode & 077) != 0)
    return absl::PermissionDeniedError(
        absl::StrFormat("%s: shared memory %s has owner %d mode %04o; want owner %d "
                        "mode 0600",
                        who, req.segment, st.st_uid, st.st_mode & 07777, uid));
  if (static_cast<uint64_t>(st.st_size) < req.segment_bytes)
    return absl::InvalidArgumentError(absl::StrCat(who, ": shared memory ", req.segment, " has ", st.st_size,
                                                   " bytes, the registration says ", req.segment_bytes));
  if (req.segment_bytes < tc::kSegmentHeaderBytes)
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": a segment of ", req.segment_bytes, " bytes has no room for its header"));
  void* p = mmap(nullptr, req.segment_bytes, PROT_READ, MAP_SHARED, reg->fd, 0);
  if (p == MAP_FAILED) return Errno(absl::StrCat("mmap ", req.segment));
  reg->base = p;
  reg->bytes = req.segment_bytes;
  if (static_cast<const tc::SegmentHeader*>(p)->magic != tc::kSegmentMagic)
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": shared memory ", req.segment, " has no wsync segment header"));

  // The device stages: every tensor on one CUDA device, and a layout without TP / EP gathers unless
  // the gathers run on the device too.
  const ParallelLayout& layout = model.layout;
  const bool gathers = layout.tp() > 1 || layout.ep() > 1 || layout.etp() > 1;
  if (options_.device_stages && !req.tensors.empty() && (!gathers || options_.device_gathers) &&
      std::all_of(req.tensors.begin(), req.tensors.end(), [&](const tc::TensorDecl& t) {
        return t.location != tc::Location::kHostShm && t.device == req.tensors.front().device;
      }))
    reg->cuda_device = req.tensors.front().device;
  std::vector<std::pair<std::string, TensorView>> named;
  named.reserve(req.tensors.size());
  for (const tc::TensorDecl& t : req.tensors) {
    auto dtype = ParseSafetensorsDType(t.dtype);
    if (!dtype.ok()) return Annotate(dtype.status(), absl::StrCat(who, ": tensor ", t.name));
    Shape shape(t.shape.begin(), t.shape.end());
    uint64_t nbytes = 0;
    if (!tc::TensorBytes(t.dtype, t.shape, &nbytes) || nbytes != t.nbytes)
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": tensor ", t.name, " declares ", t.nbytes, " bytes for its dtype and shape"));
    std::span<const std::byte> bytes;
    if (t.location == tc::Location::kHostShm) {
      if (t.offset % 64 != 0 || t.offset < tc::kSegmentHeaderBytes || t.offset > reg->bytes ||
          nbytes > reg->bytes - t.offset)
        return absl::InvalidArgumentError(absl::StrCat(who, ": tensor ", t.name, " at [", t.offset, ", +", nbytes,
                                                       ") is not a 64-byte aligned range after the header of the ",
                                                       reg->bytes, "-byte segment"));
      bytes = {static_cast<const std::byte*>(reg->base) + t.offset, static_cast<size_t>(nbytes)};
    } else {
      Registration::Device d;
      auto mapping = OpenCudaIpc(t.cuda_ipc_handle, t.device);
      if (!mapping.ok()) return Annotate(mapping.status(), absl::StrCat(who, ": tensor ", t.name));
      d.mapping = std::move(*mapping);
      d.offset = t.offset;
      if (reg->cuda_device >= 0) {
        if (t.offset > d.mapping->size() || nbytes > d.mapping->size() - t.offset)
          return absl::InvalidArgumentError(absl::StrCat(who, ": tensor ", t.name, " at [", t.offset, ", +", nbytes,
                                                         ") lies outside its ", d.mapping->size(),
                                                         "-byte CUDA allocation"));
        bytes = {static_cast<const std::byte*>(d.mapping->data()) + t.offset, static_cast<size_t>(nbytes)};
      } else {
        ASSIGN_OR_RETURN(d.host, Buffer::Allocate(nbytes));
        bytes = {d.host.data(), static_cast<size_t>(nbytes)};
      }
      reg->devices.push_back(std::move(d));
    }
    ASSIGN_OR_RETURN(TensorView view, TensorView::Make(*dtype, std::move(shape), bytes, t.name));
    named.emplace_back(t.name, view);
  }
  ASSIGN_OR_RETURN(reg->params, PlanRank(model.model, model.layout, model.parallel, options_.rank));
  ASSIGN_OR_RETURN(reg->tensors, BindToPlan(reg->params, named, who));

  absl::MutexLock lock(&state_->mu);
  if (state_->current && state_->current->connected.load())  // a concurrent registration won
    return absl::AlreadyExistsError(absl::StrCat("rank ", options_.rank, " is already registered by pid ",
                                                 state_->current->pid, ", which is still connected"));
  if (!state_->model) {
    state_->model = std::move(model);
    state_->parallel_canonical = canonical;
  }
  reg->id = state_->next_id++;
  state_->current = reg;
  WSYNC_LOG(INFO) << "shm source: rank " << options_.rank << " registered by pid " << reg->pid << ": "
                  << reg->tensors.size() << " tensors, " << reg->bytes << " bytes of shared memory"
                  << (reg->devices.empty() ? "" : absl::StrCat(", ", reg->devices.size(), " on CUDA devices"))
                  << (reg->cuda_device >= 0
                          ? absl::StrCat(", read in place on cuda:", reg->cuda_device, " (the device stages)")
                          : "");
  return reg;
}

int ShmSource::resident_device() const {
  absl::MutexLock lock(&state_->mu);
  return state_->current != nullptr ? state_->current->cuda_device : -1;
}

absl::StatusOr<RankShard> ShmSource::OpenRank(int global_rank, uint64_t version) const {
  if (global_rank != options_.rank)
    return absl::InvalidArgumentError(
        absl::StrCat("shm:", options_.name, " of rank ", options_.rank, " holds no tensors of rank ", global_rank));
  std::shared_ptr<Registration> reg;
  {
    absl::MutexLock lock(&state_->mu);
    reg = state_->current;
  }
  if (reg == nullptr)
    return absl::FailedPreconditionError(absl::StrCat("no training process has registered on ", socket_path_));
  if (!reg->connected.load())
    return absl::FailedPreconditionError(absl::StrCat("the training process of rank ", options_.rank, " (pid ",
                                                      reg->pid,
                                                      ") has disconnected; its weights are not synced "
                                                      "until it registers again"));
  if (version != 0) RETURN_IF_ERROR(reg->AwaitDeclared(version, options_.lock_timeout, options_.rank));
  RETURN_IF_ERROR(reg->AcquireShared(options_.lock_timeout, options_.rank));
  // The lease: releases the shared lock when the last copy of the shard's backing goes.
  std::shared_ptr<const void> lease(reg.get(), [reg](const void*) { reg->ReleaseShared(); });
  if (version != 0) RETURN_IF_ERROR(reg->CheckGeneration(version, options_.rank));
  if (reg->cuda_device < 0)
    for (auto& dev : reg->devices)
      RETURN_IF_ERROR(dev.mapping->CopyToHost(dev.offset, dev.host.size(), dev.host.data()));
  RankShard shard;
  shard.global_rank = global_rank;
  shard.cuda_device = reg->cuda_device;
  shard.params = reg->params;
  shard.tensors = reg->tensors;
  shard.backing = std::move(lease);
  return shard;
}

}  // namespace wsync::trainer_agent
