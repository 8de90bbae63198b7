// Full (gathered) Megatron tensor <-> HuggingFace tensors, per parameter (MEGATRON_TO_HF §2.3-2.5,
// §5). Both directions use one row mapping per HfOp (HfRowMap), so the sharder and the sync
// path cannot disagree:
//   kCopy   HF = the full tensor (expert pruning: its kept_rows, in that order)
//   kVocab  HF = rows [0, vocab_size) of the padded tensor; padding rows are zeros when sharding
//   kGlu    gate = rows [0, f), up = rows [f, 2f)
//   kQkv    per query group g: q rows, then k, then v (view(ng, n_rep+2, hd, ...) split [n_rep,1,1])
// ToHf returns views into `full` wherever the HF tensor is one contiguous block of it (copy,
// vocab unpad, GLU halves) and copies only for the q/k/v split.
//
// Errors: kInvalidArgument naming the parameter / HF tensor with expected and found dtype and
// shape; kNotFound for an HF tensor missing from the checkpoint.
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/memory_space.h"
#include "common/tensor.h"
#include "model/hf_checkpoint.h"
#include "model/hf_tensor.h"
#include "trainer_agent/convert/megatron_param.h"

namespace wsync::trainer_agent {

// A contiguous run of rows shared by the full Megatron tensor and HF tensor `hf_index`.
// Rows are the tensors' first dimension (elements for 1-D tensors).
struct HfRowPiece {
  int hf_index = 0;
  int64_t full_row = 0;
  int64_t hf_row = 0;
  int64_t rows = 0;
};
struct HfRowMap {
  std::vector<Shape> hf_shapes;    // parallel to param.hf_names
  std::vector<HfRowPiece> pieces;  // full rows outside every piece are padding
};
absl::StatusOr<HfRowMap> HfRowMapFor(const ModelConfig& model, const MegatronParam& param);

// The HF tensors a gathered parameter becomes (none for the tied output copy, param.sent false).
// `full` must have param.dtype and param.full_shape.
// A pruned expert (param.pruned) becomes none either. `full` lives in `space` (the trainer's
// device stages pass its CUDA space); an HF tensor that is not one contiguous block of it is
// gathered into a tensor owned by the result, in that same space, or, given `scratch`, into
// `scratch` (grown in `space` when too small: at most param.full_shape's bytes plus 256 per HF
// tensor), whose contents the result's views then point to until the next call with it. The sync
// passes one scratch for all its parameters, sized beforehand, so that no device memory is freed
// while its NCCL operations run (docs/comm.md).
absl::StatusOr<std::vector<model::HfTensor>> ToHf(const ModelConfig& model, const MegatronParam& param, TensorView full,
                                                  const MemorySpace& space = MemorySpace::Host(),
                                                  Buffer* scratch = nullptr);

// The reverse (used by the sharder): the full Megatron tensor built from the HF checkpoint. HF
// tensors must have the parameter's dtype, except that a bf16/fp16 source of an fp32 parameter
// (router.expert_bias) is widened exactly.
absl::StatusOr<Tensor> HfToMegatronFull(const ModelConfig& model, const MegatronParam& param,
                                        const model::HfCheckpoint& hf);

// bf16 / fp16 -> fp32, exact (kInvalidArgument for other dtypes).
absl::StatusOr<Tensor> WidenToF32(const TensorView& v);

// Every HF tensor of the model in plan order (PlanFullModel), the first `mtp_num_layers` MTP layers
// (model.layers.{L+k}.*, MEGATRON_TO_HF.md §5.7) included.
absl::StatusOr<std::vector<model::HfTensorSpec>> HfTensorSpecs(const ModelConfig& model, int64_t mtp_num_layers = 0);

}  // namespace wsync::trainer_agent
