#include "engine_side/checkpoint.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine_model/engine_weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ref_engine/testing/fixtures.h"

namespace wsync::engine_side {

using engine_model::EngineRank;
namespace {

using ref_engine::testing::MustParseConfig;
using ref_engine::testing::TensorMap;
using ::testing::HasSubstr;

constexpr char kInt4Qwen3[] = R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "intermediate_size": 256, "vocab_size": 250, "max_position_embeddings": 64, "torch_dtype": "bfloat16",
  "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "strategy": "group", "group_size": 32, "symmetric": true, "dynamic": false}}},
    "ignore": ["lm_head", "re:.*embed_tokens.*"]}})";

std::string WriteDir(const std::string& name, const TensorMap& tensors, int files = 2) {
  const std::string dir = ref_engine::testing::FreshTempDir(name);
  std::vector<SafetensorsWriter> w(static_cast<size_t>(files));
  size_t i = 0;
  for (const auto& [n, t] : tensors.all()) EXPECT_TRUE(w[i++ % w.size()].Add(n, t.view()).ok());
  for (size_t f = 0; f < w.size(); ++f)
    EXPECT_TRUE(w[f].Write(absl::StrCat(dir, "/model-0000", f + 1, ".safetensors")).ok());
  return dir;
}

// The engine memory of one rank loaded from `dir`.
absl::StatusOr<std::unique_ptr<engine_model::OwnedEngineWeights>> Load(const ModelConfig& c, int tp, int r,
                                                                       const std::string& dir, CheckpointStats* stats) {
  const QuantizationConfig* q = c.quantization ? &*c.quantization : nullptr;
  ASSIGN_OR_RETURN(engine_model::EngineLayout layout, engine_model::EngineLayout::Create(c, q, {tp, r, 1}));
  ASSIGN_OR_RETURN(std::unique_ptr<engine_model::OwnedEngineWeights> w,
                   engine_model::OwnedEngineWeights::Allocate(layout));
  CheckpointOptions o;
  o.num_threads = 2;
  ASSIGN_OR_RETURN(*stats, LoadCheckpoint(dir, layout, w->weights(), o));
  return w;
}

void ExpectSameBytes(const engine_model::EngineWeights& a, const ref_engine::testing::TensorMap& b) {
  ASSERT_EQ(a.size(), b.all().size());
  for (const engine_model::EngineBuffer& buf : a.buffers()) {
    ASSERT_TRUE(b.Has(buf.name)) << buf.name;
    const Tensor& t = b.At(buf.name);
    ASSERT_EQ(buf.nbytes, t.nbytes()) << buf.name;
    EXPECT_EQ(std::memcmp(buf.data, t.view().bytes().data(), buf.nbytes), 0) << buf.name;
  }
}

TEST(CheckpointTest, Int4SentFormAndBf16QuantizedAtLoadGiveTheSyncedBytes) {
  const ModelConfig c = MustParseConfig(kInt4Qwen3);
  const TensorMap hf = ref_engine::testing::RandomHfModel(c, 5);
  auto q = ref_engine::testing::QuantizeHf(c, hf);
  ASSERT_TRUE(q.ok()) << q.status();
  TensorMap bf16 = ref_engine::testing::RandomHfModel(c, 5);
  Tensor inv = *Tensor::Zeros(DType::kF32, {16});
  bf16.Put("model.layers.0.self_attn.rotary_emb.inv_freq", std::move(inv));
  const std::string sent_dir = WriteDir("ckpt-sent", q->sent, 3), bf16_dir = WriteDir("ckpt-bf16", bf16);
  for (int tp : {1, 2}) {
    for (int r = 0; r < tp; ++r) {
      EngineRank er;
      er.tp_size = tp;
      er.tp_rank = r;
      auto expected = ref_engine::testing::EngineParamsForRank(c, er, q->sent);  // what a sync installs
      ASSERT_TRUE(expected.ok()) << expected.status();
      CheckpointStats s1, s2;
      auto a = Load(c, tp, r, sent_dir, &s1);
      ASSERT_TRUE(a.ok()) << a.status();
      ExpectSameBytes((*a)->weights(), *expected);
      EXPECT_EQ(s1.files, 3);
      EXPECT_EQ(s1.quantized, 0);
      auto b = Load(c, tp, r, bf16_dir, &s2);
      ASSERT_TRUE(b.ok()) << b.status();
      ExpectSameBytes((*b)->weights(), *expected);
      EXPECT_EQ(s2.quantized, 2 * 7);  // q, k, v, o, gate, up, down per layer
      EXPECT_EQ(s2.skipped, 1);
    }
  }
}

TEST(CheckpointTest, RefusesUnknownMissingAndMismatchedTensors) {
  const ModelConfig c = MustParseConfig(kInt4Qwen3);
  ModelConfig bf16c = c;
  bf16c.quantization.reset();
  const TensorMap hf = ref_engine::testing::RandomHfModel(c, 6);
  auto q = ref_engine::testing::QuantizeHf(c, hf);
  ASSERT_TRUE(q.ok());
  CheckpointStats s;

  TensorMap extra = ref_engine::testing::RandomHfModel(c, 6);
  extra.Put("model.layers.0.mlp.bogus.weight", *Tensor::Zeros(DType::kBF16, {2, 2}));
  auto r = Load(bf16c, 1, 0, WriteDir("ckpt-extra", extra), &s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("1 tensor(s) the qwen3 engine layout does not know: "
                                              "model.layers.0.mlp.bogus.weight"));

  TensorMap missing = ref_engine::testing::RandomHfModel(c, 6);
  missing.Erase("model.layers.1.mlp.down_proj.weight");
  r = Load(bf16c, 1, 0, WriteDir("ckpt-missing", missing), &s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("model.layers.1.mlp.down_proj"));

  r = Load(bf16c, 1, 0, WriteDir("ckpt-int4-for-bf16", q->sent), &s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("is INT4 but the engine serves"));

  TensorMap f32 = ref_engine::testing::RandomHfModel(c, 6);
  f32.Put("model.norm.weight", *Tensor::Zeros(DType::kF32, {128}));
  r = Load(bf16c, 1, 0, WriteDir("ckpt-dtype", f32), &s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));

  const std::string empty = ref_engine::testing::FreshTempDir("ckpt-empty");
  r = Load(bf16c, 1, 0, empty, &s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("no *.safetensors"));
}

}  // namespace
}  // namespace wsync::engine_side
