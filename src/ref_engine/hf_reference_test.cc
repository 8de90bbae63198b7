// Checks of the oracle itself (HfReferenceModel) and of ops.h, independent of EngineModel:
// closed-form values, invariances, and reductions of one architecture to another.
#include "ref_engine/hf_reference.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ref_engine/ops.h"
#include "ref_engine/testing/fixtures.h"

namespace wsync::ref_engine {
namespace {

using ::testing::HasSubstr;
using testing::MustParseConfig;
using testing::TensorMap;

TEST(Ops, DotMatchesDoubleSumForAllTails) {
  std::mt19937 rng(3);
  std::normal_distribution<float> d;
  for (int n = 0; n < 40; ++n) {
    std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    double want = 0;
    for (int i = 0; i < n; ++i) {
      a[static_cast<size_t>(i)] = d(rng);
      b[static_cast<size_t>(i)] = d(rng);
      want += static_cast<double>(a[static_cast<size_t>(i)]) * b[static_cast<size_t>(i)];
    }
    EXPECT_NEAR(Dot(a.data(), b.data(), n), want, 1e-5) << n;
  }
}

TEST(Ops, RmsNormSoftmaxSilu) {
  const float x[4] = {1, -2, 3, -4}, w[4] = {1, 1, 2, 0.5f};
  float y[4];
  RmsNorm(x, w, 4, 0.0, y);
  const float inv = 1.0f / std::sqrt(30.0f / 4);
  EXPECT_FLOAT_EQ(y[0], inv);
  EXPECT_FLOAT_EQ(y[2], 6 * inv);
  EXPECT_FLOAT_EQ(y[3], -2 * inv);
  float s[3] = {10, 10, 10 - std::log(2.0f)};
  Softmax(s, 3);
  EXPECT_NEAR(s[0], 0.4f, 1e-6);
  EXPECT_NEAR(s[2], 0.2f, 1e-6);
  EXPECT_FLOAT_EQ(Silu(0), 0);
  EXPECT_NEAR(Silu(2), 2 / (1 + std::exp(-2.0)), 1e-6);
}

TEST(Ops, RopeRotatesPairsAndIsRelative) {
  // Position 0 is the identity; position p rotates pair i by p * theta^(-2i/d).
  float x[4] = {1, 2, 3, 4};
  RopeRotateHalf(x, 4, 0, 10000);
  EXPECT_EQ(x[0], 1);
  EXPECT_EQ(x[3], 4);
  float h[4] = {1, 0, 0, 0};  // pair (x0, x2) at frequency 1
  RopeRotateHalf(h, 4, 3, 10000);
  EXPECT_NEAR(h[0], std::cos(3.0), 1e-6);
  EXPECT_NEAR(h[2], std::sin(3.0), 1e-6);
  float g[4] = {0, 0, 1, 0};  // interleaved: pair (x2, x3) at frequency 1/100
  RopeInterleaved(g, 4, 5, 10000);
  EXPECT_NEAR(g[2], std::cos(0.05), 1e-6);
  EXPECT_NEAR(g[3], std::sin(0.05), 1e-6);
  // q(p1) . k(p2) depends only on p1 - p2.
  std::mt19937 rng(1);
  std::normal_distribution<float> d;
  std::vector<float> q(16), k(16);
  for (auto& v : q) v = d(rng);
  for (auto& v : k) v = d(rng);
  auto score = [&](int pq, int pk) {
    std::vector<float> a = q, b = k;
    RopeRotateHalf(a.data(), 16, pq, 500);
    RopeRotateHalf(b.data(), 16, pk, 500);
    return Dot(a.data(), b.data(), 16);
  };
  EXPECT_NEAR(score(7, 3), score(4, 0), 1e-4);
  EXPECT_NEAR(score(20, 11), score(9, 0), 1e-4);
}

TEST(Ops, ReadFloatsConvertsAndRefusesInts) {
  const uint16_t bf[2] = {F32ToBF16(1.5f), F32ToBF16(-2.0f)};
  float out[2];
  ASSERT_TRUE(ReadFloats(TensorView(DType::kBF16, {2}, std::as_bytes(std::span(bf))), out, "x").ok());
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -2.0f);
  const int32_t ints[1] = {1};
  const absl::Status s = ReadFloats(TensorView(DType::kI32, {1}, std::as_bytes(std::span(ints))), out, "my.tensor");
  EXPECT_THAT(s.message(), HasSubstr("my.tensor: dtype I32 is not a float type"));
}

const char kLlama[] = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 77,
  "tie_word_embeddings": false})";

void Fill(TensorMap& m, const std::string& name, float v) {
  Tensor& t = m.Mutable(name);
  for (int64_t i = 0; i < t.view().numel(); ++i) t.data_as<uint16_t>()[i] = F32ToBF16(v);
}

// With o_proj and down_proj zero, every layer is the identity on the residual stream:
// logits = lm_head . RmsNorm(embed[token]) * final_norm, computed here by hand.
TEST(HfReference, ZeroBlocksReduceToEmbeddingAndHead) {
  const ModelConfig c = MustParseConfig(kLlama);
  TensorMap hf = testing::RandomHfModel(c, 4);
  for (int i = 0; i < 2; ++i) {
    Fill(hf, absl::StrCat("model.layers.", i, ".self_attn.o_proj.weight"), 0);
    Fill(hf, absl::StrCat("model.layers.", i, ".mlp.down_proj.weight"), 0);
  }
  absl::StatusOr<HfReferenceModel> m = HfReferenceModel::Create(c, hf.Lookup());
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<int32_t> tokens = {5, 76, 0};
  const std::vector<float> logits = *m->Logits(tokens);
  const Tensor& emb = hf.At("model.embed_tokens.weight");
  const Tensor& head = hf.At("lm_head.weight");
  const Tensor& norm = hf.At("model.norm.weight");
  for (size_t t = 0; t < tokens.size(); ++t) {
    double ss = 0;
    std::vector<double> x(64);
    for (int d = 0; d < 64; ++d) {
      x[static_cast<size_t>(d)] = BF16ToF32(emb.view().data_as<uint16_t>()[tokens[t] * 64 + d]);
      ss += x[static_cast<size_t>(d)] * x[static_cast<size_t>(d)];
    }
    const double inv = 1 / std::sqrt(ss / 64 + 1e-6);
    for (int v = 0; v < 77; ++v) {
      double want = 0;
      for (int d = 0; d < 64; ++d)
        want += x[static_cast<size_t>(d)] * inv * BF16ToF32(norm.view().data_as<uint16_t>()[d]) *
                BF16ToF32(head.view().data_as<uint16_t>()[v * 64 + d]);
      EXPECT_NEAR(logits[t * 77 + static_cast<size_t>(v)], want, 1e-4) << t << " " << v;
    }
  }
}

// Causality: the logits of a prefix do not depend on the tokens after it.
TEST(HfReference, CausalAndGenerateIsArgmax) {
  const ModelConfig c = MustParseConfig(kLlama);
  const TensorMap hf = testing::RandomHfModel(c, 8);
  absl::StatusOr<HfReferenceModel> m = HfReferenceModel::Create(c, hf.Lookup());
  ASSERT_TRUE(m.ok());
  const std::vector<float> a = *m->Logits({3, 9, 27});
  const std::vector<float> b = *m->Logits({3, 9, 27, 40, 41});
  ASSERT_EQ(a.size(), 3u * 77);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
  std::vector<float> c2 = *m->Logits({3, 9, 28});
  EXPECT_EQ(std::vector<float>(c2.begin(), c2.begin() + 2 * 77), std::vector<float>(a.begin(), a.begin() + 2 * 77));
  EXPECT_NE(c2, a);
  const std::vector<int32_t> gen = *m->Generate({3, 9, 27}, 2);
  ASSERT_EQ(gen.size(), 2u);
  const float* last = a.data() + 2 * 77;
  EXPECT_EQ(gen[0], std::max_element(last, last + 77) - last);
}

// Qwen2 with all biases zero is Llama with the same weights.
TEST(HfReference, Qwen2WithZeroBiasIsLlama) {
  const std::string q2 = R"({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 77,
    "tie_word_embeddings": false, "rms_norm_eps": 1e-6})";
  const ModelConfig cq = MustParseConfig(q2), cl = MustParseConfig(kLlama);
  TensorMap hf = testing::RandomHfModel(cq, 12);
  std::vector<float> with_bias = *HfReferenceModel::Create(cq, hf.Lookup())->Logits({1, 2, 3});
  for (int i = 0; i < 2; ++i)
    for (const char* b : {"q_proj.bias", "k_proj.bias", "v_proj.bias"})
      Fill(hf, absl::StrCat("model.layers.", i, ".self_attn.", b), 0);
  const std::vector<float> q = *HfReferenceModel::Create(cq, hf.Lookup())->Logits({1, 2, 3});
  const std::vector<float> l = *HfReferenceModel::Create(cl, hf.Lookup())->Logits({1, 2, 3});
  EXPECT_EQ(q, l);
  EXPECT_NE(q, with_bias);
}

// A Qwen3-MoE whose experts are all equal (renormalized top-k weights sum to 1) is the dense
// Qwen3 model with that MLP.
TEST(HfReference, MoeWithEqualExpertsIsDense) {
  const std::string moe = R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
    "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true,
    "vocab_size": 77, "tie_word_embeddings": false})";
  const std::string dense = R"({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
    "vocab_size": 77, "tie_word_embeddings": false})";
  const ModelConfig cm = MustParseConfig(moe), cd = MustParseConfig(dense);
  TensorMap hf = testing::RandomHfModel(cm, 21);
  for (int i = 0; i < 2; ++i) {
    const std::string m = absl::StrCat("model.layers.", i, ".mlp.");
    for (const char* p : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}) {
      for (int e = 1; e < 4; ++e)
        hf.Put(absl::StrCat(m, "experts.", e, ".", p), *Tensor::CopyOf(hf.At(absl::StrCat(m, "experts.0.", p)).view()));
      hf.Put(m + p, *Tensor::CopyOf(hf.At(absl::StrCat(m, "experts.0.", p)).view()));
    }
  }
  const std::vector<float> a = *HfReferenceModel::Create(cm, hf.Lookup())->Logits({1, 2, 3, 4});
  const std::vector<float> b = *HfReferenceModel::Create(cd, hf.Lookup())->Logits({1, 2, 3, 4});
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4) << i;
}

TEST(HfReference, ErrorsNameTheTensor) {
  const ModelConfig c = MustParseConfig(kLlama);
  TensorMap hf = testing::RandomHfModel(c, 4);
  hf.Erase("model.layers.1.mlp.up_proj.weight");
  absl::Status s = HfReferenceModel::Create(c, hf.Lookup()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.1.mlp.up_proj.weight"));
  hf.Put("model.layers.1.mlp.up_proj.weight", *Tensor::Zeros(DType::kBF16, {96, 63}));
  s = HfReferenceModel::Create(c, hf.Lookup()).status();
  EXPECT_THAT(s.message(), HasSubstr("model.layers.1.mlp.up_proj.weight has shape [96, 63], want [96, 64]"));
  hf.Put("model.layers.1.mlp.up_proj.weight", *Tensor::Zeros(DType::kBF16, {96, 64}));
  absl::StatusOr<HfReferenceModel> m = HfReferenceModel::Create(c, hf.Lookup());
  ASSERT_TRUE(m.ok());
  EXPECT_THAT(m->Logits({77}).status().message(), HasSubstr("token 77 at position 0 is outside [0, 77)"));
  EXPECT_EQ(m->Logits({}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync::ref_engine
