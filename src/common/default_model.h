// The embedded default model of the local demo and the self-check: a small Qwen3-MoE-style
// config (the architecture slime's RL runs sync most often), with a compressed-tensors INT4
// quantization_config for the experts as slime's default ignore list gives it (attention,
// router, embeddings, lm_head and norms stay bf16). Sizes are chosen so the whole demo runs in
// seconds on 2 cores: K and N of every quantized linear are multiples of 128 and 64, the vocab is
// deliberately not a multiple of 128 (padding paths are exercised).
#pragma once

namespace wsync {

inline constexpr const char kDefaultModelConfigJson[] = R"json({
  "architectures": ["Qwen3MoeForCausalLM"],
  "model_type": "qwen3_moe",
  "hidden_size": 512,
  "num_hidden_layers": 4,
  "num_attention_heads": 8,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "intermediate_size": 1024,
  "moe_intermediate_size": 256,
  "num_experts": 8,
  "num_experts_per_tok": 2,
  "decoder_sparse_step": 1,
  "mlp_only_layers": [],
  "norm_topk_prob": true,
  "vocab_size": 4000,
  "max_position_embeddings": 4096,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "quantization_config": {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
      "group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                    "symmetric": true, "actorder": null, "dynamic": false, "observer": "minmax"}
      }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens.*", "re:.*norm.*"]
  }
})json";

}  // namespace wsync
