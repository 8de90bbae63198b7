// Security of every wsync gRPC endpoint: a bearer token on every call and, when configured, TLS.
//
//   Servers: build with ServerCredentials(sec), and begin every handler with
//            WSYNC_AUTHORIZE(context, sec)  -> UNAUTHENTICATED for a missing or wrong token,
//            before the handler changes anything.
//   Clients: PrepareContext(&ctx, sec, deadline) on every call (token + deadline: no RPC without one);
//            channels from MakeChannel(address, sec).
// The token comes from a file (--token-file) or the WSYNC_TOKEN environment variable; it is
// compared in constant time. Without a token, auth is off (loopback development only; agents
// listen on 127.0.0.1 by default). TLS: a server certificate and key, an optional CA for client
// certificates (then required), and on clients the CA that signed the server.
// Thread-safety: RpcSecurity is an immutable value after Load.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wsync {

struct RpcSecurityOptions {
  std::string token_file;     // else $WSYNC_TOKEN, else no auth
  std::string tls_cert_file;  // server: its certificate; client: its own (mutual TLS)
  std::string tls_key_file;
  std::string tls_ca_file;  // server: CA of client certificates (required if set); client: CA of the server
};

struct RpcSecurity {
  std::string token;  // empty: no auth
  std::string cert_pem, key_pem, ca_pem;
  bool tls() const { return !ca_pem.empty() || !cert_pem.empty(); }
};

// Reads the files (kNotFound / kPermissionDenied naming them; kInvalidArgument for an empty token
// file, or a certificate without its key).
absl::StatusOr<RpcSecurity> LoadRpcSecurity(const RpcSecurityOptions& options);

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const RpcSecurity& sec);
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const RpcSecurity& sec);

// The --bucket-mac setting of a process (comm/bucket/bucket_mac.h): "on", "off", or "auto" (on
// exactly when the control plane has a token: a deployment that authenticates its RPCs authenticates
// its buckets too). kInvalidArgument for anything else.
absl::StatusOr<bool> ResolveBucketMac(absl::string_view mode, const RpcSecurity& sec);

// Sets the bearer token and the deadline of one call.
void PrepareContext(grpc::ClientContext* ctx, const RpcSecurity& sec, absl::Duration timeout);

// OK, or UNAUTHENTICATED ("missing bearer token" / "wrong bearer token"). Constant time in the
// token's length.
grpc::Status Authorize(const grpc::ServerContext& ctx, const RpcSecurity& sec);

// True when a and b are equal, in time that depends only on their lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace wsync

#define WSYNC_AUTHORIZE(ctx, sec)                                   \
  do {                                                              \
    ::grpc::Status wsync_auth_ = ::wsync::Authorize(*(ctx), (sec)); \
    if (!wsync_auth_.ok()) return wsync_auth_;                      \
  } while (0)
