#include "trainer_agent/layout/parallel_layout.h"

#include <cassert>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace wsync::trainer_agent {

ParallelLayout::Grid ParallelLayout::MakeGrid(const std::array<int, 5>& size, const std::array<int, 5>& order) {
  Grid g;
  g.size = size;
  int stride = 1;
  for (int t : order) {
    g.stride[t] = stride;
    stride *= size[t];
  }
  return g;
}

std::vector<int> ParallelLayout::Group(const Grid& g, int rank, Token t) {
  const int base = rank - Digit(g, rank, t) * g.stride[t];
  std::vector<int> out;
  out.reserve(static_cast<size_t>(g.size[t]));
  for (int i = 0; i < g.size[t]; ++i) out.push_back(base + i * g.stride[t]);
  return out;  // ascending: stride > 0
}

absl::StatusOr<ParallelLayout> ParallelLayout::Create(const ParallelSizes& s) {
  const int etp = s.etp == 0 ? s.tp : s.etp;
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "invalid parallel layout (world_size=%d tp=%d cp=%d pp=%d ep=%d etp=%d experts=%d order=%s): %s", s.world_size,
        s.tp, s.cp, s.pp, s.ep, etp, s.num_experts, s.order, why));
  };
  for (auto [name, v] : {std::pair<const char*, int>{"world_size", s.world_size},
                         {"tp", s.tp},
                         {"cp", s.cp},
                         {"pp", s.pp},
                         {"ep", s.ep},
                         {"etp", etp}})
    if (v < 1) return bad(absl::StrCat(name, " must be >= 1"));
  if (s.world_size % (s.tp * s.cp * s.pp) != 0)
    return bad(absl::StrCat("tp*cp*pp = ", s.tp * s.cp * s.pp, " does not divide world_size ", s.world_size));
  if (s.world_size % (etp * s.ep * s.pp) != 0)
    return bad(absl::StrCat("etp*ep*pp = ", etp * s.ep * s.pp, " does not divide world_size ", s.world_size));
  if (s.num_experts < 0) return bad("num_experts must be >= 0");
  if (s.num_experts > 0 && s.num_experts % s.ep != 0)
    return bad(absl::StrCat("ep ", s.ep, " does not divide the ", s.num_experts, " experts"));
  if (s.num_experts == 0 && s.ep > 1) return bad("ep > 1 needs a model with experts");

  // The order: a permutation of a subset of the tokens; missing tokens are appended with size 1
  // (Megatron RankGenerator), which requires their size to be 1.
  static constexpr const char* kNames[5] = {"tp", "cp", "ep", "dp", "pp"};
  std::array<int, 5> order{};
  std::array<bool, 5> seen{};
  int n = 0;
  for (absl::string_view tok : absl::StrSplit(s.order, '-')) {
    int t = -1;
    for (int i = 0; i < 5; ++i)
      if (tok == kNames[i]) t = i;
    if (t < 0) return bad(absl::StrCat("unknown token \"", tok, "\" in order"));
    if (seen[t]) return bad(absl::StrCat("token \"", tok, "\" appears twice in order"));
    seen[t] = true;
    order[n++] = t;
  }
  ParallelLayout l;
  l.world_ = s.world_size;
  l.tp_ = s.tp;
  l.cp_ = s.cp;
  l.pp_ = s.pp;
  l.ep_ = s.ep;
  l.etp_ = etp;
  l.dp_ = s.world_size / (s.tp * s.cp * s.pp);
  l.edp_ = s.world_size / (etp * s.ep * s.pp);
  l.num_experts_ = s.num_experts;
  l.order_ = s.order;
  const std::array<int, 5> dense_size = {s.tp, s.cp, 1, l.dp_, s.pp};
  const std::array<int, 5> expert_size = {etp, 1, s.ep, l.edp_, s.pp};
  for (int t = 0; t < 5; ++t) {
    if (seen[t]) continue;
    if (dense_size[t] != 1 || expert_size[t] != 1)
      return bad(absl::StrCat("token \"", kNames[t], "\" has size > 1 but is missing from order"));
    order[n++] = t;
  }
  l.dense_ = MakeGrid(dense_size, order);
  l.expert_ = MakeGrid(expert_size, order);
  // Megatron asserts that both grids give every rank the same pipeline stage.
  for (int r = 0; r < l.world_; ++r)
    if (Digit(l.dense_, r, kPp) != Digit(l.expert_, r, kPp))
      return bad(absl::StrCat("rank ", r, " falls on different pipeline stages in the dense and expert grids"));
  return l;
}

DenseCoord ParallelLayout::Dense(int rank) const {
  assert(rank >= 0 && rank < world_);
  return {Digit(dense_, rank, kTp), Digit(dense_, rank, kCp), Digit(dense_, rank, kDp), Digit(dense_, rank, kPp)};
}

ExpertCoord ParallelLayout::Expert(int rank) const {
  assert(rank >= 0 && rank < world_);
  return {Digit(expert_, rank, kTp), Digit(expert_, rank, kEp), Digit(expert_, rank, kDp), Digit(expert_, rank, kPp)};
}

int ParallelLayout::DenseRank(const DenseCoord& c) const {
  return c.tp * dense_.stride[kTp] + c.cp * dense_.stride[kCp] + c.dp * dense_.stride[kDp] + c.pp * dense_.stride[kPp];
}

int ParallelLayout::ExpertRank(const ExpertCoord& c) const {
  return c.etp * expert_.stride[kTp] + c.ep * expert_.stride[kEp] + c.edp * expert_.stride[kDp] +
         c.pp * expert_.stride[kPp];
}

std::vector<int> ParallelLayout::TpGroup(int rank) const { return Group(dense_, rank, kTp); }
std::vector<int> ParallelLayout::CpGroup(int rank) const { return Group(dense_, rank, kCp); }
std::vector<int> ParallelLayout::DpGroup(int rank) const { return Group(dense_, rank, kDp); }
std::vector<int> ParallelLayout::PpGroup(int rank) const { return Group(dense_, rank, kPp); }
std::vector<int> ParallelLayout::EpGroup(int rank) const { return Group(expert_, rank, kEp); }
std::vector<int> ParallelLayout::EtpGroup(int rank) const { return Group(expert_, rank, kTp); }
std::vector<int> ParallelLayout::EdpGroup(int rank) const { return Group(expert_, rank, kDp); }

int ParallelLayout::StageSourceRank(int stage) const { return DenseRank({0, 0, 0, stage}); }

std::string ParallelLayout::DebugString() const {
  return absl::StrFormat("W=%d TP=%d CP=%d DP=%d PP=%d | ETP=%d EP=%d EDP=%d (%s)", world_, tp_, cp_, dp_, pp_, etp_,
                         ep_, edp_, order_);
}

}  // namespace wsync::trainer_agent
