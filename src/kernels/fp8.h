// Public API of the FP8 kernels: bf16 / fp16 weights to FP8 E4M3 codes, block-wise (DeepSeek-V3
// form: weight_scale_inv per bn x bk block) or per channel (compressed-tensors: weight_scale per
// row), for dense [N, K] weights and stacked MoE experts [E, N, K]; and the dequantization the
// checks use. Bit-exact to docs/spec/FP8.md (cited as §n); docs/kernels.md has the decisions.
//
// As the INT4 kernels (kernels/int4.h): the caller's views, every argument checked, then run on
// Options::device (kCpu: Options::num_threads threads; kCuda: device memory, enqueued on
// Options::cuda_stream and synchronized before returning).
// Errors: kInvalidArgument naming the tensor and the offending values (dtype, rank, shape of an
// output, block sizes, misalignment, overlap, and Inf/NaN in W named by expert and block or row);
// kFailedPrecondition for Device::kCuda in a build without CUDA; kInternal for CUDA failures. On
// error nothing is guaranteed about the outputs.
// Thread-safety: reentrant; concurrent calls are safe when their outputs do not overlap.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "kernels/int4.h"

namespace wsync::kernels {

// How a block's scale is computed (§2.1 slime, the default; §2.2 vllm; §2.3 ue8m0).
enum class Fp8BlockVariant { kSlime, kVllm, kUe8m0 };
// How a row's scale is computed (§3.1 slime, F32 scales, the default; §3.2 compressed-tensors,
// scales in W's dtype).
enum class Fp8ChannelVariant { kSlime, kCompressedTensors };

struct Fp8BlockOptions : KernelOptions {
  int64_t block_n = 128;  // the checkpoint's weight_block_size
  int64_t block_k = 128;
  Fp8BlockVariant variant = Fp8BlockVariant::kSlime;
};

struct Fp8ChannelOptions : KernelOptions {
  Fp8ChannelVariant variant = Fp8ChannelVariant::kSlime;
};

// The weight_scale_inv shape of W ([(E,) N, K]): [(E,) ceil(N/bn), ceil(K/bk)].
absl::StatusOr<Shape> Fp8BlockScaleShape(const Shape& w, int64_t block_n, int64_t block_k);

// W (BF16 or F16, [N, K] or [E, N, K]) -> q (F8_E4M3, W's shape) and scale_inv (F32,
// Fp8BlockScaleShape). N and K need not be multiples of the block.
absl::Status QuantizeFp8Block(const TensorView& w, MutableTensorView q, MutableTensorView scale_inv,
                              const Fp8BlockOptions& options);

// W (BF16 or F16, [N, K] or [E, N, K]) -> q (F8_E4M3, W's shape) and scale ([(E,) N, 1]: F32 for
// kSlime, W's dtype for kCompressedTensors).
absl::Status QuantizeFp8Channel(const TensorView& w, MutableTensorView q, MutableTensorView scale,
                                const Fp8ChannelOptions& options);

// With `reuse` (QuantizeReuse, int4.h; delta sync): one XXH3-64 per unit of W's bits, a unit being
// a block (its rows' segments hashed in order, each seeded with the digest so far) or a row, in
// scale order; a unit whose digest equals its entry in reuse.digests copies its codes and its scale
// from reuse.packed (the earlier q) and reuse.scales instead of being quantized. The plain call's
// bytes unless a changed unit keeps its 64-bit digest (2^-64 per changed unit); a reused unit is
// not checked for Inf / NaN again. CPU only. kInvalidArgument as the plain call, and for a CUDA
// device, next_digests not of one entry per scale, digests neither empty nor of that size, earlier
// outputs of other dtypes or shapes than the outputs', or overlapping them.
absl::Status QuantizeFp8Block(const TensorView& w, MutableTensorView q, MutableTensorView scale_inv,
                              const Fp8BlockOptions& options, QuantizeReuse& reuse);
absl::Status QuantizeFp8Channel(const TensorView& w, MutableTensorView q, MutableTensorView scale,
                                const Fp8ChannelOptions& options, QuantizeReuse& reuse);

// out = float(q) * scale of its block (scale_inv F32) or row (scale [(E,) N, 1], F32 / BF16 / F16),
// as F32, or as BF16 (RNE of the F32 product). NaN codes give NaN.
absl::Status DequantizeFp8Block(const TensorView& q, const TensorView& scale_inv, int64_t block_n, int64_t block_k,
                                MutableTensorView out, const KernelOptions& options);
absl::Status DequantizeFp8Channel(const TensorView& q, const TensorView& scale, MutableTensorView out,
                                  const KernelOptions& options);

}  // namespace wsync::kernels
