// HF checkpoint -> Megatron source directory (the inverse of a sync; used by wsync-shard and the
// tests). A source directory holds:
//   config.json                      the HF config (copied verbatim, quantization_config included)
//   parallel.json                    SourceParallel, every key written
//   rank-{global_rank:05d}.safetensors  exactly the rank's PlanRank parameters under their local
//                                    names, model dtype (fp32 router.expert_bias), vocab padded
//                                    with zero rows, DP/EDP replicas identical.
// Every tensor goes through HfToMegatronFull + ShardFull, the same layout code the sync uses.
//
// Errors: those of PlanRank / HfToMegatronFull (missing or mis-shaped HF tensors, named),
// file-system errors from the writer. Files are written atomically one by one; on error the
// directory may hold some rank files but never a partial one.
// Thread-safety: pure functions over their arguments.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/tensor.h"
#include "model/hf_checkpoint.h"
#include "trainer_agent/convert/megatron_param.h"
#include "trainer_agent/convert/source_parallel.h"

namespace wsync::tools {

// The trainer's vocabulary, which every synthetic-model tool speaks.
using trainer_agent::DenseCoord;
using trainer_agent::ExpertCoord;
using trainer_agent::HfOp;
using trainer_agent::MegatronParam;
using trainer_agent::ParallelLayout;
using trainer_agent::ShardKind;
using trainer_agent::SourceParallel;

// One local tensor of a rank: `view` aliases the HF checkpoint (replicated parameters copied
// 1:1) or points into `owned`.
struct RankTensor {
  MegatronParam param;
  TensorView view;
  Tensor owned;
};

// The local tensors of `global_rank`, in plan order.
absl::StatusOr<std::vector<RankTensor>> BuildRankTensors(const ModelConfig& model, const ParallelLayout& layout,
                                                         const SourceParallel& parallel, const model::HfCheckpoint& hf,
                                                         int global_rank);

struct WriteSourceStats {
  int files_built = 0;   // rank files built from the checkpoint
  int files_copied = 0;  // DP / EDP replicas copied from an identical rank file
  uint64_t bytes_written = 0;
};

// Writes the whole source directory (created if missing) for a resolved `parallel`.
// `config_json_text` is written as config.json and must parse to `model`.
absl::StatusOr<WriteSourceStats> WriteMegatronSource(const std::string& config_json_text, const ModelConfig& model,
                                                     const model::HfCheckpoint& hf, const SourceParallel& parallel,
                                                     const std::string& out_dir);

}  // namespace wsync::tools
