// RolloutAgent, catch-up: committing the staging into the engine outside a sync (CommitStaging,
// CatchUp: roll forward, a restarted engine), the layout key, and the copy of a staging between
// peer agents (ServeStaging served, FetchFrom / FetchFromPeers asked).

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <span>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "engine_model/engine_layout.h"
#include "engine_model/repack.h"
#include "rollout_agent/agent/membership.h"
#include "rollout_agent/agent/rollout_agent.h"
#include "rollout_agent/agent/rollout_agent_state.h"

namespace wsync::rollout_agent {

absl::Status RolloutAgent::CommitStaging(Engine& e, uint64_t version) {
  absl::MutexLock mem(&memory_mu_);
  absl::Status st =
      engine_model::Commit(*e.staging, e.memory->weights(), {.num_threads = options_.repack_threads, .verify = false});
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    version_ = version;  // wakes UpdateWeights waiters
  }
  return st;
}

void RolloutAgent::CatchUp() {
  absl::MutexLock op(&op_mu_);
  uint64_t owed = 0, current = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || sync_ != nullptr || engine_ == nullptr || owed_version_ <= version_) return;
    owed = owed_version_;
    current = version_;
  }
  Engine& e = *engine_;
  const std::string who = absl::StrCat("rolling forward to version ", owed, " (from ", current, ")");
  auto retry_later = [&](const absl::Status& st) {
    absl::MutexLock lock(&mu_);
    const int n = catch_up_failures_++;
    next_catch_up_ = absl::Now() + std::min(absl::Seconds(1) * (1 << std::min(n, 4)), absl::Seconds(10));
    if (n % 10 == 0) WSYNC_LOG(WARNING) << who << ": " << st << " (retrying; attempt " << n + 1 << ")";
  };
  auto paused = e.client->Pause(v1::PauseRequest::HOLD);
  if (!paused.ok()) return retry_later(paused.status());
  auto flushed = e.client->Flush(absl::Now() + options_.flush_deadline, [] { return false; });
  absl::Status st = flushed.status();
  if (st.ok()) st = CommitStaging(e, owed);
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    owed_version_ = 0;
    catch_up_failures_ = 0;
    if (promised_version_ <= owed) promised_version_ = 0;
  }
  if (!st.ok()) {
    if (absl::IsInternal(st)) {  // possibly partly written: the engine stays paused, the next try rewrites it
      WSYNC_LOG(ERROR) << who << ": the commit failed after validation; the engine stays paused: " << st;
      return retry_later(st);
    }
    auto cont = e.client->Continue(current);
    if (!cont.ok())
      WSYNC_LOG(ERROR) << who << ": continuing the engine on version " << current << ": " << cont.status();
    return retry_later(st);
  }
  m_->version->Set(static_cast<double>(owed));
  if (membership_) membership_->SetVersion(owed);
  auto cont = e.client->Continue(owed);
  if (!cont.ok()) {
    WSYNC_LOG(ERROR) << who << ": committed, but the engine did not continue: " << cont.status();
    return;
  }
  WSYNC_LOG(INFO) << who << ": committed from the staging; the engine serves version " << owed
                  << " as the other engines do";
}

// --- Catch-up from a peer ---------------------------------------------------------------------------

namespace {

uint64_t HashOf(const std::string& key) {
  return Xxh3_64(std::as_bytes(std::span<const char>(key.data(), key.size())));
}

}  // namespace

std::string LayoutKey(const v1::RegisterEngineRequest& req) {
  return absl::StrCat(req.model_config_json(), "\n--\n", req.quantization_config_json(), "\n--\n", req.tp_size(), "/",
                      req.tp_rank(), "/", std::max<uint32_t>(req.ep_size(), 1),
                      ServesMtpDraft(req) ? "/mtp-draft" : "");
}

bool ServesMtpDraft(const v1::RegisterEngineRequest& req) {
  return std::any_of(req.params().begin(), req.params().end(),
                     [](const v1::EngineParam& p) { return engine_model::IsMtpDraftParam(p.name()); });
}

uint64_t LayoutKeyHash(const v1::RegisterEngineRequest& req) { return HashOf(LayoutKey(req)); }

absl::Status RolloutAgent::ServeStaging(const v1::FetchStagingRequest& req,
                                        const std::function<bool(const v1::StagingChunk&)>& write) {
  absl::ReaderMutexLock staging(&staging_mu_);
  const engine_model::Staging* st = nullptr;
  std::string who;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("FetchStaging: the rollout agent is shutting down");
    if (engine_ == nullptr) return absl::FailedPreconditionError("FetchStaging: no engine has registered here");
    const v1::RegisterEngineRequest& info = engine_->info;
    who = absl::StrCat("FetchStaging(version ", req.version(), ") from engine ", info.engine_id(), " tp ",
                       info.tp_rank(), "/", info.tp_size(), " ep ", info.ep_size());
    if (HashOf(engine_->layout_key) != req.layout_key())
      return absl::FailedPreconditionError(absl::StrCat(
          who, ": the caller's engine rank has another layout (model config, quantization, TP rank / size, EP)"));
    if (staged_version_ != req.version() || version_ != req.version())
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": the staging holds ",
                       staged_version_ == 0 ? "no complete version" : absl::StrCat("version ", staged_version_),
                       " and the engine version ", version_));
    st = engine_->staging.get();
    if (st == nullptr) return absl::UnavailableError(absl::StrCat(who, ": the engine is being replaced"));
  }
  // The staging cannot change while staging_mu_ is held (a sync starting takes it exclusively).
  // A device staging's chunks are copied to the host one at a time.
  const auto& params = st->layout().params();
  const MemorySpace& space = st->space();
  Buffer host_chunk;
  if (!space.host()) {
    ASSIGN_OR_RETURN(host_chunk, Buffer::Allocate(kStagingChunk));
  }
  v1::StagingChunk c;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::span<const std::byte> bytes = st->param(static_cast<int>(i)).bytes();
    Xxh3Stream sum;
    size_t off = 0;
    do {
      const size_t n = std::min(kStagingChunk, bytes.size() - off);
      std::span<const std::byte> chunk = bytes.subspan(off, n);
      if (!space.host()) {
        RETURN_IF_ERROR(Annotate(space.CopyToHost(host_chunk.data(), chunk.data(), n),
                                 absl::StrCat(who, ": reading the staging in ", space.Name())));
        chunk = host_chunk.span().first(n);
      }
      c.Clear();
      c.set_param(static_cast<uint32_t>(i));
      c.set_offset(off);
      c.set_data(chunk.data(), n);
      sum.Update(chunk);
      off += n;
      if (off == bytes.size()) {
        c.set_param_done(true);
        c.set_xxh3_64(sum.Digest());
      }
      if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
    } while (off < bytes.size());
  }
  c.Clear();
  c.set_last(true);
  c.set_version(req.version());
  if (!write(c)) return absl::CancelledError(absl::StrCat(who, ": the caller went away"));
  return absl::OkStatus();
}

absl::Status RolloutAgent::FetchFrom(const std::string& peer, uint64_t version, Engine& e) {
  const std::string who = absl::StrCat("copying version ", version, " from the rollout agent at ", peer);
  engine_model::Staging& st = *e.staging;
  const auto& params = st.layout().params();
  const int64_t total = e.layout->TotalBytes(engine_model::ParamForm::kLoaded);
  auto stub = v1::RolloutAgent::NewStub(MakeChannel(peer, options_.security));
  grpc::ClientContext ctx;
  // Generous: a gRPC stream moves >= 0.5 GB/s even on a slow host.
  PrepareContext(&ctx, options_.security, absl::Seconds(30) + absl::Seconds(static_cast<double>(total) / 5e8));
  v1::FetchStagingRequest req;
  req.set_version(version);
  req.set_layout_key(HashOf(e.layout_key));
  absl::MutexLock staging(&staging_mu_);
  {
    absl::MutexLock lock(&mu_);
    staged_sync_id_ = staged_version_ = 0;  // the staging is being overwritten
    fetch_ctx_ = &ctx;                      // a BeginSync cancels the copy (it will write the staging)
  }
  struct Unregister {
    RolloutAgent* agent;
    ~Unregister() {
      absl::MutexLock lock(&agent->mu_);
      agent->fetch_ctx_ = nullptr;
    }
  } unregister{this};
  st.ForgetSums();  // the peer's bytes replace those the recorded sums were of
  std::unique_ptr<grpc::ClientReader<v1::StagingChunk>> reader = stub->FetchStaging(&ctx, req);
  // Each param's chunks are hashed as they arrive and copied into the staging's space (a device
  // staging: uploaded, then waited for once at the end).
  const MemorySpace& space = st.space();
  std::vector<uint64_t> got(params.size(), 0);
  std::vector<bool> param_done(params.size(), false);
  Xxh3Stream sum;
  size_t done = 0;
  bool last = false;
  absl::Status bad;
  v1::StagingChunk c;
  while (bad.ok() && !last && reader->Read(&c)) {
    if (c.last()) {
      last = c.version() == version;
      if (!last) bad = absl::DataLossError(absl::StrCat("the copy ended with version ", c.version()));
      break;
    }
    if (c.param() >= params.size()) {
      bad = absl::DataLossError(absl::StrCat("chunk of param ", c.param(), " of ", params.size()));
      break;
    }
    if (param_done[c.param()]) {
      bad = absl::DataLossError(absl::StrCat("a chunk of ", params[c.param()].name, " after its last one"));
      break;
    }
    const std::span<std::byte> dst = st.param(static_cast<int>(c.param())).bytes();
    uint64_t& at = got[c.param()];
    if (c.offset() != at || c.data().size() > dst.size() - at) {
      bad = absl::DataLossError(absl::StrCat("chunk at ", c.offset(), " of ", c.data().size(), " bytes of ",
                                             params[c.param()].name, " (", dst.size(), " bytes, ", at, " received)"));
      break;
    }
    if (at == 0) sum = Xxh3Stream();
    const auto data = std::as_bytes(std::span<const char>(c.data().data(), c.data().size()));
    if (absl::Status cp = space.Copy(dst.data() + at, data.data(), data.size()); !cp.ok()) {
      bad = Annotate(cp, absl::StrCat(params[c.param()].name, " into the staging in ", space.Name()));
      break;
    }
    sum.Update(data);
    at += c.data().size();
    if (c.param_done()) {
      if (at != dst.size()) {
        bad = absl::DataLossError(absl::StrCat(params[c.param()].name, ": ", at, " of ", dst.size(), " bytes"));
      } else if (sum.Digest() != c.xxh3_64()) {
        bad = absl::DataLossError(absl::StrCat(params[c.param()].name, ": checksum mismatch"));
      } else {
        param_done[c.param()] = true;
        ++done;
      }
    }
  }
  if (!bad.ok()) ctx.TryCancel();
  const absl::Status finished = FromGrpcStatus(reader->Finish());
  if (!bad.ok()) return Annotate(bad, who);
  if (!finished.ok()) return Annotate(finished, who);
  if (!last || done != params.size())
    return absl::DataLossError(absl::StrCat(who, ": the copy ended after ", done, " of ", params.size(), " params"));
  RETURN_IF_ERROR(Annotate(st.Synchronize(), absl::StrCat(who, ": into the staging in ", space.Name())));
  st.MarkAllRestored();
  absl::MutexLock lock(&mu_);
  staged_version_ = version;  // complete and verified: owed to the engine, and servable to others
  owed_version_ = version;
  next_catch_up_ = absl::Now();
  catch_up_failures_ = 0;
  return absl::OkStatus();
}

void RolloutAgent::FetchFromPeers(const v1::CatchUpHint& hint) {
  absl::MutexLock op(&op_mu_);
  uint64_t current = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || sync_ != nullptr || engine_ == nullptr || hint.version() <= version_) return;
    current = version_;
  }
  Engine& e = *engine_;
  const absl::Time start = absl::Now();
  std::vector<std::string> errors;
  for (const std::string& peer : hint.peers()) {
    absl::Status st = FetchFrom(peer, hint.version(), e);
    if (st.ok()) {
      const double s = absl::ToDoubleSeconds(absl::Now() - start);
      const int64_t bytes = e.layout->TotalBytes(engine_model::ParamForm::kLoaded);
      WSYNC_LOG(INFO) << "copied version " << hint.version() << " from the rollout agent at " << peer << ": " << bytes
                      << " bytes in " << absl::StrFormat("%.2f s (%.2f GB/s)", s, s > 0 ? bytes / s / 1e9 : 0.0)
                      << "; committing it into the engine";
      absl::MutexLock lock(&mu_);
      fetch_failures_ = 0;
      return;
    }
    errors.push_back(st.ToString());
  }
  if (hint.peers().empty()) errors.push_back("no agent of an engine rank with this layout reports that version");
  uint64_t promised = 0;
  {
    absl::MutexLock lock(&mu_);
    const int n = fetch_failures_++;
    next_fetch_ = absl::Now() + std::min(absl::Seconds(1) * (1 << std::min(n, 4)), absl::Seconds(10));
    if (n % 10 == 0)
      WSYNC_LOG(WARNING) << "catching up to version " << hint.version() << " from a peer failed (attempt " << n + 1
                         << "; retrying): " << absl::StrJoin(errors, "; ");
    std::swap(promised, promised_version_);
  }
  if (promised > 0) {  // the engine holds requests for it: let it serve what it has meanwhile
    auto cont = e.client->Continue(current);
    if (!cont.ok()) WSYNC_LOG(ERROR) << "continuing the engine on version " << current << ": " << cont.status();
  }
}

}  // namespace wsync::rollout_agent
