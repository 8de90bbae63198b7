// Which HF tensors a sync sends as INT4, and how (docs/spec/FORMATS.md §1-2). Both agents agree
// on it through this file: the trainer quantizes these tensors, the engine layout expects them.
//   targets  every 2-D "*.weight" except the token embedding ("*embed_tokens.weight"), minus
//            what quantization_config.ignore matches (module name or parameter name; "re:"
//            entries are Python re.match regexes, others exact names or prefixes). The ignore
//            list decides everything else (lm_head, routers, attention, ...).
//   output   <prefix>.weight_packed int32 [N, K/8], <prefix>.weight_scale (weight dtype) [N, K/G],
//            <prefix>.weight_shape int64 [2] = {N, K}; compressed-tensors packing, variant qat
//            (fl32(amax / 7)) unless configured.
// Everything else is sent as is, in its training dtype.
//
// Errors: kUnimplemented for quantization settings the INT4 path cannot produce
// (CheckInt4Supported: asymmetric, 8-bit, act-order, ...); kInvalidArgument naming the tensor
// for a target that cannot be quantized (not bf16/fp16, K not a multiple of 8 or of the group size).
// Thread-safety: pure functions; QuantizeHfTensor may use `num_threads` threads internally.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/config.h"
#include "common/tensor.h"
#include "kernels/int4.h"
#include "model/hf_tensor.h"

namespace wsync::model {

struct QuantizeOptions {
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;
  int num_threads = 0;  // 0 = hardware concurrency
};

// Whether the HF tensor `hf_name` of shape `shape` is sent as INT4 under `config`.
bool IsQuantTarget(absl::string_view hf_name, absl::Span<const int64_t> shape, const QuantizationConfig& config);

// The three tensors of a quantized weight, in the order packed, scale, shape.
absl::StatusOr<std::vector<HfTensor>> QuantizeHfTensor(absl::string_view hf_name, const TensorView& weight,
                                                       const QuantizationConfig& config,
                                                       const QuantizeOptions& options = {});

}  // namespace wsync::model
