// RolloutAgent, engine install: RegisterEngine (InstallEngine maps the engine's memory and makes
// or keeps the staging, then the join and the catch-up promise) and the reads of the engine's
// memory (EngineChecksums, ReadEngine).

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "engine_memory/engine_memory.h"
#include "engine_model/engine_layout.h"
#include "kernels/dispatch.h"
#include "rollout_agent/agent/engine_client.h"
#include "rollout_agent/agent/membership.h"
#include "rollout_agent/agent/rollout_agent.h"
#include "rollout_agent/agent/rollout_agent_state.h"

namespace wsync::rollout_agent {

// --- RegisterEngine -----------------------------------------------------------------------------------

absl::Status RolloutAgent::RegisterEngine(const v1::RegisterEngineRequest& req, v1::RegisterEngineReply* reply) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the rollout agent is shutting down");
  }
  const std::string who =
      absl::StrCat("RegisterEngine(engine \"", req.engine_id(), "\", tp rank ", req.tp_rank(), "/", req.tp_size(), ")");
  ASSIGN_OR_RETURN(Registered r, InstallEngine(req, who));
  // What follows waits on the coordinator and the engine, so it runs without op_mu_: an engine that
  // stops answering here (it hangs, or is stopped right after it asked) must not hold a BeginSync
  // that the coordinator sends meanwhile for the engine RPC timeout.
  uint64_t promise = r.catch_up ? r.staged : 0;  // RegisterEngineReply.catch_up_version
  // A restarted agent: the coordinator's answer says whether a peer can give the engine the
  // published version; if so the engine may hold requests until it is committed.
  if (r.membership && !r.catch_up && r.membership->AwaitJoined(absl::Seconds(2))) {
    const v1::CatchUpHint hint = r.membership->catch_up();
    if (hint.version() > req.version() && hint.peers_size() > 0) {
      absl::MutexLock lock(&mu_);
      // Not replaced meanwhile, and no sync has started or committed that version since (the
      // engine would hold requests for a version it is not going to be given).
      if (engine_ != nullptr && engine_->client == r.client && sync_ == nullptr && version_ < hint.version()) {
        promise = hint.version();
        promised_version_ = promise;
        next_fetch_ = absl::Now();
        fetch_failures_ = 0;
        WSYNC_LOG(INFO) << "the fleet serves version " << promise << ": copying it from a peer (" << hint.peers(0)
                        << (hint.peers_size() > 1 ? absl::StrCat(" or ", hint.peers_size() - 1, " other(s)") : "")
                        << ") for the engine";
      }
    }
  }
  reply->set_agent_id(AgentId());
  if (promise > 0) {
    reply->set_catch_up_version(promise);
    return absl::OkStatus();
  }
  // An engine left paused by an agent that died mid-commit (it re-registers with this one) must not
  // stay paused. Continue only while no sync runs (one may pause the engine itself), the engine was
  // not replaced and no commit changed its version since; it answered Health just now, so Continue
  // is prompt.
  auto health = r.client->Health();
  if (!health.ok() || health->state() != v1::HealthReply::PAUSED) return absl::OkStatus();
  absl::MutexLock op(&op_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (sync_ != nullptr || engine_ == nullptr || engine_->client != r.client || version_ != req.version())
      return absl::OkStatus();
  }
  auto cont = r.client->Continue(req.version());
  if (cont.ok())
    WSYNC_LOG(WARNING) << who << ": the engine was paused (by an earlier agent that stopped?): continued on version "
                       << *cont;
  else
    WSYNC_LOG(WARNING) << who << ": continuing the paused engine on version " << req.version() << ": " << cont.status();
  return absl::OkStatus();
}

namespace {

// The request's own checks: a TP rank below the TP size, an engine address, params.
// INVALID_ARGUMENT naming what is missing.
absl::Status CheckRegisterRequest(const v1::RegisterEngineRequest& req, const std::string& who) {
  if (req.tp_size() == 0 || req.tp_rank() >= req.tp_size()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": tp_rank must lie in [0, tp_size)"));
  }
  if (req.engine_address().empty()) return absl::InvalidArgumentError(absl::StrCat(who, ": no engine_address"));
  if (req.params_size() == 0) return absl::InvalidArgumentError(absl::StrCat(who, ": no params"));
  return absl::OkStatus();
}

// The engine's model config and quantization (none: bf16), as the request carries them.
struct EngineConfigs {
  ModelConfig config;
  std::optional<QuantizationConfig> quant;
};

// Parses both JSON documents of the request; their parsers' errors, annotated with `who`.
absl::StatusOr<EngineConfigs> ParseEngineConfigs(const v1::RegisterEngineRequest& req, const std::string& who) {
  auto config = ParseModelConfig(req.model_config_json(), "RegisterEngineRequest.model_config_json");
  if (!config.ok()) return Annotate(config.status(), who);
  EngineConfigs out{std::move(*config), std::nullopt};
  if (!req.quantization_config_json().empty()) {
    auto q = ParseQuantizationConfig(req.quantization_config_json(), "RegisterEngineRequest.quantization_config_json");
    if (!q.ok()) return Annotate(q.status(), who);
    out.quant = std::move(*q);
  }
  return out;
}

// --staging device: the staging goes to the GPU that holds every one of the engine's params.
// INVALID_ARGUMENT naming a param when they are not all on one CUDA device, or when --cuda-device
// (`cuda_device` >= 0) names another GPU.
absl::StatusOr<MemorySpace> DeviceStagingSpace(const engine_model::EngineWeights& w, int cuda_device,
                                               const std::string& who) {
  const int dev = w.buffers().empty() ? -1 : w.buffers().front().cuda_device;
  for (const engine_model::EngineBuffer& b : w.buffers()) {
    if (b.cuda_device != dev || dev < 0)
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": this agent keeps its staging on the engine's GPU (--staging device), but engine param ", b.name,
          " is in ", b.on_device() ? MemorySpace::Cuda(b.cuda_device).Name() : "host memory",
          dev >= 0 ? absl::StrCat(" and ", w.buffers().front().name, " in ", MemorySpace::Cuda(dev).Name()) : "",
          ": a device staging needs every param on one CUDA device"));
  }
  if (cuda_device >= 0 && cuda_device != dev)
    return absl::InvalidArgumentError(absl::StrCat(who, ": the engine's params are in ", MemorySpace::Cuda(dev).Name(),
                                                   ", but NCCL syncs are received on --cuda-device ", cuda_device,
                                                   ", and a device staging loads in place"));
  return MemorySpace::Cuda(dev);
}

// The Join that announces the registered engine rank to the coordinator, from `address`.
v1::JoinRequest JoinFor(const v1::RegisterEngineRequest& req, const std::string& address, uint32_t ep) {
  v1::JoinRequest join;
  join.set_agent_address(address);
  join.set_engine_id(req.engine_id());
  join.set_tp_rank(req.tp_rank());
  join.set_tp_size(req.tp_size());
  join.set_ep_size(static_cast<uint32_t>(ep));
  join.set_version(req.version());
  join.set_quantization_config_json(req.quantization_config_json());
  join.set_mtp_draft(ServesMtpDraft(req));
  return join;
}

}  // namespace

absl::Status RolloutAgent::StageEngine(Engine& engine, bool keep, MemorySpace space, const std::string& who) {
  if (keep) {
    absl::MutexLock lock(&mu_);  // DeltaBaseVersion reads engine_->staging under mu_
    engine.staging = std::move(engine_->staging);
  } else {
    // Drop the previous engine's staging before allocating the new one (peak memory: one staging).
    if (engine_ != nullptr) {
      absl::MutexLock staging(&staging_mu_);
      absl::MutexLock mem(&memory_mu_);
      absl::MutexLock lock(&mu_);
      engine_.reset();
      m_->registered->Set(0);
    }
    auto staging = engine_model::Staging::Create(*engine.layout, space);
    if (!staging.ok())
      return Annotate(staging.status(), absl::StrCat(who, ": allocating the staging buffers (", space.Name(), ")"));
    engine.staging = std::move(*staging);
  }
  // A CUDA engine: page-lock the staging so that Commit's uploads run at the link's speed (H200,
  // docs/results/h200/2026-11-28-8a0d3c4/bench_repack.log: 50.21 vs 9.06 GB/s). Failing to pin costs speed, not
  // correctness.
  if (engine.memory->device_params() > 0 && !engine.staging->pinned()) {
    if (absl::Status pin = engine.staging->PinForDevice(); !pin.ok())
      WSYNC_LOG(WARNING) << who << ": staging stays pageable (commits upload more slowly): " << pin;
  }
  return absl::OkStatus();
}

absl::StatusOr<RolloutAgent::Registered> RolloutAgent::InstallEngine(const v1::RegisterEngineRequest& req,
                                                                     const std::string& who) {
  absl::MutexLock op(&op_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (sync_ != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("RegisterEngine: sync ", sync_->id, " is in progress; register again once it has ended"));
    }
  }
  const uint32_t ep = req.ep_size() == 0 ? 1 : req.ep_size();
  RETURN_IF_ERROR(CheckRegisterRequest(req, who));
  ASSIGN_OR_RETURN(const EngineConfigs parsed, ParseEngineConfigs(req, who));
  const ModelConfig& config = parsed.config;
  const std::optional<QuantizationConfig>& quant = parsed.quant;
  const std::string key = LayoutKey(req);
  const bool reuse = engine_ != nullptr && engine_->layout_key == key;
  std::unique_ptr<engine_model::EngineLayout> new_layout;
  if (!reuse) {
    engine_model::EngineParallel parallel{static_cast<int>(req.tp_size()), static_cast<int>(req.tp_rank()),
                                          static_cast<int>(ep)};
    parallel.mtp_draft = ServesMtpDraft(req);
    auto layout = engine_model::EngineLayout::Create(config, quant ? &*quant : nullptr, parallel);
    if (!layout.ok()) return Annotate(layout.status(), who);
    new_layout = std::make_unique<engine_model::EngineLayout>(std::move(*layout));
  }
  const engine_model::EngineLayout& layout = reuse ? *engine_->layout : *new_layout;
  auto memory = engine_memory::MapEngineMemory(req.params());
  if (!memory.ok()) return Annotate(memory.status(), who);
  absl::Status match = (*memory)->weights().CheckMatches(layout);
  if (!match.ok()) {
    return Annotate(match, absl::StrCat(who, ": the engine's params are not the ", config.architecture,
                                        " engine layout at TP rank ", req.tp_rank(), "/", req.tp_size(), ", EP ", ep,
                                        quant ? " (INT4)" : " (bf16)"));
  }

  MemorySpace staging_space = MemorySpace::Host();
  if (options_.device_staging) {
    ASSIGN_OR_RETURN(staging_space, DeviceStagingSpace((*memory)->weights(), options_.cuda_device, who));
  }
  // A kept staging stays only where the new one would be (the engine's GPU may have changed).
  const bool keep_staging = reuse && engine_->staging->space() == staging_space;

  auto engine = std::make_unique<Engine>();
  engine->info = req;
  engine->info.clear_params();
  engine->info.set_ep_size(ep);
  engine->layout_key = key;
  engine->memory = std::move(*memory);
  engine->client = std::make_shared<EngineClient>(req.engine_address(), options_.security,
                                                  EngineClientOptions{options_.engine_rpc_timeout});
  engine->layout = reuse ? std::move(engine_->layout) : std::move(new_layout);
  RETURN_IF_ERROR(StageEngine(*engine, keep_staging, staging_space, who));
  const size_t device_params = engine->memory->device_params();
  const int64_t staging_bytes = engine->layout->TotalBytes(engine_model::ParamForm::kLoaded);
  const std::string staging_where = engine->staging->space().Name();
  const uint64_t param_bytes = engine->memory->param_bytes();
  const size_t segments = engine->memory->segments().size();
  std::string address;
  bool catch_up = false;
  uint64_t staged = 0;
  {
    absl::MutexLock staging(&staging_mu_);
    absl::MutexLock mem(&memory_mu_);
    absl::MutexLock lock(&mu_);
    engine_ = std::move(engine);
    // The same engine rank restarted (same layout, so the staging was kept) behind the version the
    // staging holds, complete and verified, and that this agent had committed or was told to roll
    // forward to: commit it into the new memory (CatchUp) instead of waiting for the next sync.
    staged = staged_version_;
    catch_up = keep_staging && staged > req.version() && (staged == version_ || staged == owed_version_);
    if (catch_up) {
      owed_version_ = staged;
      next_catch_up_ = absl::Now();
      catch_up_failures_ = 0;
    } else {
      staged_sync_id_ = staged_version_ = 0;  // a new staging for the new engine
      owed_version_ = 0;
    }
    version_ = req.version();
    address = options_.advertise_address.empty() ? address_ : options_.advertise_address;
  }
  m_->registered->Set(1);
  m_->version->Set(static_cast<double>(req.version()));
  if (options_.set_log_identity) SetLogIdentity("rollout", static_cast<int>(req.tp_rank()));
  WSYNC_LOG(INFO) << "registered engine \"" << req.engine_id() << "\" at " << req.engine_address() << ": "
                  << config.architecture << (quant ? " INT4" : " bf16") << ", tp " << req.tp_rank() << "/"
                  << req.tp_size() << ", ep " << ep
                  << (layout.parallel().mtp_draft
                          ? absl::StrCat(", with the NextN draft of MTP layer ", config.num_hidden_layers)
                          : "")
                  << ", version " << req.version() << ", " << req.params_size() << " params (" << param_bytes
                  << " bytes in " << segments << " shm segment(s), " << device_params << " on a CUDA device); staging "
                  << staging_bytes << " bytes in " << staging_where << (keep_staging ? " (kept)" : "")
                  << (catch_up ? absl::StrCat("; it holds version ", staged, ": catching the engine up to it") : "");
  Registered r;
  r.client = engine_->client;
  r.catch_up = catch_up;
  r.staged = staged;
  if (membership_) {
    membership_->Update(JoinFor(req, address, ep));
    r.membership = membership_;
  }
  return r;
}

// --- Reading the engine's memory -----------------------------------------------------------------

absl::Status RolloutAgent::EngineChecksums(v1::EngineChecksumsReply* reply) {
  absl::ReaderMutexLock mem(&memory_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (engine_ == nullptr) return absl::FailedPreconditionError("EngineChecksums: no engine has registered yet");
    const v1::RegisterEngineRequest& info = engine_->info;
    reply->set_engine_id(info.engine_id());
    reply->set_tp_size(info.tp_size());
    reply->set_tp_rank(info.tp_rank());
    reply->set_ep_size(info.ep_size());
    reply->set_model_config_json(info.model_config_json());
    reply->set_quantization_config_json(info.quantization_config_json());
    reply->set_version(version_);
  }
  // engine_ cannot change while memory_mu_ is held.
  const std::vector<engine_model::EngineBuffer>& buffers = engine_->memory->weights().buffers();
  ASSIGN_OR_RETURN(const std::vector<uint64_t> sums, engine_->memory->weights().Checksums());
  for (size_t i = 0; i < buffers.size(); ++i) {
    v1::ParamChecksum* p = reply->add_params();
    p->set_name(buffers[i].name);
    p->set_xxh3_64(sums[i]);
    p->set_nbytes(buffers[i].nbytes);
  }
  return absl::OkStatus();
}

absl::Status RolloutAgent::ReadEngine(const std::function<bool(const v1::EngineChunk&)>& write) {
  absl::ReaderMutexLock mem(&memory_mu_);  // no commit while the engine is read: one version
  uint64_t version = 0;
  std::string who;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("ReadEngine: the rollout agent is shutting down");
    if (engine_ == nullptr) return absl::FailedPreconditionError("ReadEngine: no engine has registered here");
    version = version_;
    who = absl::StrCat("ReadEngine of engine ", engine_->info.engine_id(), " tp ", engine_->info.tp_rank());
  }
  // engine_ cannot change while memory_mu_ is held. Device params are copied to the host a chunk at
  // a time.
  const std::vector<engine_model::EngineBuffer>& buffers = engine_->memory->weights().buffers();
  Buffer host_chunk;
  v1::EngineChunk c;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const engine_model::EngineBuffer& b = buffers[i];
    const MemorySpace space = b.on_device() ? MemorySpace::Cuda(b.cuda_device) : MemorySpace::Host();
    if (!space.host() && host_chunk.size() == 0) {
      ASSIGN_OR_RETURN(host_chunk, Buffer::Allocate(kStagingChunk));
    }
    size_t off = 0;
    do {
      const size_t n = std::min(kStagingChunk, b.nbytes - off);
      const std::byte* src = static_cast<const std::byte*>(b.data) + off;
      if (!space.host()) {
        RETURN_IF_ERROR(Annotate(space.CopyToHost(host_chunk.data(), src, n),
                                 absl::StrCat(who, ": reading ", b.name, " in ", space.Name())));
        src = host_chunk.data();
      }
      c.Clear();
      c.set_param(static_cast<uint32_t>(i));
      if (off == 0) {
        c.set_name(b.name);
        c.set_dtype(std::string(SafetensorsName(b.dtype)));
        for (int64_t d : b.shape) c.add_shape(d);
        c.set_nbytes(b.nbytes);
      }
      c.set_offset(off);
      c.set_data(src, n);
      c.set_version(version);
      off += n;
      if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
    } while (off < b.nbytes);
  }
  c.Clear();
  c.set_last(true);
  c.set_version(version);
  if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
  return absl::OkStatus();
}

}  // namespace wsync::rollout_agent
