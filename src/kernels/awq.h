// Public API of the AWQ W4 kernels: asymmetric INT4 group quantization with zero points fused
// with AWQ packing (AutoAWQ "GEMM" checkpoints, as vLLM's `awq` loads them), the AWQ <-> GPTQ
// code orientation, and the AWQ-Marlin conversion vLLM runs after loading (`awq_marlin_repack`,
// `awq_to_marlin_zero_points`; the scales use PermuteMarlinScales of kernels/int4.h). Dense [N, K]
// weights and stacked MoE experts [E, N, K]. Bit-exact to docs/spec/AWQ.md (cited as §n);
// docs/kernels.md explains layout and decisions.
//
// Conventions as in kernels/int4.h: caller-provided outputs, Options::device picks the CPU
// (std::threads) or CUDA (device pointers, enqueued on cuda_stream and synchronized) path.
// Errors: kInvalidArgument naming the tensor and the values (dtype, rank, N % 8, N % 64, K % 16,
// K % G, group size, output shape, misalignment, overlap; Inf/NaN in W, and for the fp16
// arithmetic a value or a group range that fp16 cannot hold, by expert/row/group);
// kFailedPrecondition for Device::kCuda without CUDA; kInternal for CUDA runtime failures.
// On error nothing is guaranteed about the outputs.
// Thread-safety: reentrant; concurrent calls are safe when their outputs do not overlap.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "kernels/int4.h"

namespace wsync::kernels {

// §1: AutoAWQ's arithmetic as it runs on a GPU (every op rounded to fp16: a bf16 model is first
// converted to fp16), or the same formula in float32. Both yield valid AWQ tensors; they differ
// in about 0.3 % of the codes (the fp16 rounding of w / s).
enum class AwqArith { kFp16, kFp32 };

struct AwqQuantizeOptions : KernelOptions {
  int group_size = 128;  // 32, 64, 128 or kChannelwise (-1); K % G == 0
  AwqArith arith = AwqArith::kFp16;
};

// Output shapes of QuantizeAwq for W [(E,) N, K]:
//   qweight I32 [(E,) K, N/8], qzeros I32 [(E,) K/G, N/8], scales W-dtype [(E,) K/G, N].
struct AwqShapes {
  Shape qweight, qzeros, scales;
};
absl::StatusOr<AwqShapes> AwqShapesFor(const TensorView& w, int group_size);

// Quantizes W (bf16 or fp16, [N, K] or [E, N, K], N % 8 == 0) to AWQ in one pass. scales hold
// W's dtype: the fp16 scale itself for fp16 W; for bf16 W, bf16(fp16 scale) (kFp16, what a bf16
// vLLM model loads) or bf16(f32 scale) (kFp32), round to nearest even. The codes are computed
// from the unrounded scale of the arithmetic (§1).
absl::Status QuantizeAwq(const TensorView& w, MutableTensorView qweight, MutableTensorView qzeros,
                         MutableTensorView scales, const AwqQuantizeOptions& options);
// With `reuse` (QuantizeReuse, int4.h; delta sync): a unit is one qzeros word, the group g of
// rows 8j..8j+7 (G codes in word column j of qweight, one zero word, 8 scales); its digest chains
// XXH3-64 over the 8 rows' G inputs (each seeded with the digest so far), in qzeros order. A unit
// whose digest equals its entry in reuse.digests copies its words and scales from reuse.packed
// (the earlier qweight), reuse.zeros and reuse.scales. The plain call's bytes unless a changed
// unit keeps its 64-bit digest (2^-64 per changed unit); a reused unit is not checked again. CPU
// only. kInvalidArgument as the plain call, and for a CUDA device, next_digests not of one entry
// per qzeros word, digests neither empty nor of that size, earlier outputs of other dtypes or
// shapes than the outputs', or overlapping them.
absl::Status QuantizeAwq(const TensorView& w, MutableTensorView qweight, MutableTensorView qzeros,
                         MutableTensorView scales, const AwqQuantizeOptions& options, QuantizeReuse& reuse);

// AWQ-packed I32 [(E,) R, N/8] (qweight, or qzeros with R = K/G) <-> GPTQ orientation I32
// [(E,) R/8, N] (8 R-consecutive codes per word; for qweight the layout GptqToMarlin takes).
// R % 8 == 0. Exact inverses of each other.
absl::Status AwqToGptq(const TensorView& awq, MutableTensorView gptq, const KernelOptions& options);
absl::Status GptqToAwq(const TensorView& gptq, MutableTensorView awq, const KernelOptions& options);

// §3.1 awq_marlin_repack: AWQ qweight I32 [(E,) K, N/8] -> Marlin I32 [(E,) K/16, 2N], K % 16 == 0,
// N % 64 == 0; identical to GptqToMarlin of AwqToGptq(qweight) without perm (one fused pass).
absl::Status AwqToMarlin(const TensorView& qweight, MutableTensorView marlin, const KernelOptions& options);
absl::StatusOr<Shape> AwqMarlinShapeFor(const Shape& awq_qweight_shape);

// §3.3 awq_to_marlin_zero_points: AWQ qzeros I32 [(E,) K/G, N/8] -> Marlin zero points, same
// shape, N % 64 == 0. MarlinZerosToAwq is its exact inverse.
absl::Status AwqZerosToMarlin(const TensorView& qzeros, MutableTensorView out, const KernelOptions& options);
absl::Status MarlinZerosToAwq(const TensorView& marlin_zeros, MutableTensorView out, const KernelOptions& options);

}  // namespace wsync::kernels
