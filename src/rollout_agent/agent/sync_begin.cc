// RolloutAgent, a sync beginning and receiving: BeginSync (CheckBegin, StartSync), the pause of
// the engine, the device receive (nccl, cuda-ipc) and its pools, and RunStage (one receive thread per stage).

#include <algorithm>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "comm/bucket/bucket_mac.h"
#include "comm/store/store.h"
#include "common/failpoint.h"
#include "common/logging.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "engine_model/loader.h"
#include "kernels/dispatch.h"
#include "rollout_agent/agent/rollout_agent.h"
#include "rollout_agent/agent/rollout_agent_state.h"
#include "rollout_agent/receive/recorder.h"
#include "rollout_agent/receive/stage_receiver.h"

namespace wsync::rollout_agent {

// --- BeginSync ----------------------------------------------------------------------------------------

// The coordinator run a sync belongs to: the run id of its sync_key ("<run id>-<sync id>"; "" from
// a coordinator that sends none).
std::string RolloutAgent::SyncRun(const v1::BeginSyncRequest& req) {
  const std::string& key = req.sync_key();
  const size_t dash = key.rfind('-');
  return dash == std::string::npos ? std::string() : key.substr(0, dash);
}

absl::Status RolloutAgent::CheckBegin(const v1::BeginSyncRequest& req, bool* duplicate, v1::BeginSyncReply* reply) {
  *duplicate = false;
  if (stopping_) return absl::UnavailableError("the rollout agent is shutting down");
  if (sync_ != nullptr) {
    if (sync_->id == req.sync_id()) {
      if (sync_->phase == Phase::kBeginning) return absl::OkStatus();  // the first call is still pausing: wait for it
      *duplicate = true;
      reply->set_previous_version(sync_->previous_version);
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginSync ", req.sync_id(), ": sync ", sync_->id, " is ", PhaseName(static_cast<int>(sync_->phase)),
        sync_->first_error.ok() ? "" : " (failed, waiting for AbortSync)", "; one sync at a time"));
  }
  if (req.sync_id() == 0) return absl::InvalidArgumentError("BeginSync: sync_id 0 is reserved");
  if (req.sync_id() == last_sync_id_ && SyncRun(req) == last_sync_run_) {
    return absl::FailedPreconditionError(
        absl::StrCat("BeginSync ", req.sync_id(), ": that sync already ended (",
                     last_committed_ ? "committed" : absl::StrCat("failed: ", last_outcome_.message()), ")"));
  }
  if (engine_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("BeginSync ", req.sync_id(), ": no engine has registered yet"));
  }
  if (req.version() <= version_) {
    return absl::FailedPreconditionError(absl::StrCat("BeginSync ", req.sync_id(), ": version ", req.version(),
                                                      " is not newer than the engine's version ", version_));
  }
  return absl::OkStatus();
}

uint64_t RolloutAgent::DeltaBaseVersion() const {
  absl::MutexLock lock(&mu_);
  const bool host = engine_ != nullptr && engine_->staging != nullptr && engine_->staging->space().host();
  return host ? staged_version_ : 0;
}

absl::Status RolloutAgent::BeginSync(const v1::BeginSyncRequest& req, v1::BeginSyncReply* reply, absl::Time deadline) {
  FailpointHit("rollout.begin");  // system tests (common/failpoint.h)
  bool duplicate = false;
  uint64_t stale = 0;  // a sync this newer one supersedes
  std::string stale_phase;
  {
    absl::MutexLock lock(&mu_);
    // A newer sync of the same coordinator, or any sync of another one (its run id differs: a
    // restarted trainer job numbers syncs on from its state file, or from 1 without one).
    if (sync_ != nullptr && (req.sync_id() > sync_->id || SyncRun(req) != SyncRun(sync_->req)) &&
        sync_->phase != Phase::kCommitting) {
      stale = sync_->id;
      stale_phase = PhaseName(static_cast<int>(sync_->phase));
    } else {
      RETURN_IF_ERROR(CheckBegin(req, &duplicate, reply));
      if (duplicate) return absl::OkStatus();
    }
  }
  if (stale != 0) {
    // The coordinator runs one sync at a time, so a newer sync means it is done with the older one:
    // its AbortSync was lost, or the coordinator is a restarted one (its trainer job died mid-sync:
    // then the sync comes from another run, whatever its id).
    // End the old sync now (the engine was not written: it keeps its version) rather than refuse
    // syncs until the old one's timeout passes. A sync that is committing is never superseded.
    const std::string reason =
        absl::StrCat("superseded by sync ", req.sync_id(), " (version ", req.version(), ") while ", stale_phase);
    WSYNC_LOG(WARNING) << "sync " << stale << ": " << reason;
    uint64_t version = 0;
    RETURN_IF_ERROR(Annotate(AbortById(stale, reason, &version),
                             absl::StrCat("BeginSync ", req.sync_id(), ": ending sync ", stale)));
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckBegin(req, &duplicate, reply));
    if (duplicate) return absl::OkStatus();
  }
  {
    // A copy of a version from a peer (catch-up) holds op_mu_ for as long as it streams: the sync
    // rewrites the staging anyway, so the copy ends now instead of holding this BeginSync.
    absl::MutexLock lock(&mu_);
    if (fetch_ctx_ != nullptr) {
      WSYNC_LOG(INFO) << "BeginSync " << req.sync_id() << ": cancelling the copy from a peer in progress";
      fetch_ctx_->TryCancel();
    }
  }
  absl::MutexLock op(&op_mu_);
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckBegin(req, &duplicate, reply));
    if (duplicate) return absl::OkStatus();
  }
  return StartSync(req, reply, deadline);
}

absl::StatusOr<comm::Backend> RolloutAgent::CheckSyncRequest(const v1::BeginSyncRequest& req,
                                                             const std::string& who) const {
  auto backend = comm::ParseBackend(req.backend());
  if (!backend.ok()) return Annotate(backend.status(), who);
  if (*backend == comm::Backend::kMpi)
    return absl::InvalidArgumentError(absl::StrCat(who, ": backend ", req.backend(), " (gloo, shm, nccl or cuda-ipc)"));
  const std::string name(comm::BackendName(*backend));
  if (!comm::BackendCompiledIn(*backend))
    return absl::FailedPreconditionError(absl::StrCat(who, ": backend ", name, ", and this agent was built without ",
                                                      *backend == comm::Backend::kNccl ? "NCCL" : "CUDA",
                                                      " (receive with gloo)"));
  if (comm::MovesDeviceMemory(*backend) && !kernels::GpuAvailable())
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": backend ", name, " receives into GPU memory, and this host has no CUDA device (receive with gloo)"));
  if (comm::MovesDeviceMemory(*backend) && ReceiveDevice() < 0)
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": backend ", name,
                     " receives on this agent's GPU, and none is known: the engine's parameters are not in "
                     "CUDA memory; start the agent with --cuda-device N",
                     *backend == comm::Backend::kNccl ? " (each agent of a host on its own GPU)" : ""));
  if (req.groups_size() == 0) return absl::InvalidArgumentError(absl::StrCat(who, ": no groups"));
  if (!req.bucket_mac_key().empty() && req.bucket_mac_key().size() != comm::kBucketMacKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": a ", req.bucket_mac_key().size(), "-byte bucket key (",
                                                   comm::kBucketMacKeyBytes, " or none)"));
  }
  if (req.bucket_mac_key().empty() && options_.require_bucket_mac) {
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     ": this agent accepts only authenticated buckets (--bucket-mac), and the sync has no "
                     "bucket key: start the trainer agents with --bucket-mac on (or a token)"));
  }
  if (req.store_address().empty()) return absl::InvalidArgumentError(absl::StrCat(who, ": no store_address"));
  absl::flat_hash_set<std::string> names;
  absl::flat_hash_set<uint32_t> stages;
  for (const v1::SyncGroup& g : req.groups()) {
    if (g.name().empty() || !names.insert(g.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": group names must be non-empty and distinct (\"", g.name(), "\")"));
    }
    // Sharded delivery sends a stage over several streams (one per sender); a recording names its
    // files by stage and bucket index, so a recorded sync has one stream per stage.
    if (!stages.insert(g.pp_stage()).second && req.record()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": two groups for pipeline stage ", g.pp_stage(), " in a recorded sync"));
    }
    if (g.size() < 2 || req.agent_rank() < 1 || req.agent_rank() >= g.size()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": agent_rank ", req.agent_rank(), " does not fit group \"",
                                                     g.name(), "\" of size ", g.size(),
                                                     " (rank 0 is the stage source)"));
    }
  }
  return *backend;
}

absl::Status RolloutAgent::StartSync(const v1::BeginSyncRequest& req, v1::BeginSyncReply* reply, absl::Time deadline) {
  const std::string who = absl::StrCat("BeginSync ", req.sync_id(), " (version ", req.version(), ")");
  auto backend = CheckSyncRequest(req, who);
  if (!backend.ok()) return backend.status();

  Sync* s = nullptr;
  {
    absl::MutexLock staging(&staging_mu_);  // a peer's copy of the staging in progress ends first
    if (req.delta_base() != 0) {
      // A delta sync updates the version the staging holds: it must be that base, whole.
      absl::MutexLock lock(&mu_);
      const bool host = engine_->staging->space().host();
      if (!host || staged_version_ != req.delta_base()) {
        return absl::FailedPreconditionError(
            absl::StrCat(who, ": a delta from version ", req.delta_base(), ", and this agent's staging holds ",
                         !host                  ? "its weights in GPU memory (deltas apply to a host staging only)"
                         : staged_version_ == 0 ? "no complete version"
                                                : absl::StrCat("version ", staged_version_),
                         ": nothing was changed; a full sync (--delta off) brings it forward"));
      }
    }
    auto sync = std::make_unique<Sync>();
    sync->req = req;
    sync->id = req.sync_id();
    sync->backend = *backend;
    sync->cuda_device = ReceiveDevice();
    sync->formed = std::make_unique<FormationLatch>(req.groups_size());
    sync->timeout = req.timeout_ms() > 0 ? absl::Milliseconds(req.timeout_ms()) : options_.default_sync_timeout;
    sync->rpcs = 1;
    absl::MutexLock lock(&mu_);
    sync->previous_version = version_;
    sync_ = std::move(sync);
    staged_sync_id_ = staged_version_ = 0;  // the staging is being overwritten
    owed_version_ = 0;                      // this newer sync brings the engine forward
    s = sync_.get();
  }
  m_->active->Set(1);
  Engine& e = *engine_;
  auto fail = [&](const absl::Status& st) {
    // Continue if the engine was asked to pause, even if Pause itself failed: it may have paused.
    absl::Status cont = EndFailedSync(s, std::string(st.message()), s->engine_paused);
    absl::Status out = Annotate(st, who);
    if (!cont.ok()) out = Annotate(out, absl::StrCat("[and continuing the engine failed too: ", cont.message(), "]"));
    return out;
  };
  std::string paused_note = "the engine keeps serving until the commit";
  if (options_.pause_whole_sync) {
    auto paused = PauseEngine(s, deadline);
    if (!paused.ok()) return fail(paused.status());
    paused_note = *paused;
  }

  // A delta sync: every piece holds the base, and every tensor of the sync must still arrive
  // (PrepareSync checks each was loaded: an unchanged one comes as an empty delta).
  if (req.delta_base() != 0) {
    e.staging->MarkAllRestored();
  } else {
    e.staging->ResetCoverage();
  }
  if (req.record() && req.delta_base() != 0) {
    WSYNC_LOG(DEBUG) << who << ": a delta sync is not recorded (a recording holds whole tensors)";
  } else if (req.record() && !options_.record_dir.empty()) {
    // An older coordinator sends no key: the store address and sync id then name the sync.
    std::string key = req.sync_key();
    if (key.empty()) key = absl::StrReplaceAll(absl::StrCat(req.store_address(), "-", req.sync_id()), {{"/", "_"}});
    auto rec = Recorder::Start(options_.record_dir, req.version(), key);
    if (!rec.ok()) return fail(rec.status());
    s->recorder = std::move(*rec);
  } else if (req.record()) {
    WSYNC_LOG(DEBUG) << who << ": the sync asks for a recording, but this agent has no --record-dir";
  }
  s->store = comm::GrpcStoreClient::Connect(req.store_address(), absl::Seconds(30), options_.security);
  s->loader = std::make_unique<engine_model::Loader>(e.staging.get());
  {
    absl::MutexLock lock(&mu_);
    s->phase = Phase::kReceiving;
    s->running = req.groups_size();
  }
  for (int i = 0; i < req.groups_size(); ++i)
    s->threads.emplace_back([this, s, i] { RunStage(s, static_cast<size_t>(i)); });
  {
    absl::MutexLock lock(&mu_);
    s->rpcs--;
    s->idle_since = absl::Now();
  }
  WSYNC_LOG(INFO) << who << ": " << paused_note << "; receiving " << req.groups_size() << " stage(s) as rank "
                  << req.agent_rank()
                  << (s->recorder ? absl::StrCat(", recording to ", s->recorder->partial_dir()) : "");
  reply->set_previous_version(s->previous_version);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RolloutAgent::PauseEngine(Sync* s, absl::Time deadline) {
  Engine& e = *engine_;
  const absl::Time t0 = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    s->engine_paused = true;  // from here on a failure must Continue the engine
    s->paused_at = t0;
  }
  auto paused = e.client->Pause(v1::PauseRequest::HOLD);
  if (!paused.ok()) return paused.status();
  const absl::Time t1 = absl::Now();
  m_->Observe("pause", t1 - t0);
  if (s->cancel.cancelled()) return absl::AbortedError(s->cancel.reason());
  const absl::Time flush_deadline = std::min(t1 + std::min(options_.flush_deadline, s->timeout), deadline);
  auto flushed = e.client->Flush(flush_deadline, [s] { return s->cancel.cancelled(); });
  if (!flushed.ok()) return flushed.status();
  const absl::Time t2 = absl::Now();
  m_->Observe("flush", t2 - t1);
  if (s->cancel.cancelled()) return absl::AbortedError(s->cancel.reason());
  return absl::StrCat("engine paused (", *paused, " in flight) and flushed",
                      *flushed > 0 ? absl::StrCat(" after ", *flushed, " refusals") : "", " in ",
                      absl::FormatDuration(t2 - t0));
}

int RolloutAgent::ReceiveDevice() const {
  if (options_.cuda_device >= 0) return options_.cuda_device;
  if (engine_ != nullptr && engine_->staging != nullptr && !engine_->staging->space().host())
    return engine_->staging->space().cuda_device();
  if (engine_ != nullptr && engine_->memory != nullptr) {
    for (const engine_model::EngineBuffer& b : engine_->memory->weights().buffers())
      if (b.on_device()) return b.cuda_device;
  }
  return -1;
}

BufferPool* RolloutAgent::DevicePool(int device) {
  absl::MutexLock lock(&pools_mu_);
  std::unique_ptr<BufferPool>& p = device_pools_[device];
  if (p == nullptr)
    p = std::make_unique<BufferPool>(
        2, [space = MemorySpace::Cuda(device)](size_t n) { return space.Allocate(n); }, /*keep_until_trim=*/true);
  return p.get();
}

void RolloutAgent::TrimDevicePools() {
  {
    absl::MutexLock lock(&pools_mu_);
    for (auto& [device, pool] : device_pools_) pool->Trim();
  }
  pinned_pool_.Trim();
}

void RolloutAgent::RunStage(Sync* s, size_t index) {
  const v1::SyncGroup& g = s->req.groups(static_cast<int>(index));
  StageOptions o;
  o.backend = s->backend;
  o.store = s->store.get();
  o.group = g.name();
  o.pp_stage = g.pp_stage();
  o.rank = static_cast<int>(s->req.agent_rank());
  o.size = static_cast<int>(g.size());
  o.host = options_.data_host;
  o.version = s->req.version();
  o.join_timeout = s->timeout;
  o.op_timeout = s->timeout;
  o.loader = s->loader.get();
  o.recorder = s->recorder.get();
  o.load_threads = options_.load_threads > 0
                       ? options_.load_threads
                       : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  o.cancel = &s->cancel;
  o.pool = &bucket_pool_;
  if (comm::MovesDeviceMemory(s->backend)) {
    if (s->backend == comm::Backend::kNccl) o.formed = s->formed.get();
    o.cuda_device = s->cuda_device;
    o.device_pool = DevicePool(s->cuda_device);
    o.host_pool = &pinned_pool_;
  }
  o.bucket_mac_key = s->req.bucket_mac_key();
  o.delta_base = s->req.delta_base();
  auto r = ReceiveStage(o);
  bool cancel_others = false;
  {
    absl::MutexLock lock(&mu_);
    --s->running;
    if (r.ok()) {
      s->totals.buckets += r->buckets;
      s->totals.bytes += r->bytes;
      s->totals.tensors += r->tensors;
      s->totals.join = std::max(s->totals.join, r->join);
      s->totals.transfer = std::max(s->totals.transfer, r->transfer);
      s->totals.load += r->load;
      s->totals.record += r->record;
      s->totals.to_host += r->to_host;
      s->totals.to_device += r->to_device;
      s->totals.to_host_bytes += r->to_host_bytes;
      s->totals.to_device_bytes += r->to_device_bytes;
    } else if (s->first_error.ok()) {
      s->first_error = r.status();
      cancel_others = true;
    }
  }
  if (r.ok()) {
    m_->bytes->Increment(static_cast<double>(r->bytes));
    m_->buckets->Increment(static_cast<double>(r->buckets));
    m_->tensors->Increment(static_cast<double>(r->tensors));
    WSYNC_LOG(INFO) << "sync " << s->id << ": stage " << g.pp_stage() << " received " << r->buckets << " buckets, "
                    << r->tensors << " tensors, " << r->bytes << " bytes in " << absl::FormatDuration(r->transfer)
                    << " (group formed in " << absl::FormatDuration(r->join) << ", loading "
                    << absl::FormatDuration(r->load) << ")";
  } else {
    WSYNC_LOG(ERROR) << "sync " << s->id << ": stage " << g.pp_stage() << " failed: " << r.status();
    if (cancel_others) s->cancel.Cancel(absl::StrCat("stage ", g.pp_stage(), " failed: ", r.status().message()));
  }
}

}  // namespace wsync::rollout_agent
