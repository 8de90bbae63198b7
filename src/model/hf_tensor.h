// The HF tensors of a model as both agents see them: a tensor's name, dtype and shape
// (HfTensorSpec), and one tensor of a sync with its bytes (HfTensor). The trainer produces
// HfTensors from Megatron shards (trainer_agent/convert); the rollout side and the tools check
// what an engine holds against them (tools/wsyncctl/verify.h).
// Thread-safety: plain values.
#pragma once

#include <string>

#include "common/dtype.h"
#include "common/tensor.h"

namespace wsync::model {

// An HF tensor of the model: what a checkpoint holds and a sync sends (before quantization).
struct HfTensorSpec {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;
};

// One HF tensor. `view` aliases the caller's tensor, or points into `owned` when the producer had
// to copy (then `owned` holds the bytes and moving the HfTensor keeps `view` valid).
struct HfTensor {
  std::string name;
  TensorView view;
  Tensor owned;
  bool aliases_input() const { return owned.nbytes() == 0; }
};

}  // namespace wsync::model
