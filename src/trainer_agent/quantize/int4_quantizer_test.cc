// The trainer's INT4 work on its own: which expert parameters their holders quantize and how
// (fc1 / fc2, ETP 1 / 2, group sizes that do and do not divide K / ETP, experts ignored on one EP
// member), row quantization of any split bit-exact to quantizing the whole tensor (seeded random
// weights, an all-zero group), a NaN refused naming the HF tensor, the INT4 shard merge, and the
// triplets written into a bucket bit-exact to model::QuantizeHfTensor; AWQ experts the same way
// (their blocks of AWQ triples, by holder, by ETP shard and merged, in both arithmetics).
#include "trainer_agent/quantize/int4_quantizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "model/quant_target.h"
#include "tools/synth/testing/world.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 20261121;

// A compressed-tensors INT4 config of group size `group` (kernels::kChannelwise: per row) that
// quantizes every Linear but lm_head and the routers; `ignore` is appended to the ignore list.
QuantizationConfig Int4Config(int group, const std::string& ignore = "") {
  const std::string strategy = group == kernels::kChannelwise ? "channel" : "group";
  const std::string size = group == kernels::kChannelwise ? "null" : std::to_string(group);
  const std::string json = absl::StrCat(
      R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "strategy": ")",
      strategy, R"(", "group_size": )", size, R"(, "symmetric": true, "actorder": null,
      "dynamic": false}}}, "ignore": ["lm_head", "re:.*mlp\\.gate$")",
      ignore.empty() ? "" : absl::StrCat(", \"", ignore, "\""), "]}");
  auto q = ParseQuantizationConfig(json, "test int4 config");
  EXPECT_TRUE(q.ok()) << q.status();
  return q.ok() ? *q : QuantizationConfig();
}

uint64_t AlignUp(uint64_t x) { return (x + 63) / 64 * 64; }

// A Qwen3-MoE model (hidden 64, 8 experts of width moe_ffn) sharded TP 2 x EP 2 with ETP `etp`.
struct Fixture {
  tools::SyntheticModel model;
  tools::testing::World world;
};
absl::StatusOr<Fixture> MakeFixture(int etp, int64_t moe_ffn) {
  tools::SyntheticModelOptions o = tools::testing::SmallOptions(Architecture::kQwen3Moe);
  o.moe_ffn = moe_ffn;
  Fixture f;
  ASSIGN_OR_RETURN(f.model, tools::testing::SmallModel(o, kSeed));
  ASSIGN_OR_RETURN(f.world, tools::testing::BuildWorld(f.model, tools::testing::Parallel(2, 1, 2, etp, 2)));
  return f;
}

// World rank `rank`'s tensor of local expert `expert` of kind `kind` in the first MoE layer.
const tools::RankTensor& ExpertOf(const Fixture& f, int rank, ShardKind kind, int64_t expert = 0) {
  for (const tools::RankTensor& t : f.world.ranks.at(rank))
    if (t.param.is_expert && t.param.kind == kind && t.param.local_expert == expert) return t;
  ADD_FAILURE() << "rank " << rank << " holds no expert " << expert << " of kind " << ShardKindName(kind);
  return f.world.ranks.at(rank).front();
}

// The same parameter in the plan of every EP member of `rank` (global expert ids differ).
std::vector<const MegatronParam*> OnMembers(const Fixture& f, int rank, const MegatronParam& p) {
  std::vector<const MegatronParam*> out;
  for (int member : f.world.layout.EpGroup(rank))
    for (const tools::RankTensor& t : f.world.ranks.at(member))
      if (t.param.local_name == p.local_name) out.push_back(&t.param);
  EXPECT_EQ(out.size(), static_cast<size_t>(f.world.layout.ep()));
  return out;
}

std::optional<Int4ExpertPlan> Plan(const Fixture& f, const Int4Quantizer& q, int rank, const MegatronParam& p) {
  auto plan = q.PlanExpert(f.model.config, p, OnMembers(f, rank, p), f.world.layout.etp());
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : std::nullopt;
}

// The world rank with expert coordinates (etp, ep = 0, edp = 0).
int EtpRank(const Fixture& f, int etp) { return f.world.layout.ExpertRank(ExpertCoord{etp, 0, 0, 0}); }

// --- Planning -----------------------------------------------------------------------------------

TEST(Int4PlanTest, Etp1QuantizesWholeExpertsWithGluHalvesAsRowBlocks) {
  auto f = MakeFixture(/*etp=*/1, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  const QuantizationConfig quant = Int4Config(32);
  const Int4Quantizer q({.quant = &quant});
  // fc1 [2f, H] = [gate; up], f = 32, H = 64: packed [64, 8] int32, scales [64, 2] bf16.
  const MegatronParam& fc1 = ExpertOf(*f, 0, ShardKind::kExpertGluFc1).param;
  std::optional<Int4ExpertPlan> plan = Plan(*f, q, 0, fc1);
  ASSERT_TRUE(plan.has_value());
  EXPECT_TRUE(plan->by_shard);
  EXPECT_EQ(plan->packed.full_shape, (Shape{64, 8}));
  EXPECT_EQ(plan->scales.full_shape, (Shape{64, 2}));
  EXPECT_EQ(plan->packed_bytes, 64u * 8 * 4);
  EXPECT_EQ(plan->scale_offset, AlignUp(plan->packed_bytes));
  EXPECT_EQ(plan->scale_bytes, 64u * 2 * 2);
  EXPECT_EQ(plan->block_bytes, AlignUp(plan->scale_offset + plan->scale_bytes));
  EXPECT_EQ(plan->hf_shapes, (std::vector<Shape>{{32, 64}, {32, 64}}));
  const std::vector<RowSegment> glu = {{0, 0, 0, 32}, {1, 32, 0, 32}};
  EXPECT_EQ(plan->full_rows, glu);
  EXPECT_EQ(plan->local_rows, glu);
  EXPECT_EQ(plan->local_block, 0u) << "no ETP shard blocks with ETP 1";
  // fc2 [H, f]: one HF tensor, every row.
  const MegatronParam& fc2 = ExpertOf(*f, 0, ShardKind::kExpertDim1).param;
  plan = Plan(*f, q, 0, fc2);
  ASSERT_TRUE(plan.has_value());
  EXPECT_TRUE(plan->by_shard);
  EXPECT_EQ(plan->packed.full_shape, (Shape{64, 4}));
  EXPECT_EQ(plan->full_rows, (std::vector<RowSegment>{{0, 0, 0, 64}}));
  EXPECT_EQ(plan->local_rows, plan->full_rows);
}

TEST(Int4PlanTest, Etp2QuantizesFc1ShardsByRows) {
  auto f = MakeFixture(/*etp=*/2, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  const QuantizationConfig quant = Int4Config(32);
  const Int4Quantizer q({.quant = &quant});
  for (int e = 0; e < 2; ++e) {
    SCOPED_TRACE(absl::StrCat("ETP rank ", e));
    const int rank = EtpRank(*f, e);
    const MegatronParam& fc1 = ExpertOf(*f, rank, ShardKind::kExpertGluFc1).param;
    ASSERT_EQ(fc1.rank_in_group, e);
    std::optional<Int4ExpertPlan> plan = Plan(*f, q, rank, fc1);
    ASSERT_TRUE(plan.has_value());
    EXPECT_TRUE(plan->by_shard);
    // The shard [g_e; u_e] is rows [16e, 16e + 16) of gate_proj, then of up_proj.
    EXPECT_EQ(plan->local_rows, (std::vector<RowSegment>{{0, 0, 16 * e, 16}, {1, 16, 16 * e, 16}}));
    EXPECT_EQ(plan->full_rows, (std::vector<RowSegment>{{0, 0, 0, 32}, {1, 32, 0, 32}}));
    EXPECT_EQ(plan->packed.local_shape, (Shape{32, 8}));
    EXPECT_EQ(plan->scales.local_shape, (Shape{32, 2}));
    EXPECT_EQ(plan->local_packed_bytes, 32u * 8 * 4);
    EXPECT_EQ(plan->local_scale_offset, AlignUp(plan->local_packed_bytes));
    EXPECT_EQ(plan->local_block, AlignUp(plan->local_scale_offset + 32u * 2 * 2));
  }
}

TEST(Int4PlanTest, Etp2QuantizesFc2ShardsOnlyWhenTheyHoldWholeGroups) {
  struct Want {
    int64_t moe_ffn;
    int group;
    bool by_shard;
  };
  // K = moe_ffn, K / ETP = moe_ffn / 2 columns per shard.
  for (const Want& w :
       {Want{64, 32, true}, Want{32, 32, false}, Want{64, 64, false}, Want{64, kernels::kChannelwise, false}}) {
    SCOPED_TRACE(absl::StrCat("moe_ffn ", w.moe_ffn, ", group ", w.group));
    auto f = MakeFixture(/*etp=*/2, w.moe_ffn);
    ASSERT_TRUE(f.ok()) << f.status();
    const QuantizationConfig quant = Int4Config(w.group);
    const Int4Quantizer q({.quant = &quant});
    const int rank = EtpRank(*f, 1);
    const MegatronParam& fc2 = ExpertOf(*f, rank, ShardKind::kExpertDim1).param;
    std::optional<Int4ExpertPlan> plan = Plan(*f, q, rank, fc2);
    ASSERT_TRUE(plan.has_value()) << "fc2 is an INT4 target on every member";
    EXPECT_EQ(plan->by_shard, w.by_shard);
    EXPECT_EQ(plan->full_rows, (std::vector<RowSegment>{{0, 0, 0, 64}}));
    if (w.by_shard) {
      EXPECT_EQ(plan->local_rows, plan->full_rows) << "a column block holds every row";
      EXPECT_EQ(plan->packed.local_shape, (Shape{64, w.moe_ffn / 16}));
      EXPECT_GT(plan->local_block, 0u);
    } else {
      EXPECT_TRUE(plan->local_rows.empty());
      EXPECT_EQ(plan->local_block, 0u);
    }
  }
}

TEST(Int4PlanTest, AnExpertIgnoredOnOneEpMemberStaysBf16OnEveryMember) {
  auto f = MakeFixture(/*etp=*/1, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  // EP rank 1 holds experts 4-7: its local expert 2 is global expert 6.
  const QuantizationConfig quant = Int4Config(32, "model.layers.1.mlp.experts.6");
  const Int4Quantizer q({.quant = &quant});
  for (int rank : f->world.layout.EpGroup(0)) {
    for (const tools::RankTensor& t : f->world.ranks.at(rank)) {
      const MegatronParam& p = t.param;
      if (!p.is_expert) continue;
      SCOPED_TRACE(absl::StrCat("rank ", rank, " ", p.global_name));
      const bool ignored = p.global_layer == 1 && p.local_expert == 2;
      EXPECT_EQ(Plan(*f, q, rank, p).has_value(), !ignored);
    }
  }
}

// --- Quantizing rows ----------------------------------------------------------------------------

// Seeded random bf16 [n, k], about N(0, 0.02).
Tensor RandomWeight(int64_t n, int64_t k, uint32_t seed) {
  Tensor t = *Tensor::Empty(DType::kBF16, Shape{n, k});
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  auto* w = reinterpret_cast<uint16_t*>(t.mutable_view().data());
  for (int64_t i = 0; i < n * k; ++i) w[i] = F32ToBF16(normal(rng));
  return t;
}

// Packed and scales of `w` quantized whole by the kernel.
struct Whole {
  std::vector<std::byte> packed, scales;
};
Whole QuantizeWhole(const TensorView& w, const kernels::QuantizeOptions& ko) {
  auto shapes = kernels::QuantizedShapesFor(w, ko.group_size, kernels::PackFormat::kCompressedTensors);
  EXPECT_TRUE(shapes.ok()) << shapes.status();
  Whole out;
  out.packed.resize(static_cast<size_t>(*NumBytes(DType::kI32, shapes->packed)));
  out.scales.resize(static_cast<size_t>(*NumBytes(w.dtype(), shapes->scales)));
  EXPECT_TRUE(kernels::QuantizeInt4(w, MutableTensorView(DType::kI32, shapes->packed, out.packed),
                                    MutableTensorView(w.dtype(), shapes->scales, out.scales), ko)
                  .ok());
  return out;
}

bool SameBytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

MegatronParam OneTensorParam(const std::string& hf_name, const Shape& shape) {
  MegatronParam p;
  p.global_name = p.local_name = "test.weight";
  p.local_shape = p.full_shape = shape;
  p.hf_names = {hf_name};
  return p;
}

TEST(Int4QuantizeRowsTest, AnySplitOfRowsEqualsQuantizingTheWholeTensor) {
  for (int group : {32, 64, kernels::kChannelwise}) {
    SCOPED_TRACE(absl::StrCat("group ", group));
    const QuantizationConfig quant = Int4Config(group);
    for (auto variant : {kernels::QuantVariant::kQat, kernels::QuantVariant::kSlime}) {
      Int4Quantizer q({.quant = &quant, .variant = variant, .num_threads = 2});
      Tensor w = RandomWeight(48, 128, 7 + static_cast<uint32_t>(group));
      // Row 7's second group of 32 is all zeros.
      auto* bits = reinterpret_cast<uint16_t*>(w.mutable_view().data());
      std::fill(bits + 7 * 128 + 32, bits + 7 * 128 + 64, uint16_t{0});
      const Whole whole = QuantizeWhole(w.view(), q.KernelOptions());
      const MegatronParam p = OneTensorParam("model.layers.0.mlp.down_proj.weight", {48, 128});
      std::vector<std::byte> packed(whole.packed.size()), scales(whole.scales.size());
      const std::vector<RowSegment> split = {{0, 0, 0, 5}, {0, 5, 5, 1}, {0, 6, 6, 23}, {0, 29, 29, 19}};
      ASSERT_TRUE(q.QuantizeRows(p, w.view(), split, packed, scales, "a test").ok());
      EXPECT_TRUE(SameBytes(packed, whole.packed));
      EXPECT_TRUE(SameBytes(scales, whole.scales));
      EXPECT_EQ(q.stats().quantized_bytes, w.nbytes());
    }
  }
}

// With a QuantMemo (a holder in delta syncs), a block's next quantization copies the groups whose
// inputs did not change: the bytes are a plain quantization's, the reused groups exactly those whose
// bits are equal (counted by comparing them); a failed call leaves the memo as it was; another
// variant reuses nothing.
TEST(Int4QuantizeRowsTest, WithAMemoOnlyTheGroupsWhoseInputsChangedAreQuantized) {
  const QuantizationConfig quant = Int4Config(32);
  QuantMemo memo;
  Int4Quantizer q({.quant = &quant, .num_threads = 2});
  q.set_quant_memo(&memo);
  const MegatronParam p = OneTensorParam("model.layers.0.mlp.down_proj.weight", {48, 128});
  const std::vector<RowSegment> split = {{0, 0, 0, 5}, {0, 5, 5, 1}, {0, 6, 6, 23}, {0, 29, 29, 19}};
  std::vector<std::byte> packed(48 * 16 * 4), scales(48 * 4 * 2);
  // Quantizes `w` into packed / scales with `qz`; the groups it reused (the stats' growth).
  auto quantize = [&](Int4Quantizer& qz, const Tensor& w) {
    const uint64_t before = qz.stats().reused_groups;
    const absl::Status s = qz.QuantizeRows(p, w.view(), split, packed, scales, "a test");
    EXPECT_TRUE(s.ok()) << s;
    return qz.stats().reused_groups - before;
  };
  Tensor w0 = RandomWeight(48, 128, 41);
  EXPECT_EQ(quantize(q, w0), 0u);
  EXPECT_EQ(q.stats().groups, 48u * 4u);
  auto w1 = Tensor::CopyOf(w0.view());
  ASSERT_TRUE(w1.ok());
  auto* bits = reinterpret_cast<uint16_t*>(w1->mutable_view().data());
  for (int i : {3, 200, 201, 1000, 4000, 6100}) bits[i] ^= 1u;  // the lowest mantissa bit: 5 groups
  uint64_t same = 0;
  const auto* b0 = reinterpret_cast<const uint16_t*>(w0.view().data());
  for (int g = 0; g < 48 * 4; ++g) same += std::equal(b0 + 32 * g, b0 + 32 * (g + 1), bits + 32 * g);
  ASSERT_EQ(same, 48u * 4u - 5u);
  EXPECT_EQ(quantize(q, *w1), same);
  const Whole whole = QuantizeWhole(w1->view(), q.KernelOptions());
  EXPECT_TRUE(SameBytes(packed, whole.packed));
  EXPECT_TRUE(SameBytes(scales, whole.scales));
  // A NaN: refused, and the memo still holds w1's quantization.
  auto bad = Tensor::CopyOf(w1->view());
  ASSERT_TRUE(bad.ok());
  reinterpret_cast<uint16_t*>(bad->mutable_view().data())[77] = 0x7fc0;
  EXPECT_FALSE(q.QuantizeRows(p, bad->view(), split, packed, scales, "a test").ok());
  EXPECT_EQ(quantize(q, *w1), 48u * 4u);
  EXPECT_TRUE(SameBytes(packed, whole.packed));
  EXPECT_GT(memo.bytes(), packed.size() + scales.size());
  // Another variant: other bytes, nothing of the memo reused.
  Int4Quantizer slime({.quant = &quant, .variant = kernels::QuantVariant::kSlime, .num_threads = 2});
  slime.set_quant_memo(&memo);
  EXPECT_EQ(quantize(slime, *w1), 0u);
}

// Where a comparison reused under a tenth of a block's groups, its next 2 quantizations compute no
// digests (the memo drops the block), then a probe records and the next compares; a poor probe
// doubles the pause, a good one ends it. Every quantization gives a plain quantization's bytes.
TEST(Int4QuantizeRowsTest, DigestsPauseWhereTheyDidNotPay) {
  const QuantizationConfig quant = Int4Config(32);
  QuantMemo memo;
  Int4Quantizer q({.quant = &quant, .num_threads = 2}), plain({.quant = &quant, .num_threads = 2});
  q.set_quant_memo(&memo);
  const MegatronParam p = OneTensorParam("model.layers.0.mlp.down_proj.weight", {48, 128});
  const std::vector<RowSegment> rows = {{0, 0, 0, 48}};
  constexpr uint64_t kGroups = 48 * 4;
  std::vector<std::byte> packed(48 * 16 * 4), scales(48 * 4 * 2), want_packed(packed.size()),
      want_scales(scales.size());
  // One quantization of `w`: {groups reused, groups without digests}.
  auto quantize = [&](const Tensor& w) {
    const Int4Stats before = q.stats();
    EXPECT_TRUE(q.QuantizeRows(p, w.view(), rows, packed, scales, "a test").ok());
    EXPECT_TRUE(plain.QuantizeRows(p, w.view(), rows, want_packed, want_scales, "plain").ok());
    EXPECT_TRUE(SameBytes(packed, want_packed) && SameBytes(scales, want_scales));
    EXPECT_EQ(q.stats().groups - before.groups, kGroups);
    return std::pair{q.stats().reused_groups - before.reused_groups,
                     q.stats().undigested_groups - before.undigested_groups};
  };
  using R = std::pair<uint64_t, uint64_t>;
  int seed = 100;
  auto fresh = [&] { return RandomWeight(48, 128, ++seed); };  // every group changed
  EXPECT_EQ(quantize(fresh()), (R{0, 0}));                     // records
  EXPECT_EQ(quantize(fresh()), (R{0, 0}));                     // compares: nothing reused, a pause of 2
  EXPECT_EQ(quantize(fresh()), (R{0, kGroups}));
  EXPECT_EQ(memo.bytes(), 0u) << "a paused block is kept";
  const Tensor same = fresh();
  EXPECT_EQ(quantize(same), (R{0, kGroups}));
  EXPECT_EQ(quantize(same), (R{0, 0}));     // the probe records
  EXPECT_EQ(quantize(fresh()), (R{0, 0}));  // and compares: poor again, a pause of 4
  for (int i = 0; i < 4; ++i) EXPECT_EQ(quantize(same), (R{0, kGroups})) << i;
  EXPECT_EQ(quantize(same), (R{0, 0}));        // the probe records
  EXPECT_EQ(quantize(same), (R{kGroups, 0}));  // and compares: all reused, no pause
  EXPECT_EQ(quantize(fresh()), (R{0, 0}));     // poor: the pause starts at 2 again
  EXPECT_EQ(quantize(same), (R{0, kGroups}));
  EXPECT_EQ(quantize(same), (R{0, kGroups}));
  EXPECT_EQ(quantize(same), (R{0, 0}));
  // Pauses off (set_pause_below(0)): digests every time, whatever was reused.
  memo.set_pause_below(0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(quantize(fresh()), (R{0, 0})) << i;
  Tensor quarter = fresh();
  EXPECT_EQ(quantize(quarter), (R{0, 0}));
  // At a half: a comparison that reused a quarter pauses.
  memo.set_pause_below(0.5);
  auto* bits = reinterpret_cast<uint16_t*>(quarter.mutable_view().data());
  for (int64_t g = 0; g < 48 * 4; ++g)
    if (g % 4 != 0) bits[g * 32] ^= 1u;  // every group but each row's first
  EXPECT_EQ(quantize(quarter), (R{kGroups / 4, 0}));
  EXPECT_EQ(quantize(quarter), (R{0, kGroups}));
}

TEST(Int4QuantizeRowsTest, EtpShardsQuantizedAndMergedEqualTheFullTensorQuantized) {
  // fc1 (rows) with moe_ffn 32, fc2 (column blocks of whole groups) with moe_ffn 64.
  for (auto [moe_ffn, kind] :
       {std::pair{int64_t{32}, ShardKind::kExpertGluFc1}, std::pair{int64_t{64}, ShardKind::kExpertDim1}}) {
    SCOPED_TRACE(ShardKindName(kind));
    auto f = MakeFixture(/*etp=*/2, moe_ffn);
    ASSERT_TRUE(f.ok()) << f.status();
    const QuantizationConfig quant = Int4Config(32);
    Int4Quantizer q({.quant = &quant, .num_threads = 2});
    std::vector<std::optional<Int4ExpertPlan>> plans;
    std::vector<const tools::RankTensor*> shards;
    for (int e = 0; e < 2; ++e) {
      shards.push_back(&ExpertOf(*f, EtpRank(*f, e), kind, 3));
      plans.push_back(Plan(*f, q, EtpRank(*f, e), shards.back()->param));
      ASSERT_TRUE(plans.back().has_value() && plans.back()->by_shard);
    }
    const MegatronParam& p = shards[0]->param;
    auto full = HfToMegatronFull(f->model.config, p, f->model.weights);
    ASSERT_TRUE(full.ok()) << full.status();
    const Whole whole = QuantizeWhole(full->view(), q.KernelOptions());
    const Int4ExpertPlan& plan = *plans[0];

    // The full tensor through QuantizeRows (the merger's path after a bf16 merge).
    std::vector<std::byte> block(plan.block_bytes);
    std::span<std::byte> b(block);
    ASSERT_TRUE(q.QuantizeRows(p, full->view(), plan.full_rows, b.subspan(0, plan.packed_bytes),
                               b.subspan(plan.scale_offset, plan.scale_bytes), "whole")
                    .ok());
    EXPECT_TRUE(SameBytes(b.subspan(0, plan.packed_bytes), whole.packed));
    EXPECT_TRUE(SameBytes(b.subspan(plan.scale_offset, plan.scale_bytes), whole.scales));

    // Each ETP rank's shard into its shard block, then the merge.
    std::vector<std::byte> gathered(2 * plan.local_block);
    for (int e = 0; e < 2; ++e) {
      const Int4ExpertPlan& pe = *plans[static_cast<size_t>(e)];
      ASSERT_EQ(pe.local_block, plan.local_block);
      std::span<std::byte> mine = std::span<std::byte>(gathered).subspan(e * pe.local_block, pe.local_block);
      ASSERT_TRUE(q.QuantizeRows(shards[static_cast<size_t>(e)]->param, shards[static_cast<size_t>(e)]->view,
                                 pe.local_rows, mine.subspan(0, pe.local_packed_bytes),
                                 mine.subspan(pe.local_scale_offset, pe.local_scale_bytes), "ETP shard")
                      .ok());
    }
    std::vector<std::byte> merged(plan.block_bytes);
    ASSERT_TRUE(MergeInt4Shards(plan, gathered, merged).ok());
    std::span<const std::byte> m(merged);
    EXPECT_TRUE(SameBytes(m.subspan(0, plan.packed_bytes), whole.packed));
    EXPECT_TRUE(SameBytes(m.subspan(plan.scale_offset, plan.scale_bytes), whole.scales));
  }
}

TEST(Int4QuantizeRowsTest, ANanIsRefusedNamingTheHfTensorAndItsRows) {
  auto f = MakeFixture(/*etp=*/2, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  const QuantizationConfig quant = Int4Config(32);
  Int4Quantizer q({.quant = &quant, .num_threads = 1});
  const int rank = EtpRank(*f, 1);
  const tools::RankTensor& fc1 = ExpertOf(*f, rank, ShardKind::kExpertGluFc1, 1);
  const std::optional<Int4ExpertPlan> plan = Plan(*f, q, rank, fc1.param);
  ASSERT_TRUE(plan.has_value());
  // A NaN in the shard's row 20: up_proj's row 16 + 4 (the shard's up rows are 16..31).
  auto copy = Tensor::CopyOf(fc1.view);
  ASSERT_TRUE(copy.ok());
  auto* bits = reinterpret_cast<uint16_t*>(copy->mutable_view().data());
  bits[20 * 64 + 3] = 0x7fc0;
  std::vector<std::byte> block(plan->local_block);
  std::span<std::byte> b(block);
  const absl::Status s =
      q.QuantizeRows(fc1.param, copy->view(), plan->local_rows, b.subspan(0, plan->local_packed_bytes),
                     b.subspan(plan->local_scale_offset, plan->local_scale_bytes), "ETP shard 1 of 2");
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  const std::string up = fc1.param.hf_names[1];
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("quantizing \"", up, "\" (its rows 16..31")));
  EXPECT_THAT(std::string(s.message()), HasSubstr("ETP shard 1 of 2"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("NaN"));
}

// --- Into buckets -------------------------------------------------------------------------------

class KeepSink : public comm::BucketSink {
 public:
  absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) override {
    for (const v1::BucketEntry& e : manifest.entries())
      tensors[e.tensor().name()].assign(data.data() + e.offset(), data.data() + e.offset() + e.nbytes());
    return absl::OkStatus();
  }
  Buffer Recycle(uint64_t) override { return Buffer(); }
  absl::Status Finish() override { return absl::OkStatus(); }
  std::map<std::string, std::vector<std::byte>> tensors;
};

// Every tensor of QuantizeHfTensor(name, w) is in `sink`, byte for byte (the compressed-tensors or
// AWQ triple).
void ExpectSent(const KeepSink& sink, const std::string& name, const TensorView& w, const QuantizationConfig& quant,
                const model::QuantizeOptions& options) {
  auto want = model::QuantizeHfTensor(name, w, quant, options);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(want->size(), 3u);
  for (const model::HfTensor& t : *want) {
    auto it = sink.tensors.find(t.name);
    ASSERT_NE(it, sink.tensors.end()) << t.name << " not sent";
    EXPECT_TRUE(SameBytes(it->second, t.view.bytes())) << t.name;
  }
}

TEST(Int4EmitTest, ExpertBlocksBecomeTheHfTripletsOfEachTensor) {
  auto f = MakeFixture(/*etp=*/1, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  const QuantizationConfig quant = Int4Config(32);
  Int4Quantizer q({.quant = &quant, .variant = kernels::QuantVariant::kSlime, .num_threads = 1});
  KeepSink sink;
  comm::BucketBuilder builder(sink, {.bucket_bytes = 4096});
  uint64_t hf_bytes = 0;
  std::vector<std::string> names;
  for (ShardKind kind : {ShardKind::kExpertGluFc1, ShardKind::kExpertDim1}) {
    // EP rank 1's expert (global 4 + 1), quantized by its holder, emitted by the stage source.
    const int holder = f->world.layout.ExpertRank(ExpertCoord{0, 1, 0, 0});
    const tools::RankTensor& t = ExpertOf(*f, holder, kind, 1);
    const std::optional<Int4ExpertPlan> plan = Plan(*f, q, holder, t.param);
    ASSERT_TRUE(plan.has_value());
    std::vector<std::byte> block(plan->block_bytes);
    std::span<std::byte> b(block);
    ASSERT_TRUE(q.QuantizeRows(t.param, t.view, plan->full_rows, b.subspan(0, plan->packed_bytes),
                               b.subspan(plan->scale_offset, plan->scale_bytes), "by its holder")
                    .ok());
    ASSERT_TRUE(q.EmitExpert(builder, t.param, *plan, block).ok());
    hf_bytes += t.view.nbytes();
    names.insert(names.end(), t.param.hf_names.begin(), t.param.hf_names.end());
  }
  ASSERT_TRUE(builder.Finish().ok());
  EXPECT_EQ(q.stats().hf_bytes, hf_bytes);
  EXPECT_GT(q.stats().copied_bytes, 0u);
  // Global expert 5's gate_proj, up_proj, down_proj.
  EXPECT_EQ(names, (std::vector<std::string>{"model.layers.0.mlp.experts.5.gate_proj.weight",
                                             "model.layers.0.mlp.experts.5.up_proj.weight",
                                             "model.layers.0.mlp.experts.5.down_proj.weight"}));
  EXPECT_EQ(sink.tensors.size(), 3u * names.size());
  for (const std::string& name : names) {
    auto w = f->model.weights.Get(name);
    ASSERT_TRUE(w.ok()) << w.status();
    ExpectSent(sink, name, *w, quant, {.variant = kernels::QuantVariant::kSlime, .num_threads = 1});
  }
}

TEST(Int4EmitTest, QuantizeIntoWritesTheTripletOfQuantizeHfTensor) {
  auto f = MakeFixture(/*etp=*/1, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  const QuantizationConfig quant = Int4Config(64);
  Int4Quantizer q({.quant = &quant, .num_threads = 1});
  KeepSink sink;
  comm::BucketBuilder builder(sink, {.bucket_bytes = 1 << 20});
  const std::string name = "model.layers.2.self_attn.o_proj.weight";
  auto w = f->model.weights.Get(name);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(q.QuantizeInto(builder, name, *w).ok());
  const absl::Status bad = q.QuantizeInto(builder, "model.layers.2.self_attn.o_proj.bias", *w);
  EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
  EXPECT_THAT(std::string(bad.message()), HasSubstr("not a *.weight tensor"));
  ASSERT_TRUE(builder.Finish().ok());
  EXPECT_EQ(q.stats().quantized_bytes, w->nbytes());
  ExpectSent(sink, name, *w, quant, {.num_threads = 1});
}

// AWQ configs (quant_method "awq"): QuantizeInto writes qweight / qzeros / scales as
// model::QuantizeHfTensor does, in either arithmetic; experts are planned for their holders as AWQ
// triples (Int4AwqExpertTest below).
TEST(Int4EmitTest, AwqQuantizeIntoWritesQweightQzerosScales) {
  auto f = MakeFixture(/*etp=*/1, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  auto quant = ParseQuantizationConfig(
      R"({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": true, "version": "gemm"})", "awq");
  ASSERT_TRUE(quant.ok()) << quant.status();
  const std::string name = "model.layers.2.self_attn.o_proj.weight";
  auto w = f->model.weights.Get(name);
  ASSERT_TRUE(w.ok()) << w.status();
  for (kernels::AwqArith arith : {kernels::AwqArith::kFp16, kernels::AwqArith::kFp32}) {
    SCOPED_TRACE(arith == kernels::AwqArith::kFp16 ? "fp16" : "fp32");
    Int4Options o;
    o.quant = &*quant;
    o.num_threads = 1;
    o.awq_arith = arith;
    Int4Quantizer q(o);
    KeepSink sink;
    comm::BucketBuilder builder(sink, {.bucket_bytes = 1 << 20});
    ASSERT_TRUE(q.QuantizeInto(builder, name, *w).ok());
    ASSERT_TRUE(builder.Finish().ok());
    EXPECT_EQ(q.stats().quantized_bytes, w->nbytes());
    auto want = model::QuantizeHfTensor(name, *w, *quant, {.num_threads = 1, .awq_arith = arith});
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(want->size(), 3u);
    EXPECT_EQ((*want)[0].name, "model.layers.2.self_attn.o_proj.qweight");
    EXPECT_EQ((*want)[1].name, "model.layers.2.self_attn.o_proj.qzeros");
    EXPECT_EQ((*want)[2].name, "model.layers.2.self_attn.o_proj.scales");
    EXPECT_EQ((*want)[0].view.shape(), (Shape{w->dim(1), w->dim(0) / 8}));
    EXPECT_EQ(sink.tensors.size(), 3u);
    ExpectSent(sink, name, *w, *quant, {.num_threads = 1, .awq_arith = arith});
    const int rank = EtpRank(*f, 0);
    const tools::RankTensor& e = ExpertOf(*f, rank, ShardKind::kExpertGluFc1);
    auto plan = q.PlanExpert(f->model.config, e.param, OnMembers(*f, rank, e.param), f->world.layout.etp());
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(plan->has_value());
    EXPECT_TRUE((*plan)->awq);
  }
  EXPECT_NE(QuantFingerprint(&*quant, kernels::QuantVariant::kQat, kernels::AwqArith::kFp16),
            QuantFingerprint(&*quant, kernels::QuantVariant::kQat, kernels::AwqArith::kFp32));
  const QuantizationConfig ct = Int4Config(32);
  EXPECT_NE(QuantFingerprint(&*quant, kernels::QuantVariant::kQat), QuantFingerprint(&ct, kernels::QuantVariant::kQat));
}

// --- AWQ experts by their holders ----------------------------------------------------------------

QuantizationConfig AwqConfig(int group) {
  auto q = ParseQuantizationConfig(absl::StrCat(R"({"quant_method": "awq", "bits": 4, "group_size": )", group,
                                                R"(, "zero_point": true, "version": "gemm"})"),
                                   "awq");
  EXPECT_TRUE(q.ok()) << q.status();
  return q.ok() ? *q : QuantizationConfig();
}

// AWQ packs along N, so a holder's row block is a column block of each AWQ tensor: the block holds
// one triple per HF tensor (per shard segment for ETP shards). Every path gives QuantizeHfTensor's
// bytes for each HF tensor, in both arithmetics: the full tensor by its holder (ETP 1), ETP shards
// quantized where they live and merged (fc1 rows; fc2 columns of whole groups, moe_ffn 64: one
// group a shard, 128: two, so shard 1's qzeros / scales start at row 2), and a bf16 merge quantized
// by the merger (fc2 with 16 columns a shard, narrower than a group); channelwise (G = -1) fc1 by
// shard and fc2 merged in bf16 (a K split cannot hold whole channels).
TEST(Int4AwqExpertTest, HoldersShardsAndMergesGiveEachHfTensorsTriple) {
  struct Way {
    int etp;
    int64_t moe_ffn;
    ShardKind kind;
    bool by_shard;
    int group = 32;
  };
  const Way ways[] = {{1, 32, ShardKind::kExpertGluFc1, true},
                      {1, 32, ShardKind::kExpertDim1, true},
                      {2, 32, ShardKind::kExpertGluFc1, true},
                      {2, 64, ShardKind::kExpertDim1, true},
                      {2, 128, ShardKind::kExpertDim1, true},
                      {2, 32, ShardKind::kExpertDim1, false},
                      {2, 32, ShardKind::kExpertGluFc1, true, kernels::kChannelwise},
                      {2, 64, ShardKind::kExpertDim1, false, kernels::kChannelwise}};
  for (kernels::AwqArith arith : {kernels::AwqArith::kFp16, kernels::AwqArith::kFp32}) {
    for (const Way& way : ways) {
      SCOPED_TRACE(absl::StrCat("ETP ", way.etp, ", ", ShardKindName(way.kind), ", moe_ffn ", way.moe_ffn, ", G ",
                                way.group, arith == kernels::AwqArith::kFp16 ? ", fp16" : ", fp32"));
      const QuantizationConfig quant = AwqConfig(way.group);
      auto f = MakeFixture(way.etp, way.moe_ffn);
      ASSERT_TRUE(f.ok()) << f.status();
      Int4Options o;
      o.quant = &quant;
      o.num_threads = 2;
      o.awq_arith = arith;
      Int4Quantizer q(o);
      std::vector<Int4ExpertPlan> plans;
      std::vector<const tools::RankTensor*> shards;
      for (int e = 0; e < way.etp; ++e) {
        shards.push_back(&ExpertOf(*f, EtpRank(*f, e), way.kind, 1));
        std::optional<Int4ExpertPlan> plan = Plan(*f, q, EtpRank(*f, e), shards.back()->param);
        ASSERT_TRUE(plan.has_value());
        EXPECT_TRUE(plan->awq);
        EXPECT_EQ(plan->by_shard, way.by_shard);
        plans.push_back(std::move(*plan));
      }
      const MegatronParam& p = shards[0]->param;
      const Int4ExpertPlan& plan = plans[0];
      ASSERT_EQ(plan.awq_full.size(), p.hf_names.size());
      std::vector<std::byte> block(plan.block_bytes);
      if (way.etp == 1) {
        ASSERT_TRUE(q.QuantizeExpert(p, shards[0]->view, plan, /*shard=*/false, block, "by its holder").ok());
      } else if (way.by_shard) {
        std::vector<std::byte> gathered(static_cast<size_t>(way.etp) * plan.local_block);
        for (int e = 0; e < way.etp; ++e) {
          const Int4ExpertPlan& pe = plans[static_cast<size_t>(e)];
          ASSERT_EQ(pe.local_block, plan.local_block);
          ASSERT_EQ(pe.awq_shards.size(), static_cast<size_t>(way.etp));
          std::span<std::byte> mine = std::span<std::byte>(gathered).subspan(e * pe.local_block, pe.local_block);
          ASSERT_TRUE(q.QuantizeExpert(shards[static_cast<size_t>(e)]->param, shards[static_cast<size_t>(e)]->view, pe,
                                       /*shard=*/true, mine, "ETP shard")
                          .ok());
        }
        ASSERT_TRUE(MergeInt4Shards(plan, gathered, block).ok());
        const absl::Status bad = MergeInt4Shards(plan, std::span<const std::byte>(gathered).subspan(1), block);
        EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
        // A shard quantized with another rank's plan is refused.
        const absl::Status other = q.QuantizeExpert(shards[1]->param, shards[1]->view, plans[0], /*shard=*/true,
                                                    std::span<std::byte>(gathered).subspan(0, plan.local_block), "x");
        EXPECT_TRUE(absl::IsInvalidArgument(other)) << other;
      } else {
        auto full = HfToMegatronFull(f->model.config, p, f->model.weights);
        ASSERT_TRUE(full.ok()) << full.status();
        ASSERT_TRUE(q.QuantizeExpert(p, full->view(), plan, /*shard=*/false, block, "merged").ok());
      }
      KeepSink sink;
      comm::BucketBuilder builder(sink, {.bucket_bytes = 1 << 20});
      ASSERT_TRUE(q.EmitExpert(builder, p, plan, block).ok());
      ASSERT_TRUE(builder.Finish().ok());
      EXPECT_EQ(sink.tensors.size(), 3 * p.hf_names.size());
      for (const std::string& name : p.hf_names) {
        auto w = f->model.weights.Get(name);
        ASSERT_TRUE(w.ok()) << w.status();
        ExpectSent(sink, name, *w, quant, {.num_threads = 1, .awq_arith = arith});
      }
    }
  }
}

// The rows of one HF tensor in several segments (the general case of a full tensor): each is
// quantized apart and placed at its columns of the triple, the same bytes as the tensor whole; a
// shard block asked of a plan without shards, and a merge of one, are refused.
TEST(Int4AwqExpertTest, ARowSplitOfAnHfTensorIsPlacedAtItsColumns) {
  auto f = MakeFixture(/*etp=*/1, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  const QuantizationConfig quant = AwqConfig(32);
  Int4Quantizer q({.quant = &quant, .num_threads = 1});
  const tools::RankTensor& fc2 = ExpertOf(*f, EtpRank(*f, 0), ShardKind::kExpertDim1, 1);
  std::optional<Int4ExpertPlan> plan = Plan(*f, q, EtpRank(*f, 0), fc2.param);
  ASSERT_TRUE(plan.has_value() && plan->awq);
  ASSERT_EQ(plan->full_rows, (std::vector<RowSegment>{{0, 0, 0, 64}}));
  std::vector<std::byte> whole(plan->block_bytes), split(plan->block_bytes);
  ASSERT_TRUE(q.QuantizeExpert(fc2.param, fc2.view, *plan, /*shard=*/false, whole, "whole").ok());
  Int4ExpertPlan pieces = *plan;
  pieces.full_rows = {{0, 0, 0, 8}, {0, 8, 8, 40}, {0, 48, 48, 16}};
  ASSERT_TRUE(q.QuantizeExpert(fc2.param, fc2.view, pieces, /*shard=*/false, split, "split").ok());
  EXPECT_TRUE(SameBytes(whole, split));
  std::vector<std::byte> none;
  const absl::Status s = q.QuantizeExpert(fc2.param, fc2.view, *plan, /*shard=*/true, none, "x");
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  const absl::Status m = MergeInt4Shards(*plan, none, whole);
  EXPECT_TRUE(absl::IsInvalidArgument(m)) << m;
  EXPECT_THAT(std::string(m.message()), HasSubstr("no ETP shard blocks"));
}

// A NaN in an ETP shard is refused naming the HF tensor, its rows and the shard; a block of the
// wrong size is refused before the kernel runs.
TEST(Int4AwqExpertTest, ANanOrAWrongBlockIsRefusedNamingIt) {
  auto f = MakeFixture(/*etp=*/2, /*moe_ffn=*/32);
  ASSERT_TRUE(f.ok()) << f.status();
  const QuantizationConfig quant = AwqConfig(32);
  Int4Quantizer q({.quant = &quant, .num_threads = 1});
  const int rank = EtpRank(*f, 1);
  const tools::RankTensor& fc1 = ExpertOf(*f, rank, ShardKind::kExpertGluFc1, 1);
  const std::optional<Int4ExpertPlan> plan = Plan(*f, q, rank, fc1.param);
  ASSERT_TRUE(plan.has_value() && plan->by_shard);
  auto copy = Tensor::CopyOf(fc1.view);
  ASSERT_TRUE(copy.ok());
  reinterpret_cast<uint16_t*>(copy->mutable_view().data())[20 * 64 + 3] = 0x7fc0;  // up_proj's row 16 + 4
  std::vector<std::byte> block(plan->local_block);
  absl::Status s = q.QuantizeExpert(fc1.param, copy->view(), *plan, /*shard=*/true, block, "ETP shard 1 of 2");
  ASSERT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("quantizing \"", fc1.param.hf_names[1], "\" (its rows 16..31")));
  EXPECT_THAT(std::string(s.message()), HasSubstr("ETP shard 1 of 2"));
  const uint64_t quantized = q.stats().quantized_bytes;
  block.resize(plan->local_block + 64);
  s = q.QuantizeExpert(fc1.param, fc1.view, *plan, /*shard=*/true, block, "ETP shard 1 of 2");
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(q.stats().quantized_bytes, quantized) << "the kernel ran on a wrong block";
}

// With a QuantMemo, a holder's AWQ triples copy the units (8 rows' group: one qzeros word) whose
// inputs did not change since the memo's last quantization of that triple: an ETP shard of fc1
// (two triples) and fc2 quantized in row pieces (each its own triple, placed). The bytes are a plain
// quantization's, the reused units exactly those whose bits are equal (counted from the bits); a
// refused NaN leaves the memo as it was; another arithmetic reuses nothing.
TEST(Int4AwqExpertTest, WithAMemoOnlyTheUnitsWhoseInputsChangedAreQuantized) {
  struct Case {
    int etp;
    ShardKind kind;
    bool shard;
    std::vector<RowSegment> pieces;  // replaces the plan's full_rows when not empty
  };
  const Case cases[] = {{2, ShardKind::kExpertGluFc1, true, {}},
                        {1, ShardKind::kExpertDim1, false, {{0, 0, 0, 8}, {0, 8, 8, 40}, {0, 48, 48, 16}}}};
  constexpr int kGroup = 32;
  const QuantizationConfig quant = AwqConfig(kGroup);
  for (const Case& c : cases) {
    SCOPED_TRACE(ShardKindName(c.kind));
    auto f = MakeFixture(c.etp, /*moe_ffn=*/32);
    ASSERT_TRUE(f.ok()) << f.status();
    QuantMemo memo;
    Int4Quantizer q({.quant = &quant, .num_threads = 2}), plain({.quant = &quant, .num_threads = 2});
    q.set_quant_memo(&memo);
    const int rank = EtpRank(*f, c.etp - 1);
    const tools::RankTensor& t = ExpertOf(*f, rank, c.kind, 1);
    std::optional<Int4ExpertPlan> plan = Plan(*f, q, rank, t.param);
    ASSERT_TRUE(plan.has_value() && plan->awq);
    if (!c.pieces.empty()) plan->full_rows = c.pieces;
    const std::vector<RowSegment>& segs = c.shard ? plan->local_rows : plan->full_rows;
    std::vector<std::byte> block(c.shard ? plan->local_block : plan->block_bytes), want(block.size());
    // Quantizes `w` into `block`; the units it reused (the stats' growth).
    auto quantize = [&](const Tensor& w) {
      const uint64_t before = q.stats().reused_groups;
      const absl::Status s = q.QuantizeExpert(t.param, w.view(), *plan, c.shard, block, "a test");
      EXPECT_TRUE(s.ok()) << s;
      return q.stats().reused_groups - before;
    };
    auto w0 = Tensor::CopyOf(t.view);
    ASSERT_TRUE(w0.ok());
    const int64_t k = t.view.dim(1);
    uint64_t units = 0;
    for (const RowSegment& seg : segs) units += static_cast<uint64_t>(seg.rows / 8 * (k / kGroup));
    EXPECT_EQ(quantize(*w0), 0u);
    EXPECT_EQ(q.stats().groups, units);
    auto w1 = Tensor::CopyOf(w0->view());
    ASSERT_TRUE(w1.ok());
    auto* bits = reinterpret_cast<uint16_t*>(w1->mutable_view().data());
    // The lowest mantissa bit, in rows 9 and 20: each triple keeps over a tenth of its units (its
    // digests keep paying: QuantMemo).
    for (int64_t i : {k * 9 + 40, k * 9 + 41, k * 20 + 5}) bits[i] ^= 1u;
    // The units whose 8 x G input bits are equal, counted from the bits.
    const auto* b0 = reinterpret_cast<const uint16_t*>(w0->view().data());
    uint64_t same = 0;
    for (const RowSegment& seg : segs)
      for (int64_t r = seg.row; r < seg.row + seg.rows; r += 8)
        for (int64_t g = 0; g < k; g += kGroup) {
          bool equal = true;
          for (int64_t i = r; i < r + 8; ++i)
            equal = equal && std::equal(b0 + i * k + g, b0 + i * k + g + kGroup, bits + i * k + g);
          same += equal;
        }
    ASSERT_LT(same, units);
    EXPECT_EQ(quantize(*w1), same);
    ASSERT_TRUE(plain.QuantizeExpert(t.param, w1->view(), *plan, c.shard, want, "plain").ok());
    EXPECT_TRUE(SameBytes(block, want));
    // A NaN: refused, and the memo still holds w1's quantization (each triple's, the refused one too).
    auto bad = Tensor::CopyOf(w1->view());
    ASSERT_TRUE(bad.ok());
    reinterpret_cast<uint16_t*>(bad->mutable_view().data())[w1->view().dim(0) * k - 1] = 0x7fc0;  // the last row
    EXPECT_FALSE(q.QuantizeExpert(t.param, bad->view(), *plan, c.shard, block, "a test").ok());
    EXPECT_EQ(quantize(*w1), units);
    EXPECT_TRUE(SameBytes(block, want));
    EXPECT_GE(memo.bytes(), units * 8);
    // The other arithmetic: nothing of the memo reused.
    Int4Quantizer fp32({.quant = &quant, .num_threads = 2, .awq_arith = kernels::AwqArith::kFp32});
    fp32.set_quant_memo(&memo);
    ASSERT_TRUE(fp32.QuantizeExpert(t.param, w1->view(), *plan, c.shard, block, "fp32").ok());
    EXPECT_EQ(fp32.stats().reused_groups, 0u);
    EXPECT_EQ(fp32.stats().groups, units);
  }
}

// The trainer quantizes as the engines declare; its own --quant-config must be theirs.
TEST(SyncQuantizationTest, FollowsTheEnginesAndRefusesATrainerConfigTheyDoNotServe) {
  const std::string g64 = R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
      "strategy": "group", "group_size": 64, "symmetric": true}}}, "ignore": ["lm_head"]})";
  const std::string g64_trtllm = absl::StrReplaceAll(
      g64, {{R"("format": "pack-quantized")", R"("format": "pack-quantized", "engine_layout": "trtllm-sm90")"}});
  const std::string g128 = absl::StrReplaceAll(g64, {{R"("group_size": 64)", R"("group_size": 128)"}});
  const std::string awq = R"({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": true})";
  auto parse = [](const std::string& json) {
    auto q = ParseQuantizationConfig(json, "test");
    EXPECT_TRUE(q.ok()) << q.status();
    return q.ok() ? std::optional<QuantizationConfig>(*q) : std::nullopt;
  };

  // No trainer config: the engines' (bf16 engines: bf16).
  auto q = SyncQuantization(std::nullopt, g64_trtllm);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_TRUE(q->has_value());
  EXPECT_EQ((*q)->group_size, 64);
  EXPECT_EQ((*q)->engine_layout, "trtllm-sm90");
  q = SyncQuantization(std::nullopt, "");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(q->has_value());
  // The trainer's own, when the engines serve it (their engine_layout does not count).
  q = SyncQuantization(parse(g64), g64_trtllm);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_TRUE(q->has_value());
  EXPECT_EQ((*q)->group_size, 64);
  // Refused, naming both: another group size, another method, engines in bf16.
  for (const auto& [trainer, engines, want_engines] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {g128, g64, "group 64"}, {g64, awq, "awq"}, {g64, "", "bf16"}}) {
    SCOPED_TRACE(trainer + " vs " + engines);
    q = SyncQuantization(parse(trainer), engines);
    ASSERT_EQ(q.status().code(), absl::StatusCode::kFailedPrecondition) << q.status();
    EXPECT_THAT(q.status().message(), HasSubstr("the trainer's --quant-config ("));
    EXPECT_THAT(q.status().message(), HasSubstr(parse(trainer)->Describe()));
    EXPECT_THAT(q.status().message(), HasSubstr(want_engines));
  }
  // A malformed engines' config is the parser's error.
  q = SyncQuantization(std::nullopt, R"({"quant_method": "gptq"})");
  EXPECT_FALSE(q.ok());
  EXPECT_THAT(q.status().message(), HasSubstr("the engines' quantization_config"));
}

TEST(QuantFingerprintTest, DiffersWhereTheRanksWouldDisagree) {
  const QuantizationConfig a = Int4Config(32);
  EXPECT_EQ(QuantFingerprint(nullptr, kernels::QuantVariant::kQat), "quant none");
  EXPECT_EQ(QuantFingerprint(&a, kernels::QuantVariant::kQat), QuantFingerprint(&a, kernels::QuantVariant::kQat));
  EXPECT_NE(QuantFingerprint(&a, kernels::QuantVariant::kQat), QuantFingerprint(&a, kernels::QuantVariant::kSlime));
  const QuantizationConfig b = Int4Config(64), c = Int4Config(32, "model.layers.1.mlp.experts.6");
  EXPECT_NE(QuantFingerprint(&a, kernels::QuantVariant::kQat), QuantFingerprint(&b, kernels::QuantVariant::kQat));
  EXPECT_NE(QuantFingerprint(&a, kernels::QuantVariant::kQat), QuantFingerprint(&c, kernels::QuantVariant::kQat));
}

}  // namespace
}  // namespace wsync::trainer_agent
