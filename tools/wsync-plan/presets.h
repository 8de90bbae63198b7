// Model configs wsync-plan knows by name, for projections on paper (no weights needed).
#pragma once

namespace wsync::tools {

// Kimi-K2 (Moonshot AI, 1.04T parameters): DeepSeek-V3 architecture with 384 routed experts, as in
// the published config.json of moonshotai/Kimi-K2-Instruct (MTP layers: none). Its model_type
// there is "kimi_k2"; wsync's config parser knows the architecture as deepseek_v3, which is what
// the shapes are.
inline constexpr const char kKimiK2ConfigJson[] = R"json({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
  "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.827,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "vocab_size": 163840, "num_nextn_predict_layers": 0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})json";

// INT4 experts only (group 128; attention, shared experts, dense MLPs, routers, embeddings and
// lm_head in bf16): what Kimi-K2-Thinking ships (its experts INT4, QAT) and what slime syncs.
inline constexpr const char kInt4ExpertsJson[] = R"json({
  "quant_method": "compressed-tensors", "format": "pack-quantized",
  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
    "strategy": "group", "group_size": 128, "symmetric": true}}},
  "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*shared_experts.*",
             "re:.*mlp\\.(gate|up|down)_proj$"]})json";

// Block FP8 as DeepSeek-V3 ships it (docs/spec/FP8.md §6): every linear in FP8 with
// 128 x 128 blocks; routers, embeddings and lm_head in bf16 (what the engines never build FP8).
inline constexpr const char kFp8BlockJson[] = R"json({
  "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})json";

}  // namespace wsync::tools
