// TP / expert-TP shard layouts: each kind on labelled tensors, MergeShards as the exact inverse of
// ShardFull on random data, and the refusals.
#include "trainer_agent/convert/shard_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace wsync::trainer_agent {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

MegatronParam Param(ShardKind kind, Shape full, int group) {
  MegatronParam p;
  p.local_name = p.global_name = "x";
  p.dtype = DType::kI32;
  p.kind = kind;
  p.full_shape = full;
  p.local_shape = full;
  p.group_size = kind == ShardKind::kReplicated ? 1 : group;
  p.gather_dim = kind == ShardKind::kTpDim1 || kind == ShardKind::kExpertDim1 ? 1 : 0;
  if (kind == ShardKind::kReplicated) p.gather_dim = -1;
  if (p.gather_dim >= 0) p.local_shape[static_cast<size_t>(p.gather_dim)] /= group;
  return p;
}

// Element (r, c) = 100 * r + c.
Tensor Labels(const Shape& shape) {
  Tensor t = *Tensor::Empty(DType::kI32, shape);
  const int64_t cols = shape.size() > 1 ? shape[1] : 1;
  for (int64_t i = 0; i < t.view().numel(); ++i)
    t.data_as<int32_t>()[i] = static_cast<int32_t>(i / cols * 100 + i % cols);
  return t;
}

std::vector<int32_t> Values(Tensor& t) {
  const int32_t* p = t.data_as<int32_t>();
  return std::vector<int32_t>(p, p + t.nbytes() / 4);
}

TEST(ShardLayout, GluFc1RankHoldsItsGateAndUpRows) {
  // [gate 0..3; up 4..7] over T = 2: rank 0 = [g0 g1; u4 u5], rank 1 = [g2 g3; u6 u7].
  MegatronParam p = Param(ShardKind::kTpGluFc1, Shape{8, 1}, 2);
  Tensor full = Labels(p.full_shape);
  Tensor r0 = *ShardFull(p, full.view(), 0);
  Tensor r1 = *ShardFull(p, full.view(), 1);
  EXPECT_THAT(Values(r0), ElementsAre(0, 100, 400, 500));
  EXPECT_THAT(Values(r1), ElementsAre(200, 300, 600, 700));
  Tensor merged = *Tensor::Empty(DType::kI32, p.full_shape);
  ASSERT_TRUE(MergeShards(p, {r0.view(), r1.view()}, merged.mutable_view()).ok());
  EXPECT_THAT(Values(merged), ElementsAre(0, 100, 200, 300, 400, 500, 600, 700));
  // A plain cat would interleave gate and up: [0,1,4,5,2,3,6,7].
  MegatronParam cat = Param(ShardKind::kTpDim0, Shape{8, 1}, 2);
  ASSERT_TRUE(MergeShards(cat, {r0.view(), r1.view()}, merged.mutable_view()).ok());
  EXPECT_THAT(Values(merged), ElementsAre(0, 100, 400, 500, 200, 300, 600, 700));
}

TEST(ShardLayout, RowParallelSplitsColumns) {
  MegatronParam p = Param(ShardKind::kTpDim1, Shape{2, 4}, 2);
  Tensor full = Labels(p.full_shape);
  Tensor r0 = *ShardFull(p, full.view(), 0);
  EXPECT_THAT(Values(r0), ElementsAre(0, 1, 100, 101));
  Tensor r1 = *ShardFull(p, full.view(), 1);
  EXPECT_THAT(Values(r1), ElementsAre(2, 3, 102, 103));
}

TEST(ShardLayout, ColumnParallelAndVocabSplitRows) {
  for (ShardKind kind : {ShardKind::kTpDim0, ShardKind::kVocab}) {
    MegatronParam p = Param(kind, Shape{4, 2}, 2);
    Tensor full = Labels(p.full_shape);
    Tensor r1 = *ShardFull(p, full.view(), 1);
    EXPECT_THAT(Values(r1), ElementsAre(200, 201, 300, 301));
  }
}

TEST(ShardLayout, MergeInvertsShardOnRandomTensorsOfEveryKind) {
  std::mt19937 rng(20261121);  // fixed seed
  for (ShardKind kind : {ShardKind::kReplicated, ShardKind::kTpDim0, ShardKind::kTpDim1, ShardKind::kTpGluFc1,
                         ShardKind::kVocab, ShardKind::kExpertDim1, ShardKind::kExpertGluFc1}) {
    for (int group : {1, 2, 4}) {
      MegatronParam p = Param(kind, Shape{16, 24}, group);
      p.dtype = DType::kBF16;
      Tensor full = *Tensor::Empty(DType::kBF16, p.full_shape);
      for (size_t i = 0; i < full.nbytes(); ++i) full.data_as<uint8_t>()[i] = static_cast<uint8_t>(rng());
      std::vector<Tensor> shards;
      std::vector<TensorView> views;
      for (int r = 0; r < p.group_size; ++r) shards.push_back(*ShardFull(p, full.view(), r));
      for (auto& s : shards) views.push_back(s.view());
      Tensor merged = *Tensor::Zeros(DType::kBF16, p.full_shape);
      ASSERT_TRUE(MergeShards(p, views, merged.mutable_view()).ok()) << ShardKindName(kind) << " " << group;
      EXPECT_EQ(std::memcmp(merged.view().data(), full.view().data(), full.nbytes()), 0)
          << ShardKindName(kind) << " group " << group;
    }
  }
}

TEST(ShardLayout, RefusesWrongCountsShapesAndOverlap) {
  MegatronParam p = Param(ShardKind::kTpDim0, Shape{4, 2}, 2);
  Tensor a = *Tensor::Zeros(DType::kI32, Shape{2, 2});
  Tensor full = *Tensor::Empty(DType::kI32, p.full_shape);
  auto st = MergeShards(p, {a.view()}, full.mutable_view());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("1 shard(s) given, the tp-dim0 group has 2"));

  Tensor wrong = *Tensor::Zeros(DType::kI32, Shape{3, 2});
  st = MergeShards(p, {a.view(), wrong.view()}, full.mutable_view());
  EXPECT_THAT(st.message(), HasSubstr("shard 1 is I32[3, 2] (24 bytes), expected I32[2, 2]"));

  Tensor bf = *Tensor::Zeros(DType::kBF16, Shape{2, 2});
  st = MergeShards(p, {a.view(), bf.view()}, full.mutable_view());
  EXPECT_THAT(st.message(), HasSubstr("shard 1 is BF16[2, 2]"));

  MutableTensorView alias(DType::kI32, Shape{4, 2}, full.mutable_view().bytes());
  TensorView half(DType::kI32, Shape{2, 2}, full.view().bytes().subspan(0, 16));
  st = MergeShards(p, {half, a.view()}, alias);
  EXPECT_THAT(st.message(), HasSubstr("overlaps the output"));

  EXPECT_THAT(ShardFull(p, full.view(), 2).status().message(), HasSubstr("group rank 2 is outside the group of 2"));
}

}  // namespace
}  // namespace wsync::trainer_agent
