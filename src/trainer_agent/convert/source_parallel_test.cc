// parallel.json: parsing, defaults, resolution against the model, refusals, round trip.
#include "trainer_agent/convert/source_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "absl/strings/str_join.h"
#include "tools/synth/testing/world.h"
#include "trainer_agent/convert/megatron_param.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ModelConfig Model(Architecture arch) {
  return *ParseModelConfig(*tools::SyntheticConfigJson(tools::testing::SmallOptions(arch)), "config.json");
}

TEST(PaddedVocab, MegatronFormula) {
  EXPECT_EQ(PaddedVocabSize(1000, 128, 1), 1024);
  EXPECT_EQ(PaddedVocabSize(1000, 128, 2), 1024);
  EXPECT_EQ(PaddedVocabSize(1000, 128, 3), 1152);
  EXPECT_EQ(PaddedVocabSize(1024, 128, 4), 1024);
  EXPECT_EQ(PaddedVocabSize(151936, 128, 2), 152064);  // MEGATRON_TO_HF §7
  EXPECT_EQ(PaddedVocabSize(129280, 128, 1), 129280);
  EXPECT_EQ(PaddedVocabSize(129280, 128, 8), 130048);
}

TEST(ParseSourceParallel, FullFileAndDefaults) {
  auto p = ParseSourceParallel(R"({"tp": 2, "pp": 2, "ep": 2, "etp": 1, "dp": 2, "cp": 1, "world_size": 8,
      "order": "tp-cp-ep-dp-pp", "make_vocab_size_divisible_by": 64, "padded_vocab_size": 1024,
      "layers_per_stage": [1, 3]})",
                               "parallel.json");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->tp, 2);
  EXPECT_EQ(p->etp, 1);
  EXPECT_EQ(p->world_size, 8);
  EXPECT_EQ(p->make_vocab_size_divisible_by, 64);
  EXPECT_EQ(p->padded_vocab_size, 1024);
  EXPECT_THAT(p->layers_per_stage, ElementsAre(1, 3));
  EXPECT_EQ(p->vpp, 1);

  auto d = ParseSourceParallel(R"({"tp": 4, "world_size": 8})", "p");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->etp, 4);  // Megatron: ETP defaults to TP
  EXPECT_EQ(d->dp, 2);
  EXPECT_EQ(d->order, "tp-cp-ep-dp-pp");
  auto e = ParseSourceParallel("{}", "p");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->world_size, 1);
}

TEST(ParseSourceParallel, RefusesMalformedFiles) {
  EXPECT_THAT(ParseSourceParallel("{", "parallel.json").status().message(),
              HasSubstr("parallel.json: not well-formed"));
  EXPECT_THAT(ParseSourceParallel(R"({"tp_size": 2})", "p").status().message(), HasSubstr("unknown key \"tp_size\""));
  EXPECT_THAT(ParseSourceParallel(R"({"tp": 0})", "p").status().message(), HasSubstr("\"tp\" must be >= 1, got 0"));
  EXPECT_THAT(ParseSourceParallel(R"({"tp": "2"})", "p").status().message(), HasSubstr("must be an integer"));
  EXPECT_THAT(ParseSourceParallel(R"({"tp": 2, "dp": 2, "world_size": 8})", "p").status().message(),
              HasSubstr("world_size=8 != tp*cp*pp*dp = 2*1*1*2"));
  EXPECT_THAT(ParseSourceParallel(R"({"layers_per_stage": [1, -1]})", "p").status().message(),
              HasSubstr("non-negative integers"));
  EXPECT_THAT(ParseSourceParallel(R"({"vpp": 0})", "p").status().message(), HasSubstr("\"vpp\" must be >= 1, got 0"));
  EXPECT_THAT(ParseSourceParallel(R"({"layers_per_chunk": [1, "2"]})", "p").status().message(),
              HasSubstr("\"layers_per_chunk\" must hold non-negative integers"));
  EXPECT_THAT(ParseSourceParallel(R"({"account_for_loss_in_pipeline_split": 1})", "p").status().message(),
              HasSubstr("\"account_for_loss_in_pipeline_split\" must be true or false, got 1"));
  EXPECT_THAT(ParseSourceParallel(R"({"num_layers_in_first_pipeline_stage": 0})", "p").status().message(),
              HasSubstr("\"num_layers_in_first_pipeline_stage\" must be >= 1, got 0"));
  // Megatron's custom layout string is not read: a model built with it is described by layers_per_chunk.
  EXPECT_THAT(ParseSourceParallel(R"({"pipeline_model_parallel_layout": "Et|tL"})", "p").status().message(),
              HasSubstr("unknown key \"pipeline_model_parallel_layout\""));
}

// megatron-core's own split (tools/golden/megatron_pp_split.py: its TransformerConfig,
// get_num_layers_to_build and get_transformer_layer_offset over a grid of 2032 option sets) against
// MegatronChunkLayers. Where Megatron refuses, wsync refuses. Where Megatron accepts a split it
// cannot run (a negative layer count, offsets that leave a gap or overlap), wsync refuses. Where
// Megatron's offset function divides by zero (uneven pp = 2 with VPP and both stages set,
// megatron-core 0.16.1), wsync takes the layers get_num_layers_to_build gives.
TEST(MegatronChunkLayers, EqualsMegatronCoreOnTheGoldenGrid) {
  std::ifstream in(std::string(WSYNC_GOLDEN_DIR) + "/megatron_pp_split.json");
  ASSERT_TRUE(in) << "missing golden file";
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json golden = nlohmann::json::parse(text.str());
  int refused = 0, nonsense = 0, built = 0, zero_division = 0;
  for (const nlohmann::json& c : golden.at("cases")) {
    SourceParallel p;
    p.pp = c.at("pp").get<int>();
    p.vpp = c.at("vpp").get<int>();
    if (!c.at("first").is_null()) p.num_layers_in_first_pipeline_stage = c.at("first").get<int64_t>();
    if (!c.at("last").is_null()) p.num_layers_in_last_pipeline_stage = c.at("last").get<int64_t>();
    p.account_for_embedding_in_pipeline_split = c.at("embedding").get<bool>();
    p.account_for_loss_in_pipeline_split = c.at("loss").get<bool>();
    const int64_t layers = c.at("num_layers").get<int64_t>();
    const absl::StatusOr<std::vector<int64_t>> got = MegatronChunkLayers(layers, p);
    const std::string what = c.dump();
    if (c.contains("refused")) {
      ++refused;
      EXPECT_FALSE(got.ok()) << what << " -> " << absl::StrJoin(*got, ",");
      continue;
    }
    const std::vector<int64_t> want = c.at("layers").get<std::vector<int64_t>>();
    bool runnable = std::accumulate(want.begin(), want.end(), int64_t{0}) == layers;
    for (int64_t n : want) runnable = runnable && n >= 0;
    if (c.contains("offset_error")) {
      ++zero_division;
      EXPECT_THAT(c.at("offset_error").get<std::string>(), HasSubstr("ZeroDivisionError")) << what;
      ASSERT_TRUE(got.ok()) << what << ": " << got.status();
      EXPECT_EQ(*got, want) << what;
      continue;
    }
    const std::vector<int64_t> offsets = c.at("offsets").get<std::vector<int64_t>>();
    for (size_t k = 0; k < want.size(); ++k)
      runnable =
          runnable && offsets[k] == std::accumulate(want.begin(), want.begin() + static_cast<long>(k), int64_t{0});
    if (!runnable) {
      ++nonsense;
      EXPECT_FALSE(got.ok()) << what << " -> " << absl::StrJoin(*got, ",");
      continue;
    }
    ++built;
    ASSERT_TRUE(got.ok()) << what << ": " << got.status();
    EXPECT_EQ(*got, want) << what;
  }
  // every kind of case is present, so none of the branches above is vacuous
  EXPECT_GT(refused, 1000);
  EXPECT_GT(nonsense, 50);
  EXPECT_GT(built, 300);
  EXPECT_GT(zero_division, 0);
  std::printf("%d splits Megatron builds, %d it refuses, %d it would build wrongly, %d its offsets divide by zero\n",
              built, refused, nonsense, zero_division);
}

TEST(ResolveSourceParallel, VirtualPipelineAndMegatronsOptions) {
  const ModelConfig moe = Model(Architecture::kQwen3Moe);  // 4 layers
  SourceParallel p = tools::testing::Parallel(1, 2, 1, 1, 1);
  p.vpp = 2;
  auto even = ResolveSourceParallel(moe, p);
  ASSERT_TRUE(even.ok()) << even.status();
  EXPECT_THAT(even->layers_per_chunk, ElementsAre(1, 1, 1, 1));
  EXPECT_THAT(even->layers_per_stage, ElementsAre(2, 2));
  EXPECT_EQ(even->ChunkFirstLayer(3), 3);
  EXPECT_EQ(even->Chunk(0, 1), 2);  // pipeline rank 0's second chunk holds layer 2
  auto text = SourceParallelToJson(*even);
  EXPECT_THAT(text, HasSubstr("\"layers_per_chunk\""));
  auto back = ParseSourceParallel(text, "p");
  ASSERT_TRUE(back.ok()) << back.status();
  auto again = ResolveSourceParallel(moe, *back);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(SourceParallelToJson(*again), text);

  // the embedding and the loss each take a layer's place: 4 + 2 = 6 over 2 stages x 1
  SourceParallel acct = tools::testing::Parallel(1, 2, 1, 1, 1);
  acct.account_for_embedding_in_pipeline_split = acct.account_for_loss_in_pipeline_split = true;
  auto a = ResolveSourceParallel(moe, acct);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->layers_per_stage, ElementsAre(2, 2));
  acct.pp = 3, acct.world_size = 3;  // 6 over 3: [1, 2, 1]
  a = ResolveSourceParallel(moe, acct);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->layers_per_stage, ElementsAre(1, 2, 1));

  // an explicit split is any contiguous one (Megatron's custom layouts), and must match options given
  SourceParallel given = tools::testing::Parallel(1, 2, 1, 1, 1);
  given.vpp = 2;
  given.layers_per_chunk = {0, 2, 1, 1};
  auto g = ResolveSourceParallel(moe, given);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->layers_per_stage, ElementsAre(1, 3));
  given.account_for_embedding_in_pipeline_split = true;  // Megatron: 5 over 2x2 does not split
  EXPECT_THAT(ResolveSourceParallel(moe, given).status().message(), HasSubstr("does not split evenly over pp=2"));
  given.account_for_embedding_in_pipeline_split = false;
  given.num_layers_in_first_pipeline_stage = 2;  // Megatron: [1, 1, 1, 1]
  EXPECT_THAT(ResolveSourceParallel(moe, given, "x").status().message(),
              HasSubstr("x: layers_per_chunk [0, 2, 1, 1] is not Megatron's split for the options given [1, 1, 1, 1]"));
  given.num_layers_in_first_pipeline_stage.reset();
  given.layers_per_stage = {2, 2};
  EXPECT_THAT(ResolveSourceParallel(moe, given).status().message(),
              HasSubstr("layers_per_stage [2, 2] is not the sum of layers_per_chunk [0, 2, 1, 1]"));
  given.layers_per_chunk = {1, 1, 1};
  EXPECT_THAT(ResolveSourceParallel(moe, given).status().message(),
              HasSubstr("layers_per_chunk has 3 entries but pp*vpp=2*2"));
  // vpp needs pp > 1; a vpp the layers do not fill is refused with Megatron's reason
  SourceParallel one = tools::testing::Parallel(1, 1, 1, 1, 1);
  one.vpp = 2;
  EXPECT_THAT(ResolveSourceParallel(moe, one).status().message(), HasSubstr("vpp=2 needs pipeline parallelism"));
  SourceParallel four = tools::testing::Parallel(1, 2, 1, 1, 1);
  four.vpp = 4;
  EXPECT_THAT(ResolveSourceParallel(moe, four).status().message(),
              HasSubstr("pipeline rank 0 has 2 layers, not divisible by vpp=4; give layers_per_chunk"));
}

TEST(PlanRank, VirtualPipelineChunksNamedAndNumberedAsMegatron) {
  const ModelConfig m = Model(Architecture::kQwen3);  // 4 layers
  SourceParallel p = tools::testing::Parallel(1, 2, 1, 1, 1);
  p.vpp = 2;
  auto r = ResolveSourceParallel(m, p);
  ASSERT_TRUE(r.ok()) << r.status();
  auto layout = MakeLayout(m, *r);
  ASSERT_TRUE(layout.ok());
  for (int rank = 0; rank < 2; ++rank) {
    auto plan = PlanRank(m, *layout, *r, rank);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<std::string> names;
    for (const MegatronParam& q : *plan) {
      if (q.global_layer >= 0) {
        // chunk vp of pipeline rank `rank` holds global layer vp * 2 + rank, as its local layer 0
        const int vp = q.local_name[5] - '0';
        EXPECT_EQ(q.global_layer, vp * 2 + rank) << q.local_name;
        EXPECT_EQ(q.local_layer, 0) << q.local_name;
      }
      if (q.local_name.find(".linear_qkv.weight") != std::string::npos || q.global_layer < 0)
        names.push_back(q.local_name + " -> " + q.global_name);
    }
    if (rank == 0) {
      EXPECT_THAT(names, ElementsAre("model0.embedding.word_embeddings.weight -> embedding.word_embeddings.weight",
                                     "model0.decoder.layers.0.self_attention.linear_qkv.weight -> "
                                     "decoder.layers.0.self_attention.linear_qkv.weight",
                                     "model1.decoder.layers.0.self_attention.linear_qkv.weight -> "
                                     "decoder.layers.2.self_attention.linear_qkv.weight"));
    } else {
      EXPECT_THAT(names, ElementsAre("model0.decoder.layers.0.self_attention.linear_qkv.weight -> "
                                     "decoder.layers.1.self_attention.linear_qkv.weight",
                                     "model1.decoder.layers.0.self_attention.linear_qkv.weight -> "
                                     "decoder.layers.3.self_attention.linear_qkv.weight",
                                     "model1.decoder.final_layernorm.weight -> decoder.final_layernorm.weight",
                                     "model1.output_layer.weight -> output_layer.weight"));
    }
  }
}

TEST(ResolveSourceParallel, FillsVocabAndLayersAndChecksTheModel) {
  const ModelConfig moe = Model(Architecture::kQwen3Moe);
  SourceParallel p = tools::testing::Parallel(2, 2, 2, 2, 2);
  auto r = ResolveSourceParallel(moe, p);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->padded_vocab_size, 1024);
  EXPECT_THAT(r->layers_per_stage, ElementsAre(2, 2));

  auto text = SourceParallelToJson(*r);
  auto back = ParseSourceParallel(text, "p");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(SourceParallelToJson(*back), text);

  p.layers_per_stage = {1, 2};
  EXPECT_THAT(ResolveSourceParallel(moe, p, "x/parallel.json").status().message(),
              HasSubstr("x/parallel.json: layers_per_stage [1, 2] sums to 3 but the model has num_hidden_layers=4"));
  p.layers_per_stage = {4};
  EXPECT_THAT(ResolveSourceParallel(moe, p).status().message(), HasSubstr("layers_per_stage has 1 entries but pp=2"));
  SourceParallel three = tools::testing::Parallel(1, 3, 1, 1, 1);
  EXPECT_THAT(ResolveSourceParallel(moe, three).status().message(),
              HasSubstr("num_hidden_layers=4 does not split evenly over pp=3"));
  SourceParallel small_vocab = tools::testing::Parallel(2, 1, 1, 2, 1);
  small_vocab.padded_vocab_size = 999;
  EXPECT_THAT(ResolveSourceParallel(moe, small_vocab).status().message(),
              HasSubstr("padded_vocab_size=999 is smaller than vocab_size=1000"));
  small_vocab.padded_vocab_size = 1001;
  EXPECT_THAT(ResolveSourceParallel(moe, small_vocab).status().message(),
              HasSubstr("tp=2 does not divide padded_vocab_size=1001"));
  // An explicit padded_vocab_size (e.g. mbridge's padding without the TP factor) is kept.
  small_vocab.padded_vocab_size = 1008;
  auto kept = ResolveSourceParallel(moe, small_vocab);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->padded_vocab_size, 1008);
  // An expert grid that does not tile the world: etp*ep*pp = 4 does not divide 2.
  SourceParallel grid = tools::testing::Parallel(2, 1, 2, 2, 1);
  EXPECT_THAT(ResolveSourceParallel(moe, grid).status().message(), HasSubstr("does not divide world_size 2"));
}

}  // namespace
}  // namespace wsync::trainer_agent
