// HuggingFace model configs (config.json) for the architectures wsync converts
// (docs: docs/spec/MEGATRON_TO_HF.md): Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3, and the
// optional `quantization_config` that tells which tensors go to INT4 (compressed-tensors, AWQ) or
// to FP8 (DeepSeek-V3's block form, compressed-tensors per channel).
//
// The parser validates what each architecture needs: structural sizes (hidden size, layers,
// heads, vocab, experts, MLA ranks) must be present and positive and consistent (KV heads divide
// heads, top-k <= experts, ...); hyper-parameters that HF itself defaults (eps, rope theta,
// flags) take HF's defaults for that architecture. Every problem is kInvalidArgument naming the
// source file and the field and its value. Unknown fields are ignored (HF configs carry many).
//
// Thread-safety: the structs are plain values; QuantizationConfig::IsIgnored is const and safe
// to call concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace wsync {

enum class Architecture { kLlama, kQwen2, kQwen3, kQwen3Moe, kDeepseekV3, kGlm4Moe };

// "llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe" (HF model_type spelling).
absl::string_view ArchitectureName(Architecture a);

// compressed-tensors quantization_config (format pack-quantized), as written by llm-compressor
// and by slime's INT4 converter:
//   {"quant_method": "compressed-tensors", "format": "pack-quantized",
//    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
//      "strategy": "group", "group_size": 128, "symmetric": true, "actorder": null, ...}}},
//    "ignore": ["lm_head", "re:.*mlp.gate$"]}
// Parsing is faithful; whether wsync can produce a setting (4-bit, symmetric, no act-order) is
// checked by CheckInt4Supported(), so that a clear "not supported" differs from "malformed".
// AWQ quantization_config (docs/spec/AWQ.md §2), as AutoAWQ / transformers write it and vLLM /
// SGLang read it (AWQConfig.from_config: the first of each key pair that is present):
//   {"quant_method": "awq", "bits" | "w_bit": 4, "group_size" | "q_group_size": 128,
//    "zero_point": true, "version": "gemm", "modules_to_not_convert": ["visual"]}
// It becomes a QuantizationConfig with quant_method "awq", format = the version in lower case,
// symmetric = !zero_point, strategy "group" ("channel" for group_size -1), and `ignore` =
// modules_to_not_convert as substring rules (`name in prefix`, is_layer_skipped_awq and AutoAWQ's
// exclude_layers_to_not_quantize) plus the modules the engines never build quantized under AWQ:
// lm_head and embed_tokens (not LinearBase) and MoE routers "mlp.gate" (ReplicatedLinear with
// quant_config None). docs/spec/README.md records the decision.
//
// FP8 block-wise quantization_config (docs/spec/FP8.md §6), as DeepSeek-V3, Kimi-K2 and the Qwen3
// FP8 releases and slime's converter write it and SGLang / vLLM Fp8Config read it:
//   {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
//    "weight_block_size": [128, 128], "scale_fmt": "ue8m0" (optional),
//    "modules_to_not_convert" | "ignored_layers": ["lm_head", ...]}
// It becomes quant_method "fp8", format = fmt, type "float", num_bits 8, strategy "block",
// block_n / block_k = weight_block_size; `ignore` = both lists (exact names, as SGLang's
// is_layer_skipped matches them, or prefixes; "re:" entries are regexes, a wsync extension) plus
// what the engines never build FP8 (lm_head, embed_tokens, MoE
// routers "mlp.gate"). No weight_block_size: per-tensor FP8, parsed and refused by CheckFp8Supported.
// FP8 per channel is compressed-tensors with format "float-quantized", weights {"num_bits": 8,
// "type": "float", "strategy": "channel"} (llm-compressor's FP8_DYNAMIC scheme).
//
// One entry of quantization_config.ignore: "re:PATTERN" (compiled once) or a literal name/prefix
// (compressed-tensors), or a substring (AWQ modules_to_not_convert).
struct IgnoreRule {
  std::string text;                 // as written in the config
  std::optional<std::regex> regex;  // set for "re:" entries
  bool substring = false;           // AWQ: matches any name containing `text`
  // InvalidArgument for a pattern std::regex (ECMAScript) cannot compile, longer than 1024 bytes,
  // or holding a number of more than 6 digits (libstdc++'s compiler overflows on those), naming it.
  static absl::StatusOr<IgnoreRule> Parse(std::string text);
  bool Matches(absl::string_view name) const;
};

struct QuantizationConfig {
  std::string quant_method;  // "compressed-tensors", "awq" or "fp8"
  // "pack-quantized" / "float-quantized" (compressed-tensors), the AWQ version ("gemm") or the
  // FP8 fmt ("e4m3")
  std::string format;
  int num_bits = 4;
  std::string type = "int";  // "int" or "float"
  std::string strategy;      // "group", "channel" or "block" (fp8)
  int group_size = -1;       // -1: channelwise (one group spanning K)
  bool symmetric = true;
  bool dynamic = false;
  std::string actorder;  // "" when null / absent
  std::vector<std::string> targets;
  std::vector<IgnoreRule> ignore;
  // FP8 block form: weight_block_size [block_n, block_k] (0: absent, per-tensor), scale_fmt
  // ("" or "ue8m0": scales are powers of two) and activation_scheme ("dynamic" or "static").
  int64_t block_n = 0, block_k = 0;
  std::string scale_fmt;
  std::string activation_scheme;
  // What the engine holds in memory, declared by the engine with the key "engine_layout" (a wsync
  // key: the checkpoint formats have none, docs/engine-formats.md): "marlin" (the default: SGLang's
  // and vLLM's Marlin / AWQ-Marlin) or TensorRT-LLM's preprocessed W4A16 layout for the GPU family,
  // "trtllm-sm80" (sm75-89, sm100+) or "trtllm-sm90" (Hopper; its MoE weights use the sm80 layout).
  // FP8 configs: "fp8" (the default there: the engines' FP8 weight and scale tensors as loaded).
  std::string engine_layout = "marlin";
  bool trtllm() const { return engine_layout == "trtllm-sm80" || engine_layout == "trtllm-sm90"; }

  // Whether `param_name` (e.g. "model.layers.0.mlp.gate.weight") is excluded by `ignore`. An
  // entry matches the module name (the parameter name without ".weight") or the parameter name:
  // "re:PATTERN" is an ECMAScript regular expression matched from the start of the name (Python
  // re.match semantics: anchored at the start, not at the end); anything else is an exact name or
  // a prefix of the name.
  bool IsIgnored(absl::string_view param_name) const;

  // OK for what the INT4 kernels implement: compressed-tensors pack-quantized 4-bit symmetric int,
  // or AWQ gemm 4-bit with zero points; group size 32/64/128 or channelwise, no act-order,
  // static; engine_layout marlin, or trtllm-sm80 / trtllm-sm90 with compressed-tensors.
  // Otherwise kInvalidArgument / kUnimplemented naming it.
  absl::Status CheckInt4Supported() const;
  // OK for what the FP8 kernels implement: quant_method fp8 e4m3 with a weight_block_size (each
  // side 1..4096), scale_fmt absent or ue8m0, or compressed-tensors float-quantized 8-bit float
  // symmetric per channel; static weights. Otherwise kInvalidArgument / kUnimplemented naming it.
  absl::Status CheckFp8Supported() const;
  // CheckFp8Supported for an FP8 config, CheckInt4Supported otherwise: for the consumers that
  // handle both.
  absl::Status CheckSupported() const;
  // FP8 weights: the block form (quant_method fp8) or per channel (compressed-tensors float).
  bool is_fp8() const { return is_fp8_block() || is_fp8_channel(); }
  bool is_fp8_block() const { return quant_method == "fp8"; }
  bool is_fp8_channel() const { return quant_method == "compressed-tensors" && type == "float"; }
  // quant_method "awq": asymmetric INT4 with zero points, AWQ tensors (qweight / qzeros / scales).
  bool is_awq() const { return quant_method == "awq"; }
  // Every setting that decides what a sync sends, on one line (engine_layout excluded: engines
  // that hold different layouts of one quantization are sent the same tensors). Equal strings:
  // configs that quantize alike.
  std::string Canonical() const;
  // For messages: "awq gemm 4-bit group 128 with zero points, 3 ignore rules", "fp8 e4m3 block
  // 128x128, 4 ignore rules".
  std::string Describe() const;
};

struct MoeConfig {
  int64_t num_experts = 0;          // routed experts (Qwen3-MoE num_experts, DeepSeek n_routed_experts)
  int64_t num_experts_per_tok = 0;  // top-k
  int64_t moe_intermediate_size = 0;
  int64_t num_shared_experts = 0;  // DeepSeek / GLM n_shared_experts (0 for Qwen3-MoE)
  bool norm_topk_prob = false;
  // Qwen3-MoE layer selection.
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // DeepSeek-V3 / GLM-4.5 routing: scoring_func, topk_method (noaux_tc: the router's
  // e_score_correction_bias), group-limited top-k, routed_scaling_factor. False: Qwen3-MoE's softmax top-k.
  bool deepseek_routing = false;
  // DeepSeek-V3 / GLM-4.5 layer selection and routing.
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  std::string scoring_func = "softmax";
  std::string topk_method = "greedy";

  // The router has an e_score_correction_bias (fp32; Megatron's router.expert_bias).
  bool HasExpertBias() const { return deepseek_routing && topk_method == "noaux_tc"; }
};

struct MlaConfig {          // DeepSeek-V3 multi-head latent attention
  int64_t q_lora_rank = 0;  // 0: no q compression (q_lora_rank null)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  std::string architecture;  // architectures[0], e.g. "Qwen3MoeForCausalLM"
  std::string model_type;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;  // dense MLP width (DeepSeek's first dense layers too)
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;                 // Qwen2 always; Llama/Qwen3/GLM-4.5 when attention_bias
  bool o_proj_bias = false;              // Llama/Qwen3 when attention_bias (not Qwen2, not GLM-4.5)
  bool mlp_bias = false;                 // Llama when mlp_bias: gate/up/down_proj biases (dense MLP)
  bool qk_norm = false;                  // Qwen3, Qwen3-MoE; GLM-4.5 when use_qk_norm
  double partial_rotary_factor = 1.0;    // GLM-4.5: 0.5 (RoPE on the first half of each head)
  DType dtype = DType::kBF16;            // torch_dtype
  int64_t num_nextn_predict_layers = 0;  // DeepSeek MTP
  std::optional<MoeConfig> moe;
  std::optional<MlaConfig> mla;
  std::optional<QuantizationConfig> quantization;

  // Whether decoder layer `layer` (global index) has a routed-expert MLP.
  bool IsMoeLayer(int64_t layer) const;
  // GQA: the leading dims of a head that RoPE rotates (rotate_half style), int(head_dim * factor).
  int64_t RotaryDim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor); }
};

// Parses config.json text. `source` names the file in errors.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, absl::string_view source);
// Reads `path`: a config.json, or a directory holding one.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// Parses a quantization_config: either the object itself or an HF config.json holding it under
// "quantization_config". NotFound if a config.json has none.
absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(absl::string_view json_text, absl::string_view source);
absl::StatusOr<QuantizationConfig> LoadQuantizationConfig(const std::string& path);

// Reads a whole (small) text file; kNotFound / kPermissionDenied from errno.
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

}  // namespace wsync
