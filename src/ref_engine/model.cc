#include "ref_engine/model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/int4.h"
#include "ref_engine/ops.h"
#include "ref_engine/weight_ops.h"

namespace wsync::ref_engine {
namespace {

constexpr int64_t kVocabPadding = 64;

int64_t Pad(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Lowest-index-first ordering of (value desc).
std::vector<int64_t> TopK(const std::vector<float>& v, int64_t k, const std::vector<bool>* allowed = nullptr) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < static_cast<int64_t>(v.size()); ++i)
    if (allowed == nullptr || (*allowed)[static_cast<size_t>(i)]) idx.push_back(i);
  k = std::min<int64_t>(k, static_cast<int64_t>(idx.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
    return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)] ||
           (v[static_cast<size_t>(a)] == v[static_cast<size_t>(b)] && a < b);
  });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

}  // namespace

struct EngineModel::Impl {
  ModelConfig config;
  EngineRank rank;
  RankGeometry g;
  TpCollectives coll;
  RankWeights weights;

  std::string Where() const { return g.Where(); }

  absl::Status AllReduce(std::vector<float>& v) const {
    if (g.T == 1) return absl::OkStatus();
    return coll.all_reduce_sum(absl::MakeSpan(v));
  }

  // ---- forward ---------------------------------------------------------------------------------

  // Per layer: GQA k / v rows [pos, kv_loc * hd]; MLA latent [pos, kv_lora] / roped k_pe [pos, rope].
  struct Cache {
    std::vector<std::vector<float>> a, b;
    int64_t len = 0;
  };

  void GqaAttention(const LayerWeights& L, const float* h, int64_t n, Cache& cache, size_t li, float* out) const {
    const int64_t hd = g.hd, nq = g.nh_loc, nk = g.kv_loc, width = (nq + 2 * nk) * hd, pos0 = cache.len;
    std::vector<float> qkv(static_cast<size_t>(n * width));
    MatMul(h, n, L.qkv, qkv.data());
    std::vector<float>& kc = cache.a[li];
    std::vector<float>& vc = cache.b[li];
    for (int64_t t = 0; t < n; ++t) {
      float* row = qkv.data() + t * width;
      if (!L.qkv_bias.empty())
        for (int64_t j = 0; j < width; ++j) row[j] += L.qkv_bias.f32()[j];
      for (int64_t head = 0; head < nq + nk; ++head) {
        float* x = row + head * hd;
        if (!L.q_norm.empty()) RmsNorm(x, (head < nq ? L.q_norm : L.k_norm).f32(), hd, config.rms_norm_eps, x);
        RopeRotateHalf(x, config.RotaryDim(), pos0 + t, config.rope_theta);  // GLM-4.5: the first half only
      }
      kc.insert(kc.end(), row + nq * hd, row + (nq + nk) * hd);
      vc.insert(vc.end(), row + (nq + nk) * hd, row + width);
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t group = nq / nk;
    std::vector<float> attn(static_cast<size_t>(n * nq * hd), 0.0f), p;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t len = pos0 + t + 1;
      p.resize(static_cast<size_t>(len));
      for (int64_t head = 0; head < nq; ++head) {
        const float* q = qkv.data() + t * width + head * hd;
        const int64_t kvh = head / group;
        for (int64_t j = 0; j < len; ++j)
          p[static_cast<size_t>(j)] = Dot(q, kc.data() + (j * nk + kvh) * hd, hd) * scale;
        Softmax(p.data(), len);
        float* o = attn.data() + (t * nq + head) * hd;
        for (int64_t j = 0; j < len; ++j) Axpy(p[static_cast<size_t>(j)], vc.data() + (j * nk + kvh) * hd, o, hd);
      }
    }
    MatMul(attn.data(), n, L.o, out);
  }

  // MLA in the absorbed-latent form SGLang uses (w_kc / w_vc from kv_b_proj): only the normalized
  // latent and the roped k_pe are cached; k_nope and v are never materialized.
  void MlaAttention(const LayerWeights& L, const float* h, int64_t n, Cache& cache, size_t li, float* out) const {
    const int64_t nl = g.nh / g.T, qd = g.qd, kvd = g.kvd, nope = g.nope, rope = g.rope, kvl = g.kv_lora, vd = g.vd,
                  pos0 = cache.len;
    const int64_t wa = L.qkv_a.rows;
    std::vector<float> a(static_cast<size_t>(n * wa)), q(static_cast<size_t>(n * nl * qd));
    MatMul(h, n, L.qkv_a, a.data());
    if (g.q_lora > 0) {
      std::vector<float> qc(static_cast<size_t>(n * g.q_lora));
      for (int64_t t = 0; t < n; ++t)
        RmsNorm(a.data() + t * wa, L.q_a_norm.f32(), g.q_lora, config.rms_norm_eps, qc.data() + t * g.q_lora);
      MatMul(qc.data(), n, L.q, q.data());
    } else {
      MatMul(h, n, L.q, q.data());
    }
    std::vector<float>& lat = cache.a[li];
    std::vector<float>& kpe = cache.b[li];
    for (int64_t t = 0; t < n; ++t) {
      const float* row = a.data() + t * wa + g.q_lora;
      const size_t at = lat.size();
      lat.resize(at + static_cast<size_t>(kvl));
      RmsNorm(row, L.kv_a_norm.f32(), kvl, config.rms_norm_eps, lat.data() + at);
      const size_t bt = kpe.size();
      kpe.insert(kpe.end(), row + kvl, row + kvl + rope);
      RopeInterleaved(kpe.data() + bt, rope, pos0 + t, config.rope_theta);
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(qd));
    std::vector<float> attn(static_cast<size_t>(n * nl * vd)), qlat(static_cast<size_t>(kvl)),
        olat(static_cast<size_t>(kvl)), p;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t len = pos0 + t + 1;
      p.resize(static_cast<size_t>(len));
      for (int64_t head = 0; head < nl; ++head) {
        float* qh = q.data() + (t * nl + head) * qd;
        RopeInterleaved(qh + nope, rope, pos0 + t, config.rope_theta);
        std::fill(qlat.begin(), qlat.end(), 0.0f);
        for (int64_t i = 0; i < nope; ++i) RowAxpy(L.kv_b, head * kvd + i, qh[i], qlat.data());
        for (int64_t j = 0; j < len; ++j)
          p[static_cast<size_t>(j)] =
              (Dot(qlat.data(), lat.data() + j * kvl, kvl) + Dot(qh + nope, kpe.data() + j * rope, rope)) * scale;
        Softmax(p.data(), len);
        std::fill(olat.begin(), olat.end(), 0.0f);
        for (int64_t j = 0; j < len; ++j) Axpy(p[static_cast<size_t>(j)], lat.data() + j * kvl, olat.data(), kvl);
        float* o = attn.data() + (t * nl + head) * vd;
        for (int64_t i = 0; i < vd; ++i) o[i] = RowDot(L.kv_b, head * kvd + nope + i, olat.data());
      }
    }
    MatMul(attn.data(), n, L.o, out);
  }

  // SiLU-gated MLP of m tokens x [m, H]: gate_up rows [gate (F); up (F)], then down [H, F];
  // y [m, H] = down(silu(gate) * up). gate_up_bias [2F] (Llama's mlp_bias) is added to every token's
  // gate_up output; down_proj's bias is the caller's (a row-parallel bias, added once).
  static void GatedMlp(const float* x, int64_t m, const WeightRef& gate_up, const WeightRef& down, int64_t F,
                       std::vector<float>& gu, std::vector<float>& act, float* y,
                       const WeightRef* gate_up_bias = nullptr) {
    gu.resize(static_cast<size_t>(m * 2 * F));
    act.resize(static_cast<size_t>(m * F));
    MatMul(x, m, gate_up, gu.data());
    if (gate_up_bias != nullptr && !gate_up_bias->empty())
      for (int64_t t = 0; t < m; ++t) Axpy(1.0f, gate_up_bias->f32(), gu.data() + t * 2 * F, 2 * F);
    for (int64_t t = 0; t < m; ++t)
      for (int64_t i = 0; i < F; ++i)
        act[static_cast<size_t>(t * F + i)] =
            Silu(gu[static_cast<size_t>(t * 2 * F + i)]) * gu[static_cast<size_t>(t * 2 * F + F + i)];
    MatMul(act.data(), m, down, y);
  }

  // Routed experts selected for one token: (global expert id, weight).
  std::vector<std::pair<int64_t, float>> Route(const LayerWeights& L, const float* x) const {
    const MoeConfig& m = *config.moe;
    const int64_t E = g.E_routed, k = m.num_experts_per_tok;
    std::vector<float> s(static_cast<size_t>(E));
    MatMul(x, 1, L.router, s.data());
    const bool deepseek = m.deepseek_routing;  // DeepSeek-V3, GLM-4.5
    if (deepseek && m.scoring_func == "sigmoid") {
      for (float& v : s) v = Sigmoid(v);
    } else {
      Softmax(s.data(), E);
    }
    std::vector<int64_t> chosen;
    if (deepseek && m.topk_method != "greedy" && m.n_group > 1) {
      // Group-limited: keep the topk_group best groups, then top-k inside them.
      std::vector<float> choice = s;
      if (m.topk_method == "noaux_tc")
        for (int64_t e = 0; e < E; ++e) choice[static_cast<size_t>(e)] += L.score_bias.f32()[e];
      const int64_t per = E / m.n_group;
      std::vector<float> gscore(static_cast<size_t>(m.n_group));
      for (int64_t gi = 0; gi < m.n_group; ++gi) {
        std::vector<float> grp(choice.begin() + gi * per, choice.begin() + (gi + 1) * per);
        std::sort(grp.begin(), grp.end(), std::greater<float>());
        gscore[static_cast<size_t>(gi)] = m.topk_method == "noaux_tc" ? (per >= 2 ? grp[0] + grp[1] : grp[0]) : grp[0];
      }
      std::vector<bool> allowed(static_cast<size_t>(E), false);
      for (int64_t gi : TopK(gscore, m.topk_group))
        for (int64_t e = gi * per; e < (gi + 1) * per; ++e) allowed[static_cast<size_t>(e)] = true;
      chosen = TopK(choice, k, &allowed);
    } else if (deepseek && m.topk_method == "noaux_tc") {
      std::vector<float> choice = s;
      for (int64_t e = 0; e < E; ++e) choice[static_cast<size_t>(e)] += L.score_bias.f32()[e];
      chosen = TopK(choice, k);
    } else {
      chosen = TopK(s, k);
    }
    std::vector<std::pair<int64_t, float>> out;
    float sum = 0;
    for (int64_t e : chosen) {
      out.emplace_back(e, s[static_cast<size_t>(e)]);
      sum += s[static_cast<size_t>(e)];
    }
    if (m.norm_topk_prob)
      for (auto& [e, wgt] : out) wgt /= sum;
    if (deepseek)
      for (auto& [e, wgt] : out) wgt *= static_cast<float>(m.routed_scaling_factor);
    return out;
  }

  // out [n, H] = the MLP of the n tokens h [n, H]. Every token adds its experts' outputs in
  // routing order (then the fused shared expert, then the shared experts); the expert matmuls
  // run once per expert over all the tokens routed to it.
  void Mlp(const LayerWeights& L, const float* h, int64_t n, float* out) const {
    const int64_t H = g.H;
    std::fill(out, out + n * H, 0.0f);
    std::vector<float> gu, act, y;
    auto add = [&](int64_t t, float scale, const float* src) {
      float* o = out + t * H;
      for (int64_t j = 0; j < H; ++j) o[j] += scale * src[j];
    };
    if (!L.moe) {
      y.resize(static_cast<size_t>(n * H));
      GatedMlp(h, n, L.gate_up, L.down, g.F_loc, gu, act, y.data(), &L.gate_up_bias);
      for (int64_t t = 0; t < n; ++t) add(t, 1.0f, y.data() + t * H);
      if (!L.down_bias.empty() && g.r == 0)  // RowParallelLinear: TP rank 0 adds the bias before the all-reduce
        for (int64_t t = 0; t < n; ++t) add(t, 1.0f, L.down_bias.f32());
      return;
    }
    // (local expert, weight) per token, in the order the token adds them.
    std::vector<std::vector<std::pair<int64_t, float>>> picks(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      auto& pk = picks[static_cast<size_t>(t)];
      auto pick = [&](int64_t global, float wgt) {
        const int64_t l = global - g.first_expert;
        if (l >= 0 && l < g.E_loc) pk.emplace_back(l, wgt);  // otherwise another EP rank holds it
      };
      for (const auto& [e, wgt] : Route(L, h + t * H)) pick(e, wgt);
      if (rank.fused_shared_experts) pick(g.E_routed, 1.0f);
    }
    std::vector<int64_t> base(static_cast<size_t>(n) + 1, 0);
    for (int64_t t = 0; t < n; ++t)
      base[static_cast<size_t>(t) + 1] =
          base[static_cast<size_t>(t)] + static_cast<int64_t>(picks[static_cast<size_t>(t)].size());
    std::vector<std::vector<int64_t>> users(static_cast<size_t>(g.E_loc));  // pick slots per expert
    for (int64_t t = 0; t < n; ++t)
      for (size_t s = 0; s < picks[static_cast<size_t>(t)].size(); ++s)
        users[static_cast<size_t>(picks[static_cast<size_t>(t)][s].first)].push_back(base[static_cast<size_t>(t)] +
                                                                                     static_cast<int64_t>(s));
    std::vector<int64_t> token_of(static_cast<size_t>(base.back()));
    for (int64_t t = 0; t < n; ++t)
      for (int64_t s = base[static_cast<size_t>(t)]; s < base[static_cast<size_t>(t) + 1]; ++s)
        token_of[static_cast<size_t>(s)] = t;
    std::vector<float> results(static_cast<size_t>(base.back() * H)), xs, ys;
    for (int64_t l = 0; l < g.E_loc; ++l) {
      const std::vector<int64_t>& slots = users[static_cast<size_t>(l)];
      if (slots.empty()) continue;
      const int64_t m = static_cast<int64_t>(slots.size());
      xs.resize(static_cast<size_t>(m * H));
      ys.resize(static_cast<size_t>(m * H));
      for (int64_t i = 0; i < m; ++i)
        std::copy_n(h + token_of[static_cast<size_t>(slots[static_cast<size_t>(i)])] * H, H, xs.data() + i * H);
      GatedMlp(xs.data(), m, L.w13.Expert(l, g.E_loc), L.w2.Expert(l, g.E_loc), g.I_loc, gu, act, ys.data());
      for (int64_t i = 0; i < m; ++i)
        std::copy_n(ys.data() + i * H, H, results.data() + slots[static_cast<size_t>(i)] * H);
    }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t s = base[static_cast<size_t>(t)]; s < base[static_cast<size_t>(t) + 1]; ++s)
        add(t, picks[static_cast<size_t>(t)][static_cast<size_t>(s - base[static_cast<size_t>(t)])].second,
            results.data() + s * H);
    if (g.S_loc > 0) {
      y.resize(static_cast<size_t>(n * H));
      GatedMlp(h, n, L.shared_gate_up, L.shared_down, g.S_loc, gu, act, y.data());
      for (int64_t t = 0; t < n; ++t) add(t, 1.0f, y.data() + t * H);
    }
  }

  // Runs tokens at positions cache.len .. cache.len + n - 1; returns the final-normed hidden [n, H].
  absl::StatusOr<std::vector<float>> Forward(const ServedWeights& w, absl::Span<const int32_t> tokens,
                                             Cache& cache) const {
    const int64_t n = static_cast<int64_t>(tokens.size()), H = g.H;
    std::vector<float> x(static_cast<size_t>(n * H), 0.0f), hn(x.size()), part(x.size());
    for (int64_t t = 0; t < n; ++t) {
      const int64_t local = tokens[static_cast<size_t>(t)] - g.r * g.P;
      if (local >= 0 && local < g.P) RowToFloats(w.embed, local, x.data() + t * H);
    }
    RETURN_IF_ERROR(AllReduce(x));
    for (size_t li = 0; li < w.layers.size(); ++li) {
      const LayerWeights& L = w.layers[li];
      for (int64_t t = 0; t < n; ++t)
        RmsNorm(x.data() + t * H, L.in_norm.f32(), H, config.rms_norm_eps, hn.data() + t * H);
      if (config.mla) {
        MlaAttention(L, hn.data(), n, cache, li, part.data());
      } else {
        GqaAttention(L, hn.data(), n, cache, li, part.data());
      }
      if (!L.o_bias.empty() && g.r == 0)
        for (int64_t t = 0; t < n; ++t) Axpy(1.0f, L.o_bias.f32(), part.data() + t * H, H);
      RETURN_IF_ERROR(AllReduce(part));
      for (size_t i = 0; i < x.size(); ++i) x[i] += part[i];
      for (int64_t t = 0; t < n; ++t)
        RmsNorm(x.data() + t * H, L.post_norm.f32(), H, config.rms_norm_eps, hn.data() + t * H);
      Mlp(L, hn.data(), n, part.data());
      RETURN_IF_ERROR(AllReduce(part));
      for (size_t i = 0; i < x.size(); ++i) x[i] += part[i];
    }
    cache.len += n;
    for (int64_t t = 0; t < n; ++t)
      RmsNorm(x.data() + t * H, w.final_norm.f32(), H, config.rms_norm_eps, x.data() + t * H);
    return x;
  }

  // Vocab-parallel lm_head + all-gather: logits [n, V].
  absl::StatusOr<std::vector<float>> Head(const ServedWeights& w, const float* hidden, int64_t n) const {
    const WeightRef& head = config.tie_word_embeddings ? w.embed : w.lm_head;
    std::vector<float> local(static_cast<size_t>(n * g.P));
    MatMul(hidden, n, head, local.data());
    std::vector<float> all;
    if (g.T == 1) {
      all = std::move(local);
    } else {
      all.resize(static_cast<size_t>(g.T * n * g.P));
      RETURN_IF_ERROR(coll.all_gather(absl::MakeConstSpan(local), absl::MakeSpan(all)));
    }
    std::vector<float> logits(static_cast<size_t>(n * g.V));
    for (int64_t rr = 0; rr < g.T; ++rr)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < g.P && rr * g.P + i < g.V; ++i)
          logits[static_cast<size_t>(t * g.V + rr * g.P + i)] = all[static_cast<size_t>((rr * n + t) * g.P + i)];
    return logits;
  }

  absl::Status CheckTokens(absl::Span<const int32_t> tokens, int64_t extra) const {
    if (weights.served() == nullptr)
      return absl::FailedPreconditionError(absl::StrCat(Where(), ": no weights prepared (call Prepare first)"));
    if (tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(Where(), ": empty prompt"));
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] < 0 || tokens[i] >= g.V)
        return absl::InvalidArgumentError(
            absl::StrCat(Where(), ": token ", tokens[i], " at position ", i, " is outside [0, ", g.V, ")"));
    const int64_t total = static_cast<int64_t>(tokens.size()) + extra;
    if (config.max_position_embeddings > 0 && total > config.max_position_embeddings)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": sequence of ", total,
                                                     " tokens exceeds max_position_embeddings ",
                                                     config.max_position_embeddings));
    return absl::OkStatus();
  }

  Cache NewCache() const {
    Cache c;
    c.a.resize(static_cast<size_t>(config.num_hidden_layers));
    c.b.resize(static_cast<size_t>(config.num_hidden_layers));
    return c;
  }
};

EngineModel::EngineModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EngineModel::EngineModel(EngineModel&&) noexcept = default;
EngineModel& EngineModel::operator=(EngineModel&&) noexcept = default;
EngineModel::~EngineModel() = default;

absl::StatusOr<EngineModel> EngineModel::Create(const ModelConfig& config, EngineRank rank, ParamLookup lookup,
                                                TpCollectives collectives, EngineModelOptions options) {
  RankGeometry g;
  g.T = rank.tp_size;
  g.r = rank.tp_rank;
  const std::string where = g.Where();
  auto bad = [&](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(where, ": ", parts...)); };
  const ModelConfig& c = config;
  if (rank.tp_size < 1 || rank.tp_rank < 0 || rank.tp_rank >= rank.tp_size)
    return bad("tp_rank ", rank.tp_rank, " is not in [0, tp_size ", rank.tp_size, ")");
  if (rank.ep_size < 1 || rank.tp_size % rank.ep_size != 0)
    return bad("ep_size ", rank.ep_size, " does not divide tp_size ", rank.tp_size);
  if (!lookup) return bad("no ParamLookup given");
  if (rank.tp_size > 1 && (!collectives.all_reduce_sum || !collectives.all_gather))
    return bad("tp_size ", rank.tp_size, " needs both all_reduce_sum and all_gather collectives");
  if (c.hidden_size <= 0 || c.num_hidden_layers <= 0 || c.vocab_size <= 0 || c.num_attention_heads <= 0)
    return bad("config has non-positive sizes (hidden ", c.hidden_size, ", layers ", c.num_hidden_layers, ", vocab ",
               c.vocab_size, ", heads ", c.num_attention_heads, ")");
  g.ep = rank.ep_size;
  g.moe_tp = g.T / g.ep;
  g.ep_rank = g.r / g.moe_tp;
  g.moe_tp_rank = g.r % g.moe_tp;
  g.H = c.hidden_size;
  g.V = c.vocab_size;
  g.Vp = Pad(g.V, kVocabPadding);
  if (g.Vp % g.T != 0) return bad("padded vocab pad(", g.V, ", 64) = ", g.Vp, " is not divisible by tp_size ", g.T);
  g.P = g.Vp / g.T;
  g.nh = c.num_attention_heads;
  if (g.nh % g.T != 0) return bad("num_attention_heads ", g.nh, " is not divisible by tp_size ", g.T);
  if (c.quantization) {
    if (c.quantization->is_fp8()) {
      RETURN_IF_ERROR(Annotate(c.quantization->CheckFp8Supported(), where));  // block sizes: weights.cc
    } else if (c.quantization->strategy == "channel" || c.quantization->group_size == kernels::kChannelwise) {
      g.group_size = -1;
    } else if (c.quantization->group_size > 0) {
      g.group_size = c.quantization->group_size;
    } else {
      return bad("quantization_config group_size ", c.quantization->group_size, " is not supported");
    }
  }
  if (c.mla) {
    if (c.arch != Architecture::kDeepseekV3) return bad("MLA config on a non-DeepSeek architecture");
    g.q_lora = c.mla->q_lora_rank;
    g.kv_lora = c.mla->kv_lora_rank;
    g.nope = c.mla->qk_nope_head_dim;
    g.rope = c.mla->qk_rope_head_dim;
    g.vd = c.mla->v_head_dim;
    g.qd = g.nope + g.rope;
    g.kvd = g.nope + g.vd;
    if (g.kv_lora <= 0 || g.rope <= 0 || g.rope % 2 != 0 || g.nope < 0 || g.vd <= 0 || g.q_lora < 0)
      return bad("unsupported MLA sizes (kv_lora ", g.kv_lora, ", rope ", g.rope, ", nope ", g.nope, ", v ", g.vd,
                 ", q_lora ", g.q_lora, ")");
  } else {
    g.nkv = c.num_key_value_heads;
    g.hd = c.head_dim;
    if (g.nkv <= 0 || g.hd <= 0 || g.hd % 2 != 0 || g.nh % g.nkv != 0)
      return bad("unsupported attention sizes (heads ", g.nh, ", kv heads ", g.nkv, ", head_dim ", g.hd, ")");
    g.nh_loc = g.nh / g.T;
    if (g.T >= g.nkv) {
      if (g.T % g.nkv != 0) return bad("tp_size ", g.T, " is not a multiple of num_key_value_heads ", g.nkv);
      g.kv_loc = 1;
    } else {
      if (g.nkv % g.T != 0) return bad("num_key_value_heads ", g.nkv, " is not divisible by tp_size ", g.T);
      g.kv_loc = g.nkv / g.T;
    }
  }
  bool any_dense = false, any_moe = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) (c.IsMoeLayer(i) ? any_moe : any_dense) = true;
  if (any_dense) {
    if (c.intermediate_size <= 0 || c.intermediate_size % g.T != 0)
      return bad("intermediate_size ", c.intermediate_size, " is not a positive multiple of tp_size ", g.T);
    g.F_loc = c.intermediate_size / g.T;
  }
  if (g.ep > 1 && !any_moe) return bad("ep_size ", g.ep, " > 1 needs an MoE model");
  if ((c.arch == Architecture::kQwen3Moe || c.arch == Architecture::kDeepseekV3 || c.arch == Architecture::kGlm4Moe) &&
      c.tie_word_embeddings)
    return bad(
        ArchitectureName(c.arch),
        " with tie_word_embeddings: SGLang always builds its own lm_head and never fills it (ENGINE_LAYOUT.md §2.6)");
  if (rank.fused_shared_experts && (!c.moe || !c.moe->deepseek_routing || c.moe->num_shared_experts != 1))
    return bad("fused_shared_experts needs DeepSeek-V3 or GLM-4.5 with n_shared_experts == 1");
  if (rank.fused_shared_experts && !c.moe->norm_topk_prob)
    return absl::UnimplementedError(
        absl::StrCat(where,
                     ": fused_shared_experts with norm_topk_prob false (the fused expert's weight is only 1 when "
                     "SGLang renormalizes)"));
  if (any_moe) {
    const MoeConfig& m = *c.moe;
    g.E_routed = m.num_experts;
    g.E_total = g.E_routed + (rank.fused_shared_experts ? 1 : 0);
    if (g.E_total % g.ep != 0) return bad("number of experts ", g.E_total, " is not divisible by ep_size ", g.ep);
    g.E_loc = g.E_total / g.ep;
    g.first_expert = g.ep_rank * g.E_loc;
    if (m.moe_intermediate_size <= 0 || m.moe_intermediate_size % g.moe_tp != 0)
      return bad("moe_intermediate_size ", m.moe_intermediate_size, " is not divisible by moe_tp_size ", g.moe_tp);
    g.I_loc = m.moe_intermediate_size / g.moe_tp;
    if (m.num_experts_per_tok <= 0 || m.num_experts_per_tok > m.num_experts)
      return bad("num_experts_per_tok ", m.num_experts_per_tok, " is not in [1, ", m.num_experts, "]");
    if (m.deepseek_routing) {
      if (m.scoring_func != "sigmoid" && m.scoring_func != "softmax")
        return absl::UnimplementedError(absl::StrCat(where, ": scoring_func ", m.scoring_func));
      if (m.topk_method != "noaux_tc" && m.topk_method != "greedy" && m.topk_method != "group_limited_greedy")
        return absl::UnimplementedError(absl::StrCat(where, ": topk_method ", m.topk_method));
      if (m.n_group < 1 || m.num_experts % m.n_group != 0 || m.topk_group < 1 || m.topk_group > m.n_group)
        return bad("n_group ", m.n_group, " / topk_group ", m.topk_group, " do not fit ", m.num_experts, " experts");
      if (m.num_shared_experts > 0 && !rank.fused_shared_experts) {
        const int64_t S = m.num_shared_experts * m.moe_intermediate_size;
        if (S % g.T != 0) return bad("shared experts' intermediate size ", S, " is not divisible by tp_size ", g.T);
        g.S_loc = S / g.T;
      }
    }
  }
  RankWeights weights(config, g, std::move(lookup), options.weights, options.prepare_threads);
  return EngineModel(std::unique_ptr<Impl>(new Impl{config, rank, g, std::move(collectives), std::move(weights)}));
}

absl::Status EngineModel::Prepare() { return impl_->weights.Prepare(); }

bool EngineModel::prepared() const { return impl_->weights.served() != nullptr; }
const PrepareStats& EngineModel::last_prepare() const { return impl_->weights.last_prepare(); }

absl::StatusOr<std::vector<float>> EngineModel::Logits(absl::Span<const int32_t> tokens) const {
  RETURN_IF_ERROR(impl_->CheckTokens(tokens, 0));
  Impl::Cache cache = impl_->NewCache();
  const ServedWeights& w = *impl_->weights.served();
  ASSIGN_OR_RETURN(std::vector<float> hidden, impl_->Forward(w, tokens, cache));
  return impl_->Head(w, hidden.data(), static_cast<int64_t>(tokens.size()));
}

absl::StatusOr<std::vector<int32_t>> EngineModel::Generate(absl::Span<const int32_t> prompt, int max_new_tokens,
                                                           const StepHook& before_step) const {
  if (max_new_tokens < 0)
    return absl::InvalidArgumentError(absl::StrCat(impl_->Where(), ": max_new_tokens ", max_new_tokens, " < 0"));
  RETURN_IF_ERROR(impl_->CheckTokens(prompt, max_new_tokens));
  const ServedWeights& w = *impl_->weights.served();
  Impl::Cache cache = impl_->NewCache();
  std::vector<int32_t> out;
  if (max_new_tokens == 0) return out;
  if (before_step) RETURN_IF_ERROR(before_step(0));
  ASSIGN_OR_RETURN(std::vector<float> hidden, impl_->Forward(w, prompt, cache));
  const int64_t H = impl_->g.H;
  const float* last = hidden.data() + (static_cast<int64_t>(prompt.size()) - 1) * H;
  for (int step = 0; step < max_new_tokens; ++step) {
    ASSIGN_OR_RETURN(std::vector<float> logits, impl_->Head(w, last, 1));
    const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    if (step + 1 == max_new_tokens) break;
    if (before_step) RETURN_IF_ERROR(before_step(step + 1));
    ASSIGN_OR_RETURN(hidden, impl_->Forward(w, absl::MakeConstSpan(&next, 1), cache));
    last = hidden.data();
  }
  return out;
}

absl::StatusOr<PreparedWeight> EngineModel::Weight(absl::string_view name) const { return impl_->weights.Weight(name); }

const ModelConfig& EngineModel::config() const { return impl_->config; }
const EngineRank& EngineModel::rank() const { return impl_->rank; }

}  // namespace wsync::ref_engine
