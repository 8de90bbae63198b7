// Public API of the INT4 kernels: symmetric INT4 group quantization fused with packing
// (compressed-tensors or GPTQ orientation), GPTQ <-> Marlin weight repack, and the Marlin scale
// permutation, for dense [N, K] weights and stacked MoE experts [E, N, K]. Bit-exact to
// docs/spec/FORMATS.md (cited as §n); docs/kernels.md explains layout and decisions.
//
// Every function takes the caller's input and output views (no allocation of outputs), checks
// dtype, shape, size and alignment, and then runs on Options::device:
//   kCpu   host memory; split over Options::num_threads std::threads (0 = hardware_concurrency);
//   kCuda  device memory (cudaMalloc'ed pointers in the views); enqueued on Options::cuda_stream
//          (nullptr = the legacy default stream) and synchronized before returning, so that launch
//          and execution errors are reported. kFailedPrecondition if CUDA was not compiled in.
// Errors: kInvalidArgument naming the tensor and the offending values (dtype, rank, K % 16,
// N % 64, K % G, group size, output shape, expert count, perm contents, misalignment, overlap,
// and Inf/NaN in W, reported by expert/row/group); kFailedPrecondition for Device::kCuda in a
// build without CUDA; kInternal for CUDA runtime failures. On error nothing is guaranteed about
// the outputs.
// Thread-safety: reentrant; concurrent calls are safe when their outputs do not overlap.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor.h"

namespace wsync::kernels {

enum class Device { kCpu, kCuda };

// FORMATS.md §1.1 (`qat`: fl32(amax / 7), the default) or §1.2 (`slime`: amax * fl32(1/7)).
enum class QuantVariant { kQat, kSlime };

// Output orientation of QuantizeInt4: compressed-tensors `weight_packed [N, K/8]` +
// `weight_scale [N, K/G]` (§2), or GPTQ `qweight [K/8, N]` + `scales [K/G, N]` (§3).
enum class PackFormat { kCompressedTensors, kGptq };

// Group size meaning "one group per row" (compressed-tensors writes -1).
inline constexpr int kChannelwise = -1;

struct KernelOptions {
  Device device = Device::kCpu;
  int num_threads = 0;          // CPU: 0 = std::thread::hardware_concurrency()
  void* cuda_stream = nullptr;  // CUDA: a cudaStream_t
};

struct QuantizeOptions : KernelOptions {
  int group_size = 128;  // 32, 64, 128 or kChannelwise (-1); K % G == 0
  QuantVariant variant = QuantVariant::kQat;
  PackFormat format = PackFormat::kCompressedTensors;
};

// Quantizes W (bf16 or fp16, [N, K] or [E, N, K], K % 8 == 0) in one pass.
//   kCompressedTensors: packed int32 [(E,) N, K/8], scales [(E,) N, K/G]
//   kGptq:              packed int32 [(E,) K/8, N], scales [(E,) K/G, N]
// scales have W's dtype and hold dtype(scale_f32), round to nearest even.
absl::Status QuantizeInt4(const TensorView& w, MutableTensorView packed, MutableTensorView scales,
                          const QuantizeOptions& options);

// Reuse of an earlier QuantizeInt4 of the same tensor (delta sync: most groups' inputs do not
// change between two training steps). Every group (G consecutive elements of a row) gets the
// XXH3-64 of its input bits in `next_digests`; a group whose digest equals its entry in `digests`
// is not quantized: its packed words and its scale are copied from `packed` / `scales`, that
// earlier call's outputs. The result is the plain call's bytes unless a changed group's new input
// shares its old one's 64-bit digest (a chance of 2^-64 per changed group). A reused group is not
// checked for Inf / NaN again (its input is the one that passed). CPU and compressed-tensors only.
// The FP8 quantizers take the same struct (fp8.h), a unit being a block or a row, and AWQ's
// (awq.h), a unit being 8 rows' group (one qzeros word).
struct QuantizeReuse {
  std::span<const uint64_t> digests;  // the earlier call's next_digests; empty: every group is quantized
  TensorView packed, scales;          // the earlier call's outputs (FP8: the codes; read only where digests is set)
  std::span<uint64_t> next_digests;   // out: [(E,) N, K/G], one per group (FP8: per scale; AWQ: per qzeros word)
  int64_t reused_groups = 0;          // out: the groups (FP8: blocks or rows; AWQ: 8 rows' groups) copied
  TensorView zeros;                   // AWQ: the earlier call's qzeros
};
// QuantizeInt4 with `reuse`; kInvalidArgument as QuantizeInt4, and for a CUDA device or the GPTQ
// format, next_digests not of one entry per group, digests neither empty nor of that size, earlier
// outputs of other dtypes or shapes than the outputs', or overlapping them.
absl::Status QuantizeInt4(const TensorView& w, MutableTensorView packed, MutableTensorView scales,
                          const QuantizeOptions& options, QuantizeReuse& reuse);

// Shapes QuantizeInt4 expects for its outputs (same checks on w and the group size).
struct QuantizedShapes {
  Shape packed;
  Shape scales;
};
absl::StatusOr<QuantizedShapes> QuantizedShapesFor(const TensorView& w, int group_size, PackFormat format);

// GPTQ qweight int32 [K/8, N] or [E, K/8, N] -> Marlin int32 [K/16, 2N] or [E, K/16, 2N] (§4, §6).
// size_k = K is implied by the input (8 * dim). K % 16 == 0, N % 64 == 0.
// perm: nullptr for none, else int32 [K] or [E, K], each row a permutation of 0..K-1; Marlin row k
// is GPTQ row perm[k] (§4.3; engines pass argsort(g_idx)).
absl::Status GptqToMarlin(const TensorView& gptq, const TensorView* perm, MutableTensorView marlin,
                          const KernelOptions& options);
// Exact inverse: MarlinToGptq(GptqToMarlin(x, perm), perm) == x.
absl::Status MarlinToGptq(const TensorView& marlin, const TensorView* perm, MutableTensorView gptq,
                          const KernelOptions& options);

// Marlin scale permutation (§5): scales bf16/fp16 [K/G, N] or [E, K/G, N] (GPTQ orientation),
// N % 64 == 0. size_k is the full K; group_size G in {32, 64, 128, -1}, or any G with K % G == 0.
// Uses scale_perm (64 columns) when G != -1 and G < K, else scale_perm_single (32 columns).
// out has the input's dtype and shape and must not alias it.
absl::Status PermuteMarlinScales(const TensorView& scales, int64_t size_k, int group_size, MutableTensorView out,
                                 const KernelOptions& options);
// Exact inverse of PermuteMarlinScales with the same size_k and group_size.
absl::Status UnpermuteMarlinScales(const TensorView& scales, int64_t size_k, int group_size, MutableTensorView out,
                                   const KernelOptions& options);

// Marlin shape of a GPTQ qweight shape ([K/8, N] -> [K/16, 2N], per expert), with the checks above.
absl::StatusOr<Shape> MarlinShapeFor(const Shape& gptq_shape);
// GPTQ shape of a Marlin qweight shape ([K/16, 2N] -> [K/8, N]).
absl::StatusOr<Shape> GptqShapeFor(const Shape& marlin_shape);

}  // namespace wsync::kernels
