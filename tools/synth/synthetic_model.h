// Random HuggingFace checkpoints of every supported architecture, for tests, demos and
// benchmarks (wsync-model-gen is its command line). The tensor list comes from the same tables
// as the conversion (HfTensorSpecs), so a generated model has exactly the tensors a real
// checkpoint of that config has.
//
// Values: weights ~ N(0, 0.02), norm weights 1 + N(0, 0.02), biases N(0, 0.02); rounded to the
// model dtype (bf16). Deterministic: each tensor's values depend only on (seed, tensor name),
// not on the thread count or the order of generation.
//
// Presets (sizes chosen so every linear's K is a multiple of 128 and N of 64, i.e. INT4 with
// G = 128 and the Marlin repack work; the vocab is not a multiple of 128):
//   tiny     hidden 256, 2 layers (DeepSeek: 3, first dense), 4 heads, vocab 1000     ~ 1-5 MB
//   small    hidden 512, 4 layers, 8 heads, vocab 4000 (the default model's sizes)  ~ 10-40 MB
//   bench2g  hidden 2048, ~2 GB bf16: qwen3-moe 4 layers x 32 experts (moe_ffn 1024),
//            deepseek-v3 4 layers x 32 experts, dense archs 16 layers (ffn 8192); vocab 32011
//   bench8g  hidden 4096, >= 8 GB bf16 (8e9 bytes; the GPU's whole colocated sync): qwen3-moe 6 layers
//            x 32 experts (moe_ffn 1536), deepseek-v3 7, dense archs 20 layers (ffn 12288); vocab 32011
//
// Errors: kInvalidArgument for an unknown preset/architecture or sizes the config parser
// refuses (named); kResourceExhausted if the tensors cannot be allocated.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "model/hf_checkpoint.h"

namespace wsync::tools {

struct SyntheticModelOptions {
  Architecture arch = Architecture::kQwen3Moe;
  int64_t hidden = 256;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 64;
  int64_t ffn = 512;      // dense MLP width
  int64_t moe_ffn = 128;  // routed expert width (MoE archs)
  int64_t experts = 8;
  int64_t topk = 2;
  int64_t vocab = 1000;
  bool tie = false;
  // Llama with attention_bias and mlp_bias: every linear biased (megatron-core's --add-bias-linear).
  bool linear_bias = false;
  int64_t mtp_layers = 0;  // DeepSeek-V3 / GLM-4.5: num_nextn_predict_layers (MTP layers, weights included)
  // DeepSeek-V3 (MLA + shared experts + dense first layers).
  int64_t q_lora_rank = 128;  // 0: no q compression (q_lora_rank null)
  int64_t kv_lora_rank = 128;
  int64_t qk_nope_head_dim = 64;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 64;
  int64_t shared_experts = 1;
  int64_t first_k_dense = 1;
  // A compressed-tensors quantization_config object (JSON text) written into config.json.
  std::optional<std::string> quantization_config_json;
};

// "llama", "qwen2", "qwen3", "qwen3-moe" (or "qwen3_moe"), "deepseek-v3" (or "deepseek_v3"),
// "glm4-moe" (or "glm4_moe": GLM-4.5's shape).
absl::StatusOr<Architecture> ParseArchitectureFlag(absl::string_view name);

// The preset's sizes for `arch` ("tiny", "small", "bench2g", "bench8g").
absl::StatusOr<SyntheticModelOptions> PresetOptions(absl::string_view preset, Architecture arch);

// The HF config.json text of the options (validated by ParseModelConfig before it is returned).
absl::StatusOr<std::string> SyntheticConfigJson(const SyntheticModelOptions& options);

// Random weights for every HF tensor of `model`, its num_nextn_predict_layers MTP layers included.
// threads: 0 = hardware concurrency.
absl::StatusOr<model::HfCheckpoint> GenerateSyntheticWeights(const ModelConfig& model, uint64_t seed, int threads = 0);

struct SyntheticModel {
  std::string config_json;
  ModelConfig config;
  model::HfCheckpoint weights;
};
// Config + weights in memory.
absl::StatusOr<SyntheticModel> GenerateSyntheticModel(const SyntheticModelOptions& options, uint64_t seed,
                                                      int threads = 0);
// Writes DIR/config.json and DIR/model.safetensors (directory created if missing).
absl::Status WriteHfModel(const SyntheticModel& model, const std::string& dir);

// The benchmarks' model (wsync-bench-engine, wsync-bench-repack): `checkpoint` if given, else
// WORK/hf, generated from `preset` (Qwen3-MoE, seed 7, what tools/bench-sync.sh uses) unless it
// exists (a line on stdout says so). Returns the directory. kInvalidArgument without either.
absl::StatusOr<std::string> EnsureBenchModel(const std::string& checkpoint, const std::string& work,
                                             const std::string& preset);
// DIR/config.json with the quantization the engines serve: `quant_config` a compressed-tensors
// file, "none" for bf16, empty for bench-sync.sh's (INT4 G=128 experts; bf16 attention,
// embeddings, router, norms). The config's own quantization is replaced.
absl::StatusOr<ModelConfig> BenchModelConfig(const std::string& dir, const std::string& quant_config);

}  // namespace wsync::tools
