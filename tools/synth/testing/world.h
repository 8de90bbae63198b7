// Test helpers shared by the convert, quantize and source tests (not part of the library):
// small synthetic models of every architecture and an in-memory "world" of rank tensors.
// Thread-safety: none needed (single-threaded tests).
#pragma once

#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tools/synth/reassemble.h"
#include "tools/synth/sharder.h"
#include "tools/synth/synthetic_model.h"

namespace wsync::tools::testing {

// Sizes that split over TP 4, ETP 2, EP 4 and keep tests fast (hidden 64, 8 heads / 4 groups,
// 8 experts, 4 layers, vocab 1000 so the padding paths run).
inline SyntheticModelOptions SmallOptions(Architecture arch) {
  SyntheticModelOptions o;
  o.arch = arch;
  o.hidden = 64, o.layers = 4, o.heads = 8, o.kv_heads = 4, o.head_dim = 16, o.ffn = 96;
  o.moe_ffn = 32, o.experts = 8, o.topk = 2, o.vocab = 1000;
  o.q_lora_rank = 32, o.kv_lora_rank = 32, o.qk_nope_head_dim = 16, o.qk_rope_head_dim = 8, o.v_head_dim = 16;
  o.shared_experts = 1, o.first_k_dense = 1;
  return o;
}

inline absl::StatusOr<SyntheticModel> SmallModel(const SyntheticModelOptions& o, uint64_t seed) {
  return GenerateSyntheticModel(o, seed, /*threads=*/2);
}

// Every rank's local tensors, built by the sharder in memory.
struct World {
  SourceParallel parallel;  // resolved
  ParallelLayout layout;
  std::map<int, std::vector<RankTensor>> ranks;

  absl::StatusOr<TensorView> Lookup(int rank, const MegatronParam& p) const {
    auto it = ranks.find(rank);
    if (it == ranks.end()) return absl::NotFoundError(absl::StrCat("no rank ", rank));
    for (const RankTensor& t : it->second)
      if (t.param.local_name == p.local_name) return t.view;
    return absl::NotFoundError(absl::StrCat("rank ", rank, " has no ", p.local_name));
  }
  RankTensorLookup Lookup() const {
    return [this](int rank, const MegatronParam& p) { return Lookup(rank, p); };
  }
};

inline absl::StatusOr<World> BuildWorld(const SyntheticModel& m, SourceParallel parallel) {
  World w;
  ASSIGN_OR_RETURN(w.parallel, trainer_agent::ResolveSourceParallel(m.config, std::move(parallel)));
  ASSIGN_OR_RETURN(w.layout, trainer_agent::MakeLayout(m.config, w.parallel));
  for (int r = 0; r < w.layout.world_size(); ++r) {
    ASSIGN_OR_RETURN(auto tensors, BuildRankTensors(m.config, w.layout, w.parallel, m.weights, r));
    w.ranks.emplace(r, std::move(tensors));
  }
  return w;
}

// tp/pp/ep/etp/dp(/cp) -> SourceParallel (world size derived).
inline SourceParallel Parallel(int tp, int pp, int ep, int etp, int dp, std::vector<int64_t> layers_per_stage = {},
                               int cp = 1) {
  SourceParallel p;
  p.tp = tp, p.pp = pp, p.ep = ep, p.etp = etp, p.dp = dp, p.cp = cp;
  p.world_size = tp * pp * dp * cp;
  p.layers_per_stage = std::move(layers_per_stage);
  return p;
}

}  // namespace wsync::tools::testing
