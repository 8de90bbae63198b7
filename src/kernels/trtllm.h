// Public API of the TensorRT-LLM INT4 kernels: the CUTLASS mixed-GEMM weight preprocessing
// (`preprocess_weights_for_mixed_gemm`: LDSM row permutation, sub-byte transpose, column
// interleave, bias and register interleave) for dense [K, N] and MoE [E, K, N] weights on sm80
// and sm90, W4A16 and W4AFP8, its exact inverse, and the scale layouts those kernels read.
// Bit-exact to docs/spec/TRTLLM_INT4.md (cited as §n); docs/kernels.md explains decisions.
//
// Inputs are unsigned INT4 codes in GPTQ orientation, I32 [(E,) K/8, N] (compressed-tensors
// weight_packed transposed, or AwqToGptq of an AWQ qweight): TRT-LLM's signed q is u - 8, its
// zero (8 - z) s for AWQ (§3.1). Rank 3 is an MoE expert stack, rank 2 a dense weight (§2 picks
// different layouts for them on sm90).
// Conventions as in kernels/int4.h: caller-provided outputs; Options::device picks CPU or CUDA.
// Errors: kInvalidArgument naming the tensor and the values (dtype, rank, K % 64 or % 128,
// N % 64, output shape, dense W4AFP8, group size, overlap); kFailedPrecondition for
// Device::kCuda without CUDA; kInternal for CUDA runtime failures.
// Thread-safety: reentrant; concurrent calls are safe when their outputs do not overlap.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"
#include "kernels/int4.h"

namespace wsync::kernels {

enum class TrtllmArch { kSm80, kSm90 };

struct TrtllmOptions : KernelOptions {
  // The GPU family the engine runs on (§2): kSm80 for sm75-89, sm100+ and sm120 too.
  TrtllmArch arch = TrtllmArch::kSm80;
  // FP8 activations (W4AFP8, MoE only): sm80 gives the sm89 layout (W4_AFP8 constants), sm90 the
  // Hopper grouped-GEMM layout (transposed, signed nibbles).
  bool w4afp8 = false;
};

// Byte shape of the preprocessed weight for GPTQ-orientation codes [(E,) K/8, N]: I8 [(E,) K, N/2],
// or [E, N, K/2] for W4AFP8 on sm90; with the checks of the layout (K % 64 (W4AFP8: % 128),
// N % 64, W4AFP8 only for rank 3).
absl::StatusOr<Shape> TrtllmWeightShapeFor(const Shape& gptq_shape, const TrtllmOptions& options);

// codes I32 [(E,) K/8, N] -> out I8 (shape above), per expert, in one gather pass.
absl::Status PreprocessTrtllm(const TensorView& codes, MutableTensorView out, const TrtllmOptions& options);
// Exact inverse (TRT-LLM's unpreprocess): codes I32 [(E,) K/8, N] from the preprocessed bytes
// (I8 or U8; rank 3 = an MoE stack, as for the forward direction).
absl::Status UnpreprocessTrtllm(const TensorView& bytes, MutableTensorView codes, const TrtllmOptions& options);

// The scales the kernels read (§3), from GPTQ-orientation scales [(E,) K/G, N] (bf16 / fp16):
//   W4A16: the same values, dtype and layout (row-major [K/G, N], not permuted);
//   W4AFP8 sm80 (sm89): fp16 [(E,) K/G, N] (the engine views the bits as its activation dtype);
//   W4AFP8 sm90: bf16 [E, K/G/I, N I], I = 4, 2, 1 as K % 4G, 2G == 0 (out[a, n I + i] = s[a I + i, n]).
// size_k = K, group_size G (kChannelwise = K).
struct TrtllmScaleLayout {
  DType dtype;
  Shape shape;
};
absl::StatusOr<TrtllmScaleLayout> TrtllmScaleLayoutFor(const TensorView& scales, int64_t size_k, int group_size,
                                                       const TrtllmOptions& options);
absl::Status TrtllmScales(const TensorView& scales, int64_t size_k, int group_size, MutableTensorView out,
                          const TrtllmOptions& options);

// §3.1 zeros for AWQ codes (W4A16 only): zero[g, n] = dtype((8 - z[g, n]) * s[g, n]) from AWQ
// qzeros I32 [(E,) K/G, N/8] and scales [(E,) K/G, N]; out has the scales' dtype and shape.
absl::Status TrtllmZerosFromAwq(const TensorView& qzeros, const TensorView& scales, MutableTensorView out,
                                const TrtllmOptions& options);

}  // namespace wsync::kernels
