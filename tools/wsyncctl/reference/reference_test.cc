// Tests of the independent verifier (reference.h, int4_scalar.h).
//
// Agreement: random checkpoints (model/testing, recorded seeds) of Llama, Qwen2, Qwen3 (tied and
// untied), Qwen3-MoE and DeepSeek-V3, bf16 / compressed-tensors / AWQ, TP 1-4 and EP 1-4: the
// engine memory wsync's own path produces (trainer quantization, Loader, Commit: verify.h's
// ExpectedEngineWeights, used here and only here) must pass the reference param by param.
// Sensitivity: the same memory with one bit flipped in a Marlin word, a scale, a zero point or a
// bf16 param, a swapped qkv block, a param missing, one extra, a wrong shape, another quantizer
// variant or other weights must fail, each naming the param and the element.
// Scalar pieces: the specs' worked examples and a second formulation of the Marlin layout
// (vLLM's Python reference, FORMATS.md §4.4) against the decoders; quantizer edge cases by hand.
#include "tools/wsyncctl/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine_model/engine_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/quant_target.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"
#include "tools/wsyncctl/reference/fp8_scalar.h"
#include "tools/wsyncctl/reference/int4_scalar.h"
#include "tools/wsyncctl/verify.h"

namespace wsync::tools::reference {
namespace {

using ::testing::HasSubstr;
using Verdict = ParamResult::Verdict;
using Tensors = std::map<std::string, Tensor>;

// --- fixtures -------------------------------------------------------------------------------------

// A model directory under TempDir(): config.json and model.safetensors holding MakeHfModel's bf16
// checkpoint of `seed` (DeepSeek's MTP layer included), after `edit`.
std::string WriteCheckpoint(const std::string& name, const std::string& config_json, uint32_t seed,
                            const std::function<void(Tensors*)>& edit = nullptr) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::create_directories(dir);
  auto config = ParseModelConfig(config_json, name);
  EXPECT_TRUE(config.ok()) << config.status();
  auto model = model::testing::MakeHfModel(*config, nullptr, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  if (edit) edit(&model->sent);
  SafetensorsWriter w;
  for (const auto& [n, t] : model->sent) EXPECT_TRUE(w.Add(n, t.view()).ok()) << n;
  EXPECT_TRUE(w.Write(dir + "/model.safetensors").ok());
  std::ofstream(dir + "/config.json") << config_json;
  return dir;
}

kernels::QuantVariant KernelVariant(SymmetricVariant v) {
  return v == SymmetricVariant::kQat ? kernels::QuantVariant::kQat : kernels::QuantVariant::kSlime;
}
kernels::AwqArith KernelArith(AwqArith a) {
  return a == AwqArith::kFp16 ? kernels::AwqArith::kFp16 : kernels::AwqArith::kFp32;
}

// What a sync of the checkpoint in `dir` puts into every rank of a (T, EP) engine, computed by
// wsync's own path: the trainer's quantization of what it sends (model::QuantizeHfTensor for every
// model::IsQuantTarget, as trainer_agent::ExpectedSentTensors does; called per tensor here because
// that function refuses Llama's attention_bias, which the trainer cannot convert from Megatron but
// an engine holds), then per rank the rollout agent's Loader and Commit (ExpectedEngineWeights).
// Each rank as its engine would report it.
absl::StatusOr<std::vector<std::vector<EngineParam>>> WsyncEngineMemory(const std::string& dir,
                                                                        const ReferenceOptions& o, int T, int EP) {
  std::optional<QuantizationConfig> q;
  if (!o.quantization_config_json.empty()) {
    ASSIGN_OR_RETURN(q, ParseQuantizationConfig(o.quantization_config_json, "test quantization config"));
  }
  model::QuantizeOptions qo;
  qo.variant = KernelVariant(o.variant);
  qo.awq_arith = KernelArith(o.awq_arith);
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(dir + "/model.safetensors"));
  std::vector<model::HfTensor> sent;
  for (const SafetensorsEntry& e : file.tensors()) {
    if (q && model::IsQuantTarget(e.name, e.view.shape(), *q)) {
      ASSIGN_OR_RETURN(std::vector<model::HfTensor> triple, model::QuantizeHfTensor(e.name, e.view, *q, qo));
      for (model::HfTensor& t : triple) sent.push_back(std::move(t));
    } else {
      sent.push_back({e.name, e.view, Tensor()});
    }
  }
  std::vector<std::vector<EngineParam>> ranks;
  for (int r = 0; r < T; ++r) {
    ASSIGN_OR_RETURN(auto layout, engine_model::EngineLayout::Create(config, q ? &*q : nullptr, {T, r, EP}));
    ASSIGN_OR_RETURN(auto engine, ExpectedEngineWeights(layout, sent));
    std::vector<EngineParam> params;
    for (const engine_model::EngineBuffer& b : engine->weights().buffers())
      params.push_back({b.name, std::string(SafetensorsName(b.dtype)),
                        std::vector<int64_t>(b.shape.begin(), b.shape.end()),
                        std::string(static_cast<const char*>(b.data), b.nbytes)});
    ranks.push_back(std::move(params));
  }
  return ranks;
}

EngineParam* FindParam(std::vector<EngineParam>* params, absl::string_view name) {
  for (EngineParam& p : *params)
    if (p.name == name) return &p;
  ADD_FAILURE() << "no engine param " << name;
  return nullptr;
}

// --- agreement with wsync's path ------------------------------------------------------------------

enum class Quant { kNone, kCt, kAwq, kFp8 };

struct Case {
  const char* label;
  const char* config;
  Quant quant = Quant::kNone;
  int group = 128;
  std::vector<std::string> ignore;  // compressed-tensors ignore / AWQ modules_to_not_convert
  std::vector<std::pair<int, int>> tp_ep;
  uint32_t seed = 0;
  SymmetricVariant variant = SymmetricVariant::kQat;
  AwqArith arith = AwqArith::kFp16;
  const char* layout = "marlin";  // the engine_layout the engines declare (compressed-tensors)
  const char* fp8 = "";           // Quant::kFp8: the quantization_config
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.label << " (seed " << c.seed << ")"; }

ReferenceOptions OptionsOf(const Case& c) {
  ReferenceOptions o;
  if (c.quant == Quant::kCt) o.quantization_config_json = model::testing::QuantJson(c.group, c.ignore);
  if (std::string(c.layout) != "marlin")
    o.quantization_config_json.insert(1, absl::StrCat("\"engine_layout\": \"", c.layout, "\", "));
  if (c.quant == Quant::kAwq) o.quantization_config_json = model::testing::AwqQuantJson(c.group, c.ignore);
  if (c.quant == Quant::kFp8) o.quantization_config_json = c.fp8;
  o.variant = c.variant;
  o.awq_arith = c.arith;
  return o;
}

// Qwen3 with a vocab whose padding to 64 (1088) differs from a padding to 128 (1152).
std::string Qwen3Vocab1050Json() {
  std::string s = model::testing::kQwen3Json;
  const std::string from = R"("vocab_size": 1000)";
  s.replace(s.find(from), from.size(), R"("vocab_size": 1050)");
  return s;
}
const std::string& Qwen3Vocab1050() {
  static const std::string s = Qwen3Vocab1050Json();
  return s;
}

// Qwen2 in float16 (scales and plain params in fp16).
std::string Qwen2Fp16Json() {
  std::string s = model::testing::kQwen2Json;
  const std::string from = R"("torch_dtype": "bfloat16")";
  s.replace(s.find(from), from.size(), R"("torch_dtype": "float16")");
  return s;
}
const std::string& Qwen2Fp16() {
  static const std::string s = Qwen2Fp16Json();
  return s;
}

std::string Qwen3TiedJson() {
  std::string s = model::testing::kQwen3Json;
  const std::string from = R"("tie_word_embeddings": false)";
  s.replace(s.find(from), from.size(), R"("tie_word_embeddings": true)");
  return s;
}
const std::string& Qwen3Tied() {
  static const std::string s = Qwen3TiedJson();
  return s;
}

const std::vector<std::string> kAllInt4 = {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"};
const std::vector<std::string> kSlimeIgnore = {
    "lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens.*", "re:.*norm.*", "re:.*shared_experts.*"};
const std::vector<std::string> kDeepseekMaxInt4 = {"lm_head",        "re:.*embed_tokens.*",      "re:.*mlp\\.gate$",
                                                   "re:.*q_a_proj$", "re:.*kv_a_proj_with_mqa$", "re:.*kv_b_proj$"};
const std::vector<std::string> kDeepseekNoQLoraInt4 = {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$",
                                                       "re:.*kv_b_proj$"};

constexpr const char kFp8Block64[] =
    R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]})";
constexpr const char kFp8Block64x128Ue8m0[] = R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [64, 128], "scale_fmt": "ue8m0"})";
constexpr const char kFp8Channel[] = R"({"quant_method": "compressed-tensors", "format": "float-quantized",
  "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"],
  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false}}}})";

std::vector<Case> AgreementCases() {
  using model::testing::kDeepseekJson, model::testing::kDeepseekNoQLoraJson, model::testing::kGlm45Json,
      model::testing::kLlamaJson, model::testing::kQwen2Json, model::testing::kQwen3Json,
      model::testing::kQwen3MoeH128Json, model::testing::kQwen3MoeJson;
  const auto S = SymmetricVariant::kSlime;
  const auto F32 = AwqArith::kFp32;
  const auto Q = SymmetricVariant::kQat;
  const auto F16 = AwqArith::kFp16;
  return {
      {"qwen3_untied_bf16", kQwen3Json, Quant::kNone, 0, {}, {{1, 1}, {2, 1}, {4, 1}}, 101},
      {"qwen3_tied_bf16", Qwen3Tied().c_str(), Quant::kNone, 0, {}, {{1, 1}, {2, 1}}, 102},
      {"qwen3_untied_ct_g128", kQwen3Json, Quant::kCt, 128, kAllInt4, {{1, 1}, {2, 1}}, 103},
      {"qwen3_tied_ct_g32_slime", Qwen3Tied().c_str(), Quant::kCt, 32, kAllInt4, {{1, 1}, {2, 1}}, 104, S},
      {"qwen3_vocab1050_bf16", Qwen3Vocab1050().c_str(), Quant::kNone, 0, {}, {{2, 1}, {4, 1}}, 106},
      {"qwen3_awq_g128", kQwen3Json, Quant::kAwq, 128, {}, {{2, 1}}, 105},
      {"qwen2_bias_bf16", kQwen2Json, Quant::kNone, 0, {}, {{1, 1}, {2, 1}, {4, 1}}, 111},
      {"qwen2_bias_ct_g64", kQwen2Json, Quant::kCt, 64, kAllInt4, {{1, 1}, {2, 1}}, 112},
      {"qwen2_fp16_bf16", Qwen2Fp16().c_str(), Quant::kNone, 0, {}, {{2, 1}}, 115},
      {"qwen2_fp16_ct_g32", Qwen2Fp16().c_str(), Quant::kCt, 32, kAllInt4, {{2, 1}}, 116},
      {"qwen2_fp16_awq_g64", Qwen2Fp16().c_str(), Quant::kAwq, 64, {}, {{1, 1}}, 117},
      {"qwen2_bias_awq_g32", kQwen2Json, Quant::kAwq, 32, {}, {{1, 1}, {2, 1}}, 113},
      {"qwen2_bias_awq_g32_fp32", kQwen2Json, Quant::kAwq, 32, {}, {{2, 1}}, 114, SymmetricVariant::kQat, F32},
      {"llama_bf16", kLlamaJson, Quant::kNone, 0, {}, {{2, 1}, {4, 1}}, 121},
      {"llama_ct_g128", kLlamaJson, Quant::kCt, 128, kAllInt4, {{1, 1}, {4, 1}}, 122},
      {"llama_ct_channel", kLlamaJson, Quant::kCt, -1, kAllInt4, {{1, 1}, {2, 1}}, 123},
      {"llama_awq_channel", kLlamaJson, Quant::kAwq, -1, {}, {{1, 1}, {2, 1}}, 124},
      {"llama_awq_g64_fp32", kLlamaJson, Quant::kAwq, 64, {}, {{4, 1}}, 125, SymmetricVariant::kQat, F32},
      {"qwen3moe_bf16", kQwen3MoeJson, Quant::kNone, 0, {}, {{1, 1}, {2, 2}, {4, 2}}, 131},
      {"qwen3moe_ct_g128_slime_ignore", kQwen3MoeJson, Quant::kCt, 128, kSlimeIgnore, {{2, 2}, {4, 4}}, 132, S},
      {"qwen3moe_ct_g32_all", kQwen3MoeJson, Quant::kCt, 32, kAllInt4, {{1, 1}, {2, 1}, {2, 2}}, 133},
      {"qwen3moe_awq_g64", kQwen3MoeJson, Quant::kAwq, 64, {}, {{2, 2}, {4, 1}}, 134},
      {"qwen3moe_h128_ct_g128_quirk", kQwen3MoeH128Json, Quant::kCt, 128, kSlimeIgnore, {{1, 1}, {2, 2}}, 135},
      {"qwen3moe_h128_awq_g128_quirk", kQwen3MoeH128Json, Quant::kAwq, 128, {"self_attn"}, {{1, 1}, {2, 2}}, 136},
      {"deepseek_bf16", kDeepseekJson, Quant::kNone, 0, {}, {{1, 1}, {2, 1}, {4, 4}}, 141},
      {"deepseek_ct_g128_max", kDeepseekJson, Quant::kCt, 128, kDeepseekMaxInt4, {{2, 1}, {4, 2}}, 142},
      {"deepseek_noqlora_ct_g32", kDeepseekNoQLoraJson, Quant::kCt, 32, kDeepseekNoQLoraInt4, {{1, 1}, {4, 4}}, 143},
      {"deepseek_noqlora_awq_g32", kDeepseekNoQLoraJson, Quant::kAwq, 32, {"kv_b_proj"}, {{2, 2}}, 144},
      {"glm45_bf16", kGlm45Json, Quant::kNone, 0, {}, {{1, 1}, {2, 2}}, 145},
      {"glm45_ct_g64_slime_ignore", kGlm45Json, Quant::kCt, 64, kSlimeIgnore, {{2, 2}, {4, 4}}, 146},
      // TensorRT-LLM W4A16 (TRTLLM_INT4.md): sm80 layout everywhere, sm90 dense layout for dense weights.
      {"llama_trtllm_sm80_g64", kLlamaJson, Quant::kCt, 64, kAllInt4, {{1, 1}, {2, 1}}, 151, Q, F16, "trtllm-sm80"},
      {"llama_trtllm_sm90_g32", kLlamaJson, Quant::kCt, 32, kAllInt4, {{1, 1}, {2, 1}}, 152, S, F16, "trtllm-sm90"},
      {"qwen3moe_trtllm_sm80_g128",
       kQwen3MoeJson,
       Quant::kCt,
       128,
       kSlimeIgnore,
       {{1, 1}, {2, 2}},
       153,
       Q,
       F16,
       "trtllm-sm80"},
      {"qwen3moe_trtllm_sm90_g32_all", kQwen3MoeJson, Quant::kCt, 32, kAllInt4, {{2, 2}}, 154, Q, F16, "trtllm-sm90"},
      // FP8 (FP8.md §4, §6): block (slime's scales, ue8m0 where the config says so) and per channel.
      {"deepseek_fp8_block64",
       kDeepseekJson,
       Quant::kFp8,
       0,
       {},
       {{1, 1}, {2, 1}, {2, 2}},
       161,
       Q,
       F16,
       "marlin",
       kFp8Block64},
      {"qwen3moe_fp8_block64x128_ue8m0",
       kQwen3MoeJson,
       Quant::kFp8,
       0,
       {},
       {{1, 1}, {2, 2}, {2, 1}},
       162,
       Q,
       F16,
       "marlin",
       kFp8Block64x128Ue8m0},
      {"llama_fp8_channel",
       kLlamaJson,
       Quant::kFp8,
       0,
       {},
       {{1, 1}, {2, 1}, {4, 1}},
       163,
       Q,
       F16,
       "marlin",
       kFp8Channel},
  };
}

class Agreement : public ::testing::TestWithParam<Case> {};

TEST_P(Agreement, WsyncEngineMemoryPassesTheReference) {
  const Case& c = GetParam();
  SCOPED_TRACE(absl::StrCat(c.label, " seed ", c.seed));
  const std::string dir = WriteCheckpoint(c.label, c.config, c.seed);
  const ReferenceOptions o = OptionsOf(c);
  auto ref = Reference::Open(dir, o);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto config = ParseModelConfig(c.config, c.label);
  ASSERT_TRUE(config.ok());
  for (auto [T, EP] : c.tp_ep) {
    auto ranks = WsyncEngineMemory(dir, o, T, EP);
    ASSERT_TRUE(ranks.ok()) << ranks.status();
    for (int r = 0; r < T; ++r) {
      SCOPED_TRACE(absl::StrCat("TP ", T, " EP ", EP, " rank ", r));
      const std::vector<EngineParam>& params = (*ranks)[static_cast<size_t>(r)];
      for (const EngineParam& p : params)  // 16-bit params are in the model's dtype (bf16 or fp16)
        if (p.dtype == "BF16" || p.dtype == "F16") {
          EXPECT_EQ(p.dtype, SafetensorsName(config->dtype)) << p.name;
        }
      auto report = ref->CheckRank({T, r, EP}, params);
      ASSERT_TRUE(report.ok()) << report.status();
      EXPECT_TRUE(report->ok()) << report->Summary();
      EXPECT_EQ(report->params.size(), params.size());
      auto expected = ref->ExpectedParams({T, r, EP});
      ASSERT_TRUE(expected.ok()) << expected.status();
      EXPECT_EQ(expected->size(), params.size());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Agreement, ::testing::ValuesIn(AgreementCases()),
                         [](const auto& info) { return std::string(info.param.label); });

// --- edge values: all-zero groups, exact ties, huge and tiny values -------------------------------

void SetRow(Tensors* t, const std::string& name, int64_t row, const std::vector<float>& values) {
  Tensor& x = t->at(name);
  ASSERT_EQ(x.dtype(), DType::kBF16);
  const int64_t k = x.shape()[1];
  for (int64_t c = 0; c < k; ++c)
    x.data_as<uint16_t>()[row * k + c] = F32ToBF16(values[static_cast<size_t>(c) % values.size()]);
}

// Rows of q_proj (column parallel) and o_proj (row parallel) of layer 0 with edge groups.
void EdgeRows(Tensors* t, bool fp16_range) {
  const std::string q = "model.layers.0.self_attn.q_proj.weight", o = "model.layers.0.self_attn.o_proj.weight";
  SetRow(t, q, 0, {0.0f});                                              // all zero
  SetRow(t, q, 1, {0.0f, -0.0f});                                       // zeros of both signs
  SetRow(t, q, 2, {1.75f, 0.625f, -0.625f, 0.875f, 0.125f, -1.375f});   // CT ties: scale 0.25, 2.5 / 3.5 / 0.5
  SetRow(t, q, 3, {1.0f, -0.5f, 0.25f, -2.0f, 1.5f, 0.1875f, -0.75f});  // AWQ ties
  SetRow(t, q, 4, {fp16_range ? 60000.0f : 3.0e38f, -1.0f, 0.5f, fp16_range ? -3000.0f : -1.0e38f});  // huge
  SetRow(t, q, 5, {1e-30f, -3e-39f, 1e-38f, 0.0f});  // tiny (bf16 subnormals), below 1e-5
  SetRow(t, q, 6, {1e-6f, -3e-7f, 6e-8f, 2e-6f});    // fp16 subnormals
  SetRow(t, q, 7, {0.5f});                           // a constant group
  SetRow(t, q, 8, {0.25f, 0.5f, 0.75f, 1.0f});       // all positive (AWQ z = 0)
  SetRow(t, q, 9, {-0.25f, -0.5f, -0.75f, -1.0f});   // all negative (AWQ z = 15)
  // AWQ fp16: a bf16 weight that fp16 rounds (27.5 -> 28 · 2^-24) at the floor scale 11 · 2^-24:
  // u = rint(28 / 11) = 3 from the fp16 weight, 2 from the unrounded one.
  SetRow(t, q, 10, {0.0f, std::ldexp(27.5f, -24)});
  SetRow(t, o, 0, {0.0f});
  SetRow(t, o, 1, {1.75f, 0.625f, -0.625f, 0.875f});
  SetRow(t, o, 2, {fp16_range ? 1000.0f : 1.0e30f, 1e-30f});
}

struct EdgeCase {
  const char* label;
  Quant quant;
  int group;
  SymmetricVariant variant;
  AwqArith arith;
};
void PrintTo(const EdgeCase& c, std::ostream* os) { *os << c.label; }

class EdgeValues : public ::testing::TestWithParam<EdgeCase> {};

TEST_P(EdgeValues, WsyncAndReferenceAgree) {
  const EdgeCase& e = GetParam();
  Case c{e.label, model::testing::kLlamaJson, e.quant, e.group, kAllInt4, {{2, 1}}, 201, e.variant, e.arith};
  if (e.quant == Quant::kAwq) c.ignore = {};
  const std::string dir =
      WriteCheckpoint(e.label, c.config, c.seed, [&](Tensors* t) { EdgeRows(t, e.quant == Quant::kAwq); });
  const ReferenceOptions o = OptionsOf(c);
  auto ref = Reference::Open(dir, o);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto ranks = WsyncEngineMemory(dir, o, 2, 1);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  for (int r = 0; r < 2; ++r) {
    auto report = ref->CheckRank({2, r, 1}, (*ranks)[static_cast<size_t>(r)]);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->ok()) << "rank " << r << "\n" << report->Summary();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Edges, EdgeValues,
    ::testing::Values(EdgeCase{"ct_qat_g32", Quant::kCt, 32, SymmetricVariant::kQat, AwqArith::kFp16},
                      EdgeCase{"ct_slime_g32", Quant::kCt, 32, SymmetricVariant::kSlime, AwqArith::kFp16},
                      EdgeCase{"ct_qat_channel", Quant::kCt, -1, SymmetricVariant::kQat, AwqArith::kFp16},
                      EdgeCase{"awq_fp16_g32", Quant::kAwq, 32, SymmetricVariant::kQat, AwqArith::kFp16},
                      EdgeCase{"awq_fp32_g32", Quant::kAwq, 32, SymmetricVariant::kQat, AwqArith::kFp32},
                      EdgeCase{"awq_fp16_channel", Quant::kAwq, -1, SymmetricVariant::kQat, AwqArith::kFp16}),
    [](const auto& info) { return std::string(info.param.label); });

TEST(EdgeValuesRefused, WeightsBeyondFp16AreRefusedUnderAwqFp16NamingTensorAndRow) {
  const std::string dir = WriteCheckpoint("awq_huge", model::testing::kLlamaJson, 202, [](Tensors* t) {
    SetRow(t, "model.layers.1.mlp.up_proj.weight", 3, {70000.0f, 1.0f});
  });
  ReferenceOptions o;
  o.quantization_config_json = model::testing::AwqQuantJson(32, {});
  auto ref = Reference::Open(dir, o);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto report = ref->CheckRank({1, 0, 1}, {});
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(report.status().message(), HasSubstr("model.layers.1.mlp.up_proj.weight\" row 3"));
  EXPECT_THAT(report.status().message(), HasSubstr("fp16"));
  o.awq_arith = AwqArith::kFp32;  // the float32 arithmetic takes it
  auto ref32 = Reference::Open(dir, o);
  ASSERT_TRUE(ref32.ok());
  auto ranks = WsyncEngineMemory(dir, o, 1, 1);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  auto report32 = ref32->CheckRank({1, 0, 1}, (*ranks)[0]);
  ASSERT_TRUE(report32.ok()) << report32.status();
  EXPECT_TRUE(report32->ok()) << report32->Summary();
}

// --- sensitivity: every broken premise is reported, naming the param and the element --------------

// One engine's memory and the reference of its checkpoint.
class Broken : public ::testing::Test {
 protected:
  void Prepare(const std::string& label, const char* config, const ReferenceOptions& o, int T, int EP, int rank) {
    dir_ = WriteCheckpoint(label, config, 301);
    auto ref = Reference::Open(dir_, o);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_.emplace(std::move(*ref));
    auto ranks = WsyncEngineMemory(dir_, o, T, EP);
    ASSERT_TRUE(ranks.ok()) << ranks.status();
    params_ = (*ranks)[static_cast<size_t>(rank)];
    rank_ = {T, rank, EP};
    RankReport clean = Check();
    ASSERT_TRUE(clean.ok()) << clean.Summary();
  }
  RankReport Check() {
    auto report = ref_->CheckRank(rank_, params_);
    EXPECT_TRUE(report.ok()) << report.status();
    return report.ok() ? *report : RankReport{};
  }
  // The only param not OK: `name`, with `verdict`; returns its detail.
  std::string OnlyFailure(const RankReport& r, absl::string_view name, Verdict verdict) {
    EXPECT_EQ(r.params.size() - r.Count(Verdict::kOk), 1u) << r.Summary();
    const ParamResult* p = r.Find(name);
    if (p == nullptr) {
      ADD_FAILURE() << name << " not in the report:\n" << r.Summary();
      return "";
    }
    EXPECT_EQ(p->verdict, verdict) << VerdictName(p->verdict) << " " << p->detail;
    EXPECT_THAT(r.Summary(), HasSubstr(std::string(name)));
    return p->detail;
  }
  static void FlipBit(EngineParam* p, size_t byte, int bit) {
    ASSERT_LT(byte, p->bytes.size());
    p->bytes[byte] = static_cast<char>(p->bytes[byte] ^ (1 << bit));
  }

  std::string dir_;
  std::optional<Reference> ref_;
  std::vector<EngineParam> params_;
  EngineRank rank_;
};

// The element a nibble of a Marlin array holds, by FORMATS.md §4.2 read forwards: byte `byte`
// bit `bit` of a [E, k/16, 2n] array.
std::string MarlinElement(size_t byte, int bit, int64_t k, int64_t n, bool experts) {
  static constexpr int kDk[8] = {0, 8, 0, 8, 1, 9, 1, 9}, kDn[8] = {0, 0, 8, 8, 0, 0, 8, 8};
  const int64_t word = static_cast<int64_t>(byte / 4), per_expert = k * n / 8;
  const int j = static_cast<int>(byte % 4) * 2 + bit / 4;
  const int64_t e = word / per_expert, w = word % per_expert, kt = w / (2 * n), col = w % (2 * n);
  const int64_t nt = col / 128, t = col % 128 / 4, v = col % 4;
  const int64_t kk = 16 * kt + 2 * (t % 4) + kDk[j], nn = 64 * nt + 16 * v + t / 4 + kDn[j];
  return absl::StrCat(experts ? absl::StrCat("expert ", e, ", ") : "", "row ", nn, ", column ", kk);
}

TEST_F(Broken, FlippedBitInAMarlinWordOfAnExpertTensor) {
  ReferenceOptions o;
  o.quantization_config_json = model::testing::QuantJson(32, kAllInt4);
  Prepare("broken_ct_moe", model::testing::kQwen3MoeJson, o, 2, 2, 1);
  const std::string name = "model.layers.2.mlp.experts.w13_weight_packed";  // [E_loc 4, H/16, 4I'], I' = 256
  EngineParam* p = FindParam(&params_, name);
  ASSERT_NE(p, nullptr);
  const size_t byte = 4 * (3 * (256 / 16) * 1024 + 5 * 1024 + 700) + 2;  // expert 3, k-tile 5, word 700
  FlipBit(p, byte, 5);
  const std::string d = OnlyFailure(Check(), name, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr(absl::StrCat("codes differ at ", MarlinElement(byte, 5, 256, 512, true))));
  EXPECT_THAT(d, HasSubstr("1 of 524288 codes differ"));
  EXPECT_THAT(d, HasSubstr("1 of 524288 dequantized float32 values"));
  EXPECT_THAT(d, HasSubstr("model.layers.2.mlp.experts.7."));  // local expert 3 of EP rank 1
}

TEST_F(Broken, FlippedBitInADenseMarlinWordAndScale) {
  ReferenceOptions o;
  o.quantization_config_json = model::testing::QuantJson(128, kAllInt4);
  Prepare("broken_ct_dense", model::testing::kLlamaJson, o, 2, 1, 0);
  {
    const std::string name = "model.layers.1.self_attn.o_proj.weight_packed";  // K_p 256, N 256
    EngineParam* p = FindParam(&params_, name);
    ASSERT_NE(p, nullptr);
    FlipBit(p, 1234, 0);
    const std::string d = OnlyFailure(Check(), name, Verdict::kMismatch);
    EXPECT_THAT(d, HasSubstr(MarlinElement(1234, 0, 256, 256, false)));
    EXPECT_THAT(d, HasSubstr("(group "));
    FlipBit(p, 1234, 0);
  }
  {
    const std::string name = "model.layers.0.mlp.gate_up_proj.weight_scale";  // [H/G 2, 2F/T 512], grouped perm
    EngineParam* p = FindParam(&params_, name);
    ASSERT_NE(p, nullptr);
    // Permuted scale 512 + 64 + 8·3 + 5 is row-of-groups 1, column 64 + 3 + 8·5 = 107 (FORMATS.md §5).
    FlipBit(p, 2 * (512 + 64 + 8 * 3 + 5) + 1, 6);
    const std::string d = OnlyFailure(Check(), name, Verdict::kMismatch);
    EXPECT_THAT(d, HasSubstr("scales differ at row 107, group 1"));
    EXPECT_THAT(d, HasSubstr("1 of 1024 scales differ"));
    EXPECT_THAT(d, HasSubstr("model.layers.0.mlp.gate_proj.weight[107, 128]"));
  }
}

TEST_F(Broken, FlippedBitInAwqZeroPointsScalesAndWords) {
  ReferenceOptions o;
  o.quantization_config_json = model::testing::AwqQuantJson(32, {});
  Prepare("broken_awq", model::testing::kQwen2Json, o, 2, 1, 1);
  const std::string zeros = "model.layers.1.self_attn.qkv_proj.qzeros";  // [H/G 8, n/8]
  EngineParam* z = FindParam(&params_, zeros);
  ASSERT_NE(z, nullptr);
  FlipBit(z, 0, 4);  // word 0 nibble 1 = column 8·ORDER[1] = 16 of group row 0 (AWQ.md §3.3)
  std::string d = OnlyFailure(Check(), zeros, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("zero points differ at row 16, group 0"));
  FlipBit(z, 0, 4);
  const std::string scales = "model.layers.0.mlp.down_proj.scales";  // row parallel
  FlipBit(FindParam(&params_, scales), 0, 15 - 8);
  d = OnlyFailure(Check(), scales, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("row 0, group 0"));
  EXPECT_THAT(d, HasSubstr("model.layers.0.mlp.down_proj.weight[0, 256]"));  // rank 1 holds K columns 256..511
  FlipBit(FindParam(&params_, scales), 0, 15 - 8);
  const std::string words = "model.layers.0.mlp.down_proj.qweight";
  FlipBit(FindParam(&params_, words), 77, 3);
  d = OnlyFailure(Check(), words, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr(MarlinElement(77, 3, 256, 256, false)));
}

TEST_F(Broken, TrtllmFlippedBitAndGateUpOrder) {
  ReferenceOptions o;
  o.quantization_config_json = model::testing::QuantJson(128, kSlimeIgnore);
  o.quantization_config_json.insert(1, R"("engine_layout": "trtllm-sm80", )");
  Prepare("broken_trtllm", model::testing::kQwen3MoeJson, o, 2, 2, 0);
  const std::string name = "model.layers.0.mlp.experts.w3_w1_weight";  // I8 [E_loc 4, H 256, I' 256]
  EngineParam* p = FindParam(&params_, name);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(p->dtype, "I8");
  FlipBit(p, 3 * 256 * 256 + 0, 4);  // expert 3, word 0, nibble 1: column 0, k' = 2 = row 8 (§1.1)
  std::string d = OnlyFailure(Check(), name, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("codes differ at expert 3, row 0, column 8 (group 0)"));
  EXPECT_THAT(d, HasSubstr("model.layers.0.mlp.experts.3.up_proj.weight[0, 8]"));  // up_proj first
  FlipBit(p, 3 * 256 * 256 + 0, 4);
  // gate_proj first (vLLM's w13 order) instead of TensorRT-LLM's w3_w1: columns [0, I') and
  // [I', 2I') swapped, i.e. words of column groups (n / 4) swapped, per k-row block (§1.1).
  std::string swapped = p->bytes;
  const int64_t K = 256, N = 512, per_expert = K * N / 2, half = per_expert / 2;
  for (int64_t e = 0; e < 4; ++e) {
    swapped.replace(e * per_expert, half, p->bytes, e * per_expert + half, half);
    swapped.replace(e * per_expert + half, half, p->bytes, e * per_expert, half);
  }
  p->bytes = swapped;
  RankReport r = Check();
  d = OnlyFailure(r, name, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("codes differ at expert 0, row 0, column 0"));
  const std::string scale = "model.layers.0.mlp.experts.w3_w1_weight_scale";
  EXPECT_EQ(r.Find(scale)->verdict, Verdict::kOk);
}

// FP8: one code of an expert's w13 and one block scale of a dense weight, each named with its
// element and the checkpoint element (or block) it came from.
TEST_F(Broken, Fp8FlippedCodeAndScale) {
  ReferenceOptions o;
  o.quantization_config_json = kFp8Block64x128Ue8m0;
  Prepare("broken_fp8", model::testing::kQwen3MoeJson, o, 2, 2, 1);
  const std::string w13 = "model.layers.2.mlp.experts.w13_weight";  // [E_loc 4, 2I 512, H 256] F8_E4M3
  EngineParam* p = FindParam(&params_, w13);
  ASSERT_NE(p, nullptr);
  FlipBit(p, (2 * 512 + 300) * 256 + 17, 0);  // local expert 2, row 300 (up_proj row 44), column 17
  std::string d = OnlyFailure(Check(), w13, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("element [2, 300, 17]"));
  EXPECT_THAT(d, HasSubstr("model.layers.2.mlp.experts.6.up_proj.weight#fp8[44, 17]"));  // EP rank 1: experts 4..7
  EXPECT_THAT(d, HasSubstr("1 of 524288 elements differ"));
  FlipBit(p, (2 * 512 + 300) * 256 + 17, 0);
  const std::string o_scale = "model.layers.0.self_attn.o_proj.weight_scale_inv";  // [256/64, 128/128] F32
  EngineParam* s = FindParam(&params_, o_scale);
  ASSERT_NE(s, nullptr);
  FlipBit(s, 4 * 3 + 1, 3);  // block (3, 0): rows 192.., columns 128.. of the HF o_proj (TP rank 1)
  d = OnlyFailure(Check(), o_scale, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("element [3, 0]"));
  EXPECT_THAT(d, HasSubstr("model.layers.0.self_attn.o_proj.weight#scale[3, 1]"));
}

TEST_F(Broken, FlippedBitInABf16Param) {
  Prepare("broken_bf16", model::testing::kQwen3MoeJson, {}, 2, 2, 0);
  const std::string name = "model.layers.1.post_attention_layernorm.weight";
  FlipBit(FindParam(&params_, name), 2 * 77, 0);
  std::string d = OnlyFailure(Check(), name, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("element [77]"));
  EXPECT_THAT(d, HasSubstr("from model.layers.1.post_attention_layernorm.weight[77])"));
  EXPECT_THAT(d, HasSubstr("1 of 256 elements differ"));
  FlipBit(FindParam(&params_, name), 2 * 77, 0);
  const std::string w2 = "model.layers.0.mlp.experts.w2_weight";  // [E_loc 4, H 256, I' 256]
  FlipBit(FindParam(&params_, w2), 2 * ((2 * 256 + 9) * 256 + 100), 3);
  d = OnlyFailure(Check(), w2, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("element [2, 9, 100]"));
  EXPECT_THAT(d, HasSubstr("from model.layers.0.mlp.experts.2.down_proj.weight[9, 100]"));
}

TEST_F(Broken, SwappedQkvBlocks) {
  Prepare("broken_qkv", model::testing::kLlamaJson, {}, 2, 1, 1);
  const std::string name = "model.layers.0.self_attn.qkv_proj.weight";  // q rows 0..255, k 256..319, v 320..383
  EngineParam* p = FindParam(&params_, name);
  ASSERT_NE(p, nullptr);
  const size_t row_bytes = 256 * 2;
  std::string k_block = p->bytes.substr(256 * row_bytes, 64 * row_bytes);
  std::string v_block = p->bytes.substr(320 * row_bytes, 64 * row_bytes);
  p->bytes.replace(256 * row_bytes, 64 * row_bytes, v_block);
  p->bytes.replace(320 * row_bytes, 64 * row_bytes, k_block);
  const std::string d = OnlyFailure(Check(), name, Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("element [256, 0]"));
  EXPECT_THAT(d, HasSubstr("from model.layers.0.self_attn.k_proj.weight[64, 0]"));  // rank 1: kv head 1
}

TEST_F(Broken, MissingExtraAndMisshapenParams) {
  ReferenceOptions o;
  o.quantization_config_json = model::testing::QuantJson(32, kDeepseekMaxInt4);
  Prepare("broken_set", model::testing::kDeepseekJson, o, 2, 1, 0);
  const std::string gone = "model.layers.1.mlp.experts.w2_weight_scale";
  std::vector<EngineParam> saved = params_;
  params_.erase(std::find_if(params_.begin(), params_.end(), [&](const auto& p) { return p.name == gone; }));
  std::string d = OnlyFailure(Check(), gone, Verdict::kMissing);
  EXPECT_THAT(d, HasSubstr("BF16[8, 4, 256]"));
  params_ = saved;
  params_.push_back({"model.layers.0.self_attn.q_proj.weight", "BF16", {2, 2}, std::string(8, '\0')});
  d = OnlyFailure(Check(), "model.layers.0.self_attn.q_proj.weight", Verdict::kUnexpected);
  EXPECT_THAT(d, HasSubstr("BF16[2, 2]"));
  params_ = saved;
  EngineParam* emb = FindParam(&params_, "model.embed_tokens.weight");
  emb->shape = {emb->shape[1], emb->shape[0]};
  d = OnlyFailure(Check(), "model.embed_tokens.weight", Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("engine holds BF16[256, 512], expected BF16[512, 256]"));
  emb->shape = {emb->shape[1], emb->shape[0]};
  emb->dtype = "F16";
  d = OnlyFailure(Check(), "model.embed_tokens.weight", Verdict::kMismatch);
  EXPECT_THAT(d, HasSubstr("engine holds F16[512, 256]"));
}

TEST_F(Broken, AnotherQuantizerVariantIsReported) {
  ReferenceOptions o;
  o.quantization_config_json = model::testing::QuantJson(32, kAllInt4);
  o.variant = SymmetricVariant::kSlime;  // the engine is fed by a slime-variant trainer
  Prepare("broken_variant", model::testing::kQwen3MoeJson, o, 1, 1, 0);
  o.variant = SymmetricVariant::kQat;  // the reference is told qat
  auto qat = Reference::Open(dir_, o);
  ASSERT_TRUE(qat.ok());
  auto report = qat->CheckRank(rank_, params_);
  ASSERT_TRUE(report.ok()) << report.status();
  // FORMATS.md §1.3: the variants differ on exact ties only (~0.1 % of codes), never in the scales
  // of these weights.
  EXPECT_GT(report->Count(Verdict::kMismatch), 0u) << report->Summary();
  for (const ParamResult& p : report->params) {
    if (p.verdict == Verdict::kOk) continue;
    EXPECT_THAT(p.name, HasSubstr("_packed"));
    EXPECT_THAT(p.detail, HasSubstr("codes differ at"));
  }
}

TEST_F(Broken, OtherWeightsAreReportedEverywhere) {
  Prepare("broken_weights", model::testing::kQwen2Json, {}, 2, 1, 0);
  const std::string other = WriteCheckpoint("other_weights", model::testing::kQwen2Json, 302, [](Tensors* t) {
    SetRow(t, "model.layers.0.mlp.down_proj.weight", 0, {1.0f});
  });
  auto ref = Reference::Open(other, {});
  ASSERT_TRUE(ref.ok());
  auto report = ref->CheckRank(rank_, params_);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->Count(Verdict::kMismatch), report->params.size());
}

// --- bad input ------------------------------------------------------------------------------------

TEST(BadInput, ErrorsNameTheFileTensorOrParam) {
  const std::string dir = WriteCheckpoint("bad_input", model::testing::kQwen2Json, 401);
  auto ref = Reference::Open(dir, {});
  ASSERT_TRUE(ref.ok());
  auto ranks = WsyncEngineMemory(dir, {}, 1, 1);
  ASSERT_TRUE(ranks.ok());
  std::vector<EngineParam> params = (*ranks)[0];
  params.push_back(params[0]);
  auto dup = ref->CheckRank({1, 0, 1}, params);
  EXPECT_THAT(dup.status().message(), HasSubstr(absl::StrCat("\"", params[0].name, "\" is reported twice")));
  params = (*ranks)[0];
  params[1].dtype = "F64";
  EXPECT_THAT(ref->CheckRank({1, 0, 1}, params).status().message(), HasSubstr(params[1].name));
  params = (*ranks)[0];
  params[2].bytes.pop_back();
  EXPECT_THAT(ref->CheckRank({1, 0, 1}, params).status().message(),
              HasSubstr(absl::StrCat("\"", params[2].name, "\" is ")));
  EXPECT_THAT(ref->CheckRank({1, 0, 1}, params).status().message(),
              HasSubstr(absl::StrCat("but ", params[2].bytes.size(), " bytes came")));
  // §6 refusals, with the values.
  EXPECT_THAT(ref->CheckRank({3, 0, 1}, {}).status().message(), HasSubstr("padded vocab 1024"));
  EXPECT_THAT(ref->CheckRank({2, 0, 2}, {}).status().message(), HasSubstr("ep_size 2 on a model without experts"));
  EXPECT_EQ(ref->CheckRank({2, 2, 1}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  // TensorRT-LLM: K and N multiples of 64 on every rank. The H = 128 Qwen3-MoE at T = 4, EP 1:
  // the experts' w2 has K = I' = 32, which Marlin takes (32 % 16 == 0) and TensorRT-LLM does not.
  const std::string h128 = WriteCheckpoint("bad_trtllm", model::testing::kQwen3MoeH128Json, 405);
  ReferenceOptions marlin;
  marlin.quantization_config_json = model::testing::QuantJson(32, kSlimeIgnore);
  ReferenceOptions trt = marlin;
  trt.quantization_config_json.insert(1, R"("engine_layout": "trtllm-sm80", )");
  auto m4 = Reference::Open(h128, marlin);
  auto t4 = Reference::Open(h128, trt);
  ASSERT_TRUE(m4.ok() && t4.ok());
  EXPECT_TRUE(m4->ExpectedParams({4, 0, 1}).ok()) << m4->ExpectedParams({4, 0, 1}).status();
  EXPECT_THAT(t4->ExpectedParams({4, 0, 1}).status().message(),
              HasSubstr("model.layers.1.mlp.experts.w2: TensorRT-LLM needs K % 64 == 0 and N % 64 == 0, got K 32"));
  // AWQ with a TensorRT-LLM layout: not a setting wsync serves.
  ReferenceOptions awq_trt;
  awq_trt.quantization_config_json = model::testing::AwqQuantJson(32, {});
  awq_trt.quantization_config_json.insert(1, R"("engine_layout": "trtllm-sm80", )");
  EXPECT_EQ(Reference::Open(dir, awq_trt).status().code(), absl::StatusCode::kUnimplemented);
  // Mixed quantization of a fused layer, an INT4 router: refused naming them.
  ReferenceOptions mixed;
  mixed.quantization_config_json = model::testing::QuantJson(32, {"lm_head", "re:.*k_proj$"});
  auto m = Reference::Open(dir, mixed);
  ASSERT_TRUE(m.ok());
  EXPECT_THAT(m->CheckRank({1, 0, 1}, {}).status().message(),
              HasSubstr("model.layers.0.self_attn.qkv_proj: 2 of its 3"));
  // A checkpoint tensor missing, one of the wrong shape, an unknown one.
  const std::string missing = WriteCheckpoint("ckpt_missing", model::testing::kQwen2Json, 402,
                                              [](Tensors* t) { t->erase("model.layers.1.self_attn.v_proj.bias"); });
  auto s = Reference::Open(missing, {})->CheckRank({1, 0, 1}, {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("\"model.layers.1.self_attn.v_proj.bias\" is missing"));
  const std::string misshapen = WriteCheckpoint("ckpt_misshapen", model::testing::kQwen2Json, 403, [](Tensors* t) {
    (*t)["model.norm.weight"] = std::move(*Tensor::Zeros(DType::kBF16, {255}));
  });
  s = Reference::Open(misshapen, {})->CheckRank({1, 0, 1}, {});
  EXPECT_THAT(s.status().message(), HasSubstr("\"model.norm.weight\" ("));
  EXPECT_THAT(s.status().message(), HasSubstr("is BF16[255], the config implies shape [256]"));
  const std::string unknown = WriteCheckpoint("ckpt_unknown", model::testing::kQwen2Json, 404, [](Tensors* t) {
    t->emplace("model.layers.0.mlp.extra.weight", std::move(*Tensor::Zeros(DType::kBF16, {2, 2})));
  });
  s = Reference::Open(unknown, {})->CheckRank({1, 0, 1}, {});
  EXPECT_THAT(s.status().message(), HasSubstr("\"model.layers.0.mlp.extra.weight\""));
  EXPECT_THAT(s.status().message(), HasSubstr("is not a tensor of Qwen2ForCausalLM"));
  EXPECT_EQ(Reference::Open(::testing::TempDir() + "/nowhere", {}).status().code(), absl::StatusCode::kNotFound);
}

// --- the scalar pieces against the specs ----------------------------------------------------------

// FORMATS.md §4.2: "word 0 of tile (0,0) holds, from bit 0 up, u[0,0], u[8,0], u[0,8], u[8,8],
// u[1,0], u[9,0], u[1,8], u[9,8]" (u[k, n]).
TEST(Int4Scalar, MarlinWorkedExample) {
  std::vector<unsigned char> words(16 * 64 / 2, 0);
  words[0] = 0x10;
  words[1] = 0x32;
  words[2] = 0x54;
  words[3] = 0x76;
  std::vector<uint8_t> codes(16 * 64, 0xFF);
  DecodeMarlinWeight(words.data(), 16, 64, codes.data());
  auto u = [&](int k, int n) { return codes[static_cast<size_t>(n * 16 + k)]; };
  EXPECT_EQ(u(0, 0), 0);
  EXPECT_EQ(u(8, 0), 1);
  EXPECT_EQ(u(0, 8), 2);
  EXPECT_EQ(u(8, 8), 3);
  EXPECT_EQ(u(1, 0), 4);
  EXPECT_EQ(u(9, 0), 5);
  EXPECT_EQ(u(1, 8), 6);
  EXPECT_EQ(u(9, 8), 7);
  for (uint8_t c : codes) EXPECT_LE(c, 15);  // every element written
}

// FORMATS.md §4.4: vLLM's Python reference (marlin_permute_weights + get_weight_perm + pack_cols),
// a second formulation of the layout; the decoder must invert it on random codes.
std::vector<unsigned char> VllmMarlinWeights(const std::vector<uint8_t>& q_kn, int64_t K, int64_t N) {
  std::vector<int> perm;
  for (int i = 0; i < 32; ++i) {
    std::vector<int> perm1;
    const int col = i / 4;
    for (int block : {0, 1})
      for (int row : {2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1})
        perm1.push_back(16 * row + col + 8 * block);
    for (int j = 0; j < 4; ++j)
      for (int p : perm1) perm.push_back(p + 256 * j);
  }
  static constexpr int kInterleave[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  std::vector<int> interleaved(perm.size());
  for (size_t g = 0; g < perm.size() / 8; ++g)
    for (int i = 0; i < 8; ++i) interleaved[g * 8 + i] = perm[g * 8 + kInterleave[i]];
  // reshape [K/16, 16, N/16, 16] -> permute (0, 2, 1, 3) -> [K/16, 16N]
  std::vector<uint8_t> tiled(static_cast<size_t>(K * N));
  for (int64_t kt = 0; kt < K / 16; ++kt)
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t nt = 0; nt < N / 16; ++nt)
        for (int64_t j = 0; j < 16; ++j)
          tiled[kt * 16 * N + nt * 256 + i * 16 + j] = q_kn[(16 * kt + i) * N + 16 * nt + j];
  std::vector<uint8_t> permuted(tiled.size());
  for (size_t c = 0; c < tiled.size() / 1024; ++c)
    for (size_t p = 0; p < 1024; ++p) permuted[c * 1024 + p] = tiled[c * 1024 + interleaved[p]];
  std::vector<unsigned char> out(tiled.size() / 2, 0);
  for (size_t c = 0; c < permuted.size(); ++c) {
    const size_t word = c / 8, nibble = c % 8;
    out[4 * word + nibble / 2] |= static_cast<unsigned char>(permuted[c] << (4 * (nibble % 2)));
  }
  return out;
}

TEST(Int4Scalar, MarlinDecoderInvertsVllmsReference) {
  std::mt19937 rng(7);
  for (auto [K, N] : std::vector<std::pair<int64_t, int64_t>>{{16, 64}, {64, 128}, {128, 192}}) {
    std::vector<uint8_t> q_kn(static_cast<size_t>(K * N));
    for (uint8_t& x : q_kn) x = static_cast<uint8_t>(rng() & 0xF);
    const std::vector<unsigned char> words = VllmMarlinWeights(q_kn, K, N);
    std::vector<uint8_t> codes_nk(q_kn.size());
    DecodeMarlinWeight(words.data(), K, N, codes_nk.data());
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        ASSERT_EQ(codes_nk[n * K + k], q_kn[k * N + n]) << K << "x" << N << " " << k << "," << n;
  }
}

// FORMATS.md §5: scale_perm = [i + 8j for i in 0..7 for j in 0..7], scale_perm_single =
// [2i + j for i in 0..3 for j in (0,1,8,9,16,17,24,25)]; out = in.reshape(-1, 64 | 32)[:, perm].
TEST(Int4Scalar, ScaleUnpermutationInvertsTheSpecsPermutation) {
  std::vector<int> grouped, single;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) grouped.push_back(i + 8 * j);
  for (int i = 0; i < 4; ++i)
    for (int j : {0, 1, 8, 9, 16, 17, 24, 25}) single.push_back(2 * i + j);
  const int64_t rows = 3, n = 128;
  std::vector<uint16_t> in(rows * n);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint16_t>(i * 7919 + 3);
  for (bool g : {true, false}) {
    const std::vector<int>& perm = g ? grouped : single;
    std::vector<uint16_t> permuted(in.size()), back(in.size());
    for (size_t c = 0; c < in.size() / perm.size(); ++c)
      for (size_t p = 0; p < perm.size(); ++p) permuted[c * perm.size() + p] = in[c * perm.size() + perm[p]];
    UnpermuteMarlinScales(permuted.data(), rows, n, g, back.data());
    EXPECT_EQ(back, in) << (g ? "grouped" : "single");
  }
}

// AWQ.md §3.3: z[0, c] = c % 16 over 64 columns -> word 0 = 0x88880000 (columns 0,16,32,48,8,24,40,56).
TEST(Int4Scalar, MarlinZeroPointsWorkedExample) {
  std::vector<unsigned char> words(8 * 4, 0);
  words[2] = 0x88;
  words[3] = 0x88;
  std::vector<uint8_t> z(64, 0xFF);
  DecodeMarlinZeros(words.data(), 1, 64, z.data());
  for (int c : {0, 16, 32, 48}) EXPECT_EQ(z[c], 0) << c;
  for (int c : {8, 24, 40, 56}) EXPECT_EQ(z[c], 8) << c;
  for (uint8_t v : z) EXPECT_LE(v, 15);
}

// TRTLLM_INT4.md §1.1: "word 0 holds column 0, k' = 0..7 = source rows 0,1,8,9,16,17,24,25; from
// bit 0 upward its nibbles are u[0,0] u[8,0] u[16,0] u[24,0] u[1,0] u[9,0] u[17,0] u[25,0]"; §1
// step 4: nibbles 0..7 (q = i at k' = i) become 0xFDB9ECA8.
TEST(Int4Scalar, TrtllmWorkedExample) {
  std::vector<unsigned char> bytes(64 * 64 / 2, 0x88);
  bytes[0] = 0xA8;
  bytes[1] = 0xEC;
  bytes[2] = 0xB9;
  bytes[3] = 0xFD;
  std::vector<uint8_t> codes(64 * 64, 0xFF);
  DecodeTrtllmWeight(bytes.data(), 64, 64, false, codes.data());
  const int rows[8] = {0, 1, 8, 9, 16, 17, 24, 25};  // k' = 0..7
  for (int i = 0; i < 8; ++i) EXPECT_EQ(codes[static_cast<size_t>(rows[i])], 8 + i) << "u[" << rows[i] << ", 0]";
  EXPECT_EQ(codes[2], 8);
  for (uint8_t c : codes) EXPECT_LE(c, 15);
}

// TRTLLM_INT4.md §1 steps 1-4 as separate passes (the pipeline the closed form summarises); the
// decoder must invert it for both layouts.
std::vector<unsigned char> TrtllmPipeline(const std::vector<uint8_t>& u_kn, int64_t K, int64_t N, bool sm90_dense) {
  static constexpr int kPerm[32] = {0, 1, 8,  9,  16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
                                    4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31};
  static constexpr int kRegSrc[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  // 1: rows permuted within every 32; 2: transpose to [N, K] (word v of column n: k' = 8v..8v+7).
  std::vector<uint32_t> col_words(static_cast<size_t>(N * K / 8), 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t kp = 0; kp < K; ++kp) {
      const uint32_t u = u_kn[(32 * (kp / 32) + kPerm[kp % 32]) * N + n];
      col_words[n * (K / 8) + kp / 8] |= u << (4 * (kp % 8));  // u = q + 8: the step-4 bias applied here
    }
  // 3: column interleave (I = 4, VRPT = 8), not for a dense sm90 weight.
  std::vector<uint32_t> words(col_words.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < K / 8; ++v) {
      const int64_t w = sm90_dense ? n * (K / 8) + v : (n / 4) * (K / 8) * 4 + 4 * 8 * (v / 8) + 8 * (n % 4) + v % 8;
      words[w] = col_words[n * (K / 8) + v];
    }
  // 4: register interleave: destination nibble j takes source nibble REG_SRC[j].
  std::vector<unsigned char> out(words.size() * 4);
  for (size_t w = 0; w < words.size(); ++w) {
    uint32_t x = 0;
    for (int j = 0; j < 8; ++j) x |= ((words[w] >> (4 * kRegSrc[j])) & 0xFu) << (4 * j);
    for (int b = 0; b < 4; ++b) out[4 * w + b] = static_cast<unsigned char>(x >> (8 * b));
  }
  return out;
}

TEST(Int4Scalar, TrtllmDecoderInvertsTheFourSteps) {
  std::mt19937 rng(11);
  for (bool sm90 : {false, true})
    for (auto [K, N] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {128, 192}, {256, 128}}) {
      std::vector<uint8_t> u_kn(static_cast<size_t>(K * N));
      for (uint8_t& x : u_kn) x = static_cast<uint8_t>(rng() & 0xF);
      const std::vector<unsigned char> bytes = TrtllmPipeline(u_kn, K, N, sm90);
      std::vector<uint8_t> codes_nk(u_kn.size());
      DecodeTrtllmWeight(bytes.data(), K, N, sm90, codes_nk.data());
      for (int64_t k = 0; k < K; ++k)
        for (int64_t n = 0; n < N; ++n)
          ASSERT_EQ(codes_nk[n * K + k], u_kn[k * N + n]) << (sm90 ? "sm90 " : "sm80 ") << K << "x" << N;
    }
}

TEST(Int4Scalar, SymmetricTiesZerosHugeAndTiny) {
  // amax 1.75: scale = 1.75 / 7 = 0.25 exactly (qat); 0.625 / 0.25 = 2.5 -> 2, -2.5 -> -2,
  // 3.5 -> 4, 0.5 -> 0, -5.5 -> -6 (ties to even, FORMATS.md §1.3).
  const std::vector<float> w = {1.75f, 0.625f, -0.625f, 0.875f, 0.125f, -1.375f, 0.0f, -0.0f};
  std::vector<uint8_t> codes(8);
  uint16_t scale = 0;
  ASSERT_TRUE(QuantizeRowSymmetric(w, 8, SymmetricVariant::kQat, DType::kBF16, codes.data(), &scale).ok());
  EXPECT_EQ(codes, (std::vector<uint8_t>{15, 10, 6, 12, 8, 2, 8, 8}));
  EXPECT_EQ(scale, 0x3E80);  // bf16 0.25
  // All zero: the 1e-5 floor (bf16 0x3728), every code 8.
  const std::vector<float> zero(32, 0.0f);
  std::vector<uint8_t> zc(32);
  ASSERT_TRUE(QuantizeRowSymmetric(zero, 32, SymmetricVariant::kSlime, DType::kBF16, zc.data(), &scale).ok());
  EXPECT_EQ(scale, 0x3728);
  EXPECT_EQ(zc, std::vector<uint8_t>(32, 8));
  // Huge (bf16 near its max) and tiny (below the floor: codes 8) values; channelwise (one group).
  const std::vector<float> huge = {3.0e38f, -3.0e38f, 1.0e30f, 1e-30f};
  std::vector<uint8_t> hc(4);
  ASSERT_TRUE(QuantizeRowSymmetric(huge, -1, SymmetricVariant::kQat, DType::kBF16, hc.data(), &scale).ok());
  EXPECT_EQ(hc, (std::vector<uint8_t>{15, 1, 8, 8}));
  EXPECT_EQ(BF16ToF32(scale), BF16ToF32(F32ToBF16(3.0e38f / 7.0f)));
  const std::vector<float> tiny = {1e-30f, -3e-39f, 4e-6f, -6e-6f};
  ASSERT_TRUE(QuantizeRowSymmetric(tiny, 4, SymmetricVariant::kQat, DType::kF16, hc.data(), &scale).ok());
  EXPECT_EQ(hc, (std::vector<uint8_t>{8, 8, 8, 7}));  // 4e-6 / 1e-5 = 0.4 -> 0; -0.6 -> -1
  EXPECT_EQ(F16ToF32(scale), F16ToF32(F32ToF16(1e-5f)));
  // Non-finite weights are refused, naming the column.
  const std::vector<float> nan = {1.0f, NAN};
  EXPECT_THAT(QuantizeRowSymmetric(nan, 2, SymmetricVariant::kQat, DType::kBF16, hc.data(), &scale).message(),
              HasSubstr("column 1"));
}

TEST(Int4Scalar, AwqFp16ArithmeticByHand) {
  // min -1, max 2: range 3 -> s = fp16(3 · fl32(1/15)) = 0.199951171875 (fp16 0x3266);
  // z = -rint(fp16(-1 / s) = -5.0) = 5; u(2) = rint(fp16(10.0024)) + 5 = 15; u(-1) = 0; u(0) = 5;
  // u(0.30078125) = rint(fp16(1.5043) = 1.5039) + 5 = 7 (bf16 0.3 = 0.30078125).
  const std::vector<float> w = {-1.0f, 2.0f, 0.0f, BF16ToF32(F32ToBF16(0.3f)), -1.0f, 2.0f, 0.0f, 0.0f};
  std::vector<uint8_t> codes(8);
  uint16_t scale = 0;
  uint8_t zero = 0;
  ASSERT_TRUE(QuantizeRowAwq(w, 8, AwqArith::kFp16, DType::kF16, codes.data(), &scale, &zero).ok());
  EXPECT_EQ(scale, 0x3266);
  EXPECT_EQ(zero, 5);
  EXPECT_EQ(codes, (std::vector<uint8_t>{0, 15, 5, 7, 0, 15, 5, 5}));
  // All positive: z = 0 and the top clips at 15 only if needed; all negative: z = 15.
  const std::vector<float> pos = {0.25f, 0.5f, 0.75f, 1.0f}, neg = {-0.25f, -0.5f, -0.75f, -1.0f};
  ASSERT_TRUE(QuantizeRowAwq(pos, 4, AwqArith::kFp16, DType::kBF16, codes.data(), &scale, &zero).ok());
  EXPECT_EQ(zero, 0);
  ASSERT_TRUE(QuantizeRowAwq(neg, 4, AwqArith::kFp16, DType::kBF16, codes.data(), &scale, &zero).ok());
  EXPECT_EQ(zero, 15);
  // All zero: range floor fp16(1e-5) = 168 · 2^-24, s = fp16(168 · 2^-24 / 15) = 11 · 2^-24; u = z = 0.
  const std::vector<float> zeros(4, 0.0f);
  ASSERT_TRUE(QuantizeRowAwq(zeros, 4, AwqArith::kFp16, DType::kF16, codes.data(), &scale, &zero).ok());
  EXPECT_EQ(scale, 11);
  EXPECT_EQ(zero, 0);
  EXPECT_EQ(std::vector<uint8_t>(codes.begin(), codes.begin() + 4), (std::vector<uint8_t>{0, 0, 0, 0}));
  // Range beyond fp16 (40000 - (-40000)): refused under fp16, taken under fp32.
  const std::vector<float> wide = {40000.0f, -40000.0f};
  EXPECT_THAT(QuantizeRowAwq(wide, 2, AwqArith::kFp16, DType::kBF16, codes.data(), &scale, &zero).message(),
              HasSubstr("fp16"));
  EXPECT_TRUE(QuantizeRowAwq(wide, 2, AwqArith::kFp32, DType::kBF16, codes.data(), &scale, &zero).ok());
  EXPECT_EQ(codes[0], 15);
  EXPECT_EQ(codes[1], 0);
}

// fp8_scalar.h against torch: every block_slime / block_ue8m0 / channel_slime case of
// tests/data/golden/fp8_golden.safetensors (tools/golden/fp8_golden.py: torch's float32 ops and its
// own float8_e4m3fn cast), expert by expert, code for code and scale bit for bit.
TEST(Fp8Scalar, EqualsTorchOnTheGoldenCases) {
  auto file = SafetensorsFile::Open(std::string(WSYNC_GOLDEN_DIR) + "/fp8_golden.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  const std::string cases = file->metadata().at("cases");
  int checked = 0;
  for (size_t at = cases.find('"'); at != std::string::npos; at = cases.find('"', cases.find('"', at + 1) + 1)) {
    const std::string c = cases.substr(at + 1, cases.find('"', at + 1) - at - 1);
    const std::string base = c.substr(0, c.find('.')), variant = c.substr(c.find('.') + 1);
    if (variant != "block_slime" && variant != "block_ue8m0" && variant != "channel_slime") continue;
    SCOPED_TRACE(c);
    const SafetensorsEntry* w = file->Find(base + ".w");
    const SafetensorsEntry* q = file->Find(c + ".q");
    const SafetensorsEntry* sc = file->Find(c + ".s");
    ASSERT_TRUE(w != nullptr && q != nullptr && sc != nullptr);
    const int64_t E = w->view.dim(0), N = w->view.dim(1), K = w->view.dim(2);
    const int64_t per_scale = sc->view.numel() / E;
    for (int64_t e = 0; e < E; ++e) {
      std::string wbytes(static_cast<size_t>(N * K * 2), '\0');
      std::memcpy(wbytes.data(), w->view.bytes().data() + e * N * K * 2, wbytes.size());
      const TensorView we(w->view.dtype(), Shape{N, K}, std::as_bytes(std::span(wbytes)));
      std::vector<uint8_t> codes;
      std::vector<float> scales;
      const bool block = variant != "channel_slime";
      ASSERT_TRUE(
          QuantizeFp8Scalar(we, block ? 128 : 0, block ? 128 : 0, variant == "block_ue8m0", &codes, &scales).ok());
      ASSERT_EQ(codes.size(), static_cast<size_t>(N * K));
      EXPECT_EQ(0, std::memcmp(codes.data(), q->view.bytes().data() + e * N * K, codes.size())) << "expert " << e;
      ASSERT_EQ(scales.size(), static_cast<size_t>(per_scale));
      EXPECT_EQ(0, std::memcmp(scales.data(), sc->view.bytes().data() + e * per_scale * 4, scales.size() * 4))
          << "expert " << e;
      ++checked;
    }
  }
  EXPECT_GE(checked, 20);
}

TEST(Fp8Scalar, CodesByTheDefinition) {
  EXPECT_EQ(E4m3CodeOf(448.0f), 0x7E);
  EXPECT_EQ(E4m3CodeOf(463.9f), 0x7E);
  EXPECT_EQ(E4m3CodeOf(464.0f), 0x7F);  // beyond: NaN (torch's cast does not saturate)
  EXPECT_EQ(E4m3CodeOf(-1.0f), 0xB8);
  EXPECT_EQ(E4m3CodeOf(std::ldexp(1.0f, -9)), 0x01);   // the smallest subnormal
  EXPECT_EQ(E4m3CodeOf(std::ldexp(1.0f, -10)), 0x00);  // half of it: a tie, to even (zero)
  EXPECT_EQ(E4m3CodeOf(std::ldexp(3.0f, -10)), 0x02);  // 1.5 x 2^-9: to even (2)
  EXPECT_EQ(E4m3CodeOf(1.0625f), 0x38);                // between 1 and 1.125: to 1 (even)
  EXPECT_EQ(E4m3CodeOf(1.1875f), 0x3A);                // between 1.125 and 1.25: to 1.25 (even)
  EXPECT_EQ(E4m3CodeOf(-0.0f), 0x80);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) != 0x7F) {
      EXPECT_EQ(E4m3CodeOf(E4m3ValueOf(static_cast<uint8_t>(c))), c) << c;
    }
  }
}

}  // namespace
}  // namespace wsync::tools::reference
