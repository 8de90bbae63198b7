// CPU AWQ and TensorRT-LLM INT4 kernels (the reference paths of kernels/awq.h and kernels/trtllm.h).
// Reached through those headers, which validate every argument first; these trust their arguments.
// Math and layout: kernels/format/awq_format.h and kernels/format/trtllm_format.h.
// Thread-safety: reentrant; concurrent calls must not write overlapping outputs.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/int4_args.h"

namespace wsync::kernels::cpu {

// The units these kernels split their work into (for the dispatchers and every SIMD target alike).
inline constexpr int64_t kAwqRowBlock = 128;  // QuantizeAwq: rows per unit (16 AWQ words = 64 bytes per k)
inline constexpr int64_t kTrtllmTileCols = 256, kTrtllmTileBlocks = 16;  // Trtllm: columns x 32-row blocks

// AWQ.md §1 + §2: writes qweight, qzeros, scales; kInvalidArgument for the smallest refused group.
absl::Status QuantizeAwq(const internal::AwqQuantizeArgs& args);
// AWQ [E, R, N/8] <-> GPTQ orientation [E, R/8, N].
absl::Status AwqToGptq(const internal::AwqRepackArgs& args);
absl::Status GptqToAwq(const internal::AwqRepackArgs& args);
// AWQ.md §3.1: AWQ qweight [E, K, N/8] -> Marlin [E, K/16, 2N] (args.rows = K).
absl::Status AwqToMarlin(const internal::AwqRepackArgs& args);
// AWQ.md §3.3 and its inverse (args.rows = K/G).
absl::Status AwqZerosToMarlin(const internal::AwqRepackArgs& args);
absl::Status MarlinZerosToAwq(const internal::AwqRepackArgs& args);

// TRTLLM_INT4.md §1 (args.inverse: the unpreprocess) and §3 (scales, AWQ zeros).
absl::Status Trtllm(const internal::TrtllmArgs& args);
absl::Status TrtllmScales(const internal::TrtllmScaleArgs& args);
absl::Status TrtllmZeros(const internal::TrtllmScaleArgs& args);

}  // namespace wsync::kernels::cpu
