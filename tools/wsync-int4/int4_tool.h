// wsync-int4: offline INT4 conversions of safetensors files with the kernels of kernels/int4.h.
//
//   quantize        *.weight (bf16/fp16, 2-D or stacked 3-D) -> compressed-tensors
//                   (weight_packed, weight_scale, weight_shape) or GPTQ (qweight, scales, qzeros,
//                   g_idx); everything else passes through unchanged.
//   marlin-repack   GPTQ *.qweight [K/8, N] -> Marlin [K/16, 2N] and *.scales permuted (§5);
//                   compressed-tensors *.weight_packed / *.weight_scale are transposed as the
//                   engines do (§7) and repacked under their own names.
//   marlin-restore  the exact inverse of marlin-repack.
//   quantize --format awq   *.weight -> AWQ *.qweight [K, N/8], *.qzeros [K/G, N/8], *.scales [K/G, N]
//                   (kernels/awq.h; --arith fp16|fp32).
//   awq-marlin-repack       AWQ tensors -> vLLM's AWQ-Marlin: *.qweight [K/16, 2N], *.qzeros in the
//                   Marlin zero-point layout, *.scales permuted (names kept, as vLLM replaces them).
//   trtllm-preprocess       compressed-tensors or AWQ INT4 -> TensorRT-LLM: *.weight I8 [.., K, N/2]
//                   ([E, N, K/2] for W4AFP8 on sm90), *.weight_scale in the kernel's layout, and for
//                   AWQ (W4A16) *.weight_zero = (8 - z) s (kernels/trtllm.h).
// Each command reads one file and writes one file atomically (SafetensorsWriter: temporary file in
// the output's directory + rename), so a failed run leaves nothing behind.
// Errors: kInvalidArgument naming the tensor and the values (K % 16, N % 64, K % G, dtype, group
// size, missing scales or g_idx); file errors as returned by common/safetensors.h.
// Thread-safety: the functions are reentrant; the kernels use Options::threads threads.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/awq.h"
#include "kernels/int4.h"
#include "kernels/trtllm.h"

namespace wsync::tools {

enum class QuantFileFormat { kCompressedTensors, kGptq, kAwq };

struct QuantizeFileOptions {
  std::string in, out;
  int group_size = 128;  // 32, 64, 128 or -1 (channelwise)
  QuantFileFormat format = QuantFileFormat::kCompressedTensors;
  kernels::AwqArith arith = kernels::AwqArith::kFp16;  // kAwq only
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;
  // ECMAScript regexes matched from the start of the module name (tensor name without ".weight")
  // or of the tensor name, like compressed-tensors' `re:` ignore entries; a leading "re:" is
  // stripped.
  std::vector<std::string> ignore;
  int threads = 0;
};
absl::Status QuantizeFile(const QuantizeFileOptions& options);

struct RepackFileOptions {
  std::string in, out;
  int group_size = 128;
  // If set, the act-order perm of a layer is the stable argsort of tensor "<prefix>.<perm_from>"
  // (usually "g_idx"; int32 [K] or [E, K]); the same tensor is read again by marlin-restore.
  std::string perm_from;
  int threads = 0;
};
absl::Status MarlinRepackFile(const RepackFileOptions& options);
absl::Status MarlinRestoreFile(const RepackFileOptions& options);

struct ConvertFileOptions {
  std::string in, out;
  int threads = 0;
  kernels::TrtllmArch arch = kernels::TrtllmArch::kSm80;  // trtllm-preprocess
  bool w4afp8 = false;                                    // trtllm-preprocess
};
// AWQ layers are found by *.qweight with *.qzeros and *.scales where qweight is [.., K, N/8] and
// scales [.., K/G, N]; G follows from the shapes (one group row = channelwise).
absl::Status AwqMarlinRepackFile(const ConvertFileOptions& options);
// Layers: *.weight_packed + *.weight_scale (compressed-tensors, transposed to GEMM orientation as
// the engines do) or AWQ as above. A rank-3 tensor is an MoE expert stack. *.weight_shape of a
// converted layer is dropped; everything else passes through.
absl::Status TrtllmPreprocessFile(const ConvertFileOptions& options);

}  // namespace wsync::tools
