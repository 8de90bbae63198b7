// INT4 target selection on the default model's ignore list, the quantized triplet against the
// kernel, the oracle ExpectedSentTensors, and the refusals.
#include "trainer_agent/quantize/quant_select.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "common/default_model.h"
#include "tools/synth/synthetic_model.h"
#include "tools/synth/testing/world.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::HasSubstr;

ModelConfig DefaultModel() { return *ParseModelConfig(kDefaultModelConfigJson, "default_model.h"); }

TEST(IsQuantTarget, DefaultModelQuantizesExactlyTheExperts) {
  const ModelConfig cfg = DefaultModel();
  ASSERT_TRUE(cfg.quantization.has_value());
  auto specs = HfTensorSpecs(cfg);
  ASSERT_TRUE(specs.ok());
  int targets = 0;
  for (const auto& s : *specs) {
    const bool expert = absl::StrContains(s.name, ".mlp.experts.");
    EXPECT_EQ(model::IsQuantTarget(s.name, s.shape, *cfg.quantization), expert) << s.name;
    targets += expert;
  }
  EXPECT_EQ(targets, 4 * 8 * 3);  // layers x experts x {gate, up, down}
  // The rules themselves: 2-D *.weight only, never the embedding, ignore list decides the rest.
  QuantizationConfig none = *cfg.quantization;
  none.ignore.clear();
  EXPECT_TRUE(model::IsQuantTarget("lm_head.weight", std::vector<int64_t>{4000, 512}, none));
  EXPECT_TRUE(model::IsQuantTarget("model.layers.0.mlp.gate.weight", std::vector<int64_t>{8, 512}, none));
  EXPECT_FALSE(model::IsQuantTarget("model.embed_tokens.weight", std::vector<int64_t>{4000, 512}, none));
  // an MTP layer's eh_proj: SGLang's NextN models hold it as a plain bf16 nn.Linear
  EXPECT_FALSE(model::IsQuantTarget("model.layers.61.eh_proj.weight", std::vector<int64_t>{512, 1024}, none));
  EXPECT_TRUE(model::IsQuantTarget("model.layers.61.self_attn.o_proj.weight", std::vector<int64_t>{512, 512}, none));
  EXPECT_FALSE(model::IsQuantTarget("model.norm.weight", std::vector<int64_t>{512}, none));
  EXPECT_FALSE(model::IsQuantTarget("model.layers.0.self_attn.q_proj.bias", std::vector<int64_t>{512, 1}, none));
  EXPECT_FALSE(model::IsQuantTarget("model.layers.0.mlp.gate.e_score_correction_bias", std::vector<int64_t>{8}, none));
  EXPECT_FALSE(model::IsQuantTarget("lm_head.weight", std::vector<int64_t>{4000, 512}, *cfg.quantization));
}

TEST(QuantizeHfTensor, TripletMatchesTheKernel) {
  const ModelConfig cfg = DefaultModel();
  auto model = tools::GenerateSyntheticWeights(cfg, 20261121, 2);
  ASSERT_TRUE(model.ok());
  const std::string name = "model.layers.2.mlp.experts.5.down_proj.weight";
  TensorView w = *model->Get(name);  // [512, 256]
  auto q =
      model::QuantizeHfTensor(name, w, *cfg.quantization, {.variant = kernels::QuantVariant::kQat, .num_threads = 2});
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->size(), 3u);
  EXPECT_EQ((*q)[0].name, "model.layers.2.mlp.experts.5.down_proj.weight_packed");
  EXPECT_EQ((*q)[0].view.dtype(), DType::kI32);
  EXPECT_EQ((*q)[0].view.shape(), (Shape{512, 32}));
  EXPECT_EQ((*q)[1].name, "model.layers.2.mlp.experts.5.down_proj.weight_scale");
  EXPECT_EQ((*q)[1].view.dtype(), DType::kBF16);
  EXPECT_EQ((*q)[1].view.shape(), (Shape{512, 2}));
  EXPECT_EQ((*q)[2].name, "model.layers.2.mlp.experts.5.down_proj.weight_shape");
  EXPECT_EQ((*q)[2].view.dtype(), DType::kI64);
  EXPECT_EQ((*q)[2].view.data_as<int64_t>()[0], 512);
  EXPECT_EQ((*q)[2].view.data_as<int64_t>()[1], 256);

  for (auto variant : {kernels::QuantVariant::kQat, kernels::QuantVariant::kSlime}) {
    Tensor packed = *Tensor::Empty(DType::kI32, Shape{512, 32});
    Tensor scales = *Tensor::Empty(DType::kBF16, Shape{512, 2});
    kernels::QuantizeOptions ko;
    ko.group_size = 128;
    ko.variant = variant;
    ASSERT_TRUE(kernels::QuantizeInt4(w, packed.mutable_view(), scales.mutable_view(), ko).ok());
    auto mine = model::QuantizeHfTensor(name, w, *cfg.quantization, {.variant = variant});
    ASSERT_TRUE(mine.ok());
    EXPECT_EQ(std::memcmp(packed.view().data(), (*mine)[0].view.data(), packed.nbytes()), 0);
    EXPECT_EQ(std::memcmp(scales.view().data(), (*mine)[1].view.data(), scales.nbytes()), 0);
  }
}

TEST(QuantizeHfTensor, RefusesUnsupportedSettingsAndShapes) {
  QuantizationConfig cfg = *DefaultModel().quantization;
  Tensor w = *Tensor::Zeros(DType::kBF16, Shape{64, 256});
  cfg.symmetric = false;
  auto r = model::QuantizeHfTensor("a.weight", w.view(), cfg);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(r.status().message(), HasSubstr("asymmetric"));
  cfg.symmetric = true;
  cfg.num_bits = 8;
  EXPECT_THAT(model::QuantizeHfTensor("a.weight", w.view(), cfg).status().message(), HasSubstr("num_bits 8"));
  cfg.num_bits = 4;
  cfg.actorder = "group";
  EXPECT_THAT(model::QuantizeHfTensor("a.weight", w.view(), cfg).status().message(), HasSubstr("act-order"));
  cfg.actorder.clear();

  Tensor odd = *Tensor::Zeros(DType::kBF16, Shape{64, 192});
  r = model::QuantizeHfTensor("model.layers.0.mlp.down_proj.weight", odd.view(), cfg);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("model.layers.0.mlp.down_proj.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("K=192 must be a multiple of 8 and of group_size 128"));
  Tensor f32 = *Tensor::Zeros(DType::kF32, Shape{64, 256});
  EXPECT_THAT(model::QuantizeHfTensor("x.weight", f32.view(), cfg).status().message(), HasSubstr("2-D BF16 or F16"));
  EXPECT_THAT(model::QuantizeHfTensor("x.bias", w.view(), cfg).status().message(), HasSubstr("not a *.weight"));
}

TEST(ExpectedSentTensors, DefaultModelTripletsForExpertsEverythingElseAsIs) {
  const ModelConfig cfg = DefaultModel();
  auto hf = tools::GenerateSyntheticWeights(cfg, 5, 2);
  ASSERT_TRUE(hf.ok());
  auto sent = ExpectedSentTensors(cfg, *hf, &*cfg.quantization, {.num_threads = 2});
  ASSERT_TRUE(sent.ok()) << sent.status();
  auto specs = HfTensorSpecs(cfg);
  const size_t targets = 4 * 8 * 3;
  EXPECT_EQ(sent->size(), specs->size() - targets + 3 * targets);
  std::map<std::string, const model::HfTensor*> by_name;
  for (const auto& t : *sent) by_name.emplace(t.name, &t);
  EXPECT_EQ(by_name.size(), sent->size());
  ASSERT_TRUE(by_name.count("model.layers.0.mlp.experts.0.gate_proj.weight_packed"));
  EXPECT_FALSE(by_name.count("model.layers.0.mlp.experts.0.gate_proj.weight"));
  const model::HfTensor* q = by_name.at("model.layers.0.self_attn.q_proj.weight");
  EXPECT_TRUE(q->aliases_input());
  EXPECT_EQ(q->view.data(), hf->Get("model.layers.0.self_attn.q_proj.weight")->data());
  EXPECT_TRUE(by_name.count("lm_head.weight"));

  auto plain = ExpectedSentTensors(cfg, *hf, nullptr);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->size(), specs->size());
}

TEST(ExpectedSentTensors, WidensTheExpertBiasAndRefusesStrangers) {
  auto m = tools::GenerateSyntheticModel(tools::testing::SmallOptions(Architecture::kDeepseekV3), 9, 2);
  ASSERT_TRUE(m.ok());
  // Rebuild the checkpoint with a bf16 e_score_correction_bias, an MTP layer and an unknown tensor.
  model::HfCheckpoint hf;
  const std::string bias = "model.layers.1.mlp.gate.e_score_correction_bias";
  for (const std::string& name : m->weights.Names()) {
    TensorView v = *m->weights.Get(name);
    if (name == bias) {
      Tensor b = *Tensor::Empty(DType::kBF16, v.shape());
      for (int64_t i = 0; i < v.numel(); ++i) b.data_as<uint16_t>()[i] = F32ToBF16(v.data_as<float>()[i]);
      ASSERT_TRUE(hf.Add(name, std::move(b)).ok());
    } else {
      ASSERT_TRUE(hf.Add(name, *Tensor::CopyOf(v)).ok());
    }
  }
  ASSERT_TRUE(hf.Add("model.layers.4.eh_proj.weight", *Tensor::Zeros(DType::kBF16, Shape{64, 128})).ok());
  auto sent = ExpectedSentTensors(m->config, hf, nullptr);
  ASSERT_TRUE(sent.ok()) << sent.status();
  for (const auto& t : *sent)
    if (t.name == bias) {
      EXPECT_EQ(t.view.dtype(), DType::kF32);
      EXPECT_EQ(t.view.data_as<float>()[3], BF16ToF32(hf.Get(bias)->data_as<uint16_t>()[3]));
    }
  ASSERT_TRUE(hf.Add("model.layers.0.self_attn.rotary_emb.inv_freq", *Tensor::Zeros(DType::kF32, Shape{4})).ok());
  auto bad = ExpectedSentTensors(m->config, hf, nullptr);
  EXPECT_THAT(bad.status().message(), HasSubstr("\"model.layers.0.self_attn.rotary_emb.inv_freq\" is not a tensor"));

  model::HfCheckpoint missing;
  auto none = ExpectedSentTensors(m->config, missing, nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
}

TEST(ExpectedSentTensors, FromADirectoryUsesTheConfigsQuantizationUnlessGiven) {
  auto o = tools::testing::SmallOptions(Architecture::kQwen3Moe);
  o.hidden = 128, o.moe_ffn = 128;  // K % 128 == 0 for every expert weight
  o.quantization_config_json = kDefaultModelConfigJson;
  auto m = tools::GenerateSyntheticModel(o, 12, 2);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string dir = ::testing::TempDir() + "/expected_from_dir";
  ASSERT_TRUE(tools::WriteHfModel(*m, dir).ok());
  auto quantized = ExpectedSentTensorsFromDir(dir, std::nullopt);
  ASSERT_TRUE(quantized.ok()) << quantized.status();
  auto specs = HfTensorSpecs(m->config);
  const size_t targets = 4 * 8 * 3;
  EXPECT_EQ(quantized->tensors.size(), specs->size() + 2 * targets);
  QuantizationConfig none = *m->config.quantization;
  none.ignore.push_back(*IgnoreRule::Parse("re:.*experts.*"));
  auto plain = ExpectedSentTensorsFromDir(dir, none);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->tensors.size(), specs->size());
  // Aliased tensors point into the mmap'ed checkpoint, which the result keeps alive.
  EXPECT_EQ(plain->tensors[0].view.data(), plain->hf.Get(plain->tensors[0].name)->data());
}

TEST(ExpectedSentTensors, TiedLmHeadInTheCheckpointIsNotSent) {
  auto o = tools::testing::SmallOptions(Architecture::kQwen2);
  o.tie = true;
  auto m = tools::GenerateSyntheticModel(o, 4, 2);
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(m->weights.Add("lm_head.weight", *Tensor::CopyOf(*m->weights.Get("model.embed_tokens.weight"))).ok());
  auto sent = ExpectedSentTensors(m->config, m->weights, nullptr);
  ASSERT_TRUE(sent.ok()) << sent.status();
  for (const auto& t : *sent) EXPECT_NE(t.name, "lm_head.weight");
}

}  // namespace
}  // namespace wsync::trainer_agent
