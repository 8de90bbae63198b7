// End to end per architecture, engine TP 1/2/4 (and EP), bf16 and INT4 (G = 128, 32, channelwise):
// random HF checkpoint -> Load every sent tensor -> Commit -> for every rank
//   * the dequantized engine weights equal the matching slice of the dequantized full HF weights
//     (an oracle written here from ENGINE_LAYOUT.md, independent of the layout code);
//   * concatenating the rank slices reproduces the full tensors (qkv with KV replication,
//     gate/up, w13/w2 over MoE-TP and EP ranks, row-parallel columns, vocab rows);
//   * Marlin buffers equal the kernels' repack of the received GPTQ data, and the scales a scalar
//     reference of FORMATS.md §5 with SGLang's size_k rule;
//   * Restore(Commit(x)) == x.
// Plus: every failed Load / Commit leaves the engine byte-identical (checksums), partial updates.
// Seeds are fixed per case (printed on failure).
#include "engine_model/repack.h"

#include <cstring>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/awq.h"
#include "kernels/int4.h"
#include "kernels/trtllm.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"

namespace wsync::engine_model {
namespace {

using model::testing::HfModel;
using model::testing::MakeHfModel;
using model::testing::QuantJson;
using ::testing::HasSubstr;

// --- a small dense-matrix oracle -----------------------------------------------------------------

struct D {
  Shape shape;  // [n] (as [n, 1]), [rows, cols] or [E, rows, cols]
  std::vector<float> v;
  int64_t rows() const { return shape.size() == 3 ? shape[1] : shape[0]; }
  int64_t cols() const { return shape.size() == 1 ? 1 : shape.back(); }
};

D FromTensor(const Tensor& t) {
  D d{t.shape(), {}};
  const int64_t n = t.view().numel();
  d.v.resize(static_cast<size_t>(n));
  if (t.dtype() == DType::kF32) {
    std::memcpy(d.v.data(), t.view().data(), static_cast<size_t>(n) * 4);
  } else {
    for (int64_t i = 0; i < n; ++i) d.v[static_cast<size_t>(i)] = BF16ToF32(t.view().data_as<uint16_t>()[i]);
  }
  return d;
}

D FromView(const TensorView& t) {
  D d{t.shape(), {}};
  const int64_t n = t.numel();
  d.v.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (t.dtype() == DType::kF32) {
      std::memcpy(&d.v[static_cast<size_t>(i)], t.bytes().data() + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, t.bytes().data() + 2 * i, 2);
      d.v[static_cast<size_t>(i)] = BF16ToF32(b);
    }
  }
  return d;
}

D Rows(const D& x, int64_t r0, int64_t n) {
  const int64_t c = x.cols();
  D d{x.shape.size() == 1 ? Shape{n} : Shape{n, c}, {}};
  d.v.assign(x.v.begin() + r0 * c, x.v.begin() + (r0 + n) * c);
  return d;
}

D Cols(const D& x, int64_t c0, int64_t n) {
  D d{{x.rows(), n}, {}};
  for (int64_t r = 0; r < x.rows(); ++r)
    for (int64_t c = 0; c < n; ++c) d.v.push_back(x.v[static_cast<size_t>(r * x.cols() + c0 + c)]);
  return d;
}

D Cat(const std::vector<D>& parts) {  // along rows
  D d = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) {
    d.v.insert(d.v.end(), parts[i].v.begin(), parts[i].v.end());
    d.shape[0] += parts[i].shape[0];
  }
  return d;
}

D CatCols(const std::vector<D>& parts) {
  D d{{parts[0].rows(), 0}, {}};
  for (const D& p : parts) d.shape[1] += p.cols();
  for (int64_t r = 0; r < d.shape[0]; ++r)
    for (const D& p : parts) d.v.insert(d.v.end(), p.v.begin() + r * p.cols(), p.v.begin() + (r + 1) * p.cols());
  return d;
}

D Stack(const std::vector<D>& parts) {
  D d{{static_cast<int64_t>(parts.size()), parts[0].rows(), parts[0].cols()}, {}};
  for (const D& p : parts) d.v.insert(d.v.end(), p.v.begin(), p.v.end());
  return d;
}

D Expert(const D& x, int64_t e) {
  const int64_t n = x.shape[1] * x.shape[2];
  return D{{x.shape[1], x.shape[2]}, std::vector<float>(x.v.begin() + e * n, x.v.begin() + (e + 1) * n)};
}

D PadRows(D x, int64_t total) {
  x.v.resize(static_cast<size_t>(total * x.cols()), 0.0f);
  x.shape[0] = total;
  return x;
}

// Bit-exact comparison (floats compared as bits; -0.0 vs 0.0 counts as different).
::testing::AssertionResult Same(const D& got, const D& want, const std::string& what) {
  if (got.shape != want.shape)
    return ::testing::AssertionFailure() << what << ": shape " << ShapeToString(got.shape) << ", want "
                                         << ShapeToString(want.shape);
  for (size_t i = 0; i < want.v.size(); ++i) {
    if (std::memcmp(&got.v[i], &want.v[i], 4) != 0)
      return ::testing::AssertionFailure() << what << ": element " << i << " is " << got.v[i] << ", want " << want.v[i];
  }
  return ::testing::AssertionSuccess();
}

// What engine rank r of T (EP) holds, per ENGINE_LAYOUT.md §2 / §5, as dense float: keys are the
// EngineLinear names (bf16 weight names) and the names of the other (plain) params.
std::map<std::string, D> Oracle(const ModelConfig& c, int T, int r, int EP, const model::testing::HfModel& m) {
  std::map<std::string, D> o;
  auto H = [&](const std::string& name) { return FromTensor(m.dense.at(name)); };
  const int64_t Vp = (c.vocab_size + 63) / 64 * 64, P = Vp / T;
  auto vocab = [&](const std::string& name) {
    const int64_t s0 = std::min<int64_t>(r * P, c.vocab_size), s1 = std::min<int64_t>((r + 1) * P, c.vocab_size);
    return PadRows(Rows(H(name), s0, s1 - s0), P);
  };
  auto mlp = [&](const std::string& pre, int64_t F) {
    o[pre + "gate_up_proj.weight"] =
        Cat({Rows(H(pre + "gate_proj.weight"), r * F / T, F / T), Rows(H(pre + "up_proj.weight"), r * F / T, F / T)});
    o[pre + "down_proj.weight"] = Cols(H(pre + "down_proj.weight"), r * F / T, F / T);
  };
  o["model.embed_tokens.weight"] = vocab("model.embed_tokens.weight");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string L = absl::StrCat("model.layers.", i, "."), A = L + "self_attn.";
    o[L + "input_layernorm.weight"] = H(L + "input_layernorm.weight");
    o[L + "post_attention_layernorm.weight"] = H(L + "post_attention_layernorm.weight");
    if (c.mla) {
      const MlaConfig& a = *c.mla;
      const int64_t nl = c.num_attention_heads / T, qd = a.qk_nope_head_dim + a.qk_rope_head_dim;
      const int64_t kvd = a.qk_nope_head_dim + a.v_head_dim;
      if (a.q_lora_rank > 0) {
        o[A + "fused_qkv_a_proj_with_mqa.weight"] = Cat({H(A + "q_a_proj.weight"), H(A + "kv_a_proj_with_mqa.weight")});
        o[A + "q_a_layernorm.weight"] = H(A + "q_a_layernorm.weight");
        o[A + "q_b_proj.weight"] = Rows(H(A + "q_b_proj.weight"), r * nl * qd, nl * qd);
      } else {
        o[A + "q_proj.weight"] = Rows(H(A + "q_proj.weight"), r * nl * qd, nl * qd);
        o[A + "kv_a_proj_with_mqa.weight"] = H(A + "kv_a_proj_with_mqa.weight");
      }
      o[A + "kv_a_layernorm.weight"] = H(A + "kv_a_layernorm.weight");
      o[A + "kv_b_proj.weight"] = Rows(H(A + "kv_b_proj.weight"), r * nl * kvd, nl * kvd);
      o[A + "o_proj.weight"] = Cols(H(A + "o_proj.weight"), r * nl * a.v_head_dim, nl * a.v_head_dim);
    } else {
      const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim, nhl = nh / T;
      const int64_t kvl = T >= nkv ? 1 : nkv / T, s = T >= nkv ? r / (T / nkv) : r;
      for (const char* kind : {"weight", "bias"}) {
        if (std::string(kind) == "bias" && !c.qkv_bias) continue;
        o[absl::StrCat(A, "qkv_proj.", kind)] =
            Cat({Rows(H(absl::StrCat(A, "q_proj.", kind)), r * nhl * hd, nhl * hd),
                 Rows(H(absl::StrCat(A, "k_proj.", kind)), s * kvl * hd, kvl * hd),
                 Rows(H(absl::StrCat(A, "v_proj.", kind)), s * kvl * hd, kvl * hd)});
      }
      o[A + "o_proj.weight"] = Cols(H(A + "o_proj.weight"), r * nhl * hd, nhl * hd);
      if (c.qkv_bias && c.arch != Architecture::kQwen2) o[A + "o_proj.bias"] = H(A + "o_proj.bias");
      if (c.qk_norm) {
        o[A + "q_norm.weight"] = H(A + "q_norm.weight");
        o[A + "k_norm.weight"] = H(A + "k_norm.weight");
      }
    }
    if (!c.IsMoeLayer(i)) {
      mlp(L + "mlp.", c.intermediate_size);
      if (c.mlp_bias) {  // Llama's mlp_bias: gate_up's bias split as its rows, down_proj's whole
        const std::string M = L + "mlp.";
        const int64_t F = c.intermediate_size;
        o[M + "gate_up_proj.bias"] =
            Cat({Rows(H(M + "gate_proj.bias"), r * F / T, F / T), Rows(H(M + "up_proj.bias"), r * F / T, F / T)});
        o[M + "down_proj.bias"] = H(M + "down_proj.bias");
      }
      continue;
    }
    const MoeConfig& mc = *c.moe;
    const int64_t mt = T / EP, t = r % mt, ep = r / mt, El = mc.num_experts / EP, Ip = mc.moe_intermediate_size / mt;
    o[L + "mlp.gate.weight"] = H(L + "mlp.gate.weight");
    if (c.arch == Architecture::kDeepseekV3)
      o[L + "mlp.gate.e_score_correction_bias"] = H(L + "mlp.gate.e_score_correction_bias");
    std::vector<D> w13, w2;
    for (int64_t l = 0; l < El; ++l) {
      const std::string E = absl::StrCat(L, "mlp.experts.", ep * El + l, ".");
      w13.push_back(Cat({Rows(H(E + "gate_proj.weight"), t * Ip, Ip), Rows(H(E + "up_proj.weight"), t * Ip, Ip)}));
      w2.push_back(Cols(H(E + "down_proj.weight"), t * Ip, Ip));
    }
    o[L + "mlp.experts.w13_weight"] = Stack(w13);
    o[L + "mlp.experts.w2_weight"] = Stack(w2);
    if (c.arch == Architecture::kDeepseekV3 && mc.num_shared_experts > 0)
      mlp(L + "mlp.shared_experts.", mc.num_shared_experts * mc.moe_intermediate_size);
  }
  o["model.norm.weight"] = H("model.norm.weight");
  if (!c.tie_word_embeddings) o["lm_head.weight"] = vocab("lm_head.weight");
  return o;
}

// FORMATS.md §5 scalar reference of the Marlin scale permutation on [rows, N] (GPTQ orientation).
std::vector<uint16_t> RefPermuteScales(const uint16_t* in, int64_t rows, int64_t n, bool grouped) {
  std::vector<uint16_t> out(static_cast<size_t>(rows * n));
  static constexpr int kSingle[8] = {0, 1, 8, 9, 16, 17, 24, 25};
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = in + r * n;
    uint16_t* d = out.data() + r * n;
    if (grouped) {
      for (int64_t b = 0; b < n; b += 64)
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 8; ++j) d[b + 8 * i + j] = s[b + i + 8 * j];
    } else {
      for (int64_t b = 0; b < n; b += 32)
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 8; ++j) d[b + 8 * i + j] = s[b + 2 * i + kSingle[j]];
    }
  }
  return out;
}

template <typename T>
std::vector<T> Transposed(const T* in, int64_t rows, int64_t cols) {
  std::vector<T> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = in[r * cols + c];
  return out;
}

uint64_t EngineChecksum(const EngineWeights& e) {
  Xxh3Stream h;
  for (const EngineBuffer& b : e.buffers()) h.Update({static_cast<const std::byte*>(b.data), b.nbytes});
  return h.Digest();
}

absl::Status LoadAll(Loader& loader, const model::testing::HfModel& m) {
  for (const std::string& name : m.order) RETURN_IF_ERROR(loader.Load(name, m.sent.at(name).view()));
  return absl::OkStatus();
}

// --- the end-to-end matrix -----------------------------------------------------------------------

struct Case {
  std::string label;
  const char* config;
  int group = 0;  // 0: bf16; else G (-1 channelwise)
  std::vector<std::string> ignore;
  std::vector<std::pair<int, int>> tp_ep;
  uint32_t seed = 1;
  bool awq = false;               // an AWQ config (ignore = modules_to_not_convert) instead of compressed-tensors
  const char* layout = "marlin";  // the engine_layout the engine declares
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.label << " (seed " << c.seed << ")"; }

const std::vector<std::string> kAllInt4 = {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"};
const std::vector<std::string> kSlime = {
    "lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens.*", "re:.*norm.*", "re:.*shared_experts.*"};
const std::vector<std::string> kDeepseekMaxInt4 = {"lm_head",        "re:.*embed_tokens.*",      "re:.*mlp\\.gate$",
                                                   "re:.*q_a_proj$", "re:.*kv_a_proj_with_mqa$", "re:.*kv_b_proj$"};
const std::vector<std::string> kDeepseekNoQLoraInt4 = {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$",
                                                       "re:.*kv_b_proj$"};
const std::vector<std::pair<int, int>> kTp124 = {{1, 1}, {2, 1}, {4, 1}};

std::vector<Case> Cases() {
  using namespace testing;  // NOLINT
  return {
      {"llama_bf16", model::testing::kLlamaJson, 0, {}, kTp124, 11},
      {"llama_g128", model::testing::kLlamaJson, 128, kAllInt4, kTp124, 12},
      {"llama_g32", model::testing::kLlamaJson, 32, kAllInt4, kTp124, 13},
      {"llama_channel", model::testing::kLlamaJson, -1, kAllInt4, kTp124, 14},
      {"qwen2_tied_bf16", model::testing::kQwen2Json, 0, {}, kTp124, 21},
      {"qwen2_tied_g32", model::testing::kQwen2Json, 32, kAllInt4, kTp124, 22},
      {"qwen2_tied_g128", model::testing::kQwen2Json, 128, kAllInt4, {{1, 1}, {2, 1}}, 23},
      {"qwen3_mqa_bf16", model::testing::kQwen3Json, 0, {}, kTp124, 31},
      {"qwen3_mqa_g128", model::testing::kQwen3Json, 128, kAllInt4, kTp124, 32},
      {"qwen3moe_bf16", model::testing::kQwen3MoeJson, 0, {}, {{1, 1}, {2, 1}, {2, 2}, {4, 1}, {4, 2}, {4, 4}}, 41},
      {"qwen3moe_g128_slime", model::testing::kQwen3MoeJson, 128, kSlime, {{1, 1}, {2, 1}, {2, 2}, {4, 2}, {4, 4}}, 42},
      {"qwen3moe_g32_all", model::testing::kQwen3MoeJson, 32, kAllInt4, {{1, 1}, {2, 2}, {4, 1}, {4, 4}}, 43},
      {"qwen3moe_h128_g128_quirk", model::testing::kQwen3MoeH128Json, 128, kSlime, {{1, 1}, {2, 2}}, 44},
      {"deepseek_bf16", model::testing::kDeepseekJson, 0, {}, {{1, 1}, {2, 1}, {4, 1}, {4, 2}, {4, 4}}, 51},
      {"deepseek_g128_max", model::testing::kDeepseekJson, 128, kDeepseekMaxInt4, {{1, 1}, {2, 1}, {4, 2}, {4, 4}}, 52},
      {"deepseek_g32_slime", model::testing::kDeepseekJson, 32, kSlime, {{2, 2}, {4, 1}}, 53},
      {"deepseek_noqlora_g128", model::testing::kDeepseekNoQLoraJson, 128, kDeepseekNoQLoraInt4, {{1, 1}, {2, 1}}, 54},
      {"deepseek_noqlora_g32", model::testing::kDeepseekNoQLoraJson, 32, kDeepseekNoQLoraInt4, {{4, 1}, {4, 4}}, 55},
      // AWQ -> AWQ-Marlin (AWQ.md): lm_head, embeddings and routers are never quantized under AWQ.
      {"llama_awq_g128", model::testing::kLlamaJson, 128, {}, kTp124, 61, true},
      {"llama_awq_g32", model::testing::kLlamaJson, 32, {}, {{1, 1}, {2, 1}}, 62, true},
      {"llama_awq_channel", model::testing::kLlamaJson, -1, {}, {{1, 1}, {4, 1}}, 63, true},
      {"qwen2_tied_awq_g32", model::testing::kQwen2Json, 32, {}, {{1, 1}, {2, 1}}, 64, true},
      {"qwen3_mqa_awq_g128", model::testing::kQwen3Json, 128, {}, kTp124, 65, true},
      {"qwen3moe_awq_g128_attn_bf16",
       model::testing::kQwen3MoeJson,
       128,
       {"self_attn"},
       {{1, 1}, {2, 1}, {2, 2}, {4, 2}, {4, 4}},
       66,
       true},
      {"qwen3moe_awq_g32", model::testing::kQwen3MoeJson, 32, {}, {{1, 1}, {4, 4}}, 67, true},
      {"qwen3moe_h128_awq_g128_quirk",
       model::testing::kQwen3MoeH128Json,
       128,
       {"self_attn"},
       {{1, 1}, {2, 2}},
       68,
       true},
      {"deepseek_noqlora_awq_g32", model::testing::kDeepseekNoQLoraJson, 32, {"kv_b_proj"}, {{1, 1}, {4, 4}}, 69, true},
      // TensorRT-LLM W4A16 (TRTLLM_INT4.md): compressed-tensors on the wire, the preprocessed layout in the engine.
      {"llama_trtllm_sm80_g64", model::testing::kLlamaJson, 64, kAllInt4, {{1, 1}, {2, 1}}, 71, false, "trtllm-sm80"},
      {"llama_trtllm_sm90_g32", model::testing::kLlamaJson, 32, kAllInt4, {{1, 1}, {2, 1}}, 72, false, "trtllm-sm90"},
      {"qwen3moe_trtllm_sm80_g128",
       model::testing::kQwen3MoeJson,
       128,
       kSlime,
       {{1, 1}, {2, 2}},
       73,
       false,
       "trtllm-sm80"},
      {"qwen3moe_trtllm_sm90_g32",
       model::testing::kQwen3MoeJson,
       32,
       kSlime,
       {{1, 1}, {2, 2}},
       74,
       false,
       "trtllm-sm90"},
  };
}

class RepackEndToEnd : public ::testing::TestWithParam<Case> {};

void CheckMarlin(const EngineLayout& l, const EngineLinear& lin, const Staging& staging, const EngineWeights& engine) {
  const EngineParam& pk = l.params()[static_cast<size_t>(lin.packed)];
  const EngineParam& ps = l.params()[static_cast<size_t>(lin.scale)];
  const TensorView sp = staging.param(lin.packed), ss = staging.param(lin.scale);
  const MutableTensorView ep = *engine.View(pk.name), es = *engine.View(ps.name);
  const int64_t E = std::max<int64_t>(lin.experts, 1), n = lin.n, k = lin.k, G = lin.group_size;
  const int64_t rows = G > 0 ? k / G : 1;
  // Packed: the kernels' repack of the GPTQ orientation of what was received.
  std::vector<uint32_t> gptq;
  if (lin.experts == 0) {
    gptq = Transposed(sp.data_as<uint32_t>(), n, k / 8);
  } else {
    gptq.assign(sp.data_as<uint32_t>(), sp.data_as<uint32_t>() + sp.numel());
  }
  Shape gshape = lin.experts ? Shape{lin.experts, k / 8, n} : Shape{k / 8, n};
  Tensor want = *Tensor::Empty(DType::kI32, pk.engine_shape);
  ASSERT_TRUE(kernels::GptqToMarlin(TensorView(DType::kI32, gshape, std::as_bytes(std::span(gptq))), nullptr,
                                    want.mutable_view(), {})
                  .ok());
  ASSERT_EQ(std::memcmp(want.view().data(), ep.data(), ep.nbytes()), 0) << pk.name << ": Marlin != repack(GPTQ)";
  // Scales: §5 reference with SGLang's size_k (dense K_p; w13 4I'; w2 I').
  const int64_t size_k = lin.role == ParamRole::kExpertsW13 ? 2 * n : k;
  const bool grouped = G != -1 && G < size_k;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<uint16_t> s;
    if (lin.experts == 0) {
      s = Transposed(ss.data_as<uint16_t>(), n, rows);
    } else {
      s.assign(ss.data_as<uint16_t>() + e * rows * n, ss.data_as<uint16_t>() + (e + 1) * rows * n);
    }
    const auto ref = RefPermuteScales(s.data(), rows, n, grouped);
    ASSERT_EQ(std::memcmp(ref.data(), es.data_as<uint16_t>() + e * rows * n, ref.size() * 2), 0)
        << ps.name << " expert " << e << " grouped=" << grouped;
    if (lin.experts == 0) {  // and the kernel called with SGLang's own arguments
      Tensor k_out = *Tensor::Empty(ps.dtype, {rows, n});
      ASSERT_TRUE(kernels::PermuteMarlinScales(TensorView(ps.dtype, {rows, n}, std::as_bytes(std::span(s))), k,
                                               static_cast<int>(G), k_out.mutable_view(), {})
                      .ok());
      ASSERT_EQ(std::memcmp(k_out.view().data(), es.data(), es.nbytes()), 0) << ps.name;
    }
  }
}

// AWQ-Marlin: qweight is the kernels' awq_marlin_repack of what was received; the zero points
// follow AWQ.md §3.3's closed form (nibble t of word (g, w) = z[g, 64(w/8) + w%8 + 8 ORDER[t]],
// z read from the AWQ layout by the §2 byte table); the scales are the §5 reference with vLLM's
// size_k (dense K_p; MoE I' for w13 and w2).
void CheckAwqMarlin(const EngineLayout& l, const EngineLinear& lin, const Staging& staging,
                    const EngineWeights& engine) {
  static constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  static constexpr int kNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  ASSERT_GE(lin.zeros, 0) << lin.name;
  const EngineParam& pk = l.params()[static_cast<size_t>(lin.packed)];
  const EngineParam& pz = l.params()[static_cast<size_t>(lin.zeros)];
  const EngineParam& ps = l.params()[static_cast<size_t>(lin.scale)];
  const TensorView sq = staging.param(lin.packed), sz = staging.param(lin.zeros), ss = staging.param(lin.scale);
  const MutableTensorView eq = *engine.View(pk.name), ez = *engine.View(pz.name), es = *engine.View(ps.name);
  const int64_t E = std::max<int64_t>(lin.experts, 1), n = lin.n, k = lin.k, G = lin.group_size;
  const int64_t rows = G > 0 ? k / G : 1;
  Tensor want = *Tensor::Empty(DType::kI32, pk.engine_shape);
  ASSERT_TRUE(kernels::AwqToMarlin(sq, want.mutable_view(), {}).ok());
  ASSERT_EQ(std::memcmp(want.view().data(), eq.data(), eq.nbytes()), 0) << pk.name << ": != awq_marlin_repack";
  const uint32_t* z = sz.data_as<uint32_t>();
  const uint32_t* mz = ez.data_as<uint32_t>();
  auto zero = [&](int64_t row, int64_t c) { return (z[row * (n / 8) + c / 8] >> (4 * kNibble[c % 8])) & 0xFu; };
  for (int64_t row = 0; row < E * rows; ++row)
    for (int64_t w = 0; w < n / 8; ++w) {
      uint32_t expect = 0;
      for (int t = 0; t < 8; ++t) expect |= zero(row, 64 * (w / 8) + (w % 8) + 8 * kOrder[t]) << (4 * t);
      ASSERT_EQ(mz[row * (n / 8) + w], expect) << pz.name << " row " << row << " word " << w;
    }
  const int64_t size_k = lin.experts > 0 ? (lin.role == ParamRole::kExpertsW13 ? n / 2 : k) : k;
  const bool grouped = G != -1 && G < size_k;
  for (int64_t e = 0; e < E; ++e) {
    const auto ref = RefPermuteScales(ss.data_as<uint16_t>() + e * rows * n, rows, n, grouped);
    ASSERT_EQ(std::memcmp(ref.data(), es.data_as<uint16_t>() + e * rows * n, ref.size() * 2), 0)
        << ps.name << " expert " << e << " grouped=" << grouped;
  }
}

// TensorRT-LLM: the engine's int8 bytes are the kernels' preprocessing of the GPTQ-orientation
// codes received, the scales those received unchanged (W4A16), and an MoE w3_w1 holds up_proj in
// its first I' columns: checked against the sent compressed-tensors tensors directly.
void CheckTrtllm(const EngineLayout& l, const EngineLinear& lin, const Staging& staging, const EngineWeights& engine,
                 const model::testing::HfModel& m, int ep, int rank) {
  const EngineParam& pk = l.params()[static_cast<size_t>(lin.packed)];
  const EngineParam& ps = l.params()[static_cast<size_t>(lin.scale)];
  ASSERT_EQ(pk.dtype_in(ParamForm::kEngine), DType::kI8) << pk.name;
  const TensorView sp = staging.param(lin.packed), ss = staging.param(lin.scale);
  const MutableTensorView eb = *engine.View(pk.name), es = *engine.View(ps.name);
  kernels::TrtllmOptions t;
  t.arch = pk.marlin.trtllm_sm90 ? kernels::TrtllmArch::kSm90 : kernels::TrtllmArch::kSm80;
  Tensor want = *Tensor::Empty(DType::kI8, pk.engine_shape);
  ASSERT_TRUE(kernels::PreprocessTrtllm(sp, want.mutable_view(), t).ok());
  ASSERT_EQ(std::memcmp(want.view().data(), eb.data(), eb.nbytes()), 0) << pk.name << ": != TensorRT-LLM preprocess";
  ASSERT_EQ(std::memcmp(ss.data(), es.data(), es.nbytes()), 0) << ps.name << ": W4A16 scales are not permuted";
  if (lin.role != ParamRole::kExpertsW13) return;
  // Local expert 0's up_proj rows [t I', +I') are its first I' columns: word (kw, c) = the sent
  // weight_packed [I, H/8] word (t I' + c, kw); gate_proj's follow.
  ASSERT_TRUE(pk.marlin.up_first);
  const int64_t Ip = lin.n / 2, mt = l.parallel().tp_size / ep, t_rank = rank % mt, first = l.first_local_expert();
  const std::string layer = pk.name.substr(0, pk.name.find(".mlp.experts."));
  const Tensor& up = m.sent.at(absl::StrCat(layer, ".mlp.experts.", first, ".up_proj.weight_packed"));
  const Tensor& gate = m.sent.at(absl::StrCat(layer, ".mlp.experts.", first, ".gate_proj.weight_packed"));
  const int64_t kw = lin.k / 8;
  for (int64_t w = 0; w < kw; ++w)
    for (int64_t c = 0; c < Ip; ++c) {
      ASSERT_EQ(sp.data_as<uint32_t>()[w * lin.n + c], up.view().data_as<uint32_t>()[(t_rank * Ip + c) * kw + w]);
      ASSERT_EQ(sp.data_as<uint32_t>()[w * lin.n + Ip + c],
                gate.view().data_as<uint32_t>()[(t_rank * Ip + c) * kw + w]);
    }
}

TEST_P(RepackEndToEnd, LoadCommitVerifyRestore) {
  const Case& tc = GetParam();
  SCOPED_TRACE(absl::StrCat(tc.label, " seed ", tc.seed));
  auto cfg = ParseModelConfig(tc.config, tc.label);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const ModelConfig& c = *cfg;
  std::optional<QuantizationConfig> q;
  if (tc.group != 0) {
    std::string json =
        tc.awq ? model::testing::AwqQuantJson(tc.group, tc.ignore) : model::testing::QuantJson(tc.group, tc.ignore);
    json.insert(1, absl::StrCat("\"engine_layout\": \"", tc.layout, "\", "));
    auto parsed = ParseQuantizationConfig(json, tc.label);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    q = *parsed;
  }
  model::testing::HfModelOptions mo;
  mo.send_tied_lm_head = c.tie_word_embeddings;  // a tied lm_head.weight must be dropped
  mo.weight_shape_dtype = tc.seed % 2 ? DType::kI64 : DType::kI32;
  auto model = model::testing::MakeHfModel(c, q ? &*q : nullptr, tc.seed, mo);
  ASSERT_TRUE(model.ok()) << model.status();
  const model::testing::HfModel& m = *model;
  if (q) {
    ASSERT_FALSE(m.int4.empty());
  }

  for (const auto& [T, EP] : tc.tp_ep) {
    // rank -> linear / param name -> dense engine value
    std::vector<std::map<std::string, D>> got(static_cast<size_t>(T));
    for (int r = 0; r < T; ++r) {
      SCOPED_TRACE(absl::StrCat("T ", T, " EP ", EP, " rank ", r));
      auto layout = EngineLayout::Create(c, q ? &*q : nullptr, {T, r, EP});
      ASSERT_TRUE(layout.ok()) << layout.status();
      const EngineLayout& l = *layout;
      auto staging = Staging::Create(l);
      ASSERT_TRUE(staging.ok());
      Loader loader(staging->get());
      {
        const absl::Status st_ = LoadAll(loader, m);
        ASSERT_TRUE(st_.ok()) << st_;
      }
      {
        const absl::Status st_ = loader.CheckComplete();
        ASSERT_TRUE(st_.ok()) << st_;
      }
      auto engine = OwnedEngineWeights::Allocate(l);
      ASSERT_TRUE(engine.ok());
      RepackOptions ro;
      ro.verify = true;
      ro.num_threads = 1 + r % 2;
      {
        const absl::Status st_ = Commit(**staging, (*engine)->weights(), ro);
        ASSERT_TRUE(st_.ok()) << st_;
      }

      const std::map<std::string, D> want = Oracle(c, T, r, EP, m);
      std::set<std::string> covered;
      for (const EngineLinear& lin : l.linears()) {
        auto dense = DequantizeToDense(l, lin.name, (*engine)->weights());
        ASSERT_TRUE(dense.ok()) << dense.status();
        ASSERT_TRUE(want.contains(lin.name)) << "layout linear " << lin.name << " not in the oracle";
        const D d = FromTensor(*dense);
        ASSERT_TRUE(Same(d, want.at(lin.name), lin.name + " (engine form)"));
        auto loaded = DequantizeToDense(lin.name, **staging);
        ASSERT_TRUE(loaded.ok()) << loaded.status();
        ASSERT_TRUE(Same(FromTensor(*loaded), want.at(lin.name), lin.name + " (loaded form)"));
        const bool trtllm = q && q->trtllm();
        if (lin.quantized && tc.awq) CheckAwqMarlin(l, lin, **staging, (*engine)->weights());
        if (lin.quantized && trtllm) CheckTrtllm(l, lin, **staging, (*engine)->weights(), m, EP, r);
        if (lin.quantized && !tc.awq && !trtllm) CheckMarlin(l, lin, **staging, (*engine)->weights());
        got[static_cast<size_t>(r)][lin.name] = d;
        covered.insert(lin.name);
      }
      for (const EngineParam& p : l.params()) {
        if (p.linear >= 0) continue;
        ASSERT_TRUE(want.contains(p.name)) << "layout param " << p.name << " not in the oracle";
        const D d = FromView(*(*engine)->weights().View(p.name));
        ASSERT_TRUE(Same(d, want.at(p.name), p.name));
        got[static_cast<size_t>(r)][p.name] = d;
        covered.insert(p.name);
      }
      for (const auto& [name, d] : want)
        EXPECT_TRUE(covered.contains(name)) << "oracle tensor " << name << " not in the layout";

      // Restore(Commit(x)) == x, byte for byte, and the restored staging is complete.
      auto restored = Staging::Create(l);
      ASSERT_TRUE(restored.ok());
      ASSERT_TRUE(Restore((*engine)->weights(), **restored, ro).ok());
      EXPECT_TRUE((*restored)->CheckComplete().ok());
      for (size_t i = 0; i < l.params().size(); ++i) {
        const auto a = (*staging)->param(static_cast<int>(i)), b = (*restored)->param(static_cast<int>(i));
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "restore of " << l.params()[i].name;
      }
    }
    // Concatenating the ranks' slices reproduces the full tensors.
    SCOPED_TRACE(absl::StrCat("concat T ", T, " EP ", EP));
    auto full = [&](const std::string& n) { return FromTensor(m.dense.at(n)); };
    auto g = [&](int r, const std::string& n) -> const D& { return got[static_cast<size_t>(r)].at(n); };
    const int64_t V = c.vocab_size;
    std::vector<D> vocab;
    for (int r = 0; r < T; ++r) vocab.push_back(g(r, "model.embed_tokens.weight"));
    const D vcat = Cat(vocab);
    EXPECT_TRUE(Same(Rows(vcat, 0, V), full("model.embed_tokens.weight"), "embed rows"));
    for (float x : Rows(vcat, V, vcat.rows() - V).v) ASSERT_EQ(x, 0.0f) << "vocab padding is not zero";
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string L = absl::StrCat("model.layers.", i, "."), A = L + "self_attn.";
      auto cat_rows = [&](const std::string& name, int64_t off, int64_t n, const std::vector<int>& ranks) {
        std::vector<D> p;
        for (int r : ranks) p.push_back(Rows(g(r, name), off, n));
        return Cat(p);
      };
      std::vector<int> all(static_cast<size_t>(T));
      for (int r = 0; r < T; ++r) all[static_cast<size_t>(r)] = r;
      if (!c.mla) {
        const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim, nhl = nh / T;
        const int64_t kvl = T >= nkv ? 1 : nkv / T, rep = T >= nkv ? T / nkv : 1;
        std::vector<int> kv_ranks;
        for (int r = 0; r < T; r += static_cast<int>(rep)) kv_ranks.push_back(r);
        for (const char* kind : {"weight", "bias"}) {
          if (std::string(kind) == "bias" && !c.qkv_bias) continue;
          const std::string qkv = absl::StrCat(A, "qkv_proj.", kind);
          EXPECT_TRUE(Same(cat_rows(qkv, 0, nhl * hd, all), full(absl::StrCat(A, "q_proj.", kind)), qkv + " q"));
          EXPECT_TRUE(
              Same(cat_rows(qkv, nhl * hd, kvl * hd, kv_ranks), full(absl::StrCat(A, "k_proj.", kind)), qkv + " k"));
          EXPECT_TRUE(Same(cat_rows(qkv, (nhl + kvl) * hd, kvl * hd, kv_ranks), full(absl::StrCat(A, "v_proj.", kind)),
                           qkv + " v"));
          for (int r = 0; r < T; ++r)  // replicas hold the same kv head
            EXPECT_TRUE(Same(Rows(g(r, qkv), nhl * hd, 2 * kvl * hd),
                             Rows(g(static_cast<int>(r / rep * rep), qkv), nhl * hd, 2 * kvl * hd), qkv + " replica"));
        }
      } else {
        const std::string qb = c.mla->q_lora_rank > 0 ? "q_b_proj.weight" : "q_proj.weight";
        const int64_t qrows = g(0, A + qb).rows(), kvrows = g(0, A + "kv_b_proj.weight").rows();
        EXPECT_TRUE(Same(cat_rows(A + qb, 0, qrows, all), full(A + qb), qb));
        EXPECT_TRUE(Same(cat_rows(A + "kv_b_proj.weight", 0, kvrows, all), full(A + "kv_b_proj.weight"), "kv_b"));
      }
      std::vector<D> o;
      for (int r = 0; r < T; ++r) o.push_back(g(r, A + "o_proj.weight"));
      EXPECT_TRUE(Same(CatCols(o), full(A + "o_proj.weight"), A + "o_proj"));
      std::vector<std::string> mlps;
      if (!c.IsMoeLayer(i)) mlps.push_back(L + "mlp.");
      if (c.IsMoeLayer(i) && c.arch == Architecture::kDeepseekV3) mlps.push_back(L + "mlp.shared_experts.");
      for (const std::string& pre : mlps) {
        const int64_t half = g(0, pre + "gate_up_proj.weight").rows() / 2;
        EXPECT_TRUE(
            Same(cat_rows(pre + "gate_up_proj.weight", 0, half, all), full(pre + "gate_proj.weight"), pre + "gate"));
        EXPECT_TRUE(
            Same(cat_rows(pre + "gate_up_proj.weight", half, half, all), full(pre + "up_proj.weight"), pre + "up"));
        std::vector<D> d;
        for (int r = 0; r < T; ++r) d.push_back(g(r, pre + "down_proj.weight"));
        EXPECT_TRUE(Same(CatCols(d), full(pre + "down_proj.weight"), pre + "down"));
      }
      if (!c.IsMoeLayer(i)) continue;
      const int mt = T / EP;
      const int64_t El = c.moe->num_experts / EP;
      for (int64_t e = 0; e < c.moe->num_experts; ++e) {
        const int ep = static_cast<int>(e / El);
        std::vector<D> gate, up, down;
        for (int t = 0; t < mt; ++t) {
          const D w13 = Expert(g(ep * mt + t, L + "mlp.experts.w13_weight"), e % El);
          gate.push_back(Rows(w13, 0, w13.rows() / 2));
          up.push_back(Rows(w13, w13.rows() / 2, w13.rows() / 2));
          down.push_back(Expert(g(ep * mt + t, L + "mlp.experts.w2_weight"), e % El));
        }
        const std::string E = absl::StrCat(L, "mlp.experts.", e, ".");
        ASSERT_TRUE(Same(Cat(gate), full(E + "gate_proj.weight"), E + "gate"));
        ASSERT_TRUE(Same(Cat(up), full(E + "up_proj.weight"), E + "up"));
        ASSERT_TRUE(Same(CatCols(down), full(E + "down_proj.weight"), E + "down"));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, RepackEndToEnd, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.label; });

// --- failure paths: the engine stays byte-identical ----------------------------------------------

struct Fixture {
  ModelConfig config;
  QuantizationConfig quant;
  std::optional<EngineLayout> layout;
  std::unique_ptr<Staging> staging;
  std::unique_ptr<OwnedEngineWeights> engine;
  model::testing::HfModel a, b;  // two versions
};

// Qwen3-MoE, INT4 G=32 on everything but the router / embeddings, T=2, EP=2, rank 1, at version A.
std::unique_ptr<Fixture> MakeFixture() {
  auto f = std::make_unique<Fixture>();
  f->config = *ParseModelConfig(model::testing::kQwen3MoeJson, "fixture");
  f->quant = *ParseQuantizationConfig(model::testing::QuantJson(32, kAllInt4), "fixture");
  f->layout.emplace(*EngineLayout::Create(f->config, &f->quant, {2, 1, 2}));
  f->staging = *Staging::Create(*f->layout);
  f->engine = *OwnedEngineWeights::Allocate(*f->layout);
  f->a = *model::testing::MakeHfModel(f->config, &f->quant, 7001);
  f->b = *model::testing::MakeHfModel(f->config, &f->quant, 7002);
  Loader loader(f->staging.get());
  EXPECT_TRUE(LoadAll(loader, f->a).ok());
  EXPECT_TRUE(Commit(*f->staging, f->engine->weights()).ok());
  return f;
}

TEST(RepackFailureTest, FailedLoadsAndIncompleteCommitLeaveTheEngineUntouched) {
  auto f = MakeFixture();
  const uint64_t version_a = EngineChecksum(f->engine->weights());
  f->staging->ResetCoverage();
  Loader loader(f->staging.get());
  // Version B arrives with a bad tensor in the middle: loading stops, Commit refuses.
  size_t loaded = 0;
  for (const std::string& name : f->b.order) {
    if (loaded == f->b.order.size() / 2) {
      Tensor bad = *Tensor::Zeros(DType::kBF16, {7});
      EXPECT_FALSE(loader.Load(name, bad.view()).ok());
      break;
    }
    ASSERT_TRUE(loader.Load(name, f->b.sent.at(name).view()).ok());
    ++loaded;
  }
  const absl::Status st = Commit(*f->staging, f->engine->weights());
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("commit refused"));
  EXPECT_THAT(st.message(), HasSubstr("pieces missing"));
  EXPECT_EQ(EngineChecksum(f->engine->weights()), version_a);
}

TEST(RepackFailureTest, MismatchedEngineBuffersAreRefusedBeforeWriting) {
  auto f = MakeFixture();
  f->staging->ResetCoverage();
  Loader loader(f->staging.get());
  ASSERT_TRUE(LoadAll(loader, f->b).ok());
  const std::vector<EngineBuffer>& good = f->engine->weights().buffers();
  const uint64_t version_a = EngineChecksum(f->engine->weights());
  const std::string victim = "model.layers.0.mlp.experts.w13_weight_packed";
  struct Mut {
    std::string label, want;
    std::function<void(std::vector<EngineBuffer>&)> edit;
  };
  alignas(64) static std::byte spare[1024];
  const std::vector<Mut> muts = {
      {"wrong shape", "model.layers.0.mlp.experts.w13_weight_packed is I32[4, 16, 512], want I32[4, 16, 1024]",
       [&](auto& v) {
         for (auto& b : v)
           if (b.name == victim) {
             b.shape = {4, 16, 512};
             b.nbytes /= 2;
           }
       }},
      {"wrong dtype", "model.layers.1.mlp.gate_up_proj.weight_scale is F16",
       [&](auto& v) {
         for (auto& b : v)
           if (b.name == "model.layers.1.mlp.gate_up_proj.weight_scale") b.dtype = DType::kF16;
       }},
      {"loaded-form shape", "is I32[4, 32, 512], want I32[4, 16, 1024]",
       [&](auto& v) {
         for (auto& b : v)
           if (b.name == victim) b.shape = {4, 32, 512};  // GPTQ shape: same bytes, not the engine form
       }},
      {"missing", "model.norm.weight is not registered",
       [&](auto& v) { std::erase_if(v, [](const EngineBuffer& b) { return b.name == "model.norm.weight"; }); }},
      {"extra", "model.layers.0.mlp.experts.w13_weight_shape is not a parameter of the layout",
       [&](auto& v) {
         v.push_back({"model.layers.0.mlp.experts.w13_weight_shape", DType::kI64, {2}, spare, 16});
       }},
      {"misaligned", "model.norm.weight is not 2-byte aligned",
       [&](auto& v) {
         for (auto& b : v)
           if (b.name == "model.norm.weight") b.data = spare + 1;
       }},
      {"overlap", "overlap",
       [&](auto& v) {
         for (auto& b : v)
           if (b.name == "model.layers.0.input_layernorm.weight")
             for (auto& o : v)
               if (o.name == "model.layers.1.input_layernorm.weight") b.data = o.data;
       }},
  };
  for (const Mut& mut : muts) {
    SCOPED_TRACE(mut.label);
    std::vector<EngineBuffer> bufs = good;
    mut.edit(bufs);
    EngineWeights w;
    for (auto& b : bufs) ASSERT_TRUE(w.Add(b).ok());
    const absl::Status st = Commit(*f->staging, w);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(), HasSubstr("commit refused"));
    EXPECT_THAT(st.message(), HasSubstr(mut.want));
    EXPECT_EQ(EngineChecksum(f->engine->weights()), version_a);
    // Restore validates the same way (and leaves staging coverage alone).
    EXPECT_FALSE(Restore(w, *f->staging).ok());
    EXPECT_TRUE(f->staging->CheckComplete().ok());
  }
  // Engine memory that overlaps the staging buffers.
  EngineWeights w;
  for (const EngineBuffer& b : good) {
    EngineBuffer c = b;
    if (c.name == "model.norm.weight") c.data = f->staging->Find("model.layers.0.input_layernorm.weight")->data();
    ASSERT_TRUE(w.Add(c).ok());
  }
  const absl::Status st = Commit(*f->staging, w);
  EXPECT_THAT(st.message(), HasSubstr("engine buffer model.norm.weight overlaps staging buffer"));
  EXPECT_EQ(EngineChecksum(f->engine->weights()), version_a);
  // EngineWeights::Add refusals.
  EngineWeights bad;
  EXPECT_THAT(bad.Add({"x", DType::kBF16, {4}, spare, 7}).message(), HasSubstr("7 bytes for BF16[4], which needs 8"));
  EXPECT_TRUE(bad.Add({"x", DType::kBF16, {4}, spare, 8}).ok());
  EXPECT_THAT(bad.Add({"x", DType::kBF16, {4}, spare, 8}).message(), HasSubstr("registered twice"));
  EXPECT_THAT(bad.Add({"y", DType::kBF16, {4}, nullptr, 8}).message(), HasSubstr("has no memory"));
  // And finally the good set commits version B.
  ASSERT_TRUE(Commit(*f->staging, f->engine->weights()).ok());
  EXPECT_NE(EngineChecksum(f->engine->weights()), version_a);
}

TEST(RepackFailureTest, PartialUpdateOnTopOfRestoredWeights) {
  auto f = MakeFixture();
  const EngineLayout& l = *f->layout;
  // Restore the engine's version A into a fresh staging, load only layer 0 of version B, commit.
  auto staging = *Staging::Create(l);
  ASSERT_TRUE(Restore(f->engine->weights(), *staging).ok());
  Loader loader(staging.get());
  for (const std::string& name : f->b.order) {
    if (name.rfind("model.layers.0.", 0) == 0) {
      ASSERT_TRUE(loader.Load(name, f->b.sent.at(name).view()).ok()) << name;
    }
  }
  const std::string dup = "model.layers.0.mlp.experts.5.gate_proj.weight_packed";  // owned by rank 1
  EXPECT_EQ(loader.Load(dup, f->b.sent.at(dup).view()).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(Commit(*staging, f->engine->weights(), {0, true}).ok());
  const auto want_a = Oracle(f->config, 2, 1, 2, f->a), want_b = Oracle(f->config, 2, 1, 2, f->b);
  for (const EngineLinear& lin : l.linears()) {
    const D got = FromTensor(*DequantizeToDense(l, lin.name, f->engine->weights()));
    const bool layer0 = lin.layer == 0;
    EXPECT_TRUE(Same(got, (layer0 ? want_b : want_a).at(lin.name), lin.name));
  }
}

TEST(RepackTest, DequantizeToDenseBf16AndErrors) {
  auto f = MakeFixture();
  const EngineLayout& l = *f->layout;
  const std::string name = "model.layers.0.self_attn.qkv_proj.weight";
  DenseOptions bo;
  bo.out_dtype = DType::kBF16;
  auto f32 = DequantizeToDense(l, name, f->engine->weights());
  auto bf16 = DequantizeToDense(l, name, f->engine->weights(), bo);
  ASSERT_TRUE(f32.ok() && bf16.ok());
  ASSERT_EQ(bf16->dtype(), DType::kBF16);
  const int64_t n = f32->view().numel();
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(bf16->view().data_as<uint16_t>()[i], F32ToBF16(f32->view().data_as<float>()[i])) << i;
  EXPECT_EQ(DequantizeToDense(l, "model.layers.0.self_attn.q_proj.weight", f->engine->weights()).status().code(),
            absl::StatusCode::kNotFound);
  const EngineLinear& lin = l.linears()[static_cast<size_t>(l.FindLinear(name))];
  const TensorView packed = f->staging->param(lin.packed), scale = f->staging->param(lin.scale);
  // Loaded-form views passed as engine form are refused.
  EXPECT_THAT(DequantizeToDense(lin, l, packed, scale, TensorView(), ParamForm::kEngine).status().message(),
              HasSubstr("want I32[16, 512]"));
  bo.out_dtype = DType::kI32;
  EXPECT_FALSE(DequantizeToDense(lin, l, packed, scale, TensorView(), ParamForm::kLoaded, bo).ok());
}

}  // namespace
}  // namespace wsync::engine_model
