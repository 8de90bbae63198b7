// In-process simulation of what the agents of every pipeline stage compute in a sync, from the
// ranks' local tensors: per parameter of the stage's source rank, MergeShards over its TP (or
// expert-TP) group in group order; then the routed experts of every EP rank of the stage, by
// global expert id (EP ranks in order, each rank's experts merged over its own expert-TP group);
// then ToHf. No communication: the `lookup` hands out any rank's tensors. Used by the tests and by
// `wsync-shard --verify` to check a source directory against its HF checkpoint bit for bit.
//
// Errors: those of PlanRank / MergeShards / ToHf, of `lookup` and of `sink` (first one stops).
// VerifyAgainstHf: kDataLoss naming the first HF tensor whose bytes differ (with the byte
// offset), kInvalidArgument for HF tensors emitted twice, never, or with a wrong dtype/shape, or
// a tied output copy that differs from the embedding.
// Thread-safety: runs on the calling thread; lookup and sink are called from it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/tensor.h"
#include "model/hf_checkpoint.h"
#include "trainer_agent/convert/hf_convert.h"
#include "trainer_agent/convert/megatron_param.h"
#include "trainer_agent/convert/source_parallel.h"
#include "trainer_agent/source/dir_source.h"

namespace wsync::tools {

// The trainer's vocabulary, which every synthetic-model tool speaks.
using trainer_agent::MegatronParam;
using trainer_agent::ParallelLayout;
using trainer_agent::ShardKind;
using trainer_agent::SourceParallel;

// Rank `rank`'s local tensor of `param` (a parameter of that rank's plan).
using RankTensorLookup = std::function<absl::StatusOr<TensorView>(int rank, const MegatronParam& param)>;
// One gathered parameter of `stage`: its full tensor and the HF tensors it became (none when not sent).
using StageSink = std::function<absl::Status(int stage, const MegatronParam& param, TensorView full,
                                             std::vector<model::HfTensor> hf)>;

absl::Status ReassembleModel(const ModelConfig& model, const ParallelLayout& layout, const SourceParallel& parallel,
                             const RankTensorLookup& lookup, const StageSink& sink);

struct VerifyReport {
  int64_t hf_tensors = 0;
  uint64_t hf_bytes = 0;
  int64_t params = 0;
};

// ReassembleModel, with every HF tensor compared bit-exactly to `hf` and the set of emitted
// names compared to HfTensorSpecs(model).
absl::StatusOr<VerifyReport> VerifyAgainstHf(const ModelConfig& model, const ParallelLayout& layout,
                                             const SourceParallel& parallel, const RankTensorLookup& lookup,
                                             const model::HfCheckpoint& hf);

// Simulates every stage's gathers from the source's rank files (each opened once) and compares
// the HF tensors bit for bit with `hf` (VerifyAgainstHf). Used by wsync-shard --verify.
absl::StatusOr<VerifyReport> VerifyDirSource(const trainer_agent::DirSource& source, const model::HfCheckpoint& hf);

// The HF checkpoint a source directory holds (every stage's gathers simulated and converted, as a
// sync sends it before quantization): OUT/config.json (the source's) and OUT/model.safetensors.
// Used by `wsync-shard --src DIR --to-hf OUT`, e.g. to check an engine against the weights a live
// trainer dumped at one step. Errors: ReassembleModel's, and the file system's naming the path.
absl::StatusOr<VerifyReport> WriteHfOfDirSource(const trainer_agent::DirSource& source, const std::string& out_dir);

}  // namespace wsync::tools
