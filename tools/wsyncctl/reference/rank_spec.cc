// The engine rank's params from docs/spec/ENGINE_LAYOUT.md (cited as §n), written without the
// rollout agent's EngineLayout. Where the spec leaves a choice, wsync's engines take the one in
// src/engine_model/README.md "Decisions", and so does this file (each is named below by
// that README's number, "decision n").
#include "tools/wsyncctl/reference/rank_spec.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync::tools::reference::internal {

Shape Int4Spec::packed_shape() const {
  Shape s = trtllm ? Shape{k, n / 2} : Shape{k / 16, 2 * n};
  if (experts > 0) s.insert(s.begin(), experts);
  return s;
}
Shape Int4Spec::scale_shape() const {
  Shape s = {groups, n};
  if (experts > 0) s.insert(s.begin(), experts);
  return s;
}
Shape Int4Spec::zeros_shape() const {
  Shape s = {groups, n / 8};
  if (experts > 0) s.insert(s.begin(), experts);
  return s;
}

namespace {

// How a linear's weight is sharded over the TP ranks (§2).
enum class Role { kReplicated, kColumn, kRow, kQkv, kGateUp, kFusedQkvA };

// One HF weight of a (possibly fused) linear: its name and row count (out_features).
struct Shard {
  std::string hf;    // "model.layers.0.self_attn.q_proj.weight"
  int64_t rows = 0;  // N of this HF tensor
};

struct LinearArgs {
  std::string module;  // engine module: "model.layers.0.self_attn.qkv_proj"
  Role role = Role::kReplicated;
  std::vector<Shard> shards;
  int64_t k = 0;            // HF in_features
  bool bias = false;        // QKV / gate_up bias (same row mapping as the weight)
  std::string bf16_reason;  // non-empty: must stay bf16 (refused if the quantization config covers it)
  bool fp8_ok = false;      // an FP8 config may quantize it despite bf16_reason (an INT4-only limit)
};

class Builder {
 public:
  Builder(const ModelConfig& c, const QuantizationConfig* q, const EngineRank& rank) : c_(c), q_(q), rank_(rank) {}

  absl::StatusOr<RankSpec> Build() {
    RETURN_IF_ERROR(Geometry());
    RETURN_IF_ERROR(Vocab("model.embed_tokens.weight", "model.embed_tokens.weight"));
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) RETURN_IF_ERROR(Layer(i, c_.IsMoeLayer(i)));
    Norm("model.norm.weight", c_.hidden_size);
    if (!c_.tie_word_embeddings) {
      // An INT4 lm_head is refused: SGLang's ParallelLMHead is not a LinearBase (§3.1).
      if (Quantized("lm_head.weight"))
        return absl::InvalidArgumentError(
            "lm_head.weight: the quantization config does not ignore lm_head, but engines never quantize it (§3.1)");
      RETURN_IF_ERROR(Vocab("lm_head.weight", "lm_head.weight"));
    } else {
      // §2.6: only model.embed_tokens exists; a checkpoint's lm_head.weight (a PP > 1 copy) is dropped.
      spec_.hf["lm_head.weight"] = HfInfo{{c_.vocab_size, c_.hidden_size}, c_.dtype, false, false};
    }
    if (rank_.mtp_draft) RETURN_IF_ERROR(Draft());
    spec_.mtp_first = c_.num_hidden_layers;
    spec_.mtp_end = c_.num_hidden_layers + c_.num_nextn_predict_layers;
    return std::move(spec_);
  }

 private:
  static absl::Status Refuse(absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("the engine layout refuses this rank (ENGINE_LAYOUT.md §6): ", what));
  }

  absl::Status Geometry() {
    const int T = rank_.tp_size, r = rank_.tp_rank, EP = rank_.ep_size;
    if (T < 1 || r < 0 || r >= T || EP < 1)
      return absl::InvalidArgumentError(absl::StrCat("engine rank: tp_rank ", r, " of tp_size ", T, ", ep_size ", EP,
                                                     " (want tp_size >= 1, 0 <= tp_rank < tp_size, ep_size >= 1)"));
    if (T % EP != 0) return Refuse(absl::StrCat("ep_size ", EP, " does not divide tp_size ", T));
    if (EP > 1 && !c_.moe) return Refuse(absl::StrCat("ep_size ", EP, " on a model without experts"));  // decision 12
    if (c_.tie_word_embeddings && c_.moe)  // §2.6 (Qwen3-MoE), decision 8 (DeepSeek-V3 alike)
      return Refuse(absl::StrCat(c_.architecture, " with tie_word_embeddings: its lm_head is never filled"));
    moe_tp_ = T / EP;
    moe_tp_rank_ = r % moe_tp_;  // §1: MoE-TP groups are contiguous blocks of T/EP ranks
    ep_rank_ = r / moe_tp_;
    padded_vocab_ = (c_.vocab_size + 63) / 64 * 64;  // §2.6: pad(V, 64), not multiplied by T
    if (padded_vocab_ % T != 0)
      return Refuse(absl::StrCat("padded vocab ", padded_vocab_, " (vocab ", c_.vocab_size, " padded to 64) % tp_size ",
                                 T, " = ", padded_vocab_ % T));
    if (c_.moe) {
      const MoeConfig& m = *c_.moe;
      if (m.num_experts % EP != 0)
        return Refuse(absl::StrCat("num experts ", m.num_experts, " % ep_size ", EP, " = ", m.num_experts % EP));
      if (m.moe_intermediate_size % moe_tp_ != 0)
        return Refuse(absl::StrCat("moe_intermediate_size ", m.moe_intermediate_size, " % moe_tp_size ", moe_tp_, " = ",
                                   m.moe_intermediate_size % moe_tp_));
      local_experts_ = m.num_experts / EP;  // shared-experts fusion is off (decision 1): E_total = n_routed
      first_expert_ = ep_rank_ * local_experts_;
    }
    if (q_ != nullptr) {
      scale_dtype_ = c_.dtype;
      if (scale_dtype_ != DType::kBF16 && scale_dtype_ != DType::kF16)
        return absl::InvalidArgumentError(absl::StrCat("INT4 scales take the model dtype, which is ",
                                                       SafetensorsName(c_.dtype), "; want bf16 or fp16"));
    }
    return absl::OkStatus();
  }

  bool Quantized(const std::string& hf_weight) const { return q_ != nullptr && !q_->IsIgnored(hf_weight); }

  void Known(const std::string& name, Shape shape, bool widen_ok = false) {
    spec_.hf[name] = HfInfo{std::move(shape), widen_ok ? DType::kF32 : c_.dtype, widen_ok, true};
  }

  void AddPlain(PlainSpec p) {
    spec_.params.push_back({p.name, p.dtype, p.shape, "plain"});
    spec_.plain.push_back(std::move(p));
  }

  // A replicated 1-D param (norms, §2.1).
  void Norm(const std::string& name, int64_t n) {
    Known(name, {n});
    PlainSpec p{name, c_.dtype, {n}, 0, n, 1, {}};
    p.blocks.push_back({name, 0, 0, 0, n, 1, 0, 0});
    AddPlain(std::move(p));
  }

  // §2.6: [pad(V,64)/T, H]; rank r holds HF rows [s0, s1), zero rows after them.
  absl::Status Vocab(const std::string& engine, const std::string& hf) {
    const int64_t V = c_.vocab_size, H = c_.hidden_size, P = padded_vocab_ / rank_.tp_size;
    Known(hf, {V, H});
    const int64_t s0 = std::min<int64_t>(rank_.tp_rank * P, V), s1 = std::min<int64_t>((rank_.tp_rank + 1) * P, V);
    PlainSpec p{engine, c_.dtype, {P, H}, 0, P, H, {}};
    if (s1 > s0) p.blocks.push_back({hf, 0, s0, 0, s1 - s0, H, 0, 0});
    AddPlain(std::move(p));
    return absl::OkStatus();
  }

  absl::Status Layer(int64_t i, bool moe) {
    const std::string L = absl::StrCat("model.layers.", i, ".");
    const int64_t H = c_.hidden_size;
    Norm(L + "input_layernorm.weight", H);
    RETURN_IF_ERROR(c_.mla ? MlaAttention(L) : GqaAttention(L));
    Norm(L + "post_attention_layernorm.weight", H);
    if (moe) return Moe(L);
    return DenseMlp(L + "mlp.", c_.intermediate_size, c_.mlp_bias);
  }

  // The NextN draft (EngineRank::mtp_draft): SGLang's DeepseekV3ForCausalLMNextN /
  // Glm4MoeForCausalLMNextN load model.layers.{L} only (one layer, asserted), its enorm, hnorm,
  // eh_proj (an nn.Linear: whole, never quantized) and shared_head.norm as they are, and the rest
  // as a decoder layer that is always sparse (_is_layer_sparse: is_nextn).
  absl::Status Draft() {
    if (c_.num_nextn_predict_layers != 1 || !c_.moe)
      return Refuse(absl::StrCat("an MTP draft needs exactly one MTP layer of an MoE model; the config has ",
                                 c_.num_nextn_predict_layers));
    const int64_t H = c_.hidden_size, n = c_.num_hidden_layers;
    const std::string L = absl::StrCat("model.layers.", n, ".");
    Norm(L + "enorm.weight", H);
    Norm(L + "hnorm.weight", H);
    Known(L + "eh_proj.weight", {H, 2 * H});
    PlainSpec eh{L + "eh_proj.weight", c_.dtype, {H, 2 * H}, 0, H, 2 * H, {}};
    eh.blocks.push_back({L + "eh_proj.weight", 0, 0, 0, H, 2 * H, 0, 0});
    AddPlain(std::move(eh));
    RETURN_IF_ERROR(Layer(n, /*moe=*/true));
    Norm(L + "shared_head.norm.weight", H);
    return absl::OkStatus();
  }

  absl::Status GqaAttention(const std::string& L) {
    const int64_t nh = c_.num_attention_heads, nkv = c_.num_key_value_heads, hd = c_.head_dim, H = c_.hidden_size;
    const std::string A = L + "self_attn.";
    RETURN_IF_ERROR(
        Linear({A + "qkv_proj",
                Role::kQkv,
                {{A + "q_proj.weight", nh * hd}, {A + "k_proj.weight", nkv * hd}, {A + "v_proj.weight", nkv * hd}},
                H,
                c_.qkv_bias,
                ""}));
    RETURN_IF_ERROR(Linear({A + "o_proj", Role::kRow, {{A + "o_proj.weight", H}}, nh * hd, false, ""}));
    // Decision 9: HF builds o_proj with bias=attention_bias (Llama, Qwen3, Qwen3-MoE; Qwen2 and
    // GLM-4.5 have qkv bias only); a RowParallelLinear bias is whole on every rank (§2.5).
    if (c_.o_proj_bias) Norm(A + "o_proj.bias", H);
    if (c_.qk_norm) {
      Norm(A + "q_norm.weight", hd);
      Norm(A + "k_norm.weight", hd);
    }
    return absl::OkStatus();
  }

  absl::Status MlaAttention(const std::string& L) {
    const MlaConfig& a = *c_.mla;
    const int64_t nh = c_.num_attention_heads, H = c_.hidden_size;
    const int64_t qd = a.qk_nope_head_dim + a.qk_rope_head_dim, kvd = a.qk_nope_head_dim + a.v_head_dim;
    const std::string A = L + "self_attn.";
    if (nh % rank_.tp_size != 0)
      return Refuse(absl::StrCat("num_attention_heads ", nh, " % tp_size ", rank_.tp_size, " = ", nh % rank_.tp_size));
    if (a.q_lora_rank > 0) {
      // §3.1: the loader concatenates the two sent tensors; INT4 triplets cannot be (weight_shape).
      RETURN_IF_ERROR(Linear({A + "fused_qkv_a_proj_with_mqa",
                              Role::kFusedQkvA,
                              {{A + "q_a_proj.weight", a.q_lora_rank},
                               {A + "kv_a_proj_with_mqa.weight", a.kv_lora_rank + a.qk_rope_head_dim}},
                              H,
                              false,
                              "q_a_proj and kv_a_proj_with_mqa are fused by the loader (§3.1)",
                              true}));
      Norm(A + "q_a_layernorm.weight", a.q_lora_rank);
      RETURN_IF_ERROR(
          Linear({A + "q_b_proj", Role::kColumn, {{A + "q_b_proj.weight", nh * qd}}, a.q_lora_rank, false, ""}));
    } else {
      RETURN_IF_ERROR(Linear({A + "q_proj", Role::kColumn, {{A + "q_proj.weight", nh * qd}}, H, false, ""}));
      RETURN_IF_ERROR(Linear({A + "kv_a_proj_with_mqa",
                              Role::kReplicated,
                              {{A + "kv_a_proj_with_mqa.weight", a.kv_lora_rank + a.qk_rope_head_dim}},
                              H,
                              false,
                              ""}));
    }
    Norm(A + "kv_a_layernorm.weight", a.kv_lora_rank);
    RETURN_IF_ERROR(Linear({A + "kv_b_proj",
                            Role::kColumn,
                            {{A + "kv_b_proj.weight", nh * kvd}},
                            a.kv_lora_rank,
                            false,
                            "post_load_weights derives w_kc / w_vc from a bf16 kv_b_proj (§3.1)",
                            true}));
    return Linear({A + "o_proj", Role::kRow, {{A + "o_proj.weight", H}}, nh * a.v_head_dim, false, ""});
  }

  // bias: Llama's mlp_bias (decision 9): gate_up's bias takes its row mapping, down_proj's is whole (§2.5).
  absl::Status DenseMlp(const std::string& M, int64_t F, bool bias = false) {
    const int64_t H = c_.hidden_size;
    RETURN_IF_ERROR(Linear(
        {M + "gate_up_proj", Role::kGateUp, {{M + "gate_proj.weight", F}, {M + "up_proj.weight", F}}, H, bias, ""}));
    RETURN_IF_ERROR(Linear({M + "down_proj", Role::kRow, {{M + "down_proj.weight", H}}, F, false, ""}));
    if (bias) Norm(M + "down_proj.bias", H);
    return absl::OkStatus();
  }

  absl::Status Moe(const std::string& L) {
    const MoeConfig& m = *c_.moe;
    const int64_t H = c_.hidden_size, E = m.num_experts, I = m.moe_intermediate_size;
    const std::string M = L + "mlp.";
    // The router: a ReplicatedLinear built with quant_config=None (§3.1), the params dtype (§5).
    RETURN_IF_ERROR(Linear({M + "gate",
                            Role::kReplicated,
                            {{M + "gate.weight", E}},
                            H,
                            false,
                            "the MoE router is built unquantized (§3.1)"}));
    if (m.HasExpertBias()) {
      // §5, §8: a faithful layout holds the fp32 bias (decision 10); the checkpoint may hold it in bf16.
      const std::string b = M + "gate.e_score_correction_bias";
      Known(b, {E}, true);
      PlainSpec p{b, DType::kF32, {E}, 0, E, 1, {}};
      p.blocks.push_back({b, 0, 0, 0, E, 1, 0, 0});
      AddPlain(std::move(p));
    }
    // §2.7 / §3.3. All 3·E expert weights of the layer share one quant method (§3.1).
    std::vector<std::string> gate(E), up(E), down(E);
    int quantized = 0;
    for (int64_t e = 0; e < E; ++e) {
      const std::string X = absl::StrCat(M, "experts.", e, ".");
      gate[e] = X + "gate_proj.weight";
      up[e] = X + "up_proj.weight";
      down[e] = X + "down_proj.weight";
      Known(gate[e], {I, H});
      Known(up[e], {I, H});
      Known(down[e], {H, I});
      quantized += Quantized(gate[e]) + Quantized(up[e]) + Quantized(down[e]);
    }
    if (quantized != 0 && quantized != 3 * E)
      return Refuse(
          absl::StrCat(M, "experts: ", quantized, " of the ", 3 * E,
                       " expert weights are quantized, the others ignored (one FusedMoE has one quant method)"));
    const int64_t Ip = I / moe_tp_, t = moe_tp_rank_, El = local_experts_;
    std::vector<Block> w13, w2;
    for (int64_t l = 0; l < El; ++l) {
      const int64_t e = first_expert_ + l;  // §1: local index e - ep_rank·E_loc
      w13.push_back({gate[e], l, t * Ip, 0, Ip, H, 0, 0});
      w13.push_back({up[e], l, t * Ip, 0, Ip, H, Ip, 0});
      w2.push_back({down[e], l, 0, t * Ip, H, Ip, 0, 0});
    }
    const std::string X = M + "experts.";
    if (quantized != 0 && q_->trtllm()) {
      // TensorRT-LLM's FC1 is w3_w1: up_proj (w3) in the first I' output columns (TRTLLM_INT4.md §4,
      // docs/engine-formats.md decision 6).
      for (Block& b : w13) b.dst_row0 = b.dst_row0 == 0 ? Ip : 0;
    }
    if (quantized == 0) {
      AddPlain(PlainSpec{X + "w13_weight", c_.dtype, {El, 2 * Ip, H}, El, 2 * Ip, H, std::move(w13)});
      AddPlain(PlainSpec{X + "w2_weight", c_.dtype, {El, H, Ip}, El, H, Ip, std::move(w2)});
    } else if (q_->is_fp8()) {
      // FP8.md §4: FusedMoE's checks, then the stacked weights and scales like a dense FP8 linear's.
      if (q_->is_fp8_block() && Ip % q_->block_n != 0)
        return Refuse(absl::StrCat(X, "w13: I' = ", Ip, " is not a multiple of block_n ", q_->block_n, " (FP8.md §4)"));
      if (q_->is_fp8_block() && moe_tp_ > 1 && Ip % q_->block_k != 0)
        return Refuse(absl::StrCat(X, "w2: I' = ", Ip, " is not a multiple of block_k ", q_->block_k, " (FP8.md §4)"));
      RETURN_IF_ERROR(AddFp8(X + "w13_weight", Role::kReplicated, El, 2 * Ip, H, std::move(w13)));
      RETURN_IF_ERROR(AddFp8(X + "w2_weight", Role::kReplicated, El, H, Ip, std::move(w2)));
    } else {
      if (Ip % 8 != 0) return Refuse(absl::StrCat(X, "w2: I' = ", Ip, " is not a multiple of 8 (§3.3)"));
      if (q_->group_size != -1 && Ip % q_->group_size != 0)
        return Refuse(
            absl::StrCat(X, "w2: I' = ", Ip, " is not a multiple of the group size ", q_->group_size, " (§3.3)"));
      // Scale permutation size_k (§4 and AWQ.md §4): SGLang's CT MoE passes 4I' for w13 (read after
      // the repack) and I' for w2; vLLM's AWQ-Marlin MoE passes I' for both.
      const int64_t w13_size_k = q_->is_awq() ? Ip : 4 * Ip;
      RETURN_IF_ERROR(
          AddInt4(X + (q_->trtllm() ? "w3_w1" : "w13"), El, 2 * Ip, H, {H}, w13_size_k, std::move(w13), true));
      RETURN_IF_ERROR(AddInt4(X + "w2", El, H, Ip, {I}, Ip, std::move(w2), true));
    }
    if (m.num_shared_experts > 0)  // decision 1: fusion off
      return DenseMlp(M + "shared_experts.", m.num_shared_experts * I);
    return absl::OkStatus();
  }

  // The rank's blocks of a dense linear (§2.1-§2.5) in the [n, k] matrix of its weight.
  absl::Status DenseBlocks(const LinearArgs& a, std::vector<Block>* blocks, int64_t* n, int64_t* k) {
    const int64_t T = rank_.tp_size, r = rank_.tp_rank, K = a.k;
    *k = K;
    *n = 0;
    switch (a.role) {
      case Role::kReplicated:
      case Role::kFusedQkvA:
        for (const Shard& s : a.shards) {
          blocks->push_back({s.hf, 0, 0, 0, s.rows, K, *n, 0});
          *n += s.rows;
        }
        return absl::OkStatus();
      case Role::kColumn: {
        const Shard& s = a.shards[0];
        if (s.rows % T != 0)
          return Refuse(absl::StrCat(a.module, ": N = ", s.rows, " % tp_size ", T, " = ", s.rows % T));
        const int64_t rows = s.rows / T;  // head-major for MLA (nh % T checked by the caller)
        blocks->push_back({s.hf, 0, r * rows, 0, rows, K, 0, 0});
        *n = rows;
        return absl::OkStatus();
      }
      case Role::kRow: {
        const Shard& s = a.shards[0];
        if (K % T != 0) return Refuse(absl::StrCat(a.module, ": K = ", K, " % tp_size ", T, " = ", K % T));
        blocks->push_back({s.hf, 0, 0, r * (K / T), s.rows, K / T, 0, 0});
        *n = s.rows;
        *k = K / T;
        return absl::OkStatus();
      }
      case Role::kGateUp: {
        const int64_t F = a.shards[0].rows;
        if (F % T != 0)
          return Refuse(absl::StrCat(a.module, ": intermediate size ", F, " % tp_size ", T, " = ", F % T));
        const int64_t Fp = F / T;  // §2.3: gate rows, then up rows
        blocks->push_back({a.shards[0].hf, 0, r * Fp, 0, Fp, K, 0, 0});
        blocks->push_back({a.shards[1].hf, 0, r * Fp, 0, Fp, K, Fp, 0});
        *n = 2 * Fp;
        return absl::OkStatus();
      }
      case Role::kQkv: {
        const int64_t nh = c_.num_attention_heads, nkv = c_.num_key_value_heads, hd = c_.head_dim;
        if (nh % T != 0) return Refuse(absl::StrCat("num_attention_heads ", nh, " % tp_size ", T, " = ", nh % T));
        int64_t kv_loc = 1, replicas = 1;
        if (T >= nkv) {  // §2.4: one kv head per rank, each on T/nkv consecutive ranks
          if (T % nkv != 0) return Refuse(absl::StrCat("tp_size ", T, " % num_key_value_heads ", nkv, " = ", T % nkv));
          replicas = T / nkv;
        } else {
          if (nkv % T != 0) return Refuse(absl::StrCat("num_key_value_heads ", nkv, " % tp_size ", T, " = ", nkv % T));
          kv_loc = nkv / T;
        }
        const int64_t q_rows = nh / T * hd, kv_rows = kv_loc * hd, s = r / replicas;
        blocks->push_back({a.shards[0].hf, 0, r * q_rows, 0, q_rows, K, 0, 0});
        blocks->push_back({a.shards[1].hf, 0, s * kv_rows, 0, kv_rows, K, q_rows, 0});
        blocks->push_back({a.shards[2].hf, 0, s * kv_rows, 0, kv_rows, K, q_rows + kv_rows, 0});
        *n = q_rows + 2 * kv_rows;
        return absl::OkStatus();
      }
    }
    return absl::InternalError("unknown role");
  }

  absl::Status Linear(const LinearArgs& a) {
    int quantized = 0;
    for (const Shard& s : a.shards) {
      Known(s.hf, {s.rows, a.k});
      quantized += Quantized(s.hf);
    }
    if (quantized != 0 && quantized != static_cast<int>(a.shards.size()))
      return Refuse(absl::StrCat(a.module, ": ", quantized, " of its ", a.shards.size(),
                                 " fused shards are quantized, the others ignored (mixed shards, §3.1)"));
    if (quantized != 0 && !a.bf16_reason.empty() && !(q_->is_fp8() && a.fp8_ok))
      return Refuse(absl::StrCat(a.module, " must stay bf16 (", a.bf16_reason,
                                 ") but the quantization config does not ignore ", a.shards[0].hf));
    std::vector<Block> blocks;
    int64_t n = 0, k = 0;
    RETURN_IF_ERROR(DenseBlocks(a, &blocks, &n, &k));
    if (a.bias) {  // §2.4: the bias takes the weight's row mapping
      PlainSpec b{a.module + ".bias", c_.dtype, {n}, 0, n, 1, {}};
      for (const Block& w : blocks) {
        std::string hf = w.hf;
        hf.replace(hf.size() - 6, 6, "bias");  // "*.weight" -> "*.bias"
        Known(hf, {spec_.hf[w.hf].shape[0]});
        b.blocks.push_back({hf, 0, w.src_row0, 0, w.rows, 1, w.dst_row0, 0});
      }
      if (quantized == 0) {
        AddPlain(PlainSpec{a.module + ".weight", c_.dtype, {n, k}, 0, n, k, std::move(blocks)});
        AddPlain(std::move(b));
        return absl::OkStatus();
      }
      if (q_->is_fp8()) {
        RETURN_IF_ERROR(AddFp8(a.module + ".weight", a.role, 0, n, k, std::move(blocks)));
      } else {
        RETURN_IF_ERROR(AddInt4(a.module, 0, n, k, {a.k}, k, std::move(blocks), false));
      }
      AddPlain(std::move(b));
      return absl::OkStatus();
    }
    if (quantized == 0) {
      AddPlain(PlainSpec{a.module + ".weight", c_.dtype, {n, k}, 0, n, k, std::move(blocks)});
      return absl::OkStatus();
    }
    if (q_->is_fp8()) return AddFp8(a.module + ".weight", a.role, 0, n, k, std::move(blocks));
    return AddInt4(a.module, 0, n, k, {a.k}, k, std::move(blocks), false);
  }

  // An FP8 GEMM weight of the rank (FP8.md §4): `weight` F8_E4M3 [(E,) n, k] holding the codes of
  // the checkpoint blocks, and its F32 scales `weight`_scale_inv [(E,) ceil(n/bn), ceil(k/bk)] (the
  // blocks' scales) or `weight`_scale [(E,) n, 1]. Refuses what the engines refuse (a TP-split or
  // merged output partition, a row-parallel K slice, not whole blocks) and any block that would
  // cut an FP8 block.
  absl::Status AddFp8(const std::string& weight, Role role, int64_t experts, int64_t n, int64_t k,
                      std::vector<Block> blocks) {
    const bool block = q_->is_fp8_block();
    const int64_t bn = block ? q_->block_n : 0, bk = block ? q_->block_k : 0;
    const int T = rank_.tp_size;
    if (block) {
      if (role == Role::kRow && T > 1 && k % bk != 0)
        return Refuse(absl::StrCat(weight, ": K_p = ", k, " is not a multiple of block_k ", bk, " (FP8.md §4)"));
      const bool partitions = role == Role::kQkv || role == Role::kGateUp || (role == Role::kColumn && T > 1);
      for (const Block& b : blocks) {
        const Shape& hf = spec_.hf.at(b.hf).shape;
        if (partitions && b.rows % bn != 0)
          return Refuse(absl::StrCat(weight, ": the output partition of ", b.hf, " has ", b.rows,
                                     " rows, not a multiple of block_n ", bn, " (FP8.md §4)"));
        const bool rows_ok =
            b.src_row0 % bn == 0 && b.dst_row0 % bn == 0 && (b.rows % bn == 0 || b.src_row0 + b.rows == hf[0]);
        const bool cols_ok =
            b.src_col0 % bk == 0 && b.dst_col0 % bk == 0 && (b.cols % bk == 0 || b.src_col0 + b.cols == hf[1]);
        if (!rows_ok || !cols_ok)
          return Refuse(absl::StrCat(weight, ": rows ", b.src_row0, "+", b.rows, ", columns ", b.src_col0, "+", b.cols,
                                     " of ", b.hf, " cut its ", bn, "x", bk, " FP8 blocks (FP8.md §4)"));
      }
    }
    auto with_experts = [&](Shape s) {
      if (experts > 0) s.insert(s.begin(), experts);
      return s;
    };
    auto blocks_of = [](int64_t x, int64_t b) { return (x + b - 1) / b; };
    std::vector<Block> codes, scales;
    for (const Block& b : blocks) {
      spec_.fp8[b.hf] = Fp8Source{bn, bk, block && q_->scale_fmt == "ue8m0"};
      Block c = b;
      c.hf = b.hf + "#fp8";
      codes.push_back(c);
      Block s = b;
      s.hf = b.hf + "#scale";
      if (block) {
        s.src_row0 = b.src_row0 / bn;
        s.rows = blocks_of(b.rows, bn);
        s.dst_row0 = b.dst_row0 / bn;
        s.src_col0 = b.src_col0 / bk;
        s.cols = blocks_of(b.cols, bk);
        s.dst_col0 = b.dst_col0 / bk;
      } else {
        s.src_col0 = 0;
        s.cols = 1;
        s.dst_col0 = 0;
      }
      scales.push_back(s);
    }
    const int64_t sn = block ? blocks_of(n, bn) : n, sk = block ? blocks_of(k, bk) : 1;
    PlainSpec w{weight, DType::kF8E4M3, with_experts({n, k}), experts, n, k, std::move(codes)};
    PlainSpec sc{weight + (block ? "_scale_inv" : "_scale"),
                 DType::kF32,
                 with_experts({sn, sk}),
                 experts,
                 sn,
                 sk,
                 std::move(scales)};
    spec_.params.push_back({w.name, w.dtype, w.shape, "fp8 weight"});
    spec_.plain.push_back(std::move(w));
    spec_.params.push_back({sc.name, sc.dtype, sc.shape, "fp8 scales"});
    spec_.plain.push_back(std::move(sc));
    return absl::OkStatus();
  }

  // An INT4 GEMM weight of the rank: §3.2-§4 (compressed-tensors -> Marlin), AWQ.md §3-§4.
  // `hf_k`: the in_features of its HF weights (groups run along the whole HF row).
  absl::Status AddInt4(const std::string& linear, int64_t experts, int64_t n, int64_t k, std::vector<int64_t> hf_k,
                       int64_t scale_perm_size_k, std::vector<Block> blocks, bool moe) {
    const int G = q_->group_size;
    for (int64_t K : hf_k)
      if (G != -1 && K % G != 0)
        return Refuse(absl::StrCat(linear, ": K = ", K, " is not a multiple of the group size ", G));
    if (G != -1 && k % G != 0)
      return Refuse(absl::StrCat(linear, ": K_p = ", k, " is not a multiple of the group size ", G, " (§3.2)"));
    if (k % 8 != 0) return Refuse(absl::StrCat(linear, ": K_p = ", k, " is not a multiple of 8 (§3.2)"));
    if (q_->trtllm()) {
      if (k % 64 != 0 || n % 64 != 0)  // TRTLLM_INT4.md §1 steps 1-3 (K % 32, K % 64, N % 64, K % RPT)
        return Refuse(absl::StrCat(linear, ": TensorRT-LLM needs K % 64 == 0 and N % 64 == 0, got K ", k, ", N ", n,
                                   " (TRTLLM_INT4.md §1)"));
    } else if (k % 16 != 0 || n % 64 != 0) {  // §4 hard constraints of the Marlin repack
      return Refuse(
          absl::StrCat(linear, ": Marlin needs size_k % 16 == 0 and size_n % 64 == 0, got size_k ", k, ", size_n ", n));
    }
    Int4Spec s;
    s.linear = linear;
    s.awq = q_->is_awq();
    // TRTLLM_INT4.md §2: MoE W4A16 runs the sm80 kernels on Hopper too; a dense weight on sm90
    // skips the column interleave.
    if (q_->trtllm()) s.trtllm = q_->engine_layout == "trtllm-sm90" && !moe ? 90 : 80;
    s.scale_dtype = scale_dtype_;
    s.experts = experts;
    s.n = n;
    s.k = k;
    s.group = G;
    s.groups = G == -1 ? 1 : k / G;
    s.grouped_perm = G != -1 && G < scale_perm_size_k;  // FORMATS.md §5, AWQ.md §3.2
    s.blocks = std::move(blocks);
    const std::string sep = moe ? "_" : ".";  // "experts.w13_qweight" / "qkv_proj.qweight"
    if (s.trtllm != 0) {                      // docs/engine-formats.md decision 7: X.weight int8, X.weight_scale
      s.packed_name = linear + (moe ? "_weight" : ".weight");
      s.scale_name = linear + (moe ? "_weight_scale" : ".weight_scale");
    } else if (s.awq) {
      s.packed_name = linear + sep + "qweight";
      s.scale_name = linear + sep + "scales";
      s.zeros_name = linear + sep + "qzeros";
    } else {
      s.packed_name = linear + (moe ? "_weight_packed" : ".weight_packed");
      s.scale_name = linear + (moe ? "_weight_scale" : ".weight_scale");
    }
    spec_.params.push_back({s.packed_name, s.packed_dtype(), s.packed_shape(), "int4 weight"});
    spec_.params.push_back({s.scale_name, s.scale_dtype, s.scale_shape(), "int4 scales"});
    if (s.awq) spec_.params.push_back({s.zeros_name, DType::kI32, s.zeros_shape(), "int4 zero points"});
    spec_.int4.push_back(std::move(s));
    return absl::OkStatus();
  }

  const ModelConfig& c_;
  const QuantizationConfig* q_;
  EngineRank rank_;
  int moe_tp_ = 1, moe_tp_rank_ = 0, ep_rank_ = 0;
  int64_t local_experts_ = 0, first_expert_ = 0, padded_vocab_ = 0;
  DType scale_dtype_ = DType::kBF16;
  RankSpec spec_;
};

}  // namespace

absl::StatusOr<RankSpec> BuildRankSpec(const ModelConfig& config, const QuantizationConfig* quant,
                                       const EngineRank& rank) {
  return Builder(config, quant, rank).Build();
}

}  // namespace wsync::tools::reference::internal
