// WeightSource: where a trainer agent reads its rank's Megatron parameters at each sync.
//
//   dir:PATH  DirSource  (dir_source.h): config.json, parallel.json, rank-NNNNN.safetensors files
//   shm:NAME  ShmSource  (shm_source.h): a live training process's tensors in POSIX shared
//                         memory, registered through trainer_client/wsync_trainer_client.h
//
// Both describe the model (HF config + Megatron parallel layout) and hand out a RankShard: the
// rank's parameters in PlanRank order, validated against the plan (names, dtypes, shapes), as
// views whose memory the shard keeps alive (and, for shm, keeps consistent: the trainer cannot
// write while a shard exists).
//
// Thread-safety: implementations are safe to call from any thread. A RankShard is a value owned
// by its caller. Errors: see each implementation.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "common/tensor.h"
#include "trainer_agent/convert/megatron_param.h"
#include "trainer_agent/convert/source_parallel.h"
#include "trainer_agent/layout/parallel_layout.h"

namespace wsync::trainer_agent {

struct RankShard {
  int global_rank = 0;
  std::vector<MegatronParam> params;  // PlanRank order
  std::vector<TensorView> tensors;    // tensors[i] belongs to params[i]
  // Keeps the memory behind `tensors` valid (and, for shm, the trainer's update lock shared)
  // for as long as any copy lives.
  std::shared_ptr<const void> backing;
  // -1: `tensors` are host memory. >= 0: they are device memory of this CUDA device (the shm:
  // source's CUDA tensors read in place; the sync then runs the device stages, sync/rank_sync.h).
  int cuda_device = -1;

  // Index of the parameter with this local name, or -1 (linear search).
  int Find(absl::string_view local_name) const;
};

// The model a source describes: parsed and checked against each other (sizes that do not split
// the model, a world size that is not tp*cp*pp*dp, an impossible EP/ETP grid, ...).
struct SourceModel {
  std::string config_json;  // verbatim (part of the ranks' agreement fingerprint)
  ModelConfig model;
  SourceParallel parallel;  // resolved
  ParallelLayout layout;
};

// Parses config.json and parallel.json texts; `config_where` / `parallel_where` name them in errors.
absl::StatusOr<SourceModel> ParseSourceModel(std::string config_json, absl::string_view config_where,
                                             absl::string_view parallel_json, absl::string_view parallel_where);

class WeightSource {
 public:
  virtual ~WeightSource() = default;

  virtual const SourceModel& source_model() const = 0;
  const ModelConfig& model() const { return source_model().model; }
  const std::string& config_json() const { return source_model().config_json; }
  const SourceParallel& parallel() const { return source_model().parallel; }
  const ParallelLayout& layout() const { return source_model().layout; }

  // The rank's parameters for the sync publishing `version` (see the file comment; 0: whatever
  // the source holds now; shm: waits until the training process has declared `version`).
  virtual absl::StatusOr<RankShard> OpenRank(int global_rank, uint64_t version = 0) const = 0;
  // "dir:PATH" / "shm:NAME", for messages.
  virtual std::string Describe() const = 0;
};

}  // namespace wsync::trainer_agent
