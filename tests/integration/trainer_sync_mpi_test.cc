// RunRankSync under a real `mpirun` (ctest runs this with -np 4 and -np 8): for every architecture
// (tied and untied where valid; DeepSeek-V3 also with an MTP layer) and the layouts (tp2, ep2, etp1) np4, (tp1, ep4)
// np4, (tp4) np4 and (tp2, ep2, etp2, pp2) np8 (dense models: ep 1), rank 0 generates a small model and shards it,
// every rank syncs, each stage source captures its buckets, and the HF tensors they carry are compared bit for bit with
// converting (and quantizing) the HF checkpoint directly (ExpectedSentTensors): every tensor exactly once across the
// stages, nothing else. Malformed sources (a missing, a truncated and a mis-shaped rank file) fail every rank with the
// same error naming the rank and the file; a NaN the quantizer refuses fails the source, naming the tensor, while the
// others finish. Every rank runs the same cases in the same order, as collectives require; no ASSERT may skip a
// collective on one rank only.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "comm/communicator.h"
#include "common/config.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "tools/synth/sharder.h"
#include "tools/synth/synthetic_model.h"
#include "trainer_agent/quantize/quant_select.h"
#include "trainer_agent/source/dir_source.h"
#include "trainer_agent/sync/rank_sync.h"
#include "trainer_agent/sync/testing/sync_capture.h"

namespace wsync::trainer_agent {
namespace {

comm::Communicator* world = nullptr;
// Sub-communicators per layout, made once; cleared by main() before MPI is finalized.
std::map<std::string, TrainerComms>* comms_cache = nullptr;
const comm::CollectiveOptions kTimeout{absl::Seconds(60)};

// --- Helpers ------------------------------------------------------------------------------------

using testing::Captured;
using testing::CaptureSink;
using testing::DecodeStream;
using testing::ExpectSentAsExpected;

// Rank 0 runs `make` (returning a directory); every rank gets its status and the directory.
absl::StatusOr<std::string> RootMakes(const std::function<absl::StatusOr<std::string>()>& make) {
  char buf[4096] = {};
  int32_t code = 0;
  if (world->rank() == 0) {
    absl::StatusOr<std::string> r = make();
    code = static_cast<int32_t>(r.status().code());
    const std::string text = r.ok() ? *r : std::string(r.status().message());
    std::snprintf(buf, sizeof(buf), "%s", text.c_str());
  }
  comm::MutableBytes b[2] = {{&code, sizeof(code)}, {buf, sizeof(buf)}};
  RETURN_IF_ERROR(comm::Await(world->Broadcast(b, 0, kTimeout)));
  if (code != 0) return absl::Status(static_cast<absl::StatusCode>(code), buf);
  return std::string(buf);
}

absl::StatusOr<std::string> MakeTempDir() {
  std::string templ = (std::filesystem::temp_directory_path() / "wsync-sync-XXXXXX").string();
  if (mkdtemp(templ.data()) == nullptr) return absl::InternalError("mkdtemp failed");
  return templ;
}

// Every rank asks for the layouts in the same order (Split is collective).
TrainerComms& CommsFor(const ParallelLayout& layout) {
  std::map<std::string, TrainerComms>& cache = *comms_cache;
  const std::string key = layout.DebugString();
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto c = MakeTrainerComms(*world, layout, kTimeout);
    if (!c.ok()) {
      std::fprintf(stderr, "MakeTrainerComms: %s\n", c.status().ToString().c_str());
      std::abort();  // the other ranks would hang; mpirun tears the job down
    }
    it = cache.emplace(key, std::move(*c)).first;
  }
  return it->second;
}

// All ranks' strings, in rank order.
std::vector<std::string> AllGatherStrings(const std::string& mine) {
  uint64_t n = mine.size();
  std::vector<uint64_t> sizes(static_cast<size_t>(world->size()));
  comm::ConstBytes in{&n, sizeof(n)};
  comm::MutableBytes out{sizes.data(), sizes.size() * sizeof(uint64_t)};
  EXPECT_TRUE(comm::Await(world->AllGather({&in, 1}, {&out, 1}, kTimeout)).ok());
  std::vector<size_t> counts(sizes.begin(), sizes.end());
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::string all(total, '\0');
  EXPECT_TRUE(
      comm::Await(world->AllGatherV({mine.data(), mine.size()}, {all.data(), all.size()}, counts, kTimeout)).ok());
  std::vector<std::string> res;
  size_t off = 0;
  for (size_t c : counts) res.push_back(all.substr(off, c)), off += c;
  return res;
}

// --- The model cases ----------------------------------------------------------------------------

struct ModelCase {
  std::string name;
  Architecture arch;
  bool tie;
  int64_t q_lora_rank = 32;
  int64_t mtp = 0;  // MTP layers trained and synced (num_nextn_predict_layers = mtp_num_layers)
};

tools::SyntheticModelOptions TinyOptions(const ModelCase& c) {
  tools::SyntheticModelOptions o;
  o.arch = c.arch;
  o.hidden = 64, o.layers = 4, o.heads = 8, o.kv_heads = 4, o.head_dim = 16, o.ffn = 96;
  o.moe_ffn = 32, o.experts = 8, o.topk = 2, o.vocab = 1000, o.tie = c.tie;
  o.q_lora_rank = c.q_lora_rank, o.kv_lora_rank = 32, o.qk_nope_head_dim = 16, o.qk_rope_head_dim = 8;
  o.v_head_dim = 16, o.shared_experts = 1, o.first_k_dense = 1, o.mtp_layers = c.mtp;
  return o;
}

bool IsMoe(Architecture a) { return a == Architecture::kQwen3Moe || a == Architecture::kDeepseekV3; }

struct LayoutCase {
  std::string name;
  int np, tp, pp, ep, etp;  // dense models run with ep = 1 and etp = tp
};

struct Fixture {
  std::string root, hf_dir, src_dir;
};

// Rank 0 writes root/hf (config.json + model.safetensors) and root/src (the Megatron source).
absl::StatusOr<Fixture> MakeFixture(const tools::SyntheticModelOptions& o, const LayoutCase& l, uint64_t seed,
                                    const std::function<absl::Status(tools::SyntheticModel&)>& mutate = nullptr) {
  auto make = [&]() -> absl::StatusOr<std::string> {
    ASSIGN_OR_RETURN(std::string dir, MakeTempDir());
    ASSIGN_OR_RETURN(tools::SyntheticModel m, tools::GenerateSyntheticModel(o, seed, 2));
    if (mutate) RETURN_IF_ERROR(mutate(m));
    RETURN_IF_ERROR(tools::WriteHfModel(m, dir + "/hf"));
    SourceParallel p;
    const bool moe = IsMoe(o.arch);
    p.tp = l.tp, p.pp = l.pp, p.ep = moe ? l.ep : 1, p.etp = moe ? l.etp : l.tp;
    p.world_size = l.np;
    p.dp = l.np / (l.tp * l.pp);
    p.mtp_num_layers = o.mtp_layers;
    ASSIGN_OR_RETURN(p, ResolveSourceParallel(m.config, p));
    RETURN_IF_ERROR(tools::WriteMegatronSource(m.config_json, m.config, m.weights, p, dir + "/src").status());
    return dir;
  };
  ASSIGN_OR_RETURN(std::string root, RootMakes(make));
  return Fixture{root, root + "/hf", root + "/src"};
}

void RemoveFixture(const Fixture& f) {
  EXPECT_TRUE(comm::Await(world->Barrier(kTimeout)).ok());
  if (world->rank() == 0) std::filesystem::remove_all(f.root);
}

struct SyncResult {
  absl::StatusOr<SyncReport> report = absl::UnknownError("not run");
  std::optional<CaptureSink> sink;
};

SyncResult SyncOnce(const DirSource& src, const SyncOptions& o) {
  SyncResult r;
  TrainerComms& comms = CommsFor(src.layout());
  const int me = world->rank();
  const std::vector<int> senders = StageSenders(src.layout(), src.layout().Dense(me).pp, o.spread_senders);
  if (std::find(senders.begin(), senders.end(), me) != senders.end()) r.sink.emplace();
  r.report = RunRankSync(src, comms, r.sink ? &*r.sink : nullptr, o);
  return r;
}

// The sync every rank just ran delivered exactly HF_DIR converted (and quantized) directly: each
// source checks its tensors bit for bit, then all names meet on rank 0 (collective: every rank calls).
void CheckSyncAgainstHf(const SyncResult& r, const DirSource& src, const SyncOptions& o, const std::string& hf_dir,
                        const std::optional<QuantizationConfig>& quant, int64_t mtp = 0) {
  EXPECT_TRUE(r.report.ok()) << r.report.status();
  std::string names;
  const int me = world->rank();
  if (r.sink && r.report.ok()) {
    EXPECT_TRUE(r.report->source);
    const int stage = src.layout().Dense(me).pp;
    std::map<std::string, Captured> got = DecodeStream(*r.sink, o.bucket_bytes, o.version, stage);
    EXPECT_EQ(r.report->tensors, got.size());
    EXPECT_EQ(r.report->buckets, r.sink->buckets.size());
    auto expected = ExpectedSentTensorsFromDir(hf_dir, quant, {}, mtp);
    EXPECT_TRUE(expected.ok()) << expected.status();
    if (expected.ok()) names = ExpectSentAsExpected(got, expected->tensors, stage);
  }
  const std::vector<std::string> per_rank = AllGatherStrings(names);
  if (me == 0 && r.report.ok()) {
    auto expected = ExpectedSentTensorsFromDir(hf_dir, quant, {}, mtp);
    ASSERT_TRUE(expected.ok()) << expected.status();
    std::map<std::string, int> count;
    for (const std::string& s : per_rank)
      for (absl::string_view n : absl::StrSplit(s, '\n', absl::SkipEmpty())) ++count[std::string(n)];
    for (const model::HfTensor& t : expected->tensors) {
      EXPECT_EQ(count[t.name], 1) << t.name << " sent " << count[t.name] << " times across the stages";
      count.erase(t.name);
    }
    for (const auto& [n, k] : count) ADD_FAILURE() << "unexpected tensor " << n << " sent " << k << " times";
  }
}

// With INT4 experts gathered (EP or ETP > 1), every rank of the expert block (edp = 0) quantizes:
// the EP members their experts, ETP ranks their shards of GLU fc1 (row blocks); otherwise only
// stage sources quantize.
void CheckWhoQuantized(const SyncResult& r, const ParallelLayout& layout, bool int4_experts) {
  if (!r.report.ok()) return;
  const ExpertCoord e = layout.Expert(world->rank());
  const bool member = int4_experts && (layout.ep() > 1 || layout.etp() > 1) && e.edp == 0;
  if (member) {
    EXPECT_GT(r.report->quantized_bytes, 0u) << "rank " << world->rank() << ": EP members quantize their experts";
  } else if (!r.report->source) {
    EXPECT_EQ(r.report->quantized_bytes, 0u) << "rank " << world->rank();
  }
}

// --- Bit-exact sync for every architecture and layout -------------------------------------------

struct Param {
  LayoutCase layout;
  ModelCase model;
  bool int4;
  bool spread = false;  // SyncOptions::spread_senders (sharded delivery's senders)
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.layout.name << " " << p.model.name << (p.int4 ? " int4" : " bf16") << (p.spread ? " spread" : "");
}

class TrainerSyncTest : public ::testing::TestWithParam<Param> {};

TEST_P(TrainerSyncTest, SendsExactlyTheConvertedCheckpoint) {
  const Param& P = GetParam();
  if (P.layout.np != world->size()) GTEST_SKIP() << "layout " << P.layout.name << " runs with -np " << P.layout.np;
  const tools::SyntheticModelOptions mo = TinyOptions(P.model);
  auto fixture = MakeFixture(mo, P.layout, 20261121);
  ASSERT_TRUE(fixture.ok()) << fixture.status();  // same result on every rank
  auto src = DirSource::Open(fixture->src_dir);
  ASSERT_TRUE(src.ok()) << src.status();
  std::optional<QuantizationConfig> quant;
  if (P.int4) {
    auto q = ParseQuantizationConfig(testing::kInt4Json, "test int4 config");
    ASSERT_TRUE(q.ok()) << q.status();
    quant = std::move(*q);
  }
  SyncOptions o;
  o.version = 42;
  // Small buckets (several per stage; the embedding is larger than a bucket) and gathers split
  // into several batches; the second size fits most of a stage in one bucket.
  o.bucket_bytes = (P.model.tie ? 16 : 96) << 10;
  o.gather_bytes = 40 << 10;
  o.quant = quant ? &*quant : nullptr;
  o.quant_threads = 2;
  o.collective = kTimeout;
  o.spread_senders = P.spread;
  SyncResult r = SyncOnce(*src, o);
  CheckSyncAgainstHf(r, *src, o, fixture->hf_dir, quant, P.model.mtp);
  CheckWhoQuantized(r, src->layout(), P.int4 && IsMoe(P.model.arch));
  RemoveFixture(*fixture);
}

std::vector<Param> AllParams() {
  const std::vector<LayoutCase> layouts = {
      {"tp2_ep2_etp1", 4, 2, 1, 2, 1},
      {"tp1_ep4", 4, 1, 1, 4, 1},
      {"tp4", 4, 4, 1, 1, 4},
      {"tp2_ep2_etp2_pp2", 8, 2, 2, 2, 2},
  };
  const std::vector<ModelCase> models = {
      {"llama", Architecture::kLlama, false},
      {"llama_tied", Architecture::kLlama, true},
      {"qwen2", Architecture::kQwen2, false},
      {"qwen2_tied", Architecture::kQwen2, true},
      {"qwen3", Architecture::kQwen3, false},
      {"qwen3_tied", Architecture::kQwen3, true},
      {"qwen3moe", Architecture::kQwen3Moe, false},
      {"deepseek", Architecture::kDeepseekV3, false},
      {"deepseek_tied", Architecture::kDeepseekV3, true},
      {"deepseek_no_qlora", Architecture::kDeepseekV3, false, 0},
      {"deepseek_mtp", Architecture::kDeepseekV3, false, 32, 1},  // mtp.layers.0 on the last stage
  };
  std::vector<Param> out;
  for (const auto& l : layouts)
    for (const auto& m : models)
      for (bool int4 : {false, true}) out.push_back({l, m, int4});
  // Spread senders under mpirun: a dense, a MoE and an MLA model, every layout.
  for (const auto& l : layouts)
    for (const auto& m : models)
      if (m.name == "llama" || m.name == "qwen3moe" || m.name == "deepseek")
        for (bool int4 : {false, true}) out.push_back({l, m, int4, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, TrainerSyncTest, ::testing::ValuesIn(AllParams()),
                         [](const ::testing::TestParamInfo<Param>& i) {
                           return absl::StrCat(i.param.layout.name, "_", i.param.model.name,
                                               i.param.int4 ? "_int4" : "_bf16", i.param.spread ? "_spread" : "");
                         });

// Experts partly ignored, differently per EP member: an expert parameter whose HF tensors are not
// all INT4 targets on every member is gathered in bf16 and converted by the source (which
// quantizes the targets among them); the others are quantized by their members. Bit-exact.
TEST(TrainerSyncMixedTest, ExpertsIgnoredOnSomeMembersOnlyAreSentExactly) {
  // Group 32, experts partly ignored; then channelwise (one group per row: with ETP 2, fc2's
  // column blocks are not whole groups). moe_ffn 64: with ETP 2, fc2's blocks of 32 columns are
  // whole groups of 32, quantized by each ETP rank.
  constexpr const char kMixedJson[] = R"json({
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "strategy": "group", "group_size": 32, "symmetric": true, "actorder": null, "dynamic": false}}},
    "ignore": ["lm_head", "re:.*self_attn\\.(q|k|v)_proj$", "re:.*mlp\\.gate$",
               "model.layers.1.mlp.experts.6", "model.layers.2.mlp.experts.1.up_proj",
               "re:model\\.layers\\.3\\.mlp\\.experts\\.[0-9]+\\.down_proj"]})json";
  constexpr const char kChannelwiseJson[] = R"json({
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "strategy": "channel", "group_size": null, "symmetric": true, "actorder": null, "dynamic": false}}},
    "ignore": ["lm_head", "re:.*mlp\\.gate$"]})json";
  const std::vector<LayoutCase> layouts = {
      {"tp2_ep2_etp1", 4, 2, 1, 2, 1}, {"tp1_ep4", 4, 1, 1, 4, 1}, {"tp2_ep2_etp2_pp2", 8, 2, 2, 2, 2}};
  for (const char* json : {kMixedJson, kChannelwiseJson}) {
    auto q = ParseQuantizationConfig(json, "test int4 config");
    ASSERT_TRUE(q.ok()) << q.status();
    for (const ModelCase& m : {ModelCase{"qwen3moe", Architecture::kQwen3Moe, false},
                               ModelCase{"deepseek", Architecture::kDeepseekV3, false}}) {
      for (const LayoutCase& l : layouts) {
        if (l.np != world->size()) continue;
        SCOPED_TRACE(absl::StrCat(m.name, " ", l.name, " group ", q->group_size));
        tools::SyntheticModelOptions mo = TinyOptions(m);
        mo.moe_ffn = 64;
        auto f = MakeFixture(mo, l, 17);
        ASSERT_TRUE(f.ok()) << f.status();
        auto src = DirSource::Open(f->src_dir);
        ASSERT_TRUE(src.ok()) << src.status();
        SyncOptions o;
        o.version = 3;
        o.bucket_bytes = 32 << 10;
        o.gather_bytes = 12 << 10;
        o.quant = &*q;
        o.quant_threads = 1;
        o.collective = kTimeout;
        SyncResult r = SyncOnce(*src, o);
        CheckSyncAgainstHf(r, *src, o, f->hf_dir, *q);
        CheckWhoQuantized(r, src->layout(), true);
        RemoveFixture(*f);
      }
    }
  }
}

// --- Malformed sources ---------------------------------------------------------------------------

const LayoutCase kMoeLayout = {"tp2_ep2_etp1", 4, 2, 1, 2, 1};

class MalformedSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (world->size() != 4) GTEST_SKIP() << "runs with -np 4";
  }
  // Every rank must fail at once with the same error.
  void ExpectAllFail(const Fixture& f, absl::StatusCode code, const std::vector<std::string>& needles) {
    auto src = DirSource::Open(f.src_dir);
    ASSERT_TRUE(src.ok()) << src.status();
    SyncOptions o;
    o.bucket_bytes = 64 << 10;
    o.collective = kTimeout;
    const absl::Time t0 = absl::Now();
    SyncResult r = SyncOnce(*src, o);
    EXPECT_LT(absl::Now() - t0, absl::Seconds(20)) << "failing took too long";
    ASSERT_FALSE(r.report.ok());
    EXPECT_EQ(r.report.status().code(), code) << r.report.status();
    for (const std::string& n : needles)
      EXPECT_TRUE(absl::StrContains(r.report.status().message(), n)) << r.report.status();
    const std::vector<std::string> all = AllGatherStrings(r.report.status().ToString());
    for (const std::string& s : all) EXPECT_EQ(s, all[0]) << "ranks disagree on the error";
    if (r.sink) {
      EXPECT_TRUE(r.sink->buckets.empty()) << "nothing may be sent";
    }
  }
};

tools::SyntheticModelOptions MoeOptions() { return TinyOptions({"qwen3moe", Architecture::kQwen3Moe, false}); }

TEST_F(MalformedSourceTest, AMissingRankFileFailsEveryRankNamingIt) {
  auto f = MakeFixture(MoeOptions(), kMoeLayout, 7);
  ASSERT_TRUE(f.ok()) << f.status();
  if (world->rank() == 0) std::filesystem::remove(f->src_dir + "/rank-00002.safetensors");
  ASSERT_TRUE(comm::Await(world->Barrier(kTimeout)).ok());
  ExpectAllFail(*f, absl::StatusCode::kNotFound, {"rank 2 cannot take part", "rank-00002.safetensors"});
  RemoveFixture(*f);
}

TEST_F(MalformedSourceTest, ATruncatedRankFileFailsEveryRankNamingIt) {
  auto f = MakeFixture(MoeOptions(), kMoeLayout, 8);
  ASSERT_TRUE(f.ok()) << f.status();
  if (world->rank() == 0) {
    const std::string p = f->src_dir + "/rank-00001.safetensors";
    std::filesystem::resize_file(p, std::filesystem::file_size(p) / 2);
  }
  ASSERT_TRUE(comm::Await(world->Barrier(kTimeout)).ok());
  ExpectAllFail(*f, absl::StatusCode::kInvalidArgument, {"rank 1 cannot take part", "rank-00001.safetensors"});
  RemoveFixture(*f);
}

TEST_F(MalformedSourceTest, AMisShapedRankFileFailsEveryRankNamingTheParameter) {
  // Rank 3's file replaced by rank 3's file of a model with a wider FFN.
  auto f = MakeFixture(MoeOptions(), kMoeLayout, 9);
  ASSERT_TRUE(f.ok()) << f.status();
  tools::SyntheticModelOptions wide = MoeOptions();
  wide.moe_ffn = 64;
  auto other = MakeFixture(wide, kMoeLayout, 9);
  ASSERT_TRUE(other.ok()) << other.status();
  if (world->rank() == 0)
    std::filesystem::copy_file(other->src_dir + "/rank-00003.safetensors", f->src_dir + "/rank-00003.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
  ASSERT_TRUE(comm::Await(world->Barrier(kTimeout)).ok());
  ExpectAllFail(*f, absl::StatusCode::kInvalidArgument,
                {"rank 3 cannot take part", "rank-00003.safetensors", "mlp.experts.linear_fc1.weight"});
  RemoveFixture(*other);
  RemoveFixture(*f);
}

TEST_F(MalformedSourceTest, RanksWithDifferentGatherSizesRefuseBeforeAnyGather) {
  // Different batch boundaries would pair mismatched collectives: the opening agreement refuses.
  auto f = MakeFixture(MoeOptions(), kMoeLayout, 13);
  ASSERT_TRUE(f.ok()) << f.status();
  auto src = DirSource::Open(f->src_dir);
  ASSERT_TRUE(src.ok()) << src.status();
  SyncOptions o;
  o.collective = kTimeout;
  o.gather_bytes = world->rank() == 1 ? (8 << 10) : (16 << 10);
  SyncResult r = SyncOnce(*src, o);
  ASSERT_FALSE(r.report.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(r.report.status())) << r.report.status();
  EXPECT_TRUE(absl::StrContains(r.report.status().message(), "rank 1 runs a different")) << r.report.status();
  RemoveFixture(*f);
}

// Where a NaN lands: HF tensor `name`, element `element`; quantized by the stage source of `stage`
// (ep_rank < 0: a dense tensor) or by the rank of the expert block holding it (etp_rank, ep_rank).
struct NanCase {
  std::string name;
  int64_t element = 17;
  int stage = 0, ep_rank = -1, etp_rank = 0;
};

// The NaN's quantizer fails naming the tensor; the ETP merger (etp = 0) of its EP rank, if another
// rank, fails naming it and the quantizer; the stage source, if another rank, fails naming it
// and the EP rank it came from, sends no last bucket and no Finish; every other rank finishes.
// No rank hangs.
void ExpectNanFailsItsQuantizerAndTheSource(const LayoutCase& layout, const NanCase& c, uint64_t seed,
                                            const char* quant_json = testing::kInt4Json) {
  auto f = MakeFixture(MoeOptions(), layout, seed, [&](tools::SyntheticModel& m) -> absl::Status {
    ASSIGN_OR_RETURN(TensorView v, m.weights.Get(c.name));
    auto* p = const_cast<std::byte*>(v.bytes().data());  // owned by the in-memory checkpoint
    const uint16_t nan = 0x7fc0;
    std::memcpy(p + 2 * c.element, &nan, 2);
    return absl::OkStatus();
  });
  ASSERT_TRUE(f.ok()) << f.status();
  auto src = DirSource::Open(f->src_dir);
  ASSERT_TRUE(src.ok()) << src.status();
  const ParallelLayout& l = src->layout();
  const int source = l.StageSourceRank(c.stage);
  int quantizer = source, merger = source;
  if (c.ep_rank >= 0)
    for (int r = 0; r < l.world_size(); ++r) {
      if (l.Expert(r) == ExpertCoord{c.etp_rank, c.ep_rank, 0, c.stage}) quantizer = r;
      if (l.Expert(r) == ExpertCoord{0, c.ep_rank, 0, c.stage}) merger = r;
    }
  auto q = ParseQuantizationConfig(quant_json, "test int4 config");
  ASSERT_TRUE(q.ok()) << q.status();
  SyncOptions o;
  o.bucket_bytes = 16 << 10;
  o.gather_bytes = 8 << 10;
  o.quant = &*q;
  o.quant_threads = 2;
  o.collective = kTimeout;
  const absl::Time t0 = absl::Now();
  SyncResult r = SyncOnce(*src, o);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20));
  const int me = world->rank();
  if (me == source || me == quantizer || me == merger) {
    ASSERT_FALSE(r.report.ok()) << "rank " << me;
    const std::string msg(r.report.status().message());
    EXPECT_TRUE(absl::IsInvalidArgument(r.report.status())) << r.report.status();
    EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("\"", c.name, "\""))) << r.report.status();
    EXPECT_TRUE(absl::StrContains(msg, "NaN")) << r.report.status();
    if (me == quantizer) {
      const std::string role = me == source ? absl::StrCat(" (stage ", c.stage, " source)") : "";
      EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("rank ", me, role, ": quantizing"))) << r.report.status();
    } else if (me == merger) {  // the quantizer is one of its ETP ranks
      EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("ETP rank ", c.etp_rank, " (world rank ", quantizer, ")")))
          << r.report.status();
    }
    if (me == source) {
      EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("rank ", me, " (stage ", c.stage, " source)")))
          << r.report.status();
      if (merger != source) {
        EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("EP rank ", c.ep_rank, " (world rank ", merger, ")")))
            << r.report.status();
      }
      EXPECT_EQ(r.sink->finishes, 0) << "a failed stream is not finished";
      for (const auto& b : r.sink->buckets) EXPECT_FALSE(b.manifest.last());
    }
  } else {
    EXPECT_TRUE(r.report.ok()) << "rank " << me << ": " << r.report.status();
    if (r.sink) {
      EXPECT_EQ(r.sink->finishes, 1) << "the other stage finishes its stream";
    }
  }
  RemoveFixture(*f);
}

TEST_F(MalformedSourceTest, ANanAPeerQuantizerRefusesFailsThatPeerAndTheSourceWhileTheOthersFinish) {
  // Expert 6 of 8 is held by EP rank 1 (world rank 1), which quantizes it.
  ExpectNanFailsItsQuantizerAndTheSource(kMoeLayout, {"model.layers.1.mlp.experts.6.down_proj.weight", 17, 0, 1}, 10);
}

TEST_F(MalformedSourceTest, ANanInTheSourcesOwnExpertFailsTheSourceWhileTheOthersFinish) {
  ExpectNanFailsItsQuantizerAndTheSource(kMoeLayout, {"model.layers.2.mlp.experts.1.gate_proj.weight", 17, 0, 0}, 14);
}

TEST_F(MalformedSourceTest, ANanInADenseTensorFailsTheSourceWhileTheOthersFinish) {
  ExpectNanFailsItsQuantizerAndTheSource(kMoeLayout, {"model.layers.3.self_attn.o_proj.weight", 17, 0, -1}, 15);
}

// ETP 2 (np8, stage 1 = layers 2-3, experts 4-7 on EP rank 1). gate_proj / up_proj [32, 64]: rows
// 16-31 of each are ETP rank 1's shard, rows 0-15 ETP rank 0's; each quantizes its own. down_proj
// [64, 32]: ETP splits its 32 columns into blocks of 16, less than a group of 32, so fc2 is merged
// in bf16 and quantized by the merger (etp 0), whichever shard the NaN came from.
TEST(TrainerSyncNp8Test, ANanInAnEtpPeersShardFailsThatPeerItsMergerAndItsStageSourceOnly) {
  if (world->size() != 8) GTEST_SKIP() << "runs with -np 8";
  const LayoutCase l = {"tp2_ep2_etp2_pp2", 8, 2, 2, 2, 2};
  ExpectNanFailsItsQuantizerAndTheSource(l, {"model.layers.3.mlp.experts.5.gate_proj.weight", 16 * 64 + 5, 1, 1, 1},
                                         16);
  ExpectNanFailsItsQuantizerAndTheSource(l, {"model.layers.2.mlp.experts.7.up_proj.weight", 3 * 64 + 60, 1, 1, 0}, 18);
}

TEST(TrainerSyncNp8Test, ANanInAnExpertMergedInBf16FailsItsMergerAndItsStageSourceOnly) {
  if (world->size() != 8) GTEST_SKIP() << "runs with -np 8";
  ExpectNanFailsItsQuantizerAndTheSource({"tp2_ep2_etp2_pp2", 8, 2, 2, 2, 2},
                                         {"model.layers.3.mlp.experts.5.down_proj.weight", 17, 1, 1, 0}, 19);
}

TEST_F(MalformedSourceTest, TheSourceIsReReadEverySyncWithAWorkspaceKeptAcrossSyncs) {
  // After the failures above the communicators are intact. Sync 1 sends model A; rank 0 then
  // rewrites the rank files in place with model B (new seed); sync 2, same DirSource and
  // workspace, must send B. Sync 2 uses larger gathers, so the workspace grows.
  auto a = MakeFixture(MoeOptions(), kMoeLayout, 11);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = MakeFixture(MoeOptions(), kMoeLayout, 12);
  ASSERT_TRUE(b.ok()) << b.status();
  auto src = DirSource::Open(a->src_dir);
  ASSERT_TRUE(src.ok()) << src.status();
  SyncWorkspace workspace;
  SyncOptions o;
  o.collective = kTimeout;
  o.workspace = &workspace;
  o.bucket_bytes = 32 << 10;
  o.gather_bytes = 16 << 10;
  o.version = 1;
  SyncResult r1 = SyncOnce(*src, o);
  CheckSyncAgainstHf(r1, *src, o, a->hf_dir, std::nullopt);
  const uint64_t held = workspace.bytes();
  if (world->rank() < 2) {
    EXPECT_GT(held, 0u) << "gathering ranks keep their buffers";
  }
  ASSERT_TRUE(comm::Await(world->Barrier(kTimeout)).ok());
  if (world->rank() == 0)
    for (int r = 0; r < 4; ++r)
      std::filesystem::copy_file(b->src_dir + "/" + RankFileName(r), a->src_dir + "/" + RankFileName(r),
                                 std::filesystem::copy_options::overwrite_existing);
  ASSERT_TRUE(comm::Await(world->Barrier(kTimeout)).ok());
  o.version = 2;
  o.gather_bytes = 256 << 10;
  SyncResult r2 = SyncOnce(*src, o);
  CheckSyncAgainstHf(r2, *src, o, b->hf_dir, std::nullopt);
  if (world->rank() < 2) {
    EXPECT_GT(workspace.bytes(), held) << "larger batches grew the workspace";
  }
  RemoveFixture(*b);
  RemoveFixture(*a);
}

}  // namespace
}  // namespace wsync::trainer_agent

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto w = wsync::comm::CreateMpiWorld();
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
    return 1;
  }
  wsync::trainer_agent::world = w->get();
  std::map<std::string, wsync::trainer_agent::TrainerComms> comms;
  wsync::trainer_agent::comms_cache = &comms;
  if (wsync::trainer_agent::world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  comms.clear();
  w->reset();
  return rc;
}
