// EngineModel against HfReferenceModel: random HF checkpoints (fixed seeds) for every architecture,
// loaded into SGLang engine-rank parameters by the rollout agent's Loader + Commit (ref_engine/testing/fixtures.h)
// for TP 1/2/4 and EP where valid, bf16 and Marlin INT4; T ranks run as threads with an in-process all-reduce.
//
// Tolerance: both models compute in float32 from the same bf16 (or bf16-dequantized INT4) weights;
// they differ only in summation order (TP partial sums, absorbed vs. naive MLA, cached vs.
// recomputed attention). Logits must agree to |engine - hf| <= 5e-5 * max(1, max|hf|); measured
// differences are <= 2.3e-6 relative. Greedy tokens must be equal; all TP ranks must return
// bit-identical logits and tokens. Mutation tests show the comparison fails on wrong layouts.
//
// Weights in place (WeightMode::kInPlace, the default) must compute exactly what the float32-copy
// design (kFloat32Copy) computes: every EngineVsHf case runs both and compares bit for bit. The
// version tests below prove that a failed Prepare writes none of the model's copies (outputs stay
// those of the previous version) and that later Prepares reuse the copy buffers.
#include "ref_engine/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/default_model.h"
#include "common/status.h"
#include "kernels/format/int4_format.h"
#include "ref_engine/hf_reference.h"
#include "ref_engine/ops.h"
#include "ref_engine/testing/fixtures.h"

namespace wsync::ref_engine {
namespace {

using testing::EngineParamsForRank;
using ::testing::HasSubstr;
using testing::InProcessGroup;
using testing::MustParseConfig;
using testing::RunRanks;
using testing::TensorMap;

constexpr double kRelTol = 5e-5;

// ---- configs ------------------------------------------------------------------------------------

std::string Quant(int group, const std::string& ignore) {
  const std::string strategy = group == -1 ? "channel" : "group";
  return absl::StrCat(R"(, "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": ")",
                      strategy, R"(", "group_size": )", group == -1 ? std::string("null") : absl::StrCat(group),
                      R"(, "symmetric": true, "actorder": null, "dynamic": false}}}, "ignore": [)", ignore, "]}");
}
// FP8 quantization_configs: DeepSeek-V3's block form with small blocks (the tiny models' partitions
// are 32 rows), and compressed-tensors per channel.
std::string Fp8Block(int bn, int bk) {
  return absl::StrCat(R"(, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [)",
                      bn, ", ", bk, "]}");
}
std::string Fp8Channel(const std::string& ignore) {
  return absl::StrCat(R"(, "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
    "strategy": "channel", "symmetric": true, "dynamic": false}}}, "ignore": [)",
                      ignore, "]}");
}
// An AWQ quantization_config (lm_head, embeddings and routers are never AWQ).
std::string AwqQuant(int group, const std::string& modules_to_not_convert = "") {
  return absl::StrCat(R"(, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": )", group,
                      R"(, "zero_point": true, "version": "gemm", "modules_to_not_convert": [)", modules_to_not_convert,
                      "]}");
}
// A compressed-tensors config for an engine that declares TensorRT-LLM's layout.
std::string TrtllmQuant(int group, const std::string& ignore, const std::string& layout = "trtllm-sm80") {
  std::string q = Quant(group, ignore);
  const std::string key = R"("quantization_config": {)";
  q.insert(q.find(key) + key.size(), absl::StrCat(R"("engine_layout": ")", layout, R"(", )"));
  return q;
}
const char kIgnoreDense[] = R"("lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$")";
const char kIgnoreDeepseek[] =
    R"("lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$", "re:.*q_a_proj$", "re:.*kv_a_proj_with_mqa$", "re:.*kv_b_proj$")";

std::string Llama(const std::string& extra = "") {
  return R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": true)" +
         extra + "}";
}
std::string Qwen2(const std::string& extra = "") {
  return R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "vocab_size": 500, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": false)" +
         extra + "}";
}
std::string Qwen3(const std::string& extra = "") {
  return R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": false)" +
         extra + "}";
}
std::string Qwen3Moe(const std::string& extra = "") {
  return R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": true, "vocab_size": 500,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": false)" +
         extra + "}";
}
// H == G == 64: SGLang's w13 scale permutation (size_k = 4I') picks the grouped perm although the
// scales have one row (ENGINE_LAYOUT.md §4 quirk).
std::string Qwen3MoeSmallH(const std::string& extra = "") {
  return R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 128, "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
    "norm_topk_prob": false, "vocab_size": 300, "max_position_embeddings": 64,
    "tie_word_embeddings": false)" +
         extra + "}";
}
std::string Deepseek(const std::string& extra = "") {
  return R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
    "moe_intermediate_size": 128, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": true,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "vocab_size": 1000, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": false)" +
         extra + "}";
}
// GLM-4.5's shape (Glm4MoeForCausalLM): q/k/v bias without an o_proj bias, QK norm, RoPE on the
// first half of each head (partial_rotary_factor 0.5), a dense first layer, DeepSeek-V3's sigmoid
// routing with the correction bias and one shared expert; head_dim * heads != hidden as in GLM-4.5.
std::string Glm45(const std::string& extra = "") {
  return R"({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": true,
    "routed_scaling_factor": 2.5, "attention_bias": true, "use_qk_norm": true, "partial_rotary_factor": 0.5,
    "vocab_size": 1000, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "tie_word_embeddings": false)" +
         extra + "}";
}
// DeepSeek-V2-style routing (softmax, group_limited_greedy, no renormalization) without q_lora.
std::string DeepseekNoQLora(const std::string& extra = "") {
  return R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
    "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 3,
    "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": false,
    "routed_scaling_factor": 1.5, "scoring_func": "softmax", "topk_method": "group_limited_greedy",
    "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
    "vocab_size": 500, "max_position_embeddings": 64, "tie_word_embeddings": false)" +
         extra + "}";
}

// ---- running ------------------------------------------------------------------------------------

std::vector<int32_t> PromptFor(const ModelConfig& c) {
  const int32_t V = static_cast<int32_t>(c.vocab_size);
  return {1, V - 1, V / 2, 17, (3 * V) / 4, 3, V - 64, 0};  // ids on every TP rank's vocab slice
}

struct RankOutcome {
  std::vector<float> logits;
  std::vector<int32_t> tokens;
};

// Slices `sent` for every rank and runs Logits + Generate on T threads.
std::vector<RankOutcome> RunEngine(const ModelConfig& c, EngineRank geometry, const TensorMap& sent,
                                   const std::vector<int32_t>& prompt, int new_tokens,
                                   EngineModelOptions options = {}) {
  const int T = geometry.tp_size;
  std::vector<TensorMap> params;
  for (int r = 0; r < T; ++r) {
    EngineRank er = geometry;
    er.tp_rank = r;
    absl::StatusOr<TensorMap> p = EngineParamsForRank(c, er, sent);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return {};
    params.push_back(*std::move(p));
  }
  InProcessGroup group(T);
  std::vector<RankOutcome> out(static_cast<size_t>(T));
  const std::vector<absl::Status> st = RunRanks(T, [&](int r) -> absl::Status {
    EngineRank er = geometry;
    er.tp_rank = r;
    ASSIGN_OR_RETURN(EngineModel m,
                     EngineModel::Create(c, er, params[static_cast<size_t>(r)].Lookup(), group.ForRank(r), options));
    RETURN_IF_ERROR(m.Prepare());
    ASSIGN_OR_RETURN(out[static_cast<size_t>(r)].logits, m.Logits(prompt));
    ASSIGN_OR_RETURN(out[static_cast<size_t>(r)].tokens, m.Generate(prompt, new_tokens));
    return absl::OkStatus();
  });
  for (int r = 0; r < T; ++r)
    EXPECT_TRUE(st[static_cast<size_t>(r)].ok()) << "rank " << r << ": " << st[static_cast<size_t>(r)];
  return out;
}

struct Diff {
  double max_abs = 0, max_ref = 0;
};
Diff Compare(const std::vector<float>& got, const std::vector<float>& want) {
  Diff d;
  for (size_t i = 0; i < want.size(); ++i) {
    d.max_abs = std::max(d.max_abs, static_cast<double>(std::fabs(got[i] - want[i])));
    d.max_ref = std::max(d.max_ref, static_cast<double>(std::fabs(want[i])));
  }
  return d;
}

struct Case {
  std::string name;
  std::string json;
  int tp = 1, ep = 1;
  bool fused = false;
  bool int4 = false;
  uint64_t seed = 1;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class EngineVsHfTest : public ::testing::TestWithParam<Case> {};

TEST_P(EngineVsHfTest, LogitsAndGreedyTokensMatchOracle) {
  const Case& k = GetParam();
  const ModelConfig c = MustParseConfig(k.json);
  const TensorMap hf = testing::RandomHfModel(c, k.seed);
  const TensorMap* sent_p = &hf;
  const TensorMap* oracle_p = &hf;
  absl::StatusOr<testing::QuantizedHf> q;
  if (k.int4) {
    q = testing::QuantizeHf(c, hf);
    ASSERT_TRUE(q.ok()) << q.status();
    size_t n_int4 = 0;
    for (const auto& [name, t] : q->sent.all())
      n_int4 +=
          absl::EndsWith(name, ".weight_packed") || absl::EndsWith(name, ".qweight") || t.dtype() == DType::kF8E4M3 ? 1
                                                                                                                    : 0;
    ASSERT_GT(n_int4, 0u) << "the INT4 case quantized nothing";
    sent_p = &q->sent;
    oracle_p = &q->dequantized;
  }
  absl::StatusOr<HfReferenceModel> ref = HfReferenceModel::Create(c, oracle_p->Lookup());
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<int32_t> prompt = PromptFor(c);
  constexpr int kNew = 6;
  absl::StatusOr<std::vector<float>> want = ref->Logits(prompt);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::vector<int32_t>> want_tokens = ref->Generate(prompt, kNew);
  ASSERT_TRUE(want_tokens.ok()) << want_tokens.status();

  EngineRank geometry;
  geometry.tp_size = k.tp;
  geometry.ep_size = k.ep;
  geometry.fused_shared_experts = k.fused;
  const std::vector<RankOutcome> got = RunEngine(c, geometry, *sent_p, prompt, kNew);
  ASSERT_EQ(got.size(), static_cast<size_t>(k.tp));
  ASSERT_EQ(got[0].logits.size(), want->size());
  const Diff d = Compare(got[0].logits, *want);
  EXPECT_LE(d.max_abs, kRelTol * std::max(1.0, d.max_ref)) << "max |logit| " << d.max_ref;
  RecordProperty("max_abs_logit_diff", absl::StrCat(d.max_abs));
  EXPECT_EQ(got[0].tokens, *want_tokens);
  RecordProperty("tokens", absl::StrJoin(got[0].tokens, " "));
  for (int r = 1; r < k.tp; ++r) {
    EXPECT_EQ(0, std::memcmp(got[static_cast<size_t>(r)].logits.data(), got[0].logits.data(),
                             got[0].logits.size() * sizeof(float)))
        << "rank " << r << " logits differ from rank 0";
    EXPECT_EQ(got[static_cast<size_t>(r)].tokens, got[0].tokens) << "rank " << r;
  }
  // The float32-copy design computes the same bits on every rank.
  EngineModelOptions copy;
  copy.weights = WeightMode::kFloat32Copy;
  const std::vector<RankOutcome> copied = RunEngine(c, geometry, *sent_p, prompt, kNew, copy);
  ASSERT_EQ(copied.size(), got.size());
  for (int r = 0; r < k.tp; ++r) {
    ASSERT_EQ(copied[static_cast<size_t>(r)].logits.size(), got[static_cast<size_t>(r)].logits.size());
    EXPECT_EQ(0, std::memcmp(copied[static_cast<size_t>(r)].logits.data(), got[static_cast<size_t>(r)].logits.data(),
                             got[0].logits.size() * sizeof(float)))
        << "rank " << r << ": in-place logits differ from the float32-copy design";
    EXPECT_EQ(copied[static_cast<size_t>(r)].tokens, got[static_cast<size_t>(r)].tokens) << "rank " << r;
  }
}

std::vector<Case> Cases() {
  std::vector<Case> v;
  auto add = [&](const std::string& name, const std::string& json, std::vector<std::pair<int, int>> geo,
                 bool int4 = false, bool fused = false) {
    for (auto [tp, ep] : geo)
      v.push_back({absl::StrCat(name, "_tp", tp, "_ep", ep), json, tp, ep, fused, int4,
                   static_cast<uint64_t>(1000 + v.size())});
  };
  add("llama_tied", Llama(), {{1, 1}, {2, 1}, {4, 1}});
  add("llama_attention_bias", Llama(R"(, "attention_bias": true, "tie_word_embeddings": false)"), {{2, 1}});
  // megatron's --add-bias-linear: every linear biased (gate_up's bias split, down_proj's added once)
  add("llama_linear_bias", Llama(R"(, "attention_bias": true, "mlp_bias": true, "tie_word_embeddings": false)"),
      {{1, 1}, {4, 1}});
  add("int4_llama_linear_bias", Llama(R"(, "attention_bias": true, "mlp_bias": true)" + Quant(32, kIgnoreDense)),
      {{2, 1}}, true);
  add("qwen2", Qwen2(), {{1, 1}, {2, 1}, {4, 1}});
  add("qwen3", Qwen3(), {{1, 1}, {2, 1}, {4, 1}});
  add("qwen3_moe", Qwen3Moe(), {{1, 1}, {2, 1}, {2, 2}, {4, 1}, {4, 2}, {4, 4}});
  add("deepseek_v3", Deepseek(), {{1, 1}, {2, 1}, {2, 2}, {4, 1}, {4, 4}});
  add("deepseek_v3_fused_shared", Deepseek(), {{1, 1}, {2, 1}}, false, true);
  add("deepseek_no_q_lora", DeepseekNoQLora(), {{1, 1}, {2, 2}, {4, 1}});
  add("glm4_moe", Glm45(), {{1, 1}, {2, 1}, {2, 2}, {4, 4}});
  add("glm4_moe_air", Glm45(R"(, "use_qk_norm": false, "partial_rotary_factor": 0.25)"), {{2, 2}});
  add("glm4_moe_fused_shared", Glm45(), {{2, 1}}, false, true);
  add("int4_glm4_moe", Glm45(Quant(32, kIgnoreDense)), {{1, 1}, {2, 2}}, true);
  add("fp8_glm4_moe", Glm45(Fp8Block(32, 32)), {{2, 2}}, true);
  add("int4_llama_tied", Llama(Quant(32, kIgnoreDense)), {{1, 1}, {2, 1}, {4, 1}}, true);
  add("int4_qwen2_g64", Qwen2(Quant(64, kIgnoreDense)), {{2, 1}}, true);
  add("int4_qwen3_channelwise", Qwen3(Quant(-1, kIgnoreDense)), {{1, 1}, {2, 1}}, true);
  add("int4_qwen3_moe", Qwen3Moe(Quant(32, kIgnoreDense)), {{1, 1}, {2, 1}, {4, 1}, {4, 2}, {4, 4}}, true);
  add("int4_qwen3_moe_channelwise", Qwen3Moe(Quant(-1, kIgnoreDense)), {{2, 1}}, true);
  add("int4_qwen3_moe_h_eq_g", Qwen3MoeSmallH(Quant(64, kIgnoreDense)), {{1, 1}, {2, 1}}, true);
  add("int4_deepseek_v3", Deepseek(Quant(32, kIgnoreDeepseek)), {{1, 1}, {2, 1}, {4, 1}, {4, 2}}, true);
  add("int4_default_model", kDefaultModelConfigJson, {{1, 1}, {2, 1}}, true);
  add("awq_llama_tied", Llama(AwqQuant(32)), {{1, 1}, {2, 1}, {4, 1}}, true);
  add("awq_qwen3_channelwise", Qwen3(AwqQuant(-1)), {{1, 1}, {2, 1}}, true);
  add("awq_qwen3_moe", Qwen3Moe(AwqQuant(32)), {{1, 1}, {2, 1}, {4, 2}, {4, 4}}, true);
  add("awq_qwen3_moe_h_eq_g", Qwen3MoeSmallH(AwqQuant(64)), {{1, 1}, {2, 1}}, true);
  add("awq_deepseek_v3", Deepseek(AwqQuant(32, R"("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")")), {{1, 1}, {4, 2}},
      true);
  add("fp8_llama_tied", Llama(Fp8Block(32, 32)), {{1, 1}, {2, 1}}, true);
  add("fp8_qwen3_moe", Qwen3Moe(Fp8Block(32, 64)), {{1, 1}, {2, 1}, {4, 4}}, true);  // TP 4 EP 1: I' 32 < bk
  add("fp8_deepseek_v3", Deepseek(Fp8Block(32, 32)), {{1, 1}, {2, 2}}, true);
  add("fp8_channel_qwen3", Qwen3(Fp8Channel(kIgnoreDense)), {{1, 1}, {2, 1}}, true);
  add("fp8_channel_qwen3_moe", Qwen3Moe(Fp8Channel(kIgnoreDense)), {{2, 2}}, true);
  add("trtllm_llama_tied_sm80", Llama(TrtllmQuant(64, kIgnoreDense)), {{1, 1}, {2, 1}}, true);
  add("trtllm_qwen3_sm90", Qwen3(TrtllmQuant(32, kIgnoreDense, "trtllm-sm90")), {{1, 1}, {2, 1}}, true);
  add("trtllm_qwen3_moe_sm80", Qwen3Moe(TrtllmQuant(32, kIgnoreDense)), {{1, 1}, {2, 2}}, true);
  add("trtllm_qwen3_moe_sm90", Qwen3Moe(TrtllmQuant(64, kIgnoreDense, "trtllm-sm90")), {{1, 1}, {2, 1}}, true);
  return v;
}

INSTANTIATE_TEST_SUITE_P(All, EngineVsHfTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// ---- exact weights ------------------------------------------------------------------------------

// Every prepared weight of an INT4 engine rank equals, bit for bit, the bf16 engine parameter that the
// loader makes of the dequantized HF checkpoint under a bf16 layout: Marlin unpacking, scale
// un-permutation (including the w13 quirk) and dequantization are exact.
TEST(EngineModelWeights, Int4PreparedWeightsEqualDequantizedSlices) {
  for (const std::string& json :
       {Qwen3Moe(Quant(32, kIgnoreDense)), Qwen3MoeSmallH(Quant(64, kIgnoreDense)),
        Deepseek(Quant(32, kIgnoreDeepseek)), Qwen3(Quant(-1, kIgnoreDense)), Qwen3Moe(AwqQuant(32)),
        Qwen3MoeSmallH(AwqQuant(64)), Qwen3(AwqQuant(-1)), Qwen3Moe(TrtllmQuant(32, kIgnoreDense)),
        Qwen3(TrtllmQuant(64, kIgnoreDense, "trtllm-sm90"))}) {
    const ModelConfig c = MustParseConfig(json);
    absl::StatusOr<testing::QuantizedHf> q = testing::QuantizeHf(c, testing::RandomHfModel(c, 77));
    ASSERT_TRUE(q.ok()) << q.status();
    for (auto [tp, ep] : std::vector<std::pair<int, int>>{{2, 1}, {2, 2}}) {
      if (ep > 1 && !c.moe) continue;  // EP needs an MoE model
      for (int r = 0; r < tp; ++r) {
        EngineRank er{{tp, r, ep}, false};
        ModelConfig bf16_config = c;
        bf16_config.quantization.reset();
        absl::StatusOr<TensorMap> int4 = EngineParamsForRank(c, er, q->sent);
        absl::StatusOr<TensorMap> bf16 = EngineParamsForRank(bf16_config, er, q->dequantized);
        ASSERT_TRUE(int4.ok()) << int4.status();
        ASSERT_TRUE(bf16.ok()) << bf16.status();
        InProcessGroup g(tp);
        absl::StatusOr<EngineModel> m = EngineModel::Create(c, er, int4->Lookup(), g.ForRank(r));
        ASSERT_TRUE(m.ok()) << m.status();
        ASSERT_TRUE(m->Prepare().ok());
        int checked = 0, quantized = 0;
        for (const auto& [name, t] : bf16->all()) {
          absl::StatusOr<PreparedWeight> w = m->Weight(name);
          ASSERT_TRUE(w.ok()) << w.status();
          ASSERT_EQ(w->shape, t.shape()) << name;
          std::vector<float> want(static_cast<size_t>(t.view().numel()));
          ASSERT_TRUE(ReadFloats(t.view(), want.data(), name).ok());
          ASSERT_EQ(0, std::memcmp(w->data.data(), want.data(), want.size() * sizeof(float))) << name;
          ++checked;
          const std::string base = absl::EndsWith(name, ".weight") ? name.substr(0, name.size() - 7) : name;
          const std::string awq_base = absl::EndsWith(name, "_weight") ? name.substr(0, name.size() - 7) : base;
          const bool trtllm =
              (int4->Has(name) && int4->At(name).dtype() == DType::kI8) ||
              (absl::EndsWith(name, "w13_weight") && int4->Has(name.substr(0, name.size() - 10) + "w3_w1_weight"));
          quantized += int4->Has(base + ".weight_packed") || int4->Has(name + "_packed") ||
                               int4->Has(base + ".qweight") || int4->Has(awq_base + "_qweight") || trtllm
                           ? 1
                           : 0;
        }
        EXPECT_GT(quantized, 0);
        EXPECT_GT(checked, quantized);
      }
    }
  }
}

// ---- sensitivity: wrong layouts must fail the comparison -------------------------------------------

double MaxDiffAfter(const std::string& json, int tp, const std::function<void(std::vector<TensorMap>&)>& mutate) {
  const ModelConfig c = MustParseConfig(json);
  const TensorMap hf = testing::RandomHfModel(c, 5);
  absl::StatusOr<HfReferenceModel> ref = HfReferenceModel::Create(c, hf.Lookup());
  EXPECT_TRUE(ref.ok());
  const std::vector<int32_t> prompt = PromptFor(c);
  const std::vector<float> want = *ref->Logits(prompt);
  std::vector<TensorMap> params;
  for (int r = 0; r < tp; ++r) params.push_back(*EngineParamsForRank(c, EngineRank{{tp, r, 1}, false}, hf));
  mutate(params);
  InProcessGroup g(tp);
  std::vector<std::vector<float>> got(static_cast<size_t>(tp));
  const auto st = RunRanks(tp, [&](int r) -> absl::Status {
    ASSIGN_OR_RETURN(EngineModel m, EngineModel::Create(c, EngineRank{{tp, r, 1}, false},
                                                        params[static_cast<size_t>(r)].Lookup(), g.ForRank(r)));
    RETURN_IF_ERROR(m.Prepare());
    ASSIGN_OR_RETURN(got[static_cast<size_t>(r)], m.Logits(prompt));
    return absl::OkStatus();
  });
  for (const auto& s : st) EXPECT_TRUE(s.ok()) << s;
  const Diff d = Compare(got[0], want);
  return d.max_abs / std::max(1.0, d.max_ref);
}

TEST(EngineModelSensitivity, UnmodifiedParamsPass) {
  EXPECT_LE(MaxDiffAfter(Qwen3(), 2, [](std::vector<TensorMap>&) {}), kRelTol);
}

TEST(EngineModelSensitivity, SwappedGateUpHalvesFail) {
  const double d = MaxDiffAfter(Qwen3(), 1, [](std::vector<TensorMap>& p) {
    Tensor& t = p[0].Mutable("model.layers.0.mlp.gate_up_proj.weight");
    const size_t half = t.nbytes() / 2;
    std::vector<std::byte> tmp(half);
    std::byte* b = t.mutable_view().bytes().data();
    std::memcpy(tmp.data(), b, half);
    std::memcpy(b, b + half, half);
    std::memcpy(b + half, tmp.data(), half);
  });
  EXPECT_GT(d, 100 * kRelTol);
}

TEST(EngineModelSensitivity, RanksWithSwappedShardsFail) {
  // Rank 0 computes heads 4..7 but applies the o_proj columns of heads 0..3 (and rank 1 vice versa).
  const double d = MaxDiffAfter(Qwen3(), 2, [](std::vector<TensorMap>& p) {
    const std::string n = "model.layers.0.self_attn.qkv_proj.weight";
    std::swap(p[0].Mutable(n), p[1].Mutable(n));
  });
  EXPECT_GT(d, 100 * kRelTol);
}

TEST(EngineModelSensitivity, WrongKvReplicaFails) {
  // T = 4 > nkv = 2 on Qwen2: give rank 1 the k/v rows of kv head 1 instead of head 0.
  const double d = MaxDiffAfter(Qwen2(), 4, [](std::vector<TensorMap>& p) {
    Tensor& q1 = p[1].Mutable("model.layers.1.self_attn.qkv_proj.weight");
    const Tensor& q2 = p[2].At("model.layers.1.self_attn.qkv_proj.weight");  // rank 2 holds kv head 1
    const size_t q_bytes = static_cast<size_t>(2 * 32 * 128 * 2);            // nh_loc * hd rows * H * bf16
    std::memcpy(q1.mutable_view().bytes().data() + q_bytes, q2.view().bytes().data() + q_bytes, q1.nbytes() - q_bytes);
  });
  EXPECT_GT(d, 100 * kRelTol);
}

// ---- versions and failures --------------------------------------------------------------------------

class EngineModelErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = MustParseConfig(Qwen3Moe());
    hf_ = testing::RandomHfModel(c_, 9);
    params_ = *EngineParamsForRank(c_, EngineRank{}, hf_);
  }
  absl::StatusOr<EngineModel> Make() { return EngineModel::Create(c_, EngineRank{}, params_.Lookup(), {}); }

  ModelConfig c_;
  TensorMap hf_, params_;
};

TEST_F(EngineModelErrors, BeforePrepare) {
  absl::StatusOr<EngineModel> m = Make();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->prepared());
  EXPECT_EQ(m->Logits({1, 2}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->Generate({1, 2}, 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->Weight("model.norm.weight").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(EngineModelErrors, MissingParameterNamed) {
  params_.Erase("model.layers.2.mlp.experts.w2_weight");
  absl::StatusOr<EngineModel> m = Make();
  ASSERT_TRUE(m.ok());
  const absl::Status s = m->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.2.mlp.experts.w2_weight"));
}

TEST_F(EngineModelErrors, MisshapedParameterNamed) {
  params_.Put("model.layers.0.self_attn.qkv_proj.weight", *Tensor::Zeros(DType::kBF16, {384, 64}));
  absl::StatusOr<EngineModel> m = Make();
  const absl::Status s = m->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.0.self_attn.qkv_proj.weight has shape [384, 64], want [384, 128]"));
}

TEST_F(EngineModelErrors, WrongDTypeNamed) {
  params_.Put("model.norm.weight", *Tensor::Zeros(DType::kI32, {128}));
  const absl::Status s = Make()->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.norm.weight has dtype I32"));
}

TEST_F(EngineModelErrors, BothBf16AndInt4Refused) {
  params_.Put("model.layers.0.self_attn.o_proj.weight_packed", *Tensor::Zeros(DType::kI32, {16, 256}));
  const absl::Status s = Make()->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("both model.layers.0.self_attn.o_proj.weight and"));
}

TEST_F(EngineModelErrors, Int4RouterOrEmbeddingRefused) {
  params_.Put("model.layers.0.mlp.gate.weight_packed", *Tensor::Zeros(DType::kI32, {8, 16}));
  const absl::Status s = Make()->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("keeps model.layers.0.mlp.gate.weight in bf16"));
}

TEST_F(EngineModelErrors, MixedMoeQuantizationRefused) {
  params_.Put("model.layers.0.mlp.experts.w13_weight_packed", *Tensor::Zeros(DType::kI32, {8, 8, 512}));
  const absl::Status s = Make()->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("one FusedMoE has one quantization method"));
}

// FP8 weights are served in place and must be finite: a NaN code (0x7F) or an infinite block scale
// fails Prepare naming the parameter (DataLoss); the clean set prepares.
TEST(EngineModelFp8Errors, NanCodesAndInfiniteScalesAreRefusedByName) {
  const ModelConfig c = MustParseConfig(Qwen3Moe(Fp8Block(32, 64)));
  absl::StatusOr<testing::QuantizedHf> q = testing::QuantizeHf(c, testing::RandomHfModel(c, 5));
  ASSERT_TRUE(q.ok()) << q.status();
  auto prepare = [&](const std::function<void(TensorMap&)>& mutate) {
    TensorMap p = *EngineParamsForRank(c, EngineRank{}, q->sent);
    mutate(p);
    absl::StatusOr<EngineModel> m = EngineModel::Create(c, EngineRank{}, p.Lookup(), {});
    EXPECT_TRUE(m.ok()) << m.status();
    return m->Prepare();
  };
  EXPECT_TRUE(prepare([](TensorMap&) {}).ok());
  absl::Status s = prepare([](TensorMap& p) {
    p.Mutable("model.layers.2.mlp.experts.w2_weight").data_as<uint8_t>()[12345] = 0xFF;  // -NaN
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("model.layers.2.mlp.experts.w2_weight"));
  EXPECT_THAT(s.message(), HasSubstr("element 12345"));
  s = prepare([](TensorMap& p) {
    p.Mutable("model.layers.0.self_attn.o_proj.weight_scale_inv").data_as<float>()[1] =
        std::numeric_limits<float>::infinity();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("model.layers.0.self_attn.o_proj.weight"));
}

TEST(EngineModelInt4Errors, BadScalesAndKvBRefused) {
  const ModelConfig c = MustParseConfig(Deepseek(Quant(32, kIgnoreDeepseek)));
  absl::StatusOr<testing::QuantizedHf> q = testing::QuantizeHf(c, testing::RandomHfModel(c, 3));
  ASSERT_TRUE(q.ok());
  auto prepare = [&](const std::function<void(TensorMap&)>& mutate) {
    TensorMap p = *EngineParamsForRank(c, EngineRank{}, q->sent);
    mutate(p);
    absl::StatusOr<EngineModel> m = EngineModel::Create(c, EngineRank{}, p.Lookup(), {});
    EXPECT_TRUE(m.ok());
    return m->Prepare();
  };
  EXPECT_TRUE(prepare([](TensorMap&) {}).ok());
  // kv_b_proj must stay bf16 (SGLang's post_load_weights has no compressed-tensors path).
  absl::Status s = prepare([](TensorMap& p) {
    p.Put("model.layers.0.self_attn.kv_b_proj.weight_packed", *Tensor::Zeros(DType::kI32, {4, 512}));
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("cannot load model.layers.0.self_attn.kv_b_proj as INT4"));
  // Scales with the wrong number of groups.
  s = prepare([](TensorMap& p) {
    p.Put("model.layers.0.self_attn.o_proj.weight_scale", *Tensor::Zeros(DType::kBF16, {2, 128}));
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("o_proj.weight_scale has 2 scale rows for K = 128 and group size 32"));
  // Missing scales of a quantized expert tensor.
  s = prepare([](TensorMap& p) { p.Erase("model.layers.1.mlp.experts.w2_weight_scale"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.1.mlp.experts.w2_weight_scale"));
  // Marlin buffer of the wrong shape.
  s = prepare([](TensorMap& p) {
    p.Put("model.layers.2.mlp.experts.w13_weight_packed", *Tensor::Zeros(DType::kI32, {8, 16, 256}));
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("w13_weight_packed has shape [8, 16, 256], want [8, 8, 512]"));
}

TEST_F(EngineModelErrors, FailedPrepareKeepsPreviousVersionAndNewVersionIsPickedUp) {
  absl::StatusOr<EngineModel> m = Make();
  ASSERT_TRUE(m->Prepare().ok());
  const std::vector<int32_t> prompt = {5, 6, 7};
  const std::vector<float> v1 = *m->Logits(prompt);
  // A broken update: the lookup now misses a tensor; the old cache keeps serving.
  Tensor saved = std::move(params_.Mutable("lm_head.weight"));
  params_.Erase("lm_head.weight");
  EXPECT_EQ(m->Prepare().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(m->prepared());
  EXPECT_EQ(*m->Logits(prompt), v1);
  // A good update with different weights is picked up.
  for (int64_t i = 0; i < saved.view().numel(); ++i)
    saved.data_as<uint16_t>()[i] = F32ToBF16(-BF16ToF32(saved.data_as<uint16_t>()[i]));
  params_.Put("lm_head.weight", std::move(saved));
  ASSERT_TRUE(m->Prepare().ok());
  const std::vector<float> v2 = *m->Logits(prompt);
  ASSERT_EQ(v2.size(), v1.size());
  for (size_t i = 0; i < v1.size(); ++i) ASSERT_EQ(v2[i], -v1[i]) << i;
}

// ---- weights in place: copies, reuse, failed versions ----------------------------------------------

// One version of an INT4 Qwen3-MoE rank's parameters, served through a lookup that returns some of
// them in forms the engine must copy: lm_head as f16, embed_tokens and one layer's Marlin w13
// (words and scales) at misaligned addresses. 1-D params (norms) are always copied.
struct Version {
  TensorMap params;
  std::map<std::string, std::vector<std::byte>> misaligned;  // data at offset 1

  void Misalign(const std::string& name) {
    const Tensor& t = params.At(name);
    std::vector<std::byte>& b = misaligned[name];
    b.assign(t.nbytes() + 1, std::byte{0});
    std::memcpy(b.data() + 1, t.view().bytes().data(), t.nbytes());
  }
  TensorView View(const std::string& name) const {
    const Tensor& t = params.At(name);
    auto it = misaligned.find(name);
    if (it == misaligned.end()) return t.view();
    return TensorView(t.dtype(), t.shape(), std::span<const std::byte>(it->second.data() + 1, t.nbytes()));
  }
  // Writes bits into a param (and its misaligned copy).
  void SetU16(const std::string& name, int64_t i, uint16_t bits) {
    params.Mutable(name).data_as<uint16_t>()[i] = bits;
    if (misaligned.count(name)) std::memcpy(misaligned[name].data() + 1 + 2 * i, &bits, 2);
  }
  void SetU32(const std::string& name, int64_t i, uint32_t bits) {
    params.Mutable(name).data_as<uint32_t>()[i] = bits;
    if (misaligned.count(name)) std::memcpy(misaligned[name].data() + 1 + 4 * i, &bits, 4);
  }
};

class InPlaceVersions : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = MustParseConfig(Qwen3Moe(Quant(32, kIgnoreDense)));
    for (uint64_t seed : {41, 42}) {
      absl::StatusOr<testing::QuantizedHf> q = testing::QuantizeHf(c_, testing::RandomHfModel(c_, seed));
      ASSERT_TRUE(q.ok()) << q.status();
      auto v = std::make_unique<Version>();
      v->params = *EngineParamsForRank(c_, EngineRank{}, q->sent);
      Tensor& head = v->params.Mutable("lm_head.weight");
      Tensor f16 = *Tensor::Empty(DType::kF16, head.shape());
      for (int64_t i = 0; i < head.view().numel(); ++i)
        f16.data_as<uint16_t>()[i] = F32ToF16(BF16ToF32(head.data_as<uint16_t>()[i]));
      head = std::move(f16);
      for (const char* name : {"model.embed_tokens.weight", "model.layers.2.mlp.experts.w13_weight_packed",
                               "model.layers.2.mlp.experts.w13_weight_scale"})
        v->Misalign(name);
      versions_.push_back(std::move(v));
    }
  }

  // The lookup follows current_.
  ParamLookup Lookup() {
    return [this](absl::string_view name) -> absl::StatusOr<TensorView> {
      if (!current_->params.Has(std::string(name))) return absl::NotFoundError(absl::StrCat("no ", name));
      return current_->View(std::string(name));
    };
  }

  // Logits of `v` from a fresh float32-copy model (the reference).
  std::vector<float> Reference(const Version& v) {
    current_ = &v;
    EngineModelOptions o;
    o.weights = WeightMode::kFloat32Copy;
    absl::StatusOr<EngineModel> m = EngineModel::Create(c_, EngineRank{}, Lookup(), {}, o);
    EXPECT_TRUE(m.ok());
    EXPECT_TRUE(m->Prepare().ok());
    return *m->Logits(prompt_);
  }

  static void ExpectBits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << what;
  }

  ModelConfig c_;
  std::vector<std::unique_ptr<Version>> versions_;
  const Version* current_ = nullptr;
  const std::vector<int32_t> prompt_ = {5, 6, 7, 499, 0};
};

TEST_F(InPlaceVersions, AFailedPrepareWritesNoCopyAndLaterPreparesReuseTheBuffers) {
  const std::vector<float> ref1 = Reference(*versions_[0]), ref2 = Reference(*versions_[1]);
  ASSERT_NE(ref1, ref2);
  EngineModelOptions o;
  o.prepare_threads = 3;
  absl::StatusOr<EngineModel> m = EngineModel::Create(c_, EngineRank{}, Lookup(), {}, o);
  ASSERT_TRUE(m.ok());
  current_ = versions_[0].get();
  ASSERT_TRUE(m->Prepare().ok());
  ExpectBits(*m->Logits(prompt_), ref1, "version 1");
  const PrepareStats first = m->last_prepare();
  EXPECT_GT(first.bytes_in_place, 0);
  EXPECT_GT(first.bytes_copied, 0);
  EXPECT_EQ(first.bytes_allocated, first.bytes_copied);  // nothing to reuse yet
  EXPECT_EQ(first.threads, 3);

  // Version 2 with a NaN late in load order (the last layer's norm, a copied 1-D param), and
  // then with a NaN scale (in place): every copy (embed, lm_head, norms, the misaligned w13)
  // would be overwritten by version 2's values, but checks run first, so version 1 still serves.
  Version& v2 = *versions_[1];
  const std::string norm = "model.layers.2.post_attention_layernorm.weight";
  const uint16_t saved_norm = v2.params.At(norm).view().data_as<uint16_t>()[7];
  v2.SetU16(norm, 7, F32ToBF16(std::nanf("")));
  current_ = &v2;
  absl::Status s = m->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(norm + " holds a non-finite value (nan) at element 7"));
  EXPECT_TRUE(m->prepared());
  current_ = versions_[0].get();  // version 1's memory is untouched: the model serves it exactly
  ExpectBits(*m->Logits(prompt_), ref1, "version 1 after a failed prepare (NaN norm)");
  v2.SetU16(norm, 7, saved_norm);
  const std::string scale = "model.layers.0.mlp.experts.w2_weight_scale";
  const uint16_t saved_scale = v2.params.At(scale).view().data_as<uint16_t>()[100];
  v2.SetU16(scale, 100, 0x7f80);  // +Inf
  current_ = &v2;
  s = m->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.0.mlp.experts.w2_weight holds a non-finite value"));
  ExpectBits(*m->Logits(prompt_), ref1, "version 1 after a failed prepare (Inf scale)");
  v2.SetU16(scale, 100, saved_scale);

  // Good versions: every buffer is reused (same sizes), the outputs are exactly each version's.
  ASSERT_TRUE(m->Prepare().ok());
  ExpectBits(*m->Logits(prompt_), ref2, "version 2");
  EXPECT_EQ(m->last_prepare().bytes_allocated, 0);
  EXPECT_EQ(m->last_prepare().bytes_copied, first.bytes_copied);
  current_ = versions_[0].get();
  ASSERT_TRUE(m->Prepare().ok());
  ExpectBits(*m->Logits(prompt_), ref1, "version 1 again");
  EXPECT_EQ(m->last_prepare().bytes_allocated, 0);
  // A weight that stops needing a copy (lm_head back in bf16) frees its buffer; one that starts
  // needing one gets a new buffer.
  const Tensor head16 = std::move(versions_[0]->params.Mutable("lm_head.weight"));
  Tensor head = *Tensor::Empty(DType::kBF16, head16.shape());
  for (int64_t i = 0; i < head.view().numel(); ++i)
    head.data_as<uint16_t>()[i] = F32ToBF16(F16ToF32(head16.view().data_as<uint16_t>()[i]));
  versions_[0]->params.Put("lm_head.weight", std::move(head));
  const std::vector<float> ref1b = Reference(*versions_[0]);
  ASSERT_TRUE(m->Prepare().ok());
  ExpectBits(*m->Logits(prompt_), ref1b, "version 1 with a bf16 lm_head");
  EXPECT_EQ(m->last_prepare().bytes_allocated, 0);
  EXPECT_EQ(m->last_prepare().bytes_copied, first.bytes_copied - head16.view().numel() * 4);
}

TEST_F(InPlaceVersions, TheFirstBadParamInLoadOrderIsReportedWhateverTheThreadCount) {
  Version& v = *versions_[0];
  v.SetU16("model.layers.2.input_layernorm.weight", 3, 0xff80);            // -Inf, late
  v.SetU16("model.embed_tokens.weight", 40000, F32ToBF16(std::nanf("")));  // NaN, first param
  current_ = &v;
  for (int threads : {1, 2, 7}) {
    EngineModelOptions o;
    o.prepare_threads = threads;
    absl::StatusOr<EngineModel> m = EngineModel::Create(c_, EngineRank{}, Lookup(), {}, o);
    const absl::Status s = m->Prepare();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(s.message(), HasSubstr("model.embed_tokens.weight holds a non-finite value (nan) at element 40000"))
        << threads;
    EXPECT_FALSE(m->prepared());
  }
}

// Marlin values are non-finite iff a scale is, or bf16((u - 8) s) overflows: a scale of 2^125
// serves u = 15 (7 s < 2^128) but not u = 0 (-8 s rounds to -Inf), decided by decoding the tensor.
TEST_F(InPlaceVersions, HugeScalesAreJudgedByTheNibblesTheyScale) {
  Version& v = *versions_[0];
  const std::string packed = "model.layers.0.mlp.experts.w2_weight_packed",
                    scales = "model.layers.0.mlp.experts.w2_weight_scale";
  const Tensor& p = v.params.At(packed);
  for (int64_t i = 0; i < p.view().numel(); ++i) v.SetU32(packed, i, 0xffffffffu);               // u = 15 everywhere
  for (int64_t i = 0; i < v.params.At(scales).view().numel(); ++i) v.SetU16(scales, i, 0x7e00);  // 2^125
  current_ = &v;
  absl::StatusOr<EngineModel> m = EngineModel::Create(c_, EngineRank{}, Lookup(), {});
  ASSERT_TRUE(m->Prepare().ok());
  absl::StatusOr<PreparedWeight> w = m->Weight("model.layers.0.mlp.experts.w2_weight");
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->data[0], 7.0f * std::ldexp(1.0f, 125));
  // One nibble of expert 3 becomes u = 0: word 37 of tile (kt 1, nt 0), slot 5.
  const int64_t H = 128, I = 128;  // w2: [8, H, I'], Marlin [8, I'/16, 2H]
  const int64_t word = 3 * (I / 16) * 2 * H + kernels::format::TileOffset(1, 0, H) + 37;
  v.SetU32(packed, word, 0xffffffffu & ~(0xfu << 20));
  const int64_t k = 16 + kernels::format::WordRow(37) + kernels::format::SlotDk(5);
  const int64_t n = kernels::format::WordCol(37) + kernels::format::SlotDn(5);
  const absl::Status s = m->Prepare();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("model.layers.0.mlp.experts.w2_weight holds a non-finite value (-inf) at element ",
                                     (3 * H + n) * I + k)));
}

TEST_F(EngineModelErrors, BadRequests) {
  absl::StatusOr<EngineModel> m = Make();
  ASSERT_TRUE(m->Prepare().ok());
  EXPECT_EQ(m->Logits({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m->Logits({1, 500}).status().message(), HasSubstr("token 500 at position 1 is outside [0, 500)"));
  EXPECT_EQ(m->Logits({-1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Generate({1}, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m->Generate({1, 2}, 63).status().message(), HasSubstr("exceeds max_position_embeddings 64"));
  absl::StatusOr<std::vector<int32_t>> none = m->Generate({1, 2}, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_TRUE(m->Generate({1, 2}, 62).ok());
  EXPECT_EQ(m->Weight("model.layers.0.mlp.experts.w13_weight")->shape, (Shape{8, 256, 128}));
  EXPECT_EQ(m->Weight("no.such.weight").status().code(), absl::StatusCode::kNotFound);
}

TEST(EngineModelCreate, RefusesUnsupportedGeometry) {
  auto create = [](const std::string& json, EngineRank r) {
    return EngineModel::Create(MustParseConfig(json), r, TensorMap().Lookup(), {}).status();
  };
  // pad(1000, 64) = 1024 is not divisible by 3 (ENGINE_LAYOUT.md §2.6); nor are 8 heads.
  absl::Status s = create(Llama(), {{3, 0, 1}, false});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tp_size 3 needs both all_reduce_sum and all_gather"));
  InProcessGroup g3(3);
  s = EngineModel::Create(MustParseConfig(Llama()), {{3, 0, 1}, false}, TensorMap().Lookup(), g3.ForRank(0)).status();
  EXPECT_THAT(s.message(), HasSubstr("padded vocab pad(1000, 64) = 1024 is not divisible by tp_size 3"));
  // 12 heads, 4 kv heads, T = 6 > 4 but not a multiple of it (vocab 1152 divides).
  const std::string heads12 =
      absl::StrReplaceAll(Qwen3(), {{"\"num_attention_heads\": 8", "\"num_attention_heads\": 12"},
                                    {"\"vocab_size\": 1000", "\"vocab_size\": 1152"}});
  InProcessGroup g6(6);
  s = EngineModel::Create(MustParseConfig(heads12), {{6, 0, 1}, false}, TensorMap().Lookup(), g6.ForRank(0)).status();
  EXPECT_THAT(s.message(), HasSubstr("tp_size 6 is not a multiple of num_key_value_heads 4"));
  InProcessGroup g16(16);
  s = EngineModel::Create(MustParseConfig(Qwen3()), {{16, 0, 1}, false}, TensorMap().Lookup(), g16.ForRank(0)).status();
  EXPECT_THAT(s.message(), HasSubstr("num_attention_heads 8 is not divisible by tp_size 16"));
  EXPECT_THAT(create(Qwen3Moe(), {{1, 0, 2}, false}).message(), HasSubstr("ep_size 2 does not divide tp_size 1"));
  InProcessGroup g2(2);
  s = EngineModel::Create(MustParseConfig(Qwen3()), {{2, 0, 2}, false}, TensorMap().Lookup(), g2.ForRank(0)).status();
  EXPECT_THAT(s.message(), HasSubstr("ep_size 2 > 1 needs an MoE model"));
  EXPECT_THAT(create(Qwen3Moe(), {{1, 1, 1}, false}).message(), HasSubstr("tp_rank 1 is not in [0, tp_size 1)"));
  EXPECT_THAT(create(Qwen3Moe(R"(, "tie_word_embeddings": true)"), {}).message(),
              HasSubstr("qwen3_moe with tie_word_embeddings: SGLang always builds its own lm_head"));
  EXPECT_THAT(create(Deepseek(R"(, "tie_word_embeddings": true)"), {}).message(),
              HasSubstr("deepseek_v3 with tie_word_embeddings"));
  EXPECT_THAT(create(Qwen3Moe(), {{1, 0, 1}, true}).message(), HasSubstr("fused_shared_experts needs DeepSeek-V3"));
  EXPECT_THAT(create(DeepseekNoQLora(), {{1, 0, 1}, true}).message(), HasSubstr("n_shared_experts == 1"));
  const std::string no_norm =
      absl::StrReplaceAll(Deepseek(), {{"\"norm_topk_prob\": true", "\"norm_topk_prob\": false"}});
  EXPECT_EQ(create(no_norm, {{1, 0, 1}, true}).code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(create(no_norm, {{1, 0, 1}, false}).ok());
  InProcessGroup g4(4);
  const std::string bad_i =
      absl::StrReplaceAll(Qwen3Moe(), {{"\"moe_intermediate_size\": 128", "\"moe_intermediate_size\": 130"}});
  s = EngineModel::Create(MustParseConfig(bad_i), {{4, 0, 1}, false}, TensorMap().Lookup(), g4.ForRank(0)).status();
  EXPECT_THAT(s.message(), HasSubstr("moe_intermediate_size 130 is not divisible by moe_tp_size 4"));
  EXPECT_TRUE(create(Qwen3Moe(), {}).ok());
}

}  // namespace
}  // namespace wsync::ref_engine
