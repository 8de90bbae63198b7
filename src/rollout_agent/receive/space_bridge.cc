#include "rollout_agent/receive/space_bridge.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"
#include "common/status.h"

namespace wsync::rollout_agent {

absl::Status SpaceBridge::Check(MemorySpace arrive, MemorySpace load) {
  if (!arrive.host() && !load.host() && arrive != load)
    return absl::FailedPreconditionError(
        absl::StrCat("the buckets arrive in ", arrive.Name(), " but the staging is in ", load.Name()));
  return absl::OkStatus();
}

SpaceBridge::SpaceBridge(const SpaceBridgeOptions& o) : arrive_(o.arrive), load_(o.load) {
  // Pools of the bridge's own where the caller gave none. Beside NCCL nothing is freed while the
  // stream runs (keep_until_trim: a cudaFree waits for the whole device); they go with the bridge.
  receive_pool_ = o.host_receive_pool;
  const MemorySpace arrive = arrive_, load = load_;
  if (!arrive.host()) {
    receive_pool_ = o.device_pool;
    if (receive_pool_ == nullptr)
      receive_pool_ = &own_device_pool_.emplace(
          2, [arrive](size_t n) { return arrive.Allocate(n); }, /*keep_until_trim=*/true);
    if (load.host() || o.record) {
      host_pool_ = o.pinned_pool;
      if (host_pool_ == nullptr)
        host_pool_ = &own_host_pool_.emplace(
            3, [](size_t n) { return AllocatePinnedBuffer(n); }, /*keep_until_trim=*/true);
    }
  } else if (!load.host()) {
    upload_pool_ = o.device_pool != nullptr
                       ? o.device_pool
                       : &own_upload_pool_.emplace(
                             2, [load](size_t n) { return load.Allocate(n); }, /*keep_until_trim=*/true);
  }
}

absl::Status SpaceBridge::Bridge(Buffer received, uint64_t nbytes, const std::string& where, const std::string& bucket,
                                 Bridged* out) {
  out->received = std::move(received);
  const uint64_t n = std::max<uint64_t>(nbytes, 1);
  if (!arrive_.host() && host_pool_ != nullptr) {
    const absl::Time c0 = absl::Now();
    absl::StatusOr<Buffer> host = host_pool_->Get(n);
    if (!host.ok()) return Annotate(host.status(), absl::StrCat(where, ": a host buffer for ", bucket));
    RETURN_IF_ERROR(Annotate(arrive_.CopyToHost(host->data(), out->received.data(), nbytes),
                             absl::StrCat(where, ": ", bucket, " from ", arrive_.Name())));
    out->host_copy = std::move(*host);
    if (load_.host()) GiveBack(std::exchange(out->received, Buffer()));  // free for the next receive at once
    stats_.to_host += absl::Now() - c0;
    stats_.to_host_bytes += nbytes;
  }
  if (arrive_.host() && !load_.host()) {
    const absl::Time c0 = absl::Now();
    absl::StatusOr<Buffer> dev = upload_pool_->Get(n);
    if (!dev.ok()) return Annotate(dev.status(), absl::StrCat(where, ": a ", load_.Name(), " buffer for ", bucket));
    RETURN_IF_ERROR(Annotate(load_.Copy(dev->data(), out->received.data(), nbytes),
                             absl::StrCat(where, ": ", bucket, " to ", load_.Name())));
    out->uploaded = std::move(*dev);
    stats_.to_device += absl::Now() - c0;
    stats_.to_device_bytes += nbytes;
  }
  return absl::OkStatus();
}

const Buffer& SpaceBridge::Loadable(const Bridged& b) const {
  return load_.host() ? (arrive_.host() ? b.received : b.host_copy) : (arrive_.host() ? b.uploaded : b.received);
}

const std::byte* SpaceBridge::HostBytes(const Bridged& b) const {
  return arrive_.host() ? b.received.data() : b.host_copy.data();
}

void SpaceBridge::GiveBack(Buffer b) {
  if (b.size() == 0 || b.data() == nullptr) return;
  BufferPool* to = MemorySpace::Of(b).host() ? (arrive_.host() ? receive_pool_ : host_pool_)
                                             : (arrive_.host() ? upload_pool_ : receive_pool_);
  if (to != nullptr) to->Put(std::move(b));
}

void SpaceBridge::GiveBack(Bridged& b) {
  GiveBack(std::move(b.received));
  GiveBack(std::move(b.host_copy));
  GiveBack(std::move(b.uploaded));
}

}  // namespace wsync::rollout_agent
