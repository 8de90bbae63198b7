// Which HF tensors a sync sends as INT4, and how (docs/spec/FORMATS.md §1-2). Both agents agree
// on it through this file: the trainer quantizes these tensors, the engine layout expects them.
//   targets  every 2-D "*.weight" except the token embedding ("*embed_tokens.weight"), minus
//            what quantization_config.ignore matches (module name or parameter name; "re:"
//            entries are Python re.match regexes, others exact names or prefixes). The ignore
//            list decides everything else (lm_head, routers, attention, ...).
//   output   compressed-tensors: <prefix>.weight_packed int32 [N, K/8], <prefix>.weight_scale
//            (weight dtype) [N, K/G], <prefix>.weight_shape int64 [2] = {N, K}; compressed-tensors
//            packing, variant qat (fl32(amax / 7)) unless configured.
//            AWQ (quant_method "awq", docs/spec/AWQ.md §1-2): <prefix>.qweight int32 [K, N/8],
//            <prefix>.qzeros int32 [K/G, N/8], <prefix>.scales (weight dtype) [K/G, N]; AutoAWQ's
//            fp16 arithmetic unless configured (N % 8 == 0).
// Everything else is sent as is, in its training dtype.
//
// Errors: kUnimplemented for quantization settings the INT4 path cannot produce
// (CheckInt4Supported: asymmetric, 8-bit, act-order, ...); kInvalidArgument naming the tensor
// for a target that cannot be quantized (not bf16/fp16, K not a multiple of 8 or of the group size).
// Thread-safety: pure functions; QuantizeHfTensor may use `num_threads` threads internally.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/config.h"
#include "common/tensor.h"
#include "kernels/awq.h"
#include "kernels/int4.h"
#include "model/hf_tensor.h"

namespace wsync::model {

struct QuantizeOptions {
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;  // compressed-tensors
  int num_threads = 0;                                          // 0 = hardware concurrency
  kernels::AwqArith awq_arith = kernels::AwqArith::kFp16;       // AWQ
};

// Whether the HF tensor `hf_name` of shape `shape` is sent as INT4 under `config`.
bool IsQuantTarget(absl::string_view hf_name, absl::Span<const int64_t> shape, const QuantizationConfig& config);

// The HF tensor names a quantized weight "<prefix>.weight" is sent as, in QuantizeHfTensor's
// order: {packed, scale, shape} (compressed-tensors) or {qweight, qzeros, scales} (AWQ).
std::vector<std::string> QuantizedNames(absl::string_view prefix, const QuantizationConfig& config);

// The three tensors of a quantized weight: packed, scale, shape (compressed-tensors) or qweight,
// qzeros, scales (AWQ).
absl::StatusOr<std::vector<HfTensor>> QuantizeHfTensor(absl::string_view hf_name, const TensorView& weight,
                                                       const QuantizationConfig& config,
                                                       const QuantizeOptions& options = {});

}  // namespace wsync::model
