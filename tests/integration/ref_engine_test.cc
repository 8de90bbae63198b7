// wsync-ref-engine as real processes on loopback: TP 1 and 2 started from HF checkpoints written
// here (bf16; INT4 in the sent form and as bf16 quantized at load), Generate over gRPC compared with
// HfReferenceModel computed here from the same checkpoint; Pause / Flush / Continue semantics; token
// auth; a NO_WEIGHTS start registered with a fake rollout agent that writes weights into the
// registered shared memory and continues the engine; re-registration when the agent restarts;
// clean shutdown on SIGTERM / SIGINT (segments unlinked, followers stopped by rank 0).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "comm/bucket/bucket_format.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/rpc_security.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine_model/engine_layout.h"
#include "engine_model/engine_weights.h"
#include "engine_model/loader.h"
#include "engine_model/repack.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/expert_map.h"
#include "ref_engine/hf_reference.h"
#include "ref_engine/testing/fixtures.h"
#include "wsync/v1/engine.grpc.pb.h"
#include "wsync/v1/rollout.grpc.pb.h"

extern char** environ;

namespace wsync {
namespace {

using ref_engine::testing::TensorMap;
using ::testing::HasSubstr;

// Marlin needs N % 64 and K % 16 per rank: heads 4 x 32, kv 2, hidden 128, intermediate 256, G 32.
std::string Qwen3Config(bool int4) {
  std::string c = R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "intermediate_size": 256, "vocab_size": 250, "max_position_embeddings": 64, "torch_dtype": "bfloat16",
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0)";
  if (int4) {
    c += R"(, "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "strategy": "group", "group_size": 32, "symmetric": true, "actorder": null, "dynamic": false}}},
    "ignore": ["lm_head", "re:.*embed_tokens.*"]})";
  }
  return c + "}";
}

// Qwen3-MoE: 4 experts top-2, layer 1 dense; with EP 2 each rank holds 2 experts.
std::string Qwen3MoeConfig(bool int4) {
  std::string c = R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "intermediate_size": 256, "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
  "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": true, "vocab_size": 250,
  "max_position_embeddings": 64, "tie_word_embeddings": false, "torch_dtype": "bfloat16")";
  if (int4) {
    c += R"(, "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "strategy": "group", "group_size": 32, "symmetric": true, "actorder": null, "dynamic": false}}},
    "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"]})";
  }
  return c + "}";
}

const std::vector<std::vector<int32_t>> kPrompts = {{3, 17, 101, 42, 7}, {249, 0, 5}, {77}};
constexpr int kNew = 6;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A checkpoint directory: config.json + two safetensors files.
std::string WriteCheckpoint(const std::string& name, const std::string& config_json, const TensorMap& tensors) {
  const std::string dir = ref_engine::testing::FreshTempDir("ref-engine-" + name);
  std::ofstream(dir + "/config.json") << config_json;
  SafetensorsWriter a, b;
  int i = 0;
  for (const auto& [n, t] : tensors.all()) EXPECT_TRUE((i++ % 2 ? a : b).Add(n, t.view()).ok());
  EXPECT_TRUE(a.Write(dir + "/model-00001-of-00002.safetensors").ok());
  EXPECT_TRUE(b.Write(dir + "/model-00002-of-00002.safetensors").ok());
  return dir;
}

std::vector<std::vector<int32_t>> ReferenceTokens(const ModelConfig& c, const TensorMap& hf) {
  auto ref = ref_engine::HfReferenceModel::Create(c, hf.Lookup());
  EXPECT_TRUE(ref.ok()) << ref.status();
  std::vector<std::vector<int32_t>> out;
  for (const auto& p : kPrompts) {
    auto t = ref->Generate(p, kNew);
    EXPECT_TRUE(t.ok()) << t.status();
    out.push_back(t.ok() ? *t : std::vector<int32_t>());
  }
  return out;
}

bool ShmExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// One wsync-ref-engine process; stdout + stderr go to a log file.
class EngineProc {
 public:
  EngineProc(const std::string& tag, std::vector<std::string> args)
      : log_(ref_engine::testing::FreshTempDir("engine-log-" + tag) + "/engine.log") {
    args.insert(args.begin(), WSYNC_REF_ENGINE);
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~EngineProc() {  // SIGTERM (the engine unlinks its segment), SIGKILL if it does not exit in 20 s
    if (pid_ <= 0 || Exited(absl::ZeroDuration())) return;
    kill(pid_, SIGTERM);
    if (Exited(absl::Seconds(20))) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  }

  std::string log() const { return ReadAll(log_); }

  // Waits until the log matches `pattern` (group 1 returned), or the process exits, or 60 s pass.
  std::string WaitFor(const std::string& pattern) {
    const std::regex re(pattern);
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      std::smatch m;
      const std::string text = log();
      if (std::regex_search(text, m, re)) return m.size() > 1 ? m[1].str() : m[0].str();
      if (Exited(absl::ZeroDuration())) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "engine never logged /" << pattern << "/:\n" << log();
    return "";
  }
  std::string Address() { return WaitFor("listening on (\\S+)"); }
  std::string ShmName() { return WaitFor("bytes in shm (\\S+)"); }

  bool Exited(absl::Duration wait) {
    if (status_ != -1) return true;
    const absl::Time deadline = absl::Now() + wait;
    do {
      if (waitpid(pid_, &status_, WNOHANG) == pid_) return true;
      status_ = -1;
      absl::SleepFor(absl::Milliseconds(10));
    } while (absl::Now() < deadline);
    return false;
  }
  // Sends `sig` and returns the exit code (-1 if killed or still running after 20 s).
  int Stop(int sig = SIGTERM) {
    if (!Exited(absl::ZeroDuration())) kill(pid_, sig);
    return ExitCode(absl::Seconds(20));
  }
  int ExitCode(absl::Duration wait) {
    if (!Exited(wait)) return -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int status_ = -1;
};

std::unique_ptr<v1::RolloutEngine::Stub> Stub(const std::string& address) {
  return v1::RolloutEngine::NewStub(MakeChannel(address, RpcSecurity{}));
}

RpcSecurity WithToken(const std::string& token) {
  RpcSecurity s;
  s.token = token;
  return s;
}

absl::StatusOr<v1::GenerateReply> Generate(v1::RolloutEngine::Stub& stub, const std::vector<int32_t>& prompt,
                                           int n = kNew, const RpcSecurity& sec = {},
                                           absl::Duration timeout = absl::Seconds(60)) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, sec, timeout);
  v1::GenerateRequest req;
  for (int32_t t : prompt) req.add_prompt(t);
  req.set_max_new_tokens(static_cast<uint32_t>(n));
  v1::GenerateReply reply;
  RETURN_IF_ERROR(FromGrpcStatus(stub.Generate(&ctx, req, &reply)));
  return reply;
}

std::vector<int32_t> Tokens(const v1::GenerateReply& r) { return {r.tokens().begin(), r.tokens().end()}; }

absl::StatusOr<uint32_t> Pause(v1::RolloutEngine::Stub& stub, v1::PauseRequest::Mode mode) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, {}, absl::Seconds(10));
  v1::PauseRequest req;
  req.set_mode(mode);
  v1::PauseReply reply;
  RETURN_IF_ERROR(FromGrpcStatus(stub.Pause(&ctx, req, &reply)));
  return reply.in_flight();
}
absl::Status Flush(v1::RolloutEngine::Stub& stub) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, {}, absl::Seconds(10));
  v1::FlushReply reply;
  return FromGrpcStatus(stub.Flush(&ctx, v1::FlushRequest(), &reply));
}
absl::StatusOr<uint64_t> Continue(v1::RolloutEngine::Stub& stub, uint64_t version) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, {}, absl::Seconds(30));
  v1::ContinueRequest req;
  req.set_version(version);
  v1::ContinueReply reply;
  RETURN_IF_ERROR(FromGrpcStatus(stub.Continue(&ctx, req, &reply)));
  return reply.version();
}
absl::StatusOr<v1::HealthReply> Health(v1::RolloutEngine::Stub& stub, const RpcSecurity& sec = {}) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, sec, absl::Seconds(10));
  v1::HealthReply reply;
  RETURN_IF_ERROR(FromGrpcStatus(stub.Health(&ctx, v1::HealthRequest(), &reply)));
  return reply;
}
absl::StatusOr<uint64_t> WeightVersion(v1::RolloutEngine::Stub& stub) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, {}, absl::Seconds(10));
  v1::WeightVersionReply reply;
  RETURN_IF_ERROR(FromGrpcStatus(stub.WeightVersion(&ctx, v1::WeightVersionRequest(), &reply)));
  return reply.version();
}

// Waits until Health reports `state` (after TP formation, for example).
void AwaitState(v1::RolloutEngine::Stub& stub, v1::HealthReply::State state) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::StatusOr<v1::HealthReply> h;
  while (absl::Now() < deadline) {
    h = Health(stub);
    if (h.ok() && h->state() == state) return;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ADD_FAILURE() << "engine never reached state " << v1::HealthReply::State_Name(state) << ": "
                << (h.ok() ? h->DebugString() : h.status().ToString());
}

// An engine of T ranks from `checkpoint`; rank 0 hosts the TP store.
struct Engine {
  std::vector<std::unique_ptr<EngineProc>> ranks;
  std::vector<std::string> addresses;
  std::vector<std::unique_ptr<v1::RolloutEngine::Stub>> stubs;
};

Engine StartEngine(const std::string& tag, int tp, const std::vector<std::string>& extra) {
  Engine e;
  std::string store;
  for (int r = 0; r < tp; ++r) {
    std::vector<std::string> args = {
        "--engine-id", tag, "--tp-size", std::to_string(tp), "--tp-rank", std::to_string(r), "--heartbeat-ms", "100"};
    if (tp > 1) {
      args.insert(args.end(), {"--tp-store", r == 0 ? "127.0.0.1:0" : store});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    e.ranks.push_back(std::make_unique<EngineProc>(absl::StrCat(tag, "-r", r), args));
    if (r == 0 && tp > 1) store = e.ranks[0]->WaitFor("tp-store on (\\S+)");
  }
  for (int r = 0; r < tp; ++r) {
    e.addresses.push_back(e.ranks[static_cast<size_t>(r)]->Address());
    e.stubs.push_back(Stub(e.addresses.back()));
  }
  return e;
}

// --- Serving a checkpoint ---------------------------------------------------------------------------

struct ServeCase {
  const char* name;
  int tp;
  bool int4;
  bool sent_form;       // INT4: the checkpoint holds weight_packed/scale/shape; else bf16 quantized at load
  int ep = 1;           // > 1: the Qwen3-MoE model with --ep-size ep
  bool pruned = false;  // the Qwen3-MoE model pruned to experts 3, 1 of 4 (model/expert_map.h)
};

// The Qwen3-MoE model's config and random checkpoint pruned by an expert map (PrunedConfigJson,
// PruneHfCheckpoint): what an engine of a pruned sync serves.
std::pair<std::string, TensorMap> PrunedQwen3Moe(bool int4) {
  const std::string original = Qwen3MoeConfig(int4);
  const ModelConfig oc = ref_engine::testing::MustParseConfig(original);
  auto map = model::ParseExpertMap(R"({"num_experts": 4, "layers": {"0": [3, 1]}})", "test map");
  EXPECT_TRUE(map.ok()) << map.status();
  auto json = model::PrunedConfigJson(original, *map, "qwen3-moe config");
  EXPECT_TRUE(json.ok()) << json.status();
  const TensorMap hf = ref_engine::testing::RandomHfModel(oc, 1234);
  model::HfCheckpoint ckpt;
  for (const auto& [name, t] : hf.all()) EXPECT_TRUE(ckpt.Add(name, *Tensor::CopyOf(t.view())).ok());
  auto pruned = model::PruneHfCheckpoint(oc, *map, ckpt);
  EXPECT_TRUE(pruned.ok()) << pruned.status();
  TensorMap out;
  for (const std::string& name : pruned->Names()) out.Put(name, *Tensor::CopyOf(*pruned->Get(name)));
  EXPECT_EQ(out.At("model.layers.0.mlp.gate.weight").view().shape(), (Shape{2, 128}));
  return {*json, std::move(out)};
}

class ServeTest : public ::testing::TestWithParam<ServeCase> {};

TEST_P(ServeTest, GenerateMatchesTheHfReference) {
  const ServeCase& sc = GetParam();
  std::string config_json = sc.ep > 1 ? Qwen3MoeConfig(sc.int4) : Qwen3Config(sc.int4);
  TensorMap hf;
  if (sc.pruned) std::tie(config_json, hf) = PrunedQwen3Moe(sc.int4);
  const ModelConfig c = ref_engine::testing::MustParseConfig(config_json);
  if (!sc.pruned) hf = ref_engine::testing::RandomHfModel(c, 1234);
  std::vector<std::vector<int32_t>> want;
  std::string dir;
  if (sc.int4) {
    auto q = ref_engine::testing::QuantizeHf(c, hf);
    ASSERT_TRUE(q.ok()) << q.status();
    want = ReferenceTokens(c, q->dequantized);
    dir = WriteCheckpoint(sc.name, config_json, sc.sent_form ? q->sent : hf);
  } else {
    want = ReferenceTokens(c, hf);
    dir = WriteCheckpoint(sc.name, config_json, hf);
  }
  Engine e = StartEngine(sc.name, sc.tp, {"--checkpoint", dir, "--ep-size", std::to_string(sc.ep)});
  AwaitState(*e.stubs[0], v1::HealthReply::SERVING);
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    auto r = Generate(*e.stubs[0], kPrompts[i]);
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << e.ranks[0]->log();
    EXPECT_EQ(Tokens(*r), want[i]) << "prompt " << i;
    EXPECT_EQ(r->version(), 0u);
  }
  auto h = Health(*e.stubs[0]);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->version(), 0u);
  EXPECT_THAT(h->detail(), HasSubstr("checkpoint"));
  EXPECT_EQ(*WeightVersion(*e.stubs[0]), 0u);
  auto zero = Generate(*e.stubs[0], {1, 2}, 0);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero->tokens_size(), 0);
  auto bad = Generate(*e.stubs[0], {1, 250});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("prompt token 1 is 250"));
  if (sc.tp > 1) {
    auto f = Generate(*e.stubs[1], kPrompts[0]);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(f.status().message(), HasSubstr("send it to tp rank 0 at " + e.addresses[0]));
  }
  // SIGTERM on rank 0 stops the whole engine cleanly and unlinks every segment.
  std::vector<std::string> shm;
  for (auto& r : e.ranks) shm.push_back(r->ShmName());
  EXPECT_EQ(e.ranks[0]->Stop(SIGTERM), 0) << e.ranks[0]->log();
  for (size_t r = 1; r < e.ranks.size(); ++r)
    EXPECT_EQ(e.ranks[r]->ExitCode(absl::Seconds(20)), 0) << e.ranks[r]->log();
  for (const auto& name : shm) EXPECT_FALSE(ShmExists(name)) << name;
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, ServeTest,
                         ::testing::Values(ServeCase{"tp1_bf16", 1, false, false},
                                           ServeCase{"tp2_bf16", 2, false, false},
                                           ServeCase{"tp1_int4_sent", 1, true, true},
                                           ServeCase{"tp2_int4_sent", 2, true, true},
                                           ServeCase{"tp2_int4_quantized_at_load", 2, true, false},
                                           ServeCase{"tp2_ep2_moe_int4_sent", 2, true, true, 2},
                                           ServeCase{"tp2_ep2_moe_int4_pruned", 2, true, true, 2, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// --- Control semantics -------------------------------------------------------------------------------

class ControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_json_ = Qwen3Config(false);
    c_ = ref_engine::testing::MustParseConfig(config_json_);
    hf_ = ref_engine::testing::RandomHfModel(c_, 99);
    want_ = ReferenceTokens(c_, hf_);
    dir_ = WriteCheckpoint("control", config_json_, hf_);
  }
  std::string config_json_, dir_;
  ModelConfig c_;
  TensorMap hf_;
  std::vector<std::vector<int32_t>> want_;
};

TEST_F(ControlTest, PauseHoldWaitsAbortFailsFlushRefusesWhileRunning) {
  Engine e = StartEngine("control", 2, {"--checkpoint", dir_, "--test-step-delay-ms", "40"});
  auto& r0 = *e.stubs[0];
  auto& r1 = *e.stubs[1];
  AwaitState(r0, v1::HealthReply::SERVING);
  AwaitState(r1, v1::HealthReply::SERVING);

  // HOLD on any rank queues the request until that rank continues.
  ASSERT_TRUE(Pause(r1, v1::PauseRequest::HOLD).ok());
  EXPECT_EQ(Health(r1)->state(), v1::HealthReply::PAUSED);
  auto held = std::async(std::launch::async, [&] { return Generate(r0, kPrompts[0]); });
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout);
  ASSERT_EQ(*Continue(r1, 0), 0u);
  auto r = held.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Tokens(*r), want_[0]);

  // ABORT fails new requests with UNAVAILABLE.
  ASSERT_TRUE(Pause(r0, v1::PauseRequest::ABORT).ok());
  r = Generate(r0, kPrompts[1]);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("paused for a weight sync (ABORT)"));
  ASSERT_TRUE(Pause(r1, v1::PauseRequest::ABORT).ok());
  ASSERT_TRUE(Continue(r0, 0).ok());
  r = Generate(r0, kPrompts[1]);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("tp rank 1 is paused for a weight sync (ABORT)"));
  ASSERT_TRUE(Continue(r1, 0).ok());

  // A running request: Flush refuses on both ranks; HOLD lets it finish.
  auto running = std::async(std::launch::async, [&] { return Generate(r0, kPrompts[0], 30); });
  absl::SleepFor(absl::Milliseconds(300));
  absl::Status f = Flush(r0);
  EXPECT_EQ(f.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(f.message(), HasSubstr("1 request(s) still running"));
  EXPECT_EQ(Flush(r1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Health(r0)->in_flight(), 1u);
  EXPECT_EQ(*Pause(r0, v1::PauseRequest::HOLD), 1u);
  r = running.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens_size(), 30);
  EXPECT_EQ(std::vector<int32_t>(r->tokens().begin(), r->tokens().begin() + kNew), want_[0]);
  EXPECT_TRUE(Flush(r0).ok());
  ASSERT_TRUE(Continue(r0, 0).ok());

  // ABORT on a peer stops a running request on every rank.
  running = std::async(std::launch::async, [&] { return Generate(r0, kPrompts[0], 30); });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(*Pause(r1, v1::PauseRequest::ABORT), 1u);
  r = running.get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("request aborted"));
  ASSERT_TRUE(Continue(r1, 0).ok());
  r = Generate(r0, kPrompts[2]);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Tokens(*r), want_[2]);

  // SIGINT on a follower: it exits cleanly; rank 0 sees the group broken and reports UNHEALTHY.
  const std::string shm1 = e.ranks[1]->ShmName();
  EXPECT_EQ(e.ranks[1]->Stop(SIGINT), 0) << e.ranks[1]->log();
  EXPECT_FALSE(ShmExists(shm1));
  AwaitState(r0, v1::HealthReply::UNHEALTHY);
  EXPECT_THAT(Health(r0)->detail(), HasSubstr("TP group is "));  // broken, then re-forming
  EXPECT_EQ(Generate(r0, kPrompts[0]).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(e.ranks[0]->Stop(SIGTERM), 0) << e.ranks[0]->log();
}

// kill -9 of one TP rank, then of the other: each time the survivor turns UNHEALTHY (re-forming,
// weights kept) and the engine serves the same tokens again as soon as the killed rank is started
// again with its own command line (rank 0 on the same --tp-store address), no full restart.
TEST_F(ControlTest, AKilledRankStartedAgainRejoinsItsEngine) {
  Engine e = StartEngine("reform", 2, {"--checkpoint", dir_});
  const std::string store = e.ranks[0]->WaitFor("tp-store on (\\S+)");
  AwaitState(*e.stubs[0], v1::HealthReply::SERVING);
  auto start_rank = [&](int r, const std::string& tag) {
    e.ranks[static_cast<size_t>(r)] = std::make_unique<EngineProc>(
        tag, std::vector<std::string>{"--engine-id", "reform", "--tp-size", "2", "--tp-rank", std::to_string(r),
                                      "--heartbeat-ms", "100", "--tp-store", store, "--checkpoint", dir_});
    e.addresses[static_cast<size_t>(r)] = e.ranks[static_cast<size_t>(r)]->Address();
    e.stubs[static_cast<size_t>(r)] = Stub(e.addresses[static_cast<size_t>(r)]);
  };
  auto serves = [&](const char* when) {
    AwaitState(*e.stubs[0], v1::HealthReply::SERVING);
    AwaitState(*e.stubs[1], v1::HealthReply::SERVING);
    auto r = Generate(*e.stubs[0], kPrompts[1]);
    ASSERT_TRUE(r.ok()) << when << ": " << r.status();
    EXPECT_EQ(Tokens(*r), want_[1]) << when;
  };
  serves("at start");

  EXPECT_EQ(e.ranks[1]->Stop(SIGKILL), -1);
  AwaitState(*e.stubs[0], v1::HealthReply::UNHEALTHY);
  auto h = Health(*e.stubs[0]);
  for (int i = 0; i < 100 && h.ok() && h->detail().find("re-forming") == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(50));  // broken first, then re-forming
    h = Health(*e.stubs[0]);
  }
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_THAT(h->detail(), HasSubstr("TP group is re-forming"));
  EXPECT_EQ(Generate(*e.stubs[0], kPrompts[1]).status().code(), absl::StatusCode::kUnavailable);
  start_rank(1, "reform-r1-again");
  serves("after rank 1 was killed and started again");
  EXPECT_THAT(e.ranks[0]->log(), HasSubstr("re-forming"));

  EXPECT_EQ(e.ranks[0]->Stop(SIGKILL), -1);
  AwaitState(*e.stubs[1], v1::HealthReply::UNHEALTHY);
  start_rank(0, "reform-r0-again");
  serves("after rank 0 was killed and started again");
  EXPECT_EQ(e.ranks[0]->Stop(SIGTERM), 0) << e.ranks[0]->log();
  EXPECT_EQ(e.ranks[1]->ExitCode(absl::Seconds(20)), 0) << "rank 0's shutdown stops the engine:\n" << e.ranks[1]->log();
}

TEST_F(ControlTest, TokenIsRequiredOnEveryRpc) {
  const std::string token_file = ref_engine::testing::FreshTempDir("engine-token") + "/token";
  std::ofstream(token_file) << "s3cret\n";
  chmod(token_file.c_str(), 0600);
  Engine e = StartEngine("token", 1, {"--checkpoint", dir_, "--token-file", token_file});
  auto& s = *e.stubs[0];
  EXPECT_EQ(Health(s).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Health(s, WithToken("wrong")).status().code(), absl::StatusCode::kUnauthenticated);
  auto g = Generate(s, kPrompts[0], kNew, WithToken("wrong"));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Pause(s, v1::PauseRequest::ABORT).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Flush(s).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Continue(s, 7).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(WeightVersion(s).status().code(), absl::StatusCode::kUnauthenticated);
  auto h = Health(s, WithToken("s3cret"));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->state(), v1::HealthReply::SERVING) << "a refused Pause must not have paused the engine";
  g = Generate(s, kPrompts[0], kNew, WithToken("s3cret"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(Tokens(*g), want_[0]);
}

TEST_F(ControlTest, BadStartsExitNonZeroWithTheReason) {
  EngineProc no_model("no-model", {"--listen", "127.0.0.1:0"});
  EXPECT_EQ(no_model.ExitCode(absl::Seconds(20)), 2);
  EXPECT_THAT(no_model.log(), HasSubstr("--model or --checkpoint is required"));
  EngineProc no_store("no-store", {"--model", dir_, "--tp-size", "2"});
  EXPECT_EQ(no_store.ExitCode(absl::Seconds(20)), 2);
  EXPECT_THAT(no_store.log(), HasSubstr("--tp-size > 1 needs --tp-store"));
  const std::string empty = ref_engine::testing::FreshTempDir("ref-engine-empty");
  std::ofstream(empty + "/config.json") << config_json_;
  EngineProc no_tensors("no-tensors", {"--checkpoint", empty});
  EXPECT_EQ(no_tensors.ExitCode(absl::Seconds(20)), 1);
  EXPECT_THAT(no_tensors.log(), HasSubstr("holds no *.safetensors"));
  EngineProc bad_tp("bad-tp", {"--model", dir_, "--tp-size", "3", "--tp-rank", "0", "--tp-store", "127.0.0.1:0"});
  EXPECT_EQ(bad_tp.ExitCode(absl::Seconds(20)), 1);
  EXPECT_THAT(bad_tp.log(), HasSubstr("3"));
}

// --- Registration with a rollout agent ----------------------------------------------------------------

// A stand-in rollout agent: records registrations; reports an agent_id.
class FakeAgent final : public v1::RolloutAgent::Service {
 public:
  explicit FakeAgent(std::string id) : id_(std::move(id)) {}
  grpc::Status RegisterEngine(grpc::ServerContext*, const v1::RegisterEngineRequest* req,
                              v1::RegisterEngineReply* reply) override {
    absl::MutexLock lock(&mu_);
    requests_.push_back(*req);
    engine_id_ = req->engine_id();
    reply->set_agent_id(id_);
    return grpc::Status::OK;
  }
  grpc::Status AgentStatus(grpc::ServerContext*, const v1::AgentStatusRequest*, v1::AgentStatusReply* reply) override {
    absl::MutexLock lock(&mu_);
    reply->set_agent_id(id_);
    reply->set_engine_id(engine_id_);
    reply->set_state(engine_id_.empty() ? "no_engine" : "idle");
    return grpc::Status::OK;
  }
  size_t registrations() {
    absl::MutexLock lock(&mu_);
    return requests_.size();
  }
  // Waits for the n-th registration (1-based).
  absl::StatusOr<v1::RegisterEngineRequest> Await(size_t n) {
    absl::MutexLock lock(&mu_);
    auto have = [&] { return requests_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&have), absl::Seconds(60));
    if (requests_.size() < n) return absl::DeadlineExceededError(absl::StrCat("registration ", n, " never came"));
    return requests_[n - 1];
  }

 private:
  const std::string id_;
  absl::Mutex mu_;
  std::vector<v1::RegisterEngineRequest> requests_;
  std::string engine_id_;
};

std::unique_ptr<grpc::Server> Serve(FakeAgent* agent, const std::string& address, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  b.RegisterService(agent);
  return b.BuildAndStart();
}

// What the rollout agent does: maps the registered segment and writes a version into it.
class AgentSide {
 public:
  explicit AgentSide(const v1::RegisterEngineRequest& req) {
    const std::string name = req.params(0).memory().shm_name();
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0) << name;
    struct stat st;
    EXPECT_EQ(fstat(fd, &st), 0);
    mode_ = st.st_mode & 07777;
    size_ = static_cast<size_t>(st.st_size);
    base_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    EXPECT_NE(base_, MAP_FAILED);
    for (const v1::EngineParam& p : req.params()) {
      EXPECT_EQ(p.memory().shm_name(), name);
      EXPECT_EQ(p.memory().offset() % 64, 0u) << p.name();
      EXPECT_LE(p.memory().offset() + p.nbytes(), size_) << p.name();
      engine_model::EngineBuffer b;
      b.name = p.name();
      absl::StatusOr<DType> dtype = comm::FromProto(p.dtype());
      EXPECT_TRUE(dtype.ok()) << dtype.status();
      b.dtype = dtype.value_or(DType::kU8);
      b.shape.assign(p.shape().begin(), p.shape().end());
      b.data = static_cast<std::byte*>(base_) + p.memory().offset();
      b.nbytes = p.nbytes();
      EXPECT_TRUE(weights_.Add(std::move(b)).ok()) << p.name();
    }
  }
  ~AgentSide() { munmap(base_, size_); }

  // Loads HF tensors `sent` through the rollout loader and commits them into the engine's memory.
  absl::Status Write(const ModelConfig& c, const QuantizationConfig* q, const TensorMap& sent) {
    ASSIGN_OR_RETURN(engine_model::EngineLayout layout, engine_model::EngineLayout::Create(c, q, {1, 0, 1}));
    RETURN_IF_ERROR(weights_.CheckMatches(layout));
    ASSIGN_OR_RETURN(std::unique_ptr<engine_model::Staging> staging, engine_model::Staging::Create(layout));
    engine_model::Loader loader(staging.get());
    for (const auto& [name, t] : sent.all()) RETURN_IF_ERROR(loader.Load(name, t.view()));
    return engine_model::Commit(*staging, weights_);
  }
  engine_model::EngineWeights& weights() { return weights_; }
  mode_t mode() const { return mode_; }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  mode_t mode_ = 0;
  engine_model::EngineWeights weights_;
};

// The engine follows its agent through the agent's address file: nothing registers while the
// file is missing; the first agent gets the registration once the file names it; an agent restarted
// on another port (a new file, written atomically as the agent does) gets it again, without
// restarting the engine.
TEST(RegistrationTest, AnAgentRestartedOnAnotherPortIsFoundThroughItsAddressFile) {
  const std::string config_json = Qwen3Config(false);
  const std::string dir = ref_engine::testing::FreshTempDir("ref-engine-agent-file");
  const std::string config_path = dir + "/config.json";
  std::ofstream(config_path) << config_json;
  const std::string agent_file = dir + "/agent-address";
  auto publish = [&](int port) {  // what the rollout agent's --address-file does: tmp + rename
    { std::ofstream(agent_file + ".tmp") << "127.0.0.1:" << port << "\n"; }
    ASSERT_EQ(std::rename((agent_file + ".tmp").c_str(), agent_file.c_str()), 0);
  };
  FakeAgent agent1("agent-1");
  int port1 = 0;
  auto server1 = Serve(&agent1, "127.0.0.1:0", &port1);
  ASSERT_TRUE(server1 && port1 > 0);
  EngineProc proc("agent-file", {"--model", config_path, "--quant-config", "none", "--engine-id", "eng-8",
                                 "--agent-file", agent_file, "--agent-poll-ms", "100"});
  proc.Address();
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(agent1.registrations(), 0u) << "no address yet, so no registration";
  publish(port1);
  auto first = agent1.Await(1);
  ASSERT_TRUE(first.ok()) << first.status() << proc.log();
  EXPECT_EQ(first->engine_id(), "eng-8");

  server1->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  server1.reset();
  FakeAgent agent2("agent-2");
  int port2 = 0;
  auto server2 = Serve(&agent2, "127.0.0.1:0", &port2);
  ASSERT_TRUE(server2 && port2 > 0 && port2 != port1);
  publish(port2);
  auto again = agent2.Await(1);
  ASSERT_TRUE(again.ok()) << again.status() << proc.log();
  EXPECT_EQ(again->engine_id(), "eng-8");
  EXPECT_THAT(proc.log(), HasSubstr(absl::StrCat("rollout agent address now 127.0.0.1:", port2)));
  server2->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

TEST(RegistrationTest, NoWeightsStartRegistersAndServesWhatTheAgentWrites) {
  const std::string config_json = Qwen3Config(true);
  const ModelConfig c = ref_engine::testing::MustParseConfig(config_json);
  const std::string config_path = ref_engine::testing::FreshTempDir("ref-engine-int4-config") + "/config.json";
  std::ofstream(config_path) << config_json;
  auto q = ref_engine::testing::QuantizeHf(c, ref_engine::testing::RandomHfModel(c, 4242));
  ASSERT_TRUE(q.ok());
  const auto want = ReferenceTokens(c, q->dequantized);

  FakeAgent agent1("agent-1");
  int port = 0;
  auto server = Serve(&agent1, "127.0.0.1:0", &port);
  ASSERT_TRUE(server && port > 0);
  const std::string agent_address = absl::StrCat("127.0.0.1:", port);
  const std::string address_file = ref_engine::testing::FreshTempDir("ref-engine-address") + "/address";
  EngineProc proc("agent", {"--model", config_path, "--engine-id", "eng-7", "--agent", agent_address, "--agent-poll-ms",
                            "100", "--address-file", address_file});
  const std::string address = proc.Address();
  EXPECT_EQ(ReadAll(address_file), address + "\n");
  auto stub = Stub(address);
  AwaitState(*stub, v1::HealthReply::NO_WEIGHTS);
  auto g = Generate(*stub, kPrompts[0]);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.status().message(), HasSubstr("no weights"));

  auto reg = agent1.Await(1);
  ASSERT_TRUE(reg.ok()) << reg.status() << proc.log();
  EXPECT_EQ(reg->engine_id(), "eng-7");
  EXPECT_EQ(reg->tp_size(), 1u);
  EXPECT_EQ(reg->tp_rank(), 0u);
  EXPECT_EQ(reg->ep_size(), 1u);
  EXPECT_EQ(reg->engine_address(), address);
  EXPECT_EQ(reg->version(), 0u);
  EXPECT_EQ(reg->model_config_json(), config_json);
  auto qc = ParseQuantizationConfig(reg->quantization_config_json(), "registration");
  ASSERT_TRUE(qc.ok()) << qc.status() << reg->quantization_config_json();
  EXPECT_EQ(qc->group_size, 32);
  auto layout = engine_model::EngineLayout::Create(c, &*c.quantization, {1, 0, 1});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(reg->params_size(), static_cast<int>(layout->params().size()));

  {
    AgentSide side(*reg);
    EXPECT_EQ(side.mode(), 0600u);
    ASSERT_TRUE(side.weights().CheckMatches(*layout).ok());
    // A sync: pause, write version 1, flush, continue.
    ASSERT_TRUE(Pause(*stub, v1::PauseRequest::ABORT).ok());
    ASSERT_TRUE(side.Write(c, &*c.quantization, q->sent).ok());
    ASSERT_TRUE(Flush(*stub).ok());
    ASSERT_EQ(*Continue(*stub, 1), 1u);
    for (size_t i = 0; i < kPrompts.size(); ++i) {
      auto r = Generate(*stub, kPrompts[i]);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(Tokens(*r), want[i]);
      EXPECT_EQ(r->version(), 1u);
    }
    EXPECT_EQ(*WeightVersion(*stub), 1u);

    // The agent restarts (same address, new id): the engine registers again, with version 1.
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    server.reset();
    FakeAgent agent2("agent-2");
    int port2 = 0;
    server = Serve(&agent2, agent_address, &port2);
    ASSERT_TRUE(server) << "cannot rebind " << agent_address;
    auto again = agent2.Await(1);
    ASSERT_TRUE(again.ok()) << again.status() << proc.log();
    EXPECT_EQ(again->version(), 1u);
    EXPECT_EQ(again->params(0).memory().shm_name(), reg->params(0).memory().shm_name());

    // A sync that wrote garbage: the Prepare fails, the engine is UNHEALTHY until a good Continue.
    ASSERT_TRUE(Pause(*stub, v1::PauseRequest::HOLD).ok());
    auto norm = side.weights().View("model.norm.weight");
    ASSERT_TRUE(norm.ok());
    const uint16_t saved = norm->data_as<uint16_t>()[3];
    norm->data_as<uint16_t>()[3] = 0x7fc0;  // bf16 NaN
    auto bad = Continue(*stub, 2);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(bad.status().message(), HasSubstr("model.norm.weight"));
    auto h = Health(*stub);
    EXPECT_EQ(h->state(), v1::HealthReply::UNHEALTHY);
    EXPECT_EQ(Generate(*stub, kPrompts[0]).status().code(), absl::StatusCode::kUnavailable);
    norm->data_as<uint16_t>()[3] = saved;
    ASSERT_EQ(*Continue(*stub, 2), 2u);
    auto r = Generate(*stub, kPrompts[0]);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(Tokens(*r), want[0]);
    EXPECT_EQ(r->version(), 2u);
  }
  const std::string shm = reg->params(0).memory().shm_name();
  EXPECT_TRUE(ShmExists(shm));
  EXPECT_EQ(proc.Stop(SIGTERM), 0) << proc.log();
  EXPECT_FALSE(ShmExists(shm));
}

}  // namespace
}  // namespace wsync
