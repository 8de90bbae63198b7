#include "common/rpc_security.h"

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/status.h"

namespace wsync {

absl::StatusOr<RpcSecurity> LoadRpcSecurity(const RpcSecurityOptions& o) {
  RpcSecurity sec;
  if (!o.token_file.empty()) {
    ASSIGN_OR_RETURN(std::string t, ReadTextFile(o.token_file));
    sec.token = std::string(absl::StripAsciiWhitespace(t));
    if (sec.token.empty()) return absl::InvalidArgumentError(absl::StrCat("token file ", o.token_file, " is empty"));
  } else if (const char* env = std::getenv("WSYNC_TOKEN"); env != nullptr && *env != '\0') {
    sec.token = std::string(absl::StripAsciiWhitespace(env));
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a TLS certificate needs its key (--tls-cert and --tls-key go together)");
  }
  if (!o.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(sec.cert_pem, ReadTextFile(o.tls_cert_file));
    ASSIGN_OR_RETURN(sec.key_pem, ReadTextFile(o.tls_key_file));
  }
  if (!o.tls_ca_file.empty()) {
    ASSIGN_OR_RETURN(sec.ca_pem, ReadTextFile(o.tls_ca_file));
  }
  return sec;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const RpcSecurity& sec) {
  if (sec.cert_pem.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions opts(sec.ca_pem.empty()
                                             ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                             : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  opts.pem_root_certs = sec.ca_pem;
  opts.pem_key_cert_pairs.push_back({sec.key_pem, sec.cert_pem});
  return grpc::SslServerCredentials(opts);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const RpcSecurity& sec) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (!sec.tls()) return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  grpc::SslCredentialsOptions opts;
  opts.pem_root_certs = sec.ca_pem;
  opts.pem_private_key = sec.key_pem;
  opts.pem_cert_chain = sec.cert_pem;
  return grpc::CreateCustomChannel(address, grpc::SslCredentials(opts), args);
}

absl::StatusOr<bool> ResolveBucketMac(absl::string_view mode, const RpcSecurity& sec) {
  if (mode == "on") return true;
  if (mode == "off") return false;
  if (mode == "auto") return !sec.token.empty();
  return absl::InvalidArgumentError(absl::StrCat("--bucket-mac is on, off or auto, not \"", mode, "\""));
}

void PrepareContext(grpc::ClientContext* ctx, const RpcSecurity& sec, absl::Duration timeout) {
  if (!sec.token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", sec.token));
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

grpc::Status Authorize(const grpc::ServerContext& ctx, const RpcSecurity& sec) {
  if (sec.token.empty()) return grpc::Status::OK;
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing bearer token");
  const absl::string_view value(it->second.data(), it->second.size());
  if (!absl::StartsWith(value, "Bearer ") || !ConstantTimeEquals(value.substr(7), sec.token)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong bearer token");
  }
  return grpc::Status::OK;
}

}  // namespace wsync
