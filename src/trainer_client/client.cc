// wsync_trainer_client.h implemented over trainer_client/protocol.h (C++ standard library and
// libc only: see protocol.h for why).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "trainer_client/protocol.h"
#include "trainer_client/wsync_trainer_client.h"

namespace tc = wsync::trainer_client;

namespace {

thread_local std::string g_last_error;

int Err(int code, std::string message) {
  g_last_error = std::move(message);
  return code;
}

int Ok() {
  g_last_error.clear();
  return WSYNC_OK;
}

void SleepMs(int ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, nullptr);
}

int64_t Deadline(int64_t timeout_ms) { return timeout_ms < 0 ? -1 : tc::NowMs() + timeout_ms; }

constexpr uint64_t kAlign = 64;

}  // namespace

struct wsync_client {
  std::mutex mu;
  std::string name;
  int rank = 0;
  std::string socket_path;
  int sock = -1;
  std::vector<tc::TensorDecl> decls;
  std::map<std::string, size_t> index;  // name -> decls position
  bool registered = false;
  int shm_fd = -1;
  void* base = nullptr;
  uint64_t segment_bytes = 0;
  bool locked = false;
  bool broken = false;  // the connection failed mid-exchange: reopen a client

  tc::SegmentHeader* header() const { return static_cast<tc::SegmentHeader*>(base); }
  uint64_t generation() const { return __atomic_load_n(&header()->generation, __ATOMIC_ACQUIRE); }
  void BumpGeneration() { __atomic_add_fetch(&header()->generation, 1, __ATOMIC_ACQ_REL); }

  // One request / reply exchange.
  int Call(tc::MsgType type, const std::string& payload, int64_t deadline, tc::Reply* reply) {
    if (broken) return Err(WSYNC_UNAVAILABLE, "the connection to the wsync agent was lost; open a new client");
    std::string error;
    if (tc::SendFrame(sock, type, payload, deadline, &error) != 0) {
      broken = true;
      return Err(WSYNC_UNAVAILABLE, "wsync agent at " + socket_path + ": " + error);
    }
    tc::MsgType got;
    std::string body;
    const int e = tc::RecvFrame(sock, &got, &body, deadline, &error);
    if (e != 0) {
      broken = true;  // a late reply would desynchronize the stream
      return Err(e == ETIMEDOUT ? WSYNC_DEADLINE_EXCEEDED : WSYNC_UNAVAILABLE,
                 "wsync agent at " + socket_path + ": " + error);
    }
    if (got != tc::MsgType::kReply || !tc::Decode(body, reply, &error)) {
      broken = true;
      return Err(WSYNC_INTERNAL, "wsync agent at " + socket_path + ": bad reply (" + error + ")");
    }
    if (reply->code != 0) return Err(reply->code, reply->message);
    return Ok();
  }

  void Unmap() {
    if (base != nullptr) munmap(base, segment_bytes);
    if (shm_fd >= 0) close(shm_fd);
    base = nullptr;
    shm_fd = -1;
    segment_bytes = 0;
    locked = false;
  }
};

extern "C" {

const char* wsync_last_error(void) { return g_last_error.c_str(); }

int wsync_client_abi_version(void) { return WSYNC_CLIENT_ABI_VERSION; }

int wsync_client_open(const char* source_name, int global_rank, int64_t timeout_ms, wsync_client** out) {
  if (out == nullptr) return Err(WSYNC_INVALID_ARGUMENT, "out is NULL");
  *out = nullptr;
  if (source_name == nullptr || !tc::ValidSourceName(source_name))
    return Err(WSYNC_INVALID_ARGUMENT, std::string("bad source name '") + (source_name ? source_name : "(null)") +
                                           "' (want [A-Za-z0-9._-]{1,64})");
  if (global_rank < 0) return Err(WSYNC_INVALID_ARGUMENT, "negative rank " + std::to_string(global_rank));
  const std::string path = tc::SocketPath(tc::RuntimeDir(), source_name, global_rank);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return Err(WSYNC_INVALID_ARGUMENT, "socket path too long: " + path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int64_t deadline = Deadline(timeout_ms);
  std::string last = "not tried";
  for (;;) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Err(WSYNC_INTERNAL, std::string("socket: ") + std::strerror(errno));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      auto* c = new wsync_client();
      c->name = source_name;
      c->rank = global_rank;
      c->socket_path = path;
      c->sock = fd;
      *out = c;
      return Ok();
    }
    last = std::strerror(errno);
    close(fd);
    if (deadline >= 0 && tc::NowMs() >= deadline) break;
    SleepMs(50);
  }
  return Err(WSYNC_UNAVAILABLE, "no wsync trainer agent for source '" + std::string(source_name) + "' rank " +
                                    std::to_string(global_rank) + " at " + path + " (" + last +
                                    "); is wsync-trainer-agent running with --source shm:" + source_name + "?");
}

static int AddDecl(wsync_client* c, tc::TensorDecl d) {
  if (c == nullptr) return Err(WSYNC_INVALID_ARGUMENT, "client is NULL");
  std::lock_guard<std::mutex> lock(c->mu);
  if (c->registered) return Err(WSYNC_FAILED_PRECONDITION, "tensors must be declared before wsync_client_register");
  if (d.name.empty()) return Err(WSYNC_INVALID_ARGUMENT, "empty tensor name");
  if (!tc::TensorBytes(d.dtype, d.shape, &d.nbytes))
    return Err(WSYNC_INVALID_ARGUMENT,
               "tensor " + d.name + ": unknown dtype '" + d.dtype +
                   "' (safetensors names: BF16, F16, F32, ...) or a negative / overflowing shape");
  if (c->index.count(d.name)) return Err(WSYNC_ALREADY_EXISTS, "tensor " + d.name + " is declared twice");
  c->index.emplace(d.name, c->decls.size());
  c->decls.push_back(std::move(d));
  return Ok();
}

static bool ReadShape(const int64_t* shape, int ndim, std::vector<int64_t>* out) {
  if (ndim < 0 || ndim > 8 || (ndim > 0 && shape == nullptr)) return false;
  out->assign(shape, shape + ndim);
  return true;
}

int wsync_client_add_tensor(wsync_client* c, const char* name, const char* dtype, const int64_t* shape, int ndim) {
  tc::TensorDecl d;
  d.name = name ? name : "";
  d.dtype = dtype ? dtype : "";
  if (!ReadShape(shape, ndim, &d.shape))
    return Err(WSYNC_INVALID_ARGUMENT, "tensor " + d.name + ": bad ndim " + std::to_string(ndim) + " (0..8)");
  d.location = tc::Location::kHostShm;
  return AddDecl(c, std::move(d));
}

int wsync_client_add_cuda_tensor(wsync_client* c, const char* name, const char* dtype, const int64_t* shape, int ndim,
                                 const void* handle, size_t handle_bytes, int device, uint64_t offset) {
  tc::TensorDecl d;
  d.name = name ? name : "";
  d.dtype = dtype ? dtype : "";
  if (!ReadShape(shape, ndim, &d.shape))
    return Err(WSYNC_INVALID_ARGUMENT, "tensor " + d.name + ": bad ndim " + std::to_string(ndim) + " (0..8)");
  if (handle == nullptr || handle_bytes != tc::kCudaIpcHandleBytes)
    return Err(WSYNC_INVALID_ARGUMENT, "tensor " + d.name + ": a CUDA IPC handle is " +
                                           std::to_string(tc::kCudaIpcHandleBytes) + " bytes, got " +
                                           std::to_string(handle ? handle_bytes : 0));
  if (device < 0) return Err(WSYNC_INVALID_ARGUMENT, "tensor " + d.name + ": negative CUDA device");
  d.location = tc::Location::kCudaIpc;
  d.cuda_ipc_handle.assign(static_cast<const char*>(handle), handle_bytes);
  d.device = device;
  d.offset = offset;
  return AddDecl(c, std::move(d));
}

int wsync_client_register(wsync_client* c, const char* config_json, const char* parallel_json, int64_t timeout_ms) {
  if (c == nullptr) return Err(WSYNC_INVALID_ARGUMENT, "client is NULL");
  std::lock_guard<std::mutex> lock(c->mu);
  if (c->registered) return Err(WSYNC_FAILED_PRECONDITION, "already registered (close and open a new client)");
  if (config_json == nullptr || parallel_json == nullptr)
    return Err(WSYNC_INVALID_ARGUMENT, "config_json and parallel_json are required");
  tc::RegisterRequest req;
  req.source_name = c->name;
  req.rank = c->rank;
  req.client_pid = static_cast<uint32_t>(getpid());
  req.config_json = config_json;
  req.parallel_json = parallel_json;
  req.tensors = c->decls;
  uint64_t size = tc::kSegmentHeaderBytes;
  for (auto& t : req.tensors) {
    if (t.location != tc::Location::kHostShm) continue;
    t.offset = size;
    size += (t.nbytes + kAlign - 1) / kAlign * kAlign;
  }
  // The segment exists even without host tensors: its header and lock are the update protocol.
  std::random_device rd;
  char suffix[32];
  std::snprintf(suffix, sizeof(suffix), "%d.%08x", static_cast<int>(getpid()), rd());
  char rank[16];
  std::snprintf(rank, sizeof(rank), "%05d", c->rank);
  const std::string seg = "/wsync." + c->name + ".r" + rank + "." + suffix;
  const int fd = shm_open(seg.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return Err(WSYNC_INTERNAL, "shm_open " + seg + ": " + std::strerror(errno));
  auto undo = [&](int code, std::string message) {
    c->Unmap();
    shm_unlink(seg.c_str());
    return Err(code, std::move(message));
  };
  c->shm_fd = fd;
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(size)) != 0)
    return undo(WSYNC_RESOURCE_EXHAUSTED,
                "sizing shared memory " + seg + " to " + std::to_string(size) + " bytes: " + std::strerror(errno));
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return undo(WSYNC_RESOURCE_EXHAUSTED, "mmap " + seg + ": " + std::strerror(errno));
  c->base = p;
  c->segment_bytes = size;
  c->header()->magic = tc::kSegmentMagic;
  req.segment = seg;
  req.segment_bytes = size;
  tc::Reply reply;
  const int rc = c->Call(tc::MsgType::kRegister, tc::Encode(req), Deadline(timeout_ms), &reply);
  if (rc != WSYNC_OK) return undo(rc, "registering with the wsync agent: " + g_last_error);
  shm_unlink(seg.c_str());  // both sides hold it open; nothing is left behind if either dies
  c->decls = std::move(req.tensors);
  c->registered = true;
  return Ok();
}

void* wsync_client_tensor(wsync_client* c, const char* name, uint64_t* nbytes) {
  if (c == nullptr || name == nullptr) {
    Err(WSYNC_INVALID_ARGUMENT, "client or name is NULL");
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(c->mu);
  if (!c->registered) {
    Err(WSYNC_FAILED_PRECONDITION, "tensors have memory only after wsync_client_register");
    return nullptr;
  }
  auto it = c->index.find(name);
  if (it == c->index.end()) {
    Err(WSYNC_NOT_FOUND, std::string("no tensor ") + name);
    return nullptr;
  }
  const tc::TensorDecl& d = c->decls[it->second];
  if (d.location != tc::Location::kHostShm) {
    Err(WSYNC_INVALID_ARGUMENT, std::string("tensor ") + name + " lives on a CUDA device");
    return nullptr;
  }
  if (nbytes) *nbytes = d.nbytes;
  Ok();
  return static_cast<char*>(c->base) + d.offset;
}

int wsync_client_begin_update(wsync_client* c, int64_t timeout_ms) {
  if (c == nullptr) return Err(WSYNC_INVALID_ARGUMENT, "client is NULL");
  std::lock_guard<std::mutex> lock(c->mu);
  if (!c->registered) return Err(WSYNC_FAILED_PRECONDITION, "not registered");
  if (c->locked) return Err(WSYNC_FAILED_PRECONDITION, "the update lock is already held");
  const int64_t deadline = Deadline(timeout_ms);
  for (;;) {
    if (flock(c->shm_fd, LOCK_EX | LOCK_NB) == 0) break;
    if (errno != EWOULDBLOCK && errno != EINTR)
      return Err(WSYNC_INTERNAL, std::string("flock: ") + std::strerror(errno));
    if (deadline >= 0 && tc::NowMs() >= deadline)
      return Err(WSYNC_DEADLINE_EXCEEDED, "a sync kept reading the weights for " + std::to_string(timeout_ms) + " ms");
    SleepMs(1);
  }
  c->locked = true;
  c->BumpGeneration();  // odd: writing
  return Ok();
}

int wsync_client_end_update(wsync_client* c) {
  if (c == nullptr) return Err(WSYNC_INVALID_ARGUMENT, "client is NULL");
  std::lock_guard<std::mutex> lock(c->mu);
  if (!c->locked) return Err(WSYNC_FAILED_PRECONDITION, "the update lock is not held");
  c->BumpGeneration();  // even: complete
  flock(c->shm_fd, LOCK_UN);
  c->locked = false;
  return Ok();
}

int wsync_client_request_sync(wsync_client* c, uint64_t version, int wait, int64_t timeout_ms, wsync_sync_info* info) {
  if (c == nullptr) return Err(WSYNC_INVALID_ARGUMENT, "client is NULL");
  std::lock_guard<std::mutex> lock(c->mu);
  if (!c->registered) return Err(WSYNC_FAILED_PRECONDITION, "register before requesting a sync");
  tc::RequestSyncRequest req;
  if (c->locked)
    return Err(WSYNC_FAILED_PRECONDITION,
               "request a sync after wsync_client_end_update (the weights are being written)");
  req.version = version;
  req.generation = c->generation();
  req.wait = wait != 0;
  req.timeout_ms = timeout_ms;
  tc::Reply reply;
  // The agent bounds the wait by timeout_ms; give the reply a little slack to arrive.
  const int rc = c->Call(tc::MsgType::kRequestSync, tc::Encode(req),
                         timeout_ms < 0 ? -1 : tc::NowMs() + timeout_ms + 5000, &reply);
  if (info) {
    info->sync_id = reply.sync_id;
    info->version = reply.version;
    info->coalesced = reply.coalesced ? 1 : 0;
  }
  return rc;
}

void wsync_client_close(wsync_client* c) {
  if (c == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->Unmap();
    if (c->sock >= 0) close(c->sock);
    c->sock = -1;
  }
  delete c;
}

}  // extern "C"
