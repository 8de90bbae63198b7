// The device stages of RunRankSync (sync/rank_sync.h), on a GPU: every rank's tensors resident in
// CUDA memory (CudaResidentSource), ToHf's copies, the CUDA INT4 kernels and the buckets on the
// device, a SpaceStagingSink to the capture sink. For dense, MoE and MLA models, bf16 and INT4,
// one and two pipeline stages, each stage's stream must equal the host stages' stream on the same
// checkpoint byte for byte (manifests and data), and the oracle (ExpectedSentTensors). A NaN in a
// device weight fails the sync naming the tensor, as on the host; two members of a gather group on
// one GPU gather on the host (host copies). With two GPUs, the TP / ETP / EP gathers run on them
// (NCCL groups over the host groups) and the streams equal the host stages' again.
// Skipped without the CUDA devices each needs.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "comm/store/store.h"
#include "common/cuda_ipc.h"
#include "kernels/dispatch.h"
#include "tools/synth/testing/world.h"
#include "trainer_agent/gather/testing/local_trainer_comms.h"
#include "trainer_agent/quantize/quant_select.h"
#include "trainer_agent/source/cuda_resident_source.h"
#include "trainer_agent/source/dir_source.h"
#include "trainer_agent/sync/rank_sync.h"
#include "trainer_agent/sync/testing/sync_capture.h"

namespace wsync::trainer_agent {
namespace {

namespace fs = std::filesystem;
using testing::CaptureSink;

struct RankResult {
  absl::StatusOr<SyncReport> report = absl::UnknownError("not run");
  std::optional<CaptureSink> sink;
};

std::vector<RankResult> SyncEveryRank(const WeightSource& src, const SyncOptions& o, const std::string& name) {
  const ParallelLayout& layout = src.layout();
  comm::MemoryStore store;
  auto comms = testing::MakeLocalTrainerComms(store, name, layout);
  EXPECT_TRUE(comms.ok()) << comms.status();
  std::vector<RankResult> results(static_cast<size_t>(layout.world_size()));
  if (!comms.ok()) return results;
  std::vector<std::thread> threads;
  for (int r = 0; r < layout.world_size(); ++r) {
    RankResult& res = results[static_cast<size_t>(r)];
    if (layout.IsStageSource(r)) res.sink.emplace();
    threads.emplace_back([&, r] {
      res.report = RunRankSync(src, comms->ranks[static_cast<size_t>(r)], res.sink ? &*res.sink : nullptr, o);
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// Rank `rank`'s stream `got` equals `want` bucket for bucket: manifests and data; one Finish.
void ExpectSameStream(const CaptureSink& want, const CaptureSink& got, size_t rank) {
  ASSERT_EQ(want.buckets.size(), got.buckets.size()) << "rank " << rank;
  for (size_t b = 0; b < want.buckets.size(); ++b) {
    EXPECT_EQ(want.buckets[b].manifest.SerializeAsString(), got.buckets[b].manifest.SerializeAsString())
        << "rank " << rank << " bucket " << b;
    EXPECT_TRUE(want.buckets[b].data == got.buckets[b].data) << "rank " << rank << " bucket " << b;
  }
  EXPECT_EQ(got.finishes, 1) << "rank " << rank;
}

struct Case {
  std::string name;
  Architecture arch;
  int pp;
  bool int4;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class RankSyncDeviceTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!kernels::GpuAvailable()) GTEST_SKIP() << "no CUDA device";
    dir_ = absl::StrCat(
        ::testing::TempDir(), "/rank_sync_device_",
        absl::StrReplaceAll(::testing::UnitTest::GetInstance()->current_test_info()->name(), {{"/", "_"}}));
    fs::remove_all(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void MakeFixture(Architecture arch, int tp, int pp, uint64_t seed, int ep = 1, int etp = 1) {
    auto m = tools::testing::SmallModel(tools::testing::SmallOptions(arch), seed);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(tools::WriteHfModel(*m, dir_ + "/hf").ok());
    auto stats = tools::WriteMegatronSource(m->config_json, m->config, m->weights,
                                            tools::testing::Parallel(tp, pp, ep, etp, 1), dir_ + "/src");
    ASSERT_TRUE(stats.ok()) << stats.status();
  }
  std::string dir_;
};

std::vector<int> AllRanks(const WeightSource& src) {
  std::vector<int> r;
  for (int i = 0; i < src.layout().world_size(); ++i) r.push_back(i);
  return r;
}

TEST_P(RankSyncDeviceTest, SendsTheHostStagesBytes) {
  const Case& c = GetParam();
  ASSERT_NO_FATAL_FAILURE(MakeFixture(c.arch, 1, c.pp, 20261126));
  auto host = DirSource::Open(dir_ + "/src");
  ASSERT_TRUE(host.ok()) << host.status();
  auto device = CudaResidentSource::Create(*host, AllRanks(*host), 0);
  ASSERT_TRUE(device.ok()) << device.status();
  std::optional<QuantizationConfig> quant;
  if (c.int4) quant = *ParseQuantizationConfig(testing::kInt4Json, "test int4 config");
  SyncOptions o;
  o.version = 5;
  o.bucket_bytes = 32 << 10;  // several buckets; the embedding gets one of its own
  o.quant = quant ? &*quant : nullptr;
  o.quant_threads = 1;
  o.collective = {absl::Seconds(30)};
  const std::vector<RankResult> on_host = SyncEveryRank(*host, o, "host");
  const std::vector<RankResult> on_device = SyncEveryRank(**device, o, "device");
  auto expected = ExpectedSentTensorsFromDir(dir_ + "/hf", quant);
  ASSERT_TRUE(expected.ok()) << expected.status();
  for (size_t r = 0; r < on_host.size(); ++r) {
    ASSERT_TRUE(on_host[r].report.ok()) << "host rank " << r << ": " << on_host[r].report.status();
    ASSERT_TRUE(on_device[r].report.ok()) << "device rank " << r << ": " << on_device[r].report.status();
    EXPECT_EQ(on_host[r].report->cuda_device, -1);
    EXPECT_EQ(on_device[r].report->cuda_device, 0);
    if (!on_host[r].sink) continue;
    ExpectSameStream(*on_host[r].sink, *on_device[r].sink, r);
    const CaptureSink& got = *on_device[r].sink;
    const int stage = host->layout().Dense(static_cast<int>(r)).pp;
    testing::ExpectSentAsExpected(testing::DecodeStream(got, o.bucket_bytes, o.version, stage), expected->tensors,
                                  stage);
    if (c.int4) {
      EXPECT_GT(on_device[r].report->quantized_bytes, 0u);
    }
    EXPECT_EQ(on_device[r].report->bytes, on_host[r].report->bytes);
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (bool int4 : {false, true})
    for (int pp : {1, 2}) {
      const std::string s = absl::StrCat("_pp", pp, int4 ? "_int4" : "_bf16");
      out.push_back({"qwen3" + s, Architecture::kQwen3, pp, int4});
      out.push_back({"qwen3moe" + s, Architecture::kQwen3Moe, pp, int4});
      out.push_back({"deepseek" + s, Architecture::kDeepseekV3, pp, int4});
    }
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, RankSyncDeviceTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

class RankSyncDeviceFailureTest : public RankSyncDeviceTest {};

// A NaN in a device weight that the sync quantizes: the sync fails naming the HF tensor, as the
// host stages do.
TEST_F(RankSyncDeviceFailureTest, ANanInADeviceWeightFailsTheSyncNamingTheTensor) {
  ASSERT_NO_FATAL_FAILURE(MakeFixture(Architecture::kQwen3, 1, 1, 3));
  auto host = DirSource::Open(dir_ + "/src");
  ASSERT_TRUE(host.ok()) << host.status();
  auto device = CudaResidentSource::Create(*host, {0}, 0);
  ASSERT_TRUE(device.ok()) << device.status();
  auto shard = (*device)->OpenRank(0);
  ASSERT_TRUE(shard.ok());
  const int i = shard->Find("decoder.layers.1.mlp.linear_fc2.weight");
  ASSERT_GE(i, 0);
  const uint16_t nan = 0x7FC0;  // bf16 quiet NaN, element 37
  ASSERT_TRUE(CopyHostToDevice(const_cast<std::byte*>(shard->tensors[static_cast<size_t>(i)].bytes().data()) + 37 * 2,
                               &nan, 2, 0)
                  .ok());
  const QuantizationConfig quant = *ParseQuantizationConfig(testing::kInt4Json, "test int4 config");
  SyncOptions o;
  o.bucket_bytes = 32 << 10;
  o.quant = &quant;
  o.collective = {absl::Seconds(30)};
  const std::vector<RankResult> results = SyncEveryRank(**device, o, "nan");
  ASSERT_FALSE(results[0].report.ok());
  EXPECT_EQ(results[0].report.status().code(), absl::StatusCode::kInvalidArgument) << results[0].report.status();
  EXPECT_TRUE(absl::StrContains(results[0].report.status().message(), "model.layers.1.mlp.down_proj.weight"))
      << results[0].report.status();
}

// TP 2 with both ranks on one GPU: NCCL refuses two members of a group on one device, so every
// rank copies its shard to host memory and the gathers and stages run on the host: the streams
// are the host stages', and no rank reports a device.
TEST_F(RankSyncDeviceFailureTest, TwoMembersOfAGatherGroupOnOneGpuGatherOnTheHost) {
  ASSERT_NO_FATAL_FAILURE(MakeFixture(Architecture::kQwen3, 2, 1, 4));
  auto host = DirSource::Open(dir_ + "/src");
  ASSERT_TRUE(host.ok()) << host.status();
  auto device = CudaResidentSource::Create(*host, {0, 1}, 0);
  ASSERT_TRUE(device.ok()) << device.status();
  SyncOptions o;
  o.bucket_bytes = 32 << 10;
  o.collective = {absl::Seconds(30)};
  const std::vector<RankResult> on_host = SyncEveryRank(*host, o, "tp2-host");
  const std::vector<RankResult> shared = SyncEveryRank(**device, o, "tp2-shared");
  for (size_t r = 0; r < shared.size(); ++r) {
    ASSERT_TRUE(on_host[r].report.ok()) << "rank " << r << ": " << on_host[r].report.status();
    ASSERT_TRUE(shared[r].report.ok()) << "rank " << r << ": " << shared[r].report.status();
    EXPECT_EQ(shared[r].report->cuda_device, -1) << "rank " << r;
    if (shared[r].sink) ExpectSameStream(*on_host[r].sink, *shared[r].sink, r);
  }
}

// The device gathers (two GPUs): TP 2, EP 2 and ETP 2 layouts with rank r's tensors on cuda:r; the
// TP / ETP / EP all-gathers run over NCCL groups formed over the host groups, the merges and the
// holders' INT4 quantization on the GPUs. Every stage's stream equals the host stages' byte for
// byte, as on one GPU.
struct GatherCase {
  std::string name;
  Architecture arch;
  int tp, ep, etp;
  bool int4;
};
void PrintTo(const GatherCase& c, std::ostream* os) { *os << c.name; }

class RankSyncDeviceGatherTest : public ::testing::TestWithParam<GatherCase> {
 protected:
  void SetUp() override {
    auto n = kernels::CudaDeviceCount();
    if (!n.ok() || *n < 2) GTEST_SKIP() << "the device gathers need two CUDA devices";
    dir_ = absl::StrCat(::testing::TempDir(), "/rank_sync_device_gather_", GetParam().name);
    fs::remove_all(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string dir_;
};

TEST_P(RankSyncDeviceGatherTest, GathersOnTheGpusSendTheHostStagesBytes) {
  const GatherCase& c = GetParam();
  auto m = tools::testing::SmallModel(tools::testing::SmallOptions(c.arch), 20261127);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(tools::WriteHfModel(*m, dir_ + "/hf").ok());
  ASSERT_TRUE(tools::WriteMegatronSource(m->config_json, m->config, m->weights,
                                         tools::testing::Parallel(c.tp, 1, c.ep, c.etp, 1), dir_ + "/src")
                  .ok());
  auto host = DirSource::Open(dir_ + "/src");
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_EQ(host->layout().world_size(), 2);
  auto device = CudaResidentSource::Create(*host, std::vector<int>{0, 1}, std::vector<int>{0, 1});
  ASSERT_TRUE(device.ok()) << device.status();
  std::optional<QuantizationConfig> quant;
  if (c.int4) quant = *ParseQuantizationConfig(testing::kInt4Json, "test int4 config");
  SyncOptions o;
  o.version = 9;
  o.bucket_bytes = 32 << 10;
  o.gather_bytes = 16 << 10;  // several gather batches, both slots
  o.quant = quant ? &*quant : nullptr;
  o.quant_threads = 1;
  o.collective = {absl::Seconds(60)};
  const std::vector<RankResult> on_host = SyncEveryRank(*host, o, "host");
  const std::vector<RankResult> on_device = SyncEveryRank(**device, o, "device");
  for (size_t r = 0; r < on_host.size(); ++r) {
    ASSERT_TRUE(on_host[r].report.ok()) << "host rank " << r << ": " << on_host[r].report.status();
    ASSERT_TRUE(on_device[r].report.ok()) << "device rank " << r << ": " << on_device[r].report.status();
    EXPECT_EQ(on_device[r].report->cuda_device, static_cast<int>(r));
    EXPECT_GT(on_device[r].report->gather_calls, 0u) << "rank " << r;
    if (!on_host[r].sink) continue;
    ExpectSameStream(*on_host[r].sink, *on_device[r].sink, r);
  }
}

std::vector<GatherCase> GatherCases() {
  std::vector<GatherCase> out;
  for (bool int4 : {false, true}) {
    const std::string s = int4 ? "_int4" : "_bf16";
    out.push_back({"qwen3_tp2" + s, Architecture::kQwen3, 2, 1, 1, int4});
    out.push_back({"qwen3moe_ep2" + s, Architecture::kQwen3Moe, 1, 2, 1, int4});
    out.push_back({"qwen3moe_tp2_etp2" + s, Architecture::kQwen3Moe, 2, 1, 2, int4});
    out.push_back({"deepseek_tp2_ep2" + s, Architecture::kDeepseekV3, 2, 2, 1, int4});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, RankSyncDeviceGatherTest, ::testing::ValuesIn(GatherCases()),
                         [](const ::testing::TestParamInfo<GatherCase>& i) { return i.param.name; });

}  // namespace
}  // namespace wsync::trainer_agent
