// Sharded delivery against brute force: for every architecture, bf16 and INT4, and fleets of engine
// layouts (TP 1 / 2 / 4, EP on the engine side, mixed layouts in one fleet), a random HF model is
// packed into buckets as a stage source does, cut by ShardedSink into one stream per receiver
// group, and loaded by each group's engine ranks through the agent's own LoadBucket. Each rank's
// staging must be byte-equal to what it holds after loading every whole tensor (the broadcast
// path), complete, and reached with exactly the bytes it keeps: LoadBlock refuses any block that is
// not exactly the rank's, and a duplicate, so nothing else arrives and nothing arrives twice.
// Seeds are fixed and printed on failure.
#include "plan/delivery_plan.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/bucket/bucket_format.h"
#include "comm/bucket/builder.h"
#include "comm/testing/capture_sink.h"
#include "common/config.h"
#include "common/status.h"
#include "engine_model/loader.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"
#include "plan/sharded_sink.h"
#include "rollout_agent/receive/stage_receiver.h"

namespace wsync::plan {
namespace {

using comm::testing::CaptureSink;
using engine_model::EngineLayout;
using engine_model::EngineParallel;
using engine_model::HfSource;
using engine_model::Loader;
using engine_model::Staging;
using ::testing::HasSubstr;

struct Model {
  const char* name;
  const char* json;
  bool moe;
  bool mla;
};
constexpr Model kModels[] = {
    {"llama", model::testing::kLlamaJson, false, false},
    {"qwen2", model::testing::kQwen2Json, false, false},
    {"qwen3", model::testing::kQwen3Json, false, false},
    {"qwen3_moe", model::testing::kQwen3MoeJson, true, false},
    {"deepseek", model::testing::kDeepseekJson, true, true},
    {"deepseek_no_q_lora", model::testing::kDeepseekNoQLoraJson, true, true},
    {"glm4_moe", model::testing::kGlm45Json, true, false},
};

// Engines of a fleet: {TP, EP, NextN draft} each; every engine contributes its TP ranks as
// receivers. A fleet with a draft engine runs only on models with one MTP layer.
struct FleetEngine {
  int tp = 1, ep = 1;
  bool draft = false;
};
struct Fleet {
  const char* name;
  std::vector<FleetEngine> engines;
  bool moe_only = false;
};
const std::vector<Fleet>& Fleets() {
  static const std::vector<Fleet> f = {
      {"one TP1", {{1, 1}}},
      {"two TP2", {{2, 1}, {2, 1}}},
      {"TP4", {{4, 1}}},
      {"TP2 EP2 x2", {{2, 2}, {2, 2}}, true},
      {"TP4 EP2 + TP2 EP1", {{4, 2}, {2, 1}}, true},
      {"TP4 EP4 + TP1", {{4, 4}, {1, 1}}, true},
      // SGLang's NextN draft beside the target: the draft ranks form groups of their own, which
      // alone are sent the MTP layer's blocks
      {"TP2 EP2 draft + TP2 EP2 + TP1 draft", {{2, 2, true}, {2, 2}, {1, 1, true}}, true},
  };
  return f;
}

std::vector<std::byte> Bytes(const Staging& s, int param) {
  auto v = s.param(param).bytes();
  return {v.begin(), v.end()};
}

// Bytes rank `layout` keeps of the tensors it is sent: its blocks and its weight_shapes.
uint64_t KeptBytes(const EngineLayout& layout) {
  uint64_t n = 0;
  for (const HfSource& s : layout.sources()) {
    if (s.action == HfSource::Action::kCopy) n += static_cast<uint64_t>(s.rows * s.cols) * ItemSize(s.dtype);
    if (s.action == HfSource::Action::kCheckShape) n += 2 * ItemSize(s.dtype);
  }
  return n;
}

TEST(ShardPlanTest, EveryRankGetsExactlyWhatItKeeps) {
  int cases = 0, draft_cases = 0;
  for (const Model& mdl : kModels) {
    auto config = ParseModelConfig(mdl.json, mdl.name);
    ASSERT_TRUE(config.ok()) << config.status();
    std::vector<std::string> ignore = {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"};
    if (mdl.mla) ignore.insert(ignore.end(), {"re:.*q_a_proj", "re:.*kv_a_proj_with_mqa", "re:.*kv_b_proj"});
    auto quant = ParseQuantizationConfig(model::testing::QuantJson(32, ignore), "quant");
    ASSERT_TRUE(quant.ok()) << quant.status();
    for (const bool int4 : {false, true}) {
      const QuantizationConfig* q = int4 ? &*quant : nullptr;
      const uint32_t seed = 7000 + static_cast<uint32_t>(cases);
      auto m = model::testing::MakeHfModel(*config, q, seed);
      ASSERT_TRUE(m.ok()) << m.status();
      for (const Fleet& fleet : Fleets()) {
        if (fleet.moe_only && !mdl.moe) continue;
        const bool draft =
            std::any_of(fleet.engines.begin(), fleet.engines.end(), [](const FleetEngine& e) { return e.draft; });
        if (draft && config->num_nextn_predict_layers != 1) continue;
        draft_cases += draft ? 1 : 0;
        SCOPED_TRACE(absl::StrCat(mdl.name, int4 ? " INT4" : " bf16", ", fleet ", fleet.name, ", seed ", seed));
        std::vector<EngineParallel> agents;
        for (const FleetEngine& e : fleet.engines)
          for (int r = 0; r < e.tp; ++r) agents.push_back({e.tp, r, e.ep, e.draft});
        const Grouping grouping = GroupReceivers(agents);
        auto plan = ShardPlan::Create(*config, q, grouping.groups);
        ASSERT_TRUE(plan.ok()) << plan.status();
        const int g_count = plan->num_groups();
        // Stage source: every sent tensor through the builder (small buckets: many cuts and
        // tensors alone in a bucket) into the sharded sink.
        std::vector<CaptureSink*> captures;
        std::vector<std::unique_ptr<comm::BucketSink>> sinks;
        for (int g = 0; g < g_count; ++g) {
          auto c = std::make_unique<CaptureSink>();
          captures.push_back(c.get());
          sinks.push_back(std::move(c));
        }
        ShardedSink sharded(&*plan, std::move(sinks));
        comm::BucketBuilder builder(sharded, {.bucket_bytes = 96 << 10, .version = 5, .pp_stage = 0});
        uint64_t full_bytes = 0;
        for (const std::string& name : m->order) {
          ASSERT_TRUE(builder.Add(name, m->sent.at(name).view()).ok()) << name;
          full_bytes += m->sent.at(name).view().nbytes();
        }
        ASSERT_TRUE(builder.Finish().ok());
        for (int g = 0; g < g_count; ++g) {
          const EngineParallel& p = grouping.groups[static_cast<size_t>(g)];
          SCOPED_TRACE(absl::StrCat("group ", g, ": TP rank ", p.tp_rank, " of ", p.tp_size, ", EP ", p.ep_size,
                                    p.mtp_draft ? ", draft" : ""));
          const EngineLayout& layout = plan->layout(g);
          auto sharded_staging = Staging::Create(layout);
          auto full_staging = Staging::Create(layout);
          ASSERT_TRUE(sharded_staging.ok() && full_staging.ok());
          Loader full(full_staging->get()), part(sharded_staging->get());
          for (const std::string& name : m->order) ASSERT_TRUE(full.Load(name, m->sent.at(name).view()).ok()) << name;
          ASSERT_TRUE(full.CheckComplete().ok()) << full.CheckComplete();
          // The group's stream: indices 0, 1, ..., one last bucket at its end.
          const auto& buckets = captures[static_cast<size_t>(g)]->buckets;
          ASSERT_FALSE(buckets.empty());
          uint64_t payload = 0;
          for (size_t i = 0; i < buckets.size(); ++i) {
            const auto& b = buckets[i];
            EXPECT_EQ(b.manifest.index(), i);
            EXPECT_EQ(b.manifest.last(), i + 1 == buckets.size());
            ASSERT_TRUE(comm::ValidateManifest(b.manifest, b.data.size()).ok());
            for (const auto& e : b.manifest.entries()) payload += e.nbytes();
            auto buf = Buffer::Allocate(b.data.size());
            ASSERT_TRUE(buf.ok());
            if (!b.data.empty()) std::memcpy(buf->data(), b.data.data(), b.data.size());
            absl::Status s = rollout_agent::LoadBucket(b.manifest, *buf, part, 2);
            ASSERT_TRUE(s.ok()) << s;
          }
          ASSERT_TRUE(part.CheckComplete().ok()) << part.CheckComplete();
          for (size_t i = 0; i < layout.params().size(); ++i)
            ASSERT_EQ(Bytes(**sharded_staging, static_cast<int>(i)), Bytes(**full_staging, static_cast<int>(i)))
                << layout.params()[i].name;
          // Exactly its bytes: every payload byte is a block or weight_shape this rank keeps.
          EXPECT_EQ(payload, KeptBytes(layout));
          if (p.tp_size > 1) {
            EXPECT_LT(payload, full_bytes);
          }
          // A draft group receives the MTP layer; the others none of it.
          const std::string mtp_layer = absl::StrCat("model.layers.", config->num_hidden_layers, ".");
          bool got_mtp = false;
          for (const auto& b : buckets)
            for (const auto& e : b.manifest.entries())
              got_mtp = got_mtp || absl::StartsWith(e.tensor().name(), mtp_layer);
          EXPECT_EQ(got_mtp, p.mtp_draft);
        }
        ++cases;
      }
    }
  }
  EXPECT_GE(cases, 44);
  EXPECT_EQ(draft_cases, 4);  // DeepSeek-V3 (q_lora) and GLM-4.5, bf16 and INT4
}

TEST(ShardPlanTest, GroupsFollowEngineRanks) {
  const std::vector<EngineParallel> agents = {{2, 1, 1}, {1, 0, 1}, {2, 0, 1}, {2, 1, 1}, {2, 0, 0}};
  const Grouping g = GroupReceivers(agents);
  ASSERT_EQ(g.groups.size(), 3u);  // (1, 0), (2, 0), (2, 1); EP 0 is read as 1
  EXPECT_EQ(g.members[0], std::vector<int>({1}));
  EXPECT_EQ(g.members[1], std::vector<int>({2, 4}));
  EXPECT_EQ(g.members[2], std::vector<int>({0, 3}));
  EXPECT_EQ(g.group_of, std::vector<int>({2, 0, 1, 2, 1}));
  EXPECT_EQ(g.rank_in_group, std::vector<int>({0, 0, 0, 1, 1}));
  // The same engine rank with and without the NextN draft keeps different blocks: two groups.
  std::vector<EngineParallel> mixed = {{2, 0, 1}, {2, 0, 1}, {2, 0, 1}};
  mixed[1].mtp_draft = true;
  const Grouping d = GroupReceivers(mixed);
  ASSERT_EQ(d.groups.size(), 2u);
  EXPECT_FALSE(d.groups[0].mtp_draft);
  EXPECT_TRUE(d.groups[1].mtp_draft);
  EXPECT_EQ(d.members[0], std::vector<int>({0, 2}));
  EXPECT_EQ(d.members[1], std::vector<int>({1}));
}

TEST(ShardPlanTest, RefusalsNameWhatIsWrong) {
  auto config = ParseModelConfig(model::testing::kLlamaJson, "llama");
  ASSERT_TRUE(config.ok());
  // An engine layout the model cannot take (8 heads over TP 3).
  const std::vector<EngineParallel> bad = {{3, 0, 1}};
  auto refused = ShardPlan::Create(*config, nullptr, bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("TP rank 0 of 3"));
  const std::vector<EngineParallel> two = {{2, 0, 1}, {2, 1, 1}};
  auto plan = ShardPlan::Create(*config, nullptr, two);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t shape[] = {256, 256};
  auto unknown = plan->BlockFor(0, "model.layers.9.self_attn.q_proj.weight", DType::kBF16, shape);
  EXPECT_THAT(unknown.status().message(), HasSubstr("not part of the engine layout"));
  const int64_t wrong[] = {256, 255};
  auto mis = plan->BlockFor(0, "model.layers.0.self_attn.o_proj.weight", DType::kBF16, wrong);
  EXPECT_THAT(mis.status().message(), HasSubstr("the engine expects BF16[256, 512]"));
  // o_proj is row parallel: rank 1 keeps columns [256, 512); q_proj column parallel: rows.
  const int64_t o[] = {256, 512};
  auto b = plan->BlockFor(1, "model.layers.0.self_attn.o_proj.weight", DType::kBF16, o);
  ASSERT_TRUE(b.ok() && b->has_value());
  EXPECT_EQ((*b)->row0, 0);
  EXPECT_EQ((*b)->rows, 256);
  EXPECT_EQ((*b)->col0, 256);
  EXPECT_EQ((*b)->cols, 256);
  EXPECT_FALSE((*b)->whole);

  auto two_captures = [] {  // one capturing sink per receiver group
    std::vector<std::unique_ptr<comm::BucketSink>> sinks;
    sinks.push_back(std::make_unique<CaptureSink>());
    sinks.push_back(std::make_unique<CaptureSink>());
    return sinks;
  };
  // A stage source that hands the sink a tensor the plan refuses fails its Send.
  ShardedSink sink(&*plan, two_captures());
  comm::BucketBuilder builder(sink, {.bucket_bytes = 1 << 20});
  std::vector<std::byte> bytes(256 * 255 * 2);
  const TensorView v(DType::kBF16, Shape{256, 255}, bytes);
  ASSERT_TRUE(builder.Add("model.layers.0.self_attn.o_proj.weight", v).ok());
  EXPECT_THAT(builder.Finish().message(), HasSubstr("the engine expects"));

  // Device buckets are refused before a byte is read: they are staged to the host first.
  std::vector<std::unique_ptr<comm::BucketSink>> more = two_captures();
  auto* first = static_cast<CaptureSink*>(more[0].get());
  ShardedSink device_sink(&*plan, std::move(more));
  Buffer on_device = Buffer::Adopt(
      static_cast<std::byte*>(std::malloc(64)), 64, [](std::byte* p, int) { std::free(p); }, 0);
  v1::BucketManifest m;
  m.set_nbytes(64);
  absl::Status refused_device = device_sink.Send(m, std::move(on_device), 64);
  EXPECT_EQ(refused_device.code(), absl::StatusCode::kFailedPrecondition) << refused_device;
  EXPECT_THAT(refused_device.message(), HasSubstr("SpaceStagingSink"));
  EXPECT_TRUE(first->buckets.empty());

  // A delta entry's bytes are a payload, not the tensor: no block is cut from it.
  ShardedSink delta_sink(&*plan, two_captures());
  auto host = Buffer::Allocate(64);
  ASSERT_TRUE(host.ok());
  v1::BucketManifest d;
  d.set_nbytes(64);
  d.set_base_version(1);
  v1::BucketEntry* e = d.add_entries();
  e->mutable_tensor()->set_name("model.layers.0.self_attn.o_proj.weight");
  e->mutable_tensor()->set_dtype(v1::DTYPE_BF16);
  e->mutable_tensor()->add_shape(256);
  e->mutable_tensor()->add_shape(512);
  e->set_nbytes(8);
  e->set_total_nbytes(256 * 512 * 2);
  e->mutable_delta()->set_encoding(1);
  absl::Status refused_delta = delta_sink.Send(d, std::move(*host), 64);
  EXPECT_EQ(refused_delta.code(), absl::StatusCode::kUnimplemented) << refused_delta;
  EXPECT_THAT(refused_delta.message(), HasSubstr("sharded delivery of a delta entry"));
}

TEST(LoadBlockTest, RefusesEveryBlockButTheRanksOwn) {
  auto config = ParseModelConfig(model::testing::kQwen3MoeJson, "qwen3_moe");
  ASSERT_TRUE(config.ok());
  auto layout = EngineLayout::Create(*config, nullptr, {2, 1, 2});  // EP rank 1: experts 4..7
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto staging = Staging::Create(*layout);
  ASSERT_TRUE(staging.ok());
  Loader loader(staging->get());
  std::vector<std::byte> bytes(1 << 20, std::byte{1});
  const Shape o_shape = {256, 256};  // o_proj [H, nh * hd]: rank 1 keeps columns [128, 256)
  auto view = [&](int64_t r, int64_t c) {
    return TensorView(DType::kBF16, Shape{r, c}, {bytes.data(), size_t(r * c * 2)});
  };
  const char* o = "model.layers.0.self_attn.o_proj.weight";
  EXPECT_THAT(loader.LoadBlock(o, DType::kBF16, o_shape, {0, 256, 0, 128}, view(256, 128)).message(),
              HasSubstr("keeps rows [0, 256) x columns [128, 256)"));
  EXPECT_THAT(loader.LoadBlock(o, DType::kBF16, o_shape, {0, 256, 128, 128}, view(256, 64)).message(),
              HasSubstr("the view holds"));
  EXPECT_THAT(loader.LoadBlock(o, DType::kBF16, Shape{256, 128}, {0, 256, 128, 128}, view(256, 128)).message(),
              HasSubstr("want BF16[256, 256]"));
  const char* expert = "model.layers.0.mlp.experts.1.down_proj.weight";  // EP rank 0's expert
  EXPECT_THAT(loader.LoadBlock(expert, DType::kBF16, Shape{256, 256}, {0, 256, 0, 256}, view(256, 256)).message(),
              HasSubstr("keeps none of it"));
  EXPECT_EQ(staging->get()->num_missing(), staging->get()->num_required());
  ASSERT_TRUE(loader.LoadBlock(o, DType::kBF16, o_shape, {0, 256, 128, 128}, view(256, 128)).ok());
  EXPECT_EQ(loader.LoadBlock(o, DType::kBF16, o_shape, {0, 256, 128, 128}, view(256, 128)).code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(BucketFormatTest, BlocksOutsideTheirTensorAreRefused) {
  v1::BucketManifest m;
  m.set_nbytes(1024);
  auto* e = m.add_entries();
  e->mutable_tensor()->set_name("t");
  e->mutable_tensor()->set_dtype(v1::DTYPE_BF16);
  e->mutable_tensor()->add_shape(16);
  e->mutable_tensor()->add_shape(32);
  e->set_total_nbytes(1024);
  e->set_nbytes(16 * 8 * 2);
  auto* b = e->mutable_block();
  b->set_rows(16);
  b->set_col0(24);
  b->set_cols(8);
  EXPECT_TRUE(comm::ValidateManifest(m, 1024).ok());
  b->set_col0(25);
  EXPECT_THAT(comm::ValidateManifest(m, 1024).message(), HasSubstr("does not lie inside its 16 x 32 matrix"));
  b->set_col0(0);
  e->set_nbytes(100);
  EXPECT_THAT(comm::ValidateManifest(m, 1024).message(), HasSubstr("block holds 256 bytes, the entry says 100"));
  e->set_nbytes(256);
  e->mutable_tensor()->add_shape(1);
  e->set_total_nbytes(1024);
  EXPECT_THAT(comm::ValidateManifest(m, 1024).message(), HasSubstr("a block of a 3-dim tensor"));
}

}  // namespace
}  // namespace wsync::plan
