// ExpertMap: parsing and its refusals (each naming the values), the fit against a model, the
// pruned config.json, and PruneHfCheckpoint on a checkpoint whose rows say which expert they were.
#include "model/expert_map.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "model/testing/test_models.h"

namespace wsync::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ModelConfig MustParse(const char* json) {
  auto c = ParseModelConfig(json, "test config");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(ExpertMapTest, ParsesAndAnswersCompactIds) {
  auto m = ParseExpertMap(R"({"num_experts": 8, "layers": {"2": [7, 1, 4], "0": [0, 5, 2]}})", "map.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_experts, 8);
  EXPECT_EQ(m->kept(), 3);
  EXPECT_THAT(m->layers.at(2), ElementsAre(7, 1, 4));
  EXPECT_EQ(m->CompactId(2, 7), 0);
  EXPECT_EQ(m->CompactId(2, 4), 2);
  EXPECT_EQ(m->CompactId(2, 0), -1);
  EXPECT_EQ(m->CompactId(1, 0), -1);  // not in the map
  EXPECT_EQ(m->Canonical(), R"({"num_experts": 8, "layers": {"0": [0, 5, 2], "2": [7, 1, 4]}})");
  auto again = ParseExpertMap(m->Canonical(), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->layers, m->layers);
}

TEST(ExpertMapTest, RefusesMalformedMapsNamingTheValues) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[1, 2]", "must be a JSON object"},
      {"{", "not valid JSON"},
      {R"({"num_experts": 8, "layers": {"0": [1]}, "layer": {}})", "unknown field \"layer\""},
      {R"({"layers": {"0": [1]}})",
       "\"num_experts\" must be a positive integer (the trainer model's routed experts), "
       "and is missing"},
      {R"({"num_experts": 0, "layers": {"0": [1]}})", "not 0"},
      {R"({"num_experts": 8})", "\"layers\" must be a non-empty object"},
      {R"({"num_experts": 8, "layers": {}})", "\"layers\" must be a non-empty object"},
      {R"({"num_experts": 8, "layers": {"x1": [1]}})", "layer key \"x1\" is not a decimal layer index"},
      {R"({"num_experts": 8, "layers": {"-1": [1]}})", "layer key \"-1\""},
      {R"({"num_experts": 8, "layers": {"0": []}})", "layer 0: the kept experts must be a non-empty array"},
      {R"({"num_experts": 8, "layers": {"0": [1, 8]}})", "layer 0: expert id 8 is outside [0, 8)"},
      {R"({"num_experts": 8, "layers": {"0": [1, -2]}})", "expert id -2 is outside"},
      {R"({"num_experts": 8, "layers": {"0": [1, 1.5]}})", "expert id 1.5 is not an integer"},
      {R"({"num_experts": 8, "layers": {"3": [1, 4, 1]}})", "layer 3: expert 1 is kept twice"},
      {R"({"num_experts": 8, "layers": {"0": [1, 2], "2": [3]}})", "layer 2 keeps 1 experts, layer 0 2"},
  };
  for (const auto& [json, want] : cases) {
    auto m = ParseExpertMap(json, "map.json");
    ASSERT_FALSE(m.ok()) << json;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_THAT(m.status().message(), HasSubstr("map.json: ")) << json;
    EXPECT_THAT(m.status().message(), HasSubstr(want)) << json;
  }
  EXPECT_EQ(LoadExpertMap("/nonexistent/map.json").status().code(), absl::StatusCode::kNotFound);
}

TEST(ExpertMapTest, ChecksTheFitAgainstTheTrainerModel) {
  // Qwen3-MoE test model: 3 layers, layer 1 dense (mlp_only_layers), 8 experts, top-2.
  const ModelConfig moe = MustParse(testing::kQwen3MoeJson);
  auto fit = [&](const char* json) {
    auto m = ParseExpertMap(json, "map.json");
    EXPECT_TRUE(m.ok()) << m.status();
    return CheckExpertMapFits(*m, moe);
  };
  EXPECT_TRUE(fit(R"({"num_experts": 8, "layers": {"0": [3, 1], "2": [0, 7]}})").ok());
  EXPECT_THAT(fit(R"({"num_experts": 6, "layers": {"0": [3, 1], "2": [0, 5]}})").message(),
              HasSubstr("has num_experts 6, the model 8 routed experts"));
  EXPECT_THAT(fit(R"({"num_experts": 8, "layers": {"0": [3, 1]}})").message(),
              HasSubstr("does not list MoE layer(s) 2"));
  EXPECT_THAT(fit(R"({"num_experts": 8, "layers": {"0": [3, 1], "1": [1, 2], "2": [0, 7]}})").message(),
              HasSubstr("lists layer 1, which is not a MoE decoder layer"));
  EXPECT_THAT(fit(R"({"num_experts": 8, "layers": {"0": [3], "2": [0]}})").message(),
              HasSubstr("keeps 1 experts per layer, fewer than the 2 each token is routed to"));
  auto m = ParseExpertMap(R"({"num_experts": 8, "layers": {"0": [3, 1]}})", "m");
  ASSERT_TRUE(m.ok());
  EXPECT_THAT(CheckExpertMapFits(*m, MustParse(testing::kQwen3Json)).message(), HasSubstr("has no routed experts"));
}

// The pruned config of `config_json` by the map `map_json`, parsed.
ModelConfig PrunedConfig(const char* config_json, const char* map_json) {
  auto m = ParseExpertMap(map_json, "m");
  EXPECT_TRUE(m.ok()) << m.status();
  auto pruned = PrunedConfigJson(config_json, *m, "config.json");
  EXPECT_TRUE(pruned.ok()) << pruned.status();
  return MustParse(pruned.ok() ? pruned->c_str() : "{}");
}

TEST(ExpertMapTest, PrunedConfigsCarryTheKeptCountAndDropGroupsAndMtp) {
  const ModelConfig qc =
      PrunedConfig(testing::kQwen3MoeJson, R"({"num_experts": 8, "layers": {"0": [3, 1, 6], "2": [0, 7, 2]}})");
  EXPECT_EQ(qc.moe->num_experts, 3);
  EXPECT_EQ(qc.moe->num_experts_per_tok, 2);
  EXPECT_EQ(qc.hidden_size, 256);
  EXPECT_THAT(qc.moe->mlp_only_layers, ElementsAre(1));

  // DeepSeek test model: layer 0 dense, layers 1-2 MoE, 8 experts in 2 groups, one MTP layer.
  const ModelConfig dc =
      PrunedConfig(testing::kDeepseekJson, R"({"num_experts": 8, "layers": {"1": [4, 0, 5], "2": [1, 2, 3]}})");
  EXPECT_EQ(dc.moe->num_experts, 3);
  EXPECT_EQ(dc.moe->n_group, 1);
  EXPECT_EQ(dc.moe->topk_group, 1);
  EXPECT_EQ(dc.num_nextn_predict_layers, 0);
  EXPECT_EQ(dc.moe->num_shared_experts, 2);
  EXPECT_EQ(dc.moe->topk_method, "noaux_tc");

  // A map that does not fit is refused with the config's name.
  auto dm = ParseExpertMap(R"({"num_experts": 8, "layers": {"1": [4, 0, 5], "2": [1, 2, 3]}})", "m");
  ASSERT_TRUE(dm.ok());
  auto bad = PrunedConfigJson(testing::kQwen3MoeJson, *dm, "config.json");
  EXPECT_THAT(bad.status().message(), HasSubstr("config.json"));
  EXPECT_THAT(bad.status().message(), HasSubstr("does not list MoE layer(s) 0"));
}

// A tensor whose row r holds the value 100 * tag + r in every element (f32).
Tensor Rows(Shape shape, int tag) {
  auto t = Tensor::Empty(DType::kF32, shape);
  EXPECT_TRUE(t.ok());
  const int64_t rows = shape[0];
  const int64_t per = t->view().numel() / rows;
  float* p = t->data_as<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < per; ++i) p[r * per + i] = static_cast<float>(100 * tag + r);
  return std::move(*t);
}

float RowValue(const HfCheckpoint& c, const std::string& name, int64_t row) {
  auto v = c.Get(name);
  EXPECT_TRUE(v.ok()) << v.status();
  if (!v.ok()) return -1;
  const int64_t per = v->numel() / v->shape()[0];
  return v->data_as<float>()[row * per];
}

TEST(ExpertMapTest, PrunesACheckpointByTheMap) {
  const ModelConfig ds = MustParse(testing::kDeepseekJson);  // layers 1, 2 MoE; MTP layer 3
  auto m = ParseExpertMap(R"({"num_experts": 8, "layers": {"1": [6, 0], "2": [2, 5]}})", "m");
  ASSERT_TRUE(m.ok());
  HfCheckpoint hf;
  ASSERT_TRUE(hf.Add("model.embed_tokens.weight", Rows({4, 2}, 1)).ok());
  ASSERT_TRUE(hf.Add("model.layers.0.mlp.gate_proj.weight", Rows({4, 2}, 2)).ok());
  for (int l = 1; l <= 3; ++l) {
    ASSERT_TRUE(hf.Add(absl::StrCat("model.layers.", l, ".mlp.gate.weight"), Rows({8, 3}, 10 * l)).ok());
    ASSERT_TRUE(
        hf.Add(absl::StrCat("model.layers.", l, ".mlp.gate.e_score_correction_bias"), Rows({8}, 10 * l + 1)).ok());
    ASSERT_TRUE(hf.Add(absl::StrCat("model.layers.", l, ".mlp.shared_experts.up_proj.weight"), Rows({4, 2}, 3)).ok());
    for (int e = 0; e < 8; ++e)
      ASSERT_TRUE(
          hf.Add(absl::StrCat("model.layers.", l, ".mlp.experts.", e, ".down_proj.weight"), Rows({2, 4}, 1000 * l + e))
              .ok());
  }
  auto p = PruneHfCheckpoint(ds, *m, hf);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(
      p->Names(),
      ElementsAre("model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                  "model.layers.1.mlp.experts.0.down_proj.weight", "model.layers.1.mlp.experts.1.down_proj.weight",
                  "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight",
                  "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.2.mlp.experts.0.down_proj.weight",
                  "model.layers.2.mlp.experts.1.down_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
                  "model.layers.2.mlp.gate.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"));
  EXPECT_EQ(RowValue(*p, "model.layers.1.mlp.experts.0.down_proj.weight", 0), 100 * 1006);
  EXPECT_EQ(RowValue(*p, "model.layers.1.mlp.experts.1.down_proj.weight", 1), 100 * 1000 + 1);
  EXPECT_EQ(RowValue(*p, "model.layers.2.mlp.experts.0.down_proj.weight", 0), 100 * 2002);
  EXPECT_EQ(RowValue(*p, "model.layers.2.mlp.experts.1.down_proj.weight", 0), 100 * 2005);
  EXPECT_EQ(p->Get("model.layers.1.mlp.gate.weight")->shape(), (Shape{2, 3}));
  EXPECT_EQ(RowValue(*p, "model.layers.1.mlp.gate.weight", 0), 100 * 10 + 6);
  EXPECT_EQ(RowValue(*p, "model.layers.1.mlp.gate.weight", 1), 100 * 10 + 0);
  EXPECT_EQ(RowValue(*p, "model.layers.2.mlp.gate.e_score_correction_bias", 0), 100 * 21 + 2);
  EXPECT_EQ(RowValue(*p, "model.layers.2.mlp.gate.e_score_correction_bias", 1), 100 * 21 + 5);
  EXPECT_EQ(RowValue(*p, "model.layers.0.mlp.gate_proj.weight", 3), 100 * 2 + 3);

  // A router whose rows are not the map's experts is refused, naming it.
  HfCheckpoint wrong;
  ASSERT_TRUE(wrong.Add("model.layers.1.mlp.gate.weight", Rows({6, 3}, 1)).ok());
  auto w = PruneHfCheckpoint(ds, *m, wrong);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(), HasSubstr("\"model.layers.1.mlp.gate.weight\" is F32[6, 3]"));
}

}  // namespace
}  // namespace wsync::model
