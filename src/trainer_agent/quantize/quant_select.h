// Which HF tensors a sync sends as INT4, and how (FORMATS.md §1-2, the rules):
//   targets  every 2-D "*.weight" except the token embedding ("*embed_tokens.weight"), minus
//            what quantization_config.ignore matches (module name or parameter name; "re:"
//            entries are Python re.match regexes, others exact names or prefixes). The ignore
//            list decides everything else (lm_head, routers, attention, ...).
//   output   <prefix>.weight_packed int32 [N, K/8], <prefix>.weight_scale (weight dtype) [N, K/G],
//            <prefix>.weight_shape int64 [2] = {N, K}; compressed-tensors packing, variant qat
//            (fl32(amax / 7)) unless configured.
// Everything else is sent as is, in its training dtype.
//
// ExpectedSentTensors is the test oracle: the original HF checkpoint converted directly into
// exactly what a sync must deliver, independent of any parallel layout.
//
// Errors: kUnimplemented for quantization settings the INT4 path cannot produce
// (CheckInt4Supported: asymmetric, 8-bit, act-order, ...); kInvalidArgument naming the tensor
// for a target that cannot be quantized (not bf16/fp16, K not a multiple of 8 or of the group
// size); kNotFound / kInvalidArgument for missing, mis-shaped or unknown checkpoint tensors.
// Thread-safety: pure functions; QuantizeHfTensor may use `num_threads` threads internally.
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
#include "trainer_agent/convert/hf_checkpoint.h"
#include "trainer_agent/convert/hf_convert.h"

namespace wsync::quantize {

struct QuantizeOptions {
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;
  int num_threads = 0;  // 0 = hardware concurrency
};

// Whether the HF tensor `hf_name` of shape `shape` is sent as INT4 under `config`.
bool IsQuantTarget(absl::string_view hf_name, absl::Span<const int64_t> shape, const QuantizationConfig& config);

// The three tensors of a quantized weight, in the order packed, scale, shape.
absl::StatusOr<std::vector<convert::HfTensor>> QuantizeHfTensor(absl::string_view hf_name, const TensorView& weight,
                                                                const QuantizationConfig& config,
                                                                const QuantizeOptions& options = {});

// What a sync of `model` must deliver, from the model's own HF checkpoint `hf`: every HF tensor
// of the model (HfTensorSpecs order), INT4 triplets for targets when `quant` is given, the rest
// as is (router.expert_bias as fp32). Checkpoint tensors that a sync never sends are ignored
// only when they are a tied lm_head.weight or belong to MTP layers (model.layers.{>= L});
// any other unknown tensor is kInvalidArgument.
absl::StatusOr<std::vector<convert::HfTensor>> ExpectedSentTensors(const ModelConfig& model,
                                                                   const convert::HfCheckpoint& hf,
                                                                   const QuantizationConfig* quant,
                                                                   const QuantizeOptions& options = {});

// The same from a model directory (config.json + *.safetensors, mmap'ed). `quant`: the engine's
// quantization config; std::nullopt means the config.json's own quantization_config (none:
// everything unquantized). The tensors alias `hf` where they are not quantized or widened.
struct ExpectedSync {
  ModelConfig model;
  convert::HfCheckpoint hf;
  std::vector<convert::HfTensor> tensors;
};
absl::StatusOr<ExpectedSync> ExpectedSentTensorsFromDir(const std::string& hf_dir,
                                                        const std::optional<QuantizationConfig>& quant,
                                                        const QuantizeOptions& options = {});

}  // namespace wsync::quantize
