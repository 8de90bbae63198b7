#include "model/testing/hf_model.h"

#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/awq.h"

namespace wsync::model::testing {
namespace {

void Add(std::vector<HfTensorSpec>& v, std::string name, Shape shape, DType dt) {
  v.push_back(HfTensorSpec{std::move(name), dt, std::move(shape)});
}

void AddMlp(std::vector<HfTensorSpec>& v, const std::string& pre, int64_t H, int64_t F, DType dt) {
  Add(v, pre + "gate_proj.weight", {F, H}, dt);
  Add(v, pre + "up_proj.weight", {F, H}, dt);
  Add(v, pre + "down_proj.weight", {H, F}, dt);
}

// Decoder layer i; `moe`: its MLP is MoE (an MTP layer's always is: SGLang's NextN models build it so).
void AddLayer(std::vector<HfTensorSpec>& v, const ModelConfig& c, int64_t i, bool moe) {
  const DType dt = c.dtype;
  const int64_t H = c.hidden_size;
  const std::string L = absl::StrCat("model.layers.", i, ".");
  Add(v, L + "input_layernorm.weight", {H}, dt);
  if (c.mla) {
    const MlaConfig& a = *c.mla;
    const int64_t nh = c.num_attention_heads, qd = a.qk_nope_head_dim + a.qk_rope_head_dim;
    if (a.q_lora_rank > 0) {
      Add(v, L + "self_attn.q_a_proj.weight", {a.q_lora_rank, H}, dt);
      Add(v, L + "self_attn.q_a_layernorm.weight", {a.q_lora_rank}, dt);
      Add(v, L + "self_attn.q_b_proj.weight", {nh * qd, a.q_lora_rank}, dt);
    } else {
      Add(v, L + "self_attn.q_proj.weight", {nh * qd, H}, dt);
    }
    Add(v, L + "self_attn.kv_a_proj_with_mqa.weight", {a.kv_lora_rank + a.qk_rope_head_dim, H}, dt);
    Add(v, L + "self_attn.kv_a_layernorm.weight", {a.kv_lora_rank}, dt);
    Add(v, L + "self_attn.kv_b_proj.weight", {nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank}, dt);
    Add(v, L + "self_attn.o_proj.weight", {H, nh * a.v_head_dim}, dt);
  } else {
    const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
    Add(v, L + "self_attn.q_proj.weight", {nh * hd, H}, dt);
    Add(v, L + "self_attn.k_proj.weight", {nkv * hd, H}, dt);
    Add(v, L + "self_attn.v_proj.weight", {nkv * hd, H}, dt);
    if (c.qkv_bias) {
      Add(v, L + "self_attn.q_proj.bias", {nh * hd}, dt);
      Add(v, L + "self_attn.k_proj.bias", {nkv * hd}, dt);
      Add(v, L + "self_attn.v_proj.bias", {nkv * hd}, dt);
    }
    Add(v, L + "self_attn.o_proj.weight", {H, nh * hd}, dt);
    if (c.o_proj_bias) Add(v, L + "self_attn.o_proj.bias", {H}, dt);
    if (c.qk_norm) {
      Add(v, L + "self_attn.q_norm.weight", {hd}, dt);
      Add(v, L + "self_attn.k_norm.weight", {hd}, dt);
    }
  }
  Add(v, L + "post_attention_layernorm.weight", {H}, dt);
  if (!moe) {
    AddMlp(v, L + "mlp.", H, c.intermediate_size, dt);
    if (c.mlp_bias) {
      Add(v, L + "mlp.gate_proj.bias", {c.intermediate_size}, dt);
      Add(v, L + "mlp.up_proj.bias", {c.intermediate_size}, dt);
      Add(v, L + "mlp.down_proj.bias", {H}, dt);
    }
    return;
  }
  const MoeConfig& m = *c.moe;
  Add(v, L + "mlp.gate.weight", {m.num_experts, H}, dt);
  if (m.HasExpertBias()) Add(v, L + "mlp.gate.e_score_correction_bias", {m.num_experts}, DType::kF32);
  for (int64_t e = 0; e < m.num_experts; ++e)
    AddMlp(v, absl::StrCat(L, "mlp.experts.", e, "."), H, m.moe_intermediate_size, dt);
  if (m.num_shared_experts > 0)
    AddMlp(v, L + "mlp.shared_experts.", H, m.num_shared_experts * m.moe_intermediate_size, dt);
}

// AWQ (docs/spec/AWQ.md §2), written from the spec's byte table: column c of a packed row is in
// word c / 8 at nibble (0, 4, 1, 5, 2, 6, 3, 7)[c % 8]; W[n, k] = (u - z) * s, in f32 (exact).
uint32_t AwqCode(const Tensor& t, int64_t row, int64_t c, int64_t N) {
  static constexpr int kNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  const uint32_t w = t.view().data_as<uint32_t>()[row * (N / 8) + c / 8];
  return (w >> (4 * kNibble[c % 8])) & 0xFu;
}
float AwqDequant(const Tensor& qweight, const Tensor& qzeros, const Tensor& scales, int64_t n, int64_t k, int64_t N,
                 int64_t G) {
  const int u = static_cast<int>(AwqCode(qweight, k, n, N)), z = static_cast<int>(AwqCode(qzeros, k / G, n, N));
  const uint16_t s = scales.view().data_as<uint16_t>()[(k / G) * N + n];
  return static_cast<float>(u - z) * (scales.dtype() == DType::kBF16 ? BF16ToF32(s) : F16ToF32(s));
}

float Dequant(const Tensor& packed, const Tensor& scale, int64_t n, int64_t k, int64_t K, int64_t G) {
  const auto* p = packed.view().data_as<uint32_t>();
  const auto* s = scale.view().data_as<uint16_t>();
  const uint32_t word = p[n * (K / 8) + k / 8];
  const int q = static_cast<int>((word >> (4 * (k % 8))) & 0xF) - 8;
  return static_cast<float>(q) * BF16ToF32(s[n * (K / G) + k / G]);
}

}  // namespace

std::vector<HfTensorSpec> HfCheckpointSpecs(const ModelConfig& c, bool tied_lm_head, bool mtp) {
  std::vector<HfTensorSpec> v;
  Add(v, "model.embed_tokens.weight", {c.vocab_size, c.hidden_size}, c.dtype);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) AddLayer(v, c, i, c.IsMoeLayer(i));
  Add(v, "model.norm.weight", {c.hidden_size}, c.dtype);
  if (!c.tie_word_embeddings || tied_lm_head) Add(v, "lm_head.weight", {c.vocab_size, c.hidden_size}, c.dtype);
  if (mtp) {
    for (int64_t k = 0; k < c.num_nextn_predict_layers; ++k) {
      const int64_t i = c.num_hidden_layers + k;
      const std::string L = absl::StrCat("model.layers.", i, ".");
      Add(v, L + "enorm.weight", {c.hidden_size}, c.dtype);
      Add(v, L + "hnorm.weight", {c.hidden_size}, c.dtype);
      Add(v, L + "eh_proj.weight", {c.hidden_size, 2 * c.hidden_size}, c.dtype);
      AddLayer(v, c, i, c.moe.has_value());
      Add(v, L + "shared_head.norm.weight", {c.hidden_size}, c.dtype);
    }
  }
  return v;
}

absl::StatusOr<HfModel> MakeHfModel(const ModelConfig& c, const QuantizationConfig* q, uint32_t seed,
                                    const HfModelOptions& o) {
  HfModel m;
  const auto specs = HfCheckpointSpecs(c, o.send_tied_lm_head, o.send_mtp);
  uint32_t index = 0;
  for (const HfTensorSpec& s : specs) {
    std::mt19937 rng(seed + index++);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    ASSIGN_OR_RETURN(Tensor dense, Tensor::Empty(DType::kF32, s.shape));
    ASSIGN_OR_RETURN(Tensor raw, Tensor::Empty(s.dtype, s.shape));
    const int64_t numel = raw.view().numel();
    const bool norm = absl::StrContains(s.name, "norm");
    const bool bias = absl::EndsWith(s.name, ".bias");
    for (int64_t i = 0; i < numel; ++i) {
      float x = normal(rng);
      if (norm)
        x = 1.0f + 0.1f * x;
      else if (s.dtype != DType::kF32)
        x *= 0.02f;
      else if (bias)
        x *= 0.02f;
      if (s.dtype == DType::kF32) {
        raw.data_as<float>()[i] = x;
        dense.data_as<float>()[i] = x;
      } else {
        const uint16_t b = s.dtype == DType::kBF16 ? F32ToBF16(x) : F32ToF16(x);
        raw.data_as<uint16_t>()[i] = b;
        dense.data_as<float>()[i] = s.dtype == DType::kBF16 ? BF16ToF32(b) : F16ToF32(b);
      }
    }
    // An MTP layer is quantized as the others; its eh_proj stays bf16 (SGLang's NextN models hold
    // it as a plain nn.Linear; MEGATRON_TO_HF.md §5.7).
    const bool int4 = q != nullptr && s.shape.size() == 2 && absl::EndsWith(s.name, ".weight") &&
                      !absl::EndsWith(s.name, ".eh_proj.weight") && !q->IsIgnored(s.name);
    if (!int4) {
      m.order.push_back(s.name);
      m.sent.emplace(s.name, std::move(raw));
      m.dense.emplace(s.name, std::move(dense));
      continue;
    }
    const std::string base = s.name.substr(0, s.name.size() - 7);  // strip ".weight"
    if (q->is_awq()) {
      kernels::AwqQuantizeOptions ao;
      ao.group_size = q->group_size;
      ao.num_threads = 1;
      ASSIGN_OR_RETURN(const kernels::AwqShapes shapes, kernels::AwqShapesFor(raw.view(), q->group_size));
      ASSIGN_OR_RETURN(Tensor qweight, Tensor::Empty(DType::kI32, shapes.qweight));
      ASSIGN_OR_RETURN(Tensor qzeros, Tensor::Empty(DType::kI32, shapes.qzeros));
      ASSIGN_OR_RETURN(Tensor scales, Tensor::Empty(s.dtype, shapes.scales));
      RETURN_IF_ERROR(
          kernels::QuantizeAwq(raw.view(), qweight.mutable_view(), qzeros.mutable_view(), scales.mutable_view(), ao));
      const int64_t N = s.shape[0], K = s.shape[1], G = q->group_size > 0 ? q->group_size : K;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          dense.data_as<float>()[n * K + k] = AwqDequant(qweight, qzeros, scales, n, k, N, G);
      for (const char* suffix : {".qweight", ".qzeros", ".scales"}) m.order.push_back(base + suffix);
      m.sent.emplace(base + ".qweight", std::move(qweight));
      m.sent.emplace(base + ".qzeros", std::move(qzeros));
      m.sent.emplace(base + ".scales", std::move(scales));
      m.dense.emplace(s.name, std::move(dense));
      m.int4.insert(s.name);
      continue;
    }
    kernels::QuantizeOptions qo;
    qo.group_size = q->group_size;
    qo.variant = o.variant;
    qo.num_threads = 1;
    ASSIGN_OR_RETURN(const auto shapes,
                     kernels::QuantizedShapesFor(raw.view(), q->group_size, kernels::PackFormat::kCompressedTensors));
    ASSIGN_OR_RETURN(Tensor packed, Tensor::Empty(DType::kI32, shapes.packed));
    ASSIGN_OR_RETURN(Tensor scale, Tensor::Empty(s.dtype, shapes.scales));
    RETURN_IF_ERROR(kernels::QuantizeInt4(raw.view(), packed.mutable_view(), scale.mutable_view(), qo));
    const int64_t N = s.shape[0], K = s.shape[1], G = q->group_size > 0 ? q->group_size : K;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) dense.data_as<float>()[n * K + k] = Dequant(packed, scale, n, k, K, G);
    ASSIGN_OR_RETURN(Tensor shape, Tensor::Empty(o.weight_shape_dtype, {2}));
    if (o.weight_shape_dtype == DType::kI64) {
      shape.data_as<int64_t>()[0] = N;
      shape.data_as<int64_t>()[1] = K;
    } else {
      shape.data_as<int32_t>()[0] = static_cast<int32_t>(N);
      shape.data_as<int32_t>()[1] = static_cast<int32_t>(K);
    }
    for (const char* suffix : {".weight_packed", ".weight_scale", ".weight_shape"}) m.order.push_back(base + suffix);
    m.sent.emplace(base + ".weight_packed", std::move(packed));
    m.sent.emplace(base + ".weight_scale", std::move(scale));
    m.sent.emplace(base + ".weight_shape", std::move(shape));
    m.dense.emplace(s.name, std::move(dense));
    m.int4.insert(s.name);
  }
  return m;
}

HfModel ChangeElements(const HfModel& m, double p, uint32_t seed) {
  HfModel n;
  n.order = m.order;
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution flip(p);
  for (const auto& [name, base] : m.sent) {
    auto copy = Tensor::CopyOf(base.view());
    if (!copy.ok()) std::abort();  // host memory for a test model
    Tensor& t = n.sent.emplace(name, std::move(*copy)).first->second;
    if (absl::EndsWith(name, "weight_shape")) continue;
    const size_t item = ItemSize(t.dtype());
    auto* b = t.data_as<uint8_t>();
    for (size_t i = 0; i < t.nbytes() / item; ++i)
      if (flip(rng)) b[i * item + rng() % item] ^= static_cast<uint8_t>(1 + rng() % 255);
  }
  return n;
}

}  // namespace wsync::model::testing
