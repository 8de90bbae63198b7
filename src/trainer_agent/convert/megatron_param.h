// The parameters a megatron-core GPTModel rank holds (TE spec, grouped-GEMM experts), how each
// one is sharded over its TP / expert-TP group, and which HuggingFace tensors it becomes.
// Spec: docs/spec/MEGATRON_TO_HF.md §1 (names), §2 (TP layouts), §3 (EP), §4 (PP), §5 (HF
// names); RANKS.md (which rank holds what). The architecture tables live in megatron_param.cc:
// one row per Megatron parameter (name, shard kind, full shape, HF op and names, condition);
// an architecture is the choice of attention block (GQA or MLA) plus the rows' conditions.
//
// Order of a rank's plan (what megatron-core's named_parameters() yields on that rank, with the
// fp32 router.expert_bias buffer placed right after router.weight):
//   first stage:  embedding.word_embeddings.weight
//   every layer:  [MLA: input_layernorm.weight]
//                 self_attention.linear_proj.{weight, bias}    (Attention.__init__ builds it first)
//                 GQA: linear_qkv.{layer_norm_weight, weight, bias}, q_layernorm, k_layernorm
//                 MLA: linear_q_down_proj, linear_q_up_proj.{layer_norm_weight, weight} | linear_q_proj,
//                      linear_kv_down_proj, linear_kv_up_proj.{layer_norm_weight, weight}
//                 dense MLP: mlp.linear_fc1.{layer_norm_weight, weight, bias}, mlp.linear_fc2.{weight, bias}
//                 (the biases: --add-bias-linear, Llama's attention_bias + mlp_bias)
//                 MoE: pre_mlp_layernorm.weight, mlp.router.{weight, expert_bias},
//                      mlp.experts.linear_fc1.weight{0..n-1}, mlp.experts.linear_fc2.weight{0..n-1},
//                      mlp.shared_experts.linear_fc1.weight, mlp.shared_experts.linear_fc2.weight
//   last stage:   decoder.final_layernorm.weight,
//                 per MTP layer k (parallel.json mtp_num_layers): mtp.layers.{k}.{enorm, hnorm,
//                 eh_proj}.weight, mtp.layers.{k}.transformer_layer. + a layer's names as above (the
//                 last decoder layer's kind), mtp.layers.{k}.final_layernorm.weight,
//                 output_layer.weight
//                 (with MTP and PP > 1 the last stage also holds embedding.word_embeddings.weight,
//                 first: GPTModel's copy for the MTP layers, never sent)
// Names carry no wrapper prefix; layer indices are local to the model chunk and expert indices
// local to the EP rank (local_name), or global (global_name). With virtual pipeline stages
// (vpp > 1) a rank holds its chunks in order, each as above (the embedding in chunk 0 of the
// first stage, the last-stage params in the last chunk of the last stage), local names prefixed
// "model{vp}." (MEGATRON_TO_HF.md §4.1).
//
// Errors: kInvalidArgument / kUnimplemented naming the model field or the parameter and values.
// Thread-safety: pure functions over values.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "common/tensor.h"
#include "trainer_agent/convert/source_parallel.h"
#include "trainer_agent/layout/parallel_layout.h"

namespace wsync::trainer_agent {

// How a parameter is split over its group (MEGATRON_TO_HF §2). The group is the TP group for
// kTp* and kVocab, the expert-TP group for kExpert*, none for kReplicated.
enum class ShardKind : uint8_t {
  kReplicated,    // every rank holds the whole tensor: norms, router, MLA down projections, expert_bias
  kTpDim0,        // column-parallel: rank r holds rows [r*n/T, (r+1)*n/T) (qkv by query group, MLA up)
  kTpDim1,        // row-parallel: rank r holds columns [r*k/T, (r+1)*k/T) (linear_proj, fc2)
  kTpGluFc1,      // gated fc1 [gate; up]: rank r holds [gate rows of r; up rows of r] (stride 2)
  kVocab,         // vocab-parallel embedding / output layer: row blocks of the padded vocabulary
  kExpertDim1,    // expert fc2 over expert-TP: column blocks
  kExpertGluFc1,  // expert fc1 over expert-TP: as kTpGluFc1
};
absl::string_view ShardKindName(ShardKind kind);

// How the full (gathered) Megatron tensor becomes HF tensors (MEGATRON_TO_HF §2.3-2.5, §5).
enum class HfOp : uint8_t {
  kCopy,   // one HF tensor, the same bytes
  kVocab,  // one HF tensor: the first vocab_size rows (padding dropped)
  kGlu,    // gate_proj = rows [0, f), up_proj = rows [f, 2f)
  kQkv,    // q/k/v split by query group: view(ng, n_rep+2, hd, ...) split [n_rep, 1, 1]
};

struct MegatronParam {
  std::string local_name;   // as on the rank: local layer and local expert indices
  std::string global_name;  // global layer and global expert indices
  DType dtype = DType::kBF16;
  Shape local_shape;  // on one rank of the group
  Shape full_shape;   // after the TP / expert-TP gather (vocab: padded)
  ShardKind kind = ShardKind::kReplicated;
  int gather_dim = -1;     // 0 or 1; -1 when replicated
  int group_size = 1;      // TP or ETP size for sharded kinds, 1 for kReplicated
  int rank_in_group = 0;   // this rank's position in that group
  bool is_expert = false;  // a routed expert's tensor (EP-distributed)
  int64_t global_expert = -1;
  int64_t local_expert = -1;
  int64_t global_layer = -1;  // -1 outside decoder layers
  int64_t local_layer = -1;
  HfOp hf_op = HfOp::kCopy;
  std::vector<std::string> hf_names;  // HF tensors it becomes, in op order (q,k,v / gate,up)
  // False only for the tied output_layer copy on the last stage of a PP>1 run: it is held and
  // validated but never sent (the engine ties lm_head to embed_tokens; ENGINE_LAYOUT §2.6).
  // Its hf_names name the HF tensor it is built from (model.embed_tokens.weight).
  bool sent = true;
  // Expert pruning (convert/expert_prune.h). pruned: a routed expert the engines do not keep; it
  // still takes part in its gathers (EP members' blocks are uniform) but is never converted,
  // quantized or sent. kept_rows: the router (weight rows, expert_bias entries) keeps these full
  // rows, in this order, as its one HF tensor (hf_op kCopy); empty: every row.
  bool pruned = false;
  std::vector<int64_t> kept_rows;
};

// Refuses models wsync cannot convert, naming the field (MTP layers are synced only when
// parallel.json says the run trains them: mtp_num_layers). kUnimplemented: an o_proj bias without MLP biases (Qwen3
// with attention_bias, Llama with attention_bias but not mlp_bias) or MLP biases without it: megatron-core's
// --add-bias-linear gives linear_qkv, linear_proj, linear_fc1 and linear_fc2 a bias together (Llama with both is
// converted); a tied Qwen3-MoE or GLM-4.5 (SGLang never fills its lm_head).
absl::Status CheckModelSupported(const ModelConfig& model);

// Checks that the model's sizes split over the layout: heads and query groups by TP, FFN widths
// by TP, expert FFN by ETP, experts by EP, padded vocab by TP. kInvalidArgument naming both.
absl::Status CheckModelFitsLayout(const ModelConfig& model, const SourceParallel& parallel);

// The exact list of parameters `global_rank` holds, in the order documented above, with local
// shapes and this rank's position in each group. `parallel` must be resolved
// (ResolveSourceParallel) and agree with `layout` (kInvalidArgument otherwise).
absl::StatusOr<std::vector<MegatronParam>> PlanRank(const ModelConfig& model, const ParallelLayout& layout,
                                                    const SourceParallel& parallel, int global_rank);

// Every parameter of the whole model, unsharded (TP = PP = EP = 1): global names, full shapes;
// with its first `mtp_num_layers` MTP layers.
absl::StatusOr<std::vector<MegatronParam>> PlanFullModel(const ModelConfig& model, int64_t mtp_num_layers = 0);

// Matches a rank's tensors (name -> view, any order) against its plan and returns the views in
// plan order. Every problem is kInvalidArgument naming `source` and the parameter: missing
// parameters, unknown names, wrong dtype or shape (expected and found). Lists up to 8 names.
absl::StatusOr<std::vector<TensorView>> BindToPlan(const std::vector<MegatronParam>& plan,
                                                   const std::vector<std::pair<std::string, TensorView>>& tensors,
                                                   absl::string_view source);

}  // namespace wsync::trainer_agent
