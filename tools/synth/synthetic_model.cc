#include "tools/synth/synthetic_model.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "trainer_agent/convert/hf_convert.h"

namespace wsync::tools {
namespace {

using Json = nlohmann::json;

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Approximately N(0, 1): Irwin-Hall sum of four 16-bit uniforms, centred and scaled to unit
// variance (bounded at +-3.46). Exact integer inputs and IEEE float ops: the same bits everywhere.
float StandardNormal(uint64_t& state) {
  const uint64_t x = SplitMix64(state);
  const uint32_t sum = static_cast<uint32_t>(x & 0xffff) + static_cast<uint32_t>((x >> 16) & 0xffff) +
                       static_cast<uint32_t>((x >> 32) & 0xffff) + static_cast<uint32_t>(x >> 48);
  // sum/65536 ~ Irwin-Hall(4): mean 2 (minus 2/65536 for the open upper end), variance 1/3.
  const float u = (static_cast<float>(sum) + 2.0f) * (1.0f / 65536.0f);
  return (u - 2.0f) * 1.7320508f;
}

constexpr int64_t kChunk = int64_t{1} << 16;

struct Job {
  DType dtype;
  std::byte* data;  // destination: memory owned by the checkpoint being built
  uint64_t seed;
  float mean;
  float stddev;
  int64_t numel;
};

template <typename T, typename Convert>
void FillValues(const Job& job, int64_t begin, int64_t end, uint64_t& state, Convert convert) {
  T buf[256];
  for (int64_t i = begin; i < end; i += 256) {
    const int64_t n = std::min<int64_t>(256, end - i);
    for (int64_t j = 0; j < n; ++j) buf[j] = convert(job.mean + job.stddev * StandardNormal(state));
    std::memcpy(job.data + i * static_cast<int64_t>(sizeof(T)), buf, static_cast<size_t>(n) * sizeof(T));
  }
}

void FillChunk(const Job& job, int64_t chunk) {
  uint64_t state = job.seed ^ (static_cast<uint64_t>(chunk) * 0xd1342543de82ef95ull);
  SplitMix64(state);
  const int64_t begin = chunk * kChunk;
  const int64_t end = std::min(job.numel, begin + kChunk);
  switch (job.dtype) {
    case DType::kBF16: FillValues<uint16_t>(job, begin, end, state, [](float v) { return F32ToBF16(v); }); break;
    case DType::kF16: FillValues<uint16_t>(job, begin, end, state, [](float v) { return F32ToF16(v); }); break;
    default: FillValues<float>(job, begin, end, state, [](float v) { return v; }); break;
  }
}

bool IsNormWeight(absl::string_view name) {
  return absl::EndsWith(name, "norm.weight") || absl::EndsWith(name, "layernorm.weight");
}

}  // namespace

absl::StatusOr<Architecture> ParseArchitectureFlag(absl::string_view name) {
  std::string n = absl::AsciiStrToLower(name);
  for (char& c : n)
    if (c == '_') c = '-';
  if (n == "llama") return Architecture::kLlama;
  if (n == "qwen2") return Architecture::kQwen2;
  if (n == "qwen3") return Architecture::kQwen3;
  if (n == "qwen3-moe") return Architecture::kQwen3Moe;
  if (n == "deepseek-v3") return Architecture::kDeepseekV3;
  if (n == "glm4-moe") return Architecture::kGlm4Moe;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown architecture \"", name, "\"; expected llama, qwen2, qwen3, qwen3-moe, deepseek-v3 or glm4-moe"));
}

absl::StatusOr<SyntheticModelOptions> PresetOptions(absl::string_view preset, Architecture arch) {
  SyntheticModelOptions o;
  o.arch = arch;
  const bool moe =
      arch == Architecture::kQwen3Moe || arch == Architecture::kDeepseekV3 || arch == Architecture::kGlm4Moe;
  const bool mla = arch == Architecture::kDeepseekV3;
  if (preset == "tiny") {
    o.hidden = 256, o.layers = mla ? 3 : 2, o.heads = 4, o.kv_heads = 2, o.head_dim = 64, o.ffn = 512;
    o.moe_ffn = 128, o.experts = 8, o.topk = 2, o.vocab = 1000;
    o.q_lora_rank = 128, o.kv_lora_rank = 128, o.qk_nope_head_dim = 64, o.qk_rope_head_dim = 64, o.v_head_dim = 64;
    o.first_k_dense = 1;
  } else if (preset == "small") {
    o.hidden = 512, o.layers = 4, o.heads = 8, o.kv_heads = 2, o.head_dim = 64, o.ffn = 1024;
    o.moe_ffn = 256, o.experts = 8, o.topk = 2, o.vocab = 4000;
    o.q_lora_rank = 256, o.kv_lora_rank = 256, o.qk_nope_head_dim = 64, o.qk_rope_head_dim = 64, o.v_head_dim = 64;
    o.first_k_dense = 1;
  } else if (preset == "bench2g") {
    o.hidden = 2048, o.heads = 16, o.kv_heads = 4, o.head_dim = 128, o.vocab = 32011;
    o.experts = 32, o.moe_ffn = 1024, o.topk = 4;
    o.q_lora_rank = 512, o.kv_lora_rank = 512, o.qk_nope_head_dim = 128, o.qk_rope_head_dim = 64, o.v_head_dim = 128;
    o.first_k_dense = 1;
    if (mla) {
      o.layers = 5, o.ffn = 4096;
    } else if (moe) {
      o.layers = 4, o.ffn = 4096;
    } else {
      o.layers = 14, o.ffn = 8192;
    }
  } else if (preset == "bench8g") {  // at least 8 GB (8e9 bytes) of bf16 weights: the GPU's whole-sync check
    o.hidden = 4096, o.heads = 32, o.kv_heads = 8, o.head_dim = 128, o.vocab = 32011;
    o.experts = 32, o.moe_ffn = 1536, o.topk = 4;
    o.q_lora_rank = 1536, o.kv_lora_rank = 512, o.qk_nope_head_dim = 128, o.qk_rope_head_dim = 64, o.v_head_dim = 128;
    o.first_k_dense = 1, o.ffn = 12288;
    o.layers = mla ? 7 : moe ? 6 : 20;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown preset \"", preset, "\"; expected tiny, small, bench2g or bench8g"));
  }
  return o;
}

absl::StatusOr<std::string> SyntheticConfigJson(const SyntheticModelOptions& o) {
  Json j;
  const char* cls = "";
  switch (o.arch) {
    case Architecture::kLlama: cls = "LlamaForCausalLM"; break;
    case Architecture::kQwen2: cls = "Qwen2ForCausalLM"; break;
    case Architecture::kQwen3: cls = "Qwen3ForCausalLM"; break;
    case Architecture::kQwen3Moe: cls = "Qwen3MoeForCausalLM"; break;
    case Architecture::kDeepseekV3: cls = "DeepseekV3ForCausalLM"; break;
    case Architecture::kGlm4Moe: cls = "Glm4MoeForCausalLM"; break;
  }
  j["architectures"] = {cls};
  j["model_type"] = std::string(ArchitectureName(o.arch));
  j["hidden_size"] = o.hidden;
  j["num_hidden_layers"] = o.layers;
  j["num_attention_heads"] = o.heads;
  j["intermediate_size"] = o.ffn;
  j["vocab_size"] = o.vocab;
  j["max_position_embeddings"] = 4096;
  j["rms_norm_eps"] = 1e-6;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = o.tie;
  j["torch_dtype"] = "bfloat16";
  j["bos_token_id"] = 1;
  j["eos_token_id"] = 2;
  // DeepSeek-V3's MoE fields, which GLM-4.5 shares (nlohmann::json keeps keys sorted: order is free)
  auto deepseek_style_moe = [&] {
    j["n_routed_experts"] = o.experts;
    j["num_experts_per_tok"] = o.topk;
    j["moe_intermediate_size"] = o.moe_ffn;
    j["n_shared_experts"] = o.shared_experts;
    j["first_k_dense_replace"] = o.first_k_dense;
    j["n_group"] = 1;
    j["topk_group"] = 1;
    j["routed_scaling_factor"] = 2.5;
    j["norm_topk_prob"] = true;
    j["num_nextn_predict_layers"] = o.mtp_layers;
  };
  if (o.mtp_layers < 0 || (o.mtp_layers > 0 && o.arch != Architecture::kDeepseekV3 && o.arch != Architecture::kGlm4Moe))
    return absl::InvalidArgumentError(absl::StrCat("mtp_layers=", o.mtp_layers, ": MTP layers are a DeepSeek-V3 / ",
                                                   "GLM-4.5 option (num_nextn_predict_layers), not ",
                                                   ArchitectureName(o.arch)));
  if (o.arch == Architecture::kDeepseekV3) {
    j["num_key_value_heads"] = o.heads;
    j["rope_theta"] = 10000.0;
    deepseek_style_moe();
    j["moe_layer_freq"] = 1;
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["q_lora_rank"] = o.q_lora_rank > 0 ? Json(o.q_lora_rank) : Json(nullptr);
    j["kv_lora_rank"] = o.kv_lora_rank;
    j["qk_nope_head_dim"] = o.qk_nope_head_dim;
    j["qk_rope_head_dim"] = o.qk_rope_head_dim;
    j["v_head_dim"] = o.v_head_dim;
    j["attention_bias"] = false;
  } else {
    j["num_key_value_heads"] = o.kv_heads;
    j["head_dim"] = o.head_dim;
    j["rope_theta"] = o.arch == Architecture::kLlama ? 500000.0 : 1000000.0;
    if (o.arch != Architecture::kQwen2) j["attention_bias"] = false;
    if (o.linear_bias) {
      if (o.arch != Architecture::kLlama)
        return absl::InvalidArgumentError("linear_bias (attention_bias + mlp_bias) is a Llama option");
      j["attention_bias"] = true;
      j["mlp_bias"] = true;
    }
    if (o.arch == Architecture::kGlm4Moe) {  // GLM-4.5's shape: qkv bias, QK norm, half-head RoPE, one shared expert
      j["attention_bias"] = true;
      j["use_qk_norm"] = true;
      j["partial_rotary_factor"] = 0.5;
      deepseek_style_moe();
    }
    if (o.arch == Architecture::kQwen3Moe) {
      j["num_experts"] = o.experts;
      j["num_experts_per_tok"] = o.topk;
      j["moe_intermediate_size"] = o.moe_ffn;
      j["decoder_sparse_step"] = 1;
      j["mlp_only_layers"] = Json::array();
      j["norm_topk_prob"] = true;
    }
  }
  if (o.quantization_config_json) {
    Json q = Json::parse(*o.quantization_config_json, nullptr, /*allow_exceptions=*/false);
    if (q.is_discarded() || !q.is_object()) return absl::InvalidArgumentError("quantization_config: not a JSON object");
    if (q.contains("quantization_config")) q = q.at("quantization_config");
    j["quantization_config"] = q;
  }
  std::string text = j.dump(2) + "\n";
  RETURN_IF_ERROR(ParseModelConfig(text, "generated config.json").status());
  return text;
}

absl::StatusOr<model::HfCheckpoint> GenerateSyntheticWeights(const ModelConfig& model, uint64_t seed, int threads) {
  ASSIGN_OR_RETURN(std::vector<model::HfTensorSpec> specs,
                   trainer_agent::HfTensorSpecs(model, model.num_nextn_predict_layers));
  model::HfCheckpoint ckpt;
  std::vector<Job> jobs;
  std::vector<std::pair<size_t, int64_t>> work;  // (job, chunk)
  for (const model::HfTensorSpec& s : specs) {
    ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(s.dtype, s.shape));
    Job job;
    job.dtype = s.dtype;
    job.data = t.data_as<std::byte>();
    job.numel = static_cast<int64_t>(t.nbytes() / ItemSize(s.dtype));
    uint64_t st = seed ^ Xxh3_64(std::as_bytes(std::span<const char>(s.name.data(), s.name.size())));
    job.seed = SplitMix64(st);
    job.mean = IsNormWeight(s.name) ? 1.0f : 0.0f;
    job.stddev = 0.02f;
    for (int64_t c = 0; c * kChunk < job.numel; ++c) work.emplace_back(jobs.size(), c);
    jobs.push_back(job);
    RETURN_IF_ERROR(ckpt.Add(s.name, std::move(t)));  // the buffer does not move
  }
  int n = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n = static_cast<int>(std::min<size_t>(static_cast<size_t>(n), std::max<size_t>(1, work.size())));
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < work.size(); i = next.fetch_add(1))
      FillChunk(jobs[work[i].first], work[i].second);
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  return ckpt;
}

absl::StatusOr<SyntheticModel> GenerateSyntheticModel(const SyntheticModelOptions& options, uint64_t seed,
                                                      int threads) {
  SyntheticModel m;
  ASSIGN_OR_RETURN(m.config_json, SyntheticConfigJson(options));
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(m.config_json, "generated config.json"));
  ASSIGN_OR_RETURN(m.weights, GenerateSyntheticWeights(m.config, seed, threads));
  return m;
}

absl::Status WriteHfModel(const SyntheticModel& model, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  for (const std::string& name : model.weights.Names()) {
    ASSIGN_OR_RETURN(TensorView v, model.weights.Get(name));
    RETURN_IF_ERROR(writer.Add(name, v));
  }
  RETURN_IF_ERROR(writer.Write(dir + "/model.safetensors"));
  const std::string path = dir + "/config.json";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << model.config_json;
  out.close();
  if (!out) return ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

namespace {

constexpr char kBenchSyncQuant[] = R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
 "config_groups": {"group_0": {"targets": ["Linear"],
   "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": true}}},
 "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*norm.*"]})";

}  // namespace

absl::StatusOr<std::string> EnsureBenchModel(const std::string& checkpoint, const std::string& work,
                                             const std::string& preset) {
  if (!checkpoint.empty()) return checkpoint;
  if (work.empty()) return absl::InvalidArgumentError("give --checkpoint DIR or --work DIR");
  const std::string dir = work + "/hf";
  if (!std::filesystem::exists(dir + "/config.json")) {
    std::printf("# generating the %s Qwen3-MoE (seed 7) into %s\n", preset.c_str(), dir.c_str());
    std::fflush(stdout);
    ASSIGN_OR_RETURN(SyntheticModelOptions opts, PresetOptions(preset, Architecture::kQwen3Moe));
    ASSIGN_OR_RETURN(SyntheticModel model, GenerateSyntheticModel(opts, 7));
    RETURN_IF_ERROR(WriteHfModel(model, dir));
  }
  return dir;
}

absl::StatusOr<ModelConfig> BenchModelConfig(const std::string& dir, const std::string& quant_config) {
  ASSIGN_OR_RETURN(std::string text, ReadTextFile(dir + "/config.json"));
  ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, dir + "/config.json"));
  config.quantization.reset();
  if (quant_config == "none") return config;
  std::string qtext = kBenchSyncQuant;
  if (!quant_config.empty()) {
    ASSIGN_OR_RETURN(qtext, ReadTextFile(quant_config));
  }
  ASSIGN_OR_RETURN(QuantizationConfig q, ParseQuantizationConfig(qtext, "quantization config"));
  RETURN_IF_ERROR(q.CheckInt4Supported());
  config.quantization = q;
  return config;
}

}  // namespace wsync::tools
