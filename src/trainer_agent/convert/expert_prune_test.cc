// PruneExperts: a full plan pruned by a map, each parameter built from the original checkpoint
// and converted (ToHf), gives exactly the pruned checkpoint of the independent oracle
// (model::PruneHfCheckpoint), bit for bit: kept experts renamed to their compact ids, pruned ones
// absent, router rows and expert_bias entries in map order. Per-rank plans mark the same experts.
#include "trainer_agent/convert/expert_prune.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "tools/synth/testing/world.h"
#include "trainer_agent/convert/hf_convert.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kPruneSeed = 20261126;

// Every MoE layer keeps 5 of 8 experts in a scrambled order that differs per layer.
model::ExpertMap ScrambledMap(const ModelConfig& c) {
  model::ExpertMap m;
  m.num_experts = c.moe->num_experts;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.IsMoeLayer(l)) continue;
    std::vector<int64_t> ids;
    for (int64_t k = 0; k < 5; ++k) ids.push_back((3 * k + l) % m.num_experts);  // 3 is coprime with 8
    m.layers[l] = ids;
  }
  return m;
}

class ExpertPruneTest : public ::testing::TestWithParam<Architecture> {};

TEST_P(ExpertPruneTest, ConvertedPlanIsTheOraclePrunedCheckpoint) {
  auto m = tools::testing::SmallModel(tools::testing::SmallOptions(GetParam()), kPruneSeed);
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = m->config;
  const model::ExpertMap map = ScrambledMap(c);
  SCOPED_TRACE(map.Canonical());
  auto oracle = model::PruneHfCheckpoint(c, map, m->weights);
  ASSERT_TRUE(oracle.ok()) << oracle.status();

  auto original = PlanFullModel(c);
  ASSERT_TRUE(original.ok()) << original.status();
  std::vector<MegatronParam> plan = *original;
  ASSERT_TRUE(PruneExperts(c, map, plan).ok());
  std::map<std::string, int> seen;
  int pruned = 0, sliced = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    auto full = HfToMegatronFull(c, (*original)[i], m->weights);
    ASSERT_TRUE(full.ok()) << full.status();
    auto hf = ToHf(c, plan[i], full->view());
    ASSERT_TRUE(hf.ok()) << hf.status();
    pruned += plan[i].pruned;
    sliced += !plan[i].kept_rows.empty();
    if (plan[i].pruned) {
      EXPECT_TRUE(hf->empty()) << plan[i].global_name;
    }
    for (const model::HfTensor& t : *hf) {
      ++seen[t.name];
      auto want = oracle->Get(t.name);
      ASSERT_TRUE(want.ok()) << t.name << " is not in the pruned checkpoint";
      ASSERT_EQ(t.view.dtype(), want->dtype()) << t.name;
      ASSERT_EQ(t.view.shape(), want->shape()) << t.name;
      EXPECT_EQ(std::memcmp(t.view.data(), want->data(), t.view.nbytes()), 0) << t.name;
    }
  }
  for (const std::string& name : oracle->Names()) EXPECT_EQ(seen[name], 1) << name;
  EXPECT_EQ(seen.size(), oracle->size());
  // 3 of 8 experts pruned in each MoE layer, 2 parameters each (fc1, fc2).
  EXPECT_EQ(pruned, static_cast<int>(map.layers.size()) * 3 * 2);
  EXPECT_EQ(sliced, static_cast<int>(map.layers.size()) * (GetParam() == Architecture::kDeepseekV3 ? 2 : 1));
}

INSTANTIATE_TEST_SUITE_P(Moe, ExpertPruneTest, ::testing::Values(Architecture::kQwen3Moe, Architecture::kDeepseekV3),
                         [](const auto& i) { return std::string(ArchitectureName(i.param)); });

TEST(ExpertPrune, RankPlansMarkTheirOwnExperts) {
  auto m = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kQwen3Moe), kPruneSeed);
  ASSERT_TRUE(m.ok()) << m.status();
  auto w = tools::testing::BuildWorld(*m, tools::testing::Parallel(2, 1, 4, 1, 4));
  ASSERT_TRUE(w.ok()) << w.status();
  const model::ExpertMap map = ScrambledMap(m->config);
  int kept = 0;
  for (int r = 0; r < w->layout.world_size(); ++r) {
    if (w->layout.Expert(r).edp != 0 || w->layout.Expert(r).etp != 0) continue;
    auto plan = PlanRank(m->config, w->layout, w->parallel, r);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(PruneExperts(m->config, map, *plan).ok());
    for (const MegatronParam& p : *plan) {
      if (!p.is_expert) continue;
      const int64_t compact = map.CompactId(p.global_layer, p.global_expert);
      EXPECT_EQ(p.pruned, compact < 0) << p.global_name;
      if (compact >= 0) {
        ++kept;
        EXPECT_THAT(p.hf_names[0], HasSubstr(absl::StrCat(".mlp.experts.", compact, "."))) << p.global_name;
      }
    }
  }
  // EP 4 members together hold each layer's 8 experts, 2 parameters each; 5 kept.
  EXPECT_EQ(kept, static_cast<int>(map.layers.size()) * 5 * 2);
}

TEST(ExpertPrune, RefusesAMapThatDoesNotFitTheModel) {
  auto m = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kQwen3Moe), kPruneSeed);
  ASSERT_TRUE(m.ok()) << m.status();
  model::ExpertMap map = ScrambledMap(m->config);
  map.layers.erase(map.layers.begin());
  auto plan = PlanFullModel(m->config);
  ASSERT_TRUE(plan.ok());
  const std::vector<MegatronParam> before = *plan;
  absl::Status s = PruneExperts(m->config, map, *plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("does not list MoE layer(s) 0"));
  for (size_t i = 0; i < plan->size(); ++i) EXPECT_EQ((*plan)[i].hf_names, before[i].hf_names);
}

// A pruned checkpoint declares no MTP layer (PrunedConfigJson), so a plan with one is refused whole.
TEST(ExpertPrune, RefusesAPlanWithMtpLayers) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kDeepseekV3);
  o.mtp_layers = 1;
  auto m = tools::testing::SmallModel(o, kPruneSeed);
  ASSERT_TRUE(m.ok()) << m.status();
  auto plan = PlanFullModel(m->config, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<MegatronParam> before = *plan;
  absl::Status s = PruneExperts(m->config, ScrambledMap(m->config), *plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("mtp.layers.0.enorm.weight: expert pruning with MTP layers synced"));
  for (size_t i = 0; i < plan->size(); ++i) {
    EXPECT_EQ((*plan)[i].hf_names, before[i].hf_names);
    EXPECT_FALSE((*plan)[i].pruned);
  }
}

}  // namespace
}  // namespace wsync::trainer_agent
