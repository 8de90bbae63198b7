// Synthetic HF models: every preset parses, tensors match the config, values are deterministic
// and of sane scale, files round-trip.
#include "tools/synth/synthetic_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "tools/synth/testing/world.h"
#include "trainer_agent/convert/hf_convert.h"

namespace wsync::tools {
namespace {

using ::testing::HasSubstr;

constexpr Architecture kArchs[] = {Architecture::kLlama, Architecture::kQwen2, Architecture::kQwen3,
                                   Architecture::kQwen3Moe, Architecture::kDeepseekV3};

TEST(Synthetic, EveryPresetAndArchitectureGivesAValidConfig) {
  for (const char* preset : {"tiny", "small", "bench2g", "bench8g"}) {
    for (Architecture arch : kArchs) {
      auto o = PresetOptions(preset, arch);
      ASSERT_TRUE(o.ok());
      auto json = SyntheticConfigJson(*o);
      ASSERT_TRUE(json.ok()) << preset << " " << ArchitectureName(arch) << ": " << json.status();
      auto cfg = ParseModelConfig(*json, "c");
      ASSERT_TRUE(cfg.ok());
      EXPECT_EQ(cfg->arch, arch);
      EXPECT_NE(cfg->vocab_size % 128, 0) << preset;
      // INT4 (G = 128) and Marlin (N % 64) constraints hold for every 2-D weight but the embedding.
      auto specs = trainer_agent::HfTensorSpecs(*cfg);
      ASSERT_TRUE(specs.ok());
      int64_t bytes = 0;
      for (const auto& s : *specs) {
        bytes += *NumBytes(s.dtype, s.shape);
        if (s.shape.size() != 2 || absl::StrContains(s.name, "embed_tokens") || s.name == "lm_head.weight" ||
            absl::EndsWith(s.name, "mlp.gate.weight"))  // [E, H] routers stay bf16
          continue;
        EXPECT_EQ(s.shape[1] % 128, 0) << preset << " " << s.name << " " << ShapeToString(s.shape);
        EXPECT_EQ(s.shape[0] % 64, 0) << preset << " " << s.name << " " << ShapeToString(s.shape);
      }
      if (std::string(preset) == "bench2g") {
        EXPECT_GT(bytes, int64_t{1800} << 20) << ArchitectureName(arch);
        EXPECT_LT(bytes, int64_t{2300} << 20) << ArchitectureName(arch);
      }
      if (std::string(preset) == "bench8g") {  // the issue's "at least 8 GB of weights", not much more
        EXPECT_GE(bytes, int64_t{8'000'000'000}) << ArchitectureName(arch);
        EXPECT_LT(bytes, int64_t{9'000'000'000}) << ArchitectureName(arch);
      }
    }
  }
  EXPECT_THAT(PresetOptions("huge", Architecture::kLlama).status().message(), HasSubstr("unknown preset \"huge\""));
  EXPECT_THAT(ParseArchitectureFlag("gpt2").status().message(), HasSubstr("unknown architecture \"gpt2\""));
  EXPECT_EQ(*ParseArchitectureFlag("qwen3_moe"), Architecture::kQwen3Moe);
}

TEST(Synthetic, WeightsAreDeterministicWhateverTheThreadCount) {
  auto o = testing::SmallOptions(Architecture::kDeepseekV3);
  auto a = GenerateSyntheticModel(o, 7, 1);
  auto b = GenerateSyntheticModel(o, 7, 3);
  auto c = GenerateSyntheticModel(o, 8, 2);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_EQ(a->weights.Names(), b->weights.Names());
  bool any_diff = false;
  for (const std::string& name : a->weights.Names()) {
    TensorView x = *a->weights.Get(name), y = *b->weights.Get(name), z = *c->weights.Get(name);
    ASSERT_EQ(std::memcmp(x.data(), y.data(), x.nbytes()), 0) << name;
    any_diff = any_diff || std::memcmp(x.data(), z.data(), x.nbytes()) != 0;
  }
  EXPECT_TRUE(any_diff);
}

TEST(Synthetic, ValuesHaveSaneScaleAndDtypes) {
  auto m = GenerateSyntheticModel(testing::SmallOptions(Architecture::kDeepseekV3), 11, 2);
  ASSERT_TRUE(m.ok());
  auto stats = [](const TensorView& v) {
    double sum = 0, sq = 0;
    const int64_t n = v.numel();
    for (int64_t i = 0; i < n; ++i) {
      double x;
      if (v.dtype() == DType::kF32) {
        float f;
        std::memcpy(&f, static_cast<const char*>(v.data()) + 4 * i, 4);
        x = f;
      } else {
        uint16_t b;
        std::memcpy(&b, static_cast<const char*>(v.data()) + 2 * i, 2);
        x = BF16ToF32(b);
      }
      sum += x;
      sq += x * x;
    }
    const double mean = sum / n;
    return std::pair<double, double>(mean, std::sqrt(sq / n - mean * mean));
  };
  auto [wm, ws] = stats(*m->weights.Get("model.layers.1.mlp.experts.3.up_proj.weight"));
  EXPECT_NEAR(wm, 0.0, 0.003);
  EXPECT_NEAR(ws, 0.02, 0.002);
  auto [nm, ns] = stats(*m->weights.Get("model.layers.0.input_layernorm.weight"));
  EXPECT_NEAR(nm, 1.0, 0.01);
  EXPECT_LT(ns, 0.03);
  TensorView bias = *m->weights.Get("model.layers.2.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(bias.dtype(), DType::kF32);
  EXPECT_EQ(m->weights.Get("model.embed_tokens.weight")->dtype(), DType::kBF16);
}

TEST(Synthetic, WritesAReadableCheckpointWithTheQuantizationConfig) {
  auto o = testing::SmallOptions(Architecture::kQwen3Moe);
  o.quantization_config_json = R"({"quantization_config": {"quant_method": "compressed-tensors",
      "format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights":
      {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": true}}},
      "ignore": ["lm_head"]}})";
  auto m = GenerateSyntheticModel(o, 3, 2);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->config.quantization.has_value());
  EXPECT_EQ(m->config.quantization->group_size, 32);
  const std::string dir = ::testing::TempDir() + "/synthetic_write";
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(WriteHfModel(*m, dir).ok());
  auto cfg = LoadModelConfig(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_TRUE(cfg->quantization.has_value());
  auto ckpt = model::HfCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ(ckpt->Names(), m->weights.Names());
  for (const std::string& name : ckpt->Names())
    ASSERT_EQ(std::memcmp(ckpt->Get(name)->data(), m->weights.Get(name)->data(), m->weights.Get(name)->nbytes()), 0);

  o.quantization_config_json = "[1]";
  EXPECT_FALSE(SyntheticConfigJson(o).ok());
}

TEST(HfCheckpoint, RefusesDuplicatesAcrossFilesAndMissingDirectories) {
  EXPECT_EQ(model::HfCheckpoint::Open("/nonexistent/wsync").status().code(), absl::StatusCode::kNotFound);
  const std::string dir = ::testing::TempDir() + "/ckpt_dup";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  EXPECT_THAT(model::HfCheckpoint::Open(dir).status().message(), HasSubstr("no *.safetensors files"));
  Tensor t = *Tensor::Zeros(DType::kBF16, Shape{2});
  SafetensorsWriter w;
  ASSERT_TRUE(w.Add("a.weight", t.view()).ok());
  ASSERT_TRUE(w.Write(dir + "/model-00001-of-00002.safetensors").ok());
  ASSERT_TRUE(w.Write(dir + "/model-00002-of-00002.safetensors").ok());
  EXPECT_THAT(model::HfCheckpoint::Open(dir).status().message(), HasSubstr("tensor \"a.weight\" is in both"));
}

// MTP layers exist for DeepSeek-V3 and GLM-4.5 only: --mtp on another architecture, or a negative
// count, is refused naming the option and the architecture, and makes no config.
TEST(Synthetic, MtpLayersAreRefusedWhereTheArchitectureHasNone) {
  for (Architecture a : {Architecture::kLlama, Architecture::kQwen3, Architecture::kQwen3Moe}) {
    SyntheticModelOptions o = testing::SmallOptions(a);
    o.mtp_layers = 1;
    auto json = SyntheticConfigJson(o);
    ASSERT_FALSE(json.ok()) << ArchitectureName(a);
    EXPECT_EQ(json.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(json.status().message(), HasSubstr("mtp_layers=1"));
    EXPECT_THAT(json.status().message(), HasSubstr(std::string(ArchitectureName(a))));
  }
  SyntheticModelOptions neg = testing::SmallOptions(Architecture::kDeepseekV3);
  neg.mtp_layers = -1;
  EXPECT_FALSE(SyntheticConfigJson(neg).ok());
  for (Architecture a : {Architecture::kDeepseekV3, Architecture::kGlm4Moe}) {
    SyntheticModelOptions o = testing::SmallOptions(a);
    o.mtp_layers = 1;
    auto json = SyntheticConfigJson(o);
    ASSERT_TRUE(json.ok()) << json.status();
    EXPECT_THAT(*json, HasSubstr("\"num_nextn_predict_layers\": 1"));
  }
}

}  // namespace
}  // namespace wsync::tools
