// EngineCore in-process: the pause / flush / continue state machine and the TP protocol (two
// cores over a real Gloo group in one process), against HfReferenceModel tokens.
#include "engine_side/core.h"

#include <cmath>
#include <cstring>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "comm/testing/local_group.h"
#include "common/dtype.h"
#include "engine_side/tp_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ref_engine/hf_reference.h"
#include "ref_engine/ref_core.h"
#include "ref_engine/testing/fixtures.h"

namespace wsync::engine_side {
namespace {

using ref_engine::HfReferenceModel;
using ref_engine::testing::EngineParamsForRank;
using ref_engine::testing::MustParseConfig;
using ref_engine::testing::RandomHfModel;
using ref_engine::testing::TensorMap;
using ::testing::HasSubstr;

constexpr char kQwen3[] = R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "intermediate_size": 256, "vocab_size": 250, "max_position_embeddings": 64, "torch_dtype": "bfloat16"})";

const std::vector<int32_t> kPrompt = {3, 17, 101, 42, 7};
constexpr int kNew = 6;

std::vector<int32_t> Reference(const ModelConfig& c, const TensorMap& hf) {
  auto ref = HfReferenceModel::Create(c, hf.Lookup());
  EXPECT_TRUE(ref.ok()) << ref.status();
  auto tokens = ref->Generate(kPrompt, kNew);
  EXPECT_TRUE(tokens.ok()) << tokens.status();
  return *tokens;
}

// Overwrites `dst` in place with `src` (same names and sizes): what the agent does to engine memory.
void Overwrite(TensorMap& dst, const TensorMap& src) {
  for (const auto& [name, t] : src.all()) {
    Tensor& d = dst.Mutable(name);
    ASSERT_EQ(d.nbytes(), t.nbytes()) << name;
    std::memcpy(d.data_as<char>(), t.view().bytes().data(), t.nbytes());
  }
}

EngineCoreOptions FastOptions() {
  EngineCoreOptions o;
  o.engine_id = "unit";
  o.heartbeat = absl::Milliseconds(50);
  o.idle_timeout = absl::Seconds(10);
  o.version_wait = absl::Milliseconds(400);
  o.collective_timeout = absl::Seconds(20);
  return o;
}

absl::Time In(absl::Duration d) { return absl::Now() + d; }

class CoreTest : public ::testing::Test {
 protected:
  CoreTest() : c_(MustParseConfig(kQwen3)), hf1_(RandomHfModel(c_, 11)), hf2_(RandomHfModel(c_, 22)) {}

  void MakeCores(int tp, const EngineCoreOptions& options, bool with_weights) {
    cores_.clear();
    params_.clear();
    params_.resize(static_cast<size_t>(tp));
    for (int r = 0; r < tp; ++r) {
      EngineRank er;
      er.tp_size = tp;
      er.tp_rank = r;
      auto p = EngineParamsForRank(c_, er, hf1_);
      ASSERT_TRUE(p.ok()) << p.status();
      params_[static_cast<size_t>(r)] = std::move(*p);
      auto core = ref_engine::CreateEngineCore(c_, er, params_[static_cast<size_t>(r)].Lookup(), options);
      ASSERT_TRUE(core.ok()) << core.status();
      if (with_weights) {
        ASSERT_TRUE((*core)->PrepareInitial(0, "test checkpoint").ok());
      }
      cores_.push_back(std::move(*core));
    }
    if (tp == 1) return;
    static int group_id = 0;
    const std::string name = absl::StrCat("core-test-", ++group_id);
    auto group = comm::testing::MakeLocalGroup(store_, name, tp);
    ASSERT_TRUE(group.ok()) << group.status();
    auto& comms = *group;
    for (int r = 0; r < tp; ++r)
      cores_[static_cast<size_t>(r)]->AttachGroup(std::move(comms[static_cast<size_t>(r)]), "leader:1");
  }

  // Writes new weights into rank r's memory (as the agent does while paused).
  void WriteVersion2(int r) {
    EngineRank er;
    er.tp_size = static_cast<int>(cores_.size());
    er.tp_rank = r;
    auto p = EngineParamsForRank(c_, er, hf2_);
    ASSERT_TRUE(p.ok()) << p.status();
    Overwrite(params_[static_cast<size_t>(r)], *p);
  }

  absl::StatusOr<GenerateResult> Gen(absl::Duration wait = absl::Seconds(30), int n = kNew) {
    return cores_[0]->Generate(kPrompt, n, In(wait), nullptr);
  }

  ModelConfig c_;
  TensorMap hf1_, hf2_;
  comm::MemoryStore store_;
  std::vector<TensorMap> params_;
  std::vector<std::unique_ptr<EngineCore>> cores_;
};

TEST_F(CoreTest, NoWeightsUntilAContinueWithAVersion) {
  MakeCores(1, FastOptions(), /*with_weights=*/false);
  EngineCore& e = *cores_[0];
  EXPECT_EQ(e.Health().state, HealthInfo::State::kNoWeights);
  EXPECT_EQ(Gen().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Gen().status().message(), HasSubstr("no weights"));
  e.Pause(PauseMode::kHold);
  EXPECT_EQ(e.Health().state, HealthInfo::State::kPaused);
  ASSERT_TRUE(e.Flush().ok());
  ASSERT_EQ(*e.Continue(0, In(absl::Seconds(5))), 0u);  // nothing to prepare
  EXPECT_EQ(e.Health().state, HealthInfo::State::kNoWeights);
  e.Pause(PauseMode::kHold);
  WriteVersion2(0);
  ASSERT_EQ(*e.Continue(1, In(absl::Seconds(5))), 1u);
  const HealthInfo h = e.Health();
  EXPECT_EQ(h.state, HealthInfo::State::kServing);
  EXPECT_EQ(h.version, 1u);
  auto r = Gen();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version, 1u);
  EXPECT_EQ(r->tokens, Reference(c_, hf2_));
  EXPECT_EQ(e.version(), 1u);
}

TEST_F(CoreTest, ServesTheCheckpointAndBadPromptsAreRefused) {
  MakeCores(1, FastOptions(), true);
  auto r = Gen();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, Reference(c_, hf1_));
  EXPECT_EQ(r->version, 0u);
  EXPECT_NE(Reference(c_, hf1_), Reference(c_, hf2_)) << "the two test models must differ in their tokens";
  EXPECT_EQ(cores_[0]->Generate({}, 3, In(absl::Seconds(1)), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto bad = cores_[0]->Generate({1, 250}, 3, In(absl::Seconds(1)), nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("prompt token 1 is 250"));
  EXPECT_EQ(cores_[0]->Generate({1}, 64, In(absl::Seconds(1)), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto zero = cores_[0]->Generate({1}, 0, In(absl::Seconds(1)), nullptr);
  ASSERT_TRUE(zero.ok());
  EXPECT_TRUE(zero->tokens.empty());
}

TEST_F(CoreTest, HoldQueuesAbortFailsAndDeadlinesAndCancellationEndTheWait) {
  MakeCores(1, FastOptions(), true);
  EngineCore& e = *cores_[0];
  EXPECT_EQ(e.Pause(PauseMode::kHold), 0u);
  auto held = std::async(std::launch::async, [&] { return Gen(); });
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout) << "HOLD must queue requests";
  ASSERT_TRUE(e.Continue(0, In(absl::Seconds(5))).ok());
  auto r = held.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, Reference(c_, hf1_));

  e.Pause(PauseMode::kHold);
  auto timed = Gen(absl::Milliseconds(200));
  EXPECT_EQ(timed.status().code(), absl::StatusCode::kDeadlineExceeded) << timed.status();
  std::atomic<bool> gone{false};
  auto cancelled = std::async(
      std::launch::async, [&] { return e.Generate(kPrompt, 2, In(absl::Seconds(30)), [&] { return gone.load(); }); });
  absl::SleepFor(absl::Milliseconds(150));
  gone = true;
  EXPECT_EQ(cancelled.get().status().code(), absl::StatusCode::kCancelled);

  auto waiting = std::async(std::launch::async, [&] { return Gen(); });
  absl::SleepFor(absl::Milliseconds(150));
  e.Pause(PauseMode::kAbort);  // held requests fail too
  EXPECT_EQ(waiting.get().status().code(), absl::StatusCode::kUnavailable);
  auto refused = Gen();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), HasSubstr("paused for a weight sync (ABORT)"));
  EXPECT_EQ(e.Health().detail, "paused (ABORT)");
  ASSERT_TRUE(e.Continue(0, In(absl::Seconds(5))).ok());
  EXPECT_TRUE(Gen().ok());
}

TEST_F(CoreTest, HoldTimeoutGivesUnavailable) {
  EngineCoreOptions o = FastOptions();
  o.hold_timeout = absl::Milliseconds(200);
  MakeCores(1, o, true);
  cores_[0]->Pause(PauseMode::kHold);
  auto r = Gen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("giving up"));
}

TEST_F(CoreTest, InFlightRequestsFinishUnderHoldStopUnderAbortAndBlockFlush) {
  EngineCoreOptions o = FastOptions();
  o.step_delay = absl::Milliseconds(60);
  MakeCores(1, o, true);
  EngineCore& e = *cores_[0];
  auto running = std::async(std::launch::async, [&] { return Gen(); });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(e.Health().in_flight, 1u);
  auto flush = e.Flush();
  EXPECT_EQ(flush.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(flush.message(), HasSubstr("1 request(s) still running"));
  EXPECT_EQ(e.Pause(PauseMode::kHold), 1u);
  auto r = running.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, Reference(c_, hf1_));
  EXPECT_TRUE(e.Flush().ok());
  ASSERT_TRUE(e.Continue(0, In(absl::Seconds(5))).ok());

  running = std::async(std::launch::async, [&] { return Gen(); });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(e.Pause(PauseMode::kAbort), 1u);
  r = running.get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("aborted"));
  EXPECT_TRUE(e.Flush().ok());
}

TEST_F(CoreTest, ARequestNeverSpansTwoVersions) {
  EngineCoreOptions o = FastOptions();
  o.step_delay = absl::Milliseconds(40);
  MakeCores(1, o, true);
  EngineCore& e = *cores_[0];
  auto running = std::async(std::launch::async, [&] { return Gen(); });
  absl::SleepFor(absl::Milliseconds(60));
  e.Pause(PauseMode::kHold);
  // The forward pass reads the memory in place, so the agent writes only once Flush succeeds
  // (it retries while requests drain), then continues with the new version.
  EXPECT_EQ(e.Flush().code(), absl::StatusCode::kFailedPrecondition);
  auto r = running.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version, 0u);
  EXPECT_EQ(r->tokens, Reference(c_, hf1_));
  ASSERT_TRUE(e.Flush().ok());
  WriteVersion2(0);
  ASSERT_EQ(*e.Continue(2, In(absl::Seconds(10))), 2u);
  auto r2 = Gen();
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->version, 2u);
  EXPECT_EQ(r2->tokens, Reference(c_, hf2_));
}

TEST_F(CoreTest, ContinueWaitsForRunningRequestsOnlyUntilItsDeadline) {
  EngineCoreOptions o = FastOptions();
  o.step_delay = absl::Milliseconds(100);
  MakeCores(1, o, true);
  auto running = std::async(std::launch::async, [&] { return Gen(); });
  absl::SleepFor(absl::Milliseconds(50));
  auto cont = cores_[0]->Continue(5, In(absl::Milliseconds(100)));
  EXPECT_EQ(cont.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(running.get().ok());
  EXPECT_EQ(cores_[0]->version(), 0u);
  EXPECT_EQ(cores_[0]->Health().state, HealthInfo::State::kServing);
}

TEST_F(CoreTest, AFailedPrepareMakesTheRankUnhealthyUntilAGoodContinue) {
  MakeCores(1, FastOptions(), true);
  EngineCore& e = *cores_[0];
  e.Pause(PauseMode::kHold);
  WriteVersion2(0);
  Tensor& norm = params_[0].Mutable("model.layers.1.input_layernorm.weight");
  const uint16_t saved = norm.data_as<uint16_t>()[5];
  norm.data_as<uint16_t>()[5] = F32ToBF16(std::nanf(""));
  auto cont = e.Continue(3, In(absl::Seconds(5)));
  EXPECT_EQ(cont.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(cont.status().message(), HasSubstr("model.layers.1.input_layernorm.weight"));
  HealthInfo h = e.Health();
  EXPECT_EQ(h.state, HealthInfo::State::kUnhealthy);
  EXPECT_THAT(h.detail, HasSubstr("version 3 failed to prepare"));
  auto r = Gen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("unhealthy"));
  // Even the old version number re-prepares while unhealthy.
  EXPECT_EQ(e.Continue(0, In(absl::Seconds(5))).status().code(), absl::StatusCode::kDataLoss);
  norm.data_as<uint16_t>()[5] = saved;
  ASSERT_EQ(*e.Continue(3, In(absl::Seconds(5))), 3u);
  h = e.Health();
  EXPECT_EQ(h.state, HealthInfo::State::kServing);
  r = Gen();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, Reference(c_, hf2_));
  EXPECT_EQ(r->version, 3u);
}

TEST_F(CoreTest, TwoRanksComputeInLockstepAndOnlyRankZeroTakesRequests) {
  MakeCores(2, FastOptions(), true);
  for (int i = 0; i < 3; ++i) {
    auto r = Gen();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens, Reference(c_, hf1_));
  }
  auto f = cores_[1]->Generate(kPrompt, 2, In(absl::Seconds(1)), nullptr);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(f.status().message(), HasSubstr("send it to tp rank 0 at leader:1"));
  absl::SleepFor(absl::Milliseconds(300));  // heartbeats keep an idle group alive
  EXPECT_EQ(cores_[1]->Health().state, HealthInfo::State::kServing);
  EXPECT_TRUE(Gen().ok());
}

TEST_F(CoreTest, APausedPeerHoldsOrFailsTheRequest) {
  MakeCores(2, FastOptions(), true);
  cores_[1]->Pause(PauseMode::kHold);
  auto held = std::async(std::launch::async, [&] { return Gen(); });
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(400)), std::future_status::timeout);
  ASSERT_TRUE(cores_[1]->Continue(0, In(absl::Seconds(5))).ok());
  auto r = held.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, Reference(c_, hf1_));

  cores_[1]->Pause(PauseMode::kAbort);
  r = Gen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("tp rank 1 is paused for a weight sync (ABORT)"));
  ASSERT_TRUE(cores_[1]->Continue(0, In(absl::Seconds(5))).ok());
  EXPECT_TRUE(Gen().ok());
}

TEST_F(CoreTest, AnAbortOnAPeerStopsTheRunningRequestOnEveryRank) {
  EngineCoreOptions o = FastOptions();
  o.step_delay = absl::Milliseconds(60);
  MakeCores(2, o, true);
  auto running = std::async(std::launch::async, [&] { return Gen(); });
  absl::SleepFor(absl::Milliseconds(150));
  EXPECT_EQ(cores_[1]->Pause(PauseMode::kAbort), 1u);
  auto r = running.get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("tp rank 1 was paused for a weight sync (ABORT)"));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(cores_[1]->Flush().ok());
  ASSERT_TRUE(cores_[1]->Continue(0, In(absl::Seconds(5))).ok());
  EXPECT_TRUE(Gen().ok()) << "the group survives an aborted request";
}

TEST_F(CoreTest, RanksOnDifferentVersionsWaitThenFailOrAgree) {
  MakeCores(2, FastOptions(), true);
  // A sync committing rank by rank: rank 0 is on version 1 already, rank 1 still on 0.
  cores_[0]->Pause(PauseMode::kHold);
  WriteVersion2(0);
  ASSERT_EQ(*cores_[0]->Continue(1, In(absl::Seconds(5))), 1u);
  const absl::Time start = absl::Now();
  auto r = Gen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("different weight versions [rank 0: version 1, rank 1: version 0]"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(400));
  // Rank 1 catches up while the request waits: it is served, entirely on version 1.
  auto waiting = std::async(std::launch::async, [&] { return Gen(); });
  absl::SleepFor(absl::Milliseconds(150));
  cores_[1]->Pause(PauseMode::kHold);
  WriteVersion2(1);
  ASSERT_EQ(*cores_[1]->Continue(1, In(absl::Seconds(5))), 1u);
  r = waiting.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version, 1u);
  EXPECT_EQ(r->tokens, Reference(c_, hf2_));
}

TEST_F(CoreTest, APeerWithoutWeightsOrUnhealthyFailsTheRequest) {
  MakeCores(2, FastOptions(), true);
  cores_[1]->Pause(PauseMode::kHold);
  Tensor& norm = params_[1].Mutable("model.norm.weight");
  norm.data_as<uint16_t>()[0] = F32ToBF16(INFINITY);
  EXPECT_FALSE(cores_[1]->Continue(4, In(absl::Seconds(5))).ok());
  auto r = Gen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("tp rank 1 is unhealthy"));
}

TEST_F(CoreTest, ShutdownOfRankZeroStopsTheFollowersAndALostPeerBreaksTheGroup) {
  MakeCores(2, FastOptions(), true);
  std::promise<void> told;
  cores_[1]->SetShutdownCallback([&] { told.set_value(); });
  cores_[0]->Shutdown();
  EXPECT_EQ(told.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(Gen().status().code(), absl::StatusCode::kUnavailable);
  cores_[1]->Shutdown();

  MakeCores(2, FastOptions(), true);
  cores_[1]->Shutdown();  // a follower goes away: rank 0's next collective fails
  auto r = Gen();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  const HealthInfo h = cores_[0]->Health();
  EXPECT_EQ(h.state, HealthInfo::State::kUnhealthy);
  EXPECT_THAT(h.detail, HasSubstr("TP group is broken"));
  EXPECT_EQ(cores_[0]->Continue(0, In(absl::Seconds(1))).status().code(), absl::StatusCode::kUnavailable);
}

// A restarted rank whose agent is about to commit a newer version holds requests until then (it
// never serves its older weights meanwhile); a promise that is already kept, or withdrawn, holds
// nothing.
TEST_F(CoreTest, AHoldForCatchUpLastsUntilTheAgentsContinue) {
  MakeCores(1, FastOptions(), true);
  EngineCore& e = *cores_[0];
  e.HoldForCatchUp(3);
  EXPECT_EQ(e.Health().state, HealthInfo::State::kPaused);
  auto held = std::async(std::launch::async, [&] { return Gen(); });
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  e.Pause(PauseMode::kHold);  // the agent's catch-up
  ASSERT_TRUE(e.Flush().ok());
  WriteVersion2(0);
  ASSERT_EQ(*e.Continue(3, In(absl::Seconds(5))), 3u);
  auto r = held.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version, 3u);
  EXPECT_EQ(r->tokens, Reference(c_, hf2_));

  e.HoldForCatchUp(2);  // already there
  EXPECT_EQ(e.Health().state, HealthInfo::State::kServing);
  e.HoldForCatchUp(5);
  EXPECT_EQ(e.Health().state, HealthInfo::State::kPaused);
  e.HoldForCatchUp(0);  // registered again with an agent that holds nothing
  EXPECT_EQ(e.Health().state, HealthInfo::State::kServing);
  r = Gen();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version, 3u);
  e.Pause(PauseMode::kAbort);
  e.HoldForCatchUp(0);  // an explicit Pause is not released by it
  EXPECT_EQ(e.Health().state, HealthInfo::State::kPaused);
}

// One rank of a TP 2 engine dies and comes back as a new process with its own weights (here: a new
// core over fresh memory): rank 0 notices, re-forms the group under a new epoch with the newcomer
// (RunTpGroup), keeps its weights, and serves again once both ranks hold the same version.
TEST_F(CoreTest, ARestartedRankRejoinsTheReformedGroup) {
  EngineCoreOptions o = FastOptions();
  MakeCores(1, o, true);  // just the config; the two ranks are built below
  cores_.clear();
  params_.clear();
  params_.resize(2);
  auto make_rank = [&](int r, const TensorMap& hf) -> std::unique_ptr<EngineCore> {
    EngineRank er;
    er.tp_size = 2;
    er.tp_rank = r;
    auto p = EngineParamsForRank(c_, er, hf);
    EXPECT_TRUE(p.ok()) << p.status();
    params_[static_cast<size_t>(r)] = std::move(*p);
    auto core = ref_engine::CreateEngineCore(c_, er, params_[static_cast<size_t>(r)].Lookup(), o);
    EXPECT_TRUE(core.ok()) << core.status();
    EXPECT_TRUE((*core)->PrepareInitial(0, "test checkpoint").ok());
    return *std::move(core);
  };
  struct Former {
    std::atomic<bool> stop{false};
    std::thread thread;
    void Start(EngineCore* core, comm::Store* store, int rank) {
      TpGroupOptions g;
      g.engine_id = "unit";
      g.tp_rank = rank;
      g.tp_size = 2;
      g.address = absl::StrCat("rank", rank, ":1");
      g.join_timeout = absl::Seconds(20);
      thread = std::thread([this, core, store, g] { RunTpGroup(core, store, g, [this] { return stop.load(); }); });
    }
    void Stop() {
      stop = true;
      if (thread.joinable()) thread.join();
    }
    ~Former() { Stop(); }
  } f0, f1;
  auto serve_within = [&](absl::Duration d) {
    absl::StatusOr<GenerateResult> r = absl::UnavailableError("not tried");
    for (const absl::Time until = In(d); absl::Now() < until; absl::SleepFor(absl::Milliseconds(50))) {
      r = Gen(absl::Seconds(5));
      if (r.ok()) break;
    }
    return r;
  };
  cores_.push_back(make_rank(0, hf1_));
  cores_.push_back(make_rank(1, hf1_));
  f0.Start(cores_[0].get(), &store_, 0);
  f1.Start(cores_[1].get(), &store_, 1);
  const std::vector<int32_t> want = Reference(c_, hf1_);
  auto r = serve_within(absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, want);

  // Rank 1 dies: its group is aborted (as a killed process's sockets close).
  f1.Stop();
  cores_[1]->Shutdown();
  for (const absl::Time until = In(absl::Seconds(10));
       absl::Now() < until && cores_[0]->Health().detail.find("re-forming") == std::string::npos;)
    absl::SleepFor(absl::Milliseconds(20));  // broken first, then re-forming
  HealthInfo h = cores_[0]->Health();
  EXPECT_EQ(h.state, HealthInfo::State::kUnhealthy);
  EXPECT_THAT(h.detail, HasSubstr("TP group is re-forming"));
  EXPECT_EQ(h.version, 0u) << "rank 0 keeps its weights";
  r = Gen(absl::Seconds(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();

  // It comes back (new memory, new process state): the group re-forms and the engine serves again.
  cores_[1] = make_rank(1, hf1_);
  f1.stop = false;
  f1.Start(cores_[1].get(), &store_, 1);
  r = serve_within(absl::Seconds(20));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, want);
  EXPECT_EQ(cores_[0]->Health().state, HealthInfo::State::kServing);
  auto epoch = store_.Get("wsync-engine/unit/tp/epoch", absl::ZeroDuration());
  ASSERT_TRUE(epoch.ok());
  EXPECT_THAT(*epoch, ::testing::EndsWith("-2")) << "the second formation of rank 0's instance";

  // (A killed rank 0 comes back with a new store and instance id: ref_engine_test, with processes;
  // here rank 0's Shutdown would stop the followers, as it should.)
  f0.Stop();
  f1.Stop();
}

TEST_F(CoreTest, GroupFormationFailureIsUnhealthy) {
  EngineRank er;
  er.tp_size = 2;
  auto core = ref_engine::CreateEngineCore(c_, er, hf1_.Lookup(), FastOptions());
  ASSERT_TRUE(core.ok());
  EXPECT_EQ((*core)->Health().state, HealthInfo::State::kUnhealthy);
  EXPECT_THAT((*core)->Health().detail, HasSubstr("forming"));
  EXPECT_EQ((*core)->Generate(kPrompt, 1, In(absl::Seconds(1)), nullptr).status().code(),
            absl::StatusCode::kUnavailable);
  (*core)->GroupFailed(absl::DeadlineExceededError("waiting for [x/joined/1]"));
  EXPECT_THAT((*core)->Health().detail, HasSubstr("could not be formed"));
}

}  // namespace
}  // namespace wsync::engine_side
