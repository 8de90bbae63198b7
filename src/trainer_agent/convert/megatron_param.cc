#include "trainer_agent/convert/megatron_param.h"

#include <algorithm>
#include <array>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"

namespace wsync::trainer_agent {
namespace {

// The sizes every shape formula needs, read once from the config.
struct Dims {
  int64_t h = 0;           // hidden
  int64_t nh = 0;          // attention heads
  int64_t ng = 0;          // query groups (KV heads)
  int64_t hd = 0;          // head dim (kv_channels)
  int64_t ffn = 0;         // dense MLP width
  int64_t moe_ffn = 0;     // routed expert width
  int64_t shared_ffn = 0;  // shared expert width (DeepSeek: moe_ffn * n_shared_experts)
  int64_t experts = 0;
  int64_t vocab_padded = 0;
  int64_t q_lora = 0, kv_lora = 0, nope = 0, rope = 0, vdim = 0;  // MLA
};

Dims DimsOf(const ModelConfig& m, int64_t vocab_padded) {
  Dims d;
  d.h = m.hidden_size;
  d.nh = m.num_attention_heads;
  d.ng = m.num_key_value_heads;
  d.hd = m.head_dim;
  d.ffn = m.intermediate_size;
  d.vocab_padded = vocab_padded;
  if (m.moe) {
    d.moe_ffn = m.moe->moe_intermediate_size;
    d.shared_ffn = m.moe->moe_intermediate_size * m.moe->num_shared_experts;
    d.experts = m.moe->num_experts;
  }
  if (m.mla) {
    d.q_lora = m.mla->q_lora_rank;
    d.kv_lora = m.mla->kv_lora_rank;
    d.nope = m.mla->qk_nope_head_dim;
    d.rope = m.mla->qk_rope_head_dim;
    d.vdim = m.mla->v_head_dim;
  }
  return d;
}

// kMtp: an MTP layer's own parameters before its transformer layer, kMtpNorm after it (§5.7).
enum class Block : uint8_t { kFirstStage, kGqa, kMla, kDenseMlp, kMoeMlp, kLastStage, kMtp, kMtpNorm, kOutput };

// When a row exists (besides its block being used).
enum class When : uint8_t {
  kAlways,
  kQkvBias,        // Qwen2 (--add-qkv-bias)
  kQkNorm,         // Qwen3, Qwen3-MoE (--qk-layernorm)
  kQLora,          // MLA with q_lora_rank
  kNoQLora,        // MLA without
  kExpertBias,     // DeepSeek-V3 noaux_tc (--moe-router-enable-expert-bias)
  kLinearBias,     // --add-bias-linear: linear_proj and the dense MLP's fc1 / fc2 biases
  kSharedExperts,  // n_shared_experts > 0
  kOutputLayer,    // untied, or tied on a stage without the embedding (PP > 1)
};

using ShapeFn = Shape (*)(const Dims&);

// One Megatron parameter. Layer rows name parameters relative to "decoder.layers.{i}." and HF
// tensors relative to "model.layers.{i}." (in an MTP layer k: "mtp.layers.{k}.transformer_layer."
// and "model.layers.{L+k}."; kMtp / kMtpNorm rows: "mtp.layers.{k}."); "{e}" in an HF name is the
// global expert id.
struct Row {
  Block block;
  const char* megatron;
  ShardKind kind;
  HfOp op;
  std::array<const char*, 3> hf;
  ShapeFn full_shape;
  When when = When::kAlways;
  bool per_expert = false;  // one parameter per local expert, index appended to the name
  bool fp32 = false;        // kept in fp32 whatever the model dtype (router.expert_bias)
};

// clang-format off
const Row kRows[] = {
  // --- first stage ------------------------------------------------------------------------------
  {Block::kFirstStage, "embedding.word_embeddings.weight", ShardKind::kVocab, HfOp::kVocab,
   {"model.embed_tokens.weight"}, [](const Dims& d) { return Shape{d.vocab_padded, d.h}; }},

  // --- GQA attention (Llama, Qwen2, Qwen3, Qwen3-MoE): TE spec, input norm fused into linear_qkv --
  {Block::kGqa, "self_attention.linear_proj.weight", ShardKind::kTpDim1, HfOp::kCopy,
   {"self_attn.o_proj.weight"}, [](const Dims& d) { return Shape{d.h, d.nh * d.hd}; }},
  {Block::kGqa, "self_attention.linear_proj.bias", ShardKind::kReplicated, HfOp::kCopy,
   {"self_attn.o_proj.bias"}, [](const Dims& d) { return Shape{d.h}; }, When::kLinearBias},
  {Block::kGqa, "self_attention.linear_qkv.layer_norm_weight", ShardKind::kReplicated, HfOp::kCopy,
   {"input_layernorm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  {Block::kGqa, "self_attention.linear_qkv.weight", ShardKind::kTpDim0, HfOp::kQkv,
   {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"},
   [](const Dims& d) { return Shape{(d.nh + 2 * d.ng) * d.hd, d.h}; }},
  {Block::kGqa, "self_attention.linear_qkv.bias", ShardKind::kTpDim0, HfOp::kQkv,
   {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"},
   [](const Dims& d) { return Shape{(d.nh + 2 * d.ng) * d.hd}; }, When::kQkvBias},
  {Block::kGqa, "self_attention.q_layernorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"self_attn.q_norm.weight"}, [](const Dims& d) { return Shape{d.hd}; }, When::kQkNorm},
  {Block::kGqa, "self_attention.k_layernorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"self_attn.k_norm.weight"}, [](const Dims& d) { return Shape{d.hd}; }, When::kQkNorm},

  // --- MLA attention (DeepSeek-V3): separate input norm, q/kv norms fused into the up projections -
  {Block::kMla, "input_layernorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"input_layernorm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  {Block::kMla, "self_attention.linear_proj.weight", ShardKind::kTpDim1, HfOp::kCopy,
   {"self_attn.o_proj.weight"}, [](const Dims& d) { return Shape{d.h, d.nh * d.vdim}; }},
  {Block::kMla, "self_attention.linear_q_down_proj.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"self_attn.q_a_proj.weight"}, [](const Dims& d) { return Shape{d.q_lora, d.h}; }, When::kQLora},
  {Block::kMla, "self_attention.linear_q_up_proj.layer_norm_weight", ShardKind::kReplicated, HfOp::kCopy,
   {"self_attn.q_a_layernorm.weight"}, [](const Dims& d) { return Shape{d.q_lora}; }, When::kQLora},
  {Block::kMla, "self_attention.linear_q_up_proj.weight", ShardKind::kTpDim0, HfOp::kCopy,
   {"self_attn.q_b_proj.weight"}, [](const Dims& d) { return Shape{d.nh * (d.nope + d.rope), d.q_lora}; },
   When::kQLora},
  {Block::kMla, "self_attention.linear_q_proj.weight", ShardKind::kTpDim0, HfOp::kCopy,
   {"self_attn.q_proj.weight"}, [](const Dims& d) { return Shape{d.nh * (d.nope + d.rope), d.h}; },
   When::kNoQLora},
  {Block::kMla, "self_attention.linear_kv_down_proj.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"self_attn.kv_a_proj_with_mqa.weight"}, [](const Dims& d) { return Shape{d.kv_lora + d.rope, d.h}; }},
  {Block::kMla, "self_attention.linear_kv_up_proj.layer_norm_weight", ShardKind::kReplicated, HfOp::kCopy,
   {"self_attn.kv_a_layernorm.weight"}, [](const Dims& d) { return Shape{d.kv_lora}; }},
  {Block::kMla, "self_attention.linear_kv_up_proj.weight", ShardKind::kTpDim0, HfOp::kCopy,
   {"self_attn.kv_b_proj.weight"}, [](const Dims& d) { return Shape{d.nh * (d.nope + d.vdim), d.kv_lora}; }},

  // --- dense MLP: post-attention norm fused into linear_fc1 -------------------------------------
  {Block::kDenseMlp, "mlp.linear_fc1.layer_norm_weight", ShardKind::kReplicated, HfOp::kCopy,
   {"post_attention_layernorm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  {Block::kDenseMlp, "mlp.linear_fc1.weight", ShardKind::kTpGluFc1, HfOp::kGlu,
   {"mlp.gate_proj.weight", "mlp.up_proj.weight"}, [](const Dims& d) { return Shape{2 * d.ffn, d.h}; }},
  {Block::kDenseMlp, "mlp.linear_fc1.bias", ShardKind::kTpGluFc1, HfOp::kGlu,
   {"mlp.gate_proj.bias", "mlp.up_proj.bias"}, [](const Dims& d) { return Shape{2 * d.ffn}; }, When::kLinearBias},
  {Block::kDenseMlp, "mlp.linear_fc2.weight", ShardKind::kTpDim1, HfOp::kCopy,
   {"mlp.down_proj.weight"}, [](const Dims& d) { return Shape{d.h, d.ffn}; }},
  {Block::kDenseMlp, "mlp.linear_fc2.bias", ShardKind::kReplicated, HfOp::kCopy,
   {"mlp.down_proj.bias"}, [](const Dims& d) { return Shape{d.h}; }, When::kLinearBias},

  // --- MoE MLP: real pre-MLP norm, router, grouped-GEMM experts, shared experts ------------------
  {Block::kMoeMlp, "pre_mlp_layernorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"post_attention_layernorm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  {Block::kMoeMlp, "mlp.router.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"mlp.gate.weight"}, [](const Dims& d) { return Shape{d.experts, d.h}; }},
  {Block::kMoeMlp, "mlp.router.expert_bias", ShardKind::kReplicated, HfOp::kCopy,
   {"mlp.gate.e_score_correction_bias"}, [](const Dims& d) { return Shape{d.experts}; }, When::kExpertBias,
   /*per_expert=*/false, /*fp32=*/true},
  {Block::kMoeMlp, "mlp.experts.linear_fc1.weight", ShardKind::kExpertGluFc1, HfOp::kGlu,
   {"mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"},
   [](const Dims& d) { return Shape{2 * d.moe_ffn, d.h}; }, When::kAlways, /*per_expert=*/true},
  {Block::kMoeMlp, "mlp.experts.linear_fc2.weight", ShardKind::kExpertDim1, HfOp::kCopy,
   {"mlp.experts.{e}.down_proj.weight"}, [](const Dims& d) { return Shape{d.h, d.moe_ffn}; }, When::kAlways,
   /*per_expert=*/true},
  {Block::kMoeMlp, "mlp.shared_experts.linear_fc1.weight", ShardKind::kTpGluFc1, HfOp::kGlu,
   {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"},
   [](const Dims& d) { return Shape{2 * d.shared_ffn, d.h}; }, When::kSharedExperts},
  {Block::kMoeMlp, "mlp.shared_experts.linear_fc2.weight", ShardKind::kTpDim1, HfOp::kCopy,
   {"mlp.shared_experts.down_proj.weight"}, [](const Dims& d) { return Shape{d.h, d.shared_ffn}; },
   When::kSharedExperts},

  // --- last stage: the final norm, the MTP layers (§5.7), the output layer -----------------------
  {Block::kLastStage, "decoder.final_layernorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"model.norm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  {Block::kMtp, "enorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"enorm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  {Block::kMtp, "hnorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"hnorm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  // ColumnParallelLinear(2H -> H, no bias): its input columns are [embedding | hidden state] in
  // Megatron and in SGLang's NextN models alike, so the gathered rows are copied as they are
  {Block::kMtp, "eh_proj.weight", ShardKind::kTpDim0, HfOp::kCopy,
   {"eh_proj.weight"}, [](const Dims& d) { return Shape{d.h, 2 * d.h}; }},
  {Block::kMtpNorm, "final_layernorm.weight", ShardKind::kReplicated, HfOp::kCopy,
   {"shared_head.norm.weight"}, [](const Dims& d) { return Shape{d.h}; }},
  {Block::kOutput, "output_layer.weight", ShardKind::kVocab, HfOp::kVocab,
   {"lm_head.weight"}, [](const Dims& d) { return Shape{d.vocab_padded, d.h}; }, When::kOutputLayer},
};
// clang-format on

bool HasExpertBias(const ModelConfig& m) { return m.moe && m.moe->HasExpertBias(); }

struct PlanContext {
  const ModelConfig* model;
  Dims dims;
  int tp = 1, etp = 1, tp_rank = 0, etp_rank = 0;
  int64_t local_experts = 0, expert_offset = 0;
  bool first_stage = true;
};

bool RowApplies(const Row& r, const PlanContext& c) {
  const ModelConfig& m = *c.model;
  switch (r.when) {
    case When::kAlways: return true;
    case When::kQkvBias: return m.qkv_bias;
    case When::kLinearBias: return m.o_proj_bias;  // CheckModelSupported: o_proj_bias == mlp_bias
    case When::kQkNorm: return m.qk_norm;
    case When::kQLora: return m.mla && m.mla->q_lora_rank > 0;
    case When::kNoQLora: return m.mla && m.mla->q_lora_rank == 0;
    case When::kExpertBias: return HasExpertBias(m);
    case When::kSharedExperts: return m.moe && m.moe->num_shared_experts > 0;
    case When::kOutputLayer: return !m.tie_word_embeddings || !c.first_stage;
  }
  return false;
}

// Where a block's rows go: the Megatron name prefixes (local and global layer numbers) and the HF
// one, and the layer numbers (-1 outside layers; an MTP layer k: global L + k, local -1).
struct Place {
  std::string local, global, hf;
  int64_t local_layer = -1, global_layer = -1;
};

Place DecoderLayer(int64_t local_layer, int64_t global_layer) {
  return {absl::StrCat("decoder.layers.", local_layer, "."), absl::StrCat("decoder.layers.", global_layer, "."),
          absl::StrCat("model.layers.", global_layer, "."), local_layer, global_layer};
}

void AppendRow(const Row& r, const PlanContext& c, const Place& at, std::vector<MegatronParam>* out) {
  const ModelConfig& m = *c.model;
  const int64_t n = r.per_expert ? c.local_experts : 1;
  for (int64_t l = 0; l < n; ++l) {
    MegatronParam p;
    p.kind = r.kind;
    p.hf_op = r.op;
    p.dtype = r.fp32 ? DType::kF32 : m.dtype;
    p.full_shape = r.full_shape(c.dims);
    p.local_shape = p.full_shape;
    switch (r.kind) {
      case ShardKind::kReplicated:
        p.group_size = 1;
        p.gather_dim = -1;
        break;
      case ShardKind::kTpDim0:
      case ShardKind::kTpGluFc1:
      case ShardKind::kVocab:
        p.group_size = c.tp;
        p.rank_in_group = c.tp_rank;
        p.gather_dim = 0;
        break;
      case ShardKind::kTpDim1:
        p.group_size = c.tp;
        p.rank_in_group = c.tp_rank;
        p.gather_dim = 1;
        break;
      case ShardKind::kExpertGluFc1:
        p.group_size = c.etp;
        p.rank_in_group = c.etp_rank;
        p.gather_dim = 0;
        break;
      case ShardKind::kExpertDim1:
        p.group_size = c.etp;
        p.rank_in_group = c.etp_rank;
        p.gather_dim = 1;
        break;
    }
    if (p.gather_dim >= 0) p.local_shape[static_cast<size_t>(p.gather_dim)] /= p.group_size;
    std::string suffix = r.megatron;
    std::string global_suffix = r.megatron;
    if (r.per_expert) {
      p.is_expert = true;
      p.local_expert = l;
      p.global_expert = c.expert_offset + l;
      suffix = absl::StrCat(r.megatron, l);
      global_suffix = absl::StrCat(r.megatron, p.global_expert);
    }
    p.local_layer = at.local_layer;
    p.global_layer = at.global_layer;
    p.local_name = absl::StrCat(at.local, suffix);
    p.global_name = absl::StrCat(at.global, global_suffix);
    for (const char* hf : r.hf) {
      if (hf == nullptr) break;
      std::string name = absl::StrCat(at.hf, hf);
      if (r.per_expert) name = absl::StrReplaceAll(name, {{"{e}", absl::StrCat(p.global_expert)}});
      p.hf_names.push_back(std::move(name));
    }
    if (r.block == Block::kOutput && m.tie_word_embeddings) {
      p.sent = false;  // the tied copy: built from, and equal to, the embedding
      p.hf_names = {"model.embed_tokens.weight"};
    }
    out->push_back(std::move(p));
  }
}

void AppendBlock(Block b, const PlanContext& c, const Place& at, std::vector<MegatronParam>* out) {
  for (const Row& r : kRows)
    if (r.block == b && RowApplies(r, c)) AppendRow(r, c, at, out);
}

// A decoder layer's attention and MLP blocks (global layer g decides dense or MoE).
void AppendLayer(const PlanContext& c, const Place& at, int64_t g, std::vector<MegatronParam>* out) {
  const ModelConfig& m = *c.model;
  AppendBlock(m.mla ? Block::kMla : Block::kGqa, c, at, out);
  AppendBlock(m.IsMoeLayer(g) ? Block::kMoeMlp : Block::kDenseMlp, c, at, out);
}

// MTP layer k as MultiTokenPredictionLayer registers it (enorm, hnorm, eh_proj, transformer_layer,
// final_layernorm). Its transformer layer is built from the last decoder layer's spec
// (MultiTokenPredictionBlock: layer_specs[-1]), so it is dense or MoE as layer L-1 is.
void AppendMtpLayer(const PlanContext& c, int64_t k, std::vector<MegatronParam>* out) {
  const int64_t L = c.model->num_hidden_layers;
  const std::string mtp = absl::StrCat("mtp.layers.", k, ".");
  const std::string hf = absl::StrCat("model.layers.", L + k, ".");
  AppendBlock(Block::kMtp, c, Place{mtp, mtp, hf, -1, L + k}, out);
  const std::string layer = mtp + "transformer_layer.";
  AppendLayer(c, Place{layer, layer, hf, -1, L + k}, L - 1, out);
  AppendBlock(Block::kMtpNorm, c, Place{mtp, mtp, hf, -1, L + k}, out);
}

absl::Status NotDivisible(absl::string_view what, int64_t value, absl::string_view size_name, int64_t size) {
  return absl::InvalidArgumentError(
      absl::StrCat(size_name, "=", size, " does not divide ", what, "=", value, " of the model"));
}

}  // namespace

absl::string_view ShardKindName(ShardKind kind) {
  switch (kind) {
    case ShardKind::kReplicated: return "replicated";
    case ShardKind::kTpDim0: return "tp-dim0";
    case ShardKind::kTpDim1: return "tp-dim1";
    case ShardKind::kTpGluFc1: return "tp-glu-fc1";
    case ShardKind::kVocab: return "vocab";
    case ShardKind::kExpertDim1: return "expert-dim1";
    case ShardKind::kExpertGluFc1: return "expert-glu-fc1";
  }
  return "?";
}

absl::Status CheckModelSupported(const ModelConfig& m) {
  // megatron-core biases linear_proj only under --add-bias-linear, which biases the MLP's linear_fc1
  // and linear_fc2 too (and linear_qkv): HF's o_proj bias and MLP biases come together or not at all.
  if (m.o_proj_bias && !m.mlp_bias)
    return absl::UnimplementedError(absl::StrCat(
        m.architecture, ": attention_bias=true without MLP biases is not supported (HF then has an o_proj bias; ",
        "megatron-core biases linear_proj only under --add-bias-linear, which also biases the MLP",
        m.arch == Architecture::kLlama ? ": set mlp_bias=true for such a model)" : ", which this HF model lacks)"));
  if (m.mlp_bias && !m.o_proj_bias)
    return absl::UnimplementedError(
        absl::StrCat(m.architecture,
                     ": mlp_bias=true without attention_bias is not supported (megatron-core's "
                     "--add-bias-linear biases the MLP and linear_qkv / linear_proj together)"));
  if ((m.arch == Architecture::kQwen3Moe || m.arch == Architecture::kGlm4Moe) && m.tie_word_embeddings)
    return absl::UnimplementedError(absl::StrCat(m.architecture, ": tie_word_embeddings=true is refused (SGLang's ",
                                                 m.architecture,
                                                 " builds its own lm_head and never fills it from a tied checkpoint)"));
  if (m.arch == Architecture::kDeepseekV3 && (!m.mla || !m.moe))
    return absl::InvalidArgumentError(absl::StrCat(m.architecture, ": MLA and MoE settings are missing"));
  if ((m.arch == Architecture::kQwen3Moe || m.arch == Architecture::kGlm4Moe) && !m.moe)
    return absl::InvalidArgumentError(absl::StrCat(m.architecture, ": MoE settings are missing"));
  return absl::OkStatus();
}

absl::Status CheckModelFitsLayout(const ModelConfig& m, const SourceParallel& par) {
  RETURN_IF_ERROR(CheckModelSupported(m));
  if (par.tp < 1 || par.etp < 1 || par.ep < 1)
    return absl::InvalidArgumentError(absl::StrCat("tp=", par.tp, ", etp=", par.etp, ", ep=", par.ep, " must be >= 1"));
  const Dims d = DimsOf(m, par.padded_vocab_size);
  if (d.nh % par.tp != 0) return NotDivisible("num_attention_heads", d.nh, "tp", par.tp);
  if (!m.mla && d.ng % par.tp != 0) return NotDivisible("num_key_value_heads (query groups)", d.ng, "tp", par.tp);
  bool any_dense = false, any_moe = false;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) (m.IsMoeLayer(l) ? any_moe : any_dense) = true;
  if (any_dense && d.ffn % par.tp != 0) return NotDivisible("intermediate_size", d.ffn, "tp", par.tp);
  if (any_moe) {
    if (d.moe_ffn % par.etp != 0) return NotDivisible("moe_intermediate_size", d.moe_ffn, "etp", par.etp);
    if (d.shared_ffn % par.tp != 0)
      return NotDivisible("shared expert width (moe_intermediate_size * n_shared_experts)", d.shared_ffn, "tp", par.tp);
    if (d.experts % par.ep != 0) return NotDivisible("number of routed experts", d.experts, "ep", par.ep);
  } else if (par.ep > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep=", par.ep, " needs a model with MoE layers; ", m.architecture, " has none"));
  }
  if (par.padded_vocab_size > 0) {
    if (par.padded_vocab_size < m.vocab_size)
      return absl::InvalidArgumentError(
          absl::StrCat("padded_vocab_size=", par.padded_vocab_size, " is smaller than vocab_size=", m.vocab_size));
    if (par.padded_vocab_size % par.tp != 0)
      return NotDivisible("padded_vocab_size", par.padded_vocab_size, "tp", par.tp);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<MegatronParam>> PlanRank(const ModelConfig& model, const ParallelLayout& layout,
                                                    const SourceParallel& par, int global_rank) {
  if (par.padded_vocab_size <= 0 || static_cast<int>(par.layers_per_stage.size()) != par.pp ||
      par.layers_per_chunk.size() != static_cast<size_t>(par.pp) * par.vpp)
    return absl::InvalidArgumentError("PlanRank needs a resolved SourceParallel (see ResolveSourceParallel)");
  if (layout.tp() != par.tp || layout.pp() != par.pp || layout.ep() != par.ep || layout.etp() != par.etp ||
      layout.cp() != par.cp || layout.dp() != par.dp || layout.world_size() != par.world_size)
    return absl::InvalidArgumentError(absl::StrCat("parallel layout ", layout.DebugString(),
                                                   " disagrees with parallel.json ", SourceParallelToJson(par)));
  if (global_rank < 0 || global_rank >= layout.world_size())
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", global_rank, " is outside the world of ", layout.world_size(), " ranks"));
  RETURN_IF_ERROR(CheckModelFitsLayout(model, par));

  const DenseCoord dense = layout.Dense(global_rank);
  const ExpertCoord expert = layout.Expert(global_rank);
  PlanContext c;
  c.model = &model;
  c.dims = DimsOf(model, par.padded_vocab_size);
  c.tp = par.tp;
  c.etp = par.etp;
  c.tp_rank = dense.tp;
  c.etp_rank = expert.etp;
  c.local_experts = model.moe ? model.moe->num_experts / par.ep : 0;
  c.expert_offset = expert.ep * c.local_experts;
  c.first_stage = dense.pp == 0;

  // The rank's model chunks in order (virtual stages; one without VPP), each named as Megatron's
  // model[vp].named_parameters() gives it, under "model{vp}." when there are several (§4.1).
  std::vector<MegatronParam> plan;
  const int last_chunk = par.pp * par.vpp - 1;
  for (int vp = 0; vp < par.vpp; ++vp) {
    const int chunk = par.Chunk(dense.pp, vp);
    const size_t begin = plan.size();
    if (chunk == 0) {
      AppendBlock(Block::kFirstStage, c, Place{}, &plan);
    } else if (chunk == last_chunk && par.mtp_num_layers > 0) {
      // GPTModel builds an embedding on the MTP stage too (pre_process or mtp_process), kept equal
      // to the first stage's: held, never sent (§5.7)
      AppendBlock(Block::kFirstStage, c, Place{}, &plan);
      plan.back().sent = false;
    }
    const int64_t first = par.ChunkFirstLayer(chunk);
    for (int64_t l = 0; l < par.layers_per_chunk[static_cast<size_t>(chunk)]; ++l)
      AppendLayer(c, DecoderLayer(l, first + l), first + l, &plan);
    if (chunk == last_chunk) {
      AppendBlock(Block::kLastStage, c, Place{}, &plan);
      for (int64_t k = 0; k < par.mtp_num_layers; ++k) AppendMtpLayer(c, k, &plan);
      AppendBlock(Block::kOutput, c, Place{}, &plan);
    }
    if (par.vpp > 1)
      for (size_t i = begin; i < plan.size(); ++i)
        plan[i].local_name = absl::StrCat("model", vp, ".", plan[i].local_name);
  }
  return plan;
}

absl::StatusOr<std::vector<MegatronParam>> PlanFullModel(const ModelConfig& model, int64_t mtp_num_layers) {
  SourceParallel par;
  par.mtp_num_layers = mtp_num_layers;
  par.padded_vocab_size = model.vocab_size;  // unsharded: no padding
  par.layers_per_stage = {model.num_hidden_layers};
  par.layers_per_chunk = par.layers_per_stage;
  ASSIGN_OR_RETURN(ParallelLayout layout, MakeLayout(model, par));
  return PlanRank(model, layout, par, 0);
}

absl::StatusOr<std::vector<TensorView>> BindToPlan(const std::vector<MegatronParam>& plan,
                                                   const std::vector<std::pair<std::string, TensorView>>& tensors,
                                                   absl::string_view source) {
  constexpr size_t kMaxListed = 8;
  std::map<absl::string_view, size_t> index;
  for (size_t i = 0; i < plan.size(); ++i) index.emplace(plan[i].local_name, i);
  std::vector<TensorView> views(plan.size());
  std::vector<bool> seen(plan.size(), false);
  std::vector<std::string> unknown, bad;
  for (const auto& [name, view] : tensors) {
    auto it = index.find(name);
    if (it == index.end()) {
      unknown.push_back(name);
      continue;
    }
    const MegatronParam& p = plan[it->second];
    if (seen[it->second]) {
      bad.push_back(absl::StrCat(name, " (given twice)"));
      continue;
    }
    seen[it->second] = true;
    if (view.dtype() != p.dtype || view.shape() != p.local_shape) {
      bad.push_back(absl::StrCat(name, ": expected ", SafetensorsName(p.dtype), ShapeToString(p.local_shape),
                                 ", found ", view.DebugString()));
      continue;
    }
    views[it->second] = view;
  }
  std::vector<std::string> missing;
  for (size_t i = 0; i < plan.size(); ++i)
    if (!seen[i])
      missing.push_back(absl::StrCat(plan[i].local_name, " (", SafetensorsName(plan[i].dtype),
                                     ShapeToString(plan[i].local_shape), ")"));
  auto list = [&](const std::vector<std::string>& names) {
    std::vector<std::string> shown(names.begin(), names.begin() + std::min(names.size(), kMaxListed));
    std::string s = absl::StrJoin(shown, ", ");
    if (names.size() > kMaxListed) absl::StrAppend(&s, ", ... (", names.size() - kMaxListed, " more)");
    return s;
  };
  std::vector<std::string> problems;
  if (!missing.empty()) problems.push_back(absl::StrCat(missing.size(), " missing parameter(s): ", list(missing)));
  if (!unknown.empty())
    problems.push_back(absl::StrCat(unknown.size(), " unknown parameter(s) (not held by this rank): ", list(unknown)));
  if (!bad.empty())
    problems.push_back(absl::StrCat(bad.size(), " parameter(s) with a wrong dtype or shape: ", list(bad)));
  if (!problems.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", absl::StrJoin(problems, "; ")));
  return views;
}

}  // namespace wsync::trainer_agent
