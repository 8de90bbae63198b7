#include "common/config.h"

#include <gtest/gtest.h>

#include <array>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace wsync {
namespace {

// Trimmed copies of public config.json files (fields as published).
constexpr const char* kQwen3Moe30B = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
  "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true, "vocab_size": 151936,
  "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "attention_bias": false})";

constexpr const char* kDeepseekV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
  "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
  "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
  "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
  "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": true,
  "scoring_func": "sigmoid", "vocab_size": 129280, "rms_norm_eps": 1e-06, "rope_theta": 10000,
  "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}})";

constexpr const char* kLlama8B = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
  "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "attention_bias": false, "max_position_embeddings": 131072})";

constexpr const char* kQwen25_05B = R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
  "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0})";

constexpr const char* kQwen3_06B = R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 151936, "tie_word_embeddings": true, "torch_dtype": "bfloat16"})";

constexpr const char* kInt4Quant = R"({
  "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
    "strategy": "group", "group_size": 128, "symmetric": true, "actorder": null, "dynamic": false,
    "observer": "minmax"}}},
  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "model.layers.0."]})";

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  const size_t p = s.find(from);
  EXPECT_NE(p, std::string::npos) << from;
  if (p != std::string::npos) s.replace(p, from.size(), to);
  return s;
}

TEST(ConfigTest, Qwen3Moe) {
  auto c = ParseModelConfig(kQwen3Moe30B, "qwen3moe/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kQwen3Moe);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  ASSERT_TRUE(c->moe.has_value());
  EXPECT_EQ(c->moe->num_experts, 128);
  EXPECT_EQ(c->moe->moe_intermediate_size, 768);
  EXPECT_TRUE(c->IsMoeLayer(0));
  EXPECT_TRUE(c->IsMoeLayer(47));
  EXPECT_FALSE(c->IsMoeLayer(48));
  EXPECT_FALSE(c->quantization.has_value());
  auto sparse =
      ParseModelConfig(Replace(Replace(kQwen3Moe30B, R"("decoder_sparse_step": 1)", R"("decoder_sparse_step": 2)"),
                               R"("mlp_only_layers": [])", R"("mlp_only_layers": [3])"),
                       "x");
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  EXPECT_FALSE(sparse->IsMoeLayer(0));
  EXPECT_TRUE(sparse->IsMoeLayer(1));
  EXPECT_FALSE(sparse->IsMoeLayer(3));
}

// DeepSeek-V3's own block FP8 config (docs/spec/FP8.md §4): parsed, FP8-supported, refused by
// every INT4 consumer naming FP8; the engines' never-quantized modules are ignored.
TEST(ConfigTest, DeepseekV3Fp8QuantizationConfig) {
  auto c = ParseModelConfig(kDeepseekV3, "dsv3/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->quantization.has_value());
  const QuantizationConfig& q = *c->quantization;
  EXPECT_TRUE(q.is_fp8() && q.is_fp8_block() && !q.is_fp8_channel() && !q.is_awq());
  EXPECT_EQ(q.block_n, 128);
  EXPECT_EQ(q.block_k, 128);
  EXPECT_EQ(q.format, "e4m3");
  EXPECT_EQ(q.num_bits, 8);
  EXPECT_EQ(q.engine_layout, "fp8");
  EXPECT_TRUE(q.CheckFp8Supported().ok()) << q.CheckFp8Supported();
  EXPECT_TRUE(q.CheckSupported().ok());
  const absl::Status int4 = q.CheckInt4Supported();
  EXPECT_EQ(int4.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(int4.message().find("FP8 (fp8 e4m3 block 128x128"), std::string_view::npos) << int4;
  EXPECT_TRUE(q.IsIgnored("lm_head.weight"));
  EXPECT_TRUE(q.IsIgnored("model.embed_tokens.weight"));
  EXPECT_TRUE(q.IsIgnored("model.layers.3.mlp.gate.weight"));
  EXPECT_FALSE(q.IsIgnored("model.layers.3.mlp.experts.7.gate_proj.weight"));
  EXPECT_FALSE(q.IsIgnored("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"));
}

TEST(ConfigTest, Fp8BlockQuantizationConfigs) {
  // Qwen3-4B-Thinking-2507-FP8's config, and ignored_layers (vLLM's key) beside it.
  auto qwen = ParseQuantizationConfig(
      R"({"activation_scheme": "dynamic", "modules_to_not_convert": ["model.layers.0.mlp"], "fmt": "e4m3",
          "quant_method": "fp8", "weight_block_size": [128, 64], "ignored_layers": ["model.layers.1.self_attn.o_proj"],
          "scale_fmt": "ue8m0"})",
      "qwen.json");
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_TRUE(qwen->CheckFp8Supported().ok()) << qwen->CheckFp8Supported();
  EXPECT_EQ(qwen->block_n, 128);
  EXPECT_EQ(qwen->block_k, 64);
  EXPECT_EQ(qwen->scale_fmt, "ue8m0");
  EXPECT_TRUE(qwen->IsIgnored("model.layers.0.mlp.down_proj.weight"));
  EXPECT_TRUE(qwen->IsIgnored("model.layers.1.self_attn.o_proj.weight"));
  EXPECT_FALSE(qwen->IsIgnored("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_EQ(qwen->Describe(), "fp8 e4m3 block 128x64 scale_fmt ue8m0, 5 ignore rules");
  auto re = ParseQuantizationConfig(
      R"({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["re:.*self_attn.*"]})",
      "re.json");
  ASSERT_TRUE(re.ok()) << re.status();
  EXPECT_TRUE(re->IsIgnored("model.layers.3.self_attn.q_proj.weight"));
  EXPECT_FALSE(re->IsIgnored("model.layers.3.mlp.down_proj.weight"));
  // Settings that decide the bytes make different configs; the block size and the scale format do.
  const std::string base =
      R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})";
  auto a = ParseQuantizationConfig(base, "a");
  auto b = ParseQuantizationConfig(Replace(base, "[128, 128]", "[64, 128]"), "b");
  auto u = ParseQuantizationConfig(Replace(base, R"("fmt")", R"("scale_fmt": "ue8m0", "fmt")"), "u");
  ASSERT_TRUE(a.ok() && b.ok() && u.ok());
  EXPECT_NE(a->Canonical(), b->Canonical());
  EXPECT_NE(a->Canonical(), u->Canonical());

  struct Case {
    std::string from, to;
    absl::StatusCode parse_code;
    const char* mention;
  };
  const Case cases[] = {
      {"[128, 128]", "[128]", absl::StatusCode::kInvalidArgument, "two sizes"},
      {"[128, 128]", "[0, 128]", absl::StatusCode::kInvalidArgument, "weight_block_size"},
      {"[128, 128]", "[128, 8192]", absl::StatusCode::kInvalidArgument, "1..4096"},
      {"[128, 128]", R"(["128", 128])", absl::StatusCode::kInvalidArgument, "weight_block_size"},
      {R"("activation_scheme")", R"("modules_to_not_convert": [""], "activation_scheme")",
       absl::StatusCode::kInvalidArgument, "empty entry"},
      {R"("activation_scheme")", R"("ignored_layers": ["re:(unclosed"], "activation_scheme")",
       absl::StatusCode::kInvalidArgument, "(unclosed"},
      {R"(, "weight_block_size": [128, 128])", "", absl::StatusCode::kOk, "per-tensor FP8"},
      {R"("e4m3")", R"("e5m2")", absl::StatusCode::kOk, "fmt \"e5m2\""},
      {R"("fmt")", R"("scale_fmt": "e8m0x", "fmt")", absl::StatusCode::kOk, "scale_fmt \"e8m0x\""},
      {R"("fmt")", R"("engine_layout": "marlin", "fmt")", absl::StatusCode::kOk, "engine_layout \"marlin\""},
  };
  for (const auto& c : cases) {
    auto q = ParseQuantizationConfig(Replace(base, c.from, c.to), "q.json");
    if (c.parse_code != absl::StatusCode::kOk) {
      ASSERT_FALSE(q.ok()) << c.to;
      EXPECT_EQ(q.status().code(), c.parse_code) << q.status();
      EXPECT_NE(q.status().message().find(c.mention), std::string_view::npos) << q.status();
      EXPECT_NE(q.status().message().find("q.json"), std::string_view::npos) << q.status();
    } else {
      ASSERT_TRUE(q.ok()) << q.status();
      const absl::Status s = q->CheckSupported();
      EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << c.to;
      EXPECT_NE(s.message().find(c.mention), std::string_view::npos) << s;
    }
  }
}

// llm-compressor's FP8_DYNAMIC scheme: compressed-tensors float-quantized per channel.
TEST(ConfigTest, Fp8ChannelQuantizationConfig) {
  const std::string text = R"({"quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
      "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false,
                  "group_size": null, "actorder": null, "observer": "minmax"},
      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true,
                            "symmetric": true}}}})";
  auto q = ParseQuantizationConfig(text, "fp8-dynamic.json");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->is_fp8() && q->is_fp8_channel() && !q->is_fp8_block());
  EXPECT_EQ(q->engine_layout, "fp8");
  EXPECT_TRUE(q->CheckSupported().ok()) << q->CheckSupported();
  EXPECT_EQ(q->CheckInt4Supported().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(q->IsIgnored("lm_head.weight"));
  for (const auto& [from, to, mention] : std::vector<std::array<std::string, 3>>{
           {R"("strategy": "channel")", R"("strategy": "group", "group_size_": 0)", ""},
           {R"("symmetric": true, "dynamic")", R"("symmetric": false, "dynamic")", "asymmetric FP8"},
           {R"("float-quantized")", R"("pack-quantized")", "format \"pack-quantized\""},
           {R"("dynamic": false)", R"("dynamic": true)", "dynamic weight"},
       }) {
    auto bad = ParseQuantizationConfig(Replace(text, from, to), "fp8-dynamic.json");
    if (mention.empty()) {  // group strategy without a group size: malformed, not merely unsupported
      EXPECT_FALSE(bad.ok());
      continue;
    }
    ASSERT_TRUE(bad.ok()) << bad.status();
    EXPECT_EQ(bad->CheckSupported().code(), absl::StatusCode::kUnimplemented) << to;
    EXPECT_NE(bad->CheckSupported().message().find(mention), std::string_view::npos) << bad->CheckSupported();
  }
}

TEST(ConfigTest, DeepseekV3) {
  std::string text = kDeepseekV3;
  text = text.substr(0, text.find(",\n  \"quantization_config\"")) + "}";
  auto c = ParseModelConfig(text, "dsv3/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kDeepseekV3);
  ASSERT_TRUE(c->mla.has_value());
  EXPECT_EQ(c->mla->q_lora_rank, 1536);
  EXPECT_EQ(c->mla->kv_lora_rank, 512);
  EXPECT_EQ(c->head_dim, 192);
  EXPECT_EQ(c->moe->num_experts, 256);
  EXPECT_EQ(c->moe->num_shared_experts, 1);
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  EXPECT_FALSE(c->IsMoeLayer(2));
  EXPECT_TRUE(c->IsMoeLayer(3));
  EXPECT_TRUE(c->IsMoeLayer(60));
  auto no_qlora = ParseModelConfig(Replace(text, R"("q_lora_rank": 1536)", R"("q_lora_rank": null)"), "x");
  ASSERT_TRUE(no_qlora.ok()) << no_qlora.status();
  EXPECT_EQ(no_qlora->mla->q_lora_rank, 0);
}

// GLM-4.5 (355B-A32B) as slime's glm4.5-355B-A32B.sh and Megatron-Bridge's provider give its shape:
// q/k/v bias, QK norm, RoPE on half of each 128-wide head, 3 dense layers, 160 experts + 1 shared.
constexpr const char* kGlm45 = R"({
  "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": true,
  "head_dim": 128, "hidden_size": 5120, "intermediate_size": 12288, "max_position_embeddings": 131072,
  "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
  "norm_topk_prob": true, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 92,
  "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
  "first_k_dense_replace": 3, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 2.5,
  "tie_word_embeddings": false, "topk_group": 1, "torch_dtype": "bfloat16", "use_qk_norm": true,
  "vocab_size": 151552})";

TEST(ConfigTest, Glm45) {
  auto c = ParseModelConfig(kGlm45, "glm45/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kGlm4Moe);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_proj_bias);  // Glm4MoeAttention: o_proj bias=False
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->RotaryDim(), 64);
  EXPECT_FALSE(c->mla.has_value());
  ASSERT_TRUE(c->moe.has_value());
  EXPECT_TRUE(c->moe->deepseek_routing);
  EXPECT_TRUE(c->moe->HasExpertBias());
  EXPECT_EQ(c->moe->num_experts, 160);
  EXPECT_EQ(c->moe->num_shared_experts, 1);
  EXPECT_DOUBLE_EQ(c->moe->routed_scaling_factor, 2.5);
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  EXPECT_FALSE(c->IsMoeLayer(2));
  EXPECT_TRUE(c->IsMoeLayer(3));
  EXPECT_TRUE(c->IsMoeLayer(91));
  // GLM-4.5-Air: no QK norm; transformers' defaults fill what a config leaves out (0.5 rotary,
  // routed_scaling_factor 1.0); a transformers-5 config may carry the factor in rope_parameters.
  auto air = ParseModelConfig(Replace(Replace(kGlm45, R"("use_qk_norm": true)", R"("use_qk_norm": false)"),
                                      R"("partial_rotary_factor": 0.5,)", ""),
                              "air");
  ASSERT_TRUE(air.ok()) << air.status();
  EXPECT_FALSE(air->qk_norm);
  EXPECT_EQ(air->RotaryDim(), 64);
  auto rp = ParseModelConfig(Replace(kGlm45, R"("partial_rotary_factor": 0.5,)",
                                     R"("rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25},)"),
                             "rp");
  ASSERT_TRUE(rp.ok()) << rp.status();
  EXPECT_EQ(rp->RotaryDim(), 32);
  auto error = [](const std::string& text) {
    auto r = ParseModelConfig(text, "glm");
    return r.ok() ? std::string("parsed") : std::string(r.status().message());
  };
  const std::string odd = error(Replace(kGlm45, R"("partial_rotary_factor": 0.5)", R"("partial_rotary_factor": 0.31)"));
  EXPECT_NE(odd.find("field \"partial_rotary_factor\" 0.31 of head_dim 128 gives 39 rotary dims"), std::string::npos)
      << odd;
  const std::string two = error(Replace(kGlm45, R"("n_shared_experts": 1)", R"("n_shared_experts": 2)"));
  EXPECT_NE(two.find("field \"n_shared_experts\" 2: Glm4MoeMoE builds one shared MLP"), std::string::npos) << two;
}

TEST(ConfigTest, DenseModelsAndDefaults) {
  auto llama = ParseModelConfig(kLlama8B, "llama");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->arch, Architecture::kLlama);
  EXPECT_EQ(llama->head_dim, 128);
  EXPECT_FALSE(llama->qkv_bias);
  EXPECT_FALSE(llama->moe.has_value());
  EXPECT_DOUBLE_EQ(llama->rope_theta, 500000.0);
  EXPECT_FALSE(llama->o_proj_bias || llama->mlp_bias);
  // Llama's attention_bias biases q/k/v and o_proj; mlp_bias gate/up/down_proj (LlamaMLP).
  auto biased = ParseModelConfig(
      absl::StrReplaceAll(kLlama8B, {{"\"attention_bias\": false", "\"attention_bias\": true, \"mlp_bias\": true"}}),
      "llama");
  ASSERT_TRUE(biased.ok()) << biased.status();
  EXPECT_TRUE(biased->qkv_bias && biased->o_proj_bias && biased->mlp_bias);
  auto bad = ParseModelConfig(absl::StrReplaceAll(kLlama8B, {{"\"attention_bias\": false", "\"mlp_bias\": 1"}}), "l");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("mlp_bias"), std::string_view::npos) << bad.status();
  auto qwen2 = ParseModelConfig(kQwen25_05B, "qwen2");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  EXPECT_TRUE(qwen2->qkv_bias);
  EXPECT_TRUE(qwen2->tie_word_embeddings);
  EXPECT_EQ(qwen2->head_dim, 64);
  EXPECT_EQ(qwen2->max_position_embeddings, 4096);  // default when absent
  auto qwen3 = ParseModelConfig(kQwen3_06B, "qwen3");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_EQ(qwen3->head_dim, 128);  // != hidden/heads = 64: Qwen3 sets it explicitly
  EXPECT_TRUE(qwen3->qk_norm);
  EXPECT_FALSE(qwen3->mlp_bias);  // Qwen3MLP has no bias whatever the config says
  // model_type alone identifies the architecture.
  auto by_type = ParseModelConfig(R"({"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000})",
                                  "t");
  ASSERT_TRUE(by_type.ok()) << by_type.status();
  EXPECT_EQ(by_type->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(by_type->head_dim, 128);  // HF Qwen3Config default
}

TEST(ConfigTest, InvalidConfigsNameTheField) {
  struct Case {
    std::string text;
    const char* mention;
  };
  const Case cases[] = {
      {"{", "well-formed"},
      {"[1]", "JSON object"},
      {Replace(kLlama8B, "LlamaForCausalLM", "MistralForCausalLM"), "MistralForCausalLM"},
      {Replace(kLlama8B, R"("model_type": "llama")", R"("model_type": "qwen2")"), "model_type"},
      {Replace(kLlama8B, R"("hidden_size": 4096)", R"("hidden_size": -4096)"), "hidden_size"},
      {Replace(kLlama8B, R"("hidden_size": 4096)", R"("hidden_size": "4096")"), "hidden_size"},
      {Replace(kLlama8B, R"("hidden_size": 4096,)", ""), "hidden_size\" is required"},
      {Replace(kLlama8B, R"("num_key_value_heads": 8)", R"("num_key_value_heads": 5)"), "num_key_value_heads"},
      {Replace(kLlama8B, R"("vocab_size": 128256)", R"("vocab_size": 0)"), "vocab_size"},
      {Replace(kLlama8B, R"("torch_dtype": "bfloat16")", R"("torch_dtype": "int8")"), "torch_dtype"},
      {Replace(kLlama8B, R"("tie_word_embeddings": false)", R"("tie_word_embeddings": "no")"), "tie_word_embeddings"},
      {Replace(kQwen3Moe30B, R"("num_experts": 128)", R"("num_experts": 4)"), "num_experts_per_tok"},
      {Replace(kQwen3Moe30B, R"("moe_intermediate_size": 768,)", ""), "moe_intermediate_size"},
      {Replace(kQwen3Moe30B, R"("mlp_only_layers": [])", R"("mlp_only_layers": [48])"), "mlp_only_layers"},
      {Replace(kQwen3Moe30B, R"("head_dim": 128)", R"("head_dim": 127)"), "head_dim"},
  };
  for (const auto& c : cases) {
    auto r = ParseModelConfig(c.text, "bad/config.json");
    ASSERT_FALSE(r.ok()) << c.mention;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(c.mention), std::string_view::npos) << r.status();
    EXPECT_NE(r.status().message().find("bad/config.json"), std::string_view::npos) << r.status();
  }
}

TEST(ConfigTest, QuantizationConfigStandaloneAndEmbedded) {
  auto q = ParseQuantizationConfig(kInt4Quant, "q.json");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->num_bits, 4);
  EXPECT_EQ(q->group_size, 128);
  EXPECT_EQ(q->strategy, "group");
  EXPECT_TRUE(q->symmetric);
  EXPECT_TRUE(q->actorder.empty());
  EXPECT_EQ(q->targets, std::vector<std::string>{"Linear"});
  EXPECT_TRUE(q->CheckInt4Supported().ok());

  std::string model = kQwen3Moe30B;
  model.pop_back();
  model += std::string(R"(, "quantization_config": )") + kInt4Quant + "}";
  auto m = ParseModelConfig(model, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->quantization.has_value());
  EXPECT_EQ(m->quantization->group_size, 128);
  auto from_model = ParseQuantizationConfig(model, "m");
  ASSERT_TRUE(from_model.ok());
  EXPECT_EQ(from_model->ignore.size(), 4u);
  EXPECT_EQ(ParseQuantizationConfig(kLlama8B, "llama").status().code(), absl::StatusCode::kNotFound);
}

TEST(ConfigTest, IgnoreRulesFollowReMatchAndPrefix) {
  auto q = ParseQuantizationConfig(kInt4Quant, "q.json");
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(q->IsIgnored("lm_head.weight"));                          // exact module name
  EXPECT_TRUE(q->IsIgnored("model.layers.3.self_attn.q_proj.weight"));  // regex
  EXPECT_TRUE(q->IsIgnored("model.layers.3.mlp.gate.weight"));          // regex on the module name ($)
  EXPECT_FALSE(q->IsIgnored("model.layers.3.mlp.gate_proj.weight"));    // "gate$" does not match gate_proj
  EXPECT_FALSE(q->IsIgnored("model.layers.3.mlp.experts.1.up_proj.weight"));
  EXPECT_TRUE(q->IsIgnored("model.layers.0.mlp.experts.1.up_proj.weight"));  // prefix
  EXPECT_FALSE(q->IsIgnored("model.layers.01.mlp.experts.1.up_proj.weight"));
  // Patterns libstdc++ cannot compile safely are refused up front (found by the config fuzzer).
  EXPECT_EQ(IgnoreRule::Parse("re:\\6666666666666666666").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IgnoreRule::Parse("re:a{99999999}").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IgnoreRule::Parse("re:" + std::string(2000, 'a')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IgnoreRule::Parse("re:.*layers\\.1[0-9]{1,3}\\..*").ok());
  // re.match anchors at the start only.
  auto start = IgnoreRule::Parse("re:mlp");
  ASSERT_TRUE(start.ok());
  EXPECT_FALSE(start->Matches("model.mlp.x"));
  EXPECT_TRUE(start->Matches("mlp.x"));
}

TEST(ConfigTest, QuantizationErrorsAndUnsupportedSettings) {
  struct Case {
    std::string from, to;
    absl::StatusCode parse_code;
    const char* mention;
  };
  const Case cases[] = {
      {R"("quant_method": "compressed-tensors")", R"("quant_method": "awq")", absl::StatusCode::kInvalidArgument,
       "bits"},  // an AWQ config is read as one: it has no bits
      {R"("quant_method": "compressed-tensors")", R"("quant_method": "gptq")", absl::StatusCode::kInvalidArgument,
       "gptq"},
      {R"("strategy": "group")", R"("strategy": "tensor")", absl::StatusCode::kInvalidArgument, "strategy"},
      {R"("group_size": 128)", R"("group_size": 0)", absl::StatusCode::kInvalidArgument, "group_size"},
      {R"("group_size": 128)", R"("group_size": "128")", absl::StatusCode::kInvalidArgument, "group_size"},
      {R"("re:.*self_attn.*")", R"("re:(unclosed")", absl::StatusCode::kInvalidArgument, "(unclosed"},
      {R"("num_bits": 4)", R"("num_bits": 8)", absl::StatusCode::kOk, "num_bits 8"},
      {R"("symmetric": true)", R"("symmetric": false)", absl::StatusCode::kOk, "asymmetric"},
      {R"("actorder": null)", R"("actorder": "group")", absl::StatusCode::kOk, "act-order"},
      {R"("group_size": 128)", R"("group_size": 256)", absl::StatusCode::kOk, "group_size 256"},
  };
  for (const auto& c : cases) {
    auto q = ParseQuantizationConfig(Replace(kInt4Quant, c.from, c.to), "q.json");
    if (c.parse_code != absl::StatusCode::kOk) {
      ASSERT_FALSE(q.ok()) << c.to;
      EXPECT_EQ(q.status().code(), c.parse_code) << q.status();
      EXPECT_NE(q.status().message().find(c.mention), std::string_view::npos) << q.status();
      EXPECT_NE(q.status().message().find("q.json"), std::string_view::npos) << q.status();
    } else {
      ASSERT_TRUE(q.ok()) << q.status();
      auto s = q->CheckInt4Supported();
      EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << c.to;
      EXPECT_NE(s.message().find(c.mention), std::string_view::npos) << s;
    }
  }
  auto channel =
      ParseQuantizationConfig(Replace(Replace(kInt4Quant, R"("strategy": "group")", R"("strategy": "channel")"),
                                      R"("group_size": 128)", R"("group_size": null)"),
                              "q.json");
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ(channel->group_size, -1);
  EXPECT_TRUE(channel->CheckInt4Supported().ok());
}

// AWQ configs in both spellings (transformers' AwqConfig and AutoAWQ's quant_config.json).
TEST(ConfigTest, AwqQuantizationConfig) {
  auto hf = ParseQuantizationConfig(
      R"({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm",
          "modules_to_not_convert": ["visual", "mlp.shared_expert_gate"]})",
      "awq.json");
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_TRUE(hf->is_awq());
  EXPECT_EQ(hf->format, "gemm");
  EXPECT_EQ(hf->num_bits, 4);
  EXPECT_EQ(hf->group_size, 128);
  EXPECT_FALSE(hf->symmetric);
  EXPECT_TRUE(hf->CheckInt4Supported().ok()) << hf->CheckInt4Supported();
  // modules_to_not_convert matches by substring (vLLM is_layer_skipped_awq: `name in prefix`).
  EXPECT_TRUE(hf->IsIgnored("model.visual.blocks.0.attn.qkv.weight"));
  EXPECT_TRUE(hf->IsIgnored("model.layers.3.mlp.shared_expert_gate.weight"));
  // Never quantized under AWQ, whatever the config says: lm_head, embeddings, MoE routers.
  EXPECT_TRUE(hf->IsIgnored("lm_head.weight"));
  EXPECT_TRUE(hf->IsIgnored("model.embed_tokens.weight"));
  EXPECT_TRUE(hf->IsIgnored("model.layers.3.mlp.gate.weight"));
  EXPECT_FALSE(hf->IsIgnored("model.layers.3.mlp.gate_proj.weight"));
  EXPECT_FALSE(hf->IsIgnored("model.layers.3.mlp.experts.7.down_proj.weight"));
  EXPECT_FALSE(hf->IsIgnored("model.layers.3.self_attn.q_proj.weight"));

  auto autoawq = ParseQuantizationConfig(
      R"({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": true, "version": "GEMM"})", "q.json");
  ASSERT_TRUE(autoawq.ok()) << autoawq.status();
  EXPECT_EQ(autoawq->group_size, 64);
  EXPECT_EQ(autoawq->format, "gemm");
  EXPECT_TRUE(autoawq->CheckInt4Supported().ok());

  struct Case {
    const char* json;
    absl::StatusCode parse_code;
    const char* mention;
  };
  const Case cases[] = {
      {R"({"quant_method": "awq", "group_size": 128, "zero_point": true})", absl::StatusCode::kInvalidArgument, "bits"},
      {R"({"quant_method": "awq", "bits": 4, "zero_point": true})", absl::StatusCode::kInvalidArgument, "group_size"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 0, "zero_point": true})", absl::StatusCode::kInvalidArgument,
       "group_size"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 128})", absl::StatusCode::kInvalidArgument, "zero_point"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
           "modules_to_not_convert": [""]})",
       absl::StatusCode::kInvalidArgument, "empty"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemv"})",
       absl::StatusCode::kOk, "gemv"},
      {R"({"quant_method": "awq", "bits": 8, "group_size": 128, "zero_point": true})", absl::StatusCode::kOk, "bits 8"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": false})", absl::StatusCode::kOk,
       "zero_point"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 256, "zero_point": true})", absl::StatusCode::kOk,
       "group_size 256"},
  };
  for (const auto& c : cases) {
    auto q = ParseQuantizationConfig(c.json, "q.json");
    if (c.parse_code != absl::StatusCode::kOk) {
      ASSERT_FALSE(q.ok()) << c.json;
      EXPECT_EQ(q.status().code(), c.parse_code) << q.status();
      EXPECT_NE(q.status().message().find(c.mention), std::string_view::npos) << q.status();
    } else {
      ASSERT_TRUE(q.ok()) << q.status();
      auto s = q->CheckInt4Supported();
      EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << c.json;
      EXPECT_NE(s.message().find(c.mention), std::string_view::npos) << s;
    }
  }
}

// The engine declares the layout it holds ("engine_layout", docs/engine-formats.md).
TEST(ConfigTest, EngineLayoutKey) {
  auto marlin = ParseQuantizationConfig(kInt4Quant, "q.json");
  ASSERT_TRUE(marlin.ok()) << marlin.status();
  EXPECT_EQ(marlin->engine_layout, "marlin");
  EXPECT_FALSE(marlin->trtllm());
  for (const char* layout : {"trtllm-sm80", "trtllm-sm90"}) {
    auto q = ParseQuantizationConfig(
        Replace(kInt4Quant, R"("quant_method": "compressed-tensors")",
                absl::StrCat(R"("quant_method": "compressed-tensors", "engine_layout": ")", layout, R"(")")),
        "q.json");
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->engine_layout, layout);
    EXPECT_TRUE(q->trtllm());
    EXPECT_TRUE(q->CheckInt4Supported().ok()) << q->CheckInt4Supported();
  }
  auto bad = ParseQuantizationConfig(Replace(kInt4Quant, R"("quant_method": "compressed-tensors")",
                                             R"("quant_method": "compressed-tensors", "engine_layout": "exllama")"),
                                     "q.json");
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->CheckInt4Supported().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(bad->CheckInt4Supported().message().find("exllama"), std::string_view::npos);
  auto not_string = ParseQuantizationConfig(Replace(kInt4Quant, R"("quant_method": "compressed-tensors")",
                                                    R"("quant_method": "compressed-tensors", "engine_layout": 80)"),
                                            "q.json");
  EXPECT_EQ(not_string.status().code(), absl::StatusCode::kInvalidArgument);
  // AWQ's zero points have no TensorRT-LLM delivery (its W4A16 zeros are not produced by a sync).
  auto awq = ParseQuantizationConfig(
      R"({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "engine_layout": "trtllm-sm80"})",
      "q.json");
  ASSERT_TRUE(awq.ok()) << awq.status();
  EXPECT_EQ(awq->CheckInt4Supported().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(awq->CheckInt4Supported().message().find("TensorRT-LLM"), std::string_view::npos);
}

}  // namespace
}  // namespace wsync
