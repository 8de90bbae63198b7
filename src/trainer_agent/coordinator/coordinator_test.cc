// SyncCoordinator driven in one process by fake rollout agents (AgentClient) and a fake trainer
// side: the state machine's order of calls, aborts, busy triggers, versions, member timeouts; and
// one round trip through the gRPC service (Coordinator) for the status mapping and the token.
#include "trainer_agent/coordinator/coordinator.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "trainer_agent/coordinator/sync_coordinator.h"
#include "trainer_agent/coordinator/sync_keys.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One rollout agent: records every call ("Begin 1", "Prepare 1", ...) and fails the calls it is
// told to fail.
class FakeAgent {
 public:
  void FailOn(const std::string& call, absl::Status s) {
    absl::MutexLock lock(&mu_);
    failures_[call] = std::move(s);
  }
  std::vector<std::string> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  v1::BeginSyncRequest last_begin() {
    absl::MutexLock lock(&mu_);
    return last_begin_;
  }
  absl::Status Record(const std::string& call, uint64_t sync_id) {
    absl::MutexLock lock(&mu_);
    calls_.push_back(absl::StrCat(call, " ", sync_id));
    auto it = failures_.find(call);
    return it == failures_.end() ? absl::OkStatus() : it->second;
  }
  void SetBegin(const v1::BeginSyncRequest& r) {
    absl::MutexLock lock(&mu_);
    last_begin_ = r;
  }
  // The version its engine serves: the last Begin's once a Commit succeeded.
  uint64_t version() {
    absl::MutexLock lock(&mu_);
    return version_;
  }
  void Committed() {
    absl::MutexLock lock(&mu_);
    version_ = last_begin_.version();
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Status> failures_ ABSL_GUARDED_BY(mu_);
  v1::BeginSyncRequest last_begin_ ABSL_GUARDED_BY(mu_);
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
};

class FakeAgentClient final : public AgentClient {
 public:
  explicit FakeAgentClient(std::shared_ptr<FakeAgent> agent) : agent_(std::move(agent)) {}
  absl::Status BeginSync(const v1::BeginSyncRequest& req, absl::Duration, v1::BeginSyncReply*) override {
    agent_->SetBegin(req);
    return agent_->Record("Begin", req.sync_id());
  }
  absl::Status PrepareSync(const v1::PrepareSyncRequest& req, absl::Duration, v1::PrepareSyncReply* reply) override {
    reply->set_bytes(100);
    reply->set_load_seconds(0.5);
    return agent_->Record("Prepare", req.sync_id());
  }
  absl::Status CommitSync(const v1::CommitSyncRequest& req, absl::Duration, v1::CommitSyncReply* reply) override {
    absl::Status s = agent_->Record("Commit", req.sync_id());
    if (s.ok()) {
      agent_->Committed();
      reply->set_version(agent_->version());
      reply->set_staged_version(agent_->version());  // a host staging: the committed version
    }
    return s;
  }
  absl::Status AbortSync(const v1::AbortSyncRequest& req, absl::Duration, v1::AbortSyncReply* reply) override {
    reply->set_version(agent_->version());
    return agent_->Record(req.roll_forward() ? "Abort(roll forward)" : "Abort", req.sync_id());
  }

 private:
  std::shared_ptr<FakeAgent> agent_;
};

// The trainer ranks: records plans; fails when told to; blocks while `hold` is set; says it is still
// running a sync given up on while `draining` is set.
class FakeTrainer final : public TrainerSide {
 public:
  int num_stages() const override { return 2; }
  int world_size() const override { return 4; }
  absl::StatusOr<TrainerReport> RunSync(const SyncPlan& plan) override {
    absl::MutexLock lock(&mu_);
    plans_.push_back(plan);
    mu_.Await(absl::Condition(
        +[](bool* hold) { return !*hold; }, &hold_));
    if (!fail_.ok()) return fail_;
    TrainerReport r;
    r.delta_held = plan.keep_delta_base ? plan.version : 0;  // as the stage sources' DeltaSinks
    if (plan.keep_delta_base) {
      r.tensor_bytes = 1000;
      r.sent_bytes = plan.delta_base ? 40 : 1000;
      r.delta_items = plan.delta_base ? 500 : 0;
      r.changed_items = plan.delta_base ? 5 : 0;
      r.quant_groups = 64;
      r.reused_groups = plan.delta_base ? 48 : 0;
      r.undigested_groups = plan.delta_base ? 8 : 0;
    }
    r.bytes = 1000;
    r.phases.push_back({"gather", 0.25, 1000});
    return r;
  }
  uint64_t draining_sync() override {
    absl::MutexLock lock(&mu_);
    return draining_;
  }
  absl::Status AwaitIdle(absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    ++awaiting_;
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](uint64_t* d) { return *d == 0; }, &draining_),
                          deadline);
    if (draining_ != 0) return absl::DeadlineExceededError(absl::StrCat("still running sync ", draining_));
    return absl::OkStatus();
  }
  void Hold(bool h) {
    absl::MutexLock lock(&mu_);
    hold_ = h;
  }
  // Blocks (at most 5 s) until the coordinator waits in AwaitIdle; false if it never does.
  bool WaitUntilAwaited() {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(
                                    +[](int* n) { return *n > 0; }, &awaiting_),
                                absl::Seconds(5));
  }
  void Drain(uint64_t sync_id) {
    absl::MutexLock lock(&mu_);
    draining_ = sync_id;
  }
  void Fail(absl::Status s) {
    absl::MutexLock lock(&mu_);
    fail_ = std::move(s);
  }
  std::vector<SyncPlan> plans() {
    absl::MutexLock lock(&mu_);
    return plans_;
  }

 private:
  absl::Mutex mu_;
  bool hold_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t draining_ ABSL_GUARDED_BY(mu_) = 0;
  int awaiting_ ABSL_GUARDED_BY(mu_) = 0;  // calls of AwaitIdle so far
  absl::Status fail_ ABSL_GUARDED_BY(mu_);
  std::vector<SyncPlan> plans_ ABSL_GUARDED_BY(mu_);
};

class SyncCoordinatorTest : public ::testing::Test {
 protected:
  void Make(SyncCoordinatorOptions o = {}) { ASSERT_TRUE(MakeLoaded(o).ok()); }
  // A coordinator over the fakes: its state loaded (options.state_dir), then started; LoadState's
  // error leaves it unstarted.
  // Options with an empty state directory of the test's own (TempDir()/coordinator-NAME-PID).
  static SyncCoordinatorOptions WithFreshStateDir(const std::string& name) {
    SyncCoordinatorOptions o;
    o.state_dir = ::testing::TempDir() + "/coordinator-" + name + "-" + std::to_string(getpid());
    std::filesystem::remove_all(o.state_dir);
    return o;
  }
  absl::Status MakeLoaded(const SyncCoordinatorOptions& o) {
    coordinator_ = std::make_unique<SyncCoordinator>(o, &trainer_, &store_, [this](const std::string& address) {
      absl::MutexLock lock(&mu_);
      auto& a = agents_[address];
      if (!a) a = std::make_shared<FakeAgent>();
      return std::make_unique<FakeAgentClient>(a);
    });
    if (absl::Status s = coordinator_->LoadState(); !s.ok()) return s;
    coordinator_->Start("store:1");
    return absl::OkStatus();
  }
  // Joins an agent at `address` for TP rank `tp_rank` of engine `engine` (TP `tp_size`); returns its id.
  // Without an engine id, each address serves an engine of its own ("e@<address>"): agents of one
  // engine rank replace each other (SyncCoordinator::Join).
  std::string Join(const std::string& address, uint32_t tp_rank = 0, uint32_t tp_size = 1,
                   const std::string& engine = "", const std::string& quant_json = "") {
    v1::JoinRequest req;
    req.set_agent_address(address);
    req.set_engine_id(engine.empty() ? "e@" + address : engine);
    req.set_tp_rank(tp_rank);
    req.set_tp_size(tp_size);
    req.set_quantization_config_json(quant_json);
    v1::JoinReply reply;
    EXPECT_TRUE(coordinator_->Join(req, &reply).ok());
    return reply.agent_id();
  }
  // A heartbeat of member `id` reporting `version` (and `staged`, the version its staging holds); the reply.
  v1::HeartbeatReply Beat(const std::string& id, uint64_t version, uint64_t staged = 0) {
    v1::HeartbeatRequest req;
    req.set_agent_id(id);
    req.set_version(version);
    req.set_staged_version(staged);
    v1::HeartbeatReply reply;
    EXPECT_TRUE(coordinator_->Heartbeat(req, &reply).ok());
    return reply;
  }
  std::shared_ptr<FakeAgent> Agent(const std::string& address) {
    absl::MutexLock lock(&mu_);
    return agents_[address];
  }
  absl::StatusOr<v1::TriggerSyncReply> Trigger(uint64_t version = 0, bool wait = false, uint32_t min_agents = 0,
                                               const std::string& delivery = "", const std::string& delta = "") {
    v1::TriggerSyncRequest req;
    req.set_version(version);
    req.set_delivery(delivery);
    req.set_delta(delta);
    req.set_wait_if_busy(wait);
    req.set_min_agents(min_agents);
    v1::TriggerSyncReply reply;
    absl::Status s = coordinator_->TriggerSync(req, &reply);
    if (!s.ok()) return s;
    return reply;
  }
  // The final event of sync `id` (WatchSync until it finishes).
  v1::SyncEvent Finish(uint64_t id) {
    v1::SyncEvent last;
    EXPECT_TRUE(coordinator_
                    ->WatchSync(id,
                                [&](const v1::SyncEvent& e) {
                                  last = e;
                                  return true;
                                })
                    .ok());
    return last;
  }
  // The newest sync's timings, by phase.
  std::map<std::string, double> LastPhases() {
    v1::TimingsReply timings;
    EXPECT_TRUE(coordinator_->Timings({}, &timings).ok());
    std::map<std::string, double> phases;
    for (const auto& p : timings.phases()) phases[p.phase()] = p.seconds();
    return phases;
  }
  // A coordinator of sync timeout `timeout` and one agent ("a:1"), whose trainer ranks still run sync
  // 7 (given up on), and a sync triggered meanwhile.
  absl::StatusOr<v1::TriggerSyncReply> TriggerWhileDraining(absl::Duration timeout) {
    SyncCoordinatorOptions o;
    o.sync_timeout = timeout;
    Make(o);
    Join("a:1");
    trainer_.Drain(7);
    return Trigger();
  }
  // Waits (bounded) until a sync has reached the trainer side (phase "transfer").
  void WaitForTransfer() {
    for (int i = 0; i < 500; ++i) {
      if (!trainer_.plans().empty()) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
    FAIL() << "no sync reached the trainer within 5 s";
  }

  FakeTrainer trainer_;
  comm::MemoryStore store_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<FakeAgent>> agents_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SyncCoordinator> coordinator_;
};

TEST_F(SyncCoordinatorTest, ASyncCallsEveryAgentInOrderAndPublishes) {
  Make();
  Join("a:1", 0, 2, "e0");
  Join("a:2", 1, 2, "e0");
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->version(), 1u);
  v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "done");
  EXPECT_EQ(e.error(), "");
  EXPECT_EQ(*store_.Add(SyncAbandonedKey(t->sync_id()), 0), 0);
  const std::string id = absl::StrCat(t->sync_id());
  for (const char* address : {"a:1", "a:2"}) {
    EXPECT_EQ(Agent(address)->calls(), (std::vector<std::string>{"Begin " + id, "Prepare " + id, "Commit " + id}))
        << address;
    const v1::BeginSyncRequest b = Agent(address)->last_begin();
    EXPECT_EQ(b.store_address(), "store:1");
    EXPECT_EQ(b.version(), 1u);
    ASSERT_EQ(b.groups_size(), 2);
    EXPECT_EQ(b.groups(1).name(), SyncGroupName(t->sync_id(), 1));
    EXPECT_EQ(b.groups(1).size(), 3u);  // the stage source and two agents
  }
  // Agent ranks are 1 and 2, one each.
  EXPECT_NE(Agent("a:1")->last_begin().agent_rank(), Agent("a:2")->last_begin().agent_rank());
  ASSERT_EQ(trainer_.plans().size(), 1u);
  EXPECT_EQ(trainer_.plans()[0].num_agents, 2);
  EXPECT_EQ(trainer_.plans()[0].group_names,
            (std::vector<std::string>{SyncGroupName(t->sync_id(), 0), SyncGroupName(t->sync_id(), 1)}));

  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 1u);
  EXPECT_EQ(status.state(), "idle");
  EXPECT_EQ(status.members(), 2u);
  EXPECT_EQ(status.trainer_ranks(), 4u);
  v1::VersionsReply versions;
  coordinator_->Versions(&versions);
  ASSERT_EQ(versions.versions_size(), 1);
  EXPECT_TRUE(versions.versions(0).ok());
  EXPECT_EQ(versions.versions(0).bytes(), 1000u);
  std::map<std::string, double> phases = LastPhases();
  EXPECT_EQ(phases["gather"], 0.25);
  EXPECT_EQ(phases["load"], 0.5);
  for (const char* p : {"begin", "transfer", "prepare", "commit", "downtime", "total"})
    EXPECT_TRUE(phases.count(p)) << p;
}

// A sync given up on keeps the trainer ranks busy in the background: the next sync waits for them
// before any agent hears of it, and then has its whole timeout.
TEST_F(SyncCoordinatorTest, ASyncWaitsForTheTrainerRanksToFinishOneGivenUpOn) {
  constexpr absl::Duration kTimeout = absl::Seconds(3);
  auto t = TriggerWhileDraining(kTimeout);
  ASSERT_TRUE(t.ok()) << t.status();
  // The wait is timed from when the coordinator enters it, which a loaded machine (TSan) delays.
  ASSERT_TRUE(trainer_.WaitUntilAwaited()) << "the coordinator never waited for the trainer ranks";
  const absl::Time waiting = absl::Now();
  absl::SleepFor(absl::Milliseconds(400));
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.state(), "syncing");
  EXPECT_TRUE(Agent("a:1")->calls().empty());
  EXPECT_TRUE(trainer_.plans().empty());
  const absl::Time freed = absl::Now();
  trainer_.Drain(0);
  v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "done");
  EXPECT_EQ(e.error(), "");
  const std::string id = absl::StrCat(t->sync_id());
  EXPECT_EQ(Agent("a:1")->calls(), (std::vector<std::string>{"Begin " + id, "Prepare " + id, "Commit " + id}));
  ASSERT_EQ(trainer_.plans().size(), 1u);
  EXPECT_GE(trainer_.plans()[0].deadline, freed + kTimeout - absl::Milliseconds(100))
      << "the sync's timeout counts from when the ranks are free";
  EXPECT_GE(LastPhases()["wait_trainer"], absl::ToDoubleSeconds(freed - waiting));
}

TEST_F(SyncCoordinatorTest, RanksThatStayBusyFailTheNextSyncBeforeAnyAgentBegins) {
  auto t = TriggerWhileDraining(absl::Milliseconds(300));
  ASSERT_TRUE(t.ok()) << t.status();
  v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "failed");
  EXPECT_THAT(e.error(), HasSubstr("still running sync 7"));
  EXPECT_THAT(e.error(), HasSubstr("was not started"));
  for (const std::string& call : Agent("a:1")->calls()) EXPECT_THAT(call, Not(HasSubstr("Begin")));
  EXPECT_TRUE(trainer_.plans().empty());
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 0u);
}

TEST_F(SyncCoordinatorTest, AFailedPrepareAbortsEveryAgentAndCommitsNone) {
  Make();
  Join("a:1");
  Join("a:2");
  Agent("a:2")->FailOn("Prepare", absl::DataLossError("bucket 3 checksum"));
  auto t = Trigger();
  ASSERT_TRUE(t.ok());
  v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "failed");
  EXPECT_THAT(e.error(), HasSubstr("PrepareSync on"));
  EXPECT_THAT(e.error(), HasSubstr("a:2"));
  EXPECT_THAT(e.error(), HasSubstr("bucket 3 checksum"));
  auto abandoned = store_.Add(SyncAbandonedKey(t->sync_id()), 0);  // late trainer ranks stop joining its groups
  ASSERT_TRUE(abandoned.ok());
  EXPECT_EQ(*abandoned, 1);
  const std::string id = absl::StrCat(t->sync_id());
  for (const char* address : {"a:1", "a:2"}) {
    EXPECT_EQ(Agent(address)->calls(), (std::vector<std::string>{"Begin " + id, "Prepare " + id, "Abort " + id}))
        << address;
  }
  // The failing member carries its own error in the event.
  int with_error = 0;
  for (const auto& m : e.members()) with_error += !m.error().empty();
  EXPECT_EQ(with_error, 1);
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 0u);  // nothing published
  EXPECT_THAT(status.last_error(), HasSubstr("bucket 3 checksum"));

  // The next attempt takes the next version and publishes it.
  Agent("a:2")->FailOn("Prepare", absl::OkStatus());
  auto t2 = Trigger();
  ASSERT_TRUE(t2.ok());
  EXPECT_EQ(t2->version(), 2u);
  EXPECT_EQ(Finish(t2->sync_id()).phase(), "done");
  v1::VersionsReply versions;
  coordinator_->Versions(&versions);
  ASSERT_EQ(versions.versions_size(), 2);
  EXPECT_FALSE(versions.versions(0).ok());
  EXPECT_TRUE(versions.versions(1).ok());
}

// A commit that fails on one engine after the other committed: the sync is partial, the version is
// the fleet's (published), and every report names the engine left behind, until it catches up:
// the sync's event, `versions`, `status` (per engine) and the metrics say the same.
TEST_F(SyncCoordinatorTest, APartialCommitIsReportedAsPartialEverywhereUntilTheEngineCatchesUp) {
  MetricsRegistry metrics;
  SyncCoordinatorOptions o;
  o.metrics = &metrics;
  Make(o);
  const std::string a = Join("a:1", 0, 1, "e0");
  const std::string b = Join("b:1", 0, 1, "e1");
  auto first = Trigger();
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(Finish(first->sync_id()).phase(), "done");
  Agent("b:1")->FailOn("Commit", absl::DeadlineExceededError("the engine did not answer Pause"));
  auto t = Trigger();
  ASSERT_TRUE(t.ok());
  v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "partial");
  EXPECT_THAT(e.error(), HasSubstr("version 2 was committed on engine e0 tp 0 but not on engine e1 tp 0 (on version "
                                   "1): published to part of the fleet"));
  EXPECT_THAT(e.error(), HasSubstr("the engine did not answer Pause"));
  // The engine that did not commit is told to roll forward from its staging; the other is not.
  EXPECT_EQ(Agent("b:1")->calls().back(), absl::StrCat("Abort(roll forward) ", t->sync_id()));
  EXPECT_EQ(Agent("a:1")->calls().back(), absl::StrCat("Abort ", t->sync_id()));
  auto check = [&](bool e1_behind) {
    SCOPED_TRACE(e1_behind ? "e1 behind" : "e1 caught up");
    v1::StatusReply status;
    coordinator_->Status(&status);
    EXPECT_EQ(status.version(), 2u) << "version 2 is served by e0: it is the fleet's version";
    EXPECT_EQ(status.engines_behind(), e1_behind ? 1u : 0u);
    ASSERT_EQ(status.engines_size(), 2);
    EXPECT_EQ(status.engines(0).engine_id(), "e0");
    EXPECT_EQ(status.engines(0).version(), 2u);
    EXPECT_FALSE(status.engines(0).behind());
    EXPECT_EQ(status.engines(1).version(), e1_behind ? 1u : 2u);
    EXPECT_EQ(status.engines(1).behind(), e1_behind);
    v1::VersionsReply versions;
    coordinator_->Versions(&versions);
    ASSERT_EQ(versions.versions_size(), 2);
    const v1::VersionRecord& v2 = versions.versions(1);
    EXPECT_TRUE(v2.ok());
    EXPECT_EQ(v2.outcome(), "partial");
    if (e1_behind) {
      EXPECT_THAT(v2.behind(), ::testing::ElementsAre("e1 (on version 1)"));
      EXPECT_EQ(v2.caught_up_unix_ms(), 0);
    } else {
      EXPECT_EQ(v2.behind_size(), 0);
      EXPECT_GT(v2.caught_up_unix_ms(), 0);
    }
    const std::string text = metrics.RenderPrometheus();
    EXPECT_THAT(text, HasSubstr("wsync_version 2"));
    EXPECT_THAT(text, HasSubstr(absl::StrCat("wsync_engines_behind ", e1_behind ? 1 : 0)));
    EXPECT_THAT(text, HasSubstr(absl::StrCat("wsync_engine_version{engine=\"e1\"} ", e1_behind ? 1 : 2)));
    EXPECT_THAT(text, HasSubstr("wsync_syncs_partial_total 1"));
    EXPECT_THAT(text, HasSubstr("wsync_syncs_total 1"));
  };
  check(true);
  Beat(a, 2);
  Beat(b, 1);
  check(true);
  Beat(b, 2);  // b:1's agent rolled forward
  check(false);
  // Nothing committed anywhere (a Prepare failure): failed, nothing published, no such line.
  Agent("b:1")->FailOn("Commit", absl::OkStatus());
  Agent("b:1")->FailOn("Prepare", absl::DataLossError("bucket 1 checksum"));
  auto t3 = Trigger();
  ASSERT_TRUE(t3.ok());
  e = Finish(t3->sync_id());
  EXPECT_EQ(e.phase(), "failed");
  EXPECT_THAT(e.error(), ::testing::Not(HasSubstr("was committed on")));
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 2u);
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("wsync_sync_failures_total 1"));
}

// Versions only grow, also for a coordinator without state: past every version a member reports.
TEST_F(SyncCoordinatorTest, VersionsGrowPastWhatTheMembersServe) {
  Make();
  const std::string a = Join("a:1");
  Beat(a, 41);  // its engine serves version 41 (from a coordinator before this one)
  auto refused = Trigger(7);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("not newer than version 41 (an engine serves it)"));
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->version(), 42u);
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
}

TEST_F(SyncCoordinatorTest, ATrainerFailureSkipsPrepareAndAborts) {
  Make();
  Join("a:1");
  trainer_.Fail(absl::InternalError("trainer rank 3: NaN in decoder.layers.0.mlp"));
  auto t = Trigger();
  ASSERT_TRUE(t.ok());
  v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "failed");
  EXPECT_THAT(e.error(), HasSubstr("trainer rank 3"));
  const std::string id = absl::StrCat(t->sync_id());
  EXPECT_EQ(Agent("a:1")->calls(), (std::vector<std::string>{"Begin " + id, "Abort " + id}));
}

TEST_F(SyncCoordinatorTest, AFailedBeginNeverStartsTheTrainer) {
  Make();
  Join("a:1");
  Agent("a:1")->FailOn("Begin", absl::UnavailableError("engine unreachable"));
  auto t = Trigger();
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(Finish(t->sync_id()).phase(), "failed");
  EXPECT_TRUE(trainer_.plans().empty());
}

// The engines' quantization_config reaches the trainer side in the plan (docs/engine-formats.md):
// engines that hold different layouts of one quantization sync together; engines of different
// quantizations are refused before any agent is called, naming them.
TEST_F(SyncCoordinatorTest, TheEnginesQuantizationReachesTheTrainerAndMustAgree) {
  const std::string ct = R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
    "strategy": "group", "group_size": 64, "symmetric": true}}}, "ignore": ["lm_head"]})";
  std::string trtllm = ct;
  trtllm.insert(1, R"("engine_layout": "trtllm-sm80", )");
  const std::string awq = R"({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": true})";
  Make();
  Join("a:1", 0, 1, "marlin", ct);
  Join("a:2", 0, 1, "trtllm", trtllm);
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
  ASSERT_EQ(trainer_.plans().size(), 1u);
  const std::string got = trainer_.plans()[0].engine_quant_json;
  EXPECT_TRUE(got == ct || got == trtllm) << got;
  Join("a:3", 0, 1, "awq", awq);
  t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  const v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "failed");
  EXPECT_THAT(e.error(), HasSubstr("the engines serve different quantizations"));
  EXPECT_THAT(e.error(), HasSubstr("marlin, trtllm: compressed-tensors pack-quantized 4-bit group 64 symmetric"));
  EXPECT_THAT(e.error(), HasSubstr("awq: awq gemm 4-bit group 64 with zero points"));
  EXPECT_EQ(trainer_.plans().size(), 1u);  // the trainer never ran, no agent began the sync
  for (const std::string& call : Agent("a:3")->calls()) EXPECT_FALSE(absl::StartsWith(call, "Begin")) << call;
}

TEST_F(SyncCoordinatorTest, ABusyTriggerIsRefusedOrQueued) {
  Make();
  Join("a:1");
  trainer_.Hold(true);
  auto first = Trigger();
  ASSERT_TRUE(first.ok());
  WaitForTransfer();
  auto refused = Trigger();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("in progress"));
  auto queued = Trigger(0, /*wait=*/true);
  ASSERT_TRUE(queued.ok()) << queued.status();
  EXPECT_EQ(queued->version(), 2u);
  trainer_.Hold(false);
  EXPECT_EQ(Finish(first->sync_id()).phase(), "done");
  EXPECT_EQ(Finish(queued->sync_id()).phase(), "done");
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 2u);
}

// The fleet: an engine that misses a TP rank's agent sits the sync out (its remaining agents are
// not called: half an engine is never written) and is named behind; the others are not held back.
// The operator can take the engine out (no longer counted behind); an agent that joins again brings
// it back, and the next sync includes it. With no complete engine at all, a sync is refused.
TEST_F(SyncCoordinatorTest, AnEngineMissingARankSitsTheSyncOutAndIsNamedBehind) {
  Make();
  Join("a:1", 0, 2, "e0");
  const std::string a2 = Join("a:2", 1, 2, "e0");
  Join("b:1", 0, 1, "e1");
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");

  auto leave = [&](const std::string& id) {
    v1::LeaveRequest req;
    req.set_agent_id(id);
    ASSERT_TRUE(coordinator_->Leave(req).ok());
  };
  leave(a2);
  const size_t a1_calls = Agent("a:1")->calls().size();
  t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  v1::SyncEvent e = Finish(t->sync_id());
  EXPECT_EQ(e.phase(), "partial");
  EXPECT_THAT(e.error(), HasSubstr("e0 (no agent for TP rank 1 of 2) sat it out"));
  EXPECT_EQ(Agent("a:1")->calls().size(), a1_calls) << "the incomplete engine's remaining agent sits the sync out";
  EXPECT_EQ(Agent("b:1")->calls().back(), absl::StrCat("Commit ", t->sync_id()));
  v1::VersionsReply versions;
  coordinator_->Versions(&versions);
  ASSERT_EQ(versions.versions_size(), 2);
  EXPECT_EQ(versions.versions(1).outcome(), "partial");
  EXPECT_THAT(versions.versions(1).behind(), ::testing::ElementsAre("e0 (tp 0: on version 1; tp 1: no agent)"));
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 2u);
  EXPECT_EQ(status.engines_behind(), 1u);
  v1::MembersReply members;
  coordinator_->Members(&members);
  ASSERT_EQ(members.engines_size(), 2);
  EXPECT_EQ(members.engines(0).engine_id(), "e0");
  EXPECT_THAT(members.engines(0).missing_ranks(), ::testing::ElementsAre(1u));
  EXPECT_EQ(members.engines(1).missing_ranks_size(), 0);

  absl::Status unknown = coordinator_->RemoveEngine("nope");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.message(), HasSubstr("known: e0, e1"));
  ASSERT_TRUE(coordinator_->RemoveEngine("e0").ok());
  coordinator_->Status(&status);
  EXPECT_EQ(status.engines_behind(), 0u) << "a removed engine is not behind";
  versions.Clear();
  coordinator_->Versions(&versions);
  EXPECT_EQ(versions.versions(1).behind_size(), 0) << "nor named behind version 2 any more";
  t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done") << "every engine of the fleet (e1) committed";
  EXPECT_EQ(Agent("a:1")->calls().size(), a1_calls) << "the removed engine's remaining agent sits the sync out";

  const std::string back = Join("a:2", 1, 2, "e0");  // back: the engine is in the fleet again and synced
  t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
  EXPECT_EQ(Agent("a:1")->calls().back(), absl::StrCat("Commit ", t->sync_id()));
  EXPECT_EQ(Agent("a:2")->calls().back(), absl::StrCat("Commit ", t->sync_id()));

  // No engine complete: nothing can take a sync.
  leave(back);
  ASSERT_TRUE(coordinator_->RemoveEngine("e1").ok());
  auto refused = Trigger();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("no engine of the fleet has an agent for every TP rank (e0 (no agent for TP rank 1 of 2))"));
}

// --state-dir: a coordinator restarted on the same directory continues the version and sync
// numbers and still knows the versions and timings; a damaged state file refuses the start and
// is left as it was.
TEST_F(SyncCoordinatorTest, TheStateSurvivesARestart) {
  const SyncCoordinatorOptions o = WithFreshStateDir("state");
  const std::string& dir = o.state_dir;
  ASSERT_TRUE(MakeLoaded(o).ok());
  Join("a:1");
  uint64_t last_id = 0;
  for (int i = 0; i < 2; ++i) {
    auto t = Trigger(0, false, 0, i == 1 ? "sharded" : "");
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
    last_id = t->sync_id();
  }
  trainer_.Fail(absl::InternalError("rank 3 lost its GPU"));
  auto failed = Trigger();
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(Finish(failed->sync_id()).phase(), "failed");
  trainer_.Fail(absl::OkStatus());
  coordinator_.reset();
  ASSERT_TRUE(std::filesystem::exists(dir + "/coordinator-state.json"));

  // Restarted: version 2 is published, version 3 failed, the next trigger is version 4, sync 4.
  ASSERT_TRUE(MakeLoaded(o).ok());
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 2u);
  EXPECT_THAT(status.last_error(), HasSubstr("rank 3 lost its GPU"));
  v1::VersionsReply versions;
  coordinator_->Versions(&versions);
  ASSERT_EQ(versions.versions_size(), 3);
  EXPECT_TRUE(versions.versions(1).ok());
  EXPECT_FALSE(versions.versions(2).ok());
  v1::TimingsRequest want2;
  want2.set_version(2);
  v1::TimingsReply timings;
  ASSERT_TRUE(coordinator_->Timings(want2, &timings).ok());
  EXPECT_EQ(timings.sync_id(), last_id);
  EXPECT_GT(timings.phases_size(), 5);
  EXPECT_EQ(timings.delivery(), "sharded") << "the mode of version 2 (sharded) was not kept";
  v1::TimingsRequest want1;
  want1.set_version(1);
  ASSERT_TRUE(coordinator_->Timings(want1, &timings).ok());
  EXPECT_EQ(timings.delivery(), "broadcast");
  Join("a:1");
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->version(), 4u);
  EXPECT_EQ(t->sync_id(), failed->sync_id() + 1) << "sync ids continue: agents refuse an ended id";
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
  coordinator_.reset();

  // A trainer job that dies during a sync: the state file already holds that sync's id and
  // version, so the restarted coordinator starts after them (the agents refuse an id they saw end).
  ASSERT_TRUE(MakeLoaded(o).ok());
  Join("a:1");
  trainer_.Hold(true);
  auto dying = Trigger();
  ASSERT_TRUE(dying.ok()) << dying.status();
  {
    std::ifstream f(dir + "/coordinator-state.json");
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_THAT(text, HasSubstr(absl::StrCat("\"nextSyncId\": \"", dying->sync_id() + 1, "\"")));
  }
  const std::string saved_at_trigger = dir + "/saved-at-trigger.json";
  std::filesystem::copy_file(dir + "/coordinator-state.json", saved_at_trigger);
  trainer_.Hold(false);
  EXPECT_EQ(Finish(dying->sync_id()).phase(), "done");
  coordinator_.reset();
  std::filesystem::rename(saved_at_trigger, dir + "/coordinator-state.json");  // as if it had died then
  ASSERT_TRUE(MakeLoaded(o).ok());
  Join("a:1");
  auto after = Trigger();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->sync_id(), dying->sync_id() + 1);
  EXPECT_EQ(after->version(), dying->version() + 1);
  EXPECT_EQ(Finish(after->sync_id()).phase(), "done");
  coordinator_.reset();

  // A damaged state file: LoadState refuses, naming it, and leaves it untouched.
  const std::string path = dir + "/coordinator-state.json";
  { std::ofstream(path, std::ios::trunc) << "{\"published\": \"many\"}"; }
  absl::Status bad = MakeLoaded(o);
  EXPECT_EQ(bad.code(), absl::StatusCode::kFailedPrecondition) << bad;
  EXPECT_THAT(bad.message(), HasSubstr(path));
  std::ifstream f(path);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "{\"published\": \"many\"}");
  coordinator_.reset();
  std::filesystem::remove_all(dir);
}

// A coordinator that stopped during a commit (its state file names the committing sync) rolls
// every engine forward to that version once restarted: each member behind is told once
// (AbortSync with roll_forward for that sync); the version is published (partial) as soon as an
// engine reports it, and complete when all do.
TEST_F(SyncCoordinatorTest, ACoordinatorStoppedDuringACommitRollsTheFleetForwardWhenRestarted) {
  const SyncCoordinatorOptions o = WithFreshStateDir("commit");
  const std::string& dir = o.state_dir;
  ASSERT_TRUE(MakeLoaded(o).ok());
  Join("a:1");
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(Finish(t->sync_id()).phase(), "done");
  coordinator_.reset();
  std::string text = *ReadTextFile(dir + "/coordinator-state.json");
  EXPECT_THAT(text, Not(HasSubstr("committing"))) << "a finished sync leaves no commit in the state";

  // As the state of a coordinator that stopped while committing sync 2 (version 2)
  // (and whose fleet was engines e0 and e1).
  std::ofstream(dir + "/coordinator-state.json")
      << R"({"nextVersion": "3", "nextSyncId": "3", "published": "1", "committingSyncId": "2", "committingVersion": "2",
             "fleet": [{"engineId": "e0", "tpSize": 1}, {"engineId": "e1", "tpSize": 1}]})";
  ASSERT_TRUE(MakeLoaded(o).ok());
  v1::StatusReply status;
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 1u);
  EXPECT_THAT(status.last_error(), HasSubstr("stopped during this sync's commit"));
  v1::VersionsReply versions;
  coordinator_->Versions(&versions);
  ASSERT_EQ(versions.versions_size(), 1);
  EXPECT_EQ(versions.versions(0).outcome(), "rolling_forward");
  const std::string a = Join("a:1", 0, 1, "e0");
  Beat(a, 1);
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 1u) << "published before any engine reported it";
  Beat(a, 2);  // e0 rolled forward: version 2 is served, published; e1 (not back yet) is behind it
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 2u);
  EXPECT_EQ(status.engines_behind(), 1u);
  versions.Clear();
  coordinator_->Versions(&versions);
  EXPECT_EQ(versions.versions(0).outcome(), "partial");
  EXPECT_THAT(versions.versions(0).behind(), ::testing::ElementsAre("e1 (no agent)"));
  const std::string b = Join("b:1", 0, 1, "e1");
  for (int i = 0; i < 100 && Agent("b:1")->calls().empty(); ++i) absl::SleepFor(absl::Milliseconds(50));
  absl::SleepFor(absl::Milliseconds(600));  // another pass of the reaper
  EXPECT_THAT(Agent("b:1")->calls(), ::testing::ElementsAre("Abort(roll forward) 2")) << "told once";
  Beat(b, 2);
  coordinator_->Status(&status);
  EXPECT_EQ(status.version(), 2u);
  EXPECT_EQ(status.engines_behind(), 0u);
  versions.Clear();
  coordinator_->Versions(&versions);
  EXPECT_EQ(versions.versions(0).behind_size(), 0);
  EXPECT_GT(versions.versions(0).caught_up_unix_ms(), 0);
  coordinator_.reset();
  text = *ReadTextFile(dir + "/coordinator-state.json");
  EXPECT_THAT(text, Not(HasSubstr("committing")));
  EXPECT_THAT(text, HasSubstr("\"published\": \"2\""));
  std::filesystem::remove_all(dir);
}

// A full state directory (a 64 KiB tmpfs filled up; needs root, as CI runs): the trigger is
// refused, naming the directory and the cause, and changes nothing (no sync queued, the numbers
// taken back); once there is room again the next trigger gets exactly the numbers the refused one
// would have had, and its sync runs.
TEST_F(SyncCoordinatorTest, AFullStateDirectoryRefusesTheTriggerAndChangesNothing) {
  const std::string dir = ::testing::TempDir() + "/coordinator-full-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  if (geteuid() != 0 || mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=64k") != 0) {
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << "mounting a small tmpfs needs root";
  }
  SyncCoordinatorOptions o;
  o.state_dir = dir;
  ASSERT_TRUE(MakeLoaded(o).ok());
  Join("a:1");
  auto first = Trigger();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(Finish(first->sync_id()).phase(), "done");
  {  // fill the file system
    std::ofstream fill(dir + "/fill", std::ios::binary);
    const std::string block(4096, 'x');
    for (int i = 0; i < 64 && fill; ++i) fill.write(block.data(), block.size());
  }
  v1::StatusReply before;
  coordinator_->Status(&before);
  auto refused = Trigger();
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("cannot make sync 2 (version 2) durable, so it was not started"));
  EXPECT_THAT(refused.status().message(), HasSubstr(dir));
  EXPECT_THAT(refused.status().message(), HasSubstr("No space left on device"));
  v1::StatusReply after;
  coordinator_->Status(&after);
  EXPECT_EQ(after.DebugString(), before.DebugString()) << "a refused trigger changed the coordinator";
  std::filesystem::remove(dir + "/fill");
  auto next = Trigger();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->sync_id(), 2u);
  EXPECT_EQ(next->version(), 2u);
  EXPECT_EQ(Finish(next->sync_id()).phase(), "done");
  coordinator_.reset();
  EXPECT_EQ(umount(dir.c_str()), 0);
  std::filesystem::remove_all(dir);
}

// A long job's history stays bounded: the newest 64 finished syncs keep their timings (an older
// version's are refused, saying so), the attempts list only grows up to its cap, and an ended
// sync's rendezvous keys are dropped when the next one ends.
TEST_F(SyncCoordinatorTest, TheHistoryIsBounded) {
  Make();
  Join("a:1");
  uint64_t first_id = 0;
  for (int i = 0; i < 70; ++i) {
    auto t = Trigger();
    ASSERT_TRUE(t.ok()) << t.status();
    // What a stage source's group leaves in the rendezvous store.
    ASSERT_TRUE(store_.Set(SyncGroupName(t->sync_id(), 0) + "/gloo/rank/0", "10.0.0.1:1234").ok());
    ASSERT_TRUE(store_.Add(SyncProgressPrefix(t->sync_id()) + kProgressBytes, 64).ok());
    ASSERT_EQ(Finish(t->sync_id()).phase(), "done");
    if (i == 0) first_id = t->sync_id();
  }
  EXPECT_EQ(store_.size(), 2u) << "only the last sync's keys remain in the store";
  v1::TimingsRequest oldest;
  oldest.set_version(1);
  v1::TimingsReply timings;
  absl::Status s = coordinator_->Timings(oldest, &timings);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("among the newest 64 syncs"));
  v1::TimingsRequest kept;
  kept.set_version(7);
  EXPECT_TRUE(coordinator_->Timings(kept, &timings).ok());
  EXPECT_EQ(coordinator_->WatchSync(first_id, [&](const v1::SyncEvent& e) { return true; }).code(),
            absl::StatusCode::kNotFound);
  v1::VersionsReply versions;
  coordinator_->Versions(&versions);
  EXPECT_EQ(versions.versions_size(), 70) << "every attempt up to the cap of 1000";
}

TEST_F(SyncCoordinatorTest, VersionsOnlyGrowAndTheSameVersionCoalesces) {
  Make();
  Join("a:1");
  auto t = Trigger(5);
  ASSERT_TRUE(t.ok());
  auto again = Trigger(5);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->coalesced());
  EXPECT_EQ(again->sync_id(), t->sync_id());
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
  auto after = Trigger(5);  // done: joins the finished sync
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->coalesced());
  auto older = Trigger(4);
  EXPECT_EQ(older.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(older.status().message(), HasSubstr("versions only grow"));
  auto next = Trigger();  // no version given: the next number
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->version(), 6u);
}

TEST_F(SyncCoordinatorTest, TooFewMembersAreRefused) {
  Make();
  EXPECT_EQ(Trigger().status().code(), absl::StatusCode::kFailedPrecondition);
  Join("a:1");
  auto t = Trigger(0, false, /*min_agents=*/2);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(t.status().message(), HasSubstr("at least 2 rollout agents; 1 have joined"));
}

// A trigger naming an unknown delivery is refused, naming the choices, and queues nothing.
TEST_F(SyncCoordinatorTest, AnUnknownDeliveryIsRefused) {
  Make();
  Join("a:1");
  auto t = Trigger(0, false, 0, "multicast");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("unknown delivery \"multicast\" (broadcast or sharded)"));
  auto ok = Trigger();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->sync_id(), 1u);
  EXPECT_EQ(Finish(ok->sync_id()).phase(), "done");
}

// Delta delivery (--delta auto): the first sync goes in full and the trainer keeps a base; the next
// as deltas from it, to agents whose stagings hold it (the commit says so), without a recording;
// an engine off the base sends the sync in full (auto) or sits it out (on); a failed transfer, or
// a sync with deltas off, leaves the trainer's base unknown: the next goes in full.
TEST_F(SyncCoordinatorTest, DeltasGoOnlyToStagingsThatHoldTheTrainersBase) {
  SyncCoordinatorOptions o;
  o.delta = DeltaMode::kAuto;
  MetricsRegistry metrics;
  o.metrics = &metrics;
  Make(o);
  const std::string a1 = Join("a:1", 0, 1, "e1"), a2 = Join("a:2", 0, 1, "e2");
  auto sync = [&](const std::string& delta = "") {
    auto t = Trigger(0, false, 0, "", delta);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? Finish(t->sync_id()) : v1::SyncEvent();
  };
  auto begin_base = [&](const std::string& address) { return Agent(address)->last_begin().delta_base(); };
  EXPECT_EQ(sync().phase(), "done");
  ASSERT_EQ(trainer_.plans().size(), 1u);
  EXPECT_TRUE(trainer_.plans()[0].keep_delta_base);
  EXPECT_EQ(trainer_.plans()[0].delta_base, 0u) << "no base yet: in full";
  EXPECT_TRUE(Agent("a:1")->last_begin().record());
  EXPECT_EQ(sync().phase(), "done");
  EXPECT_EQ(trainer_.plans()[1].delta_base, 1u);
  EXPECT_EQ(trainer_.plans()[1].receiver_groups.size(), 1u) << "one layout among the receivers: one checksum each";
  EXPECT_EQ(begin_base("a:1"), 1u);
  EXPECT_EQ(begin_base("a:2"), 1u);
  EXPECT_FALSE(Agent("a:1")->last_begin().record()) << "a recording holds whole tensors";
  v1::TimingsReply timings;
  ASSERT_TRUE(coordinator_->Timings({}, &timings).ok());
  EXPECT_EQ(timings.delta_base(), 1u);
  EXPECT_EQ(timings.sent_bytes(), 40u);
  EXPECT_EQ(timings.tensor_bytes(), 1000u);
  EXPECT_EQ(timings.changed_items(), 5u);
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("wsync_sync_sent_fraction 0.04"));
  EXPECT_THAT(metrics.RenderPrometheus(), HasSubstr("wsync_sync_changed_fraction 0.01"));

  Beat(a2, 2, /*staged=*/0);  // its agent restarted: the engine serves version 2, no staging holds it
  EXPECT_EQ(sync().phase(), "done");
  EXPECT_EQ(trainer_.plans()[2].delta_base, 0u) << "auto: an engine off the base: everything in full";
  EXPECT_EQ(begin_base("a:2"), 0u);

  Beat(a2, 3, /*staged=*/0);
  v1::SyncEvent on = sync("on");
  EXPECT_EQ(on.phase(), "partial");
  EXPECT_THAT(on.error(), HasSubstr("e2 (not on version 3, the delta's base) sat it out"));
  EXPECT_EQ(trainer_.plans()[3].delta_base, 3u);
  EXPECT_EQ(trainer_.plans()[3].num_agents, 1);
  EXPECT_EQ(begin_base("a:1"), 3u);
  EXPECT_EQ(Agent("a:2")->calls().back(), "Commit 3") << "e2 was not in sync 4";

  Beat(a2, 4, /*staged=*/4);  // caught up from a peer
  trainer_.Fail(absl::UnavailableError("a trainer rank is gone"));
  EXPECT_EQ(sync().phase(), "failed");
  trainer_.Fail(absl::OkStatus());
  Beat(a1, 4, 4);
  Beat(a2, 4, 4);
  EXPECT_EQ(sync().phase(), "done");
  EXPECT_EQ(trainer_.plans()[5].delta_base, 0u) << "after a failed transfer the trainer's base is unknown";
  EXPECT_EQ(sync("off").phase(), "done");
  EXPECT_FALSE(trainer_.plans()[6].keep_delta_base);
  EXPECT_EQ(sync().phase(), "done");
  EXPECT_EQ(trainer_.plans()[7].delta_base, 0u) << "a sync with deltas off drops the trainer's base";

  // Sharded delivery takes deltas too, from bases of its own (one per receiver group): the first
  // sharded sync after a broadcast one goes in full.
  auto sharded = [&] {
    auto t = Trigger(0, false, 0, "sharded", "on");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? Finish(t->sync_id()) : v1::SyncEvent();
  };
  EXPECT_EQ(sharded().phase(), "done");
  EXPECT_EQ(trainer_.plans()[8].delivery, plan::Delivery::kSharded);
  EXPECT_EQ(trainer_.plans()[8].delta_base, 0u) << "the trainer's base (version 8) is a broadcast one";
  EXPECT_EQ(sharded().phase(), "done");
  EXPECT_EQ(trainer_.plans()[9].delta_base, 9u);
  ASSERT_TRUE(coordinator_->Timings({}, &timings).ok());
  EXPECT_EQ(timings.delivery(), "sharded");
  EXPECT_EQ(timings.delta_base(), 9u);
  EXPECT_EQ(timings.reused_groups(), 48u);
  EXPECT_EQ(timings.quant_groups(), 64u);
  EXPECT_EQ(timings.undigested_groups(), 8u);
  auto unknown = Trigger(0, false, 0, "", "maybe");
  EXPECT_THAT(unknown.status().message(), HasSubstr("delta \"maybe\": off, auto or on"));
}

// --delta on sits an engine off the base out only when each of its ranks has a peer laid out as it
// is to copy the new version from; a TP 2 engine beside a TP 1 one has none: the sync goes in full.
TEST_F(SyncCoordinatorTest, AnEngineWithoutAPeerOfItsLayoutIsSentTheSyncInFull) {
  SyncCoordinatorOptions o;
  o.delta = DeltaMode::kOn;
  Make(o);
  Join("a:1", 0, 1, "e1");
  const std::string t0 = Join("a:2", 0, 2, "e2");
  Join("a:3", 1, 2, "e2");
  auto sync = [&] {
    auto t = Trigger();
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? Finish(t->sync_id()).phase() : "";
  };
  EXPECT_EQ(sync(), "done");
  EXPECT_EQ(sync(), "done");
  ASSERT_EQ(trainer_.plans().size(), 2u);
  EXPECT_EQ(trainer_.plans()[1].delta_base, 1u) << "every staging holds version 1, as the commits said";
  Beat(t0, 2, /*staged=*/0);  // e2's rank 0 lost its staging
  EXPECT_EQ(sync(), "done") << "e2 has no peer laid out as TP 2: it takes the sync, in full";
  EXPECT_EQ(trainer_.plans()[2].delta_base, 0u);
  EXPECT_EQ(trainer_.plans()[2].num_agents, 3);
}

// A rollout agent restarted on a new port joins for the engine rank its dead predecessor served:
// the old entry goes at once, so the next sync calls only the live agent.
TEST_F(SyncCoordinatorTest, AnAgentOfTheSameEngineRankReplacesTheOldOne) {
  Make();
  Join("a:1", 0, 2, "e0");
  Join("a:2", 1, 2, "e0");
  Join("a:3", 1, 2, "e0");  // rank 1's agent, restarted on another port
  v1::MembersReply members;
  coordinator_->Members(&members);
  ASSERT_EQ(members.members_size(), 2);
  std::vector<std::string> addresses;
  for (const auto& m : members.members()) addresses.push_back(m.agent_address());
  EXPECT_THAT(addresses, ::testing::UnorderedElementsAre("a:1", "a:3"));
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
  EXPECT_TRUE(Agent("a:2")->calls().empty()) << "the replaced agent was called";
}

// A member behind the published version (its agent and engine restarted) is told the version and
// the agents of the same engine rank layout elsewhere in the fleet that report it.
TEST_F(SyncCoordinatorTest, AMemberBehindThePublishedVersionIsToldWhichPeersHoldIt) {
  Make();
  std::map<std::string, std::string> ids;
  ids["a:1"] = Join("a:1", 0, 2, "e0");
  ids["a:2"] = Join("a:2", 1, 2, "e0");
  ids["b:1"] = Join("b:1", 0, 2, "e1");
  ids["b:2"] = Join("b:2", 1, 2, "e1");
  auto t = Trigger();
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(Finish(t->sync_id()).phase(), "done");
  for (const auto& [address, id] : ids) EXPECT_EQ(Beat(id, 1).catch_up().version(), 0u) << address;

  // e0's rank 1 comes back on a new address with nothing: b:2 (e1's rank 1) holds version 1.
  v1::JoinRequest req;
  req.set_agent_address("a:9");
  req.set_engine_id("e0");
  req.set_tp_rank(1);
  req.set_tp_size(2);
  v1::JoinReply reply;
  ASSERT_TRUE(coordinator_->Join(req, &reply).ok());
  EXPECT_EQ(reply.catch_up().version(), 1u);
  EXPECT_THAT(reply.catch_up().peers(), ::testing::ElementsAre("b:2"));
  EXPECT_THAT(Beat(reply.agent_id(), 0).catch_up().peers(), ::testing::ElementsAre("b:2"));
  EXPECT_EQ(Beat(ids["b:2"], 0).catch_up().version(), 1u);  // now b:2 is behind too: no peer has it
  EXPECT_TRUE(Beat(ids["b:2"], 0).catch_up().peers().empty());
  EXPECT_EQ(Beat(reply.agent_id(), 1).catch_up().version(), 0u);  // caught up
}

// An engine that serves SGLang's NextN draft says so when it joins (JoinRequest.mtp_draft): a
// sharded sync gives its ranks receiver groups of their own, marked with the draft, so the trainer
// sends them the MTP layer's blocks; and it catches up only from a peer that holds a draft too.
TEST_F(SyncCoordinatorTest, AnEngineWithTheNextNDraftGetsGroupsOfItsOwn) {
  Make();
  auto join = [&](const std::string& address, uint32_t rank, const std::string& engine, bool draft, uint64_t version) {
    v1::JoinRequest req;
    req.set_agent_address(address);
    req.set_engine_id(engine);
    req.set_tp_rank(rank);
    req.set_tp_size(2);
    req.set_mtp_draft(draft);
    req.set_version(version);
    v1::JoinReply reply;
    EXPECT_TRUE(coordinator_->Join(req, &reply).ok());
    return reply;
  };
  join("a:1", 0, "plain", false, 0);
  join("a:2", 1, "plain", false, 0);
  join("d:1", 0, "draft", true, 0);
  join("d:2", 1, "draft", true, 0);
  auto t = Trigger(0, false, 0, "sharded");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(Finish(t->sync_id()).phase(), "done");
  ASSERT_EQ(trainer_.plans().size(), 1u);
  const SyncPlan plan = trainer_.plans()[0];
  ASSERT_EQ(plan.receiver_groups.size(), 4u);
  int drafts = 0;
  for (const auto& g : plan.receiver_groups) drafts += g.mtp_draft ? 1 : 0;
  EXPECT_EQ(drafts, 2);
  EXPECT_EQ(plan.group_agents, std::vector<int>({1, 1, 1, 1}));

  // A draft engine's rank 1 restarted with nothing: the plain engine's rank 1 holds version 1 but
  // no draft, so it is no peer; another draft engine at version 1 is.
  const v1::JoinReply back = join("d:9", 1, "draft", true, 0);
  EXPECT_EQ(back.catch_up().version(), 1u);
  EXPECT_TRUE(back.catch_up().peers().empty());
  join("e:2", 1, "draft2", true, 1);
  EXPECT_THAT(Beat(back.agent_id(), 0).catch_up().peers(), ::testing::ElementsAre("e:2"));
}

TEST_F(SyncCoordinatorTest, MembershipJoinRejoinLeaveAndTimeout) {
  Make({.member_timeout = absl::Milliseconds(600)});
  v1::JoinRequest bad;
  v1::JoinReply reply;
  EXPECT_EQ(coordinator_->Join(bad, &reply).code(), absl::StatusCode::kInvalidArgument);

  const std::string a = Join("a:1");
  const std::string b = Join("a:2");
  const std::string a_again = Join("a:1");  // a restarted agent: replaces its old entry
  EXPECT_NE(a, a_again);
  v1::MembersReply members;
  coordinator_->Members(&members);
  ASSERT_EQ(members.members_size(), 2);

  v1::HeartbeatRequest hb;
  v1::HeartbeatReply hr;
  hb.set_agent_id(a);
  ASSERT_TRUE(coordinator_->Heartbeat(hb, &hr).ok());
  EXPECT_FALSE(hr.known());  // the replaced id

  // b stays silent and is dropped; a_again heartbeats and stays.
  hb.set_agent_id(a_again);
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(coordinator_->Heartbeat(hb, &hr).ok());
    ASSERT_TRUE(hr.known());
    absl::SleepFor(absl::Milliseconds(50));
  }
  members.Clear();
  coordinator_->Members(&members);
  ASSERT_EQ(members.members_size(), 1);
  EXPECT_EQ(members.members(0).agent_id(), a_again.substr(0, a_again.find('@')));
  // The same member id from an earlier coordinator (restarted, numbering from 0 again) is unknown.
  hb.set_agent_id(members.members(0).agent_id() + "@0123456789abcdef");
  ASSERT_TRUE(coordinator_->Heartbeat(hb, &hr).ok());
  EXPECT_FALSE(hr.known());
  hb.set_agent_id(members.members(0).agent_id());
  ASSERT_TRUE(coordinator_->Heartbeat(hb, &hr).ok());
  EXPECT_FALSE(hr.known());

  v1::LeaveRequest leave;
  leave.set_agent_id(a_again);
  ASSERT_TRUE(coordinator_->Leave(leave).ok());
  members.Clear();
  coordinator_->Members(&members);
  EXPECT_EQ(members.members_size(), 0);
}

TEST_F(SyncCoordinatorTest, AMemberOfTheRunningSyncIsNotDroppedWhileItRuns) {
  Make({.member_timeout = absl::Milliseconds(300)});
  Join("a:1");
  trainer_.Hold(true);
  auto t = Trigger();
  ASSERT_TRUE(t.ok());
  WaitForTransfer();
  absl::SleepFor(absl::Milliseconds(1200));  // silent for four timeouts, inside the sync
  v1::MembersReply members;
  coordinator_->Members(&members);
  EXPECT_EQ(members.members_size(), 1);
  trainer_.Hold(false);
  EXPECT_EQ(Finish(t->sync_id()).phase(), "done");
}

TEST_F(SyncCoordinatorTest, WatchingAnUnknownSyncIsNotFoundAndTimingsNeedAFinishedSync) {
  Make();
  EXPECT_EQ(coordinator_->WatchSync(42, [](const v1::SyncEvent&) { return true; }).code(), absl::StatusCode::kNotFound);
  v1::TimingsReply timings;
  EXPECT_EQ(coordinator_->Timings({}, &timings).code(), absl::StatusCode::kNotFound);
}

TEST_F(SyncCoordinatorTest, ProgressComesFromTheStore) {
  Make();
  Join("a:1");
  trainer_.Hold(true);
  auto t = Trigger();
  ASSERT_TRUE(t.ok());
  WaitForTransfer();
  ASSERT_TRUE(store_.Add(SyncProgressPrefix(t->sync_id()) + kProgressBytes, 640).ok());
  ASSERT_TRUE(store_.Add(SyncProgressPrefix(t->sync_id()) + kProgressBuckets, 2).ok());
  v1::SyncEvent running;
  ASSERT_TRUE(coordinator_
                  ->WatchSync(t->sync_id(),
                              [&](const v1::SyncEvent& e) {
                                running = e;
                                return false;  // one event is enough
                              })
                  .ok());
  EXPECT_EQ(running.phase(), "transfer");
  EXPECT_EQ(running.bytes_done(), 640u);
  EXPECT_EQ(running.buckets_done(), 2u);
  trainer_.Hold(false);
  EXPECT_EQ(Finish(t->sync_id()).bytes_done(), 1000u);  // the trainer's report once finished
}

// The gRPC service: errors keep their codes on the wire; the bearer token is checked first.
TEST(CoordinatorServiceTest, StatusCodesAndTheTokenCrossTheWire) {
  FakeTrainer trainer;
  CoordinatorOptions o;
  o.listen = "127.0.0.1:0";
  o.security.token = "secret";
  auto c = Coordinator::Start(o, &trainer);
  ASSERT_TRUE(c.ok()) << c.status();
  auto stub = v1::Coordinator::NewStub(MakeChannel((*c)->address(), o.security));

  grpc::ClientContext ctx1;
  PrepareContext(&ctx1, o.security, absl::Seconds(5));
  v1::TriggerSyncReply reply;
  absl::Status s = FromGrpcStatus(stub->TriggerSync(&ctx1, v1::TriggerSyncRequest(), &reply));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("0 have joined"));

  RpcSecurity wrong = o.security;
  wrong.token = "guess";
  grpc::ClientContext ctx2;
  PrepareContext(&ctx2, wrong, absl::Seconds(5));
  v1::StatusReply status;
  EXPECT_EQ(FromGrpcStatus(stub->Status(&ctx2, v1::StatusRequest(), &status)).code(),
            absl::StatusCode::kUnauthenticated);

  grpc::ClientContext ctx3;
  PrepareContext(&ctx3, o.security, absl::Seconds(5));
  ASSERT_TRUE(stub->Status(&ctx3, v1::StatusRequest(), &status).ok());
  EXPECT_EQ(status.trainer_ranks(), 4u);
  EXPECT_EQ(status.state(), "idle");
}

}  // namespace
}  // namespace wsync::trainer_agent
