#include "rollout_agent/engine/testing_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/int4.h"

namespace wsync::engine::testing {
namespace {

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "testing_util: %s: %s\n", what, v.status().ToString().c_str());
    std::abort();
  }
  return *std::move(v);
}

Tensor New(DType dt, Shape shape) { return Must(Tensor::Zeros(dt, std::move(shape)), "Tensor::Zeros"); }

int64_t RowBytes(const Tensor& t) {
  int64_t n = static_cast<int64_t>(ItemSize(t.dtype()));
  for (size_t i = 1; i < t.shape().size(); ++i) n *= t.shape()[i];
  return n;
}

// Rows [a, b) along dim 0 (any rank).
Tensor Rows(const Tensor& t, int64_t a, int64_t b) {
  Shape s = t.shape();
  s[0] = b - a;
  Tensor out = New(t.dtype(), s);
  const int64_t rb = RowBytes(t);
  if (b > a)
    std::memcpy(out.mutable_view().bytes().data(), t.view().bytes().data() + a * rb, static_cast<size_t>((b - a) * rb));
  return out;
}

// Columns [a, b) of a 2-D tensor.
Tensor Cols(const Tensor& t, int64_t a, int64_t b) {
  const int64_t n = t.shape()[0], k = t.shape()[1], item = static_cast<int64_t>(ItemSize(t.dtype()));
  Tensor out = New(t.dtype(), {n, b - a});
  std::byte* dst = out.mutable_view().bytes().data();
  const std::byte* src = t.view().bytes().data();
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * (b - a) * item, src + (i * k + a) * item, static_cast<size_t>((b - a) * item));
  return out;
}

Tensor CatRows(const std::vector<const Tensor*>& parts) {
  Shape s = parts[0]->shape();
  s[0] = 0;
  for (const Tensor* p : parts) s[0] += p->shape()[0];
  Tensor out = New(parts[0]->dtype(), s);
  std::byte* dst = out.mutable_view().bytes().data();
  for (const Tensor* p : parts) {
    std::memcpy(dst, p->view().bytes().data(), p->nbytes());
    dst += p->nbytes();
  }
  return out;
}

Tensor Stack(const std::vector<Tensor>& parts) {
  Shape s = parts[0].shape();
  s.insert(s.begin(), static_cast<int64_t>(parts.size()));
  Tensor out = New(parts[0].dtype(), s);
  std::byte* dst = out.mutable_view().bytes().data();
  for (const Tensor& p : parts) {
    std::memcpy(dst, p.view().bytes().data(), p.nbytes());
    dst += p.nbytes();
  }
  return out;
}

Tensor Transpose(const Tensor& t) {
  const int64_t n = t.shape()[0], k = t.shape()[1], item = static_cast<int64_t>(ItemSize(t.dtype()));
  Tensor out = New(t.dtype(), {k, n});
  std::byte* dst = out.mutable_view().bytes().data();
  const std::byte* src = t.view().bytes().data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) std::memcpy(dst + (j * n + i) * item, src + (i * k + j) * item, static_cast<size_t>(item));
  return out;
}

Tensor PadRows(const Tensor& t, int64_t rows) {
  Shape s = t.shape();
  s[0] = rows;
  Tensor out = New(t.dtype(), s);
  std::memcpy(out.mutable_view().bytes().data(), t.view().bytes().data(), t.nbytes());
  return out;
}

Tensor Copy(const Tensor& t) { return Must(Tensor::CopyOf(t.view()), "Tensor::CopyOf"); }

// A linear as sent: bf16 `w` [N, K], or compressed-tensors `packed` [N, K/8] + `scale` [N, K/G].
struct Lin {
  bool int4 = false;
  Tensor w, packed, scale;
};

absl::StatusOr<Lin> GetLin(const TensorMap& sent, const std::string& prefix) {
  Lin l;
  if (sent.Has(prefix + ".weight_packed")) {
    l.int4 = true;
    l.packed = Copy(sent.At(prefix + ".weight_packed"));
    l.scale = Copy(sent.At(prefix + ".weight_scale"));
    return l;
  }
  if (!sent.Has(prefix + ".weight")) return absl::NotFoundError(absl::StrCat("slicer: no HF tensor ", prefix, ".weight"));
  l.w = Copy(sent.At(prefix + ".weight"));
  return l;
}

Lin ColSlice(const Lin& l, int64_t a, int64_t b) {
  Lin o;
  o.int4 = l.int4;
  if (l.int4) {
    o.packed = Rows(l.packed, a, b);
    o.scale = Rows(l.scale, a, b);
  } else {
    o.w = Rows(l.w, a, b);
  }
  return o;
}

// K range [a, b): packed narrows in words of 8, scales in groups (channelwise: whole).
Lin RowSlice(const Lin& l, int64_t a, int64_t b, int G) {
  Lin o;
  o.int4 = l.int4;
  if (l.int4) {
    o.packed = Cols(l.packed, a / 8, b / 8);
    o.scale = G == -1 ? Copy(l.scale) : Cols(l.scale, a / G, b / G);
  } else {
    o.w = Cols(l.w, a, b);
  }
  return o;
}

absl::StatusOr<Lin> Fuse(const std::vector<const Lin*>& parts, const std::string& what) {
  Lin o;
  o.int4 = parts[0]->int4;
  std::vector<const Tensor*> a, b;
  for (const Lin* p : parts) {
    if (p->int4 != o.int4) return absl::InvalidArgumentError(absl::StrCat("slicer: mixed INT4/bf16 shards in ", what));
    a.push_back(p->int4 ? &p->packed : &p->w);
    b.push_back(&p->scale);
  }
  if (o.int4) {
    o.packed = CatRows(a);
    o.scale = CatRows(b);
  } else {
    o.w = CatRows(a);
  }
  return o;
}

absl::Status Emit(TensorMap& out, const std::string& prefix, const Lin& l, int G) {
  if (!l.int4) {
    out.Put(prefix + ".weight", Copy(l.w));
    return absl::OkStatus();
  }
  const Tensor gptq = Transpose(l.packed);  // [K/8, N]
  const int64_t K = gptq.shape()[0] * 8;
  WSYNC_ASSIGN_OR_RETURN(Shape ms, kernels::MarlinShapeFor(gptq.shape()));
  Tensor marlin = New(DType::kI32, ms);
  kernels::KernelOptions opts;
  opts.num_threads = 1;
  WSYNC_RETURN_IF_ERROR(kernels::GptqToMarlin(gptq.view(), nullptr, marlin.mutable_view(), opts));
  const Tensor st = Transpose(l.scale);  // [K/G, N]
  Tensor sp = New(st.dtype(), st.shape());
  WSYNC_RETURN_IF_ERROR(kernels::PermuteMarlinScales(st.view(), K, G, sp.mutable_view(), opts));
  out.Put(prefix + ".weight_packed", std::move(marlin));
  out.Put(prefix + ".weight_scale", std::move(sp));
  return absl::OkStatus();
}

// FORMATS.md §5 per row, written from the spec: grouped out[64b + 8i + j] = in[64b + i + 8j];
// single out[32b + 8i + j] = in[32b + 2i + (0,1,8,9,16,17,24,25)[j]].
void PermuteScaleColumns(Tensor& t, bool grouped) {
  const int64_t n = t.shape().back(), rows = t.view().numel() / n;
  uint16_t* p = t.data_as<uint16_t>();
  std::vector<uint16_t> row(static_cast<size_t>(n));
  static constexpr int kSingle[8] = {0, 1, 8, 9, 16, 17, 24, 25};
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(p + r * n, n, row.begin());
    const int64_t w = grouped ? 64 : 32;
    for (int64_t b = 0; b < n; b += w)
      for (int i = 0; i < w / 8; ++i)
        for (int j = 0; j < 8; ++j)
          p[r * n + b + 8 * i + j] = row[static_cast<size_t>(b + (grouped ? i + 8 * j : 2 * i + kSingle[j]))];
  }
}

int GroupOf(const ModelConfig& c) {
  if (!c.quantization) return -1;
  if (c.quantization->strategy == "channel" || c.quantization->group_size <= 0) return -1;
  return c.quantization->group_size;
}

}  // namespace

ParamLookup TensorMap::Lookup() const {
  return [this](absl::string_view name) -> absl::StatusOr<TensorView> {
    auto it = map_.find(std::string(name));
    if (it == map_.end()) return absl::NotFoundError(absl::StrCat("no tensor ", name));
    return it->second.view();
  };
}

std::vector<std::pair<std::string, Shape>> HfTensorShapes(const ModelConfig& c) {
  std::vector<std::pair<std::string, Shape>> out;
  const int64_t H = c.hidden_size, V = c.vocab_size, nh = c.num_attention_heads;
  out.push_back({"model.embed_tokens.weight", {V, H}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {V, H}});
  out.push_back({"model.norm.weight", {H}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, "."), a = p + "self_attn.", m = p + "mlp.";
    out.push_back({p + "input_layernorm.weight", {H}});
    out.push_back({p + "post_attention_layernorm.weight", {H}});
    if (c.mla) {
      const MlaConfig& l = *c.mla;
      const int64_t qd = l.qk_nope_head_dim + l.qk_rope_head_dim;
      if (l.q_lora_rank > 0) {
        out.push_back({a + "q_a_proj.weight", {l.q_lora_rank, H}});
        out.push_back({a + "q_a_layernorm.weight", {l.q_lora_rank}});
        out.push_back({a + "q_b_proj.weight", {nh * qd, l.q_lora_rank}});
      } else {
        out.push_back({a + "q_proj.weight", {nh * qd, H}});
      }
      out.push_back({a + "kv_a_proj_with_mqa.weight", {l.kv_lora_rank + l.qk_rope_head_dim, H}});
      out.push_back({a + "kv_a_layernorm.weight", {l.kv_lora_rank}});
      out.push_back({a + "kv_b_proj.weight", {nh * (l.qk_nope_head_dim + l.v_head_dim), l.kv_lora_rank}});
      out.push_back({a + "o_proj.weight", {H, nh * l.v_head_dim}});
    } else {
      const int64_t nkv = c.num_key_value_heads, hd = c.head_dim;
      out.push_back({a + "q_proj.weight", {nh * hd, H}});
      out.push_back({a + "k_proj.weight", {nkv * hd, H}});
      out.push_back({a + "v_proj.weight", {nkv * hd, H}});
      out.push_back({a + "o_proj.weight", {H, nh * hd}});
      if (c.qkv_bias) {
        out.push_back({a + "q_proj.bias", {nh * hd}});
        out.push_back({a + "k_proj.bias", {nkv * hd}});
        out.push_back({a + "v_proj.bias", {nkv * hd}});
        if (c.arch != Architecture::kQwen2) out.push_back({a + "o_proj.bias", {H}});
      }
      if (c.qk_norm) {
        out.push_back({a + "q_norm.weight", {hd}});
        out.push_back({a + "k_norm.weight", {hd}});
      }
    }
    auto mlp = [&](const std::string& q, int64_t F) {
      out.push_back({q + "gate_proj.weight", {F, H}});
      out.push_back({q + "up_proj.weight", {F, H}});
      out.push_back({q + "down_proj.weight", {H, F}});
    };
    if (!c.IsMoeLayer(i)) {
      mlp(m, c.intermediate_size);
      continue;
    }
    const MoeConfig& e = *c.moe;
    out.push_back({m + "gate.weight", {e.num_experts, H}});
    if (c.arch == Architecture::kDeepseekV3 && e.topk_method == "noaux_tc")
      out.push_back({m + "gate.e_score_correction_bias", {e.num_experts}});
    for (int64_t x = 0; x < e.num_experts; ++x) mlp(absl::StrCat(m, "experts.", x, "."), e.moe_intermediate_size);
    if (c.arch == Architecture::kDeepseekV3 && e.num_shared_experts > 0)
      mlp(m + "shared_experts.", e.num_shared_experts * e.moe_intermediate_size);
  }
  return out;
}

TensorMap RandomHfModel(const ModelConfig& c, uint64_t seed) {
  TensorMap out;
  std::mt19937_64 rng(seed);
  for (const auto& [name, shape] : HfTensorShapes(c)) {
    double mean = 0, stddev;
    DType dt = DType::kBF16;
    if (absl::EndsWith(name, "e_score_correction_bias")) {
      stddev = 0.05;
      dt = DType::kF32;
    } else if (absl::EndsWith(name, "norm.weight")) {
      mean = 1.0;
      stddev = 0.1;
    } else if (absl::EndsWith(name, ".bias")) {
      stddev = 0.1;
    } else if (absl::StrContains(name, "embed_tokens")) {
      // Tied: keep the embedding small so that the logits are not dominated by the last token's
      // own embedding (greedy decoding would just repeat it).
      stddev = c.tie_word_embeddings ? 1.0 / std::sqrt(static_cast<double>(shape[1])) : 1.0;
    } else {
      stddev = 1.0 / std::sqrt(static_cast<double>(shape[1]));
    }
    std::normal_distribution<double> dist(mean, stddev);
    Tensor t = New(dt, shape);
    const int64_t n = t.view().numel();
    for (int64_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(dist(rng));
      if (dt == DType::kF32) {
        t.data_as<float>()[i] = v;
      } else {
        t.data_as<uint16_t>()[i] = F32ToBF16(v);
      }
    }
    out.Put(name, std::move(t));
  }
  return out;
}

absl::StatusOr<QuantizedHf> QuantizeHf(const ModelConfig& c, const TensorMap& hf) {
  if (!c.quantization) return absl::InvalidArgumentError("QuantizeHf: config has no quantization_config");
  const int G = GroupOf(c);
  QuantizedHf q;
  for (const auto& [name, t] : hf.all()) {
    const bool quantize = absl::EndsWith(name, ".weight") && t.shape().size() == 2 && !c.quantization->IsIgnored(name);
    if (!quantize) {
      q.sent.Put(name, Copy(t));
      q.dequantized.Put(name, Copy(t));
      continue;
    }
    kernels::QuantizeOptions opts;
    opts.group_size = G;
    opts.format = kernels::PackFormat::kCompressedTensors;
    opts.num_threads = 1;
    WSYNC_ASSIGN_OR_RETURN(kernels::QuantizedShapes shapes, kernels::QuantizedShapesFor(t.view(), G, opts.format));
    Tensor packed = New(DType::kI32, shapes.packed), scales = New(t.dtype(), shapes.scales);
    WSYNC_RETURN_IF_ERROR(kernels::QuantizeInt4(t.view(), packed.mutable_view(), scales.mutable_view(), opts));
    // Dequantize (FORMATS.md §2): W[n, k] = (u - 8) * scale[n, k / G], rounded to bf16.
    const int64_t N = t.shape()[0], K = t.shape()[1], Gc = G == -1 ? K : G;
    Tensor deq = New(DType::kBF16, t.shape());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t word = packed.data_as<uint32_t>()[n * (K / 8) + k / 8];
        const int u = static_cast<int>((word >> (4 * (k % 8))) & 0xFu);
        const float s = BF16ToF32(scales.data_as<uint16_t>()[n * (K / Gc) + k / Gc]);
        deq.data_as<uint16_t>()[n * K + k] = F32ToBF16(static_cast<float>(u - 8) * s);
      }
    const std::string prefix = name.substr(0, name.size() - 7);
    q.sent.Put(prefix + ".weight_packed", std::move(packed));
    q.sent.Put(prefix + ".weight_scale", std::move(scales));
    q.dequantized.Put(name, std::move(deq));
  }
  return q;
}

absl::StatusOr<TensorMap> SliceForRank(const ModelConfig& c, const EngineRank& rank, const TensorMap& sent) {
  TensorMap out;
  const int64_t T = rank.tp_size, r = rank.tp_rank, EP = rank.ep_size, moe_tp = T / EP, ep_rank = r / moe_tp,
                mt = r % moe_tp;
  const int G = GroupOf(c);
  const int64_t V = c.vocab_size, Vp = (V + 63) / 64 * 64, P = Vp / T;
  const int64_t s0 = std::min(r * P, V), s1 = std::min((r + 1) * P, V);
  auto copy = [&](const std::string& name) -> absl::Status {
    if (!sent.Has(name)) return absl::NotFoundError(absl::StrCat("slicer: no HF tensor ", name));
    out.Put(name, Copy(sent.At(name)));
    return absl::OkStatus();
  };
  out.Put("model.embed_tokens.weight", PadRows(Rows(sent.At("model.embed_tokens.weight"), s0, s1), P));
  if (!c.tie_word_embeddings) out.Put("lm_head.weight", PadRows(Rows(sent.At("lm_head.weight"), s0, s1), P));
  WSYNC_RETURN_IF_ERROR(copy("model.norm.weight"));
  const int64_t nh = c.num_attention_heads;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, "."), a = p + "self_attn.", m = p + "mlp.";
    WSYNC_RETURN_IF_ERROR(copy(p + "input_layernorm.weight"));
    WSYNC_RETURN_IF_ERROR(copy(p + "post_attention_layernorm.weight"));
    if (c.mla) {
      const MlaConfig& l = *c.mla;
      const int64_t nl = nh / T, qd = l.qk_nope_head_dim + l.qk_rope_head_dim,
                    kvd = l.qk_nope_head_dim + l.v_head_dim;
      if (l.q_lora_rank > 0) {
        WSYNC_ASSIGN_OR_RETURN(Lin qa, GetLin(sent, a + "q_a_proj"));
        WSYNC_ASSIGN_OR_RETURN(Lin kva, GetLin(sent, a + "kv_a_proj_with_mqa"));
        WSYNC_ASSIGN_OR_RETURN(Lin fused, Fuse({&qa, &kva}, a + "fused_qkv_a_proj_with_mqa"));
        WSYNC_RETURN_IF_ERROR(Emit(out, a + "fused_qkv_a_proj_with_mqa", fused, G));
        WSYNC_RETURN_IF_ERROR(copy(a + "q_a_layernorm.weight"));
        WSYNC_ASSIGN_OR_RETURN(Lin qb, GetLin(sent, a + "q_b_proj"));
        WSYNC_RETURN_IF_ERROR(Emit(out, a + "q_b_proj", ColSlice(qb, r * nl * qd, (r + 1) * nl * qd), G));
      } else {
        WSYNC_ASSIGN_OR_RETURN(Lin q, GetLin(sent, a + "q_proj"));
        WSYNC_RETURN_IF_ERROR(Emit(out, a + "q_proj", ColSlice(q, r * nl * qd, (r + 1) * nl * qd), G));
        WSYNC_ASSIGN_OR_RETURN(Lin kva, GetLin(sent, a + "kv_a_proj_with_mqa"));
        WSYNC_RETURN_IF_ERROR(Emit(out, a + "kv_a_proj_with_mqa", kva, G));
      }
      WSYNC_RETURN_IF_ERROR(copy(a + "kv_a_layernorm.weight"));
      WSYNC_ASSIGN_OR_RETURN(Lin kvb, GetLin(sent, a + "kv_b_proj"));
      WSYNC_RETURN_IF_ERROR(Emit(out, a + "kv_b_proj", ColSlice(kvb, r * nl * kvd, (r + 1) * nl * kvd), G));
      WSYNC_ASSIGN_OR_RETURN(Lin o, GetLin(sent, a + "o_proj"));
      WSYNC_RETURN_IF_ERROR(
          Emit(out, a + "o_proj", RowSlice(o, r * nl * l.v_head_dim, (r + 1) * nl * l.v_head_dim, G), G));
    } else {
      const int64_t nkv = c.num_key_value_heads, hd = c.head_dim, nq = nh / T;
      const int64_t kv_loc = T >= nkv ? 1 : nkv / T, replicas = T >= nkv ? T / nkv : 1, s = r / replicas;
      WSYNC_ASSIGN_OR_RETURN(Lin q, GetLin(sent, a + "q_proj"));
      WSYNC_ASSIGN_OR_RETURN(Lin k, GetLin(sent, a + "k_proj"));
      WSYNC_ASSIGN_OR_RETURN(Lin v, GetLin(sent, a + "v_proj"));
      const Lin qs = ColSlice(q, r * nq * hd, (r + 1) * nq * hd);
      const Lin ks = ColSlice(k, s * kv_loc * hd, (s + 1) * kv_loc * hd);
      const Lin vs = ColSlice(v, s * kv_loc * hd, (s + 1) * kv_loc * hd);
      WSYNC_ASSIGN_OR_RETURN(Lin qkv, Fuse({&qs, &ks, &vs}, a + "qkv_proj"));
      WSYNC_RETURN_IF_ERROR(Emit(out, a + "qkv_proj", qkv, G));
      if (c.qkv_bias) {
        const Tensor qb = Rows(sent.At(a + "q_proj.bias"), r * nq * hd, (r + 1) * nq * hd);
        const Tensor kb = Rows(sent.At(a + "k_proj.bias"), s * kv_loc * hd, (s + 1) * kv_loc * hd);
        const Tensor vb = Rows(sent.At(a + "v_proj.bias"), s * kv_loc * hd, (s + 1) * kv_loc * hd);
        out.Put(a + "qkv_proj.bias", CatRows({&qb, &kb, &vb}));
        if (c.arch != Architecture::kQwen2) WSYNC_RETURN_IF_ERROR(copy(a + "o_proj.bias"));
      }
      WSYNC_ASSIGN_OR_RETURN(Lin o, GetLin(sent, a + "o_proj"));
      WSYNC_RETURN_IF_ERROR(Emit(out, a + "o_proj", RowSlice(o, r * nq * hd, (r + 1) * nq * hd, G), G));
      if (c.qk_norm) {
        WSYNC_RETURN_IF_ERROR(copy(a + "q_norm.weight"));
        WSYNC_RETURN_IF_ERROR(copy(a + "k_norm.weight"));
      }
    }
    auto dense = [&](const std::string& src, const std::string& dst, int64_t F) -> absl::Status {
      const int64_t f = F / T;
      WSYNC_ASSIGN_OR_RETURN(Lin gate, GetLin(sent, src + "gate_proj"));
      WSYNC_ASSIGN_OR_RETURN(Lin up, GetLin(sent, src + "up_proj"));
      WSYNC_ASSIGN_OR_RETURN(Lin down, GetLin(sent, src + "down_proj"));
      const Lin gs = ColSlice(gate, r * f, (r + 1) * f), us = ColSlice(up, r * f, (r + 1) * f);
      WSYNC_ASSIGN_OR_RETURN(Lin gu, Fuse({&gs, &us}, dst + "gate_up_proj"));
      WSYNC_RETURN_IF_ERROR(Emit(out, dst + "gate_up_proj", gu, G));
      return Emit(out, dst + "down_proj", RowSlice(down, r * f, (r + 1) * f, G), G);
    };
    if (!c.IsMoeLayer(i)) {
      WSYNC_RETURN_IF_ERROR(dense(m, m, c.intermediate_size));
      continue;
    }
    const MoeConfig& e = *c.moe;
    WSYNC_RETURN_IF_ERROR(copy(m + "gate.weight"));
    if (c.arch == Architecture::kDeepseekV3 && e.topk_method == "noaux_tc")
      WSYNC_RETURN_IF_ERROR(copy(m + "gate.e_score_correction_bias"));
    const int64_t E_total = e.num_experts + (rank.fused_shared_experts ? 1 : 0), E_loc = E_total / EP,
                  I = e.moe_intermediate_size / moe_tp;
    std::vector<Tensor> w13, w2, s13, s2;
    bool any_int4 = false, any_bf16 = false;
    for (int64_t l = 0; l < E_loc; ++l) {
      const int64_t ge = ep_rank * E_loc + l;
      const std::string src = ge < e.num_experts ? absl::StrCat(m, "experts.", ge, ".") : m + "shared_experts.";
      WSYNC_ASSIGN_OR_RETURN(Lin gate, GetLin(sent, src + "gate_proj"));
      WSYNC_ASSIGN_OR_RETURN(Lin up, GetLin(sent, src + "up_proj"));
      WSYNC_ASSIGN_OR_RETURN(Lin down, GetLin(sent, src + "down_proj"));
      if (gate.int4 != up.int4 || gate.int4 != down.int4)
        return absl::InvalidArgumentError(absl::StrCat("slicer: mixed INT4/bf16 in ", src));
      (gate.int4 ? any_int4 : any_bf16) = true;
      if (!gate.int4) {
        const Tensor g = Rows(gate.w, mt * I, (mt + 1) * I), u = Rows(up.w, mt * I, (mt + 1) * I);
        w13.push_back(CatRows({&g, &u}));
        w2.push_back(Cols(down.w, mt * I, (mt + 1) * I));
        continue;
      }
      const Tensor gp = Rows(gate.packed, mt * I, (mt + 1) * I), upk = Rows(up.packed, mt * I, (mt + 1) * I);
      const Tensor gs = Rows(gate.scale, mt * I, (mt + 1) * I), us = Rows(up.scale, mt * I, (mt + 1) * I);
      w13.push_back(Transpose(CatRows({&gp, &upk})));  // [H/8, 2I']
      s13.push_back(Transpose(CatRows({&gs, &us})));   // [H/G, 2I']
      w2.push_back(Transpose(Cols(down.packed, mt * I / 8, (mt + 1) * I / 8)));  // [I'/8, H]
      s2.push_back(Transpose(G == -1 ? Copy(down.scale) : Cols(down.scale, mt * I / G, (mt + 1) * I / G)));
    }
    if (any_int4 && any_bf16) return absl::InvalidArgumentError(absl::StrCat("slicer: mixed experts in ", m));
    if (any_bf16) {
      out.Put(m + "experts.w13_weight", Stack(w13));
      out.Put(m + "experts.w2_weight", Stack(w2));
    } else {
      kernels::KernelOptions opts;
      opts.num_threads = 1;
      const Tensor g13 = Stack(w13), g2 = Stack(w2);
      WSYNC_ASSIGN_OR_RETURN(Shape m13, kernels::MarlinShapeFor(g13.shape()));
      WSYNC_ASSIGN_OR_RETURN(Shape m2, kernels::MarlinShapeFor(g2.shape()));
      Tensor mar13 = New(DType::kI32, m13), mar2 = New(DType::kI32, m2);
      WSYNC_RETURN_IF_ERROR(kernels::GptqToMarlin(g13.view(), nullptr, mar13.mutable_view(), opts));
      WSYNC_RETURN_IF_ERROR(kernels::GptqToMarlin(g2.view(), nullptr, mar2.mutable_view(), opts));
      Tensor sc13 = Stack(s13);
      PermuteScaleColumns(sc13, G != -1 && G < 4 * I);  // SGLang: size_k = 4I' (ENGINE_LAYOUT.md §4)
      const Tensor st2 = Stack(s2);
      Tensor sc2 = New(st2.dtype(), st2.shape());
      WSYNC_RETURN_IF_ERROR(kernels::PermuteMarlinScales(st2.view(), I, G, sc2.mutable_view(), opts));
      out.Put(m + "experts.w13_weight_packed", std::move(mar13));
      out.Put(m + "experts.w13_weight_scale", std::move(sc13));
      out.Put(m + "experts.w2_weight_packed", std::move(mar2));
      out.Put(m + "experts.w2_weight_scale", std::move(sc2));
    }
    if (c.arch == Architecture::kDeepseekV3 && e.num_shared_experts > 0 && !rank.fused_shared_experts)
      WSYNC_RETURN_IF_ERROR(dense(m + "shared_experts.", m + "shared_experts.", e.num_shared_experts * e.moe_intermediate_size));
  }
  return out;
}

void InProcessGroup::Barrier() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen; });
}

absl::Status InProcessGroup::AllReduce(int rank, absl::Span<float> data) {
  ptrs_[static_cast<size_t>(rank)] = data.data();
  sizes_[static_cast<size_t>(rank)] = data.size();
  Barrier();
  bool same = true;
  for (size_t s : sizes_) same = same && s == data.size();
  std::vector<float> sum;
  if (same) {
    sum.assign(ptrs_[0], ptrs_[0] + data.size());
    for (int r = 1; r < size_; ++r)
      for (size_t i = 0; i < data.size(); ++i) sum[i] += ptrs_[static_cast<size_t>(r)][i];
  }
  Barrier();
  if (!same) return absl::InvalidArgumentError("InProcessGroup: all_reduce sizes differ between ranks");
  std::copy(sum.begin(), sum.end(), data.begin());
  return absl::OkStatus();
}

absl::Status InProcessGroup::AllGather(int rank, absl::Span<const float> local, absl::Span<float> gathered) {
  ptrs_[static_cast<size_t>(rank)] = local.data();
  sizes_[static_cast<size_t>(rank)] = local.size();
  Barrier();
  bool same = gathered.size() == local.size() * static_cast<size_t>(size_);
  for (size_t s : sizes_) same = same && s == local.size();
  if (same)
    for (int r = 0; r < size_; ++r)
      std::copy_n(ptrs_[static_cast<size_t>(r)], local.size(), gathered.begin() + static_cast<int64_t>(r * local.size()));
  Barrier();
  if (!same) return absl::InvalidArgumentError("InProcessGroup: all_gather sizes differ between ranks");
  return absl::OkStatus();
}

TpCollectives InProcessGroup::ForRank(int rank) {
  TpCollectives c;
  c.all_reduce_sum = [this, rank](absl::Span<float> d) { return AllReduce(rank, d); };
  c.all_gather = [this, rank](absl::Span<const float> l, absl::Span<float> g) { return AllGather(rank, l, g); };
  return c;
}

std::vector<absl::Status> RunRanks(int size, const std::function<absl::Status(int rank)>& fn) {
  std::vector<absl::Status> st(static_cast<size_t>(size));
  std::vector<std::thread> th;
  for (int r = 0; r < size; ++r) th.emplace_back([&, r] { st[static_cast<size_t>(r)] = fn(r); });
  for (std::thread& t : th) t.join();
  return st;
}

ModelConfig MustParseConfig(const std::string& json) { return Must(ParseModelConfig(json, "test config"), "config"); }

}  // namespace wsync::engine::testing
