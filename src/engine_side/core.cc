#include "engine_side/core.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status.h"

namespace wsync::engine_side {

// The command rank 0 broadcasts to the other ranks.
struct EngineCore::Header {
  static constexpr uint32_t kMagic = 0x57454e47;  // "WENG"
  static constexpr uint32_t kHeartbeat = 1, kGenerate = 2, kShutdown = 3;
  uint32_t magic = kMagic;
  uint32_t type = 0;
  uint64_t seq = 0;
  uint32_t prompt_len = 0;
  uint32_t max_new_tokens = 0;
  uint64_t reserved = 0;
};

namespace {

constexpr absl::Duration kRetryPeriod = absl::Milliseconds(20);
constexpr absl::Duration kPollPeriod = absl::Milliseconds(100);

const char* AdmitName(int32_t a) {
  switch (a) {
    case 0: return "ready";
    case 1: return "paused (HOLD) or preparing new weights";
    case 2: return "paused for a weight sync (ABORT)";
    case 3: return "holding no weights";
    case 4: return "unhealthy";
    case 5: return "shutting down";
  }
  return "in an unknown state";
}

}  // namespace

absl::string_view HealthStateName(HealthInfo::State s) {
  switch (s) {
    case HealthInfo::State::kServing: return "SERVING";
    case HealthInfo::State::kPaused: return "PAUSED";
    case HealthInfo::State::kNoWeights: return "NO_WEIGHTS";
    case HealthInfo::State::kUnhealthy: return "UNHEALTHY";
  }
  return "?";
}

EngineCore::EngineCore(ModelConfig config, EngineRank rank, EngineCoreOptions options)
    : config_(std::move(config)), rank_(rank), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<EngineCore>> EngineCore::Create(const ModelConfig& config, EngineRank rank,
                                                               const ModelFactory& make_model,
                                                               EngineCoreOptions options) {
  auto core = std::unique_ptr<EngineCore>(new EngineCore(config, rank, std::move(options)));
  EngineCore* self = core.get();
  TpCollectives coll;
  if (rank.tp_size > 1) {
    coll.all_reduce_sum = [self](absl::Span<float> data) {
      return self->Collective(self->comm_->AllReduceSum(data, {self->options_.collective_timeout}));
    };
    coll.all_gather = [self](absl::Span<const float> local, absl::Span<float> gathered) {
      comm::ConstBytes in{local.data(), local.size() * sizeof(float)};
      comm::MutableBytes out{gathered.data(), gathered.size() * sizeof(float)};
      return self->Collective(self->comm_->AllGather({&in, 1}, {&out, 1}, {self->options_.collective_timeout}));
    };
    absl::MutexLock lock(&core->mu_);
    core->group_ = Group::kForming;
    core->group_detail_ = "the TP group is forming (waiting for every rank to join)";
  }
  ASSIGN_OR_RETURN(core->model_, make_model(std::move(coll)));
  if (core->model_ == nullptr) return absl::InvalidArgumentError("EngineCore::Create: no model");
  return core;
}

absl::StatusOr<std::unique_ptr<EngineCore>> EngineCore::Create(const ModelConfig& config, EngineRank rank,
                                                               std::unique_ptr<ServedModel> model,
                                                               EngineCoreOptions options) {
  if (rank.tp_size != 1 || rank.tp_rank != 0)
    return absl::InvalidArgumentError(absl::StrCat("engine ", options.engine_id, ": tp rank ", rank.tp_rank, "/",
                                                   rank.tp_size, ": an engine behind an adapter serves TP 1 only"));
  if (model == nullptr) return absl::InvalidArgumentError("EngineCore::Create: no model");
  auto core = std::unique_ptr<EngineCore>(new EngineCore(config, rank, std::move(options)));
  core->model_ = std::move(model);
  return core;
}

EngineCore::~EngineCore() { Shutdown(); }

absl::Status EngineCore::PrepareInitial(uint64_t version, std::string source) {
  RETURN_IF_ERROR(model_->Prepare(version));
  absl::MutexLock lock(&mu_);
  weights_ = Weights::kReady;
  version_ = version;
  weights_detail_ = std::move(source);
  return absl::OkStatus();
}

void EngineCore::AttachGroup(std::unique_ptr<comm::Communicator> comm, std::string leader_address) {
  {
    absl::MutexLock channel(&channel_mu_);
    comm_ = std::move(comm);
    seq_ = 0;
    last_send_ = absl::Now();
  }
  {
    absl::MutexLock lock(&mu_);
    leader_address_ = std::move(leader_address);
    if (group_ == Group::kForming || group_ == Group::kBroken) {
      group_ = Group::kReady;
      group_detail_.clear();
    }
    cv_.SignalAll();
  }
  if (rank_.tp_rank == 0) {
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  } else {
    follower_ = std::thread([this] { FollowerLoop(); });
  }
}

void EngineCore::GroupFailed(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  group_ = Group::kForming;
  group_detail_ = absl::StrCat("the TP group could not be formed (still trying): ", status.ToString());
  cv_.SignalAll();
}

bool EngineCore::AwaitBroken(const std::function<bool()>& cancelled, absl::Status* why) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (stopping_) return false;
    if (group_ == Group::kBroken) {
      *why = broken_by_;
      return true;
    }
    if (cancelled && cancelled()) return false;
    cv_.WaitWithTimeout(&mu_, kPollPeriod);
  }
}

void EngineCore::DetachGroup(const absl::Status& why) {
  if (comm_) comm_->Abort(absl::StrCat("tp rank ", rank_.tp_rank, " is re-forming the TP group"));
  if (heartbeat_.joinable()) heartbeat_.join();
  if (follower_.joinable()) follower_.join();
  {
    absl::MutexLock channel(&channel_mu_);  // a request that was using the group has failed by now
    if (comm_) {
      absl::Status s = comm_->Shutdown();
      if (!s.ok()) WSYNC_LOG(DEBUG) << "TP group shutdown: " << s;
      comm_.reset();
    }
  }
  absl::MutexLock lock(&mu_);
  if (group_ == Group::kBroken) {
    group_ = Group::kForming;
    group_detail_ =
        absl::StrCat("the TP group is re-forming (waiting for every rank to join) after it broke: ", why.ToString());
  }
  cv_.SignalAll();
}

void EngineCore::SetShutdownCallback(std::function<void()> callback) {
  absl::MutexLock lock(&mu_);
  shutdown_callback_ = std::move(callback);
}

std::string EngineCore::WhereLocked() const {
  return absl::StrCat("engine ", options_.engine_id, " tp rank ", rank_.tp_rank, "/", rank_.tp_size);
}

void EngineCore::MarkBroken(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (group_ == Group::kBroken || stopping_) return;
  group_ = Group::kBroken;
  broken_by_ = status;
  group_detail_ = absl::StrCat("the TP group is broken (it re-forms once every rank is back): ", status.ToString());
  WSYNC_LOG(ERROR) << WhereLocked() << ": " << group_detail_;
  cv_.SignalAll();
}

absl::Status EngineCore::Collective(absl::StatusOr<std::unique_ptr<comm::Work>> work) {
  absl::Status s = comm::Await(std::move(work));
  if (!s.ok()) MarkBroken(s);
  return s;
}

EngineCore::Admit EngineCore::TryAdmitLocked() {
  if (stopping_) return kStopping;
  if (group_ == Group::kBroken || group_ == Group::kForming || weights_ == Weights::kBad) return kUnhealthy;
  if (paused_) return mode_ == PauseMode::kAbort ? kAbort : kHold;
  if (preparing_) return kHold;
  if (weights_ == Weights::kNone) return kNoWeights;
  ++in_flight_;
  return kOk;
}

int32_t EngineCore::StopFlag() const {
  absl::MutexLock lock(&mu_);
  if (stopping_) return 2;
  return paused_ && mode_ == PauseMode::kAbort ? 1 : 0;
}

absl::Status EngineCore::RequestStopped() const {
  const int32_t flag = StopFlag();
  if (flag == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("engine ", options_.engine_id, ": request aborted: ",
                                             flag == 2 ? "shutting down" : "paused for a weight sync (ABORT)"));
}

void EngineCore::Release() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
  cv_.SignalAll();
}

absl::Status EngineCore::Refusal(Admit admit, int tp_rank) const {
  const std::string who = tp_rank == rank_.tp_rank ? WhereLocked() : absl::StrCat(WhereLocked(), ": tp rank ", tp_rank);
  switch (admit) {
    case kAbort: return absl::UnavailableError(absl::StrCat(who, " is paused for a weight sync (ABORT)"));
    case kNoWeights:
      return absl::FailedPreconditionError(absl::StrCat(who, " holds no weights yet (waiting for the first sync)"));
    case kUnhealthy:
      if (tp_rank == rank_.tp_rank) {
        return absl::UnavailableError(absl::StrCat(
            who,
            " is unhealthy: ", group_ != Group::kReady && group_ != Group::kSingle ? group_detail_ : weights_detail_));
      }
      return absl::UnavailableError(absl::StrCat(who, " is unhealthy"));
    case kStopping: return absl::UnavailableError(absl::StrCat(who, " is shutting down"));
    default: return absl::InternalError(absl::StrCat(who, " refused in state ", AdmitName(admit)));
  }
}

absl::StatusOr<std::vector<int32_t>> EngineCore::Compute(absl::Span<const int32_t> prompt, int max_new_tokens) {
  const int T = rank_.tp_size;
  ServedModel::StepHook hook = [this, T](int) -> absl::Status {
    if (options_.step_delay > absl::ZeroDuration()) absl::SleepFor(options_.step_delay);
    const int32_t flag = StopFlag();
    std::vector<int32_t> flags(static_cast<size_t>(T), flag);
    if (T > 1) {
      comm::ConstBytes in{&flag, sizeof(flag)};
      comm::MutableBytes out{flags.data(), flags.size() * sizeof(int32_t)};
      RETURN_IF_ERROR(Collective(comm_->AllGather({&in, 1}, {&out, 1}, {options_.collective_timeout})));
    }
    for (int r = 0; r < T; ++r) {
      if (flags[static_cast<size_t>(r)] == 0) continue;
      return absl::UnavailableError(absl::StrCat(
          "engine ", options_.engine_id, ": request aborted: tp rank ", r,
          flags[static_cast<size_t>(r)] == 2 ? " is shutting down" : " was paused for a weight sync (ABORT)"));
    }
    return absl::OkStatus();
  };
  return model_->Generate(prompt, max_new_tokens, hook);
}

absl::Status EngineCore::SendHeader(uint32_t type, uint32_t prompt_len, uint32_t max_new, absl::Duration timeout) {
  Header h;
  h.type = type;
  h.seq = ++seq_;
  h.prompt_len = prompt_len;
  h.max_new_tokens = max_new;
  comm::MutableBytes b{&h, sizeof(h)};
  last_send_ = absl::Now();
  return Collective(comm_->Broadcast({&b, 1}, 0, {timeout}));
}

absl::StatusOr<std::vector<EngineCore::RankStatus>> EngineCore::Agree(RankStatus mine) {
  std::vector<RankStatus> all(static_cast<size_t>(rank_.tp_size));
  comm::ConstBytes in{&mine, sizeof(mine)};
  comm::MutableBytes out{all.data(), all.size() * sizeof(RankStatus)};
  RETURN_IF_ERROR(Collective(comm_->AllGather({&in, 1}, {&out, 1}, {options_.collective_timeout})));
  return all;
}

// One attempt of rank 0 (admitted locally, `version` served): broadcast, agree, compute. Sets
// *retry (and *versions_differ) when the request should wait and be tried again.
absl::StatusOr<GenerateResult> EngineCore::LeaderRound(absl::Span<const int32_t> prompt, int max_new_tokens,
                                                       uint64_t version, bool* retry, bool* versions_differ) {
  *retry = false;
  *versions_differ = false;
  absl::MutexLock channel(&channel_mu_);
  RETURN_IF_ERROR(SendHeader(Header::kGenerate, static_cast<uint32_t>(prompt.size()),
                             static_cast<uint32_t>(max_new_tokens), options_.collective_timeout));
  std::vector<int32_t> copy(prompt.begin(), prompt.end());
  comm::MutableBytes pb{copy.data(), copy.size() * sizeof(int32_t)};
  RETURN_IF_ERROR(Collective(comm_->Broadcast({&pb, 1}, 0, {options_.collective_timeout})));
  ASSIGN_OR_RETURN(std::vector<RankStatus> all, Agree(RankStatus{kOk, 0, version}));
  bool ok = true, same = true;
  for (const RankStatus& s : all) {
    ok = ok && s.admit == kOk;
    same = same && s.version == all[0].version;
  }
  if (ok && same) {
    ASSIGN_OR_RETURN(std::vector<int32_t> tokens, Compute(prompt, max_new_tokens));
    return GenerateResult{std::move(tokens), version};
  }
  // Nobody computes. Decide whether to wait or to fail.
  for (int r = 0; r < rank_.tp_size; ++r) {
    const Admit a = static_cast<Admit>(all[static_cast<size_t>(r)].admit);
    if (a == kAbort || a == kNoWeights || a == kUnhealthy || a == kStopping) {
      absl::MutexLock lock(&mu_);
      return Refusal(a, r);
    }
  }
  *retry = true;
  *versions_differ = ok;
  std::vector<std::string> parts;
  for (int r = 0; r < rank_.tp_size; ++r) {
    const RankStatus& s = all[static_cast<size_t>(r)];
    parts.push_back(s.admit == kOk ? absl::StrCat("rank ", r, ": version ", s.version)
                                   : absl::StrCat("rank ", r, ": ", AdmitName(s.admit)));
  }
  return absl::UnavailableError(absl::StrCat(ok ? "the TP ranks hold different weight versions" : "a TP rank is held",
                                             " [", absl::StrJoin(parts, ", "), "]"));
}

absl::StatusOr<GenerateResult> EngineCore::Generate(absl::Span<const int32_t> prompt, int64_t max_new_tokens,
                                                    absl::Time deadline, const std::function<bool()>& cancelled) {
  std::string where;
  {
    absl::MutexLock lock(&mu_);
    where = WhereLocked();
    if (rank_.tp_rank != 0) {
      return absl::FailedPreconditionError(absl::StrCat(where, " does not take Generate: send it to tp rank 0",
                                                        leader_address_.empty() ? "" : " at ", leader_address_));
    }
  }
  if (prompt.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": empty prompt"));
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= config_.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(where, ": prompt token ", i, " is ", prompt[i],
                                                     ", not in [0, vocab_size ", config_.vocab_size, ")"));
  }
  if (max_new_tokens < 0 || static_cast<int64_t>(prompt.size()) + max_new_tokens > config_.max_position_embeddings)
    return absl::InvalidArgumentError(absl::StrCat(where, ": prompt of ", prompt.size(), " tokens + max_new_tokens ",
                                                   max_new_tokens, " exceed max_position_embeddings ",
                                                   config_.max_position_embeddings));
  const int max_new = static_cast<int>(max_new_tokens);
  const absl::Time start = absl::Now();
  const absl::Time hold_until = std::min(deadline, start + options_.hold_timeout);
  absl::Time versions_differ_since = absl::InfiniteFuture();
  std::string held_by = "this rank is paused (HOLD) or preparing new weights";
  for (;;) {
    uint64_t version = 0;
    {
      absl::MutexLock lock(&mu_);
      ASSIGN_OR_RETURN(version, AdmitWaiting(where, start, hold_until, deadline, cancelled, held_by));
    }
    if (rank_.tp_size == 1) {
      absl::StatusOr<std::vector<int32_t>> tokens = Compute(prompt, max_new);
      Release();
      if (!tokens.ok()) return tokens.status();
      return GenerateResult{*std::move(tokens), version};
    }
    bool retry = false, versions_differ = false;
    absl::StatusOr<GenerateResult> result = LeaderRound(prompt, max_new, version, &retry, &versions_differ);
    Release();
    if (!retry) return result;
    // A peer is held or on another version: wait (without holding anything) and try again.
    const std::string reason(result.status().message());
    const absl::Time now = absl::Now();
    if (versions_differ) {
      if (versions_differ_since == absl::InfiniteFuture()) versions_differ_since = now;
      if (now - versions_differ_since > options_.version_wait)
        return absl::UnavailableError(
            absl::StrCat(where, ": ", reason, " for longer than ", absl::FormatDuration(options_.version_wait)));
    } else {
      versions_differ_since = absl::InfiniteFuture();
    }
    held_by = reason;
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat(where, ": the caller went away while held"));
    if (now >= hold_until) {
      const std::string msg =
          absl::StrCat(where, ": held for ", absl::FormatDuration(now - start), " (", reason, "); giving up");
      return now >= deadline ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
    }
    absl::MutexLock lock(&mu_);
    cv_.WaitWithDeadline(&mu_, std::min(hold_until, now + kRetryPeriod));
  }
}

absl::StatusOr<uint64_t> EngineCore::AdmitWaiting(const std::string& where, absl::Time start, absl::Time hold_until,
                                                  absl::Time deadline, const std::function<bool()>& cancelled,
                                                  const std::string& held_by) {
  Admit a;
  while ((a = TryAdmitLocked()) == kHold) {
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat(where, ": the caller went away while held"));
    const absl::Time now = absl::Now();
    if (now >= hold_until) {
      const std::string msg =
          absl::StrCat(where, ": held for ", absl::FormatDuration(now - start), " (", held_by, "); giving up");
      return now >= deadline ? absl::DeadlineExceededError(msg) : absl::UnavailableError(msg);
    }
    cv_.WaitWithDeadline(&mu_, std::min(hold_until, now + kPollPeriod));
  }
  if (a != kOk) return Refusal(a, rank_.tp_rank);
  return version_;
}

absl::StatusOr<uint64_t> EngineCore::BeginRequest(absl::Time deadline, const std::function<bool()>& cancelled) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  if (rank_.tp_size != 1)
    return absl::FailedPreconditionError(
        absl::StrCat(WhereLocked(), ": BeginRequest serves TP 1 only (Generate runs the TP protocol)"));
  return AdmitWaiting(WhereLocked(), start, std::min(deadline, start + options_.hold_timeout), deadline, cancelled,
                      "this rank is paused (HOLD) or preparing new weights");
}

void EngineCore::HoldForCatchUp(uint64_t v) {
  absl::MutexLock lock(&mu_);
  if (v > version_ && !paused_ && !preparing_) {
    WSYNC_LOG(INFO) << WhereLocked() << ": holding requests until the rollout agent commits version " << v
                    << " (serving " << version_ << ")";
    paused_ = held_for_catch_up_ = true;
    mode_ = PauseMode::kHold;
  } else if (v <= version_ && held_for_catch_up_) {
    WSYNC_LOG(INFO) << WhereLocked() << ": no catch-up due; serving version " << version_;
    paused_ = held_for_catch_up_ = false;
    cv_.SignalAll();
  }
}

uint32_t EngineCore::Pause(PauseMode mode) {
  uint32_t in_flight = 0;
  {
    absl::MutexLock lock(&mu_);
    held_for_catch_up_ = false;
    if (!paused_ || mode_ != mode)
      WSYNC_LOG(INFO) << WhereLocked() << ": paused (" << (mode == PauseMode::kAbort ? "ABORT" : "HOLD") << "), "
                      << in_flight_ << " request(s) in flight";
    paused_ = true;
    mode_ = mode;
    cv_.SignalAll();
    in_flight = in_flight_;
  }
  if (absl::Status s = model_->OnPause(mode); !s.ok())
    WSYNC_LOG(WARNING) << "engine " << options_.engine_id << ": the model's pause hook: " << s;
  return in_flight;
}

absl::Status EngineCore::Flush() {
  absl::MutexLock lock(&mu_);
  if (in_flight_ > 0)
    return absl::FailedPreconditionError(
        absl::StrCat(WhereLocked(), ": cannot flush, ", in_flight_, " request(s) still running"));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> EngineCore::Continue(uint64_t version, absl::Time deadline) {
  ASSIGN_OR_RETURN(const uint64_t served, ContinueServing(version, deadline));
  RETURN_IF_ERROR(Annotate(model_->OnContinue(served), absl::StrCat("engine ", options_.engine_id, ": resuming")));
  return served;
}

absl::StatusOr<uint64_t> EngineCore::ContinueServing(uint64_t version, absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError(absl::StrCat(WhereLocked(), " is shutting down"));
    if (group_ == Group::kBroken) {
      paused_ = false;
      cv_.SignalAll();
      return absl::UnavailableError(absl::StrCat(WhereLocked(), ": ", group_detail_));
    }
    if (preparing_)
      return absl::FailedPreconditionError(absl::StrCat(WhereLocked(), ": another Continue is preparing weights"));
    const bool need = weights_ == Weights::kBad || (weights_ == Weights::kReady && version != version_) ||
                      (weights_ == Weights::kNone && version != 0);
    held_for_catch_up_ = false;
    if (!need) {
      if (paused_) WSYNC_LOG(INFO) << WhereLocked() << ": continuing on version " << version_;
      paused_ = false;
      cv_.SignalAll();
      return version_;
    }
    preparing_ = true;  // admits nothing new from here on
    while (in_flight_ > 0) {
      if (cv_.WaitWithDeadline(&mu_, deadline) && in_flight_ > 0) {
        preparing_ = false;
        cv_.SignalAll();
        return absl::DeadlineExceededError(absl::StrCat(WhereLocked(), ": ", in_flight_,
                                                        " request(s) still running; cannot prepare version ", version));
      }
    }
  }
  const absl::Time start = absl::Now();
  absl::Status s = model_->Prepare(version);
  absl::MutexLock lock(&mu_);
  preparing_ = false;
  paused_ = false;
  cv_.SignalAll();
  if (!s.ok()) {
    weights_ = Weights::kBad;
    weights_detail_ = absl::StrCat("the weights of version ", version, " failed to prepare: ", s.ToString());
    WSYNC_LOG(ERROR) << WhereLocked() << ": " << weights_detail_;
    return Annotate(s, absl::StrCat(WhereLocked(), ": preparing version ", version));
  }
  weights_ = Weights::kReady;
  WSYNC_LOG(INFO) << WhereLocked() << ": serving version " << version << " (was "
                  << (weights_detail_.empty() ? "none" : absl::StrCat(version_)) << "), prepared in "
                  << absl::FormatDuration(absl::Now() - start);
  version_ = version;
  weights_detail_ = absl::StrCat("version ", version, " from the rollout agent");
  return version_;
}

HealthInfo EngineCore::Health() const {
  absl::MutexLock lock(&mu_);
  HealthInfo h;
  h.version = version_;
  h.in_flight = in_flight_;
  if (stopping_) {
    h.state = HealthInfo::State::kUnhealthy;
    h.detail = "shutting down";
  } else if (group_ == Group::kBroken || group_ == Group::kForming) {
    h.state = HealthInfo::State::kUnhealthy;
    h.detail = group_detail_;
  } else if (weights_ == Weights::kBad) {
    h.state = HealthInfo::State::kUnhealthy;
    h.detail = weights_detail_;
  } else if (paused_ || preparing_) {
    h.state = HealthInfo::State::kPaused;
    h.detail = preparing_ ? "preparing new weights" : mode_ == PauseMode::kAbort ? "paused (ABORT)" : "paused (HOLD)";
  } else if (weights_ == Weights::kNone) {
    h.state = HealthInfo::State::kNoWeights;
    h.detail = "no weights: waiting for the first sync";
  } else {
    h.state = HealthInfo::State::kServing;
    h.detail = absl::StrCat("serving version ", version_, " (", weights_detail_, ")");
  }
  return h;
}

uint64_t EngineCore::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

void EngineCore::HeartbeatLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_ || group_ == Group::kBroken) return;
      cv_.WaitWithTimeout(&mu_, options_.heartbeat / 2);
      if (stopping_ || group_ == Group::kBroken) return;
    }
    if (!channel_mu_.TryLock()) continue;  // a request is using the channel: that is traffic enough
    if (absl::Now() - last_send_ >= options_.heartbeat) {
      absl::Status s = SendHeader(Header::kHeartbeat, 0, 0, options_.collective_timeout);
      if (!s.ok()) WSYNC_LOG(ERROR) << "heartbeat to the TP ranks failed: " << s;
    }
    channel_mu_.Unlock();
  }
}

void EngineCore::FollowerLoop() {
  uint64_t expected_seq = 1;
  for (;;) {
    Header h;
    comm::MutableBytes hb{&h, sizeof(h)};
    absl::Status s = comm::Await(comm_->Broadcast({&hb, 1}, 0, {options_.idle_timeout}));
    if (!s.ok()) {
      bool stopping;
      {
        absl::MutexLock lock(&mu_);
        stopping = stopping_;
      }
      if (!stopping) MarkBroken(Annotate(s, "waiting for a command from tp rank 0"));
      return;
    }
    if (h.magic != Header::kMagic || h.seq != expected_seq) {
      MarkBroken(absl::DataLossError(absl::StrCat("tp rank 0 sent command ", h.type, " seq ", h.seq, " magic ", h.magic,
                                                  "; expected seq ", expected_seq)));
      return;
    }
    ++expected_seq;
    if (h.type == Header::kHeartbeat) continue;
    if (h.type == Header::kShutdown) {
      std::function<void()> cb;
      {
        absl::MutexLock lock(&mu_);
        WSYNC_LOG(INFO) << WhereLocked() << ": tp rank 0 shut the engine down";
        cb = shutdown_callback_;
      }
      if (cb) cb();
      return;
    }
    if (h.type != Header::kGenerate) {
      MarkBroken(absl::DataLossError(absl::StrCat("tp rank 0 sent an unknown command ", h.type)));
      return;
    }
    std::vector<int32_t> prompt(h.prompt_len);
    comm::MutableBytes pb{prompt.data(), prompt.size() * sizeof(int32_t)};
    if (!Collective(comm_->Broadcast({&pb, 1}, 0, {options_.collective_timeout})).ok()) return;
    RankStatus mine;
    {
      absl::MutexLock lock(&mu_);
      mine.admit = TryAdmitLocked();
      mine.version = version_;
    }
    absl::StatusOr<std::vector<RankStatus>> all = Agree(mine);
    bool go = all.ok();
    if (go) {
      for (const RankStatus& st : *all) go = go && st.admit == kOk && st.version == (*all)[0].version;
    }
    if (go) {
      absl::StatusOr<std::vector<int32_t>> tokens = Compute(prompt, static_cast<int>(h.max_new_tokens));
      if (!tokens.ok()) WSYNC_LOG(WARNING) << "request " << h.seq << " failed on this rank: " << tokens.status();
    }
    if (mine.admit == kOk) Release();
    if (!all.ok()) return;
  }
}

void EngineCore::Shutdown() {
  if (shut_down_.exchange(true)) return;
  bool leader_ready = false;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    leader_ready = rank_.tp_rank == 0 && group_ == Group::kReady;
    cv_.SignalAll();
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (leader_ready && comm_) {
    absl::MutexLock channel(&channel_mu_);  // a running request stops at its next step
    absl::Status s = SendHeader(Header::kShutdown, 0, 0, absl::Seconds(5));
    if (!s.ok()) WSYNC_LOG(WARNING) << "could not tell the TP ranks to shut down: " << s;
  }
  if (comm_ && rank_.tp_rank != 0) comm_->Abort("the engine rank is shutting down");
  if (follower_.joinable()) follower_.join();
  if (comm_) {
    absl::Status s = comm_->Shutdown();
    if (!s.ok() && rank_.tp_rank == 0) WSYNC_LOG(DEBUG) << "TP group shutdown: " << s;
  }
}

}  // namespace wsync::engine_side
