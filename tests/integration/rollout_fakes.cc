#include "rollout_fakes.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/status.h"
#include "gtest/gtest.h"

extern char** environ;

namespace wsync::rollout_agent::testing {
using engine_memory::ParamArena;
using engine_memory::UniqueShmName;
using engine_model::EngineLayout;

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

absl::StatusOr<std::pair<std::unique_ptr<grpc::Server>, std::string>> Serve(grpc::Service* service,
                                                                            const RpcSecurity& sec) {
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", ServerCredentials(sec), &port);
  b.RegisterService(service);
  auto server = b.BuildAndStart();
  if (!server || port == 0) return absl::UnavailableError("cannot start a test gRPC server");
  return std::make_pair(std::move(server), absl::StrCat("127.0.0.1:", port));
}

}  // namespace

std::unique_ptr<grpc::ClientContext> Context(const RpcSecurity& sec, absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  PrepareContext(ctx.get(), sec, timeout);
  return ctx;
}

bool WaitUntil(const std::function<bool()>& done, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// --- FakeEngine ---------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<FakeEngine>> FakeEngine::Start(Options options) {
  std::unique_ptr<FakeEngine> e(new FakeEngine());
  e->options_ = std::move(options);
  ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(e->options_.config_json, "test config"));
  std::optional<QuantizationConfig> quant;
  if (!e->options_.quant_json.empty()) {
    ASSIGN_OR_RETURN(quant, ParseQuantizationConfig(e->options_.quant_json, "test quantization"));
  }
  ASSIGN_OR_RETURN(EngineLayout layout, EngineLayout::Create(config, quant ? &*quant : nullptr, e->options_.parallel));
  e->layout_ = std::make_unique<EngineLayout>(std::move(layout));
  ASSIGN_OR_RETURN(e->memory_,
                   ParamArena::Create(*e->layout_, UniqueShmName(e->options_.engine_id, e->options_.parallel.tp_rank)));
  e->version_ = e->options_.version;
  ASSIGN_OR_RETURN(auto served, Serve(e.get(), e->options_.security));
  e->server_ = std::move(served.first);
  e->address_ = served.second;
  return e;
}

FakeEngine::~FakeEngine() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

v1::RegisterEngineRequest FakeEngine::RegisterRequest() const {
  v1::RegisterEngineRequest r;
  r.set_engine_id(options_.engine_id);
  r.set_tp_size(static_cast<uint32_t>(options_.parallel.tp_size));
  r.set_tp_rank(static_cast<uint32_t>(options_.parallel.tp_rank));
  r.set_ep_size(static_cast<uint32_t>(options_.parallel.ep_size));
  r.set_model_config_json(options_.config_json);
  r.set_quantization_config_json(options_.quant_json);
  r.set_engine_address(address_);
  r.set_version(version());
  memory_->FillParams(r.mutable_params());
  return r;
}

grpc::Status FakeEngine::Register(const std::string& agent) {
  auto stub = v1::RolloutAgent::NewStub(MakeChannel(agent, options_.security));
  auto ctx = Context(options_.security);
  v1::RegisterEngineReply reply;
  return stub->RegisterEngine(ctx.get(), RegisterRequest(), &reply);
}

std::vector<std::string> FakeEngine::calls() const {
  absl::MutexLock l(&mu_);
  return calls_;
}
void FakeEngine::ClearCalls() {
  absl::MutexLock l(&mu_);
  calls_.clear();
}
uint64_t FakeEngine::version() const {
  absl::MutexLock l(&mu_);
  return version_;
}
bool FakeEngine::paused() const {
  absl::MutexLock l(&mu_);
  return paused_;
}
void FakeEngine::RefuseFlushes(int n) {
  absl::MutexLock l(&mu_);
  refuse_flushes_ = n;
}

grpc::Status FakeEngine::Pause(grpc::ServerContext* ctx, const v1::PauseRequest* req, v1::PauseReply*) {
  WSYNC_AUTHORIZE(ctx, options_.security);
  absl::MutexLock l(&mu_);
  calls_.push_back(absl::StrCat("pause:", v1::PauseRequest::Mode_Name(req->mode())));
  paused_ = true;
  return grpc::Status::OK;
}

grpc::Status FakeEngine::Flush(grpc::ServerContext* ctx, const v1::FlushRequest*, v1::FlushReply*) {
  WSYNC_AUTHORIZE(ctx, options_.security);
  absl::MutexLock l(&mu_);
  if (refuse_flushes_ != 0) {
    if (refuse_flushes_ > 0) --refuse_flushes_;
    calls_.push_back("flush:refused");
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "2 requests still running");
  }
  calls_.push_back("flush");
  return grpc::Status::OK;
}

grpc::Status FakeEngine::Continue(grpc::ServerContext* ctx, const v1::ContinueRequest* req, v1::ContinueReply* reply) {
  WSYNC_AUTHORIZE(ctx, options_.security);
  absl::MutexLock l(&mu_);
  calls_.push_back(absl::StrCat("continue:", req->version()));
  version_ = req->version();
  paused_ = false;
  reply->set_version(version_);
  return grpc::Status::OK;
}

void FakeEngine::HoldHealth(bool hold) {
  absl::MutexLock l(&mu_);
  hold_health_ = hold;
}

int FakeEngine::health_waiting() const {
  absl::MutexLock l(&mu_);
  return health_waiting_;
}

grpc::Status FakeEngine::Health(grpc::ServerContext* ctx, const v1::HealthRequest*, v1::HealthReply* reply) {
  WSYNC_AUTHORIZE(ctx, options_.security);
  absl::MutexLock l(&mu_);
  ++health_waiting_;
  auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !hold_health_; };
  mu_.AwaitWithTimeout(absl::Condition(&released), absl::Seconds(30));
  --health_waiting_;
  reply->set_state(paused_ ? v1::HealthReply::PAUSED : v1::HealthReply::SERVING);
  reply->set_version(version_);
  return grpc::Status::OK;
}

grpc::Status FakeEngine::WeightVersion(grpc::ServerContext* ctx, const v1::WeightVersionRequest*,
                                       v1::WeightVersionReply* reply) {
  WSYNC_AUTHORIZE(ctx, options_.security);
  absl::MutexLock l(&mu_);
  reply->set_version(version_);
  return grpc::Status::OK;
}

// --- FakeCoordinator ----------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<HangingPeer>> HangingPeer::Start(RpcSecurity security) {
  std::unique_ptr<HangingPeer> p(new HangingPeer());
  p->sec_ = std::move(security);
  ASSIGN_OR_RETURN(auto served, Serve(p.get(), p->sec_));
  p->server_ = std::move(served.first);
  p->address_ = served.second;
  return p;
}

HangingPeer::~HangingPeer() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

int HangingPeer::fetches() const {
  absl::MutexLock l(&mu_);
  return fetches_;
}

int HangingPeer::cancelled() const {
  absl::MutexLock l(&mu_);
  return cancelled_;
}

grpc::Status HangingPeer::FetchStaging(grpc::ServerContext* ctx, const v1::FetchStagingRequest*,
                                       grpc::ServerWriter<v1::StagingChunk>*) {
  WSYNC_AUTHORIZE(ctx, sec_);
  {
    absl::MutexLock l(&mu_);
    ++fetches_;
  }
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (!ctx->IsCancelled() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  if (ctx->IsCancelled()) {
    absl::MutexLock l(&mu_);
    ++cancelled_;
  }
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "a hanging peer");
}

absl::StatusOr<std::unique_ptr<FakeCoordinator>> FakeCoordinator::Start(RpcSecurity security) {
  std::unique_ptr<FakeCoordinator> c(new FakeCoordinator());
  c->sec_ = std::move(security);
  ASSIGN_OR_RETURN(auto served, Serve(c.get(), c->sec_));
  c->server_ = std::move(served.first);
  c->address_ = served.second;
  return c;
}

FakeCoordinator::~FakeCoordinator() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

std::vector<v1::JoinRequest> FakeCoordinator::joins() const {
  absl::MutexLock l(&mu_);
  return joins_;
}
int FakeCoordinator::heartbeats() const {
  absl::MutexLock l(&mu_);
  return heartbeats_;
}
std::vector<std::string> FakeCoordinator::leaves() const {
  absl::MutexLock l(&mu_);
  return leaves_;
}
void FakeCoordinator::ForgetAgents() {
  absl::MutexLock l(&mu_);
  forget_ = true;
}

grpc::Status FakeCoordinator::Join(grpc::ServerContext* ctx, const v1::JoinRequest* req, v1::JoinReply* reply) {
  WSYNC_AUTHORIZE(ctx, sec_);
  absl::MutexLock l(&mu_);
  joins_.push_back(*req);
  reply->set_agent_id(absl::StrCat("agent-", joins_.size()));
  reply->set_heartbeat_ms(heartbeat_ms_);
  *reply->mutable_catch_up() = catch_up_;
  return grpc::Status::OK;
}

void FakeCoordinator::SetHeartbeatMs(uint64_t ms) {
  absl::MutexLock l(&mu_);
  heartbeat_ms_ = ms;
}

void FakeCoordinator::SetCatchUp(v1::CatchUpHint hint) {
  absl::MutexLock l(&mu_);
  catch_up_ = std::move(hint);
}

grpc::Status FakeCoordinator::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                        v1::HeartbeatReply* reply) {
  WSYNC_AUTHORIZE(ctx, sec_);
  absl::MutexLock l(&mu_);
  ++heartbeats_;
  reply->set_known(!forget_ && req->agent_id() == absl::StrCat("agent-", joins_.size()));
  *reply->mutable_catch_up() = catch_up_;
  forget_ = false;
  return grpc::Status::OK;
}

grpc::Status FakeCoordinator::Leave(grpc::ServerContext* ctx, const v1::LeaveRequest* req, v1::LeaveReply*) {
  WSYNC_AUTHORIZE(ctx, sec_);
  absl::MutexLock l(&mu_);
  leaves_.push_back(req->agent_id());
  return grpc::Status::OK;
}

// --- AgentProcess -------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<AgentProcess>> AgentProcess::Start(const std::string& binary, const std::string& tag,
                                                                  const std::vector<std::string>& args,
                                                                  RpcSecurity sec) {
  std::unique_ptr<AgentProcess> a(new AgentProcess());
  a->sec_ = std::move(sec);
  const std::string base = absl::StrCat(::testing::TempDir(), "/agent-", getpid(), "-", tag);
  a->log_ = base + ".log";
  const std::string address_file = a->address_file_ = base + ".address";
  unlink(address_file.c_str());
  std::vector<std::string> argv_s = {binary, "--listen", "127.0.0.1:0", "--address-file", address_file};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, a->log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  const int rc = posix_spawn(&a->pid_, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return absl::InternalError(absl::StrCat("posix_spawn ", binary, ": ", rc));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    std::string addr(absl::StripAsciiWhitespace(ReadFile(address_file)));
    if (!addr.empty()) {
      a->address_ = addr;
      break;
    }
    int st = 0;
    if (waitpid(a->pid_, &st, WNOHANG) == a->pid_) {
      a->pid_ = -1;
      a->status_ = st;
      return absl::InternalError(absl::StrCat("the agent exited at start-up:\n", a->Log()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (a->address_.empty()) return absl::DeadlineExceededError(absl::StrCat("no address from the agent:\n", a->Log()));
  a->stub_ = v1::RolloutAgent::NewStub(MakeChannel(a->address_, a->sec_));
  return a;
}

AgentProcess::~AgentProcess() { Terminate(); }

std::string AgentProcess::Log() const { return ReadFile(log_); }

void AgentProcess::RemoveFiles() const {
  unlink(log_.c_str());
  unlink(address_file_.c_str());
}

int AgentProcess::Terminate() {
  if (pid_ <= 0) return status_;
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  for (;;) {
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      status_ = st;
      break;
    }
    if (absl::Now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &st, 0);
      status_ = st;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  pid_ = -1;
  return status_;
}

// --- TrainerSide --------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<TrainerSide>> TrainerSide::Start(RpcSecurity sec) {
  auto t = std::make_unique<TrainerSide>();
  ASSIGN_OR_RETURN(t->server_, comm::StoreServer::Start(&t->store_, "127.0.0.1:0", sec));
  t->address_ = t->server_->address();
  return t;
}

void TrainerSide::Run(const std::string& name, int size, std::function<absl::Status(comm::Communicator&)> send) {
  results_.push_back(std::make_unique<absl::Status>());
  absl::Status* result = results_.back().get();
  threads_.emplace_back([this, name, size, send, result] {
    comm::GroupOptions g;
    g.store = &store_;
    g.name = name;
    g.rank = 0;
    g.size = size;
    g.join_timeout = absl::Seconds(30);
    g.default_timeout = absl::Seconds(30);
    auto comm = comm::CreateGroup(comm::Backend::kGloo, g);
    if (!comm.ok()) {
      *result = comm.status();
      return;
    }
    *result = send(**comm);
  });
}

absl::Status TrainerSide::Join() {
  for (auto& t : threads_) t.join();
  threads_.clear();
  absl::Status first;
  for (const auto& r : results_)
    if (first.ok()) first = *r;
  results_.clear();
  return first;
}

}  // namespace wsync::rollout_agent::testing
