// RunRankSync on every rank of a layout, one thread per rank in this process, over local Gloo
// groups (gather/testing/local_trainer_comms.h) and a DirSource of the synthetic sharder's rank
// files: a dense model over TP 2 (world 2) and MoE models over TP 2 x EP 2 with ETP 1 and 2 (world
// 4; with ETP 2, fc2 shards both narrower and as wide as a group), bf16 and INT4 (compressed-tensors,
// and AWQ with its expert blocks of AWQ triples). Each stage
// source's buckets are decoded and compared bit for bit with ExpectedSentTensors, the oracle of the
// mpirun test (tests/integration/trainer_sync_mpi_test.cc), through the same helpers
// (sync/testing/sync_capture.h). A missing rank file fails every rank with the same error naming
// the rank, and no rank hangs.
#include "trainer_agent/sync/rank_sync.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "comm/store/store.h"
#include "comm/testing/faulty_communicator.h"
#include "tools/synth/testing/world.h"
#include "trainer_agent/gather/testing/local_trainer_comms.h"
#include "trainer_agent/quantize/quant_select.h"
#include "trainer_agent/source/dir_source.h"
#include "trainer_agent/sync/testing/sync_capture.h"

namespace wsync::trainer_agent {
namespace {

namespace fs = std::filesystem;
using testing::CaptureSink;
using testing::LocalTrainerComms;

const comm::CollectiveOptions kTimeout{absl::Seconds(30)};
// A rank still in RunRankSync after this long is hung (every collective times out sooner).
constexpr absl::Duration kHang = absl::Seconds(90);

struct RankResult {
  absl::StatusOr<SyncReport> report = absl::UnknownError("not run");
  std::optional<CaptureSink> sink;  // stage sources
};

// Runs RunRankSync on every rank of `src`'s layout, one thread each. A rank still running after
// kHang fails the test; every communicator is then aborted so that the threads return.
std::vector<RankResult> SyncEveryRank(const DirSource& src, LocalTrainerComms& comms, const SyncOptions& o) {
  const ParallelLayout& layout = src.layout();
  const int n = layout.world_size();
  std::vector<RankResult> results(static_cast<size_t>(n));
  std::vector<absl::Notification> done(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  std::vector<bool> sends(static_cast<size_t>(n), false);
  for (int s = 0; s < layout.pp(); ++s)
    for (int r : StageSenders(layout, s, o.spread_senders)) sends[static_cast<size_t>(r)] = true;
  for (int r = 0; r < n; ++r) {
    RankResult& res = results[static_cast<size_t>(r)];
    if (sends[static_cast<size_t>(r)]) res.sink.emplace();
    threads.emplace_back([&, r] {
      res.report = RunRankSync(src, comms.ranks[static_cast<size_t>(r)], res.sink ? &*res.sink : nullptr, o);
      done[static_cast<size_t>(r)].Notify();
    });
  }
  const absl::Time deadline = absl::Now() + kHang;
  std::vector<int> hung;
  for (int r = 0; r < n; ++r)
    if (!done[static_cast<size_t>(r)].WaitForNotificationWithDeadline(deadline)) hung.push_back(r);
  if (!hung.empty()) {
    ADD_FAILURE() << "ranks " << absl::StrJoin(hung, ", ") << " still in RunRankSync after " << kHang;
    comms.Abort("the test gave up on a hung rank");
  }
  for (std::thread& t : threads) t.join();
  return results;
}

struct LayoutCase {
  std::string name;
  int tp, ep, etp, dp;
  int pp = 1, vpp = 1;  // pipeline stages, and model chunks per stage (Megatron's even split)
};

struct Case {
  std::string name;
  Architecture arch;
  LayoutCase layout;
  int64_t moe_ffn = 32;
  bool int4 = true;
  bool prune = false;        // an expert map: item 0 pruned on both EP members, item 3 on one
  bool spread = false;       // SyncOptions::spread_senders: the TP group and the EP mergers send
  bool awq = false;          // INT4 as AWQ (group 32) rather than compressed-tensors
  bool fp8 = false;          // block FP8 (16 x 32 blocks) rather than INT4; `int4` set too
  bool linear_bias = false;  // Llama with every linear biased (megatron's --add-bias-linear)
  int64_t mtp = 0;           // MTP layers trained and synced (mtp_num_layers, num_nextn_predict_layers)
};

// Keeps experts 6, 1, 3, 5, 2 of 8 (reversed on odd layers): with EP 2, local expert 0 (experts 0
// and 4) is pruned on both members, local expert 3 (3 and 7) on member 1 only.
model::ExpertMap TestExpertMap(const ModelConfig& c) {
  model::ExpertMap m;
  m.num_experts = c.moe->num_experts;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.IsMoeLayer(l)) continue;
    std::vector<int64_t> ids = {6, 1, 3, 5, 2};
    if (l % 2 == 1) std::reverse(ids.begin(), ids.end());
    m.layers[l] = ids;
  }
  return m;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// A fresh directory per test for the HF checkpoint and the rank files.
class RankSyncFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(
        ::testing::TempDir(), "/rank_sync_",
        absl::StrReplaceAll(::testing::UnitTest::GetInstance()->current_test_info()->name(), {{"/", "_"}}));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // dir_/hf: the model's HF checkpoint; dir_/src: its Megatron rank files for `l`.
  void MakeFixture(const tools::SyntheticModelOptions& mo, const LayoutCase& l, uint64_t seed) {
    auto m = tools::testing::SmallModel(mo, seed);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(tools::WriteHfModel(*m, hf_dir()).ok());
    SourceParallel p = tools::testing::Parallel(l.tp, l.pp, l.ep, l.etp, l.dp);
    p.vpp = l.vpp;
    p.mtp_num_layers = mo.mtp_layers;
    auto stats = tools::WriteMegatronSource(m->config_json, m->config, m->weights, p, src_dir());
    ASSERT_TRUE(stats.ok()) << stats.status();
  }
  std::string hf_dir() const { return dir_ + "/hf"; }
  // dir_/hf_pruned: the oracle checkpoint of the model pruned by `map` (model::PruneHfCheckpoint).
  std::string WritePrunedHf(const model::ExpertMap& map) {
    auto original = model::HfCheckpoint::Open(hf_dir());
    EXPECT_TRUE(original.ok()) << original.status();
    auto text = ReadTextFile(hf_dir() + "/config.json");
    EXPECT_TRUE(text.ok());
    auto config = ParseModelConfig(*text, "config.json");
    EXPECT_TRUE(config.ok());
    tools::SyntheticModel pruned;
    auto json = model::PrunedConfigJson(*text, map, "config.json");
    EXPECT_TRUE(json.ok()) << json.status();
    pruned.config_json = *json;
    auto weights = model::PruneHfCheckpoint(*config, map, *original);
    EXPECT_TRUE(weights.ok()) << weights.status();
    pruned.weights = std::move(*weights);
    EXPECT_TRUE(tools::WriteHfModel(pruned, dir_ + "/hf_pruned").ok());
    return dir_ + "/hf_pruned";
  }
  std::string src_dir() const { return dir_ + "/src"; }

  std::string dir_;
};

class RankSyncTest : public RankSyncFixture, public ::testing::WithParamInterface<Case> {};
class RankSyncFailureTest : public RankSyncFixture {};

// Every rank succeeded, and the stage sources together sent exactly the HF checkpoint converted
// (and quantized) directly, each tensor once, bit for bit.
void ExpectSentExactly(const std::vector<RankResult>& results, const ParallelLayout& layout, const SyncOptions& o,
                       const std::string& hf_dir, const std::optional<QuantizationConfig>& quant, int64_t mtp = 0) {
  for (size_t r = 0; r < results.size(); ++r) {
    ASSERT_TRUE(results[r].report.ok()) << "rank " << r << ": " << results[r].report.status();
  }
  auto expected = ExpectedSentTensorsFromDir(hf_dir, quant, {}, mtp);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::map<std::string, int> count;
  for (size_t r = 0; r < results.size(); ++r) {
    const RankResult& res = results[r];
    EXPECT_EQ(res.report->source, res.sink.has_value()) << "rank " << r;
    if (!res.sink) continue;
    const int stage = layout.Dense(static_cast<int>(r)).pp;
    const std::map<std::string, testing::Captured> got =
        testing::DecodeStream(*res.sink, o.bucket_bytes, o.version, stage);
    EXPECT_EQ(res.report->tensors, got.size());
    EXPECT_EQ(res.report->buckets, res.sink->buckets.size());
    const std::string names = testing::ExpectSentAsExpected(got, expected->tensors, stage);
    for (absl::string_view n : absl::StrSplit(names, '\n', absl::SkipEmpty())) ++count[std::string(n)];
  }
  for (const model::HfTensor& t : expected->tensors) {
    EXPECT_EQ(count[t.name], 1) << t.name << " sent " << count[t.name] << " times";
    count.erase(t.name);
  }
  for (const auto& [name, k] : count) ADD_FAILURE() << "unexpected tensor " << name << " sent " << k << " times";
}

TEST_P(RankSyncTest, SendsExactlyTheConvertedCheckpoint) {
  const Case& c = GetParam();
  tools::SyntheticModelOptions mo = tools::testing::SmallOptions(c.arch);
  mo.moe_ffn = c.moe_ffn;
  mo.linear_bias = c.linear_bias;
  mo.mtp_layers = c.mtp;
  ASSERT_NO_FATAL_FAILURE(MakeFixture(mo, c.layout, 20261121));
  auto src = DirSource::Open(src_dir());
  ASSERT_TRUE(src.ok()) << src.status();
  std::optional<QuantizationConfig> quant;
  if (c.int4) {
    auto q = ParseQuantizationConfig(
        c.fp8   ? R"({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 32]})"
        : c.awq ? R"({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": true, "version": "gemm"})"
                : testing::kInt4Json,
        "test quantization config");
    ASSERT_TRUE(q.ok()) << q.status();
    quant = std::move(*q);
  }
  comm::MemoryStore store;
  auto comms = testing::MakeLocalTrainerComms(store, "sync", src->layout());
  ASSERT_TRUE(comms.ok()) << comms.status();
  SyncOptions o;
  o.version = 42;
  o.bucket_bytes = 32 << 10;  // several buckets; the embedding gets one of its own
  o.gather_bytes = 12 << 10;  // several batches per phase
  o.quant = quant ? &*quant : nullptr;
  o.quant_threads = 1;
  o.collective = kTimeout;
  std::string want_dir = hf_dir();
  model::ExpertMap map;
  if (c.prune) {
    map = TestExpertMap(src->model());
    o.expert_map = &map;
    want_dir = WritePrunedHf(map);
  }
  o.spread_senders = c.spread;
  const std::vector<RankResult> results = SyncEveryRank(*src, *comms, o);
  ExpectSentExactly(results, src->layout(), o, want_dir, quant, c.mtp);
  if (c.mtp > 0) {  // the MTP layer came from the last stage's source, eh_proj in bf16 (SGLang's nn.Linear)
    const int last = src->layout().pp() - 1;
    bool eh_proj = false;
    for (size_t r = 0; r < results.size(); ++r) {
      if (!results[r].sink || src->layout().Dense(static_cast<int>(r)).pp != last) continue;
      for (const auto& [name, t] : testing::DecodeStream(*results[r].sink, o.bucket_bytes, o.version, last))
        if (name == absl::StrCat("model.layers.", src->model().num_hidden_layers, ".eh_proj.weight"))
          eh_proj = t.dtype == DType::kBF16;
    }
    EXPECT_TRUE(eh_proj) << "model.layers.{L}.eh_proj.weight not sent in bf16 by the last stage";
  }
  // Spread senders share the stage: every one of them sent tensors (TP peers their dense share,
  // EP members their own experts), and no EP gather ran.
  if (c.spread) {
    const std::vector<int> senders = StageSenders(src->layout(), 0, true);
    EXPECT_GT(senders.size(), 1u);
    for (int r : senders) {
      const absl::StatusOr<SyncReport>& rep = results[static_cast<size_t>(r)].report;
      if (rep.ok()) {
        EXPECT_GT(rep->tensors, 0u) << "sender rank " << r << " sent nothing";
      }
    }
  }
  // With INT4 experts gathered, every rank of the expert block quantizes (its experts, or its ETP
  // shards); other ranks only when they are a stage source.
  const ParallelLayout& l = src->layout();
  const bool moe = l.num_experts() > 0;
  for (int r = 0; r < l.world_size(); ++r) {
    const absl::StatusOr<SyncReport>& rep = results[static_cast<size_t>(r)].report;
    if (!rep.ok() || c.fp8) continue;  // FP8 experts are quantized by whoever emits them
    if (c.int4 && moe && l.Expert(r).edp == 0) {
      EXPECT_GT(rep->quantized_bytes, 0u) << "rank " << r << " holds experts";
    } else if (!rep->source) {
      EXPECT_EQ(rep->quantized_bytes, 0u) << "rank " << r;
    }
  }
}

std::vector<Case> AllCases() {
  const LayoutCase tp2 = {"tp2", 2, 1, 2, 1};
  const LayoutCase ep2 = {"tp2_ep2_etp1", 2, 2, 1, 2};
  const LayoutCase etp2 = {"tp2_ep2_etp2", 2, 2, 2, 2};
  std::vector<Case> out;
  for (bool int4 : {false, true}) {
    const std::string q = int4 ? "_int4" : "_bf16";
    out.push_back({"qwen3_" + tp2.name + q, Architecture::kQwen3, tp2, 32, int4});
    out.push_back({"qwen3moe_" + ep2.name + q, Architecture::kQwen3Moe, ep2, 32, int4});
    out.push_back({"qwen3moe_" + etp2.name + q, Architecture::kQwen3Moe, etp2, 32, int4});
  }
  // ETP 2 with fc2 shards of 32 columns: whole groups, quantized by each ETP rank (above, 16
  // columns: merged in bf16 and quantized by the merger).
  out.push_back({"qwen3moe_" + etp2.name + "_ffn64_int4", Architecture::kQwen3Moe, etp2, 64, true});
  out.push_back({"deepseek_" + etp2.name + "_ffn64_int4", Architecture::kDeepseekV3, etp2, 64, true});
  out.push_back({"deepseek_" + ep2.name + "_int4", Architecture::kDeepseekV3, ep2, 32, true});
  // Expert pruning: items pruned on every member are not gathered, mixed ones are.
  out.push_back({"qwen3moe_" + ep2.name + "_int4_pruned", Architecture::kQwen3Moe, ep2, 32, true, true});
  out.push_back({"qwen3moe_" + etp2.name + "_ffn64_int4_pruned", Architecture::kQwen3Moe, etp2, 64, true, true});
  out.push_back({"deepseek_" + ep2.name + "_bf16_pruned", Architecture::kDeepseekV3, ep2, 32, false, true});
  out.push_back({"deepseek_" + tp2.name + "_int4_pruned", Architecture::kDeepseekV3, tp2, 32, true, true});
  // AWQ experts quantized by their holders (ETP 1), by ETP shards (fc1; fc2 with 32 columns a
  // shard) or after a bf16 merge (fc2 with 16), then merged as AWQ triples.
  out.push_back({"qwen3moe_" + ep2.name + "_awq", Architecture::kQwen3Moe, ep2, 32, true, false, false, true});
  out.push_back({"qwen3moe_" + etp2.name + "_awq", Architecture::kQwen3Moe, etp2, 32, true, false, false, true});
  out.push_back(
      {"deepseek_" + etp2.name + "_ffn64_awq", Architecture::kDeepseekV3, etp2, 64, true, false, false, true});
  out.push_back(
      {"qwen3moe_" + etp2.name + "_ffn64_awq_pruned", Architecture::kQwen3Moe, etp2, 64, true, true, false, true});
  // Block FP8: experts travel in bf16 and are quantized where they are emitted.
  for (const auto& [arch, lc, ffn] :
       {std::tuple{Architecture::kQwen3, tp2, 32}, std::tuple{Architecture::kQwen3Moe, ep2, 32},
        std::tuple{Architecture::kDeepseekV3, etp2, 64}}) {
    Case f{std::string(ArchitectureName(arch)) + "_" + lc.name + "_fp8", arch, lc, ffn, true};
    f.fp8 = true;
    out.push_back(f);
  }
  // Virtual pipeline: 2 stages of 2 model chunks each (every stage sends its chunks' layers under
  // their global numbers), dense and MoE, bf16 and INT4.
  const LayoutCase vpp = {"tp2_ep2_etp1_pp2_vpp2", 2, 2, 1, 1, 2, 2};
  const LayoutCase dense_vpp = {"tp2_pp2_vpp2", 2, 1, 2, 1, 2, 2};
  out.push_back({"qwen3_" + dense_vpp.name + "_bf16", Architecture::kQwen3, dense_vpp, 32, false});
  out.push_back({"qwen3moe_" + vpp.name + "_int4", Architecture::kQwen3Moe, vpp, 32, true});
  out.push_back({"deepseek_" + vpp.name + "_int4", Architecture::kDeepseekV3, vpp, 32, true});
  // GLM-4.5: GQA with q/k/v bias and QK norm, DeepSeek-V3's MoE (expert bias, a shared expert).
  for (bool int4 : {false, true})
    out.push_back(
        {std::string("glm4_moe_") + etp2.name + (int4 ? "_int4" : "_bf16"), Architecture::kGlm4Moe, etp2, 32, int4});
  out.push_back({"glm4_moe_" + vpp.name + "_int4", Architecture::kGlm4Moe, vpp, 32, true});
  // Llama with every linear biased: q/k/v, o_proj and the GLU fc1 biases split over TP, o_proj's and
  // down_proj's whole (megatron's --add-bias-linear), across 2 stages.
  for (bool int4 : {false, true}) {
    Case b{std::string("llama_linear_bias_") + dense_vpp.name + (int4 ? "_int4" : "_bf16"), Architecture::kLlama,
           dense_vpp, 32, int4};
    b.linear_bias = true;
    out.push_back(b);
  }
  // MTP layers (mtp.layers.0.* -> model.layers.{L}.*) on the last stage, beside its embedding copy:
  // DeepSeek-V3 and GLM-4.5, bf16 and INT4 (the layer's weights quantized, eh_proj not), PP 2 x VPP 2.
  for (Architecture arch : {Architecture::kDeepseekV3, Architecture::kGlm4Moe})
    for (bool int4 : {false, true}) {
      Case m{std::string(ArchitectureName(arch)) + "_mtp_" + vpp.name + (int4 ? "_int4" : "_bf16"), arch, vpp, 32,
             int4};
      m.mtp = 1;
      out.push_back(m);
    }
  // Block FP8 with the MTP layer: its weights FP8 as the others', eh_proj bf16.
  Case fp8_mtp{"deepseek_v3_mtp_" + etp2.name + "_fp8", Architecture::kDeepseekV3, etp2, 64, true};
  fp8_mtp.fp8 = true;
  fp8_mtp.mtp = 1;
  out.push_back(fp8_mtp);
  // Spread senders (sharded delivery): the same checks on the union of the senders' streams.
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) {
    Case c = out[i];
    c.name += "_spread";
    c.spread = true;
    out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, RankSyncTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// Rank 2's file is gone: every rank returns the same kNotFound naming rank 2 and its file, before
// any gather, nothing is sent, and no rank hangs.
// An expert map that leaves out a MoE layer: every rank refuses the sync with the same error
// naming the layer, before any gather, and nothing is sent.
TEST_F(RankSyncFailureTest, AnExpertMapThatDoesNotFitFailsEveryRankBeforeAnyGather) {
  ASSERT_NO_FATAL_FAILURE(
      MakeFixture(tools::testing::SmallOptions(Architecture::kQwen3Moe), {"tp2_ep2_etp1", 2, 2, 1, 2}, 7));
  auto src = DirSource::Open(src_dir());
  ASSERT_TRUE(src.ok()) << src.status();
  model::ExpertMap map = TestExpertMap(src->model());
  map.layers.erase(std::prev(map.layers.end()));
  comm::MemoryStore store;
  auto comms = testing::MakeLocalTrainerComms(store, "badmap", src->layout());
  ASSERT_TRUE(comms.ok()) << comms.status();
  SyncOptions o;
  o.bucket_bytes = 32 << 10;
  o.collective = kTimeout;
  o.expert_map = &map;
  const std::vector<RankResult> results = SyncEveryRank(*src, *comms, o);
  for (size_t r = 0; r < results.size(); ++r) {
    const absl::StatusOr<SyncReport>& rep = results[r].report;
    ASSERT_FALSE(rep.ok()) << "rank " << r;
    EXPECT_EQ(rep.status().code(), absl::StatusCode::kInvalidArgument) << rep.status();
    EXPECT_TRUE(absl::StrContains(rep.status().message(), "rank 0 cannot take part")) << rep.status();
    EXPECT_TRUE(absl::StrContains(rep.status().message(), "does not list MoE layer(s) 3")) << rep.status();
    EXPECT_EQ(rep.status(), results[0].report.status()) << "ranks disagree on the error (rank " << r << ")";
    if (results[r].sink) {
      EXPECT_TRUE(results[r].sink->buckets.empty()) << "nothing may be sent";
    }
  }
}

TEST_F(RankSyncFailureTest, AMissingRankFileFailsEveryRankWithTheSameErrorNamingIt) {
  ASSERT_NO_FATAL_FAILURE(
      MakeFixture(tools::testing::SmallOptions(Architecture::kQwen3Moe), {"tp2_ep2_etp1", 2, 2, 1, 2}, 7));
  ASSERT_TRUE(fs::remove(src_dir() + "/" + RankFileName(2)));
  auto src = DirSource::Open(src_dir());
  ASSERT_TRUE(src.ok()) << src.status();
  auto q = ParseQuantizationConfig(testing::kInt4Json, "test int4 config");
  ASSERT_TRUE(q.ok()) << q.status();
  comm::MemoryStore store;
  auto comms = testing::MakeLocalTrainerComms(store, "missing", src->layout());
  ASSERT_TRUE(comms.ok()) << comms.status();
  SyncOptions o;
  o.bucket_bytes = 32 << 10;
  o.quant = &*q;
  o.quant_threads = 1;
  o.collective = kTimeout;
  const absl::Time t0 = absl::Now();
  const std::vector<RankResult> results = SyncEveryRank(*src, *comms, o);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20)) << "failing took too long";
  ASSERT_EQ(results.size(), 4u);
  for (size_t r = 0; r < results.size(); ++r) {
    const absl::StatusOr<SyncReport>& rep = results[r].report;
    ASSERT_FALSE(rep.ok()) << "rank " << r;
    EXPECT_TRUE(absl::IsNotFound(rep.status())) << "rank " << r << ": " << rep.status();
    EXPECT_TRUE(absl::StrContains(rep.status().message(), "rank 2 cannot take part")) << rep.status();
    EXPECT_TRUE(absl::StrContains(rep.status().message(), RankFileName(2))) << rep.status();
    EXPECT_EQ(rep.status(), results[0].report.status()) << "ranks disagree on the error (rank " << r << ")";
    if (results[r].sink) {
      EXPECT_TRUE(results[r].sink->buckets.empty()) << "nothing may be sent";
      EXPECT_EQ(results[r].sink->finishes, 0);
    }
  }
}

// A TP gather that fails the way a communicator fails (comm/testing/faulty_communicator.h), at its
// first, second and fifth operation on rank 1: every rank returns within the timeout (no rank waits
// out a peer), both ranks of that TP group fail (rank 1 with the fault, or kAborted naming it), and
// no stage finishes its stream, so no receiver could commit. (Ranks 2 and 3, the other TP group,
// may finish their part: the trainer agent fails the sync on any rank's error.)
TEST_F(RankSyncFailureTest, ACommunicatorFaultInAGatherFailsItsGroupAndFinishesNoStream) {
  ASSERT_NO_FATAL_FAILURE(
      MakeFixture(tools::testing::SmallOptions(Architecture::kQwen3Moe), {"tp2_ep2_etp1", 2, 2, 1, 2}, 7));
  auto src = DirSource::Open(src_dir());
  ASSERT_TRUE(src.ok()) << src.status();
  for (int at : {0, 1, 4}) {
    SCOPED_TRACE(::testing::Message() << "fault at rank 1's TP operation " << at);
    comm::MemoryStore store;
    auto comms = testing::MakeLocalTrainerComms(store, absl::StrCat("faulty", at), src->layout());
    ASSERT_TRUE(comms.ok()) << comms.status();
    auto faulty = std::make_unique<comm::testing::FaultyCommunicator>(std::move(comms->ranks[1].tp),
                                                                      std::vector<comm::testing::Fault>{{.at = at}});
    comm::testing::FaultyCommunicator* tp = faulty.get();
    comms->ranks[1].tp = std::move(faulty);
    SyncOptions o;
    o.bucket_bytes = 32 << 10;
    o.collective = kTimeout;
    const absl::Time t0 = absl::Now();
    const std::vector<RankResult> results = SyncEveryRank(*src, *comms, o);
    EXPECT_LT(absl::Now() - t0, absl::Seconds(20)) << "failing took too long";
    EXPECT_EQ(tp->fired(), 1) << "the fault never fired: rank 1 ran " << tp->operations() << " TP operations";
    for (size_t r = 0; r < results.size(); ++r) {
      const absl::StatusOr<SyncReport>& rep = results[r].report;
      if (r < 2) {
        EXPECT_FALSE(rep.ok()) << "rank " << r << " of the failed TP group finished its sync";
      }
      if (r == 1 && !rep.ok()) {
        EXPECT_TRUE(absl::StrContains(rep.status().message(), "injected")) << rep.status();
      }
      if (results[r].sink) {
        EXPECT_EQ(results[r].sink->finishes, 0) << "rank " << r << " finished its stage's stream";
      }
    }
  }
}

// Where the gathers run, from every rank's place (the opening agreement's): the same answer for
// every rank; mixed spaces and two members of a group on one GPU of one host fall back to host
// copies, saying which ranks. The device gathers themselves are in rank_sync_device_test.
TEST(DecideGathersTest, DecidesFromEveryRanksPlace) {
  ParallelSizes sizes;
  sizes.world_size = 8;
  sizes.tp = 2;
  sizes.ep = 4;
  sizes.etp = 1;
  sizes.num_experts = 8;
  auto layout = ParallelLayout::Create(sizes);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto space = [&](const std::vector<RankPlace>& places) { return DecideGathers(*layout, places).value().space; };
  EXPECT_EQ(space(std::vector<RankPlace>(8)), GatherSpace::kHost);
  std::vector<RankPlace> gpus;
  for (int r = 0; r < 8; ++r) gpus.push_back({0xA, r, 100u + r});  // one host, eight GPUs
  EXPECT_EQ(space(gpus), GatherSpace::kDevice);
  // Two hosts of four GPUs: the same device numbers on each are different GPUs.
  std::vector<RankPlace> two_hosts;
  for (int r = 0; r < 8; ++r) two_hosts.push_back({r < 4 ? 0xAu : 0xBu, r % 4, 100u + r % 4});
  EXPECT_EQ(space(two_hosts), GatherSpace::kDevice);

  std::vector<RankPlace> mixed = gpus;
  mixed[5].device = -1;
  const GatherDecision m = DecideGathers(*layout, mixed).value();
  EXPECT_EQ(m.space, GatherSpace::kHostCopies);
  EXPECT_EQ(m.why, "rank(s) 0, 1, 2, 3, 4, 6, 7 hold their tensors on GPUs and rank(s) 5 in host memory");

  // One GPU numbered differently by two processes (CUDA_VISIBLE_DEVICES): still one GPU.
  std::vector<RankPlace> renumbered = gpus;
  renumbered[7].gpu = gpus[6].gpu;
  EXPECT_EQ(space(renumbered), GatherSpace::kHostCopies);
  // Ranks 0 and 1 are a TP group; 0 and 2 share an EP group.
  for (int other : {1, 2}) {
    std::vector<RankPlace> shared = gpus;
    shared[static_cast<size_t>(other)].device = 0;
    shared[static_cast<size_t>(other)].gpu = gpus[0].gpu;
    const GatherDecision d = DecideGathers(*layout, shared).value();
    EXPECT_EQ(d.space, GatherSpace::kHostCopies);
    EXPECT_TRUE(
        absl::StrContains(d.why, absl::StrCat("ranks 0 and ", other, " hold their tensors on the same GPU (cuda:0")))
        << d.why;
  }
  // DP replicas are no group: with no gathers in the layout, nothing is asked.
  ParallelSizes solo;
  solo.world_size = 2;
  auto dp = ParallelLayout::Create(solo);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const std::vector<RankPlace> same = {{0xA, 0, 100}, {0xA, 0, 100}};
  EXPECT_EQ(DecideGathers(*dp, same).value().space, GatherSpace::kNone);
  EXPECT_EQ(DecideGathers(*dp, std::vector<RankPlace>(3)).status().code(), absl::StatusCode::kInvalidArgument);
}

// The device gathers' groups fail the same on every rank when a member cannot form them (here
// rank 1 names a GPU no host has; on this CPU host rank 0 has none either), and keep nothing; bad
// arguments are refused before any collective.
TEST(EnsureDeviceCommsTest, AFailureToFormIsTheSameOnEveryRank) {
  ParallelSizes sizes;
  sizes.world_size = 2;
  sizes.tp = 2;
  auto layout = ParallelLayout::Create(sizes);
  ASSERT_TRUE(layout.ok()) << layout.status();
  comm::MemoryStore store;
  auto comms = testing::MakeLocalTrainerComms(store, "ensure-device", *layout);
  ASSERT_TRUE(comms.ok()) << comms.status();
  EXPECT_EQ(EnsureDeviceComms(comms->ranks[0], {0}, true, true).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EnsureDeviceComms(comms->ranks[0], {0, -1}, true, true).code(), absl::StatusCode::kInvalidArgument);
  std::vector<absl::Status> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      got[static_cast<size_t>(r)] =
          EnsureDeviceComms(comms->ranks[static_cast<size_t>(r)], {0, 4096}, true, true, {absl::Seconds(20)});
    });
  for (std::thread& t : threads) t.join();
  const absl::StatusCode want = comm::BackendCompiledIn(comm::Backend::kNccl) ? absl::StatusCode::kFailedPrecondition
                                                                              : absl::StatusCode::kUnimplemented;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[static_cast<size_t>(r)].code(), want) << "rank " << r << ": " << got[static_cast<size_t>(r)];
    EXPECT_EQ(comms->ranks[static_cast<size_t>(r)].device.tp, nullptr);
    EXPECT_TRUE(comms->ranks[static_cast<size_t>(r)].device.devices.empty());
  }
  if (want == absl::StatusCode::kFailedPrecondition) {
    EXPECT_TRUE(absl::StrContains(got[1].message(), "rank 1 has no CUDA device 4096")) << got[1];
  }
}

}  // namespace
}  // namespace wsync::trainer_agent
