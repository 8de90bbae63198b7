// libwsync_engine_host through its C API, the test acting as the rollout agent (the RolloutEngine
// calls an agent makes in a sync) against callbacks that record what the engine was asked. The
// whole path with real agents and a real engine (transformers) is tests/python/test_engine.py.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc_security.h"
#include "kernels/dispatch.h"
#include "wsync/v1/engine.grpc.pb.h"
#include "wsync_engine_host.h"

namespace {

// A Qwen3 dense model small enough to build in milliseconds.
constexpr char kDense[] = R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
  "rope_theta": 1000000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";
constexpr char kInt4[] = R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
  "strategy": "group", "group_size": 128, "symmetric": true}}}, "ignore": ["lm_head", "re:.*embed_tokens.*",
  "re:.*norm.*"]})";

struct Recorder {
  absl::Mutex mu;
  std::vector<uint64_t> prepared;
  bool fail_next = false;
  std::vector<int32_t> last_prompt;
  std::vector<std::string> hooks;  // "pause 1", "continue 5", ...
};

int OnPause(void* ctx, int mode, char*, size_t) {
  auto* r = static_cast<Recorder*>(ctx);
  absl::MutexLock lock(&r->mu);
  r->hooks.push_back("pause " + std::to_string(mode));
  return 0;
}

int OnContinue(void* ctx, uint64_t version, char*, size_t) {
  auto* r = static_cast<Recorder*>(ctx);
  absl::MutexLock lock(&r->mu);
  r->hooks.push_back("continue " + std::to_string(version));
  return 0;
}

int Prepare(void* ctx, uint64_t version, char* err, size_t err_len) {
  auto* r = static_cast<Recorder*>(ctx);
  absl::MutexLock lock(&r->mu);
  if (r->fail_next) {
    r->fail_next = false;
    std::snprintf(err, err_len, "shape of lm_head.weight is not the model's");
    return 1;
  }
  r->prepared.push_back(version);
  return 0;
}

int Generate(void* ctx, const int32_t* prompt, size_t n, uint32_t max_new, int32_t* out, size_t* out_len, char*,
             size_t) {
  auto* r = static_cast<Recorder*>(ctx);
  absl::MutexLock lock(&r->mu);
  r->last_prompt.assign(prompt, prompt + n);
  for (uint32_t i = 0; i < max_new; ++i) out[i] = static_cast<int32_t>(7 + i);
  *out_len = max_new;
  return 0;
}

std::string LastError() { return wsync_engine_last_error(); }

wsync_engine_options Options(Recorder* r, const char* config, const char* quant = nullptr) {
  wsync_engine_options o;
  std::memset(&o, 0, sizeof(o));
  o.engine_id = "host-test";
  o.config_json = config;
  o.quant_json = quant;
  o.agent = "127.0.0.1:1";  // nobody: the registrar retries in the background
  o.prepare = &Prepare;
  o.generate = &Generate;
  o.ctx = r;
  o.hold_timeout_s = 5;
  o.on_pause = &OnPause;
  o.on_continue = &OnContinue;
  return o;
}

TEST(EngineHost, RefusesBadOptionsNamingWhatIsWrong) {
  Recorder r;
  wsync_engine* e = nullptr;
  wsync_engine_options o = Options(&r, kDense);
  o.engine_id = "has space";
  EXPECT_EQ(wsync_engine_create(&o, &e), 3);
  EXPECT_NE(LastError().find("has space"), std::string::npos) << LastError();
  o = Options(&r, kDense);
  o.prepare = nullptr;
  EXPECT_EQ(wsync_engine_create(&o, &e), 3);
  EXPECT_NE(LastError().find("prepare"), std::string::npos) << LastError();
  o = Options(&r, kDense);
  o.agent = nullptr;
  EXPECT_EQ(wsync_engine_create(&o, &e), 3);
  EXPECT_NE(LastError().find("agent"), std::string::npos);
  o = Options(&r, R"({"model_type": "qwen3", "hidden_size": 100, "num_attention_heads": 3})");
  EXPECT_NE(wsync_engine_create(&o, &e), 0);
  EXPECT_FALSE(LastError().empty());
  o = Options(&r, kDense, R"({"quant_method": "gptq", "bits": 4})");
  EXPECT_NE(wsync_engine_create(&o, &e), 0);
  EXPECT_NE(LastError().find("gptq"), std::string::npos) << LastError();
  EXPECT_EQ(e, nullptr);
  o = Options(&r, kDense, R"({"quant_method": "awq", "bits": 4, "zero_point": true})");
  EXPECT_NE(wsync_engine_create(&o, &e), 0);
  EXPECT_NE(LastError().find("group_size"), std::string::npos) << LastError();
  EXPECT_EQ(e, nullptr);
  o = Options(&r, kDense);
  o.param_memory = "gpu0";
  EXPECT_EQ(wsync_engine_create(&o, &e), 3);
  EXPECT_NE(LastError().find("param-memory gpu0: want shm or cuda:N"), std::string::npos) << LastError();
  EXPECT_EQ(e, nullptr);
}

// Parameters in CUDA memory: without a usable device (this CPU host) the host is refused, naming
// the missing device, and nothing is created; with one, every param is a device pointer on it.
TEST(EngineHost, ParamsInCudaMemoryAreOnTheDeviceOrRefused) {
  Recorder r;
  wsync_engine* e = nullptr;
  wsync_engine_options o = Options(&r, kDense, kInt4);
  o.param_memory = "cuda:0";
  const int rc = wsync_engine_create(&o, &e);
  if (!wsync::kernels::GpuAvailable()) {
    EXPECT_NE(rc, 0);
    EXPECT_EQ(e, nullptr);
    EXPECT_TRUE(absl::StrContains(LastError(), "CUDA")) << LastError();
    return;
  }
  ASSERT_EQ(rc, 0) << LastError();
  ASSERT_GT(wsync_engine_param_count(e), 0u);
  for (size_t i = 0; i < wsync_engine_param_count(e); ++i) {
    wsync_engine_param_info p;
    ASSERT_EQ(wsync_engine_param(e, i, &p), 0);
    EXPECT_EQ(p.device, 0) << p.name;
  }
  wsync_engine_destroy(e);
}

TEST(EngineHost, ListsTheEngineFormParamsAndDequantizesLinears) {
  Recorder r;
  wsync_engine* e = nullptr;
  wsync_engine_options o = Options(&r, kDense, kInt4);
  ASSERT_EQ(wsync_engine_create(&o, &e), 0) << LastError();
  std::map<std::string, wsync_engine_param_info> params;
  for (size_t i = 0; i < wsync_engine_param_count(e); ++i) {
    wsync_engine_param_info p;
    ASSERT_EQ(wsync_engine_param(e, i, &p), 0);
    params[p.name] = p;
  }
  wsync_engine_param_info p;
  EXPECT_EQ(wsync_engine_param(e, params.size(), &p), 11);  // OUT_OF_RANGE
  // Vocab padded to 64, fused qkv (4 + 2 * 2 heads of 32), Marlin INT4 for the MLP.
  const auto& embed = params.at("model.embed_tokens.weight");
  EXPECT_STREQ(embed.dtype, "BF16");
  EXPECT_EQ(embed.device, -1);  // the segment
  EXPECT_EQ(embed.shape[0], 1024);
  EXPECT_EQ(embed.shape[1], 128);
  const auto& qkv = params.at("model.layers.0.self_attn.qkv_proj.weight_packed");
  EXPECT_EQ(qkv.kind, 1);
  EXPECT_STREQ(qkv.dtype, "I32");
  EXPECT_EQ(qkv.shape[0], 128 / 16);
  EXPECT_EQ(qkv.shape[1], 2 * 256);
  EXPECT_EQ(params.at("model.layers.0.self_attn.qkv_proj.weight_scale").kind, 2);
  // A zero-filled segment: every code word 0 is nibble 0, i.e. -8 * scale, and the scales are 0.
  std::vector<uint16_t> dense(256 * 128, 0xffff);
  ASSERT_EQ(wsync_engine_dense_bf16(e, "model.layers.0.self_attn.qkv_proj.weight", dense.data(), dense.size() * 2), 0)
      << LastError();
  for (uint16_t v : dense) ASSERT_TRUE(v == 0 || v == 0x8000) << v;
  // Scales of 1.0 (bf16 0x3f80) everywhere and every nibble 9: the weight is all 1.0.
  const auto& scale = params.at("model.layers.0.self_attn.qkv_proj.weight_scale");
  auto* s = static_cast<uint16_t*>(scale.data);
  for (uint64_t i = 0; i < scale.nbytes / 2; ++i) s[i] = 0x3f80;
  std::memset(qkv.data, 0x99, qkv.nbytes);
  ASSERT_EQ(wsync_engine_dense_bf16(e, "model.layers.0.self_attn.qkv_proj.weight", dense.data(), dense.size() * 2), 0);
  for (uint16_t v : dense) ASSERT_EQ(v, 0x3f80);
  EXPECT_EQ(wsync_engine_dense_bf16(e, "model.layers.0.self_attn.qkv_proj.weight", dense.data(), 10), 3);
  EXPECT_NE(LastError().find("bytes"), std::string::npos);
  EXPECT_EQ(wsync_engine_dense_bf16(e, "no.such.weight", dense.data(), 10), 5);
  bool saw_qkv = false;
  for (size_t i = 0; i < wsync_engine_linear_count(e); ++i) {
    wsync_engine_linear_info l;
    ASSERT_EQ(wsync_engine_linear(e, i, &l), 0);
    if (std::string(l.name) == "model.layers.0.self_attn.qkv_proj.weight") {
      saw_qkv = true;
      EXPECT_EQ(l.quantized, 1);
      EXPECT_EQ(l.n, 256);
      EXPECT_EQ(l.k, 128);
    }
  }
  EXPECT_TRUE(saw_qkv);
  // The loaded (compressed-tensors) form: every nibble 9 and every scale 1.0 survive the restore.
  std::vector<uint32_t> packed(256 * 128 / 8);
  int64_t shape[4] = {0, 0, 0, 0};
  ASSERT_EQ(wsync_engine_loaded(e, "model.layers.0.self_attn.qkv_proj.weight_packed", packed.data(), packed.size() * 4,
                                shape),
            0)
      << LastError();
  EXPECT_EQ(shape[0], 256);
  EXPECT_EQ(shape[1], 16);
  for (uint32_t w : packed) ASSERT_EQ(w, 0x99999999u);
  EXPECT_EQ(wsync_engine_loaded(e, "model.layers.0.self_attn.qkv_proj.weight_packed", packed.data(), 4, nullptr), 3);
  EXPECT_EQ(wsync_engine_loaded(e, "nope", packed.data(), 4, nullptr), 5);
  // Where the checkpoint's k_proj goes: rows [128, 192) of the fused qkv (4 q heads of 32 first).
  bool saw_k = false;
  for (size_t i = 0; i < wsync_engine_source_count(e); ++i) {
    wsync_engine_source_info src;
    ASSERT_EQ(wsync_engine_source(e, i, &src), 0);
    if (std::string(src.hf_name) != "model.layers.0.self_attn.k_proj.weight_packed") continue;
    saw_k = true;
    EXPECT_EQ(src.action, 0);
    EXPECT_STREQ(src.param, "model.layers.0.self_attn.qkv_proj.weight_packed");
    EXPECT_STREQ(src.dtype, "I32");
    EXPECT_EQ(src.dst_row0, 128);
    EXPECT_EQ(src.rows, 64);
    EXPECT_EQ(src.cols, 16);
  }
  EXPECT_TRUE(saw_k);
  wsync_engine_destroy(e);
}

// Another process's view (a vLLM worker): the same bytes through the host's attach info; serving refused.
TEST(EngineHost, AViewAttachedFromTheInfoSeesTheHostsBytesAndServesNothing) {
  Recorder r;
  wsync_engine* e = nullptr;
  wsync_engine_options o = Options(&r, kDense, kInt4);
  ASSERT_EQ(wsync_engine_create(&o, &e), 0) << LastError();
  wsync_engine_param_info p;
  ASSERT_EQ(wsync_engine_param(e, 0, &p), 0);
  std::memset(p.data, 0x5a, p.nbytes);
  wsync_engine* v = nullptr;
  ASSERT_EQ(wsync_engine_attach(wsync_engine_attach_info(e), &v), 0) << LastError();
  ASSERT_EQ(wsync_engine_param_count(v), wsync_engine_param_count(e));
  wsync_engine_param_info q;
  ASSERT_EQ(wsync_engine_param(v, 0, &q), 0);
  EXPECT_STREQ(q.name, p.name);
  EXPECT_NE(q.data, p.data);  // its own mapping of the same segment
  EXPECT_EQ(std::memcmp(q.data, p.data, p.nbytes), 0);
  std::vector<uint32_t> packed(256 * 128 / 8);
  EXPECT_EQ(wsync_engine_loaded(v, "model.layers.0.self_attn.qkv_proj.weight_packed", packed.data(), packed.size() * 4,
                                nullptr),
            0)
      << LastError();
  uint64_t version = 0;
  EXPECT_EQ(wsync_engine_start(v), 9);
  EXPECT_NE(LastError().find("serves nothing"), std::string::npos);
  EXPECT_EQ(wsync_engine_begin_request(v, 10, &version), 9);
  wsync_engine_destroy(v);
  wsync_engine* bad = nullptr;
  EXPECT_EQ(wsync_engine_attach("{\"params\": 1}", &bad), 3);
  EXPECT_EQ(wsync_engine_attach("not json", &bad), 3);
  EXPECT_EQ(bad, nullptr);
  wsync_engine_destroy(e);
}

class EngineHostServed : public ::testing::Test {
 protected:
  void SetUp() override {
    wsync_engine_options o = Options(&r_, kDense);
    ASSERT_EQ(wsync_engine_create(&o, &e_), 0) << LastError();
    ASSERT_EQ(wsync_engine_start(e_), 0) << LastError();
    EXPECT_EQ(wsync_engine_start(e_), 9);  // FAILED_PRECONDITION: already started
    stub_ = wsync::v1::RolloutEngine::NewStub(wsync::MakeChannel(wsync_engine_address(e_), {}));
  }
  void TearDown() override { wsync_engine_destroy(e_); }

  grpc::Status Pause(wsync::v1::PauseRequest::Mode mode) {
    grpc::ClientContext ctx;
    wsync::v1::PauseRequest req;
    req.set_mode(mode);
    wsync::v1::PauseReply reply;
    return stub_->Pause(&ctx, req, &reply);
  }
  grpc::Status Flush() {
    grpc::ClientContext ctx;
    wsync::v1::FlushReply reply;
    return stub_->Flush(&ctx, {}, &reply);
  }
  grpc::Status Continue(uint64_t version) {
    grpc::ClientContext ctx;
    wsync::v1::ContinueRequest req;
    req.set_version(version);
    wsync::v1::ContinueReply reply;
    return stub_->Continue(&ctx, req, &reply);
  }
  int State(uint64_t* version) {
    int state = 0;
    EXPECT_EQ(wsync_engine_health(e_, &state, version), 0);
    return state;
  }

  Recorder r_;
  wsync_engine* e_ = nullptr;
  std::unique_ptr<wsync::v1::RolloutEngine::Stub> stub_;
};

TEST_F(EngineHostServed, TheSyncProtocolDrivesPrepareAndAdmission) {
  uint64_t v = 99;
  EXPECT_EQ(State(&v), 3);  // NO_WEIGHTS
  EXPECT_EQ(wsync_engine_begin_request(e_, 100, &v), 9);
  EXPECT_NE(LastError().find("no weights"), std::string::npos) << LastError();
  // The agent's commit: Pause(HOLD), Flush, (write), Continue(5).
  ASSERT_TRUE(Pause(wsync::v1::PauseRequest::HOLD).ok());
  ASSERT_TRUE(Flush().ok());
  ASSERT_TRUE(Continue(5).ok());
  {
    absl::MutexLock lock(&r_.mu);
    EXPECT_EQ(r_.prepared, std::vector<uint64_t>{5});
  }
  EXPECT_EQ(State(&v), 1);
  EXPECT_EQ(v, 5u);
  ASSERT_EQ(wsync_engine_begin_request(e_, 1000, &v), 0);
  EXPECT_EQ(v, 5u);
  // A request in flight: the pause counts it, Flush refuses until it ends.
  ASSERT_TRUE(Pause(wsync::v1::PauseRequest::HOLD).ok());
  EXPECT_EQ(Flush().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(wsync_engine_request_stopped(e_), 0);  // HOLD lets it finish
  wsync_engine_end_request(e_);
  EXPECT_TRUE(Flush().ok());
  // A request arriving while held waits for the Continue, then runs on the new version.
  std::atomic<int> rc{-1};
  uint64_t held_version = 0;
  std::thread held([&] { rc = wsync_engine_begin_request(e_, 5000, &held_version); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(rc.load(), -1);
  ASSERT_TRUE(Continue(6).ok());
  held.join();
  ASSERT_EQ(rc.load(), 0);
  EXPECT_EQ(held_version, 6u);
  // ABORT: a running request is told to stop; new ones are refused.
  ASSERT_TRUE(Pause(wsync::v1::PauseRequest::ABORT).ok());
  EXPECT_EQ(wsync_engine_request_stopped(e_), 14);
  wsync_engine_end_request(e_);
  EXPECT_EQ(wsync_engine_begin_request(e_, 100, &v), 14);
  ASSERT_TRUE(Continue(6).ok());  // the same version: no prepare
  absl::MutexLock lock(&r_.mu);
  EXPECT_EQ(r_.prepared, (std::vector<uint64_t>{5, 6}));
  // The engine's own serving followed: paused (HOLD = 1, ABORT = 2) and resumed on every Continue.
  EXPECT_EQ(r_.hooks,
            (std::vector<std::string>{"pause 1", "continue 5", "pause 1", "continue 6", "pause 2", "continue 6"}));
}

TEST_F(EngineHostServed, UpdateWeightsAsksTheAgentAndNamesItWhenItIsGone) {
  uint64_t v = 0;
  EXPECT_EQ(wsync_engine_update_weights(e_, 0, 2000, &v), 14);  // UNAVAILABLE: nobody at 127.0.0.1:1
  EXPECT_NE(LastError().find("UpdateWeights at the rollout agent 127.0.0.1:1"), std::string::npos) << LastError();
}

TEST_F(EngineHostServed, AFailedPrepareLeavesTheEngineUnhealthyUntilOneSucceeds) {
  {
    absl::MutexLock lock(&r_.mu);
    r_.fail_next = true;
  }
  ASSERT_TRUE(Pause(wsync::v1::PauseRequest::HOLD).ok());
  grpc::Status s = Continue(3);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.error_message().find("lm_head.weight"), std::string::npos) << s.error_message();
  uint64_t v = 0;
  EXPECT_EQ(State(&v), 4);  // UNHEALTHY
  EXPECT_EQ(wsync_engine_begin_request(e_, 100, &v), 14);
  ASSERT_TRUE(Continue(3).ok());
  EXPECT_EQ(State(&v), 1);
  EXPECT_EQ(v, 3u);
}

TEST_F(EngineHostServed, GenerateOverGrpcCallsTheEngineAndNamesTheVersion) {
  ASSERT_TRUE(Continue(2).ok());
  grpc::ClientContext ctx;
  wsync::v1::GenerateRequest req;
  for (int t : {1, 2, 3}) req.add_prompt(t);
  req.set_max_new_tokens(4);
  wsync::v1::GenerateReply reply;
  grpc::Status s = stub_->Generate(&ctx, req, &reply);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(reply.version(), 2u);
  ASSERT_EQ(reply.tokens_size(), 4);
  EXPECT_EQ(reply.tokens(3), 10);
  absl::MutexLock lock(&r_.mu);
  EXPECT_EQ(r_.last_prompt, (std::vector<int32_t>{1, 2, 3}));
}

}  // namespace
