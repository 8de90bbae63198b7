// The rollout agent as a process (build/bin/wsync-rollout-agent), driven over real gRPC on
// loopback the way the coordinator drives it, fed over a real Gloo group by a trainer-side driver
// (rank 0 of the stage group, BucketSender), writing into a fake engine's real POSIX shm memory:
//   * a whole INT4 Qwen3-MoE sync: the engine memory equals a local Commit of the sent tensors bit
//     for bit, its dequantized weights equal the HF oracle, the recording holds exactly the sent
//     tensors, versions / UpdateWeights / metrics / engine call order behave;
//   * every failure (corrupt checksum, unknown name, wrong shape, missing tensor, a sender dying
//     mid-stream, AbortSync during the transfer, a bucket of another version, flush refused until
//     the deadline, a coordinator that goes silent) leaves the engine memory byte-identical (XXH3)
//     and the engine continued on its previous version, and the agent serves the next sync;
//   * a wrong or missing token is refused and changes nothing; mismatched re-registration is refused;
//   * engine TP 2 (EP 2): two engines, two agents, one group of three;
//   * Join / heartbeats / re-join / Leave at a (fake) coordinator; SIGTERM mid-sync.
// Seeds of the generated checkpoints are fixed below.
#include "rollout_agent/agent/rollout_agent.h"

#include <httplib.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine_memory/param_arena.h"
#include "engine_model/loader.h"
#include "engine_model/repack.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dispatch.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"
#include "rollout_agent/receive/testing/sync_testing.h"
#include "rollout_fakes.h"

namespace wsync::rollout_agent {
using engine_memory::ParamArena;
using engine_memory::UniqueShmName;
using engine_model::DequantizeToDense;
using engine_model::EngineBuffer;
using engine_model::EngineLayout;
using engine_model::EngineLinear;
using engine_model::EngineParam;
using engine_model::OwnedEngineWeights;
using engine_model::ParamForm;
using engine_model::ParamRole;
using engine_model::Staging;

namespace {

namespace fs = std::filesystem;
using model::testing::HfModel;
using testing::AgentProcess;
using testing::Context;
using ::testing::ElementsAre;
using testing::FakeEngine;
using ::testing::HasSubstr;
using testing::TrainerSide;
using testing::WaitUntil;

constexpr uint32_t kSeedV1 = 20261101;  // the engine's initial weights
constexpr uint32_t kSeedV2 = 20261102;  // the first sync
constexpr uint32_t kSeedV3 = 20261103;  // later syncs
constexpr uint64_t kBucketBytes = 192 << 10;

using Tensors = std::vector<std::pair<std::string, TensorView>>;

Tensors SentTensors(const model::testing::HfModel& m) {
  Tensors t;
  for (const auto& name : m.order) t.emplace_back(name, m.sent.at(name).view());
  return t;
}

// `mac`: tag every bucket (the stream's BucketMac); none: unauthenticated buckets.
std::function<absl::Status(comm::Communicator&)> SendAll(Tensors tensors, uint64_t version, uint32_t pp_stage = 0,
                                                         std::optional<comm::BucketMac> mac = std::nullopt) {
  auto buckets = std::make_shared<std::vector<testing::PackedBucket>>();
  auto packed = testing::PackBuckets(tensors, {.version = version, .pp_stage = pp_stage, .bucket_bytes = kBucketBytes});
  if (packed.ok()) *buckets = std::move(*packed);
  return [buckets, st = packed.status(), mac](comm::Communicator& c) -> absl::Status {
    if (!st.ok()) return st;
    return testing::SendBuckets(c, std::move(*buckets), mac);
  };
}

class RolloutAgentTest : public ::testing::Test {
 public:
  void SetUp() override {
    name_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    dir_ = absl::StrCat(::testing::TempDir(), "/rollout-agent-", getpid(), "-", name_);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    sec_.token = absl::StrCat("token-", name_, "-", getpid());
    token_file_ = dir_ + "/token";
    std::ofstream(token_file_) << sec_.token << "\n";
    record_dir_ = dir_ + "/record";
    config_json_ = model::testing::kQwen3MoeJson;
    quant_json_ = model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"});
    auto config = ParseModelConfig(config_json_, "qwen3_moe");
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    auto quant = ParseQuantizationConfig(quant_json_, "quant");
    ASSERT_TRUE(quant.ok()) << quant.status();
    quant_ = *quant;
    auto trainer = TrainerSide::Start(sec_);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    trainer_ = std::move(*trainer);
  }

  void TearDown() override {
    if (HasFailure()) {
      for (size_t i = 0; i < agents_.size(); ++i) {
        if (agents_[i]) std::cerr << "---- agent " << i << " log ----\n" << agents_[i]->Log() << "\n";
      }
    }
    for (auto& a : agents_) a->Terminate();
    if (!HasFailure()) {
      for (auto& a : agents_) a->RemoveFiles();
      fs::remove_all(dir_);
    }
    agents_.clear();
    engines_.clear();
  }

  const model::testing::HfModel& Model(uint32_t seed) {
    auto it = models_.find(seed);
    if (it == models_.end()) {
      auto m = model::testing::MakeHfModel(config_, &quant_, seed);
      EXPECT_TRUE(m.ok()) << m.status();
      it = models_.emplace(seed, std::move(*m)).first;
    }
    return it->second;
  }

  // The engine form of `model` for `layout`, computed here with the library (Load + Commit).
  std::unique_ptr<engine_model::OwnedEngineWeights> Reference(const EngineLayout& layout,
                                                              const model::testing::HfModel& model) {
    auto staging = Staging::Create(layout);
    EXPECT_TRUE(staging.ok());
    engine_model::Loader loader(staging->get());
    for (const auto& name : model.order) EXPECT_TRUE(loader.Load(name, model.sent.at(name).view()).ok()) << name;
    auto owned = OwnedEngineWeights::Allocate(layout);
    EXPECT_TRUE(owned.ok());
    absl::Status s = engine_model::Commit(**staging, (*owned)->weights());
    EXPECT_TRUE(s.ok()) << s;
    return std::move(*owned);
  }

  // Every param of the engine's shm equals the reference, byte for byte.
  void ExpectEngineHolds(FakeEngine& e, const model::testing::HfModel& model) {
    auto ref = Reference(e.layout(), model);
    int differ = 0;
    for (const EngineBuffer& b : ref->weights().buffers()) {
      const EngineBuffer* got = e.memory().weights().Find(b.name);
      ASSERT_NE(got, nullptr) << b.name;
      ASSERT_EQ(got->nbytes, b.nbytes);
      if (std::memcmp(got->data, b.data, b.nbytes) != 0 && ++differ <= 5) ADD_FAILURE() << b.name << " differs";
    }
    EXPECT_EQ(differ, 0);
  }

  // Starts engine `rank` of `tp` (EP `ep`) holding version 1 (seed kSeedV1), and its agent.
  std::string heartbeat_ms_ = "100";  // the agents' --heartbeat-ms

  void StartRank(int tp, int rank, int ep, std::vector<std::string> extra_args = {}) {
    FakeEngine::Options o;
    o.config_json = config_json_;
    o.quant_json = quant_json_;
    o.parallel = {tp, rank, ep};
    o.version = 1;
    o.security = sec_;
    auto engine = FakeEngine::Start(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    // Version 1 in the engine's memory, as if it had started from that checkpoint.
    auto ref = Reference((*engine)->layout(), Model(kSeedV1));
    for (const EngineBuffer& b : ref->weights().buffers()) {
      std::memcpy((*engine)->memory().weights().Find(b.name)->data, b.data, b.nbytes);
    }
    std::vector<std::string> args = {
        "--token-file",   token_file_,
        "--record-dir",   shared_record_ ? record_dir_ + "shared" : record_dir_ + std::to_string(rank),
        "--heartbeat-ms", heartbeat_ms_,
        "--bucket-mac",   bucket_mac_};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    auto agent = AgentProcess::Start(WSYNC_ROLLOUT_AGENT, absl::StrCat(name_, "-", rank), args, sec_);
    ASSERT_TRUE(agent.ok()) << agent.status();
    grpc::Status reg = (*engine)->Register((*agent)->address());
    ASSERT_TRUE(reg.ok()) << reg.error_message() << "\n" << (*agent)->Log();
    engines_.push_back(std::move(*engine));
    agents_.push_back(std::move(*agent));
  }

  v1::BeginSyncRequest BeginRequest(uint64_t id, uint64_t version, int rank, int agents, bool record = false,
                                    uint64_t timeout_ms = 30000) {
    v1::BeginSyncRequest r;
    r.set_sync_id(id);
    r.set_version(version);
    r.set_backend("gloo");
    r.set_store_address(trainer_->store_address());
    r.set_agent_rank(static_cast<uint32_t>(rank));
    auto* g = r.add_groups();
    g->set_pp_stage(0);
    g->set_name(absl::StrCat(name_, "/sync", id, "/pp0"));
    g->set_size(static_cast<uint32_t>(agents + 1));
    r.set_timeout_ms(timeout_ms);
    r.set_record(record);
    return r;
  }
  std::string GroupName(uint64_t id) const { return absl::StrCat(name_, "/sync", id, "/pp0"); }

  grpc::Status Begin(AgentProcess& a, const v1::BeginSyncRequest& req, v1::BeginSyncReply* reply = nullptr) {
    v1::BeginSyncReply r;
    auto ctx = rollout_agent::testing::Context(a.security());
    return a.stub().BeginSync(ctx.get(), req, reply ? reply : &r);
  }
  grpc::Status Prepare(AgentProcess& a, uint64_t id, v1::PrepareSyncReply* reply = nullptr,
                       absl::Duration timeout = absl::Seconds(60)) {
    v1::PrepareSyncRequest req;
    req.set_sync_id(id);
    v1::PrepareSyncReply r;
    auto ctx = rollout_agent::testing::Context(a.security(), timeout);
    return a.stub().PrepareSync(ctx.get(), req, reply ? reply : &r);
  }
  grpc::Status CommitRpc(AgentProcess& a, uint64_t id, v1::CommitSyncReply* reply = nullptr) {
    v1::CommitSyncRequest req;
    req.set_sync_id(id);
    v1::CommitSyncReply r;
    auto ctx = rollout_agent::testing::Context(a.security());
    return a.stub().CommitSync(ctx.get(), req, reply ? reply : &r);
  }
  grpc::Status AbortRpc(AgentProcess& a, uint64_t id, v1::AbortSyncReply* reply = nullptr) {
    v1::AbortSyncRequest req;
    req.set_sync_id(id);
    req.set_reason("test abort");
    v1::AbortSyncReply r;
    auto ctx = rollout_agent::testing::Context(a.security());
    return a.stub().AbortSync(ctx.get(), req, reply ? reply : &r);
  }
  // A fake engine and the agent library in-process (AgentServer), the engine registered with it.
  void StartInProcess(std::unique_ptr<FakeEngine>* engine, std::unique_ptr<AgentServer>* server) {
    FakeEngine::Options o;
    o.config_json = config_json_;
    o.quant_json = quant_json_;
    o.security = sec_;
    auto e = FakeEngine::Start(o);
    ASSERT_TRUE(e.ok()) << e.status();
    rollout_agent::AgentOptions ao;
    ao.security = sec_;
    auto a = AgentServer::Start("127.0.0.1:0", ao);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE((*e)->Register((*a)->address()).ok());
    *engine = *std::move(e);
    *server = *std::move(a);
  }
  v1::AgentStatusReply Status(AgentProcess& a) {
    v1::AgentStatusReply r;
    auto ctx = rollout_agent::testing::Context(a.security());
    grpc::Status s = a.stub().AgentStatus(ctx.get(), v1::AgentStatusRequest(), &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return r;
  }
  grpc::Status UpdateWeights(AgentProcess& a, uint64_t min_version, absl::Duration timeout, uint64_t* version) {
    v1::UpdateWeightsRequest req;
    req.set_min_version(min_version);
    v1::UpdateWeightsReply r;
    auto ctx = rollout_agent::testing::Context(a.security(), timeout);
    grpc::Status s = a.stub().UpdateWeights(ctx.get(), req, &r);
    *version = r.version();
    return s;
  }

  // A whole successful sync of `model` as `version` on every started rank.
  void SyncAll(uint64_t id, uint64_t version, const model::testing::HfModel& model, bool record = false) {
    const int n = static_cast<int>(agents_.size());
    for (int r = 0; r < n; ++r) {
      grpc::Status s = Begin(*agents_[r], BeginRequest(id, version, r + 1, n, record));
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.error_message();
    }
    trainer_->Run(GroupName(id), n + 1, SendAll(SentTensors(model), version));
    for (int r = 0; r < n; ++r) {
      grpc::Status s = Prepare(*agents_[r], id);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.error_message();
    }
    ASSERT_TRUE(trainer_->Join().ok());
    for (int r = 0; r < n; ++r) {
      v1::CommitSyncReply reply;
      grpc::Status s = CommitRpc(*agents_[r], id, &reply);
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.error_message();
      EXPECT_EQ(reply.version(), version);
    }
  }

  std::string name_, dir_, token_file_, record_dir_, config_json_, quant_json_;
  RpcSecurity sec_;
  bool shared_record_ = false;  // every agent records into record_dir_ + "shared"
  ModelConfig config_;
  QuantizationConfig quant_;
  std::map<uint32_t, model::testing::HfModel> models_;
  std::unique_ptr<rollout_agent::testing::TrainerSide> trainer_;
  // The agents' --bucket-mac. With a token it would be on ("auto"); these tests' fake trainer sends
  // unauthenticated buckets unless a test gives SendAll a BucketMac (AuthenticatedBuckets... below).
  std::string bucket_mac_ = "off";
  std::vector<std::unique_ptr<rollout_agent::testing::FakeEngine>> engines_;
  std::vector<std::unique_ptr<rollout_agent::testing::AgentProcess>> agents_;
};

// --- the dequantized oracle (engine TP 1) -------------------------------------------------------------

// The HF-orientation dense value of an engine linear at TP 1, from the HF checkpoint's dense
// tensors: fused layers concatenated, experts stacked, the vocab padded with zero rows.
std::vector<float> OracleDense(const EngineLinear& lin, const model::testing::HfModel& m, int64_t padded_rows) {
  auto dense = [&](const std::string& name) -> const Tensor& { return m.dense.at(name); };
  auto append = [](std::vector<float>& out, const Tensor& t) {
    const float* p = reinterpret_cast<const float*>(t.view().data());
    out.insert(out.end(), p, p + t.view().numel());
  };
  std::vector<float> out;
  const std::string& n = lin.name;
  auto prefix = [&](absl::string_view suffix) { return n.substr(0, n.size() - suffix.size()); };
  if (absl::EndsWith(n, "self_attn.qkv_proj.weight")) {
    const std::string p = prefix("qkv_proj.weight");
    for (const char* part : {"q_proj", "k_proj", "v_proj"}) append(out, dense(absl::StrCat(p, part, ".weight")));
  } else if (absl::EndsWith(n, "mlp.gate_up_proj.weight")) {
    const std::string p = prefix("gate_up_proj.weight");
    for (const char* part : {"gate_proj", "up_proj"}) append(out, dense(absl::StrCat(p, part, ".weight")));
  } else if (absl::EndsWith(n, "mlp.experts.w13_weight")) {
    const std::string p = prefix("w13_weight");
    for (int64_t e = 0; e < lin.experts; ++e)
      for (const char* part : {"gate_proj", "up_proj"}) append(out, dense(absl::StrCat(p, e, ".", part, ".weight")));
  } else if (absl::EndsWith(n, "mlp.experts.w2_weight")) {
    const std::string p = prefix("w2_weight");
    for (int64_t e = 0; e < lin.experts; ++e) append(out, dense(absl::StrCat(p, e, ".down_proj.weight")));
  } else {
    append(out, dense(n));
  }
  if (padded_rows > 0) out.resize(static_cast<size_t>(padded_rows * lin.k), 0.0f);
  return out;
}

void ExpectMatchesHfOracle(rollout_agent::testing::FakeEngine& e, const model::testing::HfModel& m) {
  const EngineLayout& layout = e.layout();
  ASSERT_EQ(layout.parallel().tp_size, 1);
  int quantized = 0;
  for (const EngineLinear& lin : layout.linears()) {
    auto got = DequantizeToDense(layout, lin.name, e.memory().weights());
    ASSERT_TRUE(got.ok()) << lin.name << ": " << got.status();
    const int64_t padded = lin.role == ParamRole::kVocab ? lin.n : 0;
    const std::vector<float> want = OracleDense(lin, m, padded);
    ASSERT_EQ(static_cast<int64_t>(want.size()), got->view().numel()) << lin.name;
    EXPECT_EQ(std::memcmp(got->view().data(), want.data(), want.size() * 4), 0) << lin.name;
    quantized += lin.quantized;
  }
  EXPECT_GT(quantized, 0);
  // Plain params that are HF tensors (norms, embeddings): the sent bytes, zero padding after.
  int plain = 0;
  for (const EngineParam& p : layout.params()) {
    if (p.linear >= 0 || !m.sent.contains(p.name)) continue;
    const TensorView sent = m.sent.at(p.name).view();
    const EngineBuffer* b = e.memory().weights().Find(p.name);
    ASSERT_NE(b, nullptr);
    ASSERT_GE(b->nbytes, sent.nbytes()) << p.name;
    EXPECT_EQ(std::memcmp(b->data, sent.data(), sent.nbytes()), 0) << p.name;
    const auto* tail = static_cast<const unsigned char*>(b->data) + sent.nbytes();
    EXPECT_TRUE(std::all_of(tail, tail + (b->nbytes - sent.nbytes()), [](unsigned char c) { return c == 0; }))
        << p.name;
    ++plain;
  }
  EXPECT_GT(plain, 5);
}

// Every tensor of DIR, by name.
std::map<std::string, std::pair<DType, std::string>> ReadRecording(const std::string& dir,
                                                                   std::set<std::string>* files) {
  std::map<std::string, std::pair<DType, std::string>> out;
  std::vector<SafetensorsFile> keep;
  for (const auto& f : fs::directory_iterator(dir)) {
    files->insert(f.path().filename().string());
    auto file = SafetensorsFile::Open(f.path().string());
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) continue;
    for (const auto& t : file->tensors()) {
      EXPECT_FALSE(out.contains(t.name)) << t.name << " recorded twice";
      out[t.name] = {t.view.dtype(), std::string(reinterpret_cast<const char*>(t.view.data()), t.view.nbytes()) + "|" +
                                         ShapeToString(t.view.shape())};
    }
  }
  return out;
}

std::string Metrics(const std::string& log) {
  const size_t at = log.find("metrics on 127.0.0.1:");
  if (at == std::string::npos) return "";
  const int port = std::atoi(log.c_str() + at + std::strlen("metrics on 127.0.0.1:"));
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/metrics");
  return res && res->status == 200 ? res->body : "";
}

// --- the whole sync -----------------------------------------------------------------------------------

TEST_F(RolloutAgentTest, AWholeInt4SyncLandsInTheEngineBitExact) {
  StartRank(1, 0, 1, {"--metrics-port", "0"});
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const model::testing::HfModel& v2 = Model(kSeedV2);
  EXPECT_EQ(Status(agent).state(), "idle");
  EXPECT_EQ(Status(agent).version(), 1u);
  const uint64_t before = engine.memory().Checksum().value();

  v1::BeginSyncReply begun;
  ASSERT_TRUE(Begin(agent, BeginRequest(7, 2, 1, 1, /*record=*/true), &begun).ok());
  EXPECT_EQ(begun.previous_version(), 1u);
  EXPECT_TRUE(engine.calls().empty()) << "the engine serves while the sync is received and staged";
  EXPECT_FALSE(engine.paused());
  EXPECT_EQ(Status(agent).state(), "receiving");
  // The same BeginSync again is a no-op.
  ASSERT_TRUE(Begin(agent, BeginRequest(7, 2, 1, 1, true), &begun).ok());
  EXPECT_EQ(begun.previous_version(), 1u);
  EXPECT_TRUE(engine.calls().empty());

  auto buckets = testing::PackBuckets(SentTensors(v2), {.version = 2, .bucket_bytes = kBucketBytes});
  ASSERT_TRUE(buckets.ok());
  const size_t num_buckets = buckets->size();
  uint64_t bytes = 0;
  for (const auto& b : *buckets) bytes += b.nbytes;
  trainer_->Run(GroupName(7), 2, SendAll(SentTensors(v2), 2));
  v1::PrepareSyncReply prepared;
  grpc::Status ps = Prepare(agent, 7, &prepared);
  ASSERT_TRUE(ps.ok()) << ps.error_message();
  ASSERT_TRUE(trainer_->Join().ok());
  EXPECT_EQ(prepared.buckets(), num_buckets);
  EXPECT_GT(num_buckets, 5u);
  EXPECT_EQ(prepared.bytes(), bytes);
  EXPECT_EQ(prepared.tensors(), v2.order.size());
  EXPECT_GT(prepared.transfer_seconds(), 0.0);
  EXPECT_GT(prepared.load_seconds(), 0.0);
  EXPECT_EQ(engine.memory().Checksum().value(), before) << "PrepareSync must not touch the engine";
  EXPECT_TRUE(engine.calls().empty()) << "the engine is paused only to commit";
  EXPECT_EQ(Status(agent).state(), "prepared");
  // Prepare again: the same answer.
  v1::PrepareSyncReply again;
  ASSERT_TRUE(Prepare(agent, 7, &again).ok());
  EXPECT_EQ(again.SerializeAsString(), prepared.SerializeAsString());

  // An engine waiting for version 2 is woken by the commit.
  uint64_t waited = 0;
  grpc::Status wait_status;
  std::thread waiter([&] { wait_status = UpdateWeights(agent, 2, absl::Seconds(30), &waited); });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(waited, 0u);
  v1::CommitSyncReply committed;
  grpc::Status cs = CommitRpc(agent, 7, &committed);
  ASSERT_TRUE(cs.ok()) << cs.error_message();
  waiter.join();
  EXPECT_TRUE(wait_status.ok()) << wait_status.error_message();
  EXPECT_EQ(waited, 2u);
  EXPECT_EQ(committed.version(), 2u);
  EXPECT_GT(committed.repack_seconds(), 0.0);
  // Downtime: Pause sent -> Continue answered, i.e. the commit alone (at least the repack).
  EXPECT_GE(committed.downtime_seconds(), committed.repack_seconds());
  EXPECT_LT(committed.downtime_seconds(), committed.repack_seconds() + committed.continue_seconds() + 5.0);
  EXPECT_THAT(engine.calls(), ElementsAre("pause:HOLD", "flush", "continue:2"));
  EXPECT_FALSE(engine.paused());
  EXPECT_EQ(engine.version(), 2u);

  ExpectEngineHolds(engine, v2);
  ExpectMatchesHfOracle(engine, v2);
  {
    // What wsyncctl verify reads: every param's XXH3 of the engine memory, the version, the config.
    v1::EngineChecksumsReply sums;
    auto ctx = rollout_agent::testing::Context(sec_);
    grpc::Status s = agent.stub().EngineChecksums(ctx.get(), v1::EngineChecksumsRequest(), &sums);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(sums.version(), 2u);
    EXPECT_EQ(sums.engine_id(), "engine-a");
    EXPECT_EQ(sums.ep_size(), 1u);
    EXPECT_EQ(sums.model_config_json(), config_json_);
    EXPECT_EQ(sums.quantization_config_json(), quant_json_);
    auto ref = Reference(engine.layout(), v2);
    ASSERT_EQ(static_cast<size_t>(sums.params_size()), ref->weights().size());
    for (const v1::ParamChecksum& p : sums.params()) {
      const EngineBuffer* b = ref->weights().Find(p.name());
      ASSERT_NE(b, nullptr) << p.name();
      EXPECT_EQ(p.nbytes(), b->nbytes);
      EXPECT_EQ(p.xxh3_64(), Xxh3_64({static_cast<const std::byte*>(b->data), b->nbytes})) << p.name();
    }
  }

  // The recording is exactly what was sent.
  std::set<std::string> files;
  auto recorded = ReadRecording(record_dir_ + "0/v2", &files);
  EXPECT_EQ(files.size(), num_buckets);
  EXPECT_TRUE(files.contains("pp0-00000.safetensors"));
  ASSERT_EQ(recorded.size(), v2.sent.size());
  for (const auto& [name, t] : v2.sent) {
    auto it = recorded.find(name);
    ASSERT_NE(it, recorded.end()) << name;
    EXPECT_EQ(it->second.first, t.dtype()) << name;
    EXPECT_EQ(it->second.second,
              std::string(reinterpret_cast<const char*>(t.view().data()), t.nbytes()) + "|" + ShapeToString(t.shape()))
        << name;
  }
  std::vector<std::string> entries;
  for (const auto& f : fs::directory_iterator(record_dir_ + "0")) entries.push_back(f.path().filename().string());
  EXPECT_THAT(entries, ElementsAre("v2"));

  // Versions.
  uint64_t v = 0;
  EXPECT_TRUE(UpdateWeights(agent, 0, absl::Seconds(5), &v).ok());
  EXPECT_EQ(v, 2u);
  grpc::Status late = UpdateWeights(agent, 3, absl::Milliseconds(400), &v);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::AgentStatusReply st = Status(agent);
  EXPECT_EQ(st.state(), "idle");
  EXPECT_EQ(st.version(), 2u);
  EXPECT_EQ(st.engine_id(), "engine-a");
  EXPECT_EQ(st.tp_size(), 1u);
  // Commit again: idempotent; Begin of the finished sync: refused.
  v1::CommitSyncReply twice;
  EXPECT_TRUE(CommitRpc(agent, 7, &twice).ok());
  EXPECT_EQ(twice.version(), 2u);
  EXPECT_EQ(Begin(agent, BeginRequest(7, 3, 1, 1)).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  const std::string metrics = Metrics(agent.Log());
  EXPECT_THAT(metrics, HasSubstr("wsync_rollout_syncs_total 1"));
  EXPECT_THAT(metrics, HasSubstr("wsync_rollout_weight_version 2"));
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat("wsync_rollout_received_bytes_total ", bytes)));
  EXPECT_THAT(metrics, HasSubstr("wsync_rollout_phase_seconds_count{phase=\"repack\"} 1"));

  // The next version on top.
  const model::testing::HfModel& v3 = Model(kSeedV3);
  SyncAll(8, 3, v3);
  ExpectEngineHolds(engine, v3);
  EXPECT_EQ(engine.version(), 3u);

  // A delta sync from a version the staging does not hold is refused before anything starts (the
  // agent stays idle, the engine on version 3); one from the version it holds begins.
  auto wrong = BeginRequest(9, 4, 1, 1);
  wrong.set_delta_base(2);
  grpc::Status refused = Begin(agent, wrong);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("a delta from version 2, and this agent's staging holds version 3"));
  EXPECT_EQ(Status(agent).state(), "idle");
  auto right = BeginRequest(10, 4, 1, 1);
  right.set_delta_base(3);
  ASSERT_TRUE(Begin(agent, right).ok());
  ASSERT_TRUE(AbortRpc(agent, 10).ok());
  ExpectEngineHolds(engine, v3);
  EXPECT_EQ(engine.version(), 3u);
}

// --- failures -----------------------------------------------------------------------------------------

struct FailureCase {
  std::string label;
  // Sends (or fails to send) the stream; `agent` lets a case act on the agent mid-stream.
  std::function<absl::Status(comm::Communicator&, const Tensors&, uint64_t version)> send;
  grpc::StatusCode prepare_code;
  std::string message;
  bool sender_fails = false;
  std::function<void(RolloutAgentTest*, rollout_agent::testing::AgentProcess&, uint64_t id)>
      during;  // optional, after Begin
};

TEST_F(RolloutAgentTest, EveryFailureLeavesTheEngineOnItsPreviousVersion) {
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const model::testing::HfModel& v2 = Model(kSeedV2);
  const Tensors good = SentTensors(v2);
  auto pack = [](const Tensors& t, uint64_t version) {
    auto b = testing::PackBuckets(t, {.version = version, .bucket_bytes = kBucketBytes});
    return b.ok() ? std::move(*b) : std::vector<testing::PackedBucket>();
  };
  // A small stall point shared by the cases that act mid-stream.
  auto stall = std::make_shared<std::atomic<bool>>(false);

  std::vector<FailureCase> cases;
  cases.push_back({"corrupt checksum",
                   [&](comm::Communicator& c, const Tensors& t, uint64_t v) -> absl::Status {
                     auto b = pack(t, v);
                     RETURN_IF_ERROR(testing::SendRawBucket(c, b[0].manifest, b[0].data, b[0].nbytes, false));
                     return testing::SendRawBucket(c, b[1].manifest, b[1].data, b[1].nbytes, true);
                   },
                   grpc::StatusCode::DATA_LOSS, "stage 0 bucket 1: checksum mismatch"});
  cases.push_back({"unknown tensor",
                   [&](comm::Communicator& c, const Tensors& t, uint64_t v) {
                     Tensors u = t;
                     u.insert(u.begin() + 3, {"model.layers.0.mlp.bogus.weight", t[0].second});
                     return testing::SendBuckets(c, pack(u, v));
                   },
                   grpc::StatusCode::INVALID_ARGUMENT, "model.layers.0.mlp.bogus.weight", /*sender_fails=*/true});
  auto wrong = std::make_shared<Tensor>(*Tensor::Zeros(DType::kBF16, {128}));
  cases.push_back({"wrong shape",
                   [&, wrong](comm::Communicator& c, const Tensors& t, uint64_t v) {
                     Tensors u = t;
                     for (auto& [name, view] : u)
                       if (name == "model.norm.weight") view = wrong->view();
                     return testing::SendBuckets(c, pack(u, v));
                   },
                   grpc::StatusCode::INVALID_ARGUMENT, "model.norm.weight",
                   // The bad tensor sits in the last bucket: the sender may be done before the agent
                   // loads it. PrepareSync is where the coordinator learns of it.
                   /*sender_fails=*/false});
  cases.push_back({"missing tensor",
                   [&](comm::Communicator& c, const Tensors& t, uint64_t v) {
                     Tensors u;
                     for (const auto& e : t)
                       if (e.first != "model.layers.2.mlp.experts.5.up_proj.weight_scale") u.push_back(e);
                     return testing::SendBuckets(c, pack(u, v));
                   },
                   grpc::StatusCode::NOT_FOUND, "model.layers.2.mlp.experts.5.up_proj.weight_scale"});
  cases.push_back({"sender dies mid-stream",
                   [&](comm::Communicator& c, const Tensors& t, uint64_t v) -> absl::Status {
                     auto b = pack(t, v);
                     for (int i = 0; i < 3; ++i)
                       RETURN_IF_ERROR(testing::SendRawBucket(c, b[i].manifest, b[i].data, b[i].nbytes, false));
                     c.Abort("the trainer died");
                     return absl::AbortedError("died on purpose");
                   },
                   grpc::StatusCode::UNAVAILABLE, "stage 0", true});
  cases.push_back(
      {"bucket of another version",
       [&](comm::Communicator& c, const Tensors& t, uint64_t v) { return testing::SendBuckets(c, pack(t, v + 1)); },
       grpc::StatusCode::INVALID_ARGUMENT, "but the sync is version", true});
  cases.push_back({"AbortSync during the transfer",
                   [&, stall](comm::Communicator& c, const Tensors& t, uint64_t v) -> absl::Status {
                     auto b = pack(t, v);
                     for (int i = 0; i < 2; ++i)
                       RETURN_IF_ERROR(testing::SendRawBucket(c, b[i].manifest, b[i].data, b[i].nbytes, false));
                     stall->store(true);
                     // The agent is aborted now; the next bucket must fail fast.
                     const absl::Time t0 = absl::Now();
                     absl::Status s;
                     for (size_t i = 2; i < b.size() && s.ok(); ++i)
                       s = testing::SendRawBucket(c, b[i].manifest, b[i].data, b[i].nbytes, false);
                     if (s.ok()) return absl::InternalError("the whole stream went through an aborted agent");
                     if (absl::Now() - t0 > absl::Seconds(10))
                       return absl::InternalError("the sender learnt it too late");
                     return s;
                   },
                   grpc::StatusCode::ABORTED, "test abort", true,
                   [stall](RolloutAgentTest* t, AgentProcess& a, uint64_t id) {
                     while (!stall->load()) absl::SleepFor(absl::Milliseconds(5));
                     v1::AbortSyncReply reply;
                     grpc::Status s = t->AbortRpc(a, id, &reply);
                     EXPECT_TRUE(s.ok()) << s.error_message();
                     EXPECT_EQ(reply.version(), 1u);
                   }});

  uint64_t id = 100;
  for (const FailureCase& c : cases) {
    SCOPED_TRACE(c.label);
    ++id;
    stall->store(false);
    engine.ClearCalls();
    const uint64_t before = engine.memory().Checksum().value();
    ASSERT_TRUE(Begin(agent, BeginRequest(id, 2, 1, 1, /*record=*/true)).ok());
    trainer_->Run(GroupName(id), 2, [&c, &good](comm::Communicator& comm) { return c.send(comm, good, 2); });
    if (c.during) c.during(this, agent, id);
    v1::PrepareSyncReply prepared;
    grpc::Status ps = Prepare(agent, id, &prepared);
    EXPECT_EQ(ps.error_code(), c.prepare_code) << ps.error_message();
    EXPECT_THAT(ps.error_message(), HasSubstr(c.message));
    absl::Status sent = trainer_->Join();
    if (c.sender_fails) {
      EXPECT_FALSE(sent.ok()) << "the trainer side must see the failure";
    }
    // Commit is refused; the coordinator aborts.
    EXPECT_NE(CommitRpc(agent, id).error_code(), grpc::StatusCode::OK);
    v1::AbortSyncReply aborted;
    grpc::Status as = AbortRpc(agent, id, &aborted);
    EXPECT_TRUE(as.ok()) << as.error_message();
    EXPECT_EQ(aborted.version(), 1u);
    EXPECT_TRUE(AbortRpc(agent, id).ok()) << "AbortSync is idempotent";
    EXPECT_EQ(engine.memory().Checksum().value(), before) << "the engine's memory changed";
    EXPECT_TRUE(engine.calls().empty()) << "a sync that fails before its commit never pauses the engine";
    EXPECT_FALSE(engine.paused());
    EXPECT_EQ(Status(agent).state(), "idle");
    EXPECT_EQ(Status(agent).version(), 1u);
    EXPECT_FALSE(fs::exists(record_dir_ + "0/v2"));
    if (fs::exists(record_dir_ + "0")) {
      EXPECT_TRUE(fs::is_empty(record_dir_ + "0")) << "a partial recording was left";
    }
  }
  ExpectEngineHolds(engine, Model(kSeedV1));
  // The agent still works.
  SyncAll(++id, 2, v2, /*record=*/true);
  ExpectEngineHolds(engine, v2);
  EXPECT_TRUE(fs::exists(record_dir_ + "0/v2"));
}

// The default: the engine serves through BeginSync, the transfer and PrepareSync; CommitSync pauses
// and flushes it. A flush that never completes refuses the commit before anything is written, and
// the engine continues on its previous version.
// With a token, an agent takes only authenticated buckets (--bucket-mac auto): a sync without a key
// is refused, a stream tagged under another key fails the sync, and neither touches the engine; a
// stream tagged under the sync's key lands bit-exact.
TEST_F(RolloutAgentTest, OnlyBucketsTaggedUnderTheSyncsKeyReachTheEngine) {
  bucket_mac_ = "auto";
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const uint64_t before = engine.memory().Checksum().value();
  const model::testing::HfModel& v2 = Model(kSeedV2);
  auto expect_untouched = [&] {
    EXPECT_EQ(engine.memory().Checksum().value(), before);
    EXPECT_TRUE(engine.calls().empty());
    EXPECT_EQ(Status(agent).state(), "idle");
    EXPECT_EQ(Status(agent).version(), 1u);
  };

  grpc::Status keyless = Begin(agent, BeginRequest(1, 2, 1, 1));
  EXPECT_EQ(keyless.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << keyless.error_message();
  EXPECT_THAT(keyless.error_message(), HasSubstr("accepts only authenticated buckets"));
  expect_untouched();
  v1::BeginSyncRequest short_key = BeginRequest(2, 2, 1, 1);
  short_key.set_bucket_mac_key("12345");
  grpc::Status refused = Begin(agent, short_key);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("a 5-byte bucket key (32 or none)"));
  expect_untouched();

  const std::string key(comm::kBucketMacKeyBytes, '\x7e');
  std::string wrong = key;
  wrong[0] = 'w';
  v1::BeginSyncRequest forged = BeginRequest(3, 2, 1, 1);
  forged.set_bucket_mac_key(key);
  ASSERT_TRUE(Begin(agent, forged).ok());
  trainer_->Run(GroupName(3), 2, SendAll(SentTensors(v2), 2, 0, *comm::BucketMac::ForStream(wrong, GroupName(3))));
  grpc::Status ps = Prepare(agent, 3);
  EXPECT_EQ(ps.error_code(), grpc::StatusCode::DATA_LOSS) << ps.error_message();
  EXPECT_THAT(ps.error_message(), HasSubstr("bucket 0: not authenticated"));
  EXPECT_FALSE(trainer_->Join().ok()) << "the sender must see the refusal";
  EXPECT_TRUE(AbortRpc(agent, 3).ok());
  expect_untouched();

  v1::BeginSyncRequest good = BeginRequest(4, 2, 1, 1);
  good.set_bucket_mac_key(key);
  ASSERT_TRUE(Begin(agent, good).ok());
  trainer_->Run(GroupName(4), 2, SendAll(SentTensors(v2), 2, 0, *comm::BucketMac::ForStream(key, GroupName(4))));
  ps = Prepare(agent, 4);
  ASSERT_TRUE(ps.ok()) << ps.error_message();
  ASSERT_TRUE(trainer_->Join().ok());
  grpc::Status cs = CommitRpc(agent, 4);
  ASSERT_TRUE(cs.ok()) << cs.error_message();
  EXPECT_EQ(engine.version(), 2u);
  ExpectEngineHolds(engine, v2);
}

TEST_F(RolloutAgentTest, TheEngineIsPausedOnlyToCommitAndARefusedFlushWritesNothing) {
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const uint64_t before = engine.memory().Checksum().value();
  engine.RefuseFlushes(-1);
  // The sync's timeout also bounds the group's formation from BeginSync on: the tensors are made
  // first (quantizing them takes seconds under ASan), and it leaves room for a loaded machine.
  auto send = SendAll(SentTensors(Model(kSeedV2)), 2);
  ASSERT_TRUE(Begin(agent, BeginRequest(8, 2, 1, 1, false, /*timeout_ms=*/3000)).ok());
  trainer_->Run(GroupName(8), 2, std::move(send));
  ASSERT_TRUE(Prepare(agent, 8).ok());
  ASSERT_TRUE(trainer_->Join().ok());
  EXPECT_TRUE(engine.calls().empty()) << "received and staged while the engine served";
  const absl::Time t0 = absl::Now();
  grpc::Status c = CommitRpc(agent, 8);
  EXPECT_EQ(c.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << c.error_message();
  EXPECT_THAT(c.error_message(), HasSubstr("pausing the engine to commit; nothing was written"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10)) << "the flush retries end at the sync's 3 s timeout";
  const auto calls = engine.calls();
  ASSERT_FALSE(calls.empty());
  EXPECT_EQ(calls.front(), "pause:HOLD");
  EXPECT_EQ(calls.back(), "continue:1");
  EXPECT_FALSE(engine.paused());
  EXPECT_EQ(engine.memory().Checksum().value(), before);
  EXPECT_EQ(Status(agent).version(), 1u);
  // The next sync commits.
  engine.RefuseFlushes(0);
  engine.ClearCalls();
  SyncAll(9, 2, Model(kSeedV2));
  EXPECT_THAT(engine.calls(), ElementsAre("pause:HOLD", "flush", "continue:2"));
  ExpectEngineHolds(engine, Model(kSeedV2));
}

// --pause-for-whole-sync: Pause and Flush at BeginSync, as before staging made it unnecessary.
TEST_F(RolloutAgentTest, FlushIsRetriedWhileTheEngineDrainsAndRefusedAtTheDeadline) {
  StartRank(1, 0, 1, {"--pause-for-whole-sync"});
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  engine.RefuseFlushes(3);
  SyncAll(1, 2, Model(kSeedV2));
  EXPECT_THAT(engine.calls(),
              ElementsAre("pause:HOLD", "flush:refused", "flush:refused", "flush:refused", "flush", "continue:2"));

  engine.ClearCalls();
  engine.RefuseFlushes(-1);
  const uint64_t before = engine.memory().Checksum().value();
  const absl::Time t0 = absl::Now();
  grpc::Status s = Begin(agent, BeginRequest(2, 3, 1, 1, false, /*timeout_ms=*/600));
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("Flush"));
  EXPECT_THAT(s.error_message(), HasSubstr("2 requests still running"));
  EXPECT_GE(took, absl::Milliseconds(550));
  EXPECT_LT(took, absl::Seconds(5));
  const auto calls = engine.calls();
  // Retried every 50 ms for 600 ms: about 10 refusals, fewer on a loaded machine.
  EXPECT_GE(std::count(calls.begin(), calls.end(), "flush:refused"), 2);
  EXPECT_EQ(calls.back(), "continue:2");
  EXPECT_FALSE(engine.paused());
  EXPECT_EQ(engine.memory().Checksum().value(), before);
  EXPECT_EQ(Status(agent).state(), "idle");

  // The caller's own deadline bounds the retries too: a coordinator that gave up leaves no engine
  // paused.
  engine.ClearCalls();
  {
    auto ctx = rollout_agent::testing::Context(sec_, absl::Milliseconds(700));
    v1::BeginSyncReply r;
    grpc::Status b = agent.stub().BeginSync(ctx.get(), BeginRequest(3, 3, 1, 1), &r);
    EXPECT_EQ(b.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << b.error_message();
  }
  const absl::Time t1 = absl::Now();
  WaitUntil([&] { return !engine.paused(); }, absl::Seconds(5));
  // Well under the sync's own 30 s timeout (3 s leaves room for a loaded machine).
  EXPECT_LT(absl::Now() - t1, absl::Seconds(3)) << "the engine stayed paused after the caller's deadline";
  EXPECT_EQ(engine.calls().back(), "continue:2");
  EXPECT_EQ(engine.memory().Checksum().value(), before);

  engine.RefuseFlushes(0);
  SyncAll(4, 3, Model(kSeedV3));
  ExpectEngineHolds(engine, Model(kSeedV3));
}

// A sync left prepared by its coordinator ends on its own, keeping its staging: a coordinator that
// comes back to a partial commit rolls this engine forward from it.
TEST_F(RolloutAgentTest, AnAgentLeftAloneByItsCoordinatorAbortsOnItsOwn) {
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const uint64_t before = engine.memory().Checksum().value();
  // Prepared, then silence. The sync's timeout also bounds the group's formation, which starts at
  // BeginSync: the tensors are made before it (quantizing them under ASan takes seconds), and the
  // timeout leaves room for a loaded machine. The watchdog fires 2 x 3 s after PrepareSync.
  auto send = SendAll(SentTensors(Model(kSeedV2)), 2);
  ASSERT_TRUE(Begin(agent, BeginRequest(5, 2, 1, 1, false, /*timeout_ms=*/3000)).ok());
  trainer_->Run(GroupName(5), 2, std::move(send));
  grpc::Status prepared = Prepare(agent, 5);
  ASSERT_TRUE(prepared.ok()) << prepared.error_message();
  ASSERT_TRUE(trainer_->Join().ok());
  const absl::Time t0 = absl::Now();
  WaitUntil([&] { return Status(agent).state() == "idle"; }, absl::Seconds(20));
  EXPECT_EQ(Status(agent).state(), "idle");
  EXPECT_GE(absl::Now() - t0, absl::Seconds(3));
  EXPECT_TRUE(engine.calls().empty()) << "the engine was never paused: the sync did not reach its commit";
  EXPECT_FALSE(engine.paused());
  EXPECT_EQ(engine.memory().Checksum().value(), before);
  grpc::Status late = CommitRpc(agent, 5);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(late.error_message(), HasSubstr("coordinator"));

  // The coordinator comes back (it was stopped in its commit) and finds the commit partial: other
  // engines committed version 2. Told to roll forward, the agent commits it from the staging its
  // own abort kept, and the engine switches at one request boundary (Pause, Flush, Continue).
  {
    v1::AbortSyncRequest req;
    req.set_sync_id(5);
    req.set_reason("version 2 was committed on the other engines");
    req.set_roll_forward(true);
    v1::AbortSyncReply r;
    auto ctx = rollout_agent::testing::Context(agent.security());
    grpc::Status fwd = agent.stub().AbortSync(ctx.get(), req, &r);
    ASSERT_TRUE(fwd.ok()) << fwd.error_message();
  }
  WaitUntil([&] { return engine.version() == 2u; }, absl::Seconds(20));
  ASSERT_EQ(engine.version(), 2u) << agent.Log();
  EXPECT_THAT(engine.calls(), ElementsAre("pause:HOLD", "flush", "continue:2"));
  ExpectEngineHolds(engine, Model(kSeedV2));
  WaitUntil([&] { return Status(agent).version() == 2u; }, absl::Seconds(10));
  EXPECT_EQ(Status(agent).version(), 2u);
  const uint64_t rolled = engine.memory().Checksum().value();

  // Begun, and the coordinator never calls again (no sender either).
  engine.ClearCalls();
  ASSERT_TRUE(Begin(agent, BeginRequest(6, 3, 1, 1, false, /*timeout_ms=*/1000)).ok());
  WaitUntil([&] { return Status(agent).state() == "idle"; }, absl::Seconds(10));
  EXPECT_EQ(Status(agent).state(), "idle");
  EXPECT_TRUE(engine.calls().empty());
  EXPECT_EQ(engine.memory().Checksum().value(), rolled);
}

TEST_F(RolloutAgentTest, OneSyncAtATime) {
  // No engine yet.
  auto lonely = AgentProcess::Start(WSYNC_ROLLOUT_AGENT, name_ + "-lonely",
                                    {"--token-file", token_file_, "--bucket-mac", "off"}, sec_);
  ASSERT_TRUE(lonely.ok()) << lonely.status();
  grpc::Status s = Begin(**lonely, BeginRequest(1, 2, 1, 1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("no engine"));
  EXPECT_EQ(Status(**lonely).state(), "no_engine");
  {
    auto ctx = rollout_agent::testing::Context(sec_);
    v1::EngineChecksumsReply r;
    EXPECT_EQ((*lonely)->stub().EngineChecksums(ctx.get(), v1::EngineChecksumsRequest(), &r).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  (*lonely)->Terminate();
  if (!HasFailure()) (*lonely)->RemoveFiles();

  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  s = Begin(agent, BeginRequest(1, 1, 1, 1));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << "version 1 is not newer";
  // NCCL and the device ring receive into GPU memory: refused up front on a host without one (no
  // group is formed), naming the backend.
  for (const char* device_backend : {"nccl", "cuda-ipc"}) {
    auto req = BeginRequest(1, 2, 1, 1);
    req.set_backend(device_backend);
    if (!kernels::GpuAvailable()) {
      s = Begin(agent, req);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << device_backend;
      EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("backend ", device_backend))) << device_backend;
    }
  }
  auto mpi = BeginRequest(1, 2, 1, 1);
  mpi.set_backend("mpi");
  EXPECT_EQ(Begin(agent, mpi).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto bad_rank = BeginRequest(1, 2, 2, 1);
  EXPECT_EQ(Begin(agent, bad_rank).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A delta onto a staging that holds no version yet (a new engine): refused, a full sync brings it.
  auto delta = BeginRequest(1, 2, 1, 1);
  delta.set_delta_base(1);
  s = Begin(agent, delta);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("staging holds no complete version: nothing was changed"));
  EXPECT_TRUE(engine.calls().empty()) << "refused requests must not pause the engine";

  ASSERT_TRUE(Begin(agent, BeginRequest(5, 2, 1, 1)).ok());
  s = Begin(agent, BeginRequest(4, 3, 1, 1));  // an older sync while 5 runs
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("one sync at a time"));
  s = CommitRpc(agent, 5);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("not prepared"));
  EXPECT_EQ(CommitRpc(agent, 99).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Prepare(agent, 99).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // Prepare returns at its own deadline while the transfer has not even started.
  s = Prepare(agent, 5, nullptr, absl::Milliseconds(500));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::AbortSyncReply other;
  EXPECT_TRUE(AbortRpc(agent, 42, &other).ok()) << "another sync's abort is a no-op";
  EXPECT_EQ(Status(agent).state(), "receiving");
  // Abort while the group is still forming: bounded.
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(AbortRpc(agent, 5).ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  EXPECT_TRUE(engine.calls().empty()) << "aborted before its commit: the engine never paused";
  s = Prepare(agent, 5);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  // A registration during a sync is refused; afterwards it works.
  ASSERT_TRUE(Begin(agent, BeginRequest(6, 2, 1, 1)).ok());
  EXPECT_EQ(engine.Register(agent.address()).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // A newer sync supersedes one that is not committing (its coordinator gave it up, or died and
  // was restarted): the old one ends at once, the engine untouched, instead of after its timeout.
  const absl::Time t1 = absl::Now();
  ASSERT_TRUE(Begin(agent, BeginRequest(7, 2, 1, 1)).ok());
  EXPECT_LT(absl::Now() - t1, absl::Seconds(3));
  EXPECT_EQ(Status(agent).state(), "receiving");
  s = Prepare(agent, 6);
  EXPECT_NE(s.error_code(), grpc::StatusCode::OK) << "sync 6 was superseded";
  EXPECT_TRUE(engine.calls().empty()) << "a superseded sync never touched the engine";
  // A sync of another coordinator run (its sync_key's run id differs: a trainer job started again
  // without its state numbers its syncs from 1 again) supersedes too, whatever its id.
  auto run_a = BeginRequest(8, 2, 1, 1);
  run_a.set_sync_key("runA-8");
  ASSERT_TRUE(Begin(agent, run_a).ok());
  auto run_b = BeginRequest(3, 2, 1, 1);
  run_b.set_sync_key("runB-3");
  const absl::Time t2 = absl::Now();
  s = Begin(agent, run_b);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LT(absl::Now() - t2, absl::Seconds(3));
  EXPECT_NE(Prepare(agent, 8).error_code(), grpc::StatusCode::OK) << "run A's sync 8 was superseded";
  ASSERT_TRUE(AbortRpc(agent, 3).ok());
  // Sync 3 of run B ended; sync 3 of a run C is another sync, not "already ended".
  auto run_c = BeginRequest(3, 2, 1, 1);
  run_c.set_sync_key("runC-3");
  s = Begin(agent, run_c);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(AbortRpc(agent, 3).ok());
  EXPECT_TRUE(engine.calls().empty()) << "superseded syncs never touched the engine";
  EXPECT_TRUE(engine.Register(agent.address()).ok());
}

// An engine that hangs while it registers (it stopped right after asking; the agent checks its
// Health) must not hold the agent: a BeginSync sent meanwhile is answered at once, not after the
// engine RPC timeout (seen in e2e.hang: the coordinator's BeginSync deadline passed).
TEST_F(RolloutAgentTest, AnEngineHungInItsRegistrationDoesNotHoldABeginSync) {
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  engine.HoldHealth(true);
  grpc::Status reg;
  std::thread registering([&] { reg = engine.Register(agent.address()); });
  const bool waiting =
      rollout_agent::testing::WaitUntil([&] { return engine.health_waiting() > 0; }, absl::Seconds(10));
  if (!waiting) engine.HoldHealth(false);
  ASSERT_TRUE(waiting) << "the agent did not check the registering engine's health\n" << agent.Log();
  const absl::Time t0 = absl::Now();
  const grpc::Status begin = Begin(agent, BeginRequest(1, 2, 1, 1));
  const absl::Duration took = absl::Now() - t0;
  engine.HoldHealth(false);
  registering.join();
  ASSERT_TRUE(begin.ok()) << begin.error_message();
  EXPECT_LT(took, absl::Seconds(3)) << "BeginSync waited for the hung registration";
  EXPECT_TRUE(reg.ok()) << reg.error_message();
  ASSERT_TRUE(AbortRpc(agent, 1).ok());
  EXPECT_TRUE(engine.calls().empty()) << "the sync never reached its commit; the engine was serving";
}

// A copy of the published version from a peer (catch-up after a restart) holds the agent while it
// streams; a BeginSync ends it (the sync rewrites the staging) instead of waiting for it: here the
// peer never sends, and the BeginSync is answered at once.
TEST_F(RolloutAgentTest, ABeginSyncCancelsACopyFromAPeer) {
  auto coord = testing::FakeCoordinator::Start(sec_);
  ASSERT_TRUE(coord.ok());
  auto peer = testing::HangingPeer::Start(sec_);
  ASSERT_TRUE(peer.ok());
  v1::CatchUpHint hint;
  hint.set_version(3);
  hint.add_peers((*peer)->address());
  (*coord)->SetCatchUp(hint);
  StartRank(1, 0, 1, {"--coordinator", (*coord)->address()});
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  ASSERT_TRUE(WaitUntil([&] { return (*peer)->fetches() > 0; }, absl::Seconds(10)))
      << "the agent did not copy from the peer\n"
      << agent.Log();
  (*coord)->SetCatchUp(v1::CatchUpHint());  // no more copies after this one
  const absl::Time t0 = absl::Now();
  const grpc::Status begin = Begin(agent, BeginRequest(1, 4, 1, 1));
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(begin.ok()) << begin.error_message() << "\n" << agent.Log();
  EXPECT_LT(took, absl::Seconds(5)) << "BeginSync waited for the copy from the peer";
  EXPECT_TRUE(WaitUntil([&] { return (*peer)->cancelled() > 0; }, absl::Seconds(5)));
  EXPECT_THAT(agent.Log(), HasSubstr("BeginSync 1: cancelling the copy from a peer in progress"));
  ASSERT_TRUE(AbortRpc(agent, 1).ok());
  EXPECT_EQ(Status(agent).version(), 1u) << "the engine keeps the version it had";
}

TEST_F(RolloutAgentTest, AWrongTokenIsRefusedAndChangesNothing) {
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const uint64_t before = engine.memory().Checksum().value();
  for (const std::string& token : {std::string("wrong"), std::string()}) {
    SCOPED_TRACE(token.empty() ? "no token" : "wrong token");
    RpcSecurity bad = sec_;
    bad.token = token;
    auto stub = v1::RolloutAgent::NewStub(MakeChannel(agent.address(), bad));
    auto expect_refused = [&](const grpc::Status& s, const char* rpc) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << rpc << ": " << s.error_message();
    };
    {
      auto ctx = rollout_agent::testing::Context(bad);
      v1::BeginSyncReply r;
      expect_refused(stub->BeginSync(ctx.get(), BeginRequest(1, 2, 1, 1), &r), "BeginSync");
    }
    {
      auto ctx = rollout_agent::testing::Context(bad);
      v1::RegisterEngineRequest req = engine.RegisterRequest();
      req.set_engine_id("intruder");
      v1::RegisterEngineReply r;
      expect_refused(stub->RegisterEngine(ctx.get(), req, &r), "RegisterEngine");
    }
    {
      auto ctx = rollout_agent::testing::Context(bad);
      v1::AbortSyncRequest req;
      v1::AbortSyncReply r;
      expect_refused(stub->AbortSync(ctx.get(), req, &r), "AbortSync");
    }
    {
      auto ctx = rollout_agent::testing::Context(bad);
      v1::CommitSyncRequest req;
      v1::CommitSyncReply r;
      expect_refused(stub->CommitSync(ctx.get(), req, &r), "CommitSync");
    }
    {
      auto ctx = rollout_agent::testing::Context(bad);
      v1::UpdateWeightsReply r;
      expect_refused(stub->UpdateWeights(ctx.get(), v1::UpdateWeightsRequest(), &r), "UpdateWeights");
    }
    {
      auto ctx = rollout_agent::testing::Context(bad);
      v1::AgentStatusReply r;
      expect_refused(stub->AgentStatus(ctx.get(), v1::AgentStatusRequest(), &r), "AgentStatus");
    }
    {
      auto ctx = rollout_agent::testing::Context(bad);
      v1::EngineChecksumsReply r;
      expect_refused(stub->EngineChecksums(ctx.get(), v1::EngineChecksumsRequest(), &r), "EngineChecksums");
    }
  }
  EXPECT_TRUE(engine.calls().empty());
  EXPECT_EQ(engine.memory().Checksum().value(), before);
  v1::AgentStatusReply st = Status(agent);
  EXPECT_EQ(st.state(), "idle");
  EXPECT_EQ(st.engine_id(), "engine-a");
  EXPECT_EQ(st.version(), 1u);
}

// --staging device keeps the staging on the GPU of the engine's params: an engine whose params are
// in host memory (the shm engines here) is refused at registration, naming a param, and nothing is
// registered; a build without CUDA refuses the flag at start-up.
TEST_F(RolloutAgentTest, ADeviceStagingRefusesAnEngineWhoseParamsAreInHostMemory) {
  FakeEngine::Options o;
  o.config_json = config_json_;
  o.quant_json = quant_json_;
  o.parallel = {1, 0, 1};
  o.version = 1;
  o.security = sec_;
  auto engine = FakeEngine::Start(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto agent = AgentProcess::Start(WSYNC_ROLLOUT_AGENT, absl::StrCat(name_, "-device-staging"),
                                   {"--token-file", token_file_, "--staging", "device"}, sec_);
  if (!kernels::CudaCompiledIn()) {
    EXPECT_FALSE(agent.ok());
    return;
  }
  ASSERT_TRUE(agent.ok()) << agent.status();
  const grpc::Status reg = (*engine)->Register((*agent)->address());
  EXPECT_EQ(reg.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << reg.error_message();
  EXPECT_THAT(reg.error_message(), HasSubstr("--staging device"));
  EXPECT_THAT(reg.error_message(), HasSubstr("is in host memory"));
  EXPECT_EQ(Status(**agent).engine_id(), "");
  EXPECT_TRUE((*engine)->calls().empty());
}

TEST_F(RolloutAgentTest, MismatchedRegistrationsAreRefusedAndTheEngineStays) {
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  auto reg = [&](const v1::RegisterEngineRequest& req) {
    auto ctx = rollout_agent::testing::Context(sec_);
    v1::RegisterEngineReply r;
    return agent.stub().RegisterEngine(ctx.get(), req, &r);
  };
  {
    v1::RegisterEngineRequest req = engine.RegisterRequest();
    req.set_engine_id("engine-b");
    auto* p = req.mutable_params(3);
    p->set_shape(0, p->shape(0) / 2);
    p->set_nbytes(p->nbytes() / 2);
    grpc::Status s = reg(req);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr(p->name()));
    EXPECT_THAT(s.error_message(), HasSubstr("engine layout"));
  }
  {
    v1::RegisterEngineRequest req = engine.RegisterRequest();
    req.set_engine_id("engine-b");
    req.set_tp_size(2);  // TP-1 memory described as rank 0 of 2
    grpc::Status s = reg(req);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("TP rank 0/2"));
  }
  {
    v1::RegisterEngineRequest req = engine.RegisterRequest();
    req.set_engine_id("engine-b");
    req.set_quantization_config_json("");  // bf16 layout, INT4 memory
    EXPECT_EQ(reg(req).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    // Memory of the same layout that the group can read (an engine must keep its segment 0600).
    auto open = ParamArena::Create(engine.layout(), UniqueShmName("open", 0));
    ASSERT_TRUE(open.ok()) << open.status();
    ASSERT_EQ(chmod(absl::StrCat("/dev/shm", (*open)->segment().name()).c_str(), 0640), 0);
    v1::RegisterEngineRequest req = engine.RegisterRequest();
    req.set_engine_id("engine-b");
    req.clear_params();
    (*open)->FillParams(req.mutable_params());
    grpc::Status s = reg(req);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("mode 0640"));
  }
  EXPECT_EQ(Status(agent).engine_id(), "engine-a");
  EXPECT_TRUE(engine.calls().empty());
  SyncAll(1, 2, Model(kSeedV2));
  ExpectEngineHolds(engine, Model(kSeedV2));

  // The engine restarts with new memory (same layout): the agent follows it, and catches the new
  // memory up to version 2 from its staging at once (no sync).
  FakeEngine::Options o = engine.options();
  o.version = 0;
  auto restarted = FakeEngine::Start(o);
  ASSERT_TRUE(restarted.ok());
  ASSERT_TRUE((*restarted)->Register(agent.address()).ok());
  engines_.push_back(std::move(*restarted));
  for (int i = 0; i < 100 && Status(agent).version() != 2; ++i) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(Status(agent).version(), 2u);
  ExpectEngineHolds(*engines_.back(), Model(kSeedV2));
  EXPECT_THAT(engines_.back()->calls(), ElementsAre("pause:HOLD", "flush", "continue:2"));
  engines_.back()->ClearCalls();
  SyncAll(2, 3, Model(kSeedV3));
  ExpectEngineHolds(*engines_.back(), Model(kSeedV3));
  EXPECT_THAT(engines_.back()->calls(), ElementsAre("pause:HOLD", "flush", "continue:3"));
  ExpectEngineHolds(engine, Model(kSeedV2));  // the old segment was not written

  // FetchStaging (catch-up of a peer): the staging of the committed version, in order, each param's
  // checksum on its last chunk; refused for another version or another layout.
  auto fetch = [&](uint64_t version, uint64_t key, std::vector<v1::StagingChunk>* out) {
    auto ctx = rollout_agent::testing::Context(agent.security());
    v1::FetchStagingRequest req;
    req.set_version(version);
    req.set_layout_key(key);
    auto reader = agent.stub().FetchStaging(ctx.get(), req);
    v1::StagingChunk c;
    while (reader->Read(&c)) out->push_back(c);
    return reader->Finish();
  };
  const uint64_t key = rollout_agent::LayoutKeyHash(engines_.back()->RegisterRequest());
  std::vector<v1::StagingChunk> chunks;
  grpc::Status s = fetch(3, key, &chunks);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_FALSE(chunks.empty());
  EXPECT_TRUE(chunks.back().last());
  EXPECT_EQ(chunks.back().version(), 3u);
  std::map<uint32_t, std::string> params;
  size_t done = 0;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    const v1::StagingChunk& c = chunks[i];
    std::string& p = params[c.param()];
    EXPECT_EQ(c.offset(), p.size());
    p += c.data();
    if (c.param_done()) {
      ++done;
      EXPECT_EQ(c.xxh3_64(), Xxh3_64(std::as_bytes(std::span<const char>(p.data(), p.size())))) << c.param();
    }
  }
  EXPECT_EQ(done, params.size());
  EXPECT_EQ(params.size(), engine.layout().params().size());
  int64_t total = 0;
  for (const auto& [i, p] : params) total += static_cast<int64_t>(p.size());
  EXPECT_EQ(total, engine.layout().TotalBytes(ParamForm::kLoaded));
  chunks.clear();
  s = fetch(2, key, &chunks);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("the staging holds version 3"));
  s = fetch(3, key + 1, &chunks);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("another layout"));
  EXPECT_TRUE(chunks.empty());
}

// --- pipeline stages ----------------------------------------------------------------------------------

TEST_F(RolloutAgentTest, TwoPipelineStagesArriveThroughTwoGroupsAtOnce) {
  StartRank(1, 0, 1);
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const model::testing::HfModel& v2 = Model(kSeedV2);
  const Tensors all = SentTensors(v2);
  // Stage 0: the first half of the checkpoint, stage 1 the rest (as a PP=2 trainer sends it).
  const Tensors first(all.begin(), all.begin() + static_cast<long>(all.size() / 2));
  const Tensors second(all.begin() + static_cast<long>(all.size() / 2), all.end());
  v1::BeginSyncRequest req = BeginRequest(21, 2, 1, 1, /*record=*/true);
  auto* g1 = req.add_groups();
  g1->set_pp_stage(1);
  g1->set_name(absl::StrCat(name_, "/sync21/pp1"));
  g1->set_size(2);
  ASSERT_TRUE(Begin(agent, req).ok());
  trainer_->Run(GroupName(21), 2, SendAll(first, 2, 0));
  trainer_->Run(absl::StrCat(name_, "/sync21/pp1"), 2, SendAll(second, 2, 1));
  v1::PrepareSyncReply prepared;
  grpc::Status ps = Prepare(agent, 21, &prepared);
  ASSERT_TRUE(ps.ok()) << ps.error_message();
  ASSERT_TRUE(trainer_->Join().ok());
  EXPECT_EQ(prepared.tensors(), all.size());
  ASSERT_TRUE(CommitRpc(agent, 21).ok());
  ExpectEngineHolds(engine, v2);
  std::set<std::string> files;
  auto recorded = ReadRecording(record_dir_ + "0/v2", &files);
  EXPECT_EQ(recorded.size(), all.size());
  EXPECT_TRUE(files.contains("pp0-00000.safetensors"));
  EXPECT_TRUE(files.contains("pp1-00000.safetensors"));

  // A bucket of stage 1 arriving in stage 0's group is refused.
  const uint64_t before = engine.memory().Checksum().value();
  v1::BeginSyncRequest req2 = BeginRequest(22, 3, 1, 1);
  auto* h1 = req2.add_groups();
  h1->set_pp_stage(1);
  h1->set_name(absl::StrCat(name_, "/sync22/pp1"));
  h1->set_size(2);
  ASSERT_TRUE(Begin(agent, req2).ok());
  trainer_->Run(GroupName(22), 2, SendAll(first, 3, 1));
  trainer_->Run(absl::StrCat(name_, "/sync22/pp1"), 2, SendAll(second, 3, 1));
  ps = Prepare(agent, 22);
  EXPECT_EQ(ps.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << ps.error_message();
  EXPECT_THAT(ps.error_message(), HasSubstr("arrived in the group of stage 0"));
  EXPECT_FALSE(trainer_->Join().ok()) << "both stage sources must see the failure";
  ASSERT_TRUE(AbortRpc(agent, 22).ok());
  EXPECT_EQ(engine.memory().Checksum().value(), before);
  EXPECT_EQ(engine.calls().back(), "continue:2");
}

// --- engine TP 2 --------------------------------------------------------------------------------------

TEST_F(RolloutAgentTest, EngineTp2WithExpertParallelismTwoAgentsOneGroup) {
  shared_record_ = true;  // both agents record into one directory, as wsync-local runs them
  StartRank(2, 0, 2);
  StartRank(2, 1, 2);
  const model::testing::HfModel& v2 = Model(kSeedV2);
  SyncAll(11, 2, v2, /*record=*/true);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ExpectEngineHolds(*engines_[r], v2);
    EXPECT_THAT(engines_[r]->calls(), ElementsAre("pause:HOLD", "flush", "continue:2"));
    EXPECT_EQ(Status(*agents_[r]).tp_rank(), static_cast<uint32_t>(r));
  }
  std::vector<std::string> entries;
  for (const auto& f : fs::directory_iterator(record_dir_ + "shared")) entries.push_back(f.path().filename().string());
  EXPECT_THAT(entries, ElementsAre("v2"));
  std::set<std::string> files;
  EXPECT_EQ(ReadRecording(record_dir_ + "shared/v2", &files).size(), v2.sent.size());
  // The two ranks hold different slices.
  EXPECT_NE(engines_[0]->memory().Checksum().value(), engines_[1]->memory().Checksum().value());

  // One rank fails (a tensor it needs is missing from the stream: both fail at Prepare, since every
  // agent needs every non-expert tensor); both are aborted and keep version 2.
  const uint64_t c0 = engines_[0]->memory().Checksum().value(), c1 = engines_[1]->memory().Checksum().value();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(Begin(*agents_[r], BeginRequest(12, 3, r + 1, 2)).ok());
  Tensors t = SentTensors(Model(kSeedV3));
  t.erase(std::remove_if(t.begin(), t.end(),
                         [](const auto& e) { return e.first == "model.layers.0.self_attn.o_proj.weight_packed"; }),
          t.end());
  trainer_->Run(GroupName(12), 3, SendAll(t, 3));
  for (int r = 0; r < 2; ++r) {
    grpc::Status s = Prepare(*agents_[r], 12);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("o_proj"));
  }
  EXPECT_TRUE(trainer_->Join().ok());
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(AbortRpc(*agents_[r], 12).ok());
  EXPECT_EQ(engines_[0]->memory().Checksum().value(), c0);
  EXPECT_EQ(engines_[1]->memory().Checksum().value(), c1);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(engines_[r]->calls().back(), "continue:2");
}

// --- membership and shutdown --------------------------------------------------------------------------

TEST_F(RolloutAgentTest, JoinsHeartbeatsRejoinsAndLeavesTheCoordinator) {
  auto coord = testing::FakeCoordinator::Start(sec_);
  ASSERT_TRUE(coord.ok());
  StartRank(1, 0, 1, {"--coordinator", (*coord)->address()});
  rollout_agent::testing::FakeEngine& engine = *engines_[0];
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  auto wait_for = [](const std::function<bool()>& cond) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!cond() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
    return cond();
  };
  ASSERT_TRUE(wait_for([&] { return !(*coord)->joins().empty(); }));
  const v1::JoinRequest join = (*coord)->joins()[0];
  EXPECT_EQ(join.agent_address(), agent.address());
  EXPECT_EQ(join.engine_id(), "engine-a");
  EXPECT_EQ(join.tp_rank(), 0u);
  EXPECT_EQ(join.tp_size(), 1u);
  EXPECT_EQ(join.version(), 1u);
  EXPECT_TRUE(wait_for([&] { return (*coord)->heartbeats() >= 3; }));
  // The agent's own id is stable (engines re-register when it changes: an agent restart), whatever
  // id the coordinator gives it.
  const std::string id = Status(agent).agent_id();
  EXPECT_THAT(id, ::testing::StartsWith(absl::StrCat("agent@", agent.address(), "/pid")));
  (*coord)->ForgetAgents();
  ASSERT_TRUE(wait_for([&] { return (*coord)->joins().size() >= 2; }));
  EXPECT_EQ((*coord)->joins()[1].agent_address(), agent.address());
  EXPECT_EQ(Status(agent).agent_id(), id);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ((*coord)->joins().size(), 2u) << "heartbeats of the re-joined agent must be known";

  // SIGTERM during a sync: the engine continues on its previous version; the agent leaves.
  const uint64_t before = engine.memory().Checksum().value();
  ASSERT_TRUE(Begin(agent, BeginRequest(1, 2, 1, 1)).ok());
  const int status = agent.Terminate();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << agent.Log();
  EXPECT_TRUE(engine.calls().empty()) << "the sync never reached its commit: the engine kept serving";
  EXPECT_EQ(engine.memory().Checksum().value(), before);
  EXPECT_THAT((*coord)->leaves(), ElementsAre("agent-2"));
}

// UpdateWeights asks the coordinator at once (not at the next heartbeat) what is published and who
// holds it: the newest version (min_version 0) is the hint's; a peer that holds it is copied from;
// without one the call waits for the next sync, and its deadline error says which case it was.
TEST_F(RolloutAgentTest, UpdateWeightsAsksTheCoordinatorAtOnce) {
  auto coord = testing::FakeCoordinator::Start(sec_);
  ASSERT_TRUE(coord.ok());
  (*coord)->SetHeartbeatMs(600000);  // no periodic heartbeat during the test
  heartbeat_ms_ = "600000";
  StartRank(1, 0, 1, {"--coordinator", (*coord)->address()});
  rollout_agent::testing::AgentProcess& agent = *agents_[0];
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((*coord)->joins().empty() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_FALSE((*coord)->joins().empty()) << agent.Log();
  const uint64_t before = engines_[0]->memory().Checksum().value();
  const int hb = (*coord)->heartbeats();
  uint64_t v = 0;
  // Not behind: the engine's version, after one question to the coordinator.
  ASSERT_TRUE(UpdateWeights(agent, 0, absl::Seconds(10), &v).ok()) << agent.Log();
  EXPECT_EQ(v, 1u);
  EXPECT_EQ((*coord)->heartbeats(), hb + 1);
  // A version the engine holds: answered without asking.
  ASSERT_TRUE(UpdateWeights(agent, 1, absl::Seconds(10), &v).ok());
  EXPECT_EQ((*coord)->heartbeats(), hb + 1);
  // Version 7 published and held by a peer (that does not answer here): the agent tries to copy it.
  v1::CatchUpHint hint;
  hint.set_version(7);
  hint.add_peers("127.0.0.1:1");
  (*coord)->SetCatchUp(hint);
  const absl::Time start = absl::Now();
  // The deadlines leave the watchdog seconds to answer: on a loaded CI machine (two test processes
  // per core) its failed copy from the silent peer can hold it for over a second.
  grpc::Status s = UpdateWeights(agent, 0, absl::Seconds(3), &v);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("version 7 was not committed"));
  EXPECT_THAT(s.error_message(), HasSubstr("copying version 7 from a peer (127.0.0.1:1)"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  EXPECT_EQ((*coord)->heartbeats(), hb + 2);
  // Published, no peer holds it: the call waits for the next sync.
  hint.clear_peers();
  (*coord)->SetCatchUp(hint);
  s = UpdateWeights(agent, 7, absl::Seconds(3), &v);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("no peer holds it; waiting for the next sync"));
  // Nothing was written: the engine still serves version 1.
  EXPECT_EQ(engines_[0]->memory().Checksum().value(), before);
  EXPECT_THAT(agent.Log(), HasSubstr("UpdateWeights(0): copying version 7 from a peer"));
}

// Sharded delivery sends a stage over several streams (one per sender); a recording names its
// files by stage, so a recorded sync with two streams for one stage is refused, changing nothing.
TEST_F(RolloutAgentTest, TwoStreamsOfOneStageAreRefusedOnlyInARecordedSync) {
  std::unique_ptr<FakeEngine> engine;
  std::unique_ptr<AgentServer> server;
  ASSERT_NO_FATAL_FAILURE(StartInProcess(&engine, &server));
  v1::BeginSyncRequest req = BeginRequest(1, 1, 1, 1, /*record=*/true);
  *req.add_groups() = req.groups(0);
  req.mutable_groups(1)->set_name(GroupName(1) + "/s1");
  v1::BeginSyncReply begun;
  absl::Status refused = server->agent().BeginSync(req, &begun);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("two groups for pipeline stage 0 in a recorded sync"));
  EXPECT_EQ(server->agent().version(), 0u);
  EXPECT_TRUE(engine->calls().empty()) << "the refused sync reached the engine";
  server->Shutdown();
}

// The library in-process (what a launcher or an end-to-end test can embed).
TEST_F(RolloutAgentTest, TheAgentLibraryRunsInProcess) {
  std::unique_ptr<FakeEngine> engine;
  std::unique_ptr<AgentServer> server;
  ASSERT_NO_FATAL_FAILURE(StartInProcess(&engine, &server));
  v1::BeginSyncRequest req = BeginRequest(1, 1, 1, 1);
  v1::BeginSyncReply begun;
  ASSERT_TRUE(server->agent().BeginSync(req, &begun).ok());
  trainer_->Run(GroupName(1), 2, SendAll(SentTensors(Model(kSeedV2)), 1));
  v1::PrepareSyncRequest p;
  p.set_sync_id(1);
  v1::PrepareSyncReply prepared;
  absl::Status ps = server->agent().PrepareSync(p, absl::Now() + absl::Seconds(60), &prepared);
  ASSERT_TRUE(ps.ok()) << ps;
  ASSERT_TRUE(trainer_->Join().ok());
  v1::CommitSyncRequest c;
  c.set_sync_id(1);
  v1::CommitSyncReply committed;
  ASSERT_TRUE(server->agent().CommitSync(c, &committed).ok());
  EXPECT_EQ(server->agent().version(), 1u);
  ExpectEngineHolds(*engine, Model(kSeedV2));
  EXPECT_THAT(server->agent().metrics().RenderPrometheus(), HasSubstr("wsync_rollout_syncs_total 1"));
  server->Shutdown();
}

}  // namespace
}  // namespace wsync::rollout_agent
