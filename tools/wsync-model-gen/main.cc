// wsync-model-gen: write a random HuggingFace checkpoint (config.json + model.safetensors, bf16)
// of a supported architecture, for tests, demos and benchmarks.
//
//   wsync-model-gen --arch qwen3-moe --out DIR [--preset tiny|small|bench2g|bench8g] [--seed N]
//       [--hidden N --layers N --heads N --kv-heads N --head-dim N --ffn N --moe-ffn N --experts N
//        --topk N --vocab N --tie --linear-bias (llama: attention_bias + mlp_bias)]
//       [--q-lora N (0: none) --kv-lora N --qk-nope N --qk-rope N --v-head N --shared-experts N
//        --first-k-dense N]                                  (deepseek-v3)
//       [--quant-config FILE]   a compressed-tensors quantization_config (the object, or a
//                               config.json holding it) written into config.json
//
// Presets (tools/synth/synthetic_model.h): tiny (default; MBs), small (the default
// model's sizes), bench2g (~2 GB bf16), bench8g (>= 8 GB bf16). Size flags override the preset.
// Values are N(0, 0.02)-like (norm weights around 1), deterministic in --seed.
// Exit codes: 0 ok, 1 refused (the message names the field/value), 2 bad command line.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/default_model.h"
#include "tools/synth/synthetic_model.h"

namespace wsync::tools {
namespace {

int Run(int argc, char** argv) {
  CLI::App app{"wsync-model-gen: write a random HF checkpoint of a supported architecture"};
  std::string arch_name, out, preset = "tiny", quant_config;
  uint64_t seed = 1;
  int threads = 0;
  app.add_option("--arch", arch_name,
                 "llama, qwen2, qwen3, qwen3-moe, deepseek-v3 or glm4-moe");  // required unless --from-config
  app.add_option("--out", out, "output directory (created)")->required();
  app.add_option("--preset", preset, "tiny, small, bench2g or bench8g")->capture_default_str();
  app.add_option("--seed", seed, "random seed")->capture_default_str();
  app.add_option("-t,--threads", threads, "CPU threads (0 = all)");
  app.add_option("--quant-config", quant_config, "compressed-tensors quantization_config JSON file");
  struct Size {
    const char* flag;
    int64_t tools::SyntheticModelOptions::*field;
    const char* help;
    int64_t value = 0;
    CLI::Option* opt = nullptr;
  };
  Size sizes[] = {
      {"--hidden", &tools::SyntheticModelOptions::hidden, "hidden size"},
      {"--layers", &tools::SyntheticModelOptions::layers, "decoder layers"},
      {"--heads", &tools::SyntheticModelOptions::heads, "attention heads"},
      {"--kv-heads", &tools::SyntheticModelOptions::kv_heads, "key/value heads (query groups)"},
      {"--head-dim", &tools::SyntheticModelOptions::head_dim, "head dim"},
      {"--ffn", &tools::SyntheticModelOptions::ffn, "dense MLP width (intermediate_size)"},
      {"--moe-ffn", &tools::SyntheticModelOptions::moe_ffn, "expert width (moe_intermediate_size)"},
      {"--experts", &tools::SyntheticModelOptions::experts, "routed experts"},
      {"--topk", &tools::SyntheticModelOptions::topk, "experts per token"},
      {"--vocab", &tools::SyntheticModelOptions::vocab, "vocabulary size"},
      {"--q-lora", &tools::SyntheticModelOptions::q_lora_rank, "DeepSeek q_lora_rank (0: none)"},
      {"--kv-lora", &tools::SyntheticModelOptions::kv_lora_rank, "DeepSeek kv_lora_rank"},
      {"--qk-nope", &tools::SyntheticModelOptions::qk_nope_head_dim, "DeepSeek qk_nope_head_dim"},
      {"--qk-rope", &tools::SyntheticModelOptions::qk_rope_head_dim, "DeepSeek qk_rope_head_dim"},
      {"--v-head", &tools::SyntheticModelOptions::v_head_dim, "DeepSeek v_head_dim"},
      {"--shared-experts", &tools::SyntheticModelOptions::shared_experts, "DeepSeek n_shared_experts"},
      {"--first-k-dense", &tools::SyntheticModelOptions::first_k_dense, "DeepSeek first_k_dense_replace"},
      {"--mtp", &tools::SyntheticModelOptions::mtp_layers,
       "DeepSeek-V3 / GLM-4.5 num_nextn_predict_layers: MTP layers model.layers.{L+k}.*, weights included"},
  };
  for (Size& s : sizes) s.opt = app.add_option(s.flag, s.value, s.help);
  bool tie = false;
  app.add_flag("--tie", tie, "tie_word_embeddings");
  bool linear_bias = false;
  app.add_flag("--linear-bias", linear_bias, "llama: attention_bias and mlp_bias (megatron's --add-bias-linear)");
  std::string from_config;
  app.add_option("--from-config", from_config,
                 "Random weights for this HF config.json instead of --arch/--preset/sizes; \"default\" = the "
                 "embedded default model (src/common/default_model.h, with its INT4 quantization_config)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  };
  if (!from_config.empty()) {
    tools::SyntheticModel m;
    if (from_config == "default") {
      m.config_json = kDefaultModelConfigJson;
    } else {
      auto text = ReadTextFile(from_config);
      if (!text.ok()) return fail(text.status());
      m.config_json = *text;
    }
    auto cfg = ParseModelConfig(m.config_json, from_config);
    if (!cfg.ok()) return fail(cfg.status());
    m.config = *cfg;
    auto weights = tools::GenerateSyntheticWeights(m.config, seed, threads);
    if (!weights.ok()) return fail(weights.status());
    m.weights = std::move(*weights);
    if (absl::Status s = tools::WriteHfModel(m, out); !s.ok()) return fail(s);
    std::printf("wrote %s: %s from %s, %zu tensors, %.1f MiB, seed %llu\n", out.c_str(), m.config.architecture.c_str(),
                from_config.c_str(), m.weights.size(), static_cast<double>(m.weights.TotalBytes()) / (1 << 20),
                static_cast<unsigned long long>(seed));
    return 0;
  }
  if (arch_name.empty()) return fail(absl::InvalidArgumentError("--arch is required (or --from-config)"));
  auto arch = tools::ParseArchitectureFlag(arch_name);
  if (!arch.ok()) return fail(arch.status());
  auto options = tools::PresetOptions(preset, *arch);
  if (!options.ok()) return fail(options.status());
  for (const Size& s : sizes)
    if (s.opt->count() > 0) (*options).*(s.field) = s.value;
  if (tie) options->tie = true;
  if (linear_bias) options->linear_bias = true;
  if (!quant_config.empty()) {
    auto text = ReadTextFile(quant_config);
    if (!text.ok()) return fail(text.status());
    if (auto q = ParseQuantizationConfig(*text, quant_config); !q.ok()) return fail(q.status());
    options->quantization_config_json = *text;
  }
  const auto start = std::chrono::steady_clock::now();
  auto model = tools::GenerateSyntheticModel(*options, seed, threads);
  if (!model.ok()) return fail(model.status());
  const auto generated = std::chrono::steady_clock::now();
  if (absl::Status s = tools::WriteHfModel(*model, out); !s.ok()) return fail(s);
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  std::printf("%s\n", absl::StrFormat("wrote %s: %s (%s), %d tensors, %.1f MiB, seed %d, generated in %.2f s, "
                                      "written in %.2f s",
                                      out, model->config.architecture, preset, model->weights.size(),
                                      static_cast<double>(model->weights.TotalBytes()) / (1 << 20), seed,
                                      secs(start, generated), secs(generated, std::chrono::steady_clock::now()))
                          .c_str());
  return 0;
}

}  // namespace
}  // namespace wsync::tools

int main(int argc, char** argv) { return wsync::tools::Run(argc, argv); }
