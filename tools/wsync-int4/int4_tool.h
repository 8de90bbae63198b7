// wsync-int4: offline INT4 conversions of safetensors files with the kernels of kernels/int4.h.
//
//   quantize        *.weight (bf16/fp16, 2-D or stacked 3-D) -> compressed-tensors
//                   (weight_packed, weight_scale, weight_shape) or GPTQ (qweight, scales, qzeros,
//                   g_idx); everything else passes through unchanged.
//   marlin-repack   GPTQ *.qweight [K/8, N] -> Marlin [K/16, 2N] and *.scales permuted (§5);
//                   compressed-tensors *.weight_packed / *.weight_scale are transposed as the
//                   engines do (§7) and repacked under their own names.
//   marlin-restore  the exact inverse of marlin-repack.
// Each command reads one file and writes one file atomically (SafetensorsWriter: temporary file in
// the output's directory + rename), so a failed run leaves nothing behind.
// Errors: kInvalidArgument naming the tensor and the values (K % 16, N % 64, K % G, dtype, group
// size, missing scales or g_idx); file errors as returned by common/safetensors.h.
// Thread-safety: the functions are reentrant; the kernels use Options::threads threads.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/int4.h"

namespace wsync::tools {

struct QuantizeFileOptions {
  std::string in, out;
  int group_size = 128;  // 32, 64, 128 or -1 (channelwise)
  kernels::PackFormat format = kernels::PackFormat::kCompressedTensors;
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

}  // namespace wsync::tools
