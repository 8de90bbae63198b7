// The `dir:PATH` weight source: a Megatron source directory (format in
// tools/synth/sharder.h: config.json, parallel.json, rank-{global_rank:05d}.safetensors).
//
//   ASSIGN_OR_RETURN(DirSource src, DirSource::Open("/data/step-100"));   // config + parallel.json
//   ASSIGN_OR_RETURN(RankShard shard, src.OpenRank(my_rank));            // mmap + validate
//   shard.tensors[i] is shard.params[i]'s local tensor (PlanRank order), a view into the mapping.
//
// Open parses config.json and parallel.json and checks them against each other (sizes that do not
// split the model, a world size that is not tp*cp*pp*dp, an impossible EP/ETP grid, ...).
// OpenRank maps the rank's file read-only (zero copy) and validates it against PlanRank: missing
// and unknown parameters, wrong dtypes or shapes, and truncated or malformed files are refused.
// Each call maps the file anew, so the next sync sees a file that was replaced (renamed over)
// since, while views of an earlier RankShard stay valid as long as that RankShard lives.
//
// Errors: kNotFound for a missing directory, config.json, parallel.json or rank file (naming the
// path); kInvalidArgument naming the file, the parameter or field and the values;
// kUnimplemented for models wsync cannot convert.
// Thread-safety: a DirSource is immutable after Open; OpenRank may be called from any thread.
// A RankShard is a value owned by its caller.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/safetensors.h"
#include "common/tensor.h"
#include "model/hf_checkpoint.h"
#include "trainer_agent/convert/megatron_param.h"
#include "trainer_agent/convert/source_parallel.h"
#include "trainer_agent/layout/parallel_layout.h"
#include "trainer_agent/source/weight_source.h"

namespace wsync::trainer_agent {

class DirSource final : public WeightSource {
 public:
  static absl::StatusOr<DirSource> Open(const std::string& dir);

  DirSource(DirSource&&) noexcept = default;
  DirSource& operator=(DirSource&&) noexcept = default;

  const std::string& dir() const { return dir_; }
  const SourceModel& source_model() const override { return model_; }
  std::string RankPath(int global_rank) const;

  // Maps and validates `global_rank`'s file (see the file comment); `backing` holds the mapping.
  absl::StatusOr<RankShard> OpenRank(int global_rank, uint64_t version = 0) const override;
  std::string Describe() const override { return "dir:" + dir_; }

 private:
  DirSource(std::string dir, SourceModel model) : dir_(std::move(dir)), model_(std::move(model)) {}

  std::string dir_;
  SourceModel model_;
};

// The file of global rank `global_rank` in a dir: source ("rank-00003.safetensors").
std::string RankFileName(int global_rank);

}  // namespace wsync::trainer_agent
