// HfReferenceModel: the oracle for EngineModel. The same transformer (Llama, Qwen2, Qwen3,
// Qwen3-MoE, DeepSeek-V3) computed directly from the original, unsharded HF tensors
// ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.3.gate_proj.weight", ...),
// in float32, following the HF modeling code: separate q/k/v projections, rotate_half RoPE (for
// DeepSeek: HF's de-interleave-then-rotate_half), naive MLA that materializes k_nope and v from
// kv_b_proj, per-expert MLPs, full recomputation for every generated token. It shares only the
// tiny math of ops.h with EngineModel and is written independently of it; it is a test oracle,
// not fast.
//
// HF tensors must be float (bf16, f16 or f32); an INT4 checkpoint is compared by dequantizing it
// first (the caller passes the bf16 weights). MoE routing follows HF and SGLang alike: Qwen3-MoE
// softmax top-k (renormalized when norm_topk_prob); DeepSeek sigmoid (or softmax) scores,
// noaux_tc (+ e_score_correction_bias, group score = sum of the top-2 per group, topk_group groups
// kept), group_limited_greedy (group score = max) or greedy, then norm_topk_prob and
// routed_scaling_factor; experts outside the kept groups are excluded. RoPE scaling (yarn) is not
// modelled (config.h carries no rope_scaling).
//
// Ownership: Create reads every tensor through the lookup and copies it into float32; the
// lookup is not kept. Thread-safety: immutable after Create; Logits / Generate are const and safe
// to call concurrently.
// Errors: Create: kNotFound naming a missing HF tensor, kInvalidArgument naming a tensor with a
// wrong shape or a non-float dtype, or an unsupported config. Logits / Generate: kInvalidArgument
// for an empty prompt, a token outside [0, V) or a negative max_new_tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/config.h"
#include "ref_engine/model.h"

namespace wsync::ref_engine {

class HfReferenceModel {
 public:
  static absl::StatusOr<HfReferenceModel> Create(const ModelConfig& config, const ParamLookup& hf_lookup);

  HfReferenceModel(HfReferenceModel&&) noexcept;
  HfReferenceModel& operator=(HfReferenceModel&&) noexcept;
  ~HfReferenceModel();

  // Logits of every position: row-major [tokens.size(), vocab_size].
  absl::StatusOr<std::vector<float>> Logits(absl::Span<const int32_t> tokens) const;
  // Greedy decoding by full recomputation; argmax ties go to the lowest token id.
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int max_new_tokens) const;

 private:
  struct Impl;
  explicit HfReferenceModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::ref_engine
