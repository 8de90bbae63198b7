#include "engine_model/engine_layout.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/status.h"

namespace wsync::engine_model {

bool IsMtpDraftParam(absl::string_view name) {
  return absl::StartsWith(name, "model.layers.") && absl::EndsWith(name, ".eh_proj.weight");
}

absl::string_view ParamRoleName(ParamRole role) {
  switch (role) {
    case ParamRole::kReplicated: return "replicated";
    case ParamRole::kColumn: return "column";
    case ParamRole::kRow: return "row";
    case ParamRole::kQkv: return "qkv";
    case ParamRole::kGateUp: return "gate_up";
    case ParamRole::kVocab: return "vocab";
    case ParamRole::kExpertsW13: return "experts_w13";
    case ParamRole::kExpertsW2: return "experts_w2";
    case ParamRole::kFusedQkvA: return "fused_qkv_a";
  }
  return "?";
}

absl::string_view ParamKindName(ParamKind kind) {
  switch (kind) {
    case ParamKind::kPlain: return "plain";
    case ParamKind::kPacked: return "packed";
    case ParamKind::kScale: return "scale";
    case ParamKind::kZeros: return "zeros";
  }
  return "?";
}

namespace {

absl::Status Refuse(absl::string_view what) { return absl::InvalidArgumentError(what); }

int64_t Pad(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One HF tensor of a linear layer and the block of it this rank holds (HF [N, K] orientation).
struct Shard {
  std::string hf;  // HF module, e.g. "model.layers.0.self_attn.k_proj"
  int64_t hf_n = 0, hf_k = 0;
  int64_t r0 = 0, nr = 0;  // rows taken
  int64_t c0 = 0, nc = 0;  // columns taken (input features)
  int64_t dst_n = 0;       // row offset in this rank's [n, k] weight
  int64_t expert = 0;      // local expert index (stacked experts)
  bool owned = true;       // false: another EP rank's expert, accepted and skipped
  std::string what;
};

struct LinearSpec {
  std::string name;  // bf16 weight name
  ParamRole role = ParamRole::kReplicated;
  int64_t layer = -1;
  int64_t experts = 0;
  int64_t n = 0, k = 0;
  bool quantized = false;
  // Scale permutation size_k (SGLang's quirk for w13 = 4I'); 0 = k.
  int64_t scale_perm_size_k = 0;
};

std::string Layer(int64_t i) { return absl::StrCat("model.layers.", i, "."); }

// The AWQ engine name of a linear's tensor (vLLM / SGLang AWQ-Marlin): "X.weight" -> "X.qweight",
// "...experts.w13_weight" -> "...experts.w13_qweight".
std::string AwqParamName(absl::string_view weight_name, absl::string_view what) {
  absl::string_view base = weight_name;
  if (absl::ConsumeSuffix(&base, ".weight")) return absl::StrCat(base, ".", what);
  absl::ConsumeSuffix(&base, "_weight");
  return absl::StrCat(base, "_", what);
}

}  // namespace

class LayoutBuilder {
 public:
  LayoutBuilder(const ModelConfig& c, const QuantizationConfig* q, EngineParallel p) : c_(c), q_(q), p_(p) {
    L_.config_ = c;
    L_.parallel_ = p;
  }

  absl::StatusOr<EngineLayout> Build() {
    RETURN_IF_ERROR(CheckParallel());
    RETURN_IF_ERROR(CheckQuantization());
    RETURN_IF_ERROR(AddVocab("model.embed_tokens.weight"));
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) RETURN_IF_ERROR(AddLayer(i, c_.IsMoeLayer(i)));
    AddPlain("model.norm.weight", ParamRole::kReplicated, dt_, {c_.hidden_size}, -1, "model.norm.weight");
    if (!c_.tie_word_embeddings) {
      RETURN_IF_ERROR(AddVocab("lm_head.weight"));
    } else {
      // Tied: lm_head is embed_tokens; a sent lm_head.weight is dropped (§2.6).
      AddSkip("lm_head.weight", dt_, {c_.vocab_size, c_.hidden_size}, "tied lm_head");
    }
    if (p_.mtp_draft) RETURN_IF_ERROR(AddDraft());
    for (const std::string& w : warnings_) {
      WSYNC_LOG(WARNING) << "engine layout (TP " << p_.tp_size << " rank " << p_.tp_rank << "): " << w;
      L_.warnings_.push_back(w);
    }
    return std::move(L_);
  }

 private:
  std::string Ctx() const {
    return absl::StrCat(ArchitectureName(c_.arch), " engine TP ", p_.tp_size, " (rank ", p_.tp_rank, ", EP ",
                        p_.ep_size, ")");
  }

  absl::Status CheckParallel() {
    const int T = p_.tp_size;
    if (T < 1) return Refuse(absl::StrCat("engine tp_size must be >= 1, got ", T));
    if (p_.tp_rank < 0 || p_.tp_rank >= T)
      return Refuse(absl::StrCat("engine tp_rank ", p_.tp_rank, " is outside [0, ", T, ")"));
    if (p_.ep_size < 1) return Refuse(absl::StrCat("engine ep_size must be >= 1, got ", p_.ep_size));
    if (c_.hidden_size <= 0 || c_.num_attention_heads <= 0 || c_.vocab_size <= 0 || c_.num_hidden_layers < 0)
      return Refuse("model config has non-positive sizes (hidden_size, num_attention_heads, vocab_size)");
    dt_ = c_.dtype;
    const int64_t nh = c_.num_attention_heads;
    if (nh % T != 0) return Refuse(absl::StrCat(Ctx(), ": num_attention_heads ", nh, " is not divisible by T ", T));
    if (!c_.mla) {
      const int64_t nkv = c_.num_key_value_heads;
      if (nkv <= 0) return Refuse(absl::StrCat("num_key_value_heads must be positive, got ", nkv));
      if (T >= nkv && T % nkv != 0)
        return Refuse(absl::StrCat(Ctx(), ": T ", T, " >= num_key_value_heads ", nkv,
                                   " needs T % num_key_value_heads == 0 (KV-head replication), got ", T % nkv));
      if (T < nkv && nkv % T != 0)
        return Refuse(absl::StrCat(Ctx(), ": num_key_value_heads ", nkv, " is not divisible by T ", T));
    }
    bool has_dense_mlp = false;
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) has_dense_mlp |= !c_.IsMoeLayer(i);
    if (has_dense_mlp && c_.intermediate_size % T != 0)
      return Refuse(absl::StrCat(Ctx(), ": intermediate_size F ", c_.intermediate_size, " is not divisible by T ", T,
                                 " (gate_up_proj / down_proj)"));
    L_.padded_vocab_ = Pad(c_.vocab_size, 64);
    if (L_.padded_vocab_ % T != 0)
      return Refuse(absl::StrCat(Ctx(), ": padded vocab pad(", c_.vocab_size, ", 64) = ", L_.padded_vocab_,
                                 " is not divisible by T ", T));
    if (c_.mla && (nh * c_.mla->v_head_dim) % T != 0)
      return Refuse(absl::StrCat(Ctx(), ": o_proj K = ", nh * c_.mla->v_head_dim, " is not divisible by T ", T));
    if (!c_.mla && (nh * c_.head_dim) % T != 0)
      return Refuse(absl::StrCat(Ctx(), ": o_proj K = ", nh * c_.head_dim, " is not divisible by T ", T));
    if ((c_.arch == Architecture::kQwen3Moe || c_.arch == Architecture::kDeepseekV3 ||
         c_.arch == Architecture::kGlm4Moe) &&
        c_.tie_word_embeddings)
      return Refuse(absl::StrCat(Ctx(), ": tie_word_embeddings is set, but SGLang's ", c_.architecture,
                                 " always builds its own lm_head, which a tied checkpoint never fills; refusing"));

    if (!c_.moe) {
      if (p_.ep_size != 1) return Refuse(absl::StrCat(Ctx(), ": ep_size ", p_.ep_size, " > 1 needs an MoE model"));
      return absl::OkStatus();
    }
    const int EP = p_.ep_size;
    if (T % EP != 0) return Refuse(absl::StrCat(Ctx(), ": ep_size ", EP, " does not divide T ", T));
    L_.moe_tp_size_ = T / EP;
    L_.moe_tp_rank_ = p_.tp_rank % L_.moe_tp_size_;
    L_.ep_rank_ = p_.tp_rank / L_.moe_tp_size_;
    const int64_t E = c_.moe->num_experts;  // shared-experts fusion is off: E_total = n_routed
    if (E <= 0) return Refuse(absl::StrCat(Ctx(), ": MoE model with ", E, " experts"));
    if (E % EP != 0) return Refuse(absl::StrCat(Ctx(), ": E_total ", E, " experts are not divisible by ep_size ", EP));
    const int64_t I = c_.moe->moe_intermediate_size;
    if (I % L_.moe_tp_size_ != 0)
      return Refuse(absl::StrCat(Ctx(), ": moe_intermediate_size I ", I,
                                 " is not divisible by moe_tp = T/EP = ", L_.moe_tp_size_));
    L_.local_experts_ = E / EP;
    L_.first_expert_ = L_.ep_rank_ * L_.local_experts_;
    if (c_.moe->num_shared_experts > 0) {
      const int64_t S = c_.moe->num_shared_experts * I;
      if (S % T != 0)
        return Refuse(absl::StrCat(Ctx(), ": shared experts intermediate S = n_shared_experts * I = ", S,
                                   " is not divisible by T ", T));
    }
    return absl::OkStatus();
  }

  absl::Status CheckQuantization() {
    if (q_ == nullptr) return absl::OkStatus();
    if (q_->is_fp8()) return CheckFp8Quantization();
    if (q_->quant_method != "compressed-tensors" && !q_->is_awq())
      return absl::UnimplementedError(absl::StrCat("quantization_config: quant_method \"", q_->quant_method,
                                                   "\" is not supported (want compressed-tensors or awq)"));
    RETURN_IF_ERROR(q_->CheckInt4Supported());
    L_.format_ = q_->is_awq() ? Int4Format::kAwq : q_->trtllm() ? Int4Format::kTrtllm : Int4Format::kCompressedTensors;
    L_.quantization_ = *q_;
    if (dt_ != DType::kBF16 && dt_ != DType::kF16)
      return absl::UnimplementedError(
          absl::StrCat("INT4 needs a bf16 or fp16 model (the scales' dtype), got ", TorchName(dt_)));
    L_.quantized_ = true;
    L_.group_size_ = q_->group_size;
    G_ = q_->group_size;
    if (!q_->IsIgnored("model.embed_tokens.weight"))
      return Refuse(
          "INT4 embedding refused: SGLang never quantizes model.embed_tokens (not a LinearBase); "
          "quantization_config.ignore must cover it");
    if (!c_.tie_word_embeddings && !q_->IsIgnored("lm_head.weight"))
      return Refuse(
          "INT4 lm_head refused: SGLang never quantizes lm_head (ParallelLMHead); "
          "quantization_config.ignore must cover it");
    return absl::OkStatus();
  }

  // FP8 (docs/spec/FP8.md §4): the engines' Fp8Config / compressed-tensors FP8 on a GPU with FP8
  // GEMMs, whose loaded tensors are what they serve from.
  absl::Status CheckFp8Quantization() {
    RETURN_IF_ERROR(q_->CheckFp8Supported());
    L_.format_ = q_->is_fp8_block() ? Int4Format::kFp8Block : Int4Format::kFp8Channel;
    L_.quantization_ = *q_;
    if (dt_ != DType::kBF16 && dt_ != DType::kF16)
      return absl::UnimplementedError(
          absl::StrCat("FP8 weights need a bf16 or fp16 model (what the trainer quantizes), got ", TorchName(dt_)));
    L_.quantized_ = true;
    bn_ = q_->is_fp8_block() ? q_->block_n : 0;
    bk_ = q_->is_fp8_block() ? q_->block_k : 0;
    // The embedding is never a target (model::IsQuantTarget); lm_head is a Linear in HF.
    if (!c_.tie_word_embeddings && !q_->IsIgnored("lm_head.weight"))
      return Refuse(
          "FP8 lm_head refused: the engines never build lm_head FP8 (ParallelLMHead); the ignore list "
          "must cover it");
    return absl::OkStatus();
  }

  bool Fp8() const { return L_.format_ == Int4Format::kFp8Block || L_.format_ == Int4Format::kFp8Channel; }

  // Whether HF weight `name` is sent as INT4 (slime: not ignored; every linear weight has dim 2).
  bool Int4(absl::string_view hf_weight) const { return q_ != nullptr && !q_->IsIgnored(hf_weight); }

  // One quantization decision for a fused layer whose shards must agree (§3.1).
  absl::StatusOr<bool> Agree(absl::string_view layer_name, const std::vector<std::string>& hf_weights) const {
    if (q_ == nullptr) return false;
    std::vector<std::string> quant, bf16;
    for (const auto& w : hf_weights) (Int4(w) ? quant : bf16).push_back(w);
    if (!quant.empty() && !bf16.empty()) {
      auto head = [](const std::vector<std::string>& v) {
        std::vector<std::string> h(v.begin(), v.begin() + std::min<size_t>(v.size(), 4));
        return absl::StrCat(absl::StrJoin(h, ", "), v.size() > 4 ? absl::StrCat(" (+", v.size() - 4, " more)") : "");
      };
      return Refuse(absl::StrCat("mixed quantization in fused layer ", layer_name, ": INT4 for ", head(quant),
                                 " but bf16 (ignored) for ", head(bf16),
                                 "; SGLang requires all shards of a fused layer to agree"));
    }
    return !quant.empty();
  }

  int AddParam(EngineParam p) {
    const int idx = static_cast<int>(L_.params_.size());
    L_.param_index_[p.name] = idx;
    L_.params_.push_back(std::move(p));
    return idx;
  }

  void AddSource(HfSource s) {
    L_.source_index_[s.hf_name] = static_cast<int>(L_.sources_.size());
    L_.sources_.push_back(std::move(s));
  }

  void AddSkip(const std::string& hf, DType dt, Shape shape, std::string what) {
    HfSource s;
    s.hf_name = hf;
    s.dtype = dt;
    s.shape = std::move(shape);
    s.action = HfSource::Action::kSkip;
    s.what = std::move(what);
    AddSource(std::move(s));
  }

  // A replicated (or otherwise whole) 1-D/2-D plain tensor copied as is from `hf`.
  int AddPlain(const std::string& name, ParamRole role, DType dt, Shape shape, int64_t layer, const std::string& hf) {
    EngineParam p;
    p.name = name;
    p.role = role;
    p.kind = ParamKind::kPlain;
    p.dtype = dt;
    p.loaded_shape = shape;
    p.engine_shape = shape;
    p.layer = layer;
    const int idx = AddParam(std::move(p));
    HfSource s;
    s.hf_name = hf;
    s.dtype = dt;
    s.shape = shape;
    s.param = idx;
    s.rows = shape[0];
    s.cols = shape.size() == 2 ? shape[1] : 1;
    s.what = "whole tensor";
    AddSource(std::move(s));
    return idx;
  }

  absl::Status AddVocab(const std::string& name) {
    const int T = p_.tp_size, r = p_.tp_rank;
    const int64_t P = L_.padded_vocab_ / T, V = c_.vocab_size, H = c_.hidden_size;
    EngineParam p;
    p.name = name;
    p.role = ParamRole::kVocab;
    p.dtype = dt_;
    p.loaded_shape = {P, H};
    p.engine_shape = {P, H};
    const int idx = AddParam(std::move(p));
    const int64_t s0 = std::min<int64_t>(r * P, V), s1 = std::min<int64_t>((r + 1) * P, V);
    if (s1 <= s0) {
      AddSkip(name, dt_, {V, H}, absl::StrCat("vocab rows (none on rank ", r, ")"));
      return absl::OkStatus();
    }
    HfSource s;
    s.hf_name = name;
    s.dtype = dt_;
    s.shape = {V, H};
    s.param = idx;
    s.src_row0 = s0;
    s.rows = s1 - s0;
    s.cols = H;
    s.what = absl::StrCat("vocab rows ", s0, "..", s1 - 1);
    AddSource(std::move(s));
    return absl::OkStatus();
  }

  void Warn(std::string w) {
    if (warned_.insert(w).second) warnings_.push_back(std::move(w));
  }

  // The name with the layer index replaced by {i}, so that an advisory warning is given once.
  static std::string Generic(absl::string_view name) {
    if (!absl::StartsWith(name, "model.layers.")) return std::string(name);
    absl::string_view rest = name.substr(13);
    const size_t dot = rest.find('.');
    if (dot == absl::string_view::npos) return std::string(name);
    return absl::StrCat("model.layers.{i}", rest.substr(dot));
  }

  // Adds the params and sources of one linear. Checks the INT4 / Marlin constraints (§3, §4, §6).
  absl::Status AddLinear(LinearSpec spec, const std::vector<Shard>& shards, const std::string& bias_name = "") {
    EngineLinear lin;
    lin.name = spec.name;
    lin.role = spec.role;
    lin.layer = spec.layer;
    lin.experts = spec.experts;
    lin.n = spec.n;
    lin.k = spec.k;
    lin.quantized = spec.quantized;
    lin.group_size = spec.quantized ? G_ : -1;
    const int lidx = static_cast<int>(L_.linears_.size());
    if (!spec.quantized) {
      AddBf16Linear(spec, shards, lidx, lin);
    } else if (Fp8()) {
      RETURN_IF_ERROR(CheckFp8Shards(spec, shards));
      lin.group_size = -1;
      lin.fp8 = true;
      AddFp8Linear(spec, shards, lidx, lin);
    } else {
      RETURN_IF_ERROR(CheckInt4Shards(spec, shards));
      RETURN_IF_ERROR(CheckInt4Shape(spec));
      AddInt4Params(spec, lidx, lin);
      for (const Shard& sh : shards) {
        if (L_.format_ == Int4Format::kAwq) {
          AddAwqSources(sh, lin, G_);
        } else {
          AddInt4Sources(sh, lin, spec.experts > 0);
        }
      }
    }
    if (!bias_name.empty()) AddBias(spec, shards, bias_name);
    L_.linear_index_[lin.name] = lidx;
    L_.linears_.push_back(std::move(lin));
    return absl::OkStatus();
  }

  // `dims` with the expert dimension in front for a stacked (MoE) linear.
  static Shape WithExperts(const LinearSpec& spec, std::initializer_list<int64_t> dims) {
    Shape s;
    if (spec.experts > 0) s.push_back(spec.experts);
    s.insert(s.end(), dims.begin(), dims.end());
    return s;
  }

  // A bf16 linear: one weight param [(E,) N, K]; each owned shard a block copy of its rows / columns.
  void AddBf16Linear(const LinearSpec& spec, const std::vector<Shard>& shards, int lidx, EngineLinear& lin) {
    EngineParam p;
    p.name = spec.name;
    p.role = spec.role;
    p.dtype = dt_;
    p.loaded_shape = WithExperts(spec, {spec.n, spec.k});
    p.engine_shape = p.loaded_shape;
    p.layer = spec.layer;
    p.linear = lidx;
    lin.weight = AddParam(std::move(p));
    for (const Shard& sh : shards) {
      const std::string hf = absl::StrCat(sh.hf, ".weight");
      if (!sh.owned) {
        AddSkip(hf, dt_, {sh.hf_n, sh.hf_k}, sh.what);
        continue;
      }
      HfSource s;
      s.hf_name = hf;
      s.dtype = dt_;
      s.shape = {sh.hf_n, sh.hf_k};
      s.param = lin.weight;
      s.expert = sh.expert;
      s.src_row0 = sh.r0;
      s.rows = sh.nr;
      s.src_col0 = sh.c0;
      s.cols = sh.nc;
      s.dst_row0 = sh.dst_n;
      s.what = sh.what;
      AddSource(std::move(s));
    }
  }

  // The engines' block-shape rules for a block-FP8 linear (FP8.md §4: SGLang's
  // validate_block_quant_shapes and the FusedMoE checks, with their messages), then what every
  // block copy of weight_scale_inv needs: each shard's rows and columns start on a block and end on
  // one or at the tensor's end. INVALID_ARGUMENT naming the layer, the sizes and this rank.
  absl::Status CheckFp8Shards(const LinearSpec& spec, const std::vector<Shard>& shards) const {
    if (L_.format_ != Int4Format::kFp8Block) return absl::OkStatus();
    const int64_t bn = bn_, bk = bk_;
    auto refuse = [&](absl::string_view what) { return Refuse(absl::StrCat(spec.name, ": ", what, "; ", Ctx())); };
    const int T = p_.tp_size, moe_tp = L_.moe_tp_size_;
    if (spec.role == ParamRole::kExpertsW13 && (spec.n / 2) % bn != 0)
      return refuse(absl::StrCat("The output_size of gate's and up's weight = ", spec.n / 2,
                                 " is not divisible by weight quantization block_n = ", bn, "."));
    if (spec.role == ParamRole::kExpertsW2 && moe_tp > 1 && spec.k % bk != 0)
      return refuse(absl::StrCat("The input_size of down's weight = ", spec.k,
                                 " is not divisible by weight quantization block_k = ", bk, "."));
    if (spec.experts == 0) {
      const bool k_split = T > 1 && spec.role == ParamRole::kRow;
      const bool n_split =
          T > 1 && (spec.role == ParamRole::kColumn || spec.role == ParamRole::kQkv || spec.role == ParamRole::kGateUp);
      const bool merged = spec.role == ParamRole::kQkv || spec.role == ParamRole::kGateUp;
      if (k_split && spec.k % bk != 0)
        return refuse(absl::StrCat("Weight input_size_per_partition = ", spec.k,
                                   " is not divisible by weight quantization block_k = ", bk, "."));
      if (n_split || merged)
        for (const Shard& sh : shards)
          if (sh.nr % bn != 0)
            return refuse(absl::StrCat("Weight output_partition_size = ", sh.nr, " (", sh.what,
                                       ") is not divisible by weight quantization block_n = ", bn, "."));
    }
    for (const Shard& sh : shards) {
      const bool rows_ok = sh.r0 % bn == 0 && sh.dst_n % bn == 0 && (sh.nr % bn == 0 || sh.r0 + sh.nr == sh.hf_n);
      const bool cols_ok = sh.c0 % bk == 0 && (sh.nc % bk == 0 || sh.c0 + sh.nc == sh.hf_k);
      if (!rows_ok || !cols_ok)
        return refuse(absl::StrCat("the FP8 shard of ", sh.hf, " (", sh.what, ") on this rank is rows ", sh.r0, "..",
                                   sh.r0 + sh.nr - 1, " (to row ", sh.dst_n, ") by columns ", sh.c0, "..",
                                   sh.c0 + sh.nc - 1, " of [", sh.hf_n, ", ", sh.hf_k,
                                   "], which cuts weight quantization blocks of ", bn, "x", bk));
    }
    return absl::OkStatus();
  }

  // An FP8 linear (FP8.md §4): weight F8_E4M3 [(E,) n, k] and its scales, F32 in both forms:
  // block weight_scale_inv [(E,) ceil(n/bn), ceil(k/bk)] ("X.weight_scale_inv",
  // "...experts.w13_weight_scale_inv"), channel weight_scale [(E,) n, 1]. Each owned shard is a block
  // copy of its rows / columns of both sent tensors (scales: of whole blocks, CheckFp8Shards).
  void AddFp8Linear(const LinearSpec& spec, const std::vector<Shard>& shards, int lidx, EngineLinear& lin) {
    const bool block = L_.format_ == Int4Format::kFp8Block;
    auto blocks = [](int64_t x, int64_t b) { return (x + b - 1) / b; };
    const Shape scale_shape =
        block ? WithExperts(spec, {blocks(spec.n, bn_), blocks(spec.k, bk_)}) : WithExperts(spec, {spec.n, 1});
    auto add = [&](std::string name, DType dt, Shape shape) {
      EngineParam q;
      q.name = std::move(name);
      q.role = spec.role;
      q.kind = ParamKind::kPlain;
      q.dtype = dt;
      q.loaded_shape = shape;
      q.engine_shape = std::move(shape);
      q.layer = spec.layer;
      q.linear = lidx;
      return AddParam(std::move(q));
    };
    lin.weight = add(spec.name, DType::kF8E4M3, WithExperts(spec, {spec.n, spec.k}));
    lin.scale = add(absl::StrCat(spec.name, block ? "_scale_inv" : "_scale"), DType::kF32, scale_shape);
    for (const Shard& sh : shards) {
      const std::string wn = absl::StrCat(sh.hf, ".weight"),
                        sn = absl::StrCat(sh.hf, block ? ".weight_scale_inv" : ".weight_scale");
      const Shape sshape = block ? Shape{blocks(sh.hf_n, bn_), blocks(sh.hf_k, bk_)} : Shape{sh.hf_n, 1};
      if (!sh.owned) {
        AddSkip(wn, DType::kF8E4M3, {sh.hf_n, sh.hf_k}, sh.what);
        AddSkip(sn, DType::kF32, sshape, sh.what);
        continue;
      }
      HfSource w;
      w.hf_name = wn;
      w.dtype = DType::kF8E4M3;
      w.shape = {sh.hf_n, sh.hf_k};
      w.param = lin.weight;
      w.expert = sh.expert;
      w.src_row0 = sh.r0;
      w.rows = sh.nr;
      w.src_col0 = sh.c0;
      w.cols = sh.nc;
      w.dst_row0 = sh.dst_n;
      w.what = sh.what;
      HfSource sc = w;
      sc.hf_name = sn;
      sc.dtype = DType::kF32;
      sc.shape = sshape;
      sc.param = lin.scale;
      if (block) {
        sc.src_row0 = sh.r0 / bn_;
        sc.rows = blocks(sh.nr, bn_);
        sc.src_col0 = sh.c0 / bk_;
        sc.cols = blocks(sh.nc, bk_);
        sc.dst_row0 = sh.dst_n / bn_;
      } else {
        sc.src_col0 = 0;
        sc.cols = 1;
      }
      AddSource(std::move(w));
      AddSource(std::move(sc));
    }
  }

  // Sent-format and loader constraints on each shard of an INT4 linear (§3.2, §3.3, §6 INT4
  // refusals; AWQ.md §2): INVALID_ARGUMENT naming the shard and the rank when one fails.
  absl::Status CheckInt4Shards(const LinearSpec& spec, const std::vector<Shard>& shards) const {
    const int G = G_;
    const bool awq = L_.format_ == Int4Format::kAwq;
    for (const Shard& sh : shards) {
      if (G > 0 && sh.hf_k % G != 0)
        return Refuse(absl::StrCat(sh.hf, ": INT4 needs K % G == 0, K = ", sh.hf_k, ", G = ", G));
      if (awq) {
        // AWQ packs 8 output features (rows of W) per word: a rank's rows must be whole words.
        if (sh.hf_n % 8 != 0)
          return Refuse(absl::StrCat(sh.hf, ": AWQ needs N % 8 == 0 (packed words), N = ", sh.hf_n));
        if (sh.r0 % 8 != 0 || sh.nr % 8 != 0 || sh.dst_n % 8 != 0)
          return Refuse(absl::StrCat(spec.name, ": the AWQ shard of ", sh.hf, " on this rank spans output rows ", sh.r0,
                                     "..", sh.r0 + sh.nr - 1, " (to row ", sh.dst_n, "), not whole packed words of 8; ",
                                     Ctx()));
      } else {
        if (sh.hf_k % 8 != 0)
          return Refuse(absl::StrCat(sh.hf, ": INT4 needs K % 8 == 0 (packed words), K = ", sh.hf_k));
        if (sh.c0 % 8 != 0 || sh.nc % 8 != 0)
          return Refuse(absl::StrCat(spec.name, ": the INT4 shard of ", sh.hf, " on this rank spans input columns ",
                                     sh.c0, "..", sh.c0 + sh.nc - 1, " (K_p = ", sh.nc,
                                     "), not a multiple of 8 (packed words); ", Ctx()));
      }
      if (G > 0 && (sh.c0 % G != 0 || sh.nc % G != 0))
        return Refuse(absl::StrCat(spec.name, ": the INT4 shard of ", sh.hf, " on this rank has K_p = ", sh.nc,
                                   " input columns (from ", sh.c0, "), not a multiple of the group size G = ", G, "; ",
                                   Ctx()));
    }
    return absl::OkStatus();
  }

  // The engine-side shape constraints of an INT4 linear [N_p, K_p] on this rank: the TensorRT-LLM
  // layout's or Marlin repack's (§4 hard constraints; INVALID_ARGUMENT), and Marlin's advisories
  // (warnings, given once per generic name).
  absl::Status CheckInt4Shape(const LinearSpec& spec) {
    const int64_t n = spec.n, k = spec.k;
    if (L_.format_ == Int4Format::kTrtllm) {
      if (k % 64 != 0 || n % 64 != 0)  // TRTLLM_INT4.md §1 steps 2-3 (W4A16: RPT 64)
        return Refuse(absl::StrCat(spec.name,
                                   ": the TensorRT-LLM W4A16 layout needs K % 64 == 0 and N % 64 == 0, [K, N] = [", k,
                                   ", ", n, "]; ", Ctx()));
      return absl::OkStatus();
    }
    if (k % 16 != 0)
      return Refuse(absl::StrCat(spec.name, ": Marlin repack needs size_k % 16 == 0, size_k = ", k, "; ", Ctx()));
    if (n % 64 != 0)
      return Refuse(absl::StrCat(spec.name, ": Marlin repack needs size_n % 64 == 0, size_n = ", n, "; ", Ctx()));
    if (spec.experts == 0) {
      const std::string generic = Generic(spec.name);
      if (k % 128 != 0)
        Warn(
            absl::StrCat(generic, ": advisory (verify_marlin_supports_shape): K_p = ", k, " is not a multiple of 128"));
      const bool thread_cfg = (k % 128 == 0) || (k % 64 == 0 && n % 128 == 0);
      if (!thread_cfg)
        Warn(absl::StrCat(generic,
                          ": advisory: no Marlin thread config (k, n) in {(128,128), (128,64), (64,128), "
                          "(64,256)} divides (K_p, N_p) = (",
                          k, ", ", n, ")"));
    }
    return absl::OkStatus();
  }

  // The params of an INT4 linear in this layout's format (packed, scale, AWQ zeros), each with
  // the repack's MarlinSpec; their indices recorded in `lin`.
  void AddInt4Params(const LinearSpec& spec, int lidx, EngineLinear& lin) {
    const int G = G_;
    const int64_t n = spec.n, k = spec.k;
    const bool stacked = spec.experts > 0;
    const bool awq = L_.format_ == Int4Format::kAwq, trtllm = L_.format_ == Int4Format::kTrtllm;
    const int64_t scale_rows = G > 0 ? k / G : 1;
    MarlinSpec m;
    m.awq = awq;
    m.trtllm = trtllm;
    m.trtllm_sm90 = trtllm && q_->engine_layout == "trtllm-sm90";
    m.up_first = trtllm && spec.role == ParamRole::kExpertsW13;
    m.experts = spec.experts;
    m.size_k = k;
    m.size_n = n;
    m.group_size = G;
    m.scale_rows = scale_rows;
    m.scale_perm_size_k = spec.scale_perm_size_k > 0 ? spec.scale_perm_size_k : k;
    m.grouped_scale_perm = G != -1 && G < m.scale_perm_size_k;
    auto e = [&](std::initializer_list<int64_t> dims) { return WithExperts(spec, dims); };
    auto add = [&](ParamKind kind, std::string name, DType dt, Shape loaded, Shape engine) {
      EngineParam q;
      q.name = std::move(name);
      q.role = spec.role;
      q.kind = kind;
      q.dtype = dt;
      q.loaded_shape = std::move(loaded);
      q.engine_shape = std::move(engine);
      q.layer = spec.layer;
      q.linear = lidx;
      q.marlin = m;
      return AddParam(std::move(q));
    };
    if (trtllm) {
      // TensorRT-LLM's names: "X.weight" int8, "X.weight_scale"; the fused MoE FC1 "w3_w1_weight".
      const std::string wname = spec.role == ParamRole::kExpertsW13
                                    ? absl::StrCat(spec.name.substr(0, spec.name.size() - 10), "w3_w1_weight")
                                    : spec.name;
      lin.packed = add(ParamKind::kPacked, wname, DType::kI32, e({k / 8, n}), e({k, n / 2}));
      L_.params_[static_cast<size_t>(lin.packed)].engine_dtype = DType::kI8;
      lin.scale = add(ParamKind::kScale, wname + "_scale", dt_, e({scale_rows, n}), e({scale_rows, n}));
    } else if (awq) {
      lin.packed =
          add(ParamKind::kPacked, AwqParamName(spec.name, "qweight"), DType::kI32, e({k, n / 8}), e({k / 16, 2 * n}));
      lin.zeros = add(ParamKind::kZeros, AwqParamName(spec.name, "qzeros"), DType::kI32, e({scale_rows, n / 8}),
                      e({scale_rows, n / 8}));
      lin.scale =
          add(ParamKind::kScale, AwqParamName(spec.name, "scales"), dt_, e({scale_rows, n}), e({scale_rows, n}));
    } else {
      lin.packed = add(ParamKind::kPacked, absl::StrCat(spec.name, "_packed"), DType::kI32,
                       stacked ? e({k / 8, n}) : Shape{n, k / 8}, e({k / 16, 2 * n}));
      lin.scale = add(ParamKind::kScale, absl::StrCat(spec.name, "_scale"), dt_,
                      stacked ? e({scale_rows, n}) : Shape{n, scale_rows}, e({scale_rows, n}));
    }
  }

  // The compressed-tensors sources of one shard of an INT4 linear (GPTQ / Marlin and TensorRT-LLM
  // layouts): weight_packed and weight_scale as block copies, weight_shape checked; skipped when
  // another rank owns the shard.
  void AddInt4Sources(const Shard& sh, const EngineLinear& lin, bool stacked) {
    const int G = G_;
    const bool trtllm = L_.format_ == Int4Format::kTrtllm;
    const std::string pn = absl::StrCat(sh.hf, ".weight_packed"), sn = absl::StrCat(sh.hf, ".weight_scale"),
                      wn = absl::StrCat(sh.hf, ".weight_shape");
    const Shape pshape = {sh.hf_n, sh.hf_k / 8}, sshape = {sh.hf_n, G > 0 ? sh.hf_k / G : 1};
    if (!sh.owned) {
      AddSkip(pn, DType::kI32, pshape, sh.what);
      AddSkip(sn, dt_, sshape, sh.what);
      AddSkip(wn, DType::kI64, {2}, sh.what);
      return;
    }
    HfSource s;
    s.expert = sh.expert;
    // MoE (§3.3) and TensorRT-LLM: GPTQ orientation [K/8, N] when loaded, so transposed.
    const bool gptq = stacked || trtllm;
    s.transpose = gptq;
    s.src_row0 = sh.r0;
    s.rows = sh.nr;
    s.dst_row0 = gptq ? 0 : sh.dst_n;
    s.dst_col0 = gptq ? sh.dst_n : 0;
    s.what = sh.what;
    HfSource sp = s;
    sp.hf_name = pn;
    sp.dtype = DType::kI32;
    sp.shape = pshape;
    sp.param = lin.packed;
    sp.src_col0 = sh.c0 / 8;
    sp.cols = sh.nc / 8;
    AddSource(std::move(sp));
    HfSource ss = s;
    ss.hf_name = sn;
    ss.dtype = dt_;
    ss.shape = sshape;
    ss.param = lin.scale;
    ss.src_col0 = G > 0 ? sh.c0 / G : 0;  // channelwise: one scale per row, whole on every rank
    ss.cols = G > 0 ? sh.nc / G : 1;
    AddSource(std::move(ss));
    HfSource sw;
    sw.hf_name = wn;
    sw.dtype = DType::kI64;
    sw.shape = {2};
    sw.action = HfSource::Action::kCheckShape;
    sw.shape_values = {sh.hf_n, sh.hf_k};
    sw.what = sh.what;
    AddSource(std::move(sw));
  }

  // The bias [N] of a linear: one param, each shard's rows of "<hf>.bias".
  void AddBias(const LinearSpec& spec, const std::vector<Shard>& shards, const std::string& bias_name) {
    EngineParam b;
    b.name = bias_name;
    b.role = spec.role;
    b.dtype = dt_;
    b.loaded_shape = {spec.n};
    b.engine_shape = {spec.n};
    b.layer = spec.layer;
    const int bidx = AddParam(std::move(b));
    for (const Shard& sh : shards) {
      HfSource s;
      s.hf_name = absl::StrCat(sh.hf, ".bias");
      s.dtype = dt_;
      s.shape = {sh.hf_n};
      s.param = bidx;
      s.src_row0 = sh.r0;
      s.rows = sh.nr;
      s.cols = 1;
      s.dst_row0 = sh.dst_n;
      s.what = absl::StrCat(sh.what, " bias");
      AddSource(std::move(s));
    }
  }

  // The AWQ tensors of one shard (AWQ.md §2): qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N].
  // They are K-major: the shard's rows of W are word columns of qweight / qzeros and columns of
  // scales, its input columns are their rows; copied as blocks, no transpose (dense and MoE alike).
  void AddAwqSources(const Shard& sh, const EngineLinear& lin, int G) {
    const int64_t groups = G > 0 ? sh.hf_k / G : 1;
    const std::string qn = sh.hf + ".qweight", zn = sh.hf + ".qzeros", sn = sh.hf + ".scales";
    const Shape qshape = {sh.hf_k, sh.hf_n / 8}, zshape = {groups, sh.hf_n / 8}, sshape = {groups, sh.hf_n};
    if (!sh.owned) {
      AddSkip(qn, DType::kI32, qshape, sh.what);
      AddSkip(zn, DType::kI32, zshape, sh.what);
      AddSkip(sn, dt_, sshape, sh.what);
      return;
    }
    HfSource s;
    s.expert = sh.expert;
    s.what = sh.what;
    HfSource q = s;
    q.hf_name = qn;
    q.dtype = DType::kI32;
    q.shape = qshape;
    q.param = lin.packed;
    q.src_row0 = sh.c0;
    q.rows = sh.nc;
    q.src_col0 = sh.r0 / 8;
    q.cols = sh.nr / 8;
    q.dst_col0 = sh.dst_n / 8;
    AddSource(std::move(q));
    HfSource z = s;  // channelwise: one group row, whole on every rank
    z.hf_name = zn;
    z.dtype = DType::kI32;
    z.shape = zshape;
    z.param = lin.zeros;
    z.src_row0 = G > 0 ? sh.c0 / G : 0;
    z.rows = G > 0 ? sh.nc / G : 1;
    z.src_col0 = sh.r0 / 8;
    z.cols = sh.nr / 8;
    z.dst_col0 = sh.dst_n / 8;
    HfSource sc = z;
    sc.hf_name = sn;
    sc.dtype = dt_;
    sc.shape = sshape;
    sc.param = lin.scale;
    sc.src_col0 = sh.r0;
    sc.cols = sh.nr;
    sc.dst_col0 = sh.dst_n;
    AddSource(std::move(z));
    AddSource(std::move(sc));
  }

  // Column-parallel shard: rows [r * n/T, +n/T) of an [n, k] HF weight.
  Shard ColShard(const std::string& hf, int64_t n, int64_t k, int64_t dst_n, std::string what) const {
    const int64_t np = n / p_.tp_size;
    return Shard{hf, n, k, p_.tp_rank * np, np, 0, k, dst_n, 0, true, std::move(what)};
  }
  Shard WholeShard(const std::string& hf, int64_t n, int64_t k, int64_t dst_n, std::string what) const {
    return Shard{hf, n, k, 0, n, 0, k, dst_n, 0, true, std::move(what)};
  }

  // Dense or shared-expert MLP: gate_up_proj (merged column) + down_proj (row).
  absl::Status AddDenseMlp(int64_t i, const std::string& module, int64_t F) {
    const int T = p_.tp_size;
    const int64_t H = c_.hidden_size;
    const std::string pre = absl::StrCat(Layer(i), module, ".");
    ASSIGN_OR_RETURN(const bool gu_q, Agree(pre + "gate_up_proj", {pre + "gate_proj.weight", pre + "up_proj.weight"}));
    LinearSpec gu{pre + "gate_up_proj.weight", ParamRole::kGateUp, i, 0, 2 * F / T, H, gu_q};
    // Llama's mlp_bias (decision 9): gate_up_proj's bias is split as its rows, down_proj's is whole
    // on every rank like o_proj's (only the dense MLP: no MoE architecture has one).
    const bool bias = c_.mlp_bias && module == "mlp";
    RETURN_IF_ERROR(AddLinear(
        gu, {ColShard(pre + "gate_proj", F, H, 0, "gate_proj"), ColShard(pre + "up_proj", F, H, F / T, "up_proj")},
        bias ? pre + "gate_up_proj.bias" : ""));
    LinearSpec dn{pre + "down_proj.weight", ParamRole::kRow, i, 0, H, F / T, Int4(pre + "down_proj.weight")};
    RETURN_IF_ERROR(
        AddLinear(dn, {Shard{pre + "down_proj", H, F, 0, H, p_.tp_rank * (F / T), F / T, 0, 0, true, "down_proj"}}));
    if (bias) AddPlain(pre + "down_proj.bias", ParamRole::kRow, dt_, {H}, i, pre + "down_proj.bias");
    return absl::OkStatus();
  }

  absl::Status AddGqaAttention(int64_t i) {
    const int T = p_.tp_size, r = p_.tp_rank;
    const int64_t H = c_.hidden_size, nh = c_.num_attention_heads, nkv = c_.num_key_value_heads, hd = c_.head_dim;
    const int64_t nh_loc = nh / T;
    const int64_t kv_loc = T >= nkv ? 1 : nkv / T;
    const int64_t replicas = T >= nkv ? T / nkv : 1;
    const int64_t s = r / replicas;
    const std::string pre = Layer(i) + "self_attn.";
    ASSIGN_OR_RETURN(const bool qkv_q,
                     Agree(pre + "qkv_proj", {pre + "q_proj.weight", pre + "k_proj.weight", pre + "v_proj.weight"}));
    LinearSpec qkv{pre + "qkv_proj.weight", ParamRole::kQkv, i, 0, (nh_loc + 2 * kv_loc) * hd, H, qkv_q};
    std::vector<Shard> shards = {
        Shard{pre + "q_proj", nh * hd, H, r * nh_loc * hd, nh_loc * hd, 0, H, 0, 0, true, "q_proj"},
        Shard{pre + "k_proj", nkv * hd, H, s * kv_loc * hd, kv_loc * hd, 0, H, nh_loc * hd, 0, true,
              absl::StrCat("k_proj (kv shard ", s, ")")},
        Shard{pre + "v_proj", nkv * hd, H, s * kv_loc * hd, kv_loc * hd, 0, H, (nh_loc + kv_loc) * hd, 0, true,
              absl::StrCat("v_proj (kv shard ", s, ")")}};
    RETURN_IF_ERROR(AddLinear(qkv, shards, c_.qkv_bias ? pre + "qkv_proj.bias" : ""));
    const int64_t K = nh * hd;
    LinearSpec o{pre + "o_proj.weight", ParamRole::kRow, i, 0, H, K / T, Int4(pre + "o_proj.weight")};
    RETURN_IF_ERROR(AddLinear(o, {Shard{pre + "o_proj", H, K, 0, H, r * (K / T), K / T, 0, 0, true, "o_proj"}}));
    // HF Llama / Qwen3 with attention_bias also give o_proj a bias; a RowParallelLinear bias is whole
    // on every rank (Qwen2 and GLM-4.5 have qkv bias only).
    if (c_.o_proj_bias) AddPlain(pre + "o_proj.bias", ParamRole::kRow, dt_, {H}, i, pre + "o_proj.bias");
    if (c_.qk_norm) {
      AddPlain(pre + "q_norm.weight", ParamRole::kReplicated, dt_, {hd}, i, pre + "q_norm.weight");
      AddPlain(pre + "k_norm.weight", ParamRole::kReplicated, dt_, {hd}, i, pre + "k_norm.weight");
    }
    return absl::OkStatus();
  }

  absl::Status AddMlaAttention(int64_t i) {
    const int T = p_.tp_size, r = p_.tp_rank;
    const MlaConfig& a = *c_.mla;
    const int64_t H = c_.hidden_size, nh = c_.num_attention_heads, nl = nh / T;
    const int64_t qd = a.qk_nope_head_dim + a.qk_rope_head_dim, kvd = a.qk_nope_head_dim + a.v_head_dim;
    const int64_t kva = a.kv_lora_rank + a.qk_rope_head_dim;
    const std::string pre = Layer(i) + "self_attn.";
    if (a.q_lora_rank > 0) {
      // INT4: cat(q_a_proj, kv_a_proj_with_mqa) must stay bf16 (§3.1: the two weight_shape [2] become
      // [4]). FP8: the two concatenate, scales too (DeepSeek-V3 ships them FP8), both or neither.
      bool fused_fp8 = false;
      if (Fp8()) {
        ASSIGN_OR_RETURN(fused_fp8, Agree(pre + "fused_qkv_a_proj_with_mqa",
                                          {pre + "q_a_proj.weight", pre + "kv_a_proj_with_mqa.weight"}));
      }
      for (const char* m : {"q_a_proj", "kv_a_proj_with_mqa"}) {
        if (!Fp8() && Int4(absl::StrCat(pre, m, ".weight")))
          return Refuse(absl::StrCat("INT4 ", pre, m,
                                     " refused: with q_lora_rank set SGLang fuses q_a_proj and "
                                     "kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa, which cannot load INT4 "
                                     "(weight_shape [2]+[2] -> [4]); quantization_config.ignore must cover both"));
      }
      LinearSpec f{
          pre + "fused_qkv_a_proj_with_mqa.weight", ParamRole::kFusedQkvA, i, 0, a.q_lora_rank + kva, H, fused_fp8};
      RETURN_IF_ERROR(
          AddLinear(f, {WholeShard(pre + "q_a_proj", a.q_lora_rank, H, 0, "q_a_proj"),
                        WholeShard(pre + "kv_a_proj_with_mqa", kva, H, a.q_lora_rank, "kv_a_proj_with_mqa")}));
      AddPlain(pre + "q_a_layernorm.weight", ParamRole::kReplicated, dt_, {a.q_lora_rank}, i,
               pre + "q_a_layernorm.weight");
      LinearSpec qb{pre + "q_b_proj.weight", ParamRole::kColumn,           i, 0, nl * qd,
                    a.q_lora_rank,           Int4(pre + "q_b_proj.weight")};
      RETURN_IF_ERROR(AddLinear(qb, {ColShard(pre + "q_b_proj", nh * qd, a.q_lora_rank, 0, "q_b_proj")}));
    } else {
      LinearSpec qp{pre + "q_proj.weight", ParamRole::kColumn, i, 0, nl * qd, H, Int4(pre + "q_proj.weight")};
      RETURN_IF_ERROR(AddLinear(qp, {ColShard(pre + "q_proj", nh * qd, H, 0, "q_proj")}));
      LinearSpec kv{pre + "kv_a_proj_with_mqa.weight",      ParamRole::kReplicated, i, 0, kva, H,
                    Int4(pre + "kv_a_proj_with_mqa.weight")};
      RETURN_IF_ERROR(AddLinear(kv, {WholeShard(pre + "kv_a_proj_with_mqa", kva, H, 0, "kv_a_proj_with_mqa")}));
    }
    AddPlain(pre + "kv_a_layernorm.weight", ParamRole::kReplicated, dt_, {a.kv_lora_rank}, i,
             pre + "kv_a_layernorm.weight");
    // (FP8 kv_b_proj is what DeepSeek-V3 ships: post_load_weights dequantizes its blocks.)
    if (!Fp8() && Int4(pre + "kv_b_proj.weight"))
      return Refuse(absl::StrCat("INT4 ", pre,
                                 "kv_b_proj refused: SGLang's post_load_weights derives w_kc / w_vc "
                                 "from a bf16 kv_b_proj.weight and has no compressed-tensors path; "
                                 "quantization_config.ignore must cover it"));
    LinearSpec kvb{pre + "kv_b_proj.weight",
                   ParamRole::kColumn,
                   i,
                   0,
                   nl * kvd,
                   a.kv_lora_rank,
                   Fp8() && Int4(pre + "kv_b_proj.weight")};
    RETURN_IF_ERROR(AddLinear(kvb, {ColShard(pre + "kv_b_proj", nh * kvd, a.kv_lora_rank, 0, "kv_b_proj")}));
    const int64_t K = nh * a.v_head_dim;
    LinearSpec o{pre + "o_proj.weight", ParamRole::kRow, i, 0, H, K / T, Int4(pre + "o_proj.weight")};
    return AddLinear(o, {Shard{pre + "o_proj", H, K, 0, H, r * (K / T), K / T, 0, 0, true, "o_proj"}});
  }

  absl::Status AddMoe(int64_t i) {
    const MoeConfig& m = *c_.moe;
    const int64_t H = c_.hidden_size, E = m.num_experts, I = m.moe_intermediate_size;
    const int64_t Ip = I / L_.moe_tp_size_, t = L_.moe_tp_rank_, E_loc = L_.local_experts_, first = L_.first_expert_;
    const std::string pre = Layer(i) + "mlp.";
    // Router: ReplicatedLinear / MoEGate, never quantized (§3.1).
    if (Int4(pre + "gate.weight"))
      return Refuse(absl::StrCat("INT4 router ", pre,
                                 "gate refused: SGLang builds the MoE router unquantized; "
                                 "quantization_config.ignore must cover it (e.g. \"re:.*mlp\\.gate$\")"));
    RETURN_IF_ERROR(AddLinear(LinearSpec{pre + "gate.weight", ParamRole::kReplicated, i, 0, E, H, false},
                              {WholeShard(pre + "gate", E, H, 0, "router gate")}));
    if (m.HasExpertBias())
      AddPlain(pre + "gate.e_score_correction_bias", ParamRole::kReplicated, DType::kF32, {E}, i,
               pre + "gate.e_score_correction_bias");

    std::vector<std::string> names;
    for (int64_t e = 0; e < E; ++e)
      for (const char* p : {"gate_proj", "up_proj", "down_proj"})
        names.push_back(absl::StrCat(pre, "experts.", e, ".", p, ".weight"));
    ASSIGN_OR_RETURN(const bool q, Agree(pre + "experts", names));
    if (q) {
      const int G = G_;
      const std::string ctx = absl::StrCat("; ", Ctx(), ", moe_tp ", L_.moe_tp_size_);
      if (Ip % 8 != 0)
        return Refuse(absl::StrCat(pre, "experts: INT4 needs I' = I / moe_tp = ", I, " / ", L_.moe_tp_size_, " = ", Ip,
                                   " to be a multiple of 8", ctx));
      if (G > 0 && Ip % G != 0)
        return Refuse(absl::StrCat(pre, "experts: INT4 needs I' = I / moe_tp = ", I, " / ", L_.moe_tp_size_, " = ", Ip,
                                   " to be a multiple of the group size ", G, " (use a larger EP or a smaller T)",
                                   ctx));
      if (G > 0 && H % G != 0) return Refuse(absl::StrCat(pre, "experts: INT4 needs H % G == 0, H = ", H, ", G = ", G));
      if (H % 8 != 0) return Refuse(absl::StrCat(pre, "experts: INT4 needs H % 8 == 0, H = ", H));
      const bool marlin = L_.format_ != Int4Format::kTrtllm;  // TensorRT-LLM's constraints: AddLinear
      if (marlin && (H % 16 != 0 || (2 * Ip) % 64 != 0))
        return Refuse(absl::StrCat(pre, "experts.w13: Marlin repack needs H % 16 == 0 and 2I' % 64 == 0, H = ", H,
                                   ", I' = ", Ip, ctx));
      if (marlin && (Ip % 16 != 0 || H % 64 != 0))
        return Refuse(absl::StrCat(pre, "experts.w2: Marlin repack needs I' % 16 == 0 and H % 64 == 0, I' = ", Ip,
                                   ", H = ", H, ctx));
      const std::string gen = Generic(pre + "experts");
      if (marlin && H % 128 != 0)
        Warn(absl::StrCat(gen, ": advisory (check_moe_marlin_supports_layer): H = ", H, " is not a multiple of 128"));
      const int64_t need = std::max<int64_t>(64, G);
      if (marlin && Ip % need != 0)
        Warn(absl::StrCat(gen, ": advisory (check_moe_marlin_supports_layer): I' = ", Ip,
                          " is not a multiple of max(64, G) = ", need));
    }
    std::vector<Shard> w13, w2;
    for (int64_t e = 0; e < E; ++e) {
      const bool owned = e >= first && e < first + E_loc;
      const int64_t l = owned ? e - first : 0;
      const std::string ex = absl::StrCat(pre, "experts.", e, ".");
      w13.push_back(
          Shard{ex + "gate_proj", I, H, t * Ip, Ip, 0, H, 0, l, owned, absl::StrCat("expert ", e, " gate_proj")});
      w13.push_back(
          Shard{ex + "up_proj", I, H, t * Ip, Ip, 0, H, Ip, l, owned, absl::StrCat("expert ", e, " up_proj")});
      w2.push_back(
          Shard{ex + "down_proj", H, I, 0, H, t * Ip, Ip, 0, l, owned, absl::StrCat("expert ", e, " down_proj")});
    }
    // Scale permutation size_k: SGLang's compressed-tensors MoE passes 4I' for w13 (§4); vLLM's
    // AWQ-Marlin MoE passes I' for both (AWQ.md §4).
    const bool awq = L_.format_ == Int4Format::kAwq;
    LinearSpec s13{pre + "experts.w13_weight", ParamRole::kExpertsW13, i, E_loc, 2 * Ip, H, q, awq ? Ip : 4 * Ip};
    if (q && L_.format_ == Int4Format::kTrtllm) {  // w3_w1: up_proj first (TRTLLM_INT4.md §4)
      for (Shard& sh : w13) sh.dst_n = sh.dst_n == 0 ? Ip : 0;
    }
    RETURN_IF_ERROR(AddLinear(s13, w13));
    // w2 scale permutation: size_k = (I'/G)·G = I' (channelwise: 8, which selects the same single perm).
    LinearSpec s2{pre + "experts.w2_weight", ParamRole::kExpertsW2, i, E_loc, H, Ip, q, Ip};
    RETURN_IF_ERROR(AddLinear(s2, w2));
    if (m.num_shared_experts > 0) RETURN_IF_ERROR(AddDenseMlp(i, "mlp.shared_experts", m.num_shared_experts * I));
    return absl::OkStatus();
  }

  absl::Status AddLayer(int64_t i, bool moe) {
    const int64_t H = c_.hidden_size;
    const std::string pre = Layer(i);
    AddPlain(pre + "input_layernorm.weight", ParamRole::kReplicated, dt_, {H}, i, pre + "input_layernorm.weight");
    RETURN_IF_ERROR(c_.mla ? AddMlaAttention(i) : AddGqaAttention(i));
    AddPlain(pre + "post_attention_layernorm.weight", ParamRole::kReplicated, dt_, {H}, i,
             pre + "post_attention_layernorm.weight");
    if (moe) return AddMoe(i);
    return AddDenseMlp(i, "mlp", c_.intermediate_size);
  }

  // SGLang's NextN draft model (deepseek_nextn.py, glm4_moe_nextn.py; MEGATRON_TO_HF.md §5.7): the
  // checkpoint's MTP layer L = num_hidden_layers as enorm, hnorm, eh_proj (a plain nn.Linear [H, 2H],
  // whole on every rank and never quantized), a decoder layer that is always MoE, sharded and
  // quantized as the target's layers, and shared_head.norm. Its embed_tokens and lm_head are the
  // target's (skipped when sent). Named by the checkpoint's names (README.md decision 20).
  absl::Status AddDraft() {
    if (c_.num_nextn_predict_layers != 1 || !c_.moe)
      return Refuse(absl::StrCat("mtp_draft: SGLang's NextN draft models load exactly one MoE MTP layer; ",
                                 c_.architecture, " declares num_nextn_predict_layers=", c_.num_nextn_predict_layers,
                                 c_.moe ? "" : " and has no MoE layers"));
    const int64_t L = c_.num_hidden_layers, H = c_.hidden_size;
    const std::string pre = Layer(L);
    for (const char* norm : {"enorm.weight", "hnorm.weight"})
      AddPlain(pre + norm, ParamRole::kReplicated, dt_, {H}, L, pre + norm);
    AddPlain(pre + "eh_proj.weight", ParamRole::kReplicated, dt_, {H, 2 * H}, L, pre + "eh_proj.weight");
    RETURN_IF_ERROR(AddLayer(L, /*moe=*/true));
    AddPlain(pre + "shared_head.norm.weight", ParamRole::kReplicated, dt_, {H}, L, pre + "shared_head.norm.weight");
    return absl::OkStatus();
  }

  const ModelConfig& c_;
  const QuantizationConfig* q_;
  EngineParallel p_;
  EngineLayout L_;
  DType dt_ = DType::kBF16;
  int G_ = -1;
  int64_t bn_ = 0, bk_ = 0;  // FP8 block sizes (block form)
  std::set<std::string> warned_;
  std::vector<std::string> warnings_;
};

absl::StatusOr<EngineLayout> EngineLayout::Create(const ModelConfig& config, const QuantizationConfig* quantization,
                                                  EngineParallel parallel) {
  return LayoutBuilder(config, quantization, parallel).Build();
}

int EngineLayout::FindParam(absl::string_view name) const {
  auto it = param_index_.find(name);
  return it == param_index_.end() ? -1 : it->second;
}

int EngineLayout::FindLinear(absl::string_view name) const {
  auto it = linear_index_.find(name);
  return it == linear_index_.end() ? -1 : it->second;
}

KeptBlock KeptBlockOf(const HfSource& s) {
  switch (s.action) {
    case HfSource::Action::kCopy: return {s.src_row0, s.rows, s.src_col0, s.cols};
    case HfSource::Action::kCheckShape: {
      const MatrixDims m = MatrixOf(s.shape);
      return {0, m.rows, 0, m.cols};
    }
    case HfSource::Action::kSkip: break;
  }
  return {};
}

int EngineLayout::FindSource(absl::string_view hf_name) const {
  auto it = source_index_.find(hf_name);
  return it == source_index_.end() ? -1 : it->second;
}

bool EngineLayout::IsIgnoredHfName(absl::string_view hf_name) const {
  if (config_.num_nextn_predict_layers <= 0 || !absl::ConsumePrefix(&hf_name, "model.layers.")) return false;
  const size_t dot = hf_name.find('.');
  int64_t layer = 0;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(hf_name.substr(0, dot), &layer)) return false;
  return layer >= config_.num_hidden_layers && layer < config_.num_hidden_layers + config_.num_nextn_predict_layers;
}

int64_t EngineLayout::TotalBytes(ParamForm form) const {
  int64_t total = 0;
  for (const auto& p : params_) total += NumBytes(p.dtype_in(form), p.shape(form)).value_or(0);
  return total;
}

}  // namespace wsync::engine_model
