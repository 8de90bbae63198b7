// Megatron-core's rank layout: global rank -> (tp, cp, dp, pp) on the dense grid and
// -> (etp, ep, edp, pp) on the expert grid, the process groups each rank belongs to, and the
// source rank of each pipeline stage. Spec: docs/spec/RANKS.md (Megatron's RankGenerator and
// initialize_model_parallel, default order "tp-cp-ep-dp-pp").
//
// A rank's coordinates are the mixed-radix digits of its global rank, the first token of `order`
// varying fastest. The dense grid uses sizes {tp: TP, cp: CP, ep: 1, dp: DP, pp: PP}, the expert
// grid {tp: ETP, cp: 1, ep: EP, dp: EDP, pp: PP}, with DP = W/(TP*CP*PP), EDP = W/(ETP*EP*PP) and
// ETP defaulting to TP. Every group lists global ranks in ascending order, so a rank's position in
// a group is its coordinate on that axis (torch.distributed.new_group semantics).
//
// Errors: Create() returns kInvalidArgument naming the sizes when the layout is impossible (a
// size < 1, TP*CP*PP or ETP*EP*PP not dividing the world, EP not dividing the experts, an order
// that is not a permutation of the tokens, or grids that disagree on the PP stage).
// Thread-safety: immutable after Create(); all methods are const and safe from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace wsync::trainer_agent {

struct ParallelSizes {
  int world_size = 1;
  int tp = 1;
  int cp = 1;
  int pp = 1;
  int ep = 1;
  int etp = 0;  // 0: unset, same as tp (Megatron's default)
  std::string order = "tp-cp-ep-dp-pp";
  int64_t num_experts = 0;  // routed experts of the model; 0 when not MoE
};

struct DenseCoord {
  int tp = 0, cp = 0, dp = 0, pp = 0;
  bool operator==(const DenseCoord&) const = default;
};

struct ExpertCoord {
  int etp = 0, ep = 0, edp = 0, pp = 0;
  bool operator==(const ExpertCoord&) const = default;
};

class ParallelLayout {
 public:
  static absl::StatusOr<ParallelLayout> Create(const ParallelSizes& sizes);

  int world_size() const { return world_; }
  int tp() const { return tp_; }
  int cp() const { return cp_; }
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int ep() const { return ep_; }
  int etp() const { return etp_; }
  int edp() const { return edp_; }
  int64_t num_experts() const { return num_experts_; }
  int64_t num_local_experts() const { return ep_ > 0 ? num_experts_ / ep_ : 0; }

  // Coordinates of a global rank (0 <= rank < world_size; not checked beyond a debug assert).
  DenseCoord Dense(int rank) const;
  ExpertCoord Expert(int rank) const;
  // Inverse maps.
  int DenseRank(const DenseCoord& c) const;
  int ExpertRank(const ExpertCoord& c) const;

  // The groups containing `rank`, ascending global ranks.
  std::vector<int> TpGroup(int rank) const;  // dense grid, varies tp
  std::vector<int> CpGroup(int rank) const;
  std::vector<int> DpGroup(int rank) const;
  std::vector<int> PpGroup(int rank) const;
  std::vector<int> EpGroup(int rank) const;   // expert grid, varies ep
  std::vector<int> EtpGroup(int rank) const;  // expert-TP group
  std::vector<int> EdpGroup(int rank) const;

  // The rank that converts and sends pipeline stage `stage`: its lowest rank, which has
  // tp = cp = dp = 0 and etp = ep = edp = 0, so it holds every tensor of the stage after the
  // TP and EP all-gathers.
  int StageSourceRank(int stage) const;
  bool IsStageSource(int rank) const { return rank == StageSourceRank(Dense(rank).pp); }

  // Global id of local expert `local` on `rank`: ep_rank * (E / EP) + local.
  int64_t GlobalExpertId(int rank, int64_t local) const { return Expert(rank).ep * num_local_experts() + local; }

  std::string DebugString() const;  // "W=8 TP=2 CP=1 DP=2 PP=2 | ETP=2 EP=2 EDP=1 (tp-cp-ep-dp-pp)"

 private:
  // Token indices in the canonical order used internally.
  enum Token { kTp = 0, kCp = 1, kEp = 2, kDp = 3, kPp = 4 };
  struct Grid {
    std::array<int, 5> size{};    // per token
    std::array<int, 5> stride{};  // per token: product of the sizes of the tokens before it in `order`
  };
  static Grid MakeGrid(const std::array<int, 5>& size, const std::array<int, 5>& order);
  static int Digit(const Grid& g, int rank, Token t) { return (rank / g.stride[t]) % g.size[t]; }
  static std::vector<int> Group(const Grid& g, int rank, Token t);

  int world_ = 1, tp_ = 1, cp_ = 1, dp_ = 1, pp_ = 1, ep_ = 1, etp_ = 1, edp_ = 1;
  int64_t num_experts_ = 0;
  std::string order_;
  Grid dense_, expert_;
};

}  // namespace wsync::trainer_agent
