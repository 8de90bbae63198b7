// What a sync of the trainer side must deliver, as a test and verification oracle
// (ExpectedSentTensors): the original HF checkpoint converted directly into exactly what a sync
// must deliver, independent of any parallel layout. Which tensors are INT4 and how they are
// quantized is model/quant_target.h.
//
// Errors: kUnimplemented for quantization settings the INT4 path cannot produce
// (CheckInt4Supported: asymmetric, 8-bit, act-order, ...); kInvalidArgument naming the tensor
// for a target that cannot be quantized (not bf16/fp16, K not a multiple of 8 or of the group
// size); kNotFound / kInvalidArgument for missing, mis-shaped or unknown checkpoint tensors.
// Thread-safety: pure functions; quantization may use `options.num_threads` threads internally.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/config.h"
#include "common/tensor.h"
#include "kernels/int4.h"
#include "model/hf_checkpoint.h"
#include "model/quant_target.h"
#include "trainer_agent/convert/hf_convert.h"

namespace wsync::trainer_agent {

// What a sync of `model` must deliver, from the model's own HF checkpoint `hf`: every HF tensor
// of the model (HfTensorSpecs order), INT4 triplets for targets when `quant` is given, the rest
// as is (router.expert_bias as fp32), the first `mtp_num_layers` MTP layers included (a run that
// trains them: MEGATRON_TO_HF.md §5.7). Checkpoint tensors that a sync never sends are ignored
// only when they are a tied lm_head.weight or belong to MTP layers (model.layers.{>= L}: the ones
// not synced, a DeepSeek-V3 MTP layer's embed_tokens / shared_head.head); any other unknown tensor
// is kInvalidArgument.
absl::StatusOr<std::vector<model::HfTensor>> ExpectedSentTensors(const ModelConfig& model,
                                                                 const model::HfCheckpoint& hf,
                                                                 const QuantizationConfig* quant,
                                                                 const model::QuantizeOptions& options = {},
                                                                 int64_t mtp_num_layers = 0);

// The same from a model directory (config.json + *.safetensors, mmap'ed). `quant`: the engine's
// quantization config; std::nullopt means the config.json's own quantization_config (none:
// everything unquantized). The tensors alias `hf` where they are not quantized or widened.
struct ExpectedSync {
  ModelConfig model;
  model::HfCheckpoint hf;
  std::vector<model::HfTensor> tensors;
};
absl::StatusOr<ExpectedSync> ExpectedSentTensorsFromDir(const std::string& hf_dir,
                                                        const std::optional<QuantizationConfig>& quant,
                                                        const model::QuantizeOptions& options = {},
                                                        int64_t mtp_num_layers = 0);

}  // namespace wsync::trainer_agent
