#include "rollout_agent/receive/stage_receiver.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/bucket/stream.h"
#include "common/cuda_ipc.h"
#include "common/failpoint.h"
#include "common/logging.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "rollout_agent/receive/space_bridge.h"

namespace wsync::rollout_agent {

// --- SyncCancel -----------------------------------------------------------------------------------

void SyncCancel::Cancel(const std::string& reason) {
  // Abort() is quick and never blocks for long, so it runs under the lock: a communicator cannot
  // be unregistered (and destroyed) while it is being aborted.
  absl::MutexLock lock(&mu_);
  if (!cancelled_.load(std::memory_order_relaxed)) reason_ = reason;
  cancelled_.store(true, std::memory_order_release);
  for (comm::Communicator* c : comms_) c->Abort(reason_);
}

std::string SyncCancel::reason() const {
  absl::MutexLock lock(&mu_);
  return reason_;
}

bool SyncCancel::Register(comm::Communicator* comm) {
  absl::MutexLock lock(&mu_);
  if (cancelled_.load(std::memory_order_relaxed)) {
    comm->Abort(reason_);
    return false;
  }
  comms_.push_back(comm);
  return true;
}

void SyncCancel::Unregister(comm::Communicator* comm) {
  absl::MutexLock lock(&mu_);
  comms_.erase(std::remove(comms_.begin(), comms_.end(), comm), comms_.end());
}

// --- FormationLatch -------------------------------------------------------------------------------

void FormationLatch::Arrive() {
  absl::MutexLock lock(&mu_);
  --left_;
}

absl::Status FormationLatch::Wait(const SyncCancel& cancel, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto all = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return left_ <= 0; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&all), absl::Milliseconds(20))) {
    if (cancel.cancelled()) return absl::AbortedError("cancelled while the other stages formed their groups");
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(
          absl::StrCat(left_, " stage(s) still forming their groups after ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

// --- ReceiveStage ---------------------------------------------------------------------------------

namespace {

std::string BucketWhere(const v1::BucketManifest& m) {
  return absl::StrCat("stage ", m.pp_stage(), " bucket ", m.index());
}

// A delta entry (EntryDelta) of the whole tensor or of a block (sharded): applied onto the
// staging's block of the base, checked by the sums of this rank's layout.
absl::Status LoadDeltaEntry(const v1::BucketEntry& e, DType dtype, const Shape& shape, const Buffer& data,
                            engine_model::Loader& loader) {
  const engine_model::EngineParallel& me = loader.staging().layout().parallel();
  const v1::DeltaSum* sum = nullptr;
  for (const v1::DeltaSum& s : e.delta().sums())
    if (static_cast<int>(s.tp_size()) == me.tp_size && static_cast<int>(s.tp_rank()) == me.tp_rank &&
        static_cast<int>(s.ep_size()) == me.ep_size && s.mtp_draft() == me.mtp_draft)
      sum = &s;
  if (sum == nullptr)
    return absl::FailedPreconditionError(absl::StrCat(
        e.tensor().name(), ": the delta carries no checksums for engine rank ", me.tp_rank, " of TP ", me.tp_size,
        ", EP ", me.ep_size, me.mtp_draft ? " (NextN draft)" : "", ": the sender did not know this rank's layout"));
  if (e.delta().encoding() > 2)
    return absl::DataLossError(absl::StrCat(e.tensor().name(), ": a delta in unknown encoding ", e.delta().encoding()));
  engine_model::Loader::DeltaRef ref{static_cast<kernels::DeltaEncoding>(e.delta().encoding()), sum->base_sum64(),
                                     sum->sum64()};
  if (e.has_block())  // sharded delivery: a delta of the block cut for this rank's group
    ref.block = engine_model::Loader::BlockRef{e.block().row0(), e.block().rows(), e.block().col0(), e.block().cols()};
  const auto* p = reinterpret_cast<const uint8_t*>(data.data()) + e.offset();
  return loader.LoadDelta(e.tensor().name(), dtype, shape, ref, {p, static_cast<size_t>(e.nbytes())});
}

absl::Status LoadEntry(const v1::BucketEntry& e, const Buffer& data, engine_model::Loader& loader) {
  ASSIGN_OR_RETURN(const DType dtype, comm::FromProto(e.tensor().dtype()));
  Shape shape(e.tensor().shape().begin(), e.tensor().shape().end());
  if (e.has_delta()) return LoadDeltaEntry(e, dtype, shape, data, loader);
  if (e.has_block()) {  // sharded delivery: the block this rank keeps (ValidateManifest sized it)
    const auto& b = e.block();
    const engine_model::Loader::BlockRef block{b.row0(), b.rows(), b.col0(), b.cols()};
    ASSIGN_OR_RETURN(TensorView view,
                     TensorView::Make(dtype, Shape{b.rows(), b.cols()},
                                      {data.data() + e.offset(), static_cast<size_t>(e.nbytes())}, e.tensor().name()));
    return loader.LoadBlock(e.tensor().name(), dtype, shape, block, view);
  }
  ASSIGN_OR_RETURN(TensorView view,
                   TensorView::Make(dtype, std::move(shape),
                                    {data.data() + e.offset(), static_cast<size_t>(e.nbytes())}, e.tensor().name()));
  return loader.Load(e.tensor().name(), view);
}

}  // namespace

absl::Status LoadBucket(const v1::BucketManifest& m, const Buffer& data, engine_model::Loader& loader, int threads) {
  const int n = m.entries_size();
  const engine_model::Staging& staging = loader.staging();
  if (m.nbytes() > 0 && MemorySpace::Of(data) != staging.space())
    return absl::InvalidArgumentError(absl::StrCat(BucketWhere(m), ": the bucket is in ", MemorySpace::Of(data).Name(),
                                                   ", the staging in ", staging.space().Name()));
  for (const v1::BucketEntry& e : m.entries()) {
    if (!e.has_block() && !e.has_delta() && e.nbytes() != e.total_nbytes()) {
      return absl::UnimplementedError(absl::StrCat(BucketWhere(m), ": ", e.tensor().name(), " is split (bytes [",
                                                   e.split_offset(), ", ", e.split_offset() + e.nbytes(), ") of ",
                                                   e.total_nbytes(), "); this agent loads whole tensors only"));
    }
  }
  // The work is the bytes written, and a delta entry's whole tensor however small its payload (its
  // block may be read back and summed: the first delta after a full sync, and every recheck).
  uint64_t written = m.nbytes();
  for (const v1::BucketEntry& e : m.entries())
    if (e.has_delta()) written += e.total_nbytes();
  threads = std::clamp(threads, 1, std::max(n, 1));
  if (written < (uint64_t{1} << 20)) threads = 1;  // not worth a thread
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first;
  auto work = [&] {
    for (;;) {
      const int i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n || failed.load(std::memory_order_relaxed)) return;
      absl::Status s = LoadEntry(m.entries(i), data, loader);
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (first.ok()) first = Annotate(s, BucketWhere(m));
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  // A device staging's copies are enqueued: the bucket may be reused only once they are done (also
  // after a failed entry: other entries' copies may be in flight).
  if (!staging.space().host()) {
    absl::Status done = staging.Synchronize();
    if (first.ok() && !done.ok())
      first = Annotate(done, absl::StrCat(BucketWhere(m), ": loading into ", staging.space().Name()));
  }
  return first;
}

namespace {

absl::Status CheckManifest(const v1::BucketManifest& m, const StageOptions& o) {
  if (m.version() != o.version) {
    return absl::InvalidArgumentError(
        absl::StrCat(BucketWhere(m), ": carries version ", m.version(), " but the sync is version ", o.version));
  }
  if (m.pp_stage() != o.pp_stage) {
    return absl::InvalidArgumentError(
        absl::StrCat(BucketWhere(m), ": arrived in the group of stage ", o.pp_stage, " (", o.group, ")"));
  }
  // Deltas apply to the base the agent checked at BeginSync, and to no other version.
  if (m.base_version() != 0 && m.base_version() != o.delta_base) {
    return absl::FailedPreconditionError(
        absl::StrCat(BucketWhere(m), ": deltas from version ", m.base_version(), ", and ",
                     o.delta_base == 0 ? "this is a full sync (the staging holds no base for them)"
                                       : absl::StrCat("the staging holds version ", o.delta_base)));
  }
  return absl::OkStatus();
}

bool AddressedTo(const v1::BucketManifest& m, int rank) {
  if (m.targets().empty()) return true;
  return std::find(m.targets().begin(), m.targets().end(), static_cast<uint32_t>(rank)) != m.targets().end();
}

}  // namespace

absl::StatusOr<StageStats> ReceiveStage(const StageOptions& o) {
  const std::string where =
      absl::StrCat("stage ", o.pp_stage, " (group \"", o.group, "\", rank ", o.rank, "/", o.size, ")");
  if (o.store == nullptr || o.loader == nullptr || o.cancel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": store, loader and cancel are required"));
  }
  SyncCancel& cancel = *o.cancel;
  auto aborted = [&](const absl::Status& s) {
    return absl::AbortedError(absl::StrCat("the sync was aborted (", cancel.reason(), "): ", s.message()));
  };
  std::optional<comm::BucketMac> mac;
  if (!o.bucket_mac_key.empty()) {
    auto m = comm::BucketMac::ForStream(o.bucket_mac_key, o.group);
    if (!m.ok()) return Annotate(m.status(), where);
    mac = std::move(*m);
  }
  StageStats stats;
  comm::GroupOptions g;
  g.store = o.store;
  g.name = o.group;
  g.rank = o.rank;
  g.size = o.size;
  g.host = o.host;
  g.cuda_device = o.cuda_device;
  g.join_timeout = o.join_timeout;
  g.default_timeout = o.op_timeout;
  g.cancelled = [&cancel] { return cancel.cancelled(); };
  const absl::Time t0 = absl::Now();
  auto comm = comm::CreateGroup(o.backend, g);
  if (!comm.ok()) return cancel.cancelled() ? aborted(comm.status()) : Annotate(comm.status(), where);
  stats.join = absl::Now() - t0;
  if (!cancel.Register(comm->get()))
    return aborted(absl::AbortedError(absl::StrCat(where, ": after forming the group")));
  WSYNC_LOG(DEBUG) << where << ": group formed in " << absl::FormatDuration(stats.join);
  if (o.formed != nullptr) {
    o.formed->Arrive();
    if (absl::Status w = o.formed->Wait(cancel, o.join_timeout); !w.ok()) {
      (*comm)->Abort(w.message());
      cancel.Unregister(comm->get());
      return cancel.cancelled() ? aborted(w) : Annotate(w, where);
    }
  }

  // Where the buckets arrive (host memory, or the group's GPU over NCCL) and where the loader reads
  // them (the staging's space): the bridge moves a bucket that arrives elsewhere once.
  const MemorySpace space = (*comm)->space();
  if (absl::Status st = SpaceBridge::Check(space, o.loader->staging().space()); !st.ok()) {
    st = absl::FailedPreconditionError(absl::StrCat(where, ": ", st.message()));
    (*comm)->Abort(st.message());
    cancel.Unregister(comm->get());
    return st;
  }
  SpaceBridge bridge({.arrive = space,
                      .load = o.loader->staging().space(),
                      .record = o.recorder != nullptr,
                      .host_receive_pool = o.pool,
                      .device_pool = o.device_pool,
                      .pinned_pool = o.host_pool});
  const absl::Time t1 = absl::Now();
  absl::Status s = [&]() -> absl::Status {
    comm::BucketReceiver receiver(**comm, 0, comm::CollectiveOptions{o.op_timeout}, bridge.receive_pool(), mac);
    for (;;) {
      auto next = receiver.Next();
      if (!next.ok()) return Annotate(next.status(), where);
      if (!next->has_value()) return absl::OkStatus();
      comm::BucketReceiver::Bucket& b = **next;
      RETURN_IF_ERROR(CheckManifest(b.manifest, o));
      if (stats.buckets == 0) FailpointHit("rollout.transfer");  // system tests (common/failpoint.h)
      stats.buckets++;
      stats.bytes += b.manifest.nbytes();
      if (!AddressedTo(b.manifest, o.rank)) {
        bridge.GiveBack(std::move(b.data));
        continue;
      }
      Bridged bridged;
      absl::Status moved =
          bridge.Bridge(std::move(b.data), b.manifest.nbytes(), where, BucketWhere(b.manifest), &bridged);
      stats.to_host = bridge.stats().to_host;
      stats.to_device = bridge.stats().to_device;
      stats.to_host_bytes = bridge.stats().to_host_bytes;
      stats.to_device_bytes = bridge.stats().to_device_bytes;
      RETURN_IF_ERROR(moved);
      const absl::Time l0 = absl::Now();
      RETURN_IF_ERROR(LoadBucket(b.manifest, bridge.Loadable(bridged), *o.loader, o.load_threads));
      const absl::Time l1 = absl::Now();
      stats.load += l1 - l0;
      stats.tensors += static_cast<uint64_t>(b.manifest.entries_size());
      if (o.recorder != nullptr) {
        RETURN_IF_ERROR(o.recorder->WriteBucket(b.manifest, bridge.HostBytes(bridged)));
        stats.record += absl::Now() - l1;
      }
      bridge.GiveBack(bridged);
      if (cancel.cancelled()) return absl::AbortedError("cancelled between buckets");
    }
  }();
  stats.transfer = absl::Now() - t1;
  if (!s.ok()) (*comm)->Abort(s.message());
  cancel.Unregister(comm->get());
  if (!s.ok()) return cancel.cancelled() ? aborted(s) : s;
  return stats;
}

}  // namespace wsync::rollout_agent
