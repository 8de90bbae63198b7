// Staging (SGLang's loaded form) <-> engine memory (the form the engine serves from), and dense
// dequantization for verification and for the reference engine. Spec: ENGINE_LAYOUT.md §4,
// FORMATS.md §3-6; the bit-level work is done by src/kernels (GptqToMarlin, MarlinToGptq,
// PermuteMarlinScales, UnpermuteMarlinScales).
//
// Commit(staging, engine): for every param of the layout,
//   plain (bf16 / fp32)   copy;
//   dense INT4 packed     permute_param_layout_ ([N_p, K_p/8] -> [K_p/8, N_p]) then
//                         gptq_marlin_repack(size_k = K_p, size_n = N_p) -> [K_p/16, 2N_p];
//   dense INT4 scale      transpose ([N_p, K_p/G] -> [K_p/G, N_p]) then marlin_permute_scales,
//                         64-column perm iff G != -1 and G < K_p;
//   MoE packed            per expert gptq_marlin_moe_repack: [E, K/8, N] -> [E, K/16, 2N];
//   MoE scale             per expert marlin_moe_permute_scales with SGLang's size_k (w13: 4I',
//                         so the 64-column perm iff G < 4I'; w2: I');
//   AWQ qweight           awq_marlin_repack [(E,) K, N/8] -> [(E,) K/16, 2N] (AWQ.md §3.1, no transpose);
//   AWQ qzeros            awq_to_marlin_zero_points, same shape (§3.3);
//   AWQ scales            marlin_permute_scales as above, vLLM's size_k (MoE: I' for w13 and w2, §4).
// Engine buffers in device memory (EngineBuffer::cuda_device >= 0, an engine's CUDA parameters)
// are written on their device: plain params are copied host -> device; INT4 params are brought to
// GPTQ orientation on the host as above, uploaded into one device scratch buffer per device (the
// largest INT4 param's loaded bytes) and repacked by the CUDA kernels straight into the engine's
// memory. No host copy of the engine's memory is kept; the bytes equal the host path's.
// Everything is validated before the first byte is written (staging complete, engine buffers
// exactly the layout's engine form, no overlaps, host and device scratch allocated), so a refused
// Commit leaves the engine untouched. Restore(engine, staging) is the exact inverse (MarlinToGptq,
// unpermute, transpose back; AWQ: MarlinToGptq + GptqToAwq, MarlinZerosToAwq), fills every
// staging buffer and marks every piece restored.
//
// Errors: Commit/Restore return kNotFound (incomplete staging: the missing pieces) or
// kInvalidArgument (engine buffers vs. layout, staging from another layout) before writing;
// kResourceExhausted if scratch memory cannot be allocated (before writing; kFailedPrecondition or
// kUnimplemented for device scratch without a usable device or CUDA build); kInternal if a kernel
// or a device copy fails after validation (a bug: the engine may then be partially written) or, with
// RepackOptions::verify, if the read-back differs.
// Thread-safety: Commit and Restore may not run concurrently with each other or with Load on the
// same staging; each uses up to RepackOptions::num_threads threads internally. DequantizeToDense
// is reentrant.
#pragma once

#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tensor.h"
#include "engine_model/engine_layout.h"
#include "engine_model/engine_weights.h"
#include "engine_model/loader.h"

namespace wsync::engine_model {

struct RepackOptions {
  int num_threads = 0;  // 0: hardware concurrency (kernels: at most one thread per MiB)
  bool verify = false;  // Commit: read every param back (Marlin -> GPTQ, unpermute) and compare with staging
};

absl::Status Commit(const Staging& staging, EngineWeights& engine, const RepackOptions& options = {});
absl::Status Restore(const EngineWeights& engine, Staging& staging, const RepackOptions& options = {});

// One param of host engine memory in its loaded form (the inverse of Commit for that param: plain
// params copied, INT4 restored from Marlin to compressed-tensors / GPTQ orientation), into `loaded`
// (the param's loaded dtype and shape). kNotFound for an unknown name, kInvalidArgument for a view
// that does not fit, kFailedPrecondition for device memory (use Restore), kResourceExhausted if
// scratch memory cannot be allocated.
absl::Status RestoreParamToLoaded(const EngineLayout& layout, absl::string_view name, const EngineWeights& engine,
                                  const MutableTensorView& loaded, const RepackOptions& options = {});

struct DenseOptions {
  DType out_dtype = DType::kF32;  // kF32 (exact: q * s) or kBF16 (bf16(q * s), one rounding)
  int num_threads = 0;
};

// The weight of `linear` as a dense HF-orientation tensor, [n, k] or [experts, n, k] (w13:
// [E_loc, 2I', H] with gate rows first; w2: [E_loc, H, I']), from its params in `form`.
// Unquantized: `weight` is the bf16/fp32 param (scale unused), converted. INT4: `weight` is the
// packed param and `scale` the scale param, both in `form`; W = (nibble - 8) * scale. AWQ:
// `zeros` is the zero-point param (empty otherwise); W = (u - z) * scale.
// kInvalidArgument if a view's dtype or shape is not the layout's.
absl::StatusOr<Tensor> DequantizeToDense(const EngineLinear& linear, const EngineLayout& layout,
                                         const TensorView& weight, const TensorView& scale, const TensorView& zeros,
                                         ParamForm form, const DenseOptions& options = {});
// By linear name (EngineLinear::name), from engine memory (engine form; device buffers are copied
// to the host first) or staging (loaded form).
absl::StatusOr<Tensor> DequantizeToDense(const EngineLayout& layout, absl::string_view linear_name,
                                         const EngineWeights& engine, const DenseOptions& options = {});
absl::StatusOr<Tensor> DequantizeToDense(absl::string_view linear_name, const Staging& staging,
                                         const DenseOptions& options = {});

}  // namespace wsync::engine_model
