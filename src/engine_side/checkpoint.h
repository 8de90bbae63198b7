// Start-up of an engine rank from an HF checkpoint directory: every tensor of every
// *.safetensors file goes through the rollout agent's own path (engine_model Loader into a Staging, then
// repack Commit into the engine memory), so the engine serves exactly what a weight sync of the
// same checkpoint would have installed.
//
// Quantized linears (EngineLayout::quantized()) accept either form, per weight:
//   * the sent form: X.weight_packed [N, K/8] + X.weight_scale [N, K/G] + X.weight_shape
//     (compressed-tensors pack-quantized, what the rollout agent receives), loaded as is;
//   * a bf16 X.weight: quantized here with kernels::QuantizeInt4 (compressed-tensors, the layout's
//     group size, options.variant), then loaded as that triplet. This is what a trainer-side
//     quantizer would have sent for the same bf16 weight.
// The reverse (an INT4 triplet where the engine serves bf16) is refused: the engine never
// dequantizes a checkpoint. Also skipped: DeepSeek MTP layers (EngineLayout::IsIgnoredHfName) and
// "*.rotary_emb.inv_freq" buffers some old checkpoints carry.
//
// Errors: kNotFound for a directory without *.safetensors; kInvalidArgument naming a tensor the
// layout does not know (at most 8 named, with the count), or one with a wrong dtype / shape; the
// loader's kNotFound listing missing pieces; safetensors / kernel / repack errors as they come.
// Nothing is served from a failed load (the caller exits).
// Thread-safety: a plain function; `weights` must not be read or written concurrently.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "engine_model/engine_layout.h"
#include "engine_model/engine_weights.h"
#include "kernels/int4.h"

namespace wsync::engine_side {

struct CheckpointOptions {
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;  // for bf16 weights quantized at load
  int num_threads = 0;                                          // kernels / repack; 0 = all cores
};

struct CheckpointStats {
  int files = 0;
  int64_t tensors = 0;    // loaded as they were
  int64_t quantized = 0;  // bf16 weights quantized at load
  int64_t skipped = 0;    // MTP layers, inv_freq
  int64_t bytes = 0;      // of all checkpoint tensors read
};

// Loads checkpoint directory `dir` into `weights` (which must match `layout` in its engine form).
absl::StatusOr<CheckpointStats> LoadCheckpoint(const std::string& dir, const engine_model::EngineLayout& layout,
                                               engine_model::EngineWeights& weights,
                                               const CheckpointOptions& options = {});

}  // namespace wsync::engine_side
