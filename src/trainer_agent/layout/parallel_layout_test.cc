#include "trainer_agent/layout/parallel_layout.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

namespace wsync::trainer_agent {
namespace {

ParallelSizes Sizes(int w, int tp, int pp, int ep, int etp, int64_t experts, int cp = 1,
                    const char* order = "tp-cp-ep-dp-pp") {
  ParallelSizes s;
  s.world_size = w;
  s.tp = tp;
  s.pp = pp;
  s.ep = ep;
  s.etp = etp;
  s.cp = cp;
  s.num_experts = experts;
  s.order = order;
  return s;
}

ParallelLayout Make(int w, int tp, int pp, int ep, int etp, int64_t experts = 8, int cp = 1) {
  auto l = ParallelLayout::Create(Sizes(w, tp, pp, ep, etp, experts, cp));
  EXPECT_TRUE(l.ok()) << l.status();
  return *l;
}

struct Row {
  int tp, dp, pp, etp, ep, edp;
};

void CheckTable(const ParallelLayout& l, const std::vector<Row>& rows) {
  ASSERT_EQ(static_cast<int>(rows.size()), l.world_size());
  for (int g = 0; g < l.world_size(); ++g) {
    const auto d = l.Dense(g);
    const auto e = l.Expert(g);
    const Row& r = rows[static_cast<size_t>(g)];
    EXPECT_EQ(d.tp, r.tp) << "rank " << g;
    EXPECT_EQ(d.dp, r.dp) << "rank " << g;
    EXPECT_EQ(d.pp, r.pp) << "rank " << g;
    EXPECT_EQ(e.etp, r.etp) << "rank " << g;
    EXPECT_EQ(e.ep, r.ep) << "rank " << g;
    EXPECT_EQ(e.edp, r.edp) << "rank " << g;
    EXPECT_EQ(e.pp, d.pp);
    EXPECT_EQ(l.DenseRank(d), g);
    EXPECT_EQ(l.ExpertRank(e), g);
  }
}

// RANKS.md §4, first table: TP=2, PP=1, EP=2, ETP=1 -> W=2.
TEST(ParallelLayoutTest, WorkedTableTp2Ep2Etp1) {
  auto l = Make(2, 2, 1, 2, 1);
  EXPECT_EQ(l.dp(), 1);
  EXPECT_EQ(l.edp(), 1);
  CheckTable(l, {{0, 0, 0, 0, 0, 0}, {1, 0, 0, 0, 1, 0}});
  EXPECT_EQ(l.EpGroup(0), (std::vector<int>{0, 1}));  // EP is the TP group here
  EXPECT_EQ(l.EtpGroup(1), (std::vector<int>{1}));
}

// RANKS.md §4, second table: TP=2, PP=2, EP=2, ETP=2, W=8 -> DP=2, EDP=1 (here ep == dp).
TEST(ParallelLayoutTest, WorkedTableTp2Pp2Ep2Etp2) {
  auto l = Make(8, 2, 2, 2, 2);
  EXPECT_EQ(l.dp(), 2);
  EXPECT_EQ(l.edp(), 1);
  CheckTable(l, {{0, 0, 0, 0, 0, 0},
                 {1, 0, 0, 1, 0, 0},
                 {0, 1, 0, 0, 1, 0},
                 {1, 1, 0, 1, 1, 0},
                 {0, 0, 1, 0, 0, 0},
                 {1, 0, 1, 1, 0, 0},
                 {0, 1, 1, 0, 1, 0},
                 {1, 1, 1, 1, 1, 0}});
  EXPECT_EQ(l.TpGroup(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(l.DpGroup(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(l.PpGroup(3), (std::vector<int>{3, 7}));
  EXPECT_EQ(l.EpGroup(6), (std::vector<int>{4, 6}));
  EXPECT_EQ(l.EtpGroup(6), (std::vector<int>{6, 7}));
  EXPECT_EQ(l.StageSourceRank(0), 0);
  EXPECT_EQ(l.StageSourceRank(1), 4);
  EXPECT_TRUE(l.IsStageSource(4));
  EXPECT_FALSE(l.IsStageSource(6));
  // Experts: 8 experts over EP=2 -> 4 local; rank 2 (ep 1) holds global experts 4..7.
  EXPECT_EQ(l.GlobalExpertId(2, 0), 4);
  EXPECT_EQ(l.GlobalExpertId(3, 3), 7);
  EXPECT_EQ(l.GlobalExpertId(5, 3), 3);
}

// RANKS.md §4: TP=1, PP=1, EP=4 -> dp = ep = g; and TP=2, EP=2, ETP=1, DP=2 -> ep = tp, edp = dp.
TEST(ParallelLayoutTest, WorkedTablesEp4AndTp2Etp1Dp2) {
  auto a = Make(4, 1, 1, 4, 0);
  EXPECT_EQ(a.etp(), 1);
  CheckTable(a, {{0, 0, 0, 0, 0, 0}, {0, 1, 0, 0, 1, 0}, {0, 2, 0, 0, 2, 0}, {0, 3, 0, 0, 3, 0}});
  auto b = Make(4, 2, 1, 2, 1);
  CheckTable(b, {{0, 0, 0, 0, 0, 0}, {1, 0, 0, 0, 1, 0}, {0, 1, 0, 0, 0, 1}, {1, 1, 0, 0, 1, 1}});
}

// Generic properties on many layouts: coordinates are a bijection, groups partition the world and
// a rank's position in each group equals its coordinate.
TEST(ParallelLayoutTest, GroupsPartitionTheWorld) {
  struct L {
    int w, tp, pp, ep, etp, cp;
  };
  for (const L& c : std::vector<L>{{8, 2, 2, 2, 2, 1},
                                   {8, 2, 2, 2, 1, 1},
                                   {16, 4, 2, 2, 1, 1},
                                   {8, 2, 1, 4, 1, 1},
                                   {12, 2, 3, 2, 2, 1},
                                   {8, 1, 1, 8, 1, 1},
                                   {8, 2, 1, 2, 2, 2},
                                   {6, 3, 2, 1, 0, 1}}) {
    auto l = Make(c.w, c.tp, c.pp, c.ep, c.etp, 16, c.cp);
    std::set<std::pair<int, int>> seen_dense;
    for (int r = 0; r < l.world_size(); ++r) {
      const auto d = l.Dense(r);
      const auto e = l.Expert(r);
      auto pos = [r](const std::vector<int>& g) {
        for (size_t i = 0; i < g.size(); ++i)
          if (g[i] == r) return static_cast<int>(i);
        return -1;
      };
      ASSERT_EQ(pos(l.TpGroup(r)), d.tp) << l.DebugString();
      ASSERT_EQ(pos(l.CpGroup(r)), d.cp);
      ASSERT_EQ(pos(l.DpGroup(r)), d.dp);
      ASSERT_EQ(pos(l.PpGroup(r)), d.pp);
      ASSERT_EQ(pos(l.EpGroup(r)), e.ep);
      ASSERT_EQ(pos(l.EtpGroup(r)), e.etp);
      ASSERT_EQ(pos(l.EdpGroup(r)), e.edp);
      ASSERT_EQ(static_cast<int>(l.TpGroup(r).size()), l.tp());
      ASSERT_EQ(static_cast<int>(l.EpGroup(r).size()), l.ep());
      // RANKS.md §3: ep_rank = ((tp + TP*(cp + CP*dp)) // ETP) % EP on the same stage.
      ASSERT_EQ(e.ep, ((d.tp + l.tp() * (d.cp + l.cp() * d.dp)) / l.etp()) % l.ep()) << l.DebugString();
      ASSERT_EQ(l.Expert(l.StageSourceRank(d.pp)), (ExpertCoord{0, 0, 0, d.pp}));
    }
  }
}

TEST(ParallelLayoutTest, InvalidLayoutsAreRefused) {
  struct Bad {
    ParallelSizes s;
    const char* mention;
  };
  auto S = [](int w, int tp, int pp, int ep, int etp, int64_t experts, const char* order = "tp-cp-ep-dp-pp") {
    return Sizes(w, tp, pp, ep, etp, experts, 1, order);
  };
  const Bad cases[] = {
      {S(6, 4, 1, 1, 0, 0), "does not divide world_size 6"},
      {S(4, 2, 1, 4, 2, 8), "etp*ep*pp = 8"},
      {S(4, 1, 1, 4, 1, 6), "does not divide the 6 experts"},
      {S(4, 1, 1, 2, 1, 0), "needs a model with experts"},
      {S(0, 1, 1, 1, 1, 0), "world_size must be >= 1"},
      {S(4, 0, 1, 1, 1, 0), "tp must be >= 1"},
      {S(4, 2, 1, 1, 0, 0, "tp-xx-dp-pp"), "unknown token \"xx\""},
      {S(4, 2, 1, 1, 0, 0, "tp-tp-dp-pp"), "appears twice"},
      {S(4, 2, 1, 1, 0, 0, "cp-ep-dp-pp"), "missing from order"},
  };
  for (const auto& c : cases) {
    auto l = ParallelLayout::Create(c.s);
    ASSERT_FALSE(l.ok()) << c.mention;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find(c.mention), std::string_view::npos) << l.status();
  }
  // A missing token of size 1 is fine (appended, as Megatron does).
  EXPECT_TRUE(ParallelLayout::Create(S(4, 2, 1, 1, 0, 0, "tp-dp-pp")).ok());
}

}  // namespace
}  // namespace wsync::trainer_agent
