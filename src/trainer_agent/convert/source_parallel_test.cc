// parallel.json: parsing, defaults, resolution against the model, refusals, round trip.
#include "trainer_agent/convert/source_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tools/synth/testing/world.h"

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
  EXPECT_EQ(p->FirstLayer(1), 1);

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
