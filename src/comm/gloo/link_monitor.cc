#include "comm/gloo/link_monitor.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace wsync::comm {
namespace {

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Waits for `fd` to become ready for `events` until `deadline`.
absl::Status PollUntil(int fd, short events, absl::Time deadline, absl::string_view what) {
  for (;;) {
    const int ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, ms);
    if (rc > 0) return absl::OkStatus();
    if (rc == 0) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    if (errno != EINTR) return Errno(what);
  }
}

absl::StatusOr<int> Listen(const std::string& host, int* port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), "0", &hints, &res); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve \"", host, "\": ", gai_strerror(rc)));
  }
  const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 4) != 0) {
    absl::Status s = Errno(absl::StrCat("listening on ", host));
    freeaddrinfo(res);
    if (fd >= 0) ::close(fd);
    return s;
  }
  freeaddrinfo(res);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

absl::StatusOr<int> Connect(const std::string& endpoint, absl::Time deadline) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("bad endpoint \"", endpoint, "\""));
  const std::string host = endpoint.substr(0, colon), port = endpoint.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve \"", endpoint, "\": ", gai_strerror(rc)));
  }
  const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int rc = fd < 0 ? -1 : ::connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (fd < 0) return Errno("socket");
  if (rc != 0 && errno != EINPROGRESS) {
    absl::Status s = Errno(absl::StrCat("connecting to ", endpoint));
    ::close(fd);
    return s;
  }
  absl::Status s = PollUntil(fd, POLLOUT, deadline, absl::StrCat("connecting to ", endpoint));
  int err = 0;
  socklen_t len = sizeof(err);
  if (s.ok()) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (!s.ok() || err != 0) {
    ::close(fd);
    return s.ok() ? absl::UnavailableError(absl::StrCat("connecting to ", endpoint, ": ", std::strerror(err))) : s;
  }
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LinkMonitor>> LinkMonitor::Create(Store& store, const std::string& prefix, int rank,
                                                                 int size, const std::string& host,
                                                                 absl::Duration timeout) {
  if (size == 1) return std::unique_ptr<LinkMonitor>(new LinkMonitor(-1, -1, -1, -1));
  const absl::Time deadline = absl::Now() + timeout;
  const int prev = (rank + size - 1) % size, next = (rank + 1) % size;
  int port = 0;
  ASSIGN_OR_RETURN(const int listen_fd, Listen(host, &port));
  auto cleanup = [&](int fd) {
    if (fd >= 0) ::close(fd);
  };
  absl::Status s = store.Set(absl::StrCat(prefix, rank), absl::StrCat(host, ":", port));
  absl::StatusOr<std::string> endpoint = s.ok() ? store.Get(absl::StrCat(prefix, next), timeout) : s;
  absl::StatusOr<int> next_fd = endpoint.ok() ? Connect(*endpoint, deadline) : endpoint.status();
  if (!next_fd.ok()) {
    cleanup(listen_fd);
    return Annotate(next_fd.status(), absl::StrCat("link to rank ", next));
  }
  s = PollUntil(listen_fd, POLLIN, deadline, absl::StrCat("waiting for the link from rank ", prev));
  const int prev_fd = s.ok() ? ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK) : -1;
  cleanup(listen_fd);
  if (prev_fd < 0) {
    cleanup(*next_fd);
    return s.ok() ? Errno("accept") : s;
  }
  return std::unique_ptr<LinkMonitor>(new LinkMonitor(prev, prev_fd, next, *next_fd));
}

LinkMonitor::LinkMonitor(int prev_rank, int prev_fd, int next_rank, int next_fd)
    : prev_rank_(prev_rank), prev_fd_(prev_fd), next_rank_(next_rank), next_fd_(next_fd) {}

LinkMonitor::~LinkMonitor() { Close(); }

void LinkMonitor::Start(std::function<void(Link, const std::string&)> on_lost) {
  if (prev_fd_ < 0) return;
  on_lost_ = std::move(on_lost);
  if (::pipe2(wake_, O_CLOEXEC) != 0) return;
  watcher_ = std::thread([this] { Watch(); });
}

void LinkMonitor::Watch() {
  pollfd fds[3] = {{prev_fd_, POLLIN, 0}, {next_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
  int open_links = 2;
  while (open_links > 0) {
    if (::poll(fds, 3, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[2].revents) return;  // Close()
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !fds[i].revents) continue;
      char buf[64];
      const ssize_t n = ::recv(fds[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) continue;  // stray bytes: ignore
      const int peer = i == 0 ? prev_rank_ : next_rank_;
      on_lost_(i == 0 ? Link::kPrev : Link::kNext,
               absl::StrCat("rank ", peer, " closed its connection",
                            n < 0 ? absl::StrCat(" (", std::strerror(errno), ")") : std::string()));
      fds[i].fd = -1;  // poll ignores it from now on
      --open_links;
    }
  }
}

void LinkMonitor::Close() {
  if (wake_[1] >= 0) {
    const char c = 1;
    (void)!::write(wake_[1], &c, 1);
  }
  if (watcher_.joinable()) watcher_.join();
  for (int* fd : {&prev_fd_, &next_fd_, &wake_[0], &wake_[1]}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

}  // namespace wsync::comm
