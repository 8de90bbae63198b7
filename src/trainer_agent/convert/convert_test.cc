// Megatron <-> HF conversion: every architecture x every supported layout, round trip HF ->
// shards -> simulated gathers -> HF compared bit for bit; plus the individual rules (plan order,
// expert ids, PP offsets, tied embeddings, vocab padding, refusals).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tools/synth/reassemble.h"
#include "tools/synth/testing/world.h"
#include "trainer_agent/convert/hf_convert.h"
#include "trainer_agent/convert/megatron_param.h"
#include "trainer_agent/convert/shard_layout.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::HasSubstr;
using tools::testing::BuildWorld;
using tools::testing::Parallel;
using tools::testing::SmallModel;
using tools::testing::SmallOptions;
using tools::testing::World;

constexpr uint64_t kSeed = 20261121;

struct ModelCase {
  const char* name;
  Architecture arch;
  bool tie = false;
  bool q_lora = true;           // DeepSeek-V3
  bool mlp_only_layer = false;  // Qwen3-MoE with layer 1 dense (mlp_only_layers: [1])
  bool linear_bias = false;     // Llama with attention_bias + mlp_bias (megatron's --add-bias-linear)
  int64_t mtp = 0;              // MTP layers trained and synced (num_nextn_predict_layers = mtp_num_layers)
};

const ModelCase kModels[] = {
    {"llama", Architecture::kLlama},
    {"llama_tied", Architecture::kLlama, true},
    {"llama_linear_bias", Architecture::kLlama, false, true, false, true},
    {"qwen2", Architecture::kQwen2},
    {"qwen2_tied", Architecture::kQwen2, true},
    {"qwen3", Architecture::kQwen3},
    {"qwen3_tied", Architecture::kQwen3, true},
    {"qwen3_moe", Architecture::kQwen3Moe},
    {"qwen3_moe_mlp_only_layer", Architecture::kQwen3Moe, false, true, true},
    {"deepseek_v3", Architecture::kDeepseekV3},
    {"deepseek_v3_no_q_lora", Architecture::kDeepseekV3, false, false},
    {"glm4_moe", Architecture::kGlm4Moe},
    {"deepseek_v3_mtp", Architecture::kDeepseekV3, false, true, false, false, 1},
    {"glm4_moe_mtp", Architecture::kGlm4Moe, false, true, false, false, 1},
};

struct LayoutCase {
  const char* name;
  int tp, pp, ep, etp, dp;
  std::vector<int64_t> layers_per_stage;
  int cp = 1;
  int vpp = 1;
  std::vector<int64_t> layers_per_chunk = {};
  bool account_for_embedding_and_loss = false;
};

// The supported layouts, the RANKS.md caution layout (ep_rank == dp_rank), an uneven PP split and CP.
const LayoutCase kLayouts[] = {
    {"tp2_ep2_etp1", 2, 1, 2, 1, 1, {}},
    {"tp2_ep2_etp2_pp2", 2, 2, 2, 2, 2, {}},
    {"tp1_ep4", 1, 1, 4, 1, 4, {}},
    {"tp4", 4, 1, 1, 4, 1, {}},
    {"tp2_etp2_ep2_dp2", 2, 1, 2, 2, 2, {}},
    {"pp2_uneven_1_3", 1, 2, 2, 1, 2, {1, 3}},
    {"tp2_cp2_ep2_etp1", 2, 1, 2, 1, 1, {}, 2},  // CP ranks hold copies; the expert grid folds CP into EP
    // virtual pipeline: Megatron's even interleaving, an explicit split with an empty chunk (a
    // custom --pipeline-model-parallel-layout), and the embedding and loss taking layers' places
    {"tp2_pp2_vpp2_ep2", 2, 2, 2, 1, 1, {}, 1, 2},
    {"pp2_vpp2_chunks_0_2_1_1", 1, 2, 2, 1, 2, {}, 1, 2, {0, 2, 1, 1}},
    {"pp3_account_embedding_loss", 1, 3, 2, 1, 2, {}, 1, 1, {}, true},
};

bool IsMoe(Architecture a) {
  return a == Architecture::kQwen3Moe || a == Architecture::kDeepseekV3 || a == Architecture::kGlm4Moe;
}

absl::StatusOr<tools::SyntheticModel> MakeModel(const ModelCase& mc, uint64_t seed) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(mc.arch);
  o.tie = mc.tie;
  o.linear_bias = mc.linear_bias;
  o.mtp_layers = mc.mtp;
  if (!mc.q_lora) o.q_lora_rank = 0;
  if (!mc.mlp_only_layer) return tools::testing::SmallModel(o, seed);
  ASSIGN_OR_RETURN(std::string json, tools::SyntheticConfigJson(o));
  const std::string patched =
      absl::StrReplaceAll(json, {{"\"mlp_only_layers\": []", "\"mlp_only_layers\": [\n    1\n  ]"}});
  if (patched == json) return absl::InternalError("mlp_only_layers not found in the generated config");
  tools::SyntheticModel m;
  m.config_json = patched;
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(patched, "patched"));
  ASSIGN_OR_RETURN(m.weights, tools::GenerateSyntheticWeights(m.config, seed, 2));
  return m;
}

SourceParallel ParallelFor(const LayoutCase& lc, const ModelCase& mc) {
  const Architecture arch = mc.arch;
  // Dense models have no EP: keep the TP / PP / DP / CP part of the layout.
  SourceParallel p = IsMoe(arch)
                         ? tools::testing::Parallel(lc.tp, lc.pp, lc.ep, lc.etp, lc.dp, lc.layers_per_stage, lc.cp)
                         : tools::testing::Parallel(lc.tp, lc.pp, 1, lc.tp, lc.dp, lc.layers_per_stage, lc.cp);
  p.vpp = lc.vpp;
  p.layers_per_chunk = lc.layers_per_chunk;
  p.account_for_embedding_in_pipeline_split = p.account_for_loss_in_pipeline_split = lc.account_for_embedding_and_loss;
  p.mtp_num_layers = mc.mtp;
  return p;
}

class RoundTripTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(RoundTripTest, GatheredTensorsEqualTheHfCheckpointBitForBit) {
  const ModelCase& mc = kModels[std::get<0>(GetParam())];
  const LayoutCase& lc = kLayouts[std::get<1>(GetParam())];
  const uint64_t seed = kSeed + static_cast<uint64_t>(std::get<0>(GetParam()) * 16 + std::get<1>(GetParam()));
  SCOPED_TRACE(absl::StrCat(mc.name, " / ", lc.name, " / seed ", seed));
  auto model = MakeModel(mc, seed);
  ASSERT_TRUE(model.ok()) << model.status();
  auto world = tools::testing::BuildWorld(*model, ParallelFor(lc, mc));
  ASSERT_TRUE(world.ok()) << world.status();

  auto report = tools::VerifyAgainstHf(model->config, world->layout, world->parallel, world->Lookup(), model->weights);
  ASSERT_TRUE(report.ok()) << report.status();
  auto specs = HfTensorSpecs(model->config, mc.mtp);
  ASSERT_TRUE(specs.ok());
  EXPECT_EQ(report->hf_tensors, static_cast<int64_t>(specs->size()));
  EXPECT_EQ(report->hf_bytes, model->weights.TotalBytes());

  // Every rank file matches its plan (what DirSource::OpenRank checks), and ranks that differ
  // only in dp / edp hold identical bytes.
  for (const auto& [rank, tensors] : world->ranks) {
    auto plan = PlanRank(model->config, world->layout, world->parallel, rank);
    ASSERT_TRUE(plan.ok());
    std::vector<std::pair<std::string, TensorView>> named;
    for (const tools::RankTensor& t : tensors) named.emplace_back(t.param.local_name, t.view);
    EXPECT_TRUE(BindToPlan(*plan, named, absl::StrCat("rank ", rank)).ok());
    const DenseCoord d = world->layout.Dense(rank);
    const ExpertCoord e = world->layout.Expert(rank);
    for (const auto& [other, other_tensors] : world->ranks) {
      if (other <= rank) continue;
      const DenseCoord d2 = world->layout.Dense(other);
      const ExpertCoord e2 = world->layout.Expert(other);
      if (d2.tp != d.tp || d2.pp != d.pp || e2.ep != e.ep || e2.etp != e.etp) continue;  // dp, cp, edp differ
      ASSERT_EQ(other_tensors.size(), tensors.size());
      for (size_t i = 0; i < tensors.size(); ++i)
        ASSERT_EQ(std::memcmp(tensors[i].view.data(), other_tensors[i].view.data(), tensors[i].view.nbytes()), 0)
            << "ranks " << rank << " and " << other << " differ in " << tensors[i].param.local_name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllArchitecturesAllLayouts, RoundTripTest,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kModels))),
                                            ::testing::Range(0, static_cast<int>(std::size(kLayouts)))),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return absl::StrCat(kModels[std::get<0>(info.param)].name, "__",
                                               kLayouts[std::get<1>(info.param)].name);
                         });

// A corrupted shard must be caught by the verification (the round-trip test can fail).
TEST(RoundTrip, DetectsAFlippedBit) {
  auto model = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kQwen3Moe), kSeed);
  ASSERT_TRUE(model.ok());
  auto world = tools::testing::BuildWorld(*model, tools::testing::Parallel(2, 1, 2, 1, 1));
  ASSERT_TRUE(world.ok());
  for (tools::RankTensor& t : world->ranks[1])
    if (t.param.local_name == "decoder.layers.1.mlp.experts.linear_fc2.weight3") {
      EXPECT_EQ(t.owned.nbytes(), 0u);  // ETP 1: the shard is the HF tensor itself, not copied
      t.owned = *Tensor::CopyOf(t.view);
      t.owned.data_as<uint8_t>()[5] ^= 1;
      t.view = t.owned.view();
    }
  auto report = tools::VerifyAgainstHf(model->config, world->layout, world->parallel, world->Lookup(), model->weights);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), absl::StatusCode::kDataLoss);
  // EP rank 1 owns experts 4..7; local expert 3 is global expert 7.
  EXPECT_THAT(report.status().message(), HasSubstr("model.layers.1.mlp.experts.7.down_proj.weight"));
}

// --- plan: names, order, shapes -------------------------------------------------------------------

std::vector<std::string> LocalNames(const std::vector<MegatronParam>& plan) {
  std::vector<std::string> out;
  for (const auto& p : plan) out.push_back(p.local_name);
  return out;
}

TEST(PlanRank, Qwen3MoeOrderIsNamedParametersOrder) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kQwen3Moe);
  o.layers = 1, o.experts = 4;
  auto json = tools::SyntheticConfigJson(o);
  ASSERT_TRUE(json.ok());
  auto cfg = ParseModelConfig(*json, "t");
  ASSERT_TRUE(cfg.ok());
  auto par = ResolveSourceParallel(*cfg, tools::testing::Parallel(1, 1, 2, 1, 2));
  ASSERT_TRUE(par.ok()) << par.status();
  auto layout = MakeLayout(*cfg, *par);
  ASSERT_TRUE(layout.ok());
  auto plan = PlanRank(*cfg, *layout, *par, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(
      LocalNames(*plan),
      ::testing::ElementsAre(
          "embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_proj.weight",
          "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
          "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.q_layernorm.weight",
          "decoder.layers.0.self_attention.k_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
          "decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.experts.linear_fc1.weight0",
          "decoder.layers.0.mlp.experts.linear_fc1.weight1", "decoder.layers.0.mlp.experts.linear_fc2.weight0",
          "decoder.layers.0.mlp.experts.linear_fc2.weight1", "decoder.final_layernorm.weight", "output_layer.weight"));
  // Rank 1 is EP rank 1: local experts 0, 1 are global 2, 3.
  EXPECT_EQ((*plan)[8].global_name, "decoder.layers.0.mlp.experts.linear_fc1.weight2");
  EXPECT_EQ((*plan)[8].global_expert, 2);
  EXPECT_THAT((*plan)[8].hf_names, ::testing::ElementsAre("model.layers.0.mlp.experts.2.gate_proj.weight",
                                                          "model.layers.0.mlp.experts.2.up_proj.weight"));
  EXPECT_EQ((*plan)[11].hf_names[0], "model.layers.0.mlp.experts.3.down_proj.weight");
}

TEST(PlanRank, DeepseekOrderShapesAndDtypes) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kDeepseekV3);
  o.layers = 2;
  auto json = tools::SyntheticConfigJson(o);
  ASSERT_TRUE(json.ok());
  auto cfg = ParseModelConfig(*json, "t");
  ASSERT_TRUE(cfg.ok());
  auto par = ResolveSourceParallel(*cfg, tools::testing::Parallel(2, 1, 1, 2, 1));
  ASSERT_TRUE(par.ok()) << par.status();
  auto layout = MakeLayout(*cfg, *par);
  ASSERT_TRUE(layout.ok());
  auto plan = PlanRank(*cfg, *layout, *par, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<std::string> layer = {"input_layernorm.weight",
                                          "self_attention.linear_proj.weight",
                                          "self_attention.linear_q_down_proj.weight",
                                          "self_attention.linear_q_up_proj.layer_norm_weight",
                                          "self_attention.linear_q_up_proj.weight",
                                          "self_attention.linear_kv_down_proj.weight",
                                          "self_attention.linear_kv_up_proj.layer_norm_weight",
                                          "self_attention.linear_kv_up_proj.weight"};
  std::vector<std::string> want = {"embedding.word_embeddings.weight"};
  for (const auto& s : layer) want.push_back("decoder.layers.0." + s);
  for (const auto& s : {"mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"})
    want.push_back(std::string("decoder.layers.0.") + s);
  for (const auto& s : layer) want.push_back("decoder.layers.1." + s);
  for (const auto& s : {"pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.router.expert_bias"})
    want.push_back(std::string("decoder.layers.1.") + s);
  for (int e = 0; e < 8; ++e) want.push_back(absl::StrCat("decoder.layers.1.mlp.experts.linear_fc1.weight", e));
  for (int e = 0; e < 8; ++e) want.push_back(absl::StrCat("decoder.layers.1.mlp.experts.linear_fc2.weight", e));
  want.push_back("decoder.layers.1.mlp.shared_experts.linear_fc1.weight");
  want.push_back("decoder.layers.1.mlp.shared_experts.linear_fc2.weight");
  want.push_back("decoder.final_layernorm.weight");
  want.push_back("output_layer.weight");
  EXPECT_EQ(LocalNames(*plan), want);

  auto find = [&](absl::string_view name) -> const MegatronParam& {
    for (const auto& p : *plan)
      if (p.local_name == name) return p;
    ADD_FAILURE() << "no " << name;
    return plan->front();
  };
  // 8 heads x (16 + 8) rows over TP 2; q_lora 32.
  const MegatronParam& q_up = find("decoder.layers.0.self_attention.linear_q_up_proj.weight");
  EXPECT_EQ(q_up.local_shape, (Shape{96, 32}));
  EXPECT_EQ(q_up.full_shape, (Shape{192, 32}));
  EXPECT_EQ(q_up.kind, ShardKind::kTpDim0);
  const MegatronParam& kv_down = find("decoder.layers.0.self_attention.linear_kv_down_proj.weight");
  EXPECT_EQ(kv_down.kind, ShardKind::kReplicated);
  EXPECT_EQ(kv_down.local_shape, (Shape{40, 64}));
  EXPECT_EQ(kv_down.hf_names[0], "model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
  const MegatronParam& proj = find("decoder.layers.1.self_attention.linear_proj.weight");
  EXPECT_EQ(proj.local_shape, (Shape{64, 64}));  // [H, 8*16 / 2]
  EXPECT_EQ(proj.gather_dim, 1);
  const MegatronParam& bias = find("decoder.layers.1.mlp.router.expert_bias");
  EXPECT_EQ(bias.dtype, DType::kF32);
  EXPECT_EQ(bias.hf_names[0], "model.layers.1.mlp.gate.e_score_correction_bias");
  const MegatronParam& shared = find("decoder.layers.1.mlp.shared_experts.linear_fc1.weight");
  EXPECT_EQ(shared.kind, ShardKind::kTpGluFc1);
  EXPECT_EQ(shared.local_shape, (Shape{32, 64}));  // 2 * 32 / TP 2
  EXPECT_THAT(shared.hf_names, ::testing::ElementsAre("model.layers.1.mlp.shared_experts.gate_proj.weight",
                                                      "model.layers.1.mlp.shared_experts.up_proj.weight"));
  const MegatronParam& fc1 = find("decoder.layers.1.mlp.experts.linear_fc1.weight5");
  EXPECT_EQ(fc1.kind, ShardKind::kExpertGluFc1);
  EXPECT_EQ(fc1.group_size, 2);
  EXPECT_EQ(fc1.rank_in_group, 1);
  EXPECT_EQ(fc1.local_shape, (Shape{32, 64}));
  const MegatronParam& emb = find("embedding.word_embeddings.weight");
  EXPECT_EQ(emb.local_shape, (Shape{512, 64}));  // ceil(1000 / 256) * 256 / 2
}

// MTP (MEGATRON_TO_HF.md §5.7): GPTModel registers embedding, decoder, mtp, output_layer, and each
// MultiTokenPredictionLayer enorm, hnorm, eh_proj, transformer_layer, final_layernorm; with PP > 1
// the MTP stage holds its own embedding copy, first, never sent.
TEST(PlanRank, MtpLayerSitsBetweenTheFinalNormAndTheOutputLayer) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kDeepseekV3);
  o.layers = 2, o.mtp_layers = 1;
  auto json = tools::SyntheticConfigJson(o);
  ASSERT_TRUE(json.ok()) << json.status();
  auto cfg = ParseModelConfig(*json, "t");
  ASSERT_TRUE(cfg.ok());
  SourceParallel sp = tools::testing::Parallel(2, 2, 1, 2, 1);
  sp.mtp_num_layers = 1;
  auto par = ResolveSourceParallel(*cfg, sp);
  ASSERT_TRUE(par.ok()) << par.status();
  auto layout = MakeLayout(*cfg, *par);
  ASSERT_TRUE(layout.ok());
  auto first = PlanRank(*cfg, *layout, *par, 1);  // TP rank 1 of stage 0
  ASSERT_TRUE(first.ok()) << first.status();
  for (const auto& p : *first) EXPECT_FALSE(absl::StartsWith(p.local_name, "mtp.")) << p.local_name;
  auto last = PlanRank(*cfg, *layout, *par, 3);  // TP rank 1 of stage 1
  ASSERT_TRUE(last.ok()) << last.status();
  const std::vector<std::string> names = LocalNames(*last);
  ASSERT_EQ(names.front(), "embedding.word_embeddings.weight");
  EXPECT_FALSE(last->front().sent);
  EXPECT_EQ(last->front().local_shape, (Shape{512, 64}));
  const auto at = [&](absl::string_view name) -> const MegatronParam& {
    for (const auto& p : *last)
      if (p.local_name == name) return p;
    ADD_FAILURE() << "no " << name;
    return last->front();
  };
  const auto index = [&](absl::string_view name) {
    return std::find(names.begin(), names.end(), name) - names.begin();
  };
  const std::vector<std::string> order = {"decoder.final_layernorm.weight",
                                          "mtp.layers.0.enorm.weight",
                                          "mtp.layers.0.hnorm.weight",
                                          "mtp.layers.0.eh_proj.weight",
                                          "mtp.layers.0.transformer_layer.input_layernorm.weight",
                                          "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
                                          "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc2.weight",
                                          "mtp.layers.0.final_layernorm.weight",
                                          "output_layer.weight"};
  for (size_t i = 0; i + 1 < order.size(); ++i) EXPECT_LT(index(order[i]), index(order[i + 1])) << order[i];
  EXPECT_EQ(names.back(), "output_layer.weight");
  const MegatronParam& eh = at("mtp.layers.0.eh_proj.weight");
  EXPECT_EQ(eh.kind, ShardKind::kTpDim0);
  EXPECT_EQ(eh.local_shape, (Shape{32, 128}));  // [H / TP, 2H]
  EXPECT_THAT(eh.hf_names, ::testing::ElementsAre("model.layers.2.eh_proj.weight"));
  EXPECT_EQ(eh.global_layer, 2);
  EXPECT_THAT(at("mtp.layers.0.final_layernorm.weight").hf_names,
              ::testing::ElementsAre("model.layers.2.shared_head.norm.weight"));
  EXPECT_THAT(at("mtp.layers.0.enorm.weight").hf_names, ::testing::ElementsAre("model.layers.2.enorm.weight"));
  const MegatronParam& kv = at("mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight");
  EXPECT_THAT(kv.hf_names, ::testing::ElementsAre("model.layers.2.self_attn.kv_b_proj.weight"));
  const MegatronParam& ex = at("mtp.layers.0.transformer_layer.mlp.experts.linear_fc2.weight7");
  EXPECT_TRUE(ex.is_expert);
  EXPECT_THAT(ex.hf_names, ::testing::ElementsAre("model.layers.2.mlp.experts.7.down_proj.weight"));

  // mtp_num_layers must be the HF config's num_nextn_predict_layers
  sp.mtp_num_layers = 2;
  auto two = ResolveSourceParallel(*cfg, sp);
  EXPECT_EQ(two.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(two.status().message(), HasSubstr("mtp_num_layers=2 but the HF config (DeepseekV3ForCausalLM) has "
                                                "num_nextn_predict_layers=1"));
  auto parsed = ParseSourceParallel(R"({"mtp_num_layers": -1})", "p.json");
  EXPECT_THAT(parsed.status().message(), HasSubstr("\"mtp_num_layers\" must be >= 0, got -1"));
  auto round = ParseSourceParallel(SourceParallelToJson(*par), "p.json");
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(round->mtp_num_layers, 1);
}

TEST(PlanRank, DeepseekWithoutQLoraUsesLinearQProj) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kDeepseekV3);
  o.q_lora_rank = 0;
  auto model = tools::testing::SmallModel(o, kSeed);
  ASSERT_TRUE(model.ok()) << model.status();
  auto plan = PlanFullModel(model->config);
  ASSERT_TRUE(plan.ok());
  std::set<std::string> names;
  for (const auto& p : *plan) names.insert(p.global_name);
  EXPECT_TRUE(names.count("decoder.layers.2.self_attention.linear_q_proj.weight"));
  EXPECT_FALSE(names.count("decoder.layers.2.self_attention.linear_q_down_proj.weight"));
  EXPECT_TRUE(model->weights.Contains("model.layers.2.self_attn.q_proj.weight"));
  EXPECT_FALSE(model->weights.Contains("model.layers.2.self_attn.q_a_proj.weight"));
}

TEST(PlanRank, PipelineStagesUseLocalLayerIndicesAndGlobalOffsets) {
  auto model = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kQwen3), kSeed);
  ASSERT_TRUE(model.ok());
  auto par = ResolveSourceParallel(model->config, tools::testing::Parallel(1, 3, 1, 1, 1, {1, 2, 1}));
  ASSERT_TRUE(par.ok()) << par.status();
  auto layout = MakeLayout(model->config, *par);
  ASSERT_TRUE(layout.ok());
  std::vector<std::vector<MegatronParam>> stages;
  for (int r = 0; r < 3; ++r) stages.push_back(*PlanRank(model->config, *layout, *par, r));
  EXPECT_EQ(stages[0].front().local_name, "embedding.word_embeddings.weight");
  EXPECT_EQ(stages[1].front().local_name, "decoder.layers.0.self_attention.linear_proj.weight");
  EXPECT_EQ(stages[1].front().global_name, "decoder.layers.1.self_attention.linear_proj.weight");
  EXPECT_EQ(stages[1].front().hf_names[0], "model.layers.1.self_attn.o_proj.weight");
  EXPECT_EQ(stages[1].back().local_name, "decoder.layers.1.mlp.linear_fc2.weight");
  EXPECT_EQ(stages[1].back().global_layer, 2);
  EXPECT_EQ(stages[1].back().local_layer, 1);
  EXPECT_EQ(stages[2].back().local_name, "output_layer.weight");
  EXPECT_EQ(stages[2][stages[2].size() - 2].local_name, "decoder.final_layernorm.weight");
  for (const auto& p : stages[1]) EXPECT_NE(p.local_name, "decoder.final_layernorm.weight");
  EXPECT_EQ(stages[2].front().global_name, "decoder.layers.3.self_attention.linear_proj.weight");
}

TEST(PlanRank, ExpertIdsFollowTheExpertGridNotTheTpRank) {
  // TP 2, ETP 2, EP 2, DP 2: ep_rank == dp_rank (RANKS.md §5); a wrong EP rank shows here.
  auto model = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kQwen3Moe), kSeed);
  ASSERT_TRUE(model.ok());
  auto par = ResolveSourceParallel(model->config, tools::testing::Parallel(2, 1, 2, 2, 2));
  ASSERT_TRUE(par.ok());
  auto layout = MakeLayout(model->config, *par);
  ASSERT_TRUE(layout.ok());
  for (int rank = 0; rank < 4; ++rank) {
    auto plan = PlanRank(model->config, *layout, *par, rank);
    ASSERT_TRUE(plan.ok());
    const int ep = rank / 2;  // g = etp + 2 * ep
    for (const auto& p : *plan) {
      if (!p.is_expert) continue;
      EXPECT_EQ(p.global_expert, ep * 4 + p.local_expert) << "rank " << rank << " " << p.local_name;
      EXPECT_EQ(p.rank_in_group, rank % 2);
    }
  }
}

TEST(PlanRank, TiedEmbeddings) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kQwen3);
  o.tie = true;
  auto model = tools::testing::SmallModel(o, kSeed);
  ASSERT_TRUE(model.ok());
  EXPECT_FALSE(model->weights.Contains("lm_head.weight"));
  // PP 1: no output layer at all.
  auto full = PlanFullModel(model->config);
  ASSERT_TRUE(full.ok());
  for (const auto& p : *full) EXPECT_NE(p.local_name, "output_layer.weight");
  // PP 2: the last stage holds the copy, built from the embedding, never sent.
  auto world = tools::testing::BuildWorld(*model, tools::testing::Parallel(2, 2, 1, 2, 1));
  ASSERT_TRUE(world.ok()) << world.status();
  const tools::RankTensor& out = world->ranks.at(3).back();
  EXPECT_EQ(out.param.local_name, "output_layer.weight");
  EXPECT_FALSE(out.param.sent);
  EXPECT_EQ(out.param.hf_names[0], "model.embed_tokens.weight");
  const tools::RankTensor& emb = world->ranks.at(1).front();
  EXPECT_EQ(emb.param.local_name, "embedding.word_embeddings.weight");
  ASSERT_EQ(out.view.nbytes(), emb.view.nbytes());
  EXPECT_EQ(std::memcmp(out.view.data(), emb.view.data(), emb.view.nbytes()), 0);
  Tensor gathered = *Tensor::Empty(out.param.dtype, out.param.full_shape);
  ASSERT_TRUE(MergeShards(out.param, {world->ranks.at(2).back().view, out.view}, gathered.mutable_view()).ok());
  auto hf = ToHf(model->config, out.param, gathered.view());
  ASSERT_TRUE(hf.ok());
  EXPECT_TRUE(hf->empty());
}

TEST(Vocab, PaddingRowsAreZeroAndDroppedWithoutACopy) {
  auto model = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kLlama), kSeed);
  ASSERT_TRUE(model.ok());
  auto world = tools::testing::BuildWorld(*model, tools::testing::Parallel(4, 1, 1, 4, 1));
  ASSERT_TRUE(world.ok());
  EXPECT_EQ(world->parallel.padded_vocab_size, 1024);  // ceil(1000 / 512) * 512
  // TP rank 3 holds rows 768..1023: 232 real rows, then 24 zero rows.
  const tools::RankTensor& emb = world->ranks.at(3).front();
  ASSERT_EQ(emb.view.shape(), (Shape{256, 64}));
  const auto* p = reinterpret_cast<const uint8_t*>(emb.view.data());
  const size_t row = 64 * 2;
  for (size_t i = 232 * row; i < 256 * row; ++i) ASSERT_EQ(p[i], 0) << "byte " << i;
  bool nonzero = false;
  for (size_t i = 231 * row; i < 232 * row; ++i) nonzero = nonzero || p[i] != 0;
  EXPECT_TRUE(nonzero);

  Tensor full = *Tensor::Empty(emb.param.dtype, emb.param.full_shape);
  std::vector<TensorView> shards;
  for (int r = 0; r < 4; ++r) shards.push_back(world->ranks.at(r).front().view);
  ASSERT_TRUE(MergeShards(emb.param, shards, full.mutable_view()).ok());
  auto hf = ToHf(model->config, emb.param, full.view());
  ASSERT_TRUE(hf.ok());
  ASSERT_EQ(hf->size(), 1u);
  EXPECT_EQ((*hf)[0].name, "model.embed_tokens.weight");
  EXPECT_EQ((*hf)[0].view.shape(), (Shape{1000, 64}));
  EXPECT_TRUE((*hf)[0].aliases_input());
  EXPECT_EQ((*hf)[0].view.data(), full.view().data());
}

// --- HF op row maps ---------------------------------------------------------------------------

MegatronParam Param(HfOp op, ShardKind kind, Shape full, std::vector<std::string> names) {
  MegatronParam p;
  p.global_name = p.local_name = "p";
  p.dtype = DType::kI32;  // values are row labels
  p.hf_op = op;
  p.kind = kind;
  p.full_shape = p.local_shape = full;
  p.hf_names = std::move(names);
  return p;
}

Tensor RowLabels(const Shape& shape) {
  Tensor t = *Tensor::Empty(DType::kI32, shape);
  const int64_t rows = shape[0], cols = t.nbytes() / 4 / rows;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t.data_as<int32_t>()[r * cols + c] = static_cast<int32_t>(r * 100 + c);
  return t;
}

std::vector<int32_t> Col0(const TensorView& v) {
  std::vector<int32_t> out;
  const int64_t rows = v.dim(0), cols = v.numel() / rows;
  for (int64_t r = 0; r < rows; ++r) {
    int32_t x;
    std::memcpy(&x, static_cast<const char*>(v.data()) + r * cols * 4, 4);
    out.push_back(x / 100);
  }
  return out;
}

TEST(HfConvert, QkvSplitsByQueryGroupsAndRoundTrips) {
  ModelConfig cfg;
  cfg.num_attention_heads = 4, cfg.num_key_value_heads = 2, cfg.head_dim = 1;
  MegatronParam p = Param(HfOp::kQkv, ShardKind::kTpDim0, Shape{8, 3}, {"q", "k", "v"});
  Tensor full = RowLabels(p.full_shape);
  auto hf = ToHf(cfg, p, full.view());
  ASSERT_TRUE(hf.ok()) << hf.status();
  ASSERT_EQ(hf->size(), 3u);
  // Group g = [q(2 heads); k; v]: rows 0,1 q; 2 k; 3 v; 4,5 q; 6 k; 7 v.
  EXPECT_THAT(Col0((*hf)[0].view), ::testing::ElementsAre(0, 1, 4, 5));
  EXPECT_THAT(Col0((*hf)[1].view), ::testing::ElementsAre(2, 6));
  EXPECT_THAT(Col0((*hf)[2].view), ::testing::ElementsAre(3, 7));
  EXPECT_FALSE((*hf)[0].aliases_input());

  model::HfCheckpoint ckpt;
  for (auto& t : *hf) ASSERT_TRUE(ckpt.Add(t.name, *Tensor::CopyOf(t.view)).ok());
  auto back = HfToMegatronFull(cfg, p, ckpt);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(std::memcmp(back->view().data(), full.view().data(), full.nbytes()), 0);

  // The bias (1-D) splits the same way.
  MegatronParam b = Param(HfOp::kQkv, ShardKind::kTpDim0, Shape{8}, {"qb", "kb", "vb"});
  Tensor bias = RowLabels(b.full_shape);
  auto hb = ToHf(cfg, b, bias.view());
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_THAT(Col0((*hb)[0].view), ::testing::ElementsAre(0, 1, 4, 5));
  EXPECT_THAT(Col0((*hb)[1].view), ::testing::ElementsAre(2, 6));
  EXPECT_THAT(Col0((*hb)[2].view), ::testing::ElementsAre(3, 7));
}

TEST(HfConvert, GluHalvesAliasTheFullTensor) {
  ModelConfig cfg;
  MegatronParam p = Param(HfOp::kGlu, ShardKind::kTpGluFc1, Shape{6, 2}, {"gate", "up"});
  Tensor full = RowLabels(p.full_shape);
  auto hf = ToHf(cfg, p, full.view());
  ASSERT_TRUE(hf.ok());
  EXPECT_THAT(Col0((*hf)[0].view), ::testing::ElementsAre(0, 1, 2));
  EXPECT_THAT(Col0((*hf)[1].view), ::testing::ElementsAre(3, 4, 5));
  EXPECT_TRUE((*hf)[0].aliases_input());
  EXPECT_TRUE((*hf)[1].aliases_input());
}

TEST(HfConvert, RefusesWrongShapesAndMissingTensors) {
  ModelConfig cfg;
  cfg.vocab_size = 5;
  MegatronParam p = Param(HfOp::kVocab, ShardKind::kVocab, Shape{8, 2}, {"model.embed_tokens.weight"});
  Tensor wrong = *Tensor::Zeros(DType::kI32, Shape{7, 2});
  auto r = ToHf(cfg, p, wrong.view());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("expected I32[8, 2]"));

  model::HfCheckpoint empty;
  auto missing = HfToMegatronFull(cfg, p, empty);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("model.embed_tokens.weight"));

  model::HfCheckpoint bad;
  ASSERT_TRUE(bad.Add("model.embed_tokens.weight", *Tensor::Zeros(DType::kI32, Shape{6, 2})).ok());
  auto mis = HfToMegatronFull(cfg, p, bad);
  ASSERT_FALSE(mis.ok());
  EXPECT_THAT(mis.status().message(), HasSubstr("expected shape [5, 2]"));

  model::HfCheckpoint padded;
  Tensor five = RowLabels(Shape{5, 2});
  ASSERT_TRUE(padded.Add("model.embed_tokens.weight", std::move(five)).ok());
  auto full = HfToMegatronFull(cfg, p, padded);
  ASSERT_TRUE(full.ok());
  EXPECT_THAT(Col0(full->view()), ::testing::ElementsAre(0, 1, 2, 3, 4, 0, 0, 0));
}

// --- refusals -----------------------------------------------------------------------------------

TEST(Refusals, UnsupportedModelsAndLayoutsAreNamed) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kQwen3Moe);
  o.tie = true;
  auto tied_moe = tools::SyntheticConfigJson(o);
  ASSERT_TRUE(tied_moe.ok());
  auto cfg = ParseModelConfig(*tied_moe, "t");
  ASSERT_TRUE(cfg.ok());
  EXPECT_EQ(CheckModelSupported(*cfg).code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(CheckModelSupported(*cfg).message(), HasSubstr("tie_word_embeddings"));

  // HF's o_proj bias and MLP biases only together (megatron-core's --add-bias-linear gives both)
  auto llama_json = tools::SyntheticConfigJson(tools::testing::SmallOptions(Architecture::kLlama));
  ASSERT_TRUE(llama_json.ok());
  auto biased = ParseModelConfig(
      absl::StrReplaceAll(*llama_json, {{"\"attention_bias\": false", "\"attention_bias\": true"}}), "t");
  ASSERT_TRUE(biased.ok());
  EXPECT_EQ(CheckModelSupported(*biased).code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(CheckModelSupported(*biased).message(), HasSubstr("attention_bias=true without MLP biases"));
  EXPECT_THAT(CheckModelSupported(*biased).message(), HasSubstr("set mlp_bias=true"));
  auto mlp_biased =
      ParseModelConfig(absl::StrReplaceAll(*llama_json, {{"\"attention_bias\": false", "\"mlp_bias\": true"}}), "t");
  ASSERT_TRUE(mlp_biased.ok());
  EXPECT_THAT(CheckModelSupported(*mlp_biased).message(), HasSubstr("mlp_bias=true without attention_bias"));
  auto both = ParseModelConfig(
      absl::StrReplaceAll(*llama_json, {{"\"attention_bias\": false", "\"attention_bias\": true, \"mlp_bias\": true"}}),
      "t");
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE(both->o_proj_bias && both->mlp_bias);
  EXPECT_TRUE(CheckModelSupported(*both).ok()) << CheckModelSupported(*both);
  auto qwen3_json = tools::SyntheticConfigJson(tools::testing::SmallOptions(Architecture::kQwen3));
  ASSERT_TRUE(qwen3_json.ok());
  auto qwen3_biased = ParseModelConfig(
      absl::StrReplaceAll(*qwen3_json, {{"\"attention_bias\": false", "\"attention_bias\": true"}}), "t");
  ASSERT_TRUE(qwen3_biased.ok());
  EXPECT_THAT(CheckModelSupported(*qwen3_biased).message(), HasSubstr("which this HF model lacks"));

  auto llama = ParseModelConfig(*llama_json, "t");
  ASSERT_TRUE(llama.ok());
  auto tp3 = ResolveSourceParallel(*llama, tools::testing::Parallel(3, 1, 1, 3, 1));
  ASSERT_FALSE(tp3.ok());
  EXPECT_THAT(tp3.status().message(), HasSubstr("tp=3 does not divide num_attention_heads=8"));
  auto tp8 = ResolveSourceParallel(*llama, tools::testing::Parallel(8, 1, 1, 8, 1));
  EXPECT_THAT(tp8.status().message(), HasSubstr("tp=8 does not divide num_key_value_heads (query groups)=4"));
  auto ep2 = ResolveSourceParallel(*llama, tools::testing::Parallel(1, 1, 2, 1, 2));
  EXPECT_THAT(ep2.status().message(), HasSubstr("ep=2 needs a model with MoE layers"));

  auto moe = ParseModelConfig(*tools::SyntheticConfigJson(tools::testing::SmallOptions(Architecture::kQwen3Moe)), "t");
  ASSERT_TRUE(moe.ok());
  auto ep3 = ResolveSourceParallel(*moe, tools::testing::Parallel(1, 1, 3, 1, 3));
  EXPECT_THAT(ep3.status().message(), HasSubstr("ep=3 does not divide number of routed experts=8"));
  auto etp3 = ResolveSourceParallel(*moe, tools::testing::Parallel(1, 1, 1, 3, 3));
  EXPECT_THAT(etp3.status().message(), HasSubstr("etp=3 does not divide moe_intermediate_size=32"));
}

TEST(BindToPlan, NamesMissingUnknownAndMisShapedParameters) {
  auto model = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kQwen3Moe), kSeed);
  ASSERT_TRUE(model.ok());
  auto world = tools::testing::BuildWorld(*model, tools::testing::Parallel(2, 1, 2, 1, 1));
  ASSERT_TRUE(world.ok());
  const auto& tensors = world->ranks.at(0);
  std::vector<MegatronParam> plan;
  std::vector<std::pair<std::string, TensorView>> named;
  for (const tools::RankTensor& t : tensors) {
    plan.push_back(t.param);
    named.emplace_back(t.param.local_name, t.view);
  }
  EXPECT_TRUE(BindToPlan(plan, named, "r0").ok());

  auto missing = named;
  missing.erase(missing.begin() + 3);
  auto r = BindToPlan(plan, missing, "rank-00000.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("rank-00000.safetensors: 1 missing parameter(s): "
                                              "decoder.layers.0.self_attention.linear_qkv.weight (BF16[128, 64])"));

  auto unknown = named;
  unknown.emplace_back("decoder.layers.0.mlp.experts.linear_fc1.weight9", named[0].second);
  r = BindToPlan(plan, unknown, "f");
  EXPECT_THAT(
      r.status().message(),
      HasSubstr("1 unknown parameter(s) (not held by this rank): decoder.layers.0.mlp.experts.linear_fc1.weight9"));

  auto wrong = named;
  wrong[1].second = named[0].second;  // the embedding's bytes under linear_proj's name
  r = BindToPlan(plan, wrong, "f");
  EXPECT_THAT(r.status().message(), HasSubstr("decoder.layers.0.self_attention.linear_proj.weight: expected "
                                              "BF16[64, 64], found BF16[512, 64]"));
}

}  // namespace
}  // namespace wsync::trainer_agent
