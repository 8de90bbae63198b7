#include "trainer_client/protocol.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace wsync::trainer_client {
namespace {

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
  }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : p_(in.data()), n_(in.size()) {}
  bool U8(uint8_t* v) {
    if (!Need(1)) return false;
    *v = static_cast<uint8_t>(p_[0]);
    Skip(1);
    return true;
  }
  bool U32(uint32_t* v) {
    if (!Need(4)) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= static_cast<uint32_t>(static_cast<uint8_t>(p_[i])) << (8 * i);
    Skip(4);
    return true;
  }
  bool U64(uint64_t* v) {
    if (!Need(8)) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i) *v |= static_cast<uint64_t>(static_cast<uint8_t>(p_[i])) << (8 * i);
    Skip(8);
    return true;
  }
  bool I64(int64_t* v) {
    uint64_t u;
    if (!U64(&u)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
  bool I32(int32_t* v) {
    uint32_t u;
    if (!U32(&u)) return false;
    *v = static_cast<int32_t>(u);
    return true;
  }
  bool Str(std::string* s) {
    uint32_t len;
    if (!U32(&len) || !Need(len)) return false;
    s->assign(p_, len);
    Skip(len);
    return true;
  }
  bool Done() const { return n_ == 0; }

 private:
  bool Need(size_t k) const { return n_ >= k; }
  void Skip(size_t k) {
    p_ += k;
    n_ -= k;
  }
  const char* p_;
  size_t n_;
};

bool Fail(std::string* error, const char* what) {
  if (error) *error = what;
  return false;
}

void PutTensor(Writer& w, const TensorDecl& t) {
  w.Str(t.name);
  w.Str(t.dtype);
  w.U32(static_cast<uint32_t>(t.shape.size()));
  for (int64_t d : t.shape) w.I64(d);
  w.U32(static_cast<uint32_t>(t.location));
  w.U64(t.offset);
  w.U64(t.nbytes);
  w.Str(t.cuda_ipc_handle);
  w.U32(static_cast<uint32_t>(t.device));
}

bool GetTensor(Reader& r, TensorDecl* t) {
  uint32_t ndim, loc;
  if (!r.Str(&t->name) || !r.Str(&t->dtype) || !r.U32(&ndim) || ndim > 8) return false;
  t->shape.resize(ndim);
  for (auto& d : t->shape)
    if (!r.I64(&d)) return false;
  if (!r.U32(&loc) || loc > 1) return false;
  t->location = static_cast<Location>(loc);
  return r.U64(&t->offset) && r.U64(&t->nbytes) && r.Str(&t->cuda_ipc_handle) && r.I32(&t->device);
}

int WaitFd(int fd, short events, int64_t deadline_ms) {
  for (;;) {
    int timeout = -1;
    if (deadline_ms >= 0) {
      const int64_t left = deadline_ms - NowMs();
      if (left <= 0) return ETIMEDOUT;
      timeout = static_cast<int>(std::min<int64_t>(left, 1000));
    }
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, timeout);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n > 0) return 0;
  }
}

int SendAll(int fd, const char* p, size_t n, int64_t deadline_ms) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (int e = WaitFd(fd, POLLOUT, deadline_ms)) return e;
      continue;
    }
    return k < 0 ? errno : EPIPE;
  }
  return 0;
}

int RecvAll(int fd, char* p, size_t n, int64_t deadline_ms) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0) return ECONNRESET;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (int e = WaitFd(fd, POLLIN, deadline_ms)) return e;
      continue;
    }
    return errno;
  }
  return 0;
}

std::string Describe(int e, const char* what) {
  if (e == ETIMEDOUT) return std::string(what) + ": timed out";
  if (e == ECONNRESET || e == EPIPE) return std::string(what) + ": the peer closed the connection";
  return std::string(what) + ": " + std::strerror(e);
}

}  // namespace

std::string Encode(const RegisterRequest& r) {
  Writer w;
  w.Str(r.source_name);
  w.U32(static_cast<uint32_t>(r.rank));
  w.U32(r.client_pid);
  w.Str(r.config_json);
  w.Str(r.parallel_json);
  w.Str(r.segment);
  w.U64(r.segment_bytes);
  w.U32(static_cast<uint32_t>(r.tensors.size()));
  for (const auto& t : r.tensors) PutTensor(w, t);
  return w.Take();
}

std::string Encode(const RequestSyncRequest& r) {
  Writer w;
  w.U64(r.version);
  w.U64(r.generation);
  w.U8(r.wait ? 1 : 0);
  w.I64(r.timeout_ms);
  return w.Take();
}

std::string Encode(const Reply& r) {
  Writer w;
  w.U32(static_cast<uint32_t>(r.code));
  w.Str(r.message);
  w.U64(r.sync_id);
  w.U64(r.version);
  w.U8(r.coalesced ? 1 : 0);
  return w.Take();
}

bool Decode(const std::string& payload, RegisterRequest* r, std::string* error) {
  Reader in(payload);
  uint32_t n;
  if (!in.Str(&r->source_name) || !in.I32(&r->rank) || !in.U32(&r->client_pid) || !in.Str(&r->config_json) ||
      !in.Str(&r->parallel_json) || !in.Str(&r->segment) || !in.U64(&r->segment_bytes) || !in.U32(&n)) {
    return Fail(error, "register request: truncated header fields");
  }
  if (n > payload.size()) return Fail(error, "register request: tensor count exceeds the payload");
  r->tensors.resize(n);
  for (auto& t : r->tensors)
    if (!GetTensor(in, &t)) return Fail(error, "register request: truncated or malformed tensor entry");
  if (!in.Done()) return Fail(error, "register request: trailing bytes");
  return true;
}

bool Decode(const std::string& payload, RequestSyncRequest* r, std::string* error) {
  Reader in(payload);
  uint8_t wait;
  if (!in.U64(&r->version) || !in.U64(&r->generation) || !in.U8(&wait) || !in.I64(&r->timeout_ms) || wait > 1 ||
      !in.Done())
    return Fail(error, "sync request: malformed payload");
  r->wait = wait != 0;
  return true;
}

bool Decode(const std::string& payload, Reply* r, std::string* error) {
  Reader in(payload);
  uint8_t coalesced;
  if (!in.I32(&r->code) || !in.Str(&r->message) || !in.U64(&r->sync_id) || !in.U64(&r->version) || !in.U8(&coalesced) ||
      coalesced > 1 || !in.Done())
    return Fail(error, "reply: malformed payload");
  r->coalesced = coalesced != 0;
  return true;
}

int SendFrame(int fd, MsgType type, const std::string& payload, int64_t deadline_ms, std::string* error) {
  if (payload.size() > kMaxPayload) {
    if (error) *error = "message too large (" + std::to_string(payload.size()) + " bytes)";
    return EMSGSIZE;
  }
  Writer h;
  h.U32(kMagic);
  h.U32(kProtocolVersion);
  h.U32(static_cast<uint32_t>(type));
  h.U32(static_cast<uint32_t>(payload.size()));
  std::string frame = h.Take();
  frame.append(payload);
  const int e = SendAll(fd, frame.data(), frame.size(), deadline_ms);
  if (e && error) *error = Describe(e, "sending");
  return e;
}

int RecvFrame(int fd, MsgType* type, std::string* payload, int64_t deadline_ms, std::string* error) {
  std::string header(16, '\0');
  if (int e = RecvAll(fd, header.data(), header.size(), deadline_ms)) {
    if (error) *error = Describe(e, "receiving");
    return e;
  }
  Reader in(header);
  uint32_t magic = 0, version = 0, t = 0, len = 0;
  in.U32(&magic);
  in.U32(&version);
  in.U32(&t);
  in.U32(&len);
  if (magic != kMagic || version != kProtocolVersion || len > kMaxPayload) {
    if (error)
      *error = magic != kMagic               ? "not a wsync frame (bad magic)"
               : version != kProtocolVersion ? "protocol version " + std::to_string(version) + ", this side speaks " +
                                                   std::to_string(kProtocolVersion)
                                             : "frame of " + std::to_string(len) + " bytes exceeds the limit";
    return EPROTO;
  }
  payload->assign(len, '\0');
  if (int e = RecvAll(fd, payload->data(), len, deadline_ms)) {
    if (error) *error = Describe(e, "receiving");
    return e;
  }
  *type = static_cast<MsgType>(t);
  return 0;
}

int64_t NowMs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

bool ValidSourceName(const std::string& name) {
  if (name.empty() || name.size() > 64 || name[0] == '.') return false;
  for (char c : name) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::string RuntimeDir() {
  if (const char* d = std::getenv("WSYNC_RUNTIME_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_RUNTIME_DIR"); d && *d) return std::string(d) + "/wsync";
  return "/tmp/wsync-" + std::to_string(::geteuid());
}

std::string SocketPath(const std::string& runtime_dir, const std::string& name, int rank) {
  char r[16];
  std::snprintf(r, sizeof(r), "%05d", rank);
  return runtime_dir + "/" + name + ".r" + r + ".sock";
}

bool TensorBytes(const std::string& dtype, const std::vector<int64_t>& shape, uint64_t* nbytes) {
  uint64_t item = 0;
  if (dtype == "BOOL" || dtype == "U8" || dtype == "I8" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    item = 1;
  else if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16")
    item = 2;
  else if (dtype == "F32" || dtype == "I32" || dtype == "U32")
    item = 4;
  else if (dtype == "F64" || dtype == "I64" || dtype == "U64")
    item = 8;
  else
    return false;
  uint64_t n = item;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) return false;
    n *= static_cast<uint64_t>(d);
  }
  *nbytes = n;
  return true;
}

}  // namespace wsync::trainer_client
