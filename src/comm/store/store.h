// The rendezvous key-value store through which separately launched processes form a data-plane
// group (Gloo addresses, the NCCL unique id, member counters), in the manner of c10d's Store.
//
//   MemoryStore      the state itself; lives in the coordinator (trainer rank 0).
//   StoreService     serves a MemoryStore over gRPC (proto/wsync/v1/store.proto).
//   GrpcStoreClient  a Store that talks to a StoreService: all a process needs to know is the
//                    coordinator's address.
//
// Semantics: Set overwrites. Get and Wait block until the keys exist or the timeout passes, then
// fail with kDeadlineExceeded naming the missing keys (this is how a group that misses a member
// fails: "waiting for [gloo/rank/3]"). Add treats the value as a decimal int64 counter (absent =
// 0) and returns the new value; Get of a counter returns its decimal text. Keys are non-empty.
// A client's RPC failures come back as kUnavailable (coordinator gone) or the server's code.
// Thread-safety: every method of every class may be called from any thread concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc_security.h"

namespace grpc {
class Channel;
class Server;
class Service;
}  // namespace grpc

namespace wsync::comm {

class Store {
 public:
  virtual ~Store() = default;
  virtual absl::Status Set(absl::string_view key, std::string value) = 0;
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;
};

class MemoryStore : public Store {
 public:
  absl::Status Set(absl::string_view key, std::string value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

  // Like Wait, but also gives up (kCancelled) as soon as `cancelled()` returns true; it is
  // polled every 50 ms. Used by the gRPC service when a client goes away.
  absl::Status WaitOrCancel(const std::vector<std::string>& keys, absl::Duration timeout,
                            const std::function<bool()>& cancelled);

  // Removes every key that starts with `prefix` (non-empty); returns how many. The coordinator
  // drops an ended sync's keys this way, so that the store does not grow with every sync.
  size_t DeletePrefix(absl::string_view prefix);
  size_t size();  // keys held

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string, std::less<>> kv_;  // GUARDED_BY(mu_)
};

// The gRPC service over `store` (not owned), for a server that hosts other services too (the
// coordinator). Every call is authorized against `sec` (common/rpc_security.h).
std::unique_ptr<grpc::Service> MakeStoreService(MemoryStore* store, RpcSecurity sec = {});

// Serves `store` (not owned; must outlive the server) on `address` ("127.0.0.1:0" picks a port).
class StoreServer {
 public:
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(MemoryStore* store, const std::string& address,
                                                            RpcSecurity sec = {});
  ~StoreServer();  // shuts down: in-flight Waits end with kCancelled / kUnavailable at the client
  int port() const { return port_; }
  std::string address() const;  // "127.0.0.1:PORT"

 private:
  class Service;
  friend std::unique_ptr<grpc::Service> MakeStoreService(MemoryStore* store, RpcSecurity sec);
  StoreServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string host_;
  int port_ = 0;
};

class GrpcStoreClient : public Store {
 public:
  // Connects lazily; `rpc_margin` is added to each blocking call's timeout for the RPC deadline.
  static std::unique_ptr<GrpcStoreClient> Connect(const std::string& address,
                                                  absl::Duration rpc_timeout = absl::Seconds(30), RpcSecurity sec = {});
  ~GrpcStoreClient() override;

  absl::Status Set(absl::string_view key, std::string value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

 private:
  struct Impl;
  explicit GrpcStoreClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::comm
