// The parameter set one SGLang engine rank holds for an HF checkpoint, and where every sent HF
// tensor goes in it. Spec: docs/spec/ENGINE_LAYOUT.md (cited as §n), FORMATS.md §1-7.
//
// EngineLayout::Create(config, quantization, {T, r, EP}) lists, for engine TP rank r of T with MoE
// expert parallelism EP (moe_tp_rank = r % (T/EP), ep_rank = r / (T/EP), §1):
//   * every engine parameter: its SGLang name ("model.layers.0.self_attn.qkv_proj.weight",
//     "...qkv_proj.weight_packed" / "weight_scale", "model.layers.1.mlp.experts.w13_weight_packed"),
//     dtype, role, and shape in two forms:
//       kLoaded  what SGLang's weight loaders fill (bf16 [N_p, K_p]; INT4 compressed-tensors
//                [N_p, K_p/8] + [N_p, K_p/G]; MoE GPTQ orientation [E_loc, K/8, N] + [E_loc, K/G, N];
//                AWQ qweight [(E_loc,) K_p, N_p/8] + qzeros [(E_loc,) K_p/G, N_p/8] + scales
//                [(E_loc,) K_p/G, N_p], the checkpoint's own layout, AWQ.md §2 / §4)
//       kEngine  what the engine serves from after process_weights_after_loading (Marlin
//                [K_p/16, 2N_p] + permuted [K_p/G, N_p]; MoE [E_loc, K/16, 2N] + [E_loc, K/G, N];
//                AWQ-Marlin adds Marlin zero points [(E_loc,) K_p/G, N_p/8], AWQ.md §3;
//                TensorRT-LLM (engine_layout trtllm-*): int8 [(E_loc,) K, N/2] preprocessed bytes
//                + scales [(E_loc,) K/G, N], loaded as GPTQ-orientation codes [(E_loc,) K/8, N]
//                + [(E_loc,) K/G, N]; MoE FC1 "w3_w1" holds up_proj before gate_proj);
//                identical to kLoaded for every unquantized parameter;
//   * every logical GEMM weight (EngineLinear): the bf16 weight or the packed + scale pair;
//   * every sent HF tensor (HfSource): its expected dtype and shape, and the block of it this rank
//     copies into which parameter (or that it is accepted and skipped: other ranks' experts, a tied
//     lm_head.weight), the §2/§3 slicing included (column / row / qkv with KV replication /
//     gate_up / vocab with zero padding / MoE w13, w2 in the transposed GPTQ orientation of §3.3;
//     AWQ tensors are K-major, so a rank's rows of W are word columns of qweight / qzeros and
//     columns of scales, copied without a transpose, dense and MoE alike).
// Quantization is decided per engine layer from QuantizationConfig::IsIgnored on the HF shard
// names; all shards of a fused layer must agree (§3.1). Decisions the spec leaves open are in
// src/engine_model/README.md (shared-experts fusion is always off, Marlin is always used for
// INT4, MTP layers are skipped unless the engine serves a NextN draft (mtp_draft), no weight_shape
// / g_idx placeholders are engine params).
//
// Errors: Create() returns kInvalidArgument naming the config values for every refusal of §6 (TP
// divisibility, INT4 refusals, Marlin repack constraints) and kUnimplemented for quantization
// settings wsync cannot serve; §4 advisory checks only add to warnings() (and are logged).
// Thread-safety: immutable after Create(); every method is const and safe from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "common/dtype.h"
#include "common/tensor.h"

namespace wsync::engine_model {

struct EngineParallel {
  int tp_size = 1;  // T: the engine's tensor-parallel size
  int tp_rank = 0;  // r in [0, T)
  int ep_size = 1;  // EP: MoE expert parallelism inside the TP group; divides T
  // The engine also serves the checkpoint's MTP layer as SGLang's NextN draft model (speculative
  // decoding): its params are the checkpoint's model.layers.{L}.* (README.md decision 20).
  bool mtp_draft = false;
};

// Whether an engine param named `name` shows that its engine serves the NextN draft: the MTP
// layer's model.layers.{L}.eh_proj.weight, a name no target model has. The rollout agent and
// wsyncctl verify read EngineParallel::mtp_draft off a registered engine's params with it.
bool IsMtpDraftParam(absl::string_view name);

// How a parameter is sharded over the engine ranks (§2).
// One engine rank's place (ENGINE_LAYOUT.md §1): the rollout loader's geometry (tp_size, tp_rank,
// ep_size; moe_tp = tp_size / ep_size, ep_rank = tp_rank / moe_tp, moe_tp_rank = tp_rank % moe_tp)
// plus the one thing only the engine knows, whether DeepSeek-V3's shared experts are fused.
// An EngineRank is an EngineParallel, so it passes straight to EngineLayout::Create.
struct EngineRank : EngineParallel {
  // DeepSeek-V3 shared-experts fusion (ENGINE_LAYOUT.md §2.7): the shared expert is routed
  // expert n_routed (E_total = n_routed + 1, always selected with weight 1) and there is no
  // mlp.shared_experts module. Requires n_shared_experts == 1. The rollout loader never fuses
  // (README.md decision 1), so wsync-ref-engine always serves with it off.
  bool fused_shared_experts = false;
};

enum class ParamRole {
  kReplicated,  // norms, ReplicatedLinear (router gate, kv_a_proj_with_mqa without q_lora), MoEGate bias
  kColumn,      // ColumnParallelLinear: q_b_proj, q_proj (MLA), kv_b_proj
  kRow,         // RowParallelLinear: o_proj, down_proj (and its unsharded bias)
  kQkv,         // QKVParallelLinear: qkv_proj weight and bias
  kGateUp,      // MergedColumnParallelLinear: gate_up_proj (dense and shared experts)
  kVocab,       // VocabParallelEmbedding / ParallelLMHead
  kExpertsW13,  // FusedMoE w13 (gate in the first half, up in the second)
  kExpertsW2,   // FusedMoE w2 (down_proj)
  kFusedQkvA,   // MLA fused_qkv_a_proj_with_mqa = cat(q_a_proj, kv_a_proj_with_mqa), replicated
};
absl::string_view ParamRoleName(ParamRole role);  // "replicated", "column", ..., "fused_qkv_a"

enum class ParamKind {
  kPlain,   // bf16 / fp32 tensor, the same in both forms
  kPacked,  // INT4 weight: compressed-tensors / GPTQ (or AWQ) int32 when loaded, Marlin int32 in the engine
  kScale,   // INT4 group scales: model dtype; Marlin-permuted in the engine
  kZeros,   // AWQ zero points: AWQ-packed int32 when loaded, Marlin zero-point layout in the engine
};
absl::string_view ParamKindName(ParamKind kind);  // "plain", "packed", "scale", "zeros"

// The quantized format an engine serves (config.quantization's quant_method); despite the name,
// the FP8 forms too.
enum class Int4Format {
  kNone,               // a bf16 engine
  kCompressedTensors,  // compressed-tensors INT4 -> Marlin (SGLang's gptq_marlin path, FORMATS.md)
  kAwq,                // AWQ -> AWQ-Marlin with zero points (vLLM / SGLang awq_marlin, AWQ.md §2-4)
  kTrtllm,             // compressed-tensors INT4 -> TensorRT-LLM's preprocessed W4A16 layout (TRTLLM_INT4.md)
  kFp8Block,           // block FP8 (quant_method fp8): weight F8_E4M3 + weight_scale_inv F32 (FP8.md §4)
  kFp8Channel,         // compressed-tensors FP8 per channel: weight F8_E4M3 + weight_scale F32 [N, 1]
};

enum class ParamForm { kLoaded, kEngine };

// Marlin geometry of a kPacked / kScale parameter (per expert for stacked experts).
// (For TensorRT-LLM params the same fields describe the GEMM; `trtllm` says which layout.)
struct MarlinSpec {
  bool awq = false;                 // AWQ-Marlin (zero points; AWQ loaded form) rather than GPTQ-Marlin
  bool trtllm = false;              // TensorRT-LLM W4A16 (TRTLLM_INT4.md §1-§3) rather than Marlin
  bool trtllm_sm90 = false;         // its GPU family: sm90 (dense weights skip the column interleave)
  bool up_first = false;            // TensorRT-LLM w3_w1: up_proj in columns [0, I'), gate_proj after (§4)
  int64_t experts = 0;              // 0: a dense 2-D GEMM weight; else E_loc (3-D, stacked)
  int64_t size_k = 0;               // GEMM K: K_p (dense), H (w13), I' (w2)
  int64_t size_n = 0;               // GEMM N: N_p (dense), 2I' (w13), H (w2)
  int group_size = -1;              // G; -1 channelwise
  int64_t scale_rows = 0;           // K/G (1 channelwise)
  int64_t scale_perm_size_k = 0;    // the size_k the engine passes to the scale permutation (w13: 4I', §4; AWQ: I')
  bool grouped_scale_perm = false;  // 64-column scale_perm iff G != -1 && G < scale_perm_size_k (§4, FORMATS §5)
};

struct EngineParam {
  std::string name;  // SGLang parameter name
  ParamRole role = ParamRole::kReplicated;
  ParamKind kind = ParamKind::kPlain;
  DType dtype = DType::kBF16;  // the loaded form's, and the engine form's unless engine_dtype is set
  // TensorRT-LLM weights: int8 bytes in the engine, int32 GPTQ-orientation codes when loaded.
  std::optional<DType> engine_dtype;
  Shape loaded_shape;
  Shape engine_shape;
  int64_t layer = -1;  // decoder layer, -1 for embeddings / final norm / lm_head
  int linear = -1;     // index into EngineLayout::linears() for GEMM weights, else -1
  MarlinSpec marlin;   // kPacked / kScale only

  const Shape& shape(ParamForm form) const { return form == ParamForm::kLoaded ? loaded_shape : engine_shape; }
  DType dtype_in(ParamForm form) const { return form == ParamForm::kEngine && engine_dtype ? *engine_dtype : dtype; }
};

// One logical GEMM weight of this rank: a linear layer or a stacked-expert tensor.
struct EngineLinear {
  // Name of the unquantized weight parameter; an INT4 linear's params are name + "_packed" and
  // name + "_scale" ("...qkv_proj.weight" -> "...qkv_proj.weight_packed"; "...experts.w13_weight"),
  // for AWQ the engines' qweight / qzeros / scales ("...qkv_proj.qweight", "...experts.w13_qzeros").
  std::string name;
  ParamRole role = ParamRole::kReplicated;
  int64_t layer = -1;
  int64_t experts = 0;  // 0: dense [n, k]; else E_loc stacked [experts, n, k]
  int64_t n = 0;        // rows of the dense weight on this rank (HF orientation, per expert)
  int64_t k = 0;        // columns (input features) on this rank
  bool quantized = false;
  bool fp8 = false;     // FP8: `weight` is the F8_E4M3 param and `scale` its scales (both kPlain)
  int group_size = -1;  // INT4 only
  int weight = -1;      // param index of the bf16 weight (unquantized) or the FP8 weight, else -1
  int packed = -1;      // param indices of the INT4 pair (quantized), else -1
  int scale = -1;       // INT4 scales, or the FP8 scales
  int zeros = -1;       // AWQ: param index of the zero points, else -1
};

// One sent HF tensor and what this rank does with it.
struct HfSource {
  enum class Action {
    kCopy,        // copy a block of it into param `param` of the staging set
    kCheckShape,  // an INT4 `weight_shape`: its values must equal `shape_values`; nothing is stored
    kSkip,        // known, checked (dtype, shape), and not held by this rank
  };
  std::string hf_name;
  DType dtype = DType::kBF16;  // expected dtype (weight_shape: I64; I32 is accepted too)
  Shape shape;                 // expected shape of the whole sent tensor
  Action action = Action::kCopy;
  int param = -1;
  // kCopy: the block [src_row0, +rows) x [src_col0, +cols) of the sent tensor viewed as 2-D (a 1-D
  // [n] tensor as [n, 1]) goes to local expert `expert` (0 for 2-D params) of the param, at
  // (dst_row0, dst_col0) of its per-expert 2-D matrix, transposed when `transpose` (MoE INT4).
  int64_t expert = 0;
  bool transpose = false;
  int64_t src_row0 = 0, rows = 0, src_col0 = 0, cols = 0;
  int64_t dst_row0 = 0, dst_col0 = 0;
  std::array<int64_t, 2> shape_values = {0, 0};  // kCheckShape
  std::string what;  // the piece, for coverage errors: "q_proj", "expert 5 up_proj", "gate_proj"
};

// The block of a sent tensor's matrix view (MatrixOf, common/tensor.h) this rank keeps: a kCopy
// source's rows and columns, all of a kCheckShape tensor (a weight_shape), nothing for kSkip
// (rows = cols = 0). What sharded delivery sends a rank, and the only block its loader takes
// (plan/delivery_plan.h, Loader::LoadBlock).
struct KeptBlock {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  bool empty() const { return rows == 0 || cols == 0; }
};
KeptBlock KeptBlockOf(const HfSource& s);

class EngineLayout {
 public:
  // See the file comment. `quantization` null means a bf16 engine (any quantization_config inside
  // `config` is not consulted).
  static absl::StatusOr<EngineLayout> Create(const ModelConfig& config, const QuantizationConfig* quantization,
                                             EngineParallel parallel);

  const ModelConfig& config() const { return config_; }
  const EngineParallel& parallel() const { return parallel_; }
  bool quantized() const { return quantized_; }
  Int4Format int4_format() const { return format_; }
  // The quantization config the layout was made for; nullptr for a bf16 engine.
  const QuantizationConfig* quantization() const { return quantization_ ? &*quantization_ : nullptr; }
  int group_size() const { return group_size_; }  // INT4 only
  int moe_tp_size() const { return moe_tp_size_; }
  int moe_tp_rank() const { return moe_tp_rank_; }
  int ep_rank() const { return ep_rank_; }
  int64_t local_experts() const { return local_experts_; }      // E_loc (0 without MoE)
  int64_t first_local_expert() const { return first_expert_; }  // ep_rank * E_loc
  int64_t padded_vocab() const { return padded_vocab_; }        // pad(V, 64)
  int64_t vocab_per_rank() const { return padded_vocab_ / parallel_.tp_size; }
  bool shared_experts_fused() const { return false; }  // always off (README.md)

  const std::vector<EngineParam>& params() const { return params_; }
  const std::vector<EngineLinear>& linears() const { return linears_; }
  const std::vector<HfSource>& sources() const { return sources_; }
  // Index of a param / linear (by EngineLinear::name) / sent tensor, or -1.
  int FindParam(absl::string_view name) const;
  int FindLinear(absl::string_view name) const;
  int FindSource(absl::string_view hf_name) const;
  // Whether `hf_name` belongs to a part of the checkpoint the engine does not load and that is
  // accepted unchecked (MTP layers model.layers.{L..L+nextn-1}.* the engine holds no draft of, and
  // a draft layer's tensors it does not hold: embed_tokens, shared_head.head; README.md).
  bool IsIgnoredHfName(absl::string_view hf_name) const;

  // Advisory checks that failed (§4, §6 "warned"); each is also logged once by Create().
  const std::vector<std::string>& warnings() const { return warnings_; }
  // Total bytes of all params in a form.
  int64_t TotalBytes(ParamForm form) const;

 private:
  friend class LayoutBuilder;
  EngineLayout() = default;

  ModelConfig config_;
  EngineParallel parallel_;
  bool quantized_ = false;
  Int4Format format_ = Int4Format::kNone;
  std::optional<QuantizationConfig> quantization_;
  int group_size_ = -1;
  int moe_tp_size_ = 1, moe_tp_rank_ = 0, ep_rank_ = 0;
  int64_t local_experts_ = 0, first_expert_ = 0, padded_vocab_ = 0;
  std::vector<EngineParam> params_;
  std::vector<EngineLinear> linears_;
  std::vector<HfSource> sources_;
  absl::flat_hash_map<std::string, int> param_index_, linear_index_, source_index_;
  std::vector<std::string> warnings_;
};

}  // namespace wsync::engine_model
