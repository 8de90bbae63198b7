// EngineModel: the numerical core of the reference rollout engine (wsync-ref-engine). A CPU
// transformer forward pass over the parameters ONE SGLang engine rank holds, in SGLang's layout
// (docs/spec/ENGINE_LAYOUT.md §1-§5): vocab-parallel embed_tokens / lm_head padded to pad(V,64)/T
// rows, fused qkv_proj [q|k|v] with KV-head replication when T > nkv, row-parallel o_proj /
// down_proj, fused gate_up_proj [gate; up], Qwen3 q_norm/k_norm, Qwen2 qkv bias, MoE (replicated
// router, experts.w13 [E_loc, 2I', H] / w2 [E_loc, H, I'] with engine EP), DeepSeek-V3 MLA
// (fused_qkv_a_proj_with_mqa, q_b_proj, kv_b_proj; absorbed-latent attention) with sigmoid/noaux_tc
// group-limited routing and shared experts. Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3.
// Activations and accumulation are fp32. README.md records the decisions.
//
// Weights: weights.h resolves the rank's parameters by engine name (ParamLookup), checks them and
// holds the version the forward pass reads (bf16 / f32 rows and Marlin INT4 tiles in place, or
// float32 copies: WeightMode). EngineModel::Prepare() is RankWeights::Prepare().
//
// Tensor parallelism: the T ranks of one engine each own an EngineModel and must call Logits /
// Generate in lockstep with the same arguments; TpCollectives carries the all-reduce (after
// o_proj, after the MLP / MoE, after the vocab-parallel embedding) and the all-gather (lm_head
// logits). Both must return bit-identical results on every rank (sum in rank order), so that all
// ranks pick the same greedy tokens. With T = 1 empty collectives mean identity.
//
// Ownership: the model copies the config; ParamLookup and TpCollectives are stored and must stay
// callable for the model's life. The memory behind the lookup's views must live as weights.h
// says (kInPlace: until the next successful Prepare(); the engine's pause protocol: core.h).
// Thread-safety: Prepare() must not run concurrently with anything else on the same model (the
// caller serializes: a request never spans two versions). Logits / Generate / Weight are const
// and may run concurrently with each other only if the collectives allow it (they are issued in
// program order per call).
// Errors: Create: kInvalidArgument for an unsupported rank geometry (ENGINE_LAYOUT.md §6 naming
// the sizes; also EP > 1 on a dense model, tied Qwen3-MoE / DeepSeek-V3, T > 1 without
// collectives), kUnimplemented for routing it does not model (scoring_func / topk_method, fused
// shared experts without norm_topk_prob). Prepare: those of RankWeights::Prepare (weights.h); on
// error the model keeps the previous version's references and copies (what that means for memory
// read in place: weights.h). Logits / Generate: kFailedPrecondition before the first successful
// Prepare(), kInvalidArgument for an empty prompt, a token outside [0, V) or a sequence longer
// than max_position_embeddings; collective errors are passed through.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/config.h"
#include "engine_model/engine_layout.h"
#include "engine_side/tp_collectives.h"
#include "ref_engine/weights.h"

namespace wsync::ref_engine {

using engine_model::EngineRank;
using engine_side::TpCollectives;

struct EngineModelOptions {
  WeightMode weights = WeightMode::kInPlace;
  int prepare_threads = 0;  // kInPlace Prepare's checks and copies; 0 = hardware_concurrency
};

class EngineModel {
 public:
  // Validates the geometry (ENGINE_LAYOUT.md §6) and stores its arguments; reads no weights.
  static absl::StatusOr<EngineModel> Create(const ModelConfig& config, EngineRank rank, ParamLookup lookup,
                                            TpCollectives collectives, EngineModelOptions options = {});

  EngineModel(EngineModel&&) noexcept;
  EngineModel& operator=(EngineModel&&) noexcept;
  ~EngineModel();

  // RankWeights::Prepare (weights.h): reads every parameter of this rank through the lookup and
  // checks names, dtypes, shapes and finiteness, then serves the new version; on error the
  // previous version's references and copies stay. Does not call the collectives.
  absl::Status Prepare();
  bool prepared() const;
  const PrepareStats& last_prepare() const;

  // Logits of every position of `tokens` (one forward pass over the whole sequence from position
  // 0): row-major [tokens.size(), vocab_size] (the pad(V,64) padding is dropped).
  absl::StatusOr<std::vector<float>> Logits(absl::Span<const int32_t> tokens) const;

  // Called before every forward pass of Generate with the number of tokens generated so far (0
  // before the prompt pass); a non-OK status stops generation and is returned. With T > 1 every
  // rank must take the same decision at the same step (the engine server makes it a collective).
  using StepHook = std::function<absl::Status(int step)>;

  // Greedy decoding with a KV cache: the prompt in one pass, then one token per step; returns the
  // max_new_tokens (>= 0) new tokens. Argmax ties go to the lowest token id.
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int max_new_tokens,
                                                const StepHook& before_step = nullptr) const;

  // The prepared weight behind engine parameter `name`, named and shaped as its bf16 engine
  // parameter (e.g. "model.layers.0.self_attn.qkv_proj.weight" [N_p, K_p],
  // "model.layers.1.mlp.experts.w13_weight" [E_loc, 2I', H]) whether it was stored bf16 or INT4,
  // as a float32 copy (INT4 dequantized). kFailedPrecondition before Prepare(); kNotFound for a
  // name this rank does not hold.
  absl::StatusOr<PreparedWeight> Weight(absl::string_view name) const;

  const ModelConfig& config() const;
  const EngineRank& rank() const;

 private:
  struct Impl;
  explicit EngineModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::ref_engine
