// Addresses of this host, for listeners that must be reachable from other hosts: which local
// address faces a peer, and "host:port" strings (IPv4, names, "[IPv6]:port").
//
// LocalAddressFacing("coordinator:7070") is the default of the agents' data-plane host: the
// address of the interface the kernel routes to the coordinator through (a UDP socket connected
// to it, then getsockname; no packet is sent). On one machine (127.0.0.1) it is 127.0.0.1.
// Errors: kInvalidArgument (malformed "host:port"), kNotFound (a name that does not resolve),
// kUnavailable (no route to the peer), each naming the address.
// Thread-safety: reentrant.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wsync {

struct HostPort {
  std::string host;  // without brackets
  int port = 0;
};
// Splits "host:port" or "[v6]:port"; the port must be 0..65535.
absl::StatusOr<HostPort> SplitHostPort(absl::string_view address);
// "host:port", bracketing IPv6 hosts.
std::string JoinHostPort(absl::string_view host, int port);

// The local IP address (numeric) that faces `peer` ("host:port").
absl::StatusOr<std::string> LocalAddressFacing(absl::string_view peer);

// True for 0.0.0.0, ::, and empty: addresses one can bind but not dial.
bool IsWildcardHost(absl::string_view host);

}  // namespace wsync
