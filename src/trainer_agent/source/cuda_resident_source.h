// CudaResidentSource: a WeightSource (weight_source.h) whose ranks' tensors live in CUDA device
// memory, as a training process's are: every tensor of the chosen ranks of another source is
// uploaded once, at Create, into one device allocation per rank, and OpenRank hands out device
// views (RankShard::cuda_device set). It is what an shm: registration of CUDA tensors gives the
// agent, minus the IPC and the training process: the device stages' tests and
// `wsync-bench-trainer --cuda-device` run the sync on it.
//
// Ownership: `inner` is read only during Create. The device memory lives as long as the source or
// a shard opened from it. Errors: Create: the inner source's OpenRank errors, and the cuda_ipc.h
// ones (kUnimplemented without CUDA, kFailedPrecondition without the device, kResourceExhausted);
// OpenRank: kNotFound for a rank that was not uploaded. Thread-safety: const methods from any thread.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "trainer_agent/source/weight_source.h"

namespace wsync::trainer_agent {

class CudaResidentSource final : public WeightSource {
 public:
  static absl::StatusOr<std::unique_ptr<CudaResidentSource>> Create(const WeightSource& inner,
                                                                    absl::Span<const int> ranks, int device);
  // Rank ranks[i] on devices[i] (the device gathers' tests: one GPU per member of a group).
  // kInvalidArgument for a `devices` of another length.
  static absl::StatusOr<std::unique_ptr<CudaResidentSource>> Create(const WeightSource& inner,
                                                                    absl::Span<const int> ranks,
                                                                    absl::Span<const int> devices);

  const SourceModel& source_model() const override { return model_; }
  // `version` is not checked (the tensors do not change).
  absl::StatusOr<RankShard> OpenRank(int global_rank, uint64_t version = 0) const override;
  std::string Describe() const override { return description_; }

 private:
  CudaResidentSource() = default;
  SourceModel model_;
  std::string description_;
  std::map<int, RankShard> ranks_;  // device views; `backing` holds the device memory
};

}  // namespace wsync::trainer_agent
