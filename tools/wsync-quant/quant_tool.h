// wsync-quant: whole HF checkpoints (a directory: config.json + *.safetensors) to and from FP8, with
// the sync path's own quantizer (model::QuantizeHfTensor, docs/spec/FP8.md), so a checkpoint it
// writes holds exactly what a sync sends.
//
//   QuantizeCheckpointFp8   bf16 / fp16 -> FP8: block (DeepSeek-V3's form, `quant_method: fp8`,
//                           weight_block_size, scale_fmt ue8m0 optional; `modules_to_not_convert`
//                           from --ignore) or per channel (compressed-tensors float-quantized);
//                           config.json gets the quantization_config; every target (model::
//                           IsQuantTarget) becomes weight + weight_scale_inv / weight_scale.
//   DequantizeCheckpoint    FP8 (either form, as config.json says) -> bf16 / fp16
//                           (model::DequantizeFp8Checkpoint), quantization_config removed: the
//                           checkpoint a trainer or wsync-shard starts from.
// Files other than config.json and *.safetensors are copied. The output directory must not exist;
// it is written as a temporary directory beside it and renamed, so a failed run leaves nothing.
// Errors: kInvalidArgument naming the file, tensor and values (a checkpoint already quantized, a
// config without an FP8 quantization_config, bad block sizes); kAlreadyExists for an existing
// output; file errors as returned by common/safetensors.h.
// Thread-safety: reentrant; the kernels use Options::threads threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace wsync::tools {

struct Fp8CheckpointOptions {
  std::string in, out;
  bool channel = false;                  // per channel (compressed-tensors) rather than block
  int64_t block_n = 128, block_k = 128;  // block form
  bool ue8m0 = false;                    // block form: scale_fmt "ue8m0" (power-of-two scales)
  std::vector<std::string> ignore;       // modules kept in bf16 (exact names or prefixes; "re:" regexes)
  int threads = 0;
};
absl::Status QuantizeCheckpointFp8(const Fp8CheckpointOptions& options);

struct DequantizeOptions {
  std::string in, out;
  DType dtype = DType::kBF16;
  int threads = 0;
};
absl::Status DequantizeCheckpoint(const DequantizeOptions& options);

// config.json text without its quantization_config (for a dequantized checkpoint or a bf16 source).
absl::StatusOr<std::string> WithoutQuantizationConfig(const std::string& config_json, const std::string& source);

}  // namespace wsync::tools
