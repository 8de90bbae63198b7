#include "ref_engine/hf_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "ref_engine/ops.h"

namespace wsync::ref_engine {
namespace {

struct F32 {
  Shape shape;
  std::vector<float> v;
};

using Vec = std::vector<float>;

// y = W x (+ b), W [N, K] row-major.
Vec Apply(const F32& W, const float* x, const F32* b = nullptr) {
  const int64_t N = W.shape[0], K = W.shape[1];
  Vec y(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) y[static_cast<size_t>(i)] = Dot(W.v.data() + i * K, x, K);
  if (b != nullptr)
    for (int64_t i = 0; i < N; ++i) y[static_cast<size_t>(i)] += b->v[static_cast<size_t>(i)];
  return y;
}

Vec Norm(const Vec& x, const F32& w, double eps) {
  Vec y(x.size());
  RmsNorm(x.data(), w.v.data(), static_cast<int64_t>(x.size()), eps, y.data());
  return y;
}

// HF DeepSeek apply_rotary_pos_emb: view(d/2, 2).transpose -> [x0, x2, ..., x1, x3, ...], then
// rotate_half. (The result stays in the de-interleaved order, for q and k alike.)
void DeepseekRope(float* x, int64_t d, int64_t pos, double theta) {
  Vec tmp(static_cast<size_t>(d));
  for (int64_t i = 0; i < d / 2; ++i) {
    tmp[static_cast<size_t>(i)] = x[2 * i];
    tmp[static_cast<size_t>(d / 2 + i)] = x[2 * i + 1];
  }
  RopeRotateHalf(tmp.data(), d, pos, theta);
  std::copy(tmp.begin(), tmp.end(), x);
}

// Indices of the k largest values among those with mask true (descending; ties: lower index).
std::vector<int64_t> LargestK(const Vec& v, int64_t k, const std::vector<char>& mask) {
  std::vector<int64_t> order;
  for (size_t i = 0; i < v.size(); ++i)
    if (mask[i]) order.push_back(static_cast<int64_t>(i));
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)]; });
  if (static_cast<int64_t>(order.size()) > k) order.resize(static_cast<size_t>(k));
  return order;
}

}  // namespace

struct HfReferenceModel::Impl {
  ModelConfig c;
  absl::flat_hash_map<std::string, F32> t;

  const F32& W(const std::string& name) const { return t.at(name); }
  const F32* Maybe(const std::string& name) const {
    auto it = t.find(name);
    return it == t.end() ? nullptr : &it->second;
  }

  absl::Status Need(const ParamLookup& lookup, const std::string& name, Shape shape) {
    absl::StatusOr<TensorView> v = lookup(name);
    if (!v.ok()) {
      if (absl::IsNotFound(v.status()))
        return absl::NotFoundError(absl::StrCat("HfReferenceModel: HF tensor ", name, " not found"));
      return Annotate(v.status(), absl::StrCat("HfReferenceModel: ", name));
    }
    if (v->shape() != shape)
      return absl::InvalidArgumentError(absl::StrCat("HfReferenceModel: HF tensor ", name, " has shape ",
                                                     ShapeToString(v->shape()), ", want ", ShapeToString(shape)));
    F32 f;
    f.shape = std::move(shape);
    f.v.resize(static_cast<size_t>(v->numel()));
    RETURN_IF_ERROR(ReadFloats(*v, f.v.data(), absl::StrCat("HfReferenceModel: HF tensor ", name)));
    t[name] = std::move(f);
    return absl::OkStatus();
  }

  absl::Status Load(const ParamLookup& lookup) {
    const int64_t H = c.hidden_size, V = c.vocab_size;
    RETURN_IF_ERROR(Need(lookup, "model.embed_tokens.weight", {V, H}));
    if (!c.tie_word_embeddings) RETURN_IF_ERROR(Need(lookup, "lm_head.weight", {V, H}));
    RETURN_IF_ERROR(Need(lookup, "model.norm.weight", {H}));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      RETURN_IF_ERROR(Need(lookup, p + "input_layernorm.weight", {H}));
      RETURN_IF_ERROR(Need(lookup, p + "post_attention_layernorm.weight", {H}));
      const std::string a = p + "self_attn.";
      const int64_t nh = c.num_attention_heads;
      if (c.mla) {
        const MlaConfig& m = *c.mla;
        const int64_t qd = m.qk_nope_head_dim + m.qk_rope_head_dim;
        if (m.q_lora_rank > 0) {
          RETURN_IF_ERROR(Need(lookup, a + "q_a_proj.weight", {m.q_lora_rank, H}));
          RETURN_IF_ERROR(Need(lookup, a + "q_a_layernorm.weight", {m.q_lora_rank}));
          RETURN_IF_ERROR(Need(lookup, a + "q_b_proj.weight", {nh * qd, m.q_lora_rank}));
        } else {
          RETURN_IF_ERROR(Need(lookup, a + "q_proj.weight", {nh * qd, H}));
        }
        RETURN_IF_ERROR(Need(lookup, a + "kv_a_proj_with_mqa.weight", {m.kv_lora_rank + m.qk_rope_head_dim, H}));
        RETURN_IF_ERROR(Need(lookup, a + "kv_a_layernorm.weight", {m.kv_lora_rank}));
        RETURN_IF_ERROR(
            Need(lookup, a + "kv_b_proj.weight", {nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank}));
        RETURN_IF_ERROR(Need(lookup, a + "o_proj.weight", {H, nh * m.v_head_dim}));
      } else {
        const int64_t nkv = c.num_key_value_heads, hd = c.head_dim;
        RETURN_IF_ERROR(Need(lookup, a + "q_proj.weight", {nh * hd, H}));
        RETURN_IF_ERROR(Need(lookup, a + "k_proj.weight", {nkv * hd, H}));
        RETURN_IF_ERROR(Need(lookup, a + "v_proj.weight", {nkv * hd, H}));
        RETURN_IF_ERROR(Need(lookup, a + "o_proj.weight", {H, nh * hd}));
        if (c.qkv_bias) {
          RETURN_IF_ERROR(Need(lookup, a + "q_proj.bias", {nh * hd}));
          RETURN_IF_ERROR(Need(lookup, a + "k_proj.bias", {nkv * hd}));
          RETURN_IF_ERROR(Need(lookup, a + "v_proj.bias", {nkv * hd}));
          if (c.o_proj_bias) RETURN_IF_ERROR(Need(lookup, a + "o_proj.bias", {H}));
        }
        if (c.qk_norm) {
          RETURN_IF_ERROR(Need(lookup, a + "q_norm.weight", {hd}));
          RETURN_IF_ERROR(Need(lookup, a + "k_norm.weight", {hd}));
        }
      }
      const std::string m = p + "mlp.";
      auto mlp = [&](const std::string& q, int64_t F) -> absl::Status {
        RETURN_IF_ERROR(Need(lookup, q + "gate_proj.weight", {F, H}));
        RETURN_IF_ERROR(Need(lookup, q + "up_proj.weight", {F, H}));
        return Need(lookup, q + "down_proj.weight", {H, F});
      };
      if (!c.IsMoeLayer(i)) {
        RETURN_IF_ERROR(mlp(m, c.intermediate_size));
        if (c.mlp_bias) {
          RETURN_IF_ERROR(Need(lookup, m + "gate_proj.bias", {c.intermediate_size}));
          RETURN_IF_ERROR(Need(lookup, m + "up_proj.bias", {c.intermediate_size}));
          RETURN_IF_ERROR(Need(lookup, m + "down_proj.bias", {H}));
        }
        continue;
      }
      const MoeConfig& moe = *c.moe;
      RETURN_IF_ERROR(Need(lookup, m + "gate.weight", {moe.num_experts, H}));
      if (moe.HasExpertBias()) RETURN_IF_ERROR(Need(lookup, m + "gate.e_score_correction_bias", {moe.num_experts}));
      for (int64_t e = 0; e < moe.num_experts; ++e)
        RETURN_IF_ERROR(mlp(absl::StrCat(m, "experts.", e, "."), moe.moe_intermediate_size));
      if (moe.num_shared_experts > 0)
        RETURN_IF_ERROR(mlp(m + "shared_experts.", moe.num_shared_experts * moe.moe_intermediate_size));
    }
    return absl::OkStatus();
  }

  Vec SwiGlu(const std::string& q, const Vec& x) const {
    Vec g = Apply(W(q + "gate_proj.weight"), x.data(), Maybe(q + "gate_proj.bias"));
    const Vec u = Apply(W(q + "up_proj.weight"), x.data(), Maybe(q + "up_proj.bias"));
    for (size_t i = 0; i < g.size(); ++i) g[i] = Silu(g[i]) * u[i];
    return Apply(W(q + "down_proj.weight"), g.data(), Maybe(q + "down_proj.bias"));
  }

  // HF Qwen3MoeSparseMoeBlock / DeepseekV3MoE routing: (expert, weight) pairs.
  std::vector<std::pair<int64_t, float>> Router(const std::string& m, const Vec& x) const {
    const MoeConfig& moe = *c.moe;
    const int64_t E = moe.num_experts, k = moe.num_experts_per_tok;
    Vec scores = Apply(W(m + "gate.weight"), x.data());
    std::vector<char> all(static_cast<size_t>(E), 1);
    std::vector<int64_t> idx;
    if (!moe.deepseek_routing) {
      Softmax(scores.data(), E);
      idx = LargestK(scores, k, all);
    } else {
      if (moe.scoring_func == "sigmoid") {
        for (float& s : scores) s = Sigmoid(s);
      } else {
        Softmax(scores.data(), E);
      }
      Vec for_choice = scores;
      const F32* bias = Maybe(m + "gate.e_score_correction_bias");
      if (moe.topk_method == "noaux_tc")
        for (int64_t e = 0; e < E; ++e) for_choice[static_cast<size_t>(e)] += bias->v[static_cast<size_t>(e)];
      std::vector<char> mask = all;
      if (moe.topk_method != "greedy") {
        const int64_t groups = moe.n_group, per = E / groups;
        Vec group_scores(static_cast<size_t>(groups));
        for (int64_t gi = 0; gi < groups; ++gi) {
          Vec members(for_choice.begin() + gi * per, for_choice.begin() + (gi + 1) * per);
          std::sort(members.rbegin(), members.rend());
          group_scores[static_cast<size_t>(gi)] =
              moe.topk_method == "noaux_tc"
                  ? std::accumulate(members.begin(), members.begin() + std::min<int64_t>(2, per), 0.0f)
                  : members[0];
        }
        const std::vector<int64_t> kept =
            LargestK(group_scores, moe.topk_group, std::vector<char>(static_cast<size_t>(groups), 1));
        std::fill(mask.begin(), mask.end(), 0);
        for (int64_t gi : kept)
          for (int64_t e = gi * per; e < (gi + 1) * per; ++e) mask[static_cast<size_t>(e)] = 1;
      }
      idx = LargestK(for_choice, k, mask);
    }
    std::vector<std::pair<int64_t, float>> out;
    float denom = 0;
    for (int64_t e : idx) denom += scores[static_cast<size_t>(e)];
    for (int64_t e : idx) {
      float w = scores[static_cast<size_t>(e)];
      if (moe.norm_topk_prob) w = w / denom;
      if (moe.deepseek_routing) w *= static_cast<float>(moe.routed_scaling_factor);
      out.emplace_back(e, w);
    }
    return out;
  }

  // Attention output (after o_proj) for every position of the normalized inputs x.
  std::vector<Vec> GqaAttention(const std::string& a, const std::vector<Vec>& x) const {
    const int64_t n = static_cast<int64_t>(x.size()), nh = c.num_attention_heads, nkv = c.num_key_value_heads,
                  hd = c.head_dim;
    std::vector<Vec> q(x.size()), k(x.size()), v(x.size());
    for (int64_t s = 0; s < n; ++s) {
      const float* xs = x[static_cast<size_t>(s)].data();
      q[static_cast<size_t>(s)] = Apply(W(a + "q_proj.weight"), xs, Maybe(a + "q_proj.bias"));
      k[static_cast<size_t>(s)] = Apply(W(a + "k_proj.weight"), xs, Maybe(a + "k_proj.bias"));
      v[static_cast<size_t>(s)] = Apply(W(a + "v_proj.weight"), xs, Maybe(a + "v_proj.bias"));
      for (int64_t h = 0; h < nh; ++h) {
        float* qh = q[static_cast<size_t>(s)].data() + h * hd;
        if (c.qk_norm) RmsNorm(qh, W(a + "q_norm.weight").v.data(), hd, c.rms_norm_eps, qh);
        RopeRotateHalf(qh, c.RotaryDim(), s, c.rope_theta);  // Glm4Moe: q[..., :rotary_dim] only
      }
      for (int64_t h = 0; h < nkv; ++h) {
        float* kh = k[static_cast<size_t>(s)].data() + h * hd;
        if (c.qk_norm) RmsNorm(kh, W(a + "k_norm.weight").v.data(), hd, c.rms_norm_eps, kh);
        RopeRotateHalf(kh, c.RotaryDim(), s, c.rope_theta);
      }
    }
    const int64_t rep = nh / nkv;  // repeat_kv
    std::vector<Vec> out(x.size());
    for (int64_t s = 0; s < n; ++s) {
      Vec ctx(static_cast<size_t>(nh * hd), 0.0f);
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kvh = h / rep;
        Vec w(static_cast<size_t>(s + 1));
        for (int64_t j = 0; j <= s; ++j)
          w[static_cast<size_t>(j)] =
              Dot(q[static_cast<size_t>(s)].data() + h * hd, k[static_cast<size_t>(j)].data() + kvh * hd, hd) /
              std::sqrt(static_cast<float>(hd));
        Softmax(w.data(), s + 1);
        for (int64_t j = 0; j <= s; ++j)
          for (int64_t d = 0; d < hd; ++d)
            ctx[static_cast<size_t>(h * hd + d)] +=
                w[static_cast<size_t>(j)] * v[static_cast<size_t>(j)][static_cast<size_t>(kvh * hd + d)];
      }
      out[static_cast<size_t>(s)] = Apply(W(a + "o_proj.weight"), ctx.data(), Maybe(a + "o_proj.bias"));
    }
    return out;
  }

  // HF DeepseekV3Attention (eager): k_nope / v materialized per head from kv_b_proj.
  std::vector<Vec> MlaAttention(const std::string& a, const std::vector<Vec>& x) const {
    const MlaConfig& m = *c.mla;
    const int64_t n = static_cast<int64_t>(x.size()), nh = c.num_attention_heads, nope = m.qk_nope_head_dim,
                  rope = m.qk_rope_head_dim, vd = m.v_head_dim, qd = nope + rope, kvl = m.kv_lora_rank;
    std::vector<Vec> q(x.size()), key(x.size()), val(x.size());
    for (int64_t s = 0; s < n; ++s) {
      const float* xs = x[static_cast<size_t>(s)].data();
      if (m.q_lora_rank > 0) {
        const Vec qa = Norm(Apply(W(a + "q_a_proj.weight"), xs), W(a + "q_a_layernorm.weight"), c.rms_norm_eps);
        q[static_cast<size_t>(s)] = Apply(W(a + "q_b_proj.weight"), qa.data());
      } else {
        q[static_cast<size_t>(s)] = Apply(W(a + "q_proj.weight"), xs);
      }
      const Vec ckv = Apply(W(a + "kv_a_proj_with_mqa.weight"), xs);
      const Vec latent = Norm(Vec(ckv.begin(), ckv.begin() + kvl), W(a + "kv_a_layernorm.weight"), c.rms_norm_eps);
      Vec k_pe(ckv.begin() + kvl, ckv.end());
      DeepseekRope(k_pe.data(), rope, s, c.rope_theta);
      const Vec kv = Apply(W(a + "kv_b_proj.weight"), latent.data());  // [nh, nope + v]
      key[static_cast<size_t>(s)].assign(static_cast<size_t>(nh * qd), 0.0f);
      val[static_cast<size_t>(s)].assign(static_cast<size_t>(nh * vd), 0.0f);
      for (int64_t h = 0; h < nh; ++h) {
        float* kh = key[static_cast<size_t>(s)].data() + h * qd;
        std::copy_n(kv.data() + h * (nope + vd), nope, kh);
        std::copy(k_pe.begin(), k_pe.end(), kh + nope);
        std::copy_n(kv.data() + h * (nope + vd) + nope, vd, val[static_cast<size_t>(s)].data() + h * vd);
        DeepseekRope(q[static_cast<size_t>(s)].data() + h * qd + nope, rope, s, c.rope_theta);
      }
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(qd));
    std::vector<Vec> out(x.size());
    for (int64_t s = 0; s < n; ++s) {
      Vec ctx(static_cast<size_t>(nh * vd), 0.0f);
      for (int64_t h = 0; h < nh; ++h) {
        Vec w(static_cast<size_t>(s + 1));
        for (int64_t j = 0; j <= s; ++j)
          w[static_cast<size_t>(j)] =
              Dot(q[static_cast<size_t>(s)].data() + h * qd, key[static_cast<size_t>(j)].data() + h * qd, qd) * scale;
        Softmax(w.data(), s + 1);
        for (int64_t j = 0; j <= s; ++j)
          for (int64_t d = 0; d < vd; ++d)
            ctx[static_cast<size_t>(h * vd + d)] +=
                w[static_cast<size_t>(j)] * val[static_cast<size_t>(j)][static_cast<size_t>(h * vd + d)];
      }
      out[static_cast<size_t>(s)] = Apply(W(a + "o_proj.weight"), ctx.data());
    }
    return out;
  }

  absl::Status Check(absl::Span<const int32_t> tokens) const {
    if (tokens.empty()) return absl::InvalidArgumentError("HfReferenceModel: empty prompt");
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
        return absl::InvalidArgumentError(absl::StrCat("HfReferenceModel: token ", tokens[i], " at position ", i,
                                                       " is outside [0, ", c.vocab_size, ")"));
    return absl::OkStatus();
  }

  std::vector<float> Run(absl::Span<const int32_t> tokens) const {
    const int64_t H = c.hidden_size, V = c.vocab_size;
    const F32& emb = W("model.embed_tokens.weight");
    std::vector<Vec> hs;
    for (int32_t tok : tokens) hs.emplace_back(emb.v.begin() + tok * H, emb.v.begin() + (tok + 1) * H);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      std::vector<Vec> normed;
      for (const Vec& h : hs) normed.push_back(Norm(h, W(p + "input_layernorm.weight"), c.rms_norm_eps));
      const std::vector<Vec> att =
          c.mla ? MlaAttention(p + "self_attn.", normed) : GqaAttention(p + "self_attn.", normed);
      for (size_t s = 0; s < hs.size(); ++s)
        for (int64_t d = 0; d < H; ++d) hs[s][static_cast<size_t>(d)] += att[s][static_cast<size_t>(d)];
      for (size_t s = 0; s < hs.size(); ++s) {
        const Vec x = Norm(hs[s], W(p + "post_attention_layernorm.weight"), c.rms_norm_eps);
        const std::string m = p + "mlp.";
        Vec y(static_cast<size_t>(H), 0.0f);
        if (!c.IsMoeLayer(i)) {
          y = SwiGlu(m, x);
        } else {
          for (const auto& [e, w] : Router(m, x)) {
            const Vec ye = SwiGlu(absl::StrCat(m, "experts.", e, "."), x);
            for (int64_t d = 0; d < H; ++d) y[static_cast<size_t>(d)] += w * ye[static_cast<size_t>(d)];
          }
          if (c.moe->num_shared_experts > 0) {
            const Vec sh = SwiGlu(m + "shared_experts.", x);
            for (int64_t d = 0; d < H; ++d) y[static_cast<size_t>(d)] += sh[static_cast<size_t>(d)];
          }
        }
        for (int64_t d = 0; d < H; ++d) hs[s][static_cast<size_t>(d)] += y[static_cast<size_t>(d)];
      }
    }
    const F32& head = c.tie_word_embeddings ? emb : W("lm_head.weight");
    std::vector<float> logits;
    logits.reserve(hs.size() * static_cast<size_t>(V));
    for (const Vec& h : hs) {
      const Vec fin = Norm(h, W("model.norm.weight"), c.rms_norm_eps);
      const Vec l = Apply(head, fin.data());
      logits.insert(logits.end(), l.begin(), l.end());
    }
    return logits;
  }
};

HfReferenceModel::HfReferenceModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfReferenceModel::HfReferenceModel(HfReferenceModel&&) noexcept = default;
HfReferenceModel& HfReferenceModel::operator=(HfReferenceModel&&) noexcept = default;
HfReferenceModel::~HfReferenceModel() = default;

absl::StatusOr<HfReferenceModel> HfReferenceModel::Create(const ModelConfig& config, const ParamLookup& hf_lookup) {
  if (config.hidden_size <= 0 || config.num_hidden_layers <= 0 || config.vocab_size <= 0 ||
      config.num_attention_heads <= 0)
    return absl::InvalidArgumentError("HfReferenceModel: config has non-positive sizes");
  if (config.mla) {
    if (config.mla->kv_lora_rank <= 0 || config.mla->qk_rope_head_dim % 2 != 0)
      return absl::InvalidArgumentError("HfReferenceModel: unsupported MLA sizes");
  } else if (config.num_key_value_heads <= 0 || config.num_attention_heads % config.num_key_value_heads != 0 ||
             config.head_dim <= 0 || config.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("HfReferenceModel: unsupported attention sizes (heads ",
                                                   config.num_attention_heads, ", kv heads ",
                                                   config.num_key_value_heads, ", head_dim ", config.head_dim, ")"));
  }
  if (config.moe && config.moe->deepseek_routing) {
    const MoeConfig& m = *config.moe;
    if (m.topk_method != "noaux_tc" && m.topk_method != "greedy" && m.topk_method != "group_limited_greedy")
      return absl::UnimplementedError(absl::StrCat("HfReferenceModel: topk_method ", m.topk_method));
    if (m.n_group < 1 || m.num_experts % m.n_group != 0 || m.topk_group < 1 || m.topk_group > m.n_group)
      return absl::InvalidArgumentError("HfReferenceModel: n_group / topk_group do not fit the experts");
  }
  auto impl = std::make_unique<Impl>();
  impl->c = config;
  RETURN_IF_ERROR(impl->Load(hf_lookup));
  return HfReferenceModel(std::move(impl));
}

absl::StatusOr<std::vector<float>> HfReferenceModel::Logits(absl::Span<const int32_t> tokens) const {
  RETURN_IF_ERROR(impl_->Check(tokens));
  return impl_->Run(tokens);
}

absl::StatusOr<std::vector<int32_t>> HfReferenceModel::Generate(absl::Span<const int32_t> prompt,
                                                                int max_new_tokens) const {
  if (max_new_tokens < 0)
    return absl::InvalidArgumentError(absl::StrCat("HfReferenceModel: max_new_tokens ", max_new_tokens, " < 0"));
  RETURN_IF_ERROR(impl_->Check(prompt));
  std::vector<int32_t> seq(prompt.begin(), prompt.end()), out;
  const int64_t V = impl_->c.vocab_size;
  for (int i = 0; i < max_new_tokens; ++i) {
    const std::vector<float> logits = impl_->Run(seq);
    const float* last = logits.data() + (static_cast<int64_t>(seq.size()) - 1) * V;
    int32_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (last[v] > last[best]) best = static_cast<int32_t>(v);
    out.push_back(best);
    seq.push_back(best);
  }
  return out;
}

}  // namespace wsync::ref_engine
