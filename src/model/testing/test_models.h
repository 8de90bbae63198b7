// Test helper: small model configs (config.json text) of every supported architecture, sized so
// that INT4 with G = 128 and G = 32 and engine TP 1/2/4 are loadable (K_p % G, N_p % 64), and
// quantization_config JSON for them.
#pragma once

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace wsync::model::testing {

// Llama, untied, every linear biased (attention_bias: qkv and o_proj; mlp_bias: gate/up/down_proj, as
// megatron's --add-bias-linear): nh 8, nkv 2 (replicated at T = 4).
inline constexpr const char kLlamaJson[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
  "intermediate_size": 512, "vocab_size": 1000, "attention_bias": true, "mlp_bias": true,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

// Qwen2, tied, qkv bias: nh 4, nkv 4 (T = 2 holds 2 kv heads per rank).
inline constexpr const char kQwen2Json[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
  "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": true, "torch_dtype": "bfloat16"})";

// Qwen3, untied, q/k norms, MQA (nkv 1: every rank replicates the one kv head).
inline constexpr const char kQwen3Json[] = R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 64,
  "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

// Qwen3-MoE: layer 1 is dense (mlp_only_layers).
inline constexpr const char kQwen3MoeJson[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
  "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
  "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
  "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": true, "vocab_size": 1000,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

// Qwen3-MoE with H = G = 128: SGLang permutes the w13 scales with size_k = 4I' (grouped perm),
// where vLLM's size_k = H would pick the single perm (ENGINE_LAYOUT.md §4 quirk).
inline constexpr const char kQwen3MoeH128Json[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "intermediate_size": 256, "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
  "mlp_only_layers": [0], "vocab_size": 500, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

// DeepSeek-V3 with q_lora (fused_qkv_a_proj_with_mqa), one dense layer, shared experts (S = 512),
// noaux_tc (fp32 e_score_correction_bias), one MTP layer.
inline constexpr const char kDeepseekJson[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128,
  "kv_lora_rank": 128, "qk_nope_head_dim": 96, "qk_rope_head_dim": 32, "v_head_dim": 128,
  "intermediate_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 8, "n_shared_experts": 2,
  "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 2, "topk_group": 1,
  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "vocab_size": 1000, "num_nextn_predict_layers": 1,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

// GLM-4.5's shape: q/k/v bias (no o_proj bias), QK norm, half-head RoPE, a dense first layer,
// sigmoid routing with the correction bias, one shared expert; head_dim * heads != hidden.
inline constexpr const char kGlm45Json[] = R"({
  "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 256,
  "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
  "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 8, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
  "routed_scaling_factor": 2.5, "attention_bias": true, "use_qk_norm": true, "partial_rotary_factor": 0.5,
  "vocab_size": 1000, "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

// DeepSeek-V3 without q_lora (q_proj, kv_a_proj_with_mqa replicated and INT4-loadable: 96 + 32 = 128 rows).
inline constexpr const char kDeepseekNoQLoraJson[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": null,
  "kv_lora_rank": 96, "qk_nope_head_dim": 96, "qk_rope_head_dim": 32, "v_head_dim": 128,
  "intermediate_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 8, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "first_k_dense_replace": 1, "topk_method": "noaux_tc", "vocab_size": 1000,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

// A compressed-tensors W4A16 quantization_config with group size G (-1: channel) and `ignore`
// entries (JSON-escaped by the caller).
inline std::string QuantJson(int group_size, const std::vector<std::string>& ignore) {
  std::vector<std::string> quoted;
  for (const auto& s : ignore) quoted.push_back(absl::StrCat("\"", absl::StrReplaceAll(s, {{"\\", "\\\\"}}), "\""));
  const std::string weights =
      group_size == -1
          ? std::string(R"("num_bits": 4, "type": "int", "strategy": "channel", "symmetric": true, "actorder": null)")
          : absl::StrCat(R"("num_bits": 4, "type": "int", "strategy": "group", "group_size": )", group_size,
                         R"(, "symmetric": true, "actorder": null)");
  return absl::StrCat(
      R"({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {)",
      weights, R"(}}}, "ignore": [)", absl::StrJoin(quoted, ", "), "]}");
}

// An AWQ quantization_config (transformers' spelling) with group size G and modules_to_not_convert.
inline std::string AwqQuantJson(int group_size, const std::vector<std::string>& modules_to_not_convert) {
  std::vector<std::string> quoted;
  for (const auto& s : modules_to_not_convert) quoted.push_back(absl::StrCat("\"", s, "\""));
  return absl::StrCat(R"({"quant_method": "awq", "bits": 4, "group_size": )", group_size,
                      R"(, "zero_point": true, "version": "gemm", "modules_to_not_convert": [)",
                      absl::StrJoin(quoted, ", "), "]}");
}

}  // namespace wsync::model::testing
