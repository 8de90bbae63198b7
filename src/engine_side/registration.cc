#include "engine_side/registration.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace wsync::engine_side {

AgentRegistrar::AgentRegistrar(RegistrarOptions options, std::function<v1::RegisterEngineRequest()> make_request)
    : options_(std::move(options)), make_request_(std::move(make_request)) {}

std::unique_ptr<AgentRegistrar> AgentRegistrar::Start(RegistrarOptions options,
                                                      std::function<v1::RegisterEngineRequest()> make_request) {
  auto r = std::unique_ptr<AgentRegistrar>(new AgentRegistrar(std::move(options), std::move(make_request)));
  r->thread_ = std::thread([p = r.get()] { p->Loop(); });
  return r;
}

bool AgentRegistrar::ResolveAgent() {
  std::string address = options_.agent_address;
  if (!options_.agent_address_file.empty()) {
    absl::StatusOr<std::string> text = ReadTextFile(options_.agent_address_file);
    if (text.ok()) address = std::string(absl::StripAsciiWhitespace(*text));
  }
  if (address.empty()) return false;
  if (address != agent_ || stub_ == nullptr) {
    if (!agent_.empty())
      WSYNC_LOG(INFO) << "rollout agent address now " << address << " (was " << agent_ << ", from "
                      << options_.agent_address_file << ")";
    agent_ = address;
    stub_ = v1::RolloutAgent::NewStub(MakeChannel(agent_, options_.security));
  }
  return true;
}

AgentRegistrar::~AgentRegistrar() { Stop(); }

void AgentRegistrar::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

int AgentRegistrar::registrations() const {
  absl::MutexLock lock(&mu_);
  return registrations_;
}

std::string AgentRegistrar::agent_id() const {
  absl::MutexLock lock(&mu_);
  return agent_id_;
}

bool AgentRegistrar::Sleep(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  const absl::Time until = absl::Now() + d;
  while (!stop_ && absl::Now() < until) cv_.WaitWithDeadline(&mu_, until);
  return !stop_;
}

void AgentRegistrar::Loop() {
  const std::string& agent = agent_;
  bool registered = false;
  std::string engine_id;
  absl::Duration backoff = options_.min_backoff;
  int failures = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (!registered) {
      absl::Status s;
      v1::RegisterEngineRequest req;
      v1::RegisterEngineReply reply;
      if (ResolveAgent()) {
        req = make_request_();
        engine_id = req.engine_id();
        grpc::ClientContext ctx;
        PrepareContext(&ctx, options_.security, options_.rpc_timeout);
        s = FromGrpcStatus(stub_->RegisterEngine(&ctx, req, &reply));
      } else {
        s = absl::UnavailableError(absl::StrCat("no agent address in ", options_.agent_address_file, " yet"));
      }
      if (s.ok()) {
        registered = true;
        backoff = options_.min_backoff;
        failures = 0;
        absl::MutexLock lock(&mu_);
        ++registrations_;
        agent_id_ = reply.agent_id();
        WSYNC_LOG(INFO) << "registered with rollout agent " << agent << " (agent_id " << reply.agent_id()
                        << "): " << req.params_size() << " params, version " << req.version()
                        << (reply.catch_up_version() > 0
                                ? absl::StrCat("; it catches this engine up to version ", reply.catch_up_version())
                                : "");
        if (options_.on_registered) options_.on_registered(reply);
        continue;
      }
      if (failures++ % 10 == 0)
        WSYNC_LOG(WARNING) << "registration with rollout agent " << agent << " failed (attempt " << failures
                           << ", retrying every <= " << absl::FormatDuration(options_.max_backoff) << "): " << s;
      if (!Sleep(backoff)) return;
      backoff = std::min(backoff * 2, options_.max_backoff);
      continue;
    }
    if (!Sleep(options_.poll)) return;
    v1::AgentStatusReply status;
    grpc::ClientContext ctx;
    PrepareContext(&ctx, options_.security, options_.rpc_timeout);
    const absl::Status s = FromGrpcStatus(stub_->AgentStatus(&ctx, v1::AgentStatusRequest(), &status));
    std::string why;
    if (!s.ok()) {
      why = absl::StrCat("unreachable (", s.ToString(), ")");
    } else if (status.agent_id() != agent_id()) {
      why = absl::StrCat("restarted (agent_id ", status.agent_id(), ")");
    } else if (status.state() == "no_engine" || status.engine_id() != engine_id) {
      why = absl::StrCat("no longer knows this engine (state ", status.state(), ", engine_id \"", status.engine_id(),
                         "\")");
    }
    if (!why.empty()) {
      WSYNC_LOG(WARNING) << "rollout agent " << agent << " " << why << ": registering again";
      registered = false;
    }
  }
}

}  // namespace wsync::engine_side
