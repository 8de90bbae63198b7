#include "comm/store/store.h"

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_status.h"
#include "common/status.h"
#include "wsync/v1/store.grpc.pb.h"

namespace wsync::comm {
namespace {

absl::Status CheckKey(absl::string_view key) {
  if (key.empty()) return absl::InvalidArgumentError("store: empty key");
  return absl::OkStatus();
}

std::vector<std::string> Missing(const std::map<std::string, std::string, std::less<>>& kv,
                                 const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys)
    if (kv.find(k) == kv.end()) out.push_back(k);
  return out;
}

}  // namespace

// ---- MemoryStore ---------------------------------------------------------------------------------

absl::Status MemoryStore::Set(absl::string_view key, std::string value) {
  RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  kv_.insert_or_assign(std::string(key), std::move(value));
  return absl::OkStatus();
}

size_t MemoryStore::DeletePrefix(absl::string_view prefix) {
  if (prefix.empty()) return 0;
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && absl::StartsWith(it->first, prefix); ++n)
    it = kv_.erase(it);
  return n;
}

size_t MemoryStore::size() {
  absl::MutexLock lock(&mu_);
  return kv_.size();
}

absl::Status MemoryStore::WaitOrCancel(const std::vector<std::string>& keys, absl::Duration timeout,
                                       const std::function<bool()>& cancelled) {
  for (const auto& k : keys) RETURN_IF_ERROR(CheckKey(k));
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto all_present = [&] { return Missing(kv_, keys).empty(); };
  while (!all_present()) {
    if (cancelled && cancelled()) return absl::CancelledError("store: wait cancelled by the caller");
    const absl::Time now = absl::Now();
    if (now >= deadline)
      return absl::DeadlineExceededError(absl::StrCat("store: timed out after ", absl::FormatDuration(timeout),
                                                      " waiting for [", absl::StrJoin(Missing(kv_, keys), ", "), "]"));
    const absl::Time slice = cancelled ? std::min(deadline, now + absl::Milliseconds(50)) : deadline;
    mu_.AwaitWithDeadline(absl::Condition(&all_present), slice);
  }
  return absl::OkStatus();
}

absl::Status MemoryStore::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  return WaitOrCancel(keys, timeout, nullptr);
}

absl::StatusOr<std::string> MemoryStore::Get(absl::string_view key, absl::Duration timeout) {
  RETURN_IF_ERROR(Wait({std::string(key)}, timeout));
  absl::MutexLock lock(&mu_);
  return kv_.find(key)->second;
}

absl::StatusOr<int64_t> MemoryStore::Add(absl::string_view key, int64_t delta) {
  RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  int64_t v = 0;
  auto it = kv_.find(key);
  if (it != kv_.end() && !absl::SimpleAtoi(it->second, &v))
    return absl::FailedPreconditionError(absl::StrCat("store: key \"", key, "\" holds a non-counter value"));
  if (__builtin_add_overflow(v, delta, &v))
    return absl::OutOfRangeError(absl::StrCat("store: counter \"", key, "\" overflows"));
  kv_.insert_or_assign(std::string(key), absl::StrCat(v));
  return v;
}

// ---- StoreServer ---------------------------------------------------------------------------------

class StoreServer::Service final : public v1::Store::Service {
 public:
  Service(MemoryStore* store, RpcSecurity sec) : store_(store), sec_(std::move(sec)) {}

  grpc::Status Set(grpc::ServerContext* ctx, const v1::StoreSetRequest* req, v1::StoreSetResponse*) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    return ToGrpcStatus(store_->Set(req->key(), req->value()));
  }
  grpc::Status Get(grpc::ServerContext* ctx, const v1::StoreGetRequest* req, v1::StoreGetResponse* resp) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    auto s = store_->WaitOrCancel({req->key()}, Timeout(ctx, req->timeout_ms()), [ctx] { return ctx->IsCancelled(); });
    if (!s.ok()) return ToGrpcStatus(s);
    auto v = store_->Get(req->key(), absl::ZeroDuration());
    if (!v.ok()) return ToGrpcStatus(v.status());
    resp->set_value(std::move(*v));
    return grpc::Status::OK;
  }
  grpc::Status Wait(grpc::ServerContext* ctx, const v1::StoreWaitRequest* req, v1::StoreWaitResponse*) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    return ToGrpcStatus(
        store_->WaitOrCancel(keys, Timeout(ctx, req->timeout_ms()), [ctx] { return ctx->IsCancelled(); }));
  }
  grpc::Status Add(grpc::ServerContext* ctx, const v1::StoreAddRequest* req, v1::StoreAddResponse* resp) override {
    WSYNC_AUTHORIZE(ctx, sec_);
    auto v = store_->Add(req->key(), req->delta());
    if (!v.ok()) return ToGrpcStatus(v.status());
    resp->set_value(*v);
    return grpc::Status::OK;
  }

 private:
  // The request's timeout (0: 30 s), never beyond the RPC's own deadline.
  static absl::Duration Timeout(grpc::ServerContext* ctx, uint32_t timeout_ms) {
    absl::Duration t = timeout_ms ? absl::Milliseconds(timeout_ms) : absl::Seconds(30);
    const absl::Time rpc_deadline = absl::FromChrono(ctx->deadline());
    return std::min(t, std::max(absl::ZeroDuration(), rpc_deadline - absl::Now()));
  }
  MemoryStore* store_;
  RpcSecurity sec_;
};

std::unique_ptr<grpc::Service> MakeStoreService(MemoryStore* store, RpcSecurity sec) {
  return std::make_unique<StoreServer::Service>(store, std::move(sec));
}

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(MemoryStore* store, const std::string& address,
                                                                RpcSecurity sec) {
  std::unique_ptr<StoreServer> s(new StoreServer());
  s->service_ = std::make_unique<Service>(store, sec);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, ServerCredentials(sec), &s->port_);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) return absl::UnavailableError(absl::StrCat("store: cannot listen on ", address));
  const size_t colon = address.rfind(':');
  s->host_ = colon == std::string::npos ? address : address.substr(0, colon);
  return s;
}

StoreServer::~StoreServer() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

std::string StoreServer::address() const { return absl::StrCat(host_, ":", port_); }

// ---- GrpcStoreClient -----------------------------------------------------------------------------

struct GrpcStoreClient::Impl {
  std::string address;
  absl::Duration rpc_timeout;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Store::Stub> stub;

  RpcSecurity sec;

  void Deadline(grpc::ClientContext* ctx, absl::Duration extra) const { PrepareContext(ctx, sec, rpc_timeout + extra); }
  absl::Status Convert(const grpc::Status& s, absl::string_view op) const {
    if (s.ok()) return absl::OkStatus();
    absl::Status st = FromGrpcStatus(s);
    // wait_for_ready turns "nobody listening" into a deadline; report it as the lost peer it is.
    const bool down =
        s.error_code() == grpc::StatusCode::UNAVAILABLE || (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                                                            channel->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE);
    if (down)
      return absl::UnavailableError(
          absl::StrCat("store ", op, ": coordinator at ", address, " unreachable: ", s.error_message()));
    return Annotate(st, absl::StrCat("store ", op, " at ", address));
  }
};

GrpcStoreClient::GrpcStoreClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcStoreClient::~GrpcStoreClient() = default;

std::unique_ptr<GrpcStoreClient> GrpcStoreClient::Connect(const std::string& address, absl::Duration rpc_timeout,
                                                          RpcSecurity sec) {
  auto impl = std::make_unique<Impl>();
  impl->address = address;
  impl->rpc_timeout = rpc_timeout;
  impl->sec = sec;
  impl->channel = MakeChannel(address, sec);
  impl->stub = v1::Store::NewStub(impl->channel);
  return std::unique_ptr<GrpcStoreClient>(new GrpcStoreClient(std::move(impl)));
}

absl::Status GrpcStoreClient::Set(absl::string_view key, std::string value) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, absl::ZeroDuration());
  ctx.set_wait_for_ready(true);  // the coordinator may still be starting
  v1::StoreSetRequest req;
  req.set_key(std::string(key));
  req.set_value(std::move(value));
  v1::StoreSetResponse resp;
  return impl_->Convert(impl_->stub->Set(&ctx, req, &resp), absl::StrCat("set \"", key, "\""));
}

absl::StatusOr<std::string> GrpcStoreClient::Get(absl::string_view key, absl::Duration timeout) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, timeout);
  ctx.set_wait_for_ready(true);
  v1::StoreGetRequest req;
  req.set_key(std::string(key));
  req.set_timeout_ms(static_cast<uint32_t>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout))));
  v1::StoreGetResponse resp;
  RETURN_IF_ERROR(impl_->Convert(impl_->stub->Get(&ctx, req, &resp), absl::StrCat("get \"", key, "\"")));
  return std::move(*resp.mutable_value());
}

absl::Status GrpcStoreClient::Wait(const std::vector<std::string>& keys, absl::Duration timeout) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, timeout);
  ctx.set_wait_for_ready(true);
  v1::StoreWaitRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(static_cast<uint32_t>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout))));
  v1::StoreWaitResponse resp;
  return impl_->Convert(impl_->stub->Wait(&ctx, req, &resp), "wait");
}

absl::StatusOr<int64_t> GrpcStoreClient::Add(absl::string_view key, int64_t delta) {
  grpc::ClientContext ctx;
  impl_->Deadline(&ctx, absl::ZeroDuration());
  ctx.set_wait_for_ready(true);
  v1::StoreAddRequest req;
  req.set_key(std::string(key));
  req.set_delta(delta);
  v1::StoreAddResponse resp;
  RETURN_IF_ERROR(impl_->Convert(impl_->stub->Add(&ctx, req, &resp), absl::StrCat("add \"", key, "\"")));
  return resp.value();
}

}  // namespace wsync::comm
