// Which HF tensors a sync sends quantized (INT4 or FP8), and how (docs/spec/FORMATS.md §1-2, AWQ.md,
// FP8.md). Both agents agree
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
//            FP8 block (quant_method "fp8", FP8.md §2): <prefix>.weight F8_E4M3 [N, K],
//            <prefix>.weight_scale_inv F32 [ceil(N/bn), ceil(K/bk)]; slime's variant, ue8m0 when
//            the config's scale_fmt says so, unless configured.
//            FP8 channel (compressed-tensors float, FP8.md §3): <prefix>.weight F8_E4M3 [N, K],
//            <prefix>.weight_scale [N, 1] (F32, slime's variant, unless configured).
// Everything else is sent as is, in its training dtype.
//
// Errors: kUnimplemented for quantization settings wsync cannot produce (CheckSupported:
// asymmetric, 8-bit int, act-order, per-tensor FP8, ...); kInvalidArgument naming the tensor for a
// target that cannot be quantized (not bf16/fp16, INT4 K not a multiple of 8 or of the group size,
// Inf / NaN for FP8).
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
#include "kernels/awq.h"
#include "kernels/fp8.h"
#include "kernels/int4.h"
#include "model/hf_checkpoint.h"
#include "model/hf_tensor.h"

namespace wsync::model {

struct QuantizeOptions {
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;  // compressed-tensors
  int num_threads = 0;                                          // 0 = hardware concurrency
  kernels::AwqArith awq_arith = kernels::AwqArith::kFp16;       // AWQ
  // FP8 block: nullopt = the config's (ue8m0 for scale_fmt "ue8m0", else slime).
  std::optional<kernels::Fp8BlockVariant> fp8_block;
  kernels::Fp8ChannelVariant fp8_channel = kernels::Fp8ChannelVariant::kSlime;  // FP8 channel
  kernels::Device device = kernels::Device::kCpu;  // where the FP8 kernels run (QuantizeFp8)
};

// Whether the HF tensor `hf_name` of shape `shape` is sent as INT4 under `config`.
bool IsQuantTarget(absl::string_view hf_name, absl::Span<const int64_t> shape, const QuantizationConfig& config);

// The HF tensor names a quantized weight "<prefix>.weight" is sent as, in QuantizeHfTensor's
// order: {packed, scale, shape} (compressed-tensors), {qweight, qzeros, scales} (AWQ), {weight,
// weight_scale_inv} (FP8 block) or {weight, weight_scale} (FP8 channel).
std::vector<std::string> QuantizedNames(absl::string_view prefix, const QuantizationConfig& config);

// The tensors of a quantized weight: packed, scale, shape (compressed-tensors), qweight, qzeros,
// scales (AWQ) or weight, scale (FP8).
absl::StatusOr<std::vector<HfTensor>> QuantizeHfTensor(absl::string_view hf_name, const TensorView& weight,
                                                       const QuantizationConfig& config,
                                                       const QuantizeOptions& options = {});

// FP8: the scale tensor of weight `w` (its codes are F8_E4M3 of w's shape) under an FP8 `config`.
struct Fp8Shapes {
  Shape scale;
  DType scale_dtype = DType::kF32;
};
absl::StatusOr<Fp8Shapes> Fp8ShapesFor(const TensorView& w, const QuantizationConfig& config,
                                       const QuantizeOptions& options = {});
// The block variant a sync uses under `config` and `options` (the options' when set).
kernels::Fp8BlockVariant Fp8BlockVariantFor(const QuantizationConfig& config, const QuantizeOptions& options);
// W -> q (F8_E4M3) and scale (Fp8ShapesFor) with the config's block size and the variant of the
// options, on options.device; the kernels' errors. With `reuse` (CPU), the kernels' reuse of an
// earlier call's outputs (kernels/fp8.h).
absl::Status QuantizeFp8(const TensorView& w, MutableTensorView q, MutableTensorView scale,
                         const QuantizationConfig& config, const QuantizeOptions& options,
                         kernels::QuantizeReuse* reuse = nullptr);

// An FP8 checkpoint (DeepSeek-V3's block form or compressed-tensors per channel, `q`) as the
// checkpoint a trainer holds: every F8_E4M3 `X.weight` replaced by float(code) x its block's or
// row's scale (`X.weight_scale_inv` / `X.weight_scale`, F32 or BF16), rounded to `dtype` (BF16 or
// F16), the scales dropped, every other tensor copied. kInvalidArgument naming an FP8 weight
// without its scale, or a scale of the wrong shape; the kernels' errors.
absl::StatusOr<HfCheckpoint> DequantizeFp8Checkpoint(const HfCheckpoint& fp8, const QuantizationConfig& q,
                                                     DType dtype = DType::kBF16, int num_threads = 0);

}  // namespace wsync::model
