#include "rollout_agent/agent/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"

namespace wsync::rollout_agent {

Membership::Membership(std::string coordinator, const RpcSecurity& sec, absl::Duration heartbeat,
                       std::function<uint64_t()> staged)
    : coordinator_(std::move(coordinator)),
      sec_(sec),
      heartbeat_(std::max(heartbeat, absl::Milliseconds(10))),
      staged_(std::move(staged)),
      stub_(v1::Coordinator::NewStub(MakeChannel(coordinator_, sec_))) {
  thread_ = std::thread([this] { Run(); });
}

Membership::~Membership() {
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    id = agent_id_;
  }
  thread_.join();
  if (!id.empty()) {
    grpc::ClientContext ctx;
    PrepareContext(&ctx, sec_, RpcTimeout());
    v1::LeaveRequest req;
    req.set_agent_id(id);
    v1::LeaveReply reply;
    const grpc::Status s = stub_->Leave(&ctx, req, &reply);
    if (!s.ok()) WSYNC_LOG(WARNING) << "leaving the coordinator at " << coordinator_ << ": " << s.error_message();
  }
}

absl::Duration Membership::RpcTimeout() const { return std::clamp(heartbeat_, absl::Seconds(1), absl::Seconds(10)); }

void Membership::Update(const v1::JoinRequest& join) {
  absl::MutexLock lock(&mu_);
  join_ = join;
  have_join_ = true;
  need_join_ = true;
  ++update_seq_;
}

bool Membership::AwaitJoined(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const uint64_t want = update_seq_;
  auto joined = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return joined_seq_ >= want || stop_; };
  return mu_.AwaitWithTimeout(absl::Condition(&joined), timeout) && joined_seq_ >= want;
}

v1::CatchUpHint Membership::catch_up() const {
  absl::MutexLock lock(&mu_);
  return catch_up_;
}

void Membership::SetVersion(uint64_t version) {
  absl::MutexLock lock(&mu_);
  join_.set_version(version);
}

std::string Membership::agent_id() const {
  absl::MutexLock lock(&mu_);
  return agent_id_;
}

int Membership::joins() const {
  absl::MutexLock lock(&mu_);
  return joins_;
}

bool Membership::DoJoin(const v1::JoinRequest& join, uint64_t seq, absl::Duration* period) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, sec_, RpcTimeout());
  v1::JoinReply reply;
  const grpc::Status s = stub_->Join(&ctx, join, &reply);
  if (!s.ok()) {
    WSYNC_LOG(WARNING) << "joining the coordinator at " << coordinator_ << " failed: " << FromGrpcStatus(s)
                       << " (retrying every " << absl::FormatDuration(heartbeat_) << ")";
    return false;
  }
  *period = heartbeat_;
  if (reply.heartbeat_ms() > 0) *period = std::min(heartbeat_, absl::Milliseconds(reply.heartbeat_ms()));
  absl::MutexLock lock(&mu_);
  agent_id_ = reply.agent_id();
  ++joins_;
  joined_seq_ = std::max(joined_seq_, seq);
  catch_up_ = reply.catch_up();
  WSYNC_LOG(INFO) << "joined the coordinator at " << coordinator_ << " as " << agent_id_ << " (engine "
                  << join.engine_id() << ", tp " << join.tp_rank() << "/" << join.tp_size() << ", version "
                  << join.version() << "); heartbeat every " << absl::FormatDuration(*period);
  return true;
}

absl::StatusOr<v1::CatchUpHint> Membership::RefreshHint(absl::Duration timeout) {
  v1::HeartbeatRequest req;
  {
    absl::MutexLock lock(&mu_);
    if (agent_id_.empty() || need_join_)
      return absl::FailedPreconditionError(absl::StrCat("not joined at the coordinator ", coordinator_, " yet"));
    req.set_agent_id(agent_id_);
    req.set_version(join_.version());
  }
  if (staged_) req.set_staged_version(staged_());
  grpc::ClientContext ctx;
  PrepareContext(&ctx, sec_, timeout);
  v1::HeartbeatReply reply;
  const grpc::Status s = stub_->Heartbeat(&ctx, req, &reply);
  if (!s.ok()) return Annotate(FromGrpcStatus(s), absl::StrCat("asking the coordinator at ", coordinator_));
  absl::MutexLock lock(&mu_);
  catch_up_ = reply.catch_up();
  if (!reply.known()) need_join_ = true;
  return reply.catch_up();
}

void Membership::Run() {
  absl::Duration period = heartbeat_;
  bool warned = false;  // a heartbeat failure was logged and has not recovered yet
  for (;;) {
    v1::JoinRequest join;
    bool need_join = false;
    std::string id;
    uint64_t seq = 0;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || need_join_; };
      mu_.AwaitWithTimeout(absl::Condition(&wake), period);
      if (stop_) return;
      if (!have_join_) continue;
      join = join_;
      seq = update_seq_;
      need_join = need_join_;
      id = agent_id_;
    }
    if (need_join) {
      v1::JoinRequest sent = join;
      if (staged_) sent.set_staged_version(staged_());
      if (DoJoin(sent, seq, &period)) {
        absl::MutexLock lock(&mu_);
        // A later Update() asks again; this Join used the then current request.
        if (join_.SerializeAsString() == join.SerializeAsString()) need_join_ = false;
        warned = false;
      } else {
        absl::MutexLock lock(&mu_);
        auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
        mu_.AwaitWithTimeout(absl::Condition(&stop), heartbeat_);
        if (stop_) return;
      }
      continue;
    }
    grpc::ClientContext ctx;
    PrepareContext(&ctx, sec_, RpcTimeout());
    v1::HeartbeatRequest req;
    req.set_agent_id(id);
    req.set_version(join.version());
    if (staged_) req.set_staged_version(staged_());
    v1::HeartbeatReply reply;
    const grpc::Status s = stub_->Heartbeat(&ctx, req, &reply);
    if (!s.ok()) {
      if (!warned)
        WSYNC_LOG(WARNING) << "heartbeat to the coordinator at " << coordinator_ << " failed: " << FromGrpcStatus(s);
      warned = true;
      continue;
    }
    if (warned) WSYNC_LOG(INFO) << "the coordinator at " << coordinator_ << " answers heartbeats again";
    warned = false;
    {
      absl::MutexLock lock(&mu_);
      catch_up_ = reply.catch_up();
    }
    if (!reply.known()) {
      WSYNC_LOG(INFO) << "the coordinator does not know agent " << id << " any more: joining again";
      absl::MutexLock lock(&mu_);
      need_join_ = true;
    }
  }
}

}  // namespace wsync::rollout_agent
