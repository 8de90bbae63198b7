#include "common/net.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync {

absl::StatusOr<HostPort> SplitHostPort(absl::string_view address) {
  HostPort hp;
  absl::string_view port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() || address[close + 1] != ':')
      return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\" is not [IPv6]:port"));
    hp.host = std::string(address.substr(1, close - 1));
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos || address.find(':') != colon)
      return absl::InvalidArgumentError(
          absl::StrCat("address \"", address, "\" is not host:port (write IPv6 hosts as [addr]:port)"));
    hp.host = std::string(address.substr(0, colon));
    port = address.substr(colon + 1);
  }
  if (!absl::SimpleAtoi(port, &hp.port) || hp.port < 0 || hp.port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\" has no port in 0..65535"));
  return hp;
}

std::string JoinHostPort(absl::string_view host, int port) {
  return host.find(':') != absl::string_view::npos ? absl::StrCat("[", host, "]:", port)
                                                   : absl::StrCat(host, ":", port);
}

bool IsWildcardHost(absl::string_view host) { return host.empty() || host == "0.0.0.0" || host == "::"; }

absl::StatusOr<std::string> LocalAddressFacing(absl::string_view peer) {
  ASSIGN_OR_RETURN(HostPort hp, SplitHostPort(peer));
  if (IsWildcardHost(hp.host))
    return absl::InvalidArgumentError(
        absl::StrCat("cannot tell which local address faces \"", peer, "\": a wildcard address names no peer"));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  // The port must be nonzero for connect(); any will do, nothing is sent.
  if (int rc = getaddrinfo(hp.host.c_str(), "9", &hints, &res); rc != 0)
    return absl::NotFoundError(absl::StrCat("resolving \"", hp.host, "\": ", gai_strerror(rc)));
  absl::Status last = absl::UnavailableError(absl::StrCat("no address of \"", hp.host, "\""));
  std::string found;
  for (addrinfo* a = res; a != nullptr && found.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last = ErrnoToStatus(errno, "socket");
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      last = absl::UnavailableError(absl::StrCat("no route to \"", peer, "\": ", std::strerror(errno)));
    } else if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      last = ErrnoToStatus(errno, "getsockname");
    } else {
      char buf[INET6_ADDRSTRLEN] = {};
      const void* src = local.ss_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, src, buf, sizeof(buf)) != nullptr) found = buf;
    }
    close(fd);
  }
  freeaddrinfo(res);
  if (found.empty()) return last;
  return found;
}

}  // namespace wsync
