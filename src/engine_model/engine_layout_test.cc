// EngineLayout: names, shapes and roles against hand-written tables of ENGINE_LAYOUT.md §5 / §7,
// the rank geometry of §1, and every refusal / warning of §6.
#include "engine_model/engine_layout.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/config.h"
#include "common/default_model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/testing/test_models.h"

namespace wsync::engine_model {
namespace {

using model::testing::QuantJson;
using ::testing::HasSubstr;

ModelConfig Config(const std::string& json) {
  auto c = ParseModelConfig(json, "test");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

QuantizationConfig Quant(int g, const std::vector<std::string>& ignore) {
  auto q = ParseQuantizationConfig(model::testing::QuantJson(g, ignore), "quant");
  EXPECT_TRUE(q.ok()) << q.status();
  return *q;
}

// slime's default INT4 ignore list (tools/convert_hf_to_int4_direct.py), as regexes.
const std::vector<std::string> kSlimeIgnore = {
    "lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens.*", "re:.*norm.*", "re:.*shared_experts.*"};

struct Want {
  std::string name;
  ParamRole role;
  ParamKind kind;
  DType dtype;
  Shape loaded, engine;
};

void ExpectParam(const EngineLayout& l, const Want& w) {
  const int i = l.FindParam(w.name);
  ASSERT_GE(i, 0) << "missing " << w.name;
  const EngineParam& p = l.params()[static_cast<size_t>(i)];
  EXPECT_EQ(p.role, w.role) << w.name << " role " << ParamRoleName(p.role);
  EXPECT_EQ(p.kind, w.kind) << w.name;
  EXPECT_EQ(p.dtype, w.dtype) << w.name;
  EXPECT_EQ(p.loaded_shape, w.loaded) << w.name << " loaded " << ShapeToString(p.loaded_shape);
  EXPECT_EQ(p.engine_shape, w.engine) << w.name << " engine " << ShapeToString(p.engine_shape);
}

constexpr auto kB = DType::kBF16;
constexpr auto kI = DType::kI32;
constexpr auto kPl = ParamKind::kPlain;
constexpr auto kPk = ParamKind::kPacked;
constexpr auto kSc = ParamKind::kScale;

// The embedded default model (Qwen3-MoE, INT4 experts, G=128): every param of TP=2 rank 1.
TEST(EngineLayoutTest, DefaultModelTp2FullParamTable) {
  const ModelConfig c = Config(kDefaultModelConfigJson);
  auto l = EngineLayout::Create(c, &*c.quantization, {2, 1, 1});
  ASSERT_TRUE(l.ok()) << l.status();
  std::vector<Want> want = {{"model.embed_tokens.weight", ParamRole::kVocab, kPl, kB, {2016, 512}, {2016, 512}}};
  for (int i = 0; i < 4; ++i) {
    const std::string L = absl::StrCat("model.layers.", i, ".");
    std::vector<Want> layer = {
        {L + "input_layernorm.weight", ParamRole::kReplicated, kPl, kB, {512}, {512}},
        {L + "self_attn.qkv_proj.weight", ParamRole::kQkv, kPl, kB, {384, 512}, {384, 512}},
        {L + "self_attn.o_proj.weight", ParamRole::kRow, kPl, kB, {512, 256}, {512, 256}},
        {L + "self_attn.q_norm.weight", ParamRole::kReplicated, kPl, kB, {64}, {64}},
        {L + "self_attn.k_norm.weight", ParamRole::kReplicated, kPl, kB, {64}, {64}},
        {L + "post_attention_layernorm.weight", ParamRole::kReplicated, kPl, kB, {512}, {512}},
        {L + "mlp.gate.weight", ParamRole::kReplicated, kPl, kB, {8, 512}, {8, 512}},
        {L + "mlp.experts.w13_weight_packed", ParamRole::kExpertsW13, kPk, kI, {8, 64, 256}, {8, 32, 512}},
        {L + "mlp.experts.w13_weight_scale", ParamRole::kExpertsW13, kSc, kB, {8, 4, 256}, {8, 4, 256}},
        {L + "mlp.experts.w2_weight_packed", ParamRole::kExpertsW2, kPk, kI, {8, 16, 512}, {8, 8, 1024}},
        {L + "mlp.experts.w2_weight_scale", ParamRole::kExpertsW2, kSc, kB, {8, 1, 512}, {8, 1, 512}},
    };
    want.insert(want.end(), layer.begin(), layer.end());
  }
  want.push_back({"model.norm.weight", ParamRole::kReplicated, kPl, kB, {512}, {512}});
  want.push_back({"lm_head.weight", ParamRole::kVocab, kPl, kB, {2016, 512}, {2016, 512}});
  ASSERT_EQ(l->params().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(l->params()[i].name, want[i].name) << i;
    ExpectParam(*l, want[i]);
  }
  // Marlin geometry of w13: SGLang's scale perm size_k quirk (4I' = 512 > G -> grouped); w2 I' = 128 = G -> single.
  const EngineParam& w13 =
      l->params()[static_cast<size_t>(l->FindParam("model.layers.0.mlp.experts.w13_weight_scale"))];
  EXPECT_EQ(w13.marlin.scale_perm_size_k, 512);
  EXPECT_TRUE(w13.marlin.grouped_scale_perm);
  const EngineParam& w2 = l->params()[static_cast<size_t>(l->FindParam("model.layers.0.mlp.experts.w2_weight_scale"))];
  EXPECT_EQ(w2.marlin.scale_perm_size_k, 128);
  EXPECT_FALSE(w2.marlin.grouped_scale_perm);
  EXPECT_TRUE(l->warnings().empty()) << l->warnings()[0];
  EXPECT_EQ(l->TotalBytes(ParamForm::kLoaded), l->TotalBytes(ParamForm::kEngine));
}

// §7 worked example: Qwen3-30B-A3B, T=4, EP=4, INT4 G=128 on experts only.
const char kQwen3_30B[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
  "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
  "vocab_size": 151936, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

TEST(EngineLayoutTest, WorkedExampleQwen3_30B_A3B) {
  const ModelConfig c = Config(kQwen3_30B);
  const QuantizationConfig q = Quant(128, kSlimeIgnore);
  for (int r = 0; r < 4; ++r) {
    auto l = EngineLayout::Create(c, &q, {4, r, 4});
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->moe_tp_size(), 1);
    EXPECT_EQ(l->ep_rank(), r);
    EXPECT_EQ(l->local_experts(), 32);
    EXPECT_EQ(l->first_local_expert(), 32 * r);
    EXPECT_EQ(l->vocab_per_rank(), 37984);
    const std::string L = "model.layers.47.";
    ExpectParam(*l, {L + "self_attn.qkv_proj.weight", ParamRole::kQkv, kPl, kB, {1280, 2048}, {1280, 2048}});
    ExpectParam(*l, {L + "self_attn.o_proj.weight", ParamRole::kRow, kPl, kB, {2048, 1024}, {2048, 1024}});
    ExpectParam(
        *l, {L + "mlp.experts.w13_weight_packed", ParamRole::kExpertsW13, kPk, kI, {32, 256, 1536}, {32, 128, 3072}});
    ExpectParam(*l,
                {L + "mlp.experts.w13_weight_scale", ParamRole::kExpertsW13, kSc, kB, {32, 16, 1536}, {32, 16, 1536}});
    ExpectParam(*l,
                {L + "mlp.experts.w2_weight_packed", ParamRole::kExpertsW2, kPk, kI, {32, 96, 2048}, {32, 48, 4096}});
    ExpectParam(*l, {L + "mlp.experts.w2_weight_scale", ParamRole::kExpertsW2, kSc, kB, {32, 6, 2048}, {32, 6, 2048}});
    // kv head r on rank r, no replication: k rows come from k_proj[r*128, +128].
    const HfSource& k = l->sources()[static_cast<size_t>(l->FindSource(L + "self_attn.k_proj.weight"))];
    EXPECT_EQ(k.src_row0, 128 * r);
    EXPECT_EQ(k.rows, 128);
    EXPECT_EQ(k.dst_row0, 8 * 128);
  }
  // T=4, EP=1: I' = 192 is not a multiple of 128: not loadable (§6 example).
  auto bad = EngineLayout::Create(c, &q, {4, 0, 1});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("I' = I / moe_tp = 768 / 4 = 192"));
  EXPECT_THAT(bad.status().message(), HasSubstr("group size 128"));
  // T=2 (I' = 384) loads.
  EXPECT_TRUE(EngineLayout::Create(c, &q, {2, 1, 1}).ok());
}

// The same model as an AWQ engine (vLLM / SGLang awq_marlin, AWQ.md §2-4), T=4, EP=4: K-major AWQ
// tensors loaded as they are in the checkpoint, Marlin qweight and zero points in the engine; lm_head,
// embeddings and the router stay bf16 without being listed in modules_to_not_convert.
TEST(EngineLayoutTest, WorkedExampleQwen3_30B_A3B_Awq) {
  const ModelConfig c = Config(kQwen3_30B);
  auto q = ParseQuantizationConfig(model::testing::AwqQuantJson(128, {}), "awq");
  ASSERT_TRUE(q.ok()) << q.status();
  constexpr auto kZp = ParamKind::kZeros;
  for (int r = 0; r < 4; ++r) {
    auto l = EngineLayout::Create(c, &*q, {4, r, 4});
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->int4_format(), Int4Format::kAwq);
    const std::string L = "model.layers.47.";
    ExpectParam(*l, {L + "self_attn.qkv_proj.qweight", ParamRole::kQkv, kPk, kI, {2048, 160}, {128, 2560}});
    ExpectParam(*l, {L + "self_attn.qkv_proj.qzeros", ParamRole::kQkv, kZp, kI, {16, 160}, {16, 160}});
    ExpectParam(*l, {L + "self_attn.qkv_proj.scales", ParamRole::kQkv, kSc, kB, {16, 1280}, {16, 1280}});
    ExpectParam(*l, {L + "self_attn.o_proj.qweight", ParamRole::kRow, kPk, kI, {1024, 256}, {64, 4096}});
    ExpectParam(*l, {L + "self_attn.o_proj.qzeros", ParamRole::kRow, kZp, kI, {8, 256}, {8, 256}});
    ExpectParam(*l, {L + "mlp.experts.w13_qweight", ParamRole::kExpertsW13, kPk, kI, {32, 2048, 192}, {32, 128, 3072}});
    ExpectParam(*l, {L + "mlp.experts.w13_qzeros", ParamRole::kExpertsW13, kZp, kI, {32, 16, 192}, {32, 16, 192}});
    ExpectParam(*l, {L + "mlp.experts.w13_scales", ParamRole::kExpertsW13, kSc, kB, {32, 16, 1536}, {32, 16, 1536}});
    ExpectParam(*l, {L + "mlp.experts.w2_qweight", ParamRole::kExpertsW2, kPk, kI, {32, 768, 256}, {32, 48, 4096}});
    ExpectParam(*l, {L + "mlp.experts.w2_scales", ParamRole::kExpertsW2, kSc, kB, {32, 6, 2048}, {32, 6, 2048}});
    ExpectParam(*l, {L + "mlp.gate.weight", ParamRole::kReplicated, kPl, kB, {128, 2048}, {128, 2048}});
    ExpectParam(*l, {"lm_head.weight", ParamRole::kVocab, kPl, kB, {37984, 2048}, {37984, 2048}});
    EXPECT_LT(l->FindParam(L + "self_attn.qkv_proj.weight_packed"), 0);
    // vLLM's AWQ-Marlin MoE permutes both scales with size_k = I' (AWQ.md §4).
    const EngineParam& s13 = l->params()[static_cast<size_t>(l->FindParam(L + "mlp.experts.w13_scales"))];
    EXPECT_EQ(s13.marlin.scale_perm_size_k, 768);
    EXPECT_TRUE(s13.marlin.awq);
    // k_proj's AWQ tensors: all K rows, kv head r's 128 output features = word columns 16r .. 16r+15,
    // landing after the 8 q heads (word column 128); its scales by feature, its zeros by word.
    const HfSource& k = l->sources()[static_cast<size_t>(l->FindSource(L + "self_attn.k_proj.qweight"))];
    EXPECT_EQ(k.shape, (Shape{2048, 64}));
    EXPECT_EQ(k.src_row0, 0);
    EXPECT_EQ(k.rows, 2048);
    EXPECT_EQ(k.src_col0, 16 * r);
    EXPECT_EQ(k.cols, 16);
    EXPECT_EQ(k.dst_col0, 128);
    EXPECT_FALSE(k.transpose);
    const HfSource& ks = l->sources()[static_cast<size_t>(l->FindSource(L + "self_attn.k_proj.scales"))];
    EXPECT_EQ(ks.shape, (Shape{16, 512}));
    EXPECT_EQ(ks.src_col0, 128 * r);
    EXPECT_EQ(ks.cols, 128);
    EXPECT_EQ(ks.dst_col0, 1024);
    // o_proj is row parallel: rank r takes K rows [1024 r, +1024) of qweight and 8 group rows.
    const HfSource& o = l->sources()[static_cast<size_t>(l->FindSource(L + "self_attn.o_proj.qzeros"))];
    EXPECT_EQ(o.src_row0, 8 * r);
    EXPECT_EQ(o.rows, 8);
    EXPECT_EQ(o.cols, 256);
    // Another EP rank's expert: its three AWQ tensors are checked and skipped.
    const int other = (r + 1) % 4 * 32;
    const HfSource& skip =
        l->sources()[static_cast<size_t>(l->FindSource(absl::StrCat(L, "mlp.experts.", other, ".up_proj.qzeros")))];
    EXPECT_EQ(skip.action, HfSource::Action::kSkip);
    EXPECT_EQ(skip.shape, (Shape{16, 96}));
  }
  // T=4, EP=1: I' = 192 is not a multiple of 128, for AWQ as for compressed-tensors.
  auto bad = EngineLayout::Create(c, &*q, {4, 0, 1});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("I' = I / moe_tp = 768 / 4 = 192"));
  // AWQ versions other than gemm are refused.
  auto gemv = ParseQuantizationConfig(
      R"({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemv"})", "awq");
  ASSERT_TRUE(gemv.ok());
  auto refused = EngineLayout::Create(c, &*gemv, {4, 0, 4});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(refused.status().message(), HasSubstr("gemv"));
}

// The same model in an engine that holds TensorRT-LLM's W4A16 layout (TRTLLM_INT4.md), T=4, EP=4:
// compressed-tensors sources, GPTQ-orientation codes when loaded (so every INT4 source is a
// transposed copy), int8 [K, N/2] in the engine, w3_w1 with up_proj's columns first.
TEST(EngineLayoutTest, WorkedExampleQwen3_30B_A3B_Trtllm) {
  const ModelConfig c = Config(kQwen3_30B);
  std::string json = QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"});
  json.insert(1, R"("engine_layout": "trtllm-sm90", )");
  auto q = ParseQuantizationConfig(json, "trtllm");
  ASSERT_TRUE(q.ok()) << q.status();
  for (int r = 0; r < 4; ++r) {
    auto l = EngineLayout::Create(c, &*q, {4, r, 4});
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->int4_format(), Int4Format::kTrtllm);
    const std::string L = "model.layers.47.";
    ExpectParam(*l, {L + "self_attn.qkv_proj.weight", ParamRole::kQkv, kPk, kI, {256, 1280}, {2048, 640}});
    ExpectParam(*l, {L + "self_attn.qkv_proj.weight_scale", ParamRole::kQkv, kSc, kB, {16, 1280}, {16, 1280}});
    ExpectParam(*l, {L + "self_attn.o_proj.weight", ParamRole::kRow, kPk, kI, {128, 2048}, {1024, 1024}});
    ExpectParam(*l,
                {L + "mlp.experts.w3_w1_weight", ParamRole::kExpertsW13, kPk, kI, {32, 256, 1536}, {32, 2048, 768}});
    ExpectParam(
        *l, {L + "mlp.experts.w3_w1_weight_scale", ParamRole::kExpertsW13, kSc, kB, {32, 16, 1536}, {32, 16, 1536}});
    ExpectParam(*l, {L + "mlp.experts.w2_weight", ParamRole::kExpertsW2, kPk, kI, {32, 96, 2048}, {32, 768, 1024}});
    ExpectParam(*l, {L + "mlp.experts.w2_weight_scale", ParamRole::kExpertsW2, kSc, kB, {32, 6, 2048}, {32, 6, 2048}});
    const EngineParam& qkv = l->params()[static_cast<size_t>(l->FindParam(L + "self_attn.qkv_proj.weight"))];
    EXPECT_EQ(qkv.dtype_in(ParamForm::kEngine), DType::kI8);
    EXPECT_EQ(qkv.dtype_in(ParamForm::kLoaded), DType::kI32);
    EXPECT_TRUE(qkv.marlin.trtllm_sm90);
    EXPECT_LT(l->FindParam(L + "mlp.experts.w13_weight_packed"), 0);
    // up_proj of a local expert lands in w3_w1's first 768 columns, gate_proj after it.
    const int64_t e = 32 * r + 5;
    const HfSource& up =
        l->sources()[static_cast<size_t>(l->FindSource(absl::StrCat(L, "mlp.experts.", e, ".up_proj.weight_packed")))];
    const HfSource& gate = l->sources()[static_cast<size_t>(
        l->FindSource(absl::StrCat(L, "mlp.experts.", e, ".gate_proj.weight_packed")))];
    EXPECT_EQ(up.dst_col0, 0);
    EXPECT_EQ(gate.dst_col0, 768);
    EXPECT_TRUE(up.transpose);
    EXPECT_EQ(up.expert, 5);
    // Dense sources are transposed copies too: k_proj's kv head r lands after the 8 q heads.
    const HfSource& k = l->sources()[static_cast<size_t>(l->FindSource(L + "self_attn.k_proj.weight_packed"))];
    EXPECT_TRUE(k.transpose);
    EXPECT_EQ(k.src_row0, 128 * r);
    EXPECT_EQ(k.dst_col0, 1024);
    EXPECT_TRUE(l->warnings().empty()) << l->warnings()[0];  // no Marlin advisories for this layout
  }
  // The layout's own constraint: K and N multiples of 64 on every rank (T=4, EP=1: I' = 192 is
  // refused first, by the group size).
  auto bad = EngineLayout::Create(c, &*q, {4, 0, 1});
  ASSERT_FALSE(bad.ok());
}

// §7 worked example: DeepSeek-V3, T=8, EP=1, bf16 (shared-experts fusion off: see README.md).
const char kDeepseekV3Full[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
  "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
  "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
  "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
  "topk_method": "noaux_tc", "vocab_size": 129280, "num_nextn_predict_layers": 1,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

TEST(EngineLayoutTest, WorkedExampleDeepseekV3) {
  const ModelConfig c = Config(kDeepseekV3Full);
  auto l = EngineLayout::Create(c, nullptr, {8, 3, 1});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_FALSE(l->shared_experts_fused());
  EXPECT_EQ(l->vocab_per_rank(), 16160);
  const std::string A = "model.layers.0.self_attn.", M = "model.layers.3.mlp.";
  ExpectParam(*l, {A + "fused_qkv_a_proj_with_mqa.weight", ParamRole::kFusedQkvA, kPl, kB, {2112, 7168}, {2112, 7168}});
  ExpectParam(*l, {A + "q_a_layernorm.weight", ParamRole::kReplicated, kPl, kB, {1536}, {1536}});
  ExpectParam(*l, {A + "q_b_proj.weight", ParamRole::kColumn, kPl, kB, {3072, 1536}, {3072, 1536}});
  ExpectParam(*l, {A + "kv_a_layernorm.weight", ParamRole::kReplicated, kPl, kB, {512}, {512}});
  ExpectParam(*l, {A + "kv_b_proj.weight", ParamRole::kColumn, kPl, kB, {4096, 512}, {4096, 512}});
  ExpectParam(*l, {A + "o_proj.weight", ParamRole::kRow, kPl, kB, {7168, 2048}, {7168, 2048}});
  ExpectParam(*l, {"model.layers.2.mlp.gate_up_proj.weight", ParamRole::kGateUp, kPl, kB, {4608, 7168}, {4608, 7168}});
  ExpectParam(*l, {"model.layers.2.mlp.down_proj.weight", ParamRole::kRow, kPl, kB, {7168, 2304}, {7168, 2304}});
  ExpectParam(*l, {M + "gate.weight", ParamRole::kReplicated, kPl, kB, {256, 7168}, {256, 7168}});
  ExpectParam(*l, {M + "gate.e_score_correction_bias", ParamRole::kReplicated, kPl, DType::kF32, {256}, {256}});
  ExpectParam(*l, {M + "experts.w13_weight", ParamRole::kExpertsW13, kPl, kB, {256, 512, 7168}, {256, 512, 7168}});
  ExpectParam(*l, {M + "experts.w2_weight", ParamRole::kExpertsW2, kPl, kB, {256, 7168, 256}, {256, 7168, 256}});
  ExpectParam(*l, {M + "shared_experts.gate_up_proj.weight", ParamRole::kGateUp, kPl, kB, {512, 7168}, {512, 7168}});
  ExpectParam(*l, {M + "shared_experts.down_proj.weight", ParamRole::kRow, kPl, kB, {7168, 256}, {7168, 256}});
  EXPECT_LT(l->FindParam("model.layers.2.mlp.gate.weight"), 0);  // dense layer: no router
  EXPECT_LT(l->FindParam("model.layers.61.eh_proj.weight"), 0);  // MTP layer: not loaded
  EXPECT_TRUE(l->IsIgnoredHfName("model.layers.61.eh_proj.weight"));
  EXPECT_FALSE(l->IsIgnoredHfName("model.layers.62.eh_proj.weight"));
  EXPECT_FALSE(l->IsIgnoredHfName("model.layers.60.eh_proj.weight"));
  // q_a rows 0..1535 then kv_a rows at 1536 of the fused tensor, whole on every rank.
  const HfSource& kva = l->sources()[static_cast<size_t>(l->FindSource(A + "kv_a_proj_with_mqa.weight"))];
  EXPECT_EQ(kva.dst_row0, 1536);
  EXPECT_EQ(kva.rows, 576);
  // kv_b: head-major rows r*nl*kvd.
  const HfSource& kvb = l->sources()[static_cast<size_t>(l->FindSource(A + "kv_b_proj.weight"))];
  EXPECT_EQ(kvb.src_row0, 3 * 4096);
}

// The NextN draft (mtp_draft, README.md decision 20) of DeepSeek-V3 at T=8 rank 3: the MTP layer 61
// as SGLang's DeepseekV3ForCausalLMNextN holds it, beside the target's layers.
TEST(EngineLayoutTest, MtpDraftDeepseekV3) {
  const ModelConfig c = Config(kDeepseekV3Full);
  EngineParallel p{8, 3, 1};
  p.mtp_draft = true;
  auto l = EngineLayout::Create(c, nullptr, p);
  ASSERT_TRUE(l.ok()) << l.status();
  auto plain = EngineLayout::Create(c, nullptr, {8, 3, 1});
  ASSERT_TRUE(plain.ok());
  const std::string D = "model.layers.61.", A = D + "self_attn.", M = D + "mlp.";
  ExpectParam(*l, {D + "enorm.weight", ParamRole::kReplicated, kPl, kB, {7168}, {7168}});
  ExpectParam(*l, {D + "hnorm.weight", ParamRole::kReplicated, kPl, kB, {7168}, {7168}});
  ExpectParam(*l, {D + "eh_proj.weight", ParamRole::kReplicated, kPl, kB, {7168, 14336}, {7168, 14336}});
  ExpectParam(*l, {D + "shared_head.norm.weight", ParamRole::kReplicated, kPl, kB, {7168}, {7168}});
  // the decoder layer: sharded as the target's layers, and MoE
  ExpectParam(*l, {A + "fused_qkv_a_proj_with_mqa.weight", ParamRole::kFusedQkvA, kPl, kB, {2112, 7168}, {2112, 7168}});
  ExpectParam(*l, {A + "kv_b_proj.weight", ParamRole::kColumn, kPl, kB, {4096, 512}, {4096, 512}});
  ExpectParam(*l, {M + "experts.w13_weight", ParamRole::kExpertsW13, kPl, kB, {256, 512, 7168}, {256, 512, 7168}});
  ExpectParam(*l, {M + "shared_experts.down_proj.weight", ParamRole::kRow, kPl, kB, {7168, 256}, {7168, 256}});
  const HfSource& eh = l->sources()[static_cast<size_t>(l->FindSource(D + "eh_proj.weight"))];
  EXPECT_EQ(eh.action, HfSource::Action::kCopy);
  EXPECT_EQ(eh.rows, 7168);
  EXPECT_EQ(eh.cols, 14336);
  // the draft's embed_tokens and lm_head are the target's: a checkpoint's copies are accepted unchecked
  EXPECT_LT(l->FindSource(D + "embed_tokens.weight"), 0);
  EXPECT_TRUE(l->IsIgnoredHfName(D + "embed_tokens.weight"));
  EXPECT_TRUE(l->IsIgnoredHfName(D + "shared_head.head.weight"));
  // exactly the draft's params are added, after the target's
  ASSERT_GT(l->params().size(), plain->params().size());
  for (size_t i = 0; i < l->params().size(); ++i) {
    if (i < plain->params().size()) {
      EXPECT_EQ(l->params()[i].name, plain->params()[i].name);
    } else {
      EXPECT_EQ(l->params()[i].layer, 61) << l->params()[i].name;
    }
  }
  // a checkpoint without an MTP layer has no draft to serve
  ModelConfig none = c;
  none.num_nextn_predict_layers = 0;
  auto refused = EngineLayout::Create(none, nullptr, p);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("num_nextn_predict_layers=0"));
}

// GLM-4.5 (355B-A32B's shape, ENGINE_LAYOUT.md §2.7) at TP 8 x EP 8, rank 3: GQA with q/k/v bias
// (no o_proj bias) and QK norm, then DeepSeek-V3's MoE (fp32 correction bias, one shared expert).
const char kGlm45Full[] = R"({
  "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": true,
  "head_dim": 128, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
  "n_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "norm_topk_prob": true,
  "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8,
  "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "first_k_dense_replace": 3,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 2.5, "tie_word_embeddings": false,
  "topk_group": 1, "torch_dtype": "bfloat16", "use_qk_norm": true, "vocab_size": 151552})";

TEST(EngineLayoutTest, WorkedExampleGlm45) {
  const ModelConfig c = Config(kGlm45Full);
  auto l = EngineLayout::Create(c, nullptr, {8, 3, 8});
  ASSERT_TRUE(l.ok()) << l.status();
  const std::string A = "model.layers.5.self_attn.", M = "model.layers.5.mlp.";
  // q 96 / 8 = 12 heads, k and v 8 / 8 = 1 head each, of 128
  ExpectParam(*l, {A + "qkv_proj.weight", ParamRole::kQkv, kPl, kB, {1792, 5120}, {1792, 5120}});
  ExpectParam(*l, {A + "qkv_proj.bias", ParamRole::kQkv, kPl, kB, {1792}, {1792}});
  ExpectParam(*l, {A + "o_proj.weight", ParamRole::kRow, kPl, kB, {5120, 1536}, {5120, 1536}});
  EXPECT_LT(l->FindParam(A + "o_proj.bias"), 0);
  ExpectParam(*l, {A + "q_norm.weight", ParamRole::kReplicated, kPl, kB, {128}, {128}});
  ExpectParam(*l, {A + "k_norm.weight", ParamRole::kReplicated, kPl, kB, {128}, {128}});
  ExpectParam(*l, {"model.layers.2.mlp.gate_up_proj.weight", ParamRole::kGateUp, kPl, kB, {3072, 5120}, {3072, 5120}});
  EXPECT_LT(l->FindParam("model.layers.2.mlp.gate.weight"), 0);  // dense layers 0-2: no router
  ExpectParam(*l, {M + "gate.weight", ParamRole::kReplicated, kPl, kB, {160, 5120}, {160, 5120}});
  ExpectParam(*l, {M + "gate.e_score_correction_bias", ParamRole::kReplicated, kPl, DType::kF32, {160}, {160}});
  // EP 8: 20 local experts of the whole width (moe_tp 1)
  ExpectParam(*l, {M + "experts.w13_weight", ParamRole::kExpertsW13, kPl, kB, {20, 3072, 5120}, {20, 3072, 5120}});
  ExpectParam(*l, {M + "experts.w2_weight", ParamRole::kExpertsW2, kPl, kB, {20, 5120, 1536}, {20, 5120, 1536}});
  ExpectParam(*l, {M + "shared_experts.gate_up_proj.weight", ParamRole::kGateUp, kPl, kB, {384, 5120}, {384, 5120}});
  ExpectParam(*l, {M + "shared_experts.down_proj.weight", ParamRole::kRow, kPl, kB, {5120, 192}, {5120, 192}});
  EXPECT_EQ(l->first_local_expert(), 60);
  EXPECT_TRUE(l->IsIgnoredHfName("model.layers.92.eh_proj.weight"));  // the MTP layer: not the main model's
  auto tied =
      Config(absl::StrReplaceAll(kGlm45Full, {{R"("tie_word_embeddings": false)", R"("tie_word_embeddings": true)"}}));
  EXPECT_THAT(EngineLayout::Create(tied, nullptr, {8, 3, 8}).status().message(), HasSubstr("tie_word_embeddings"));
}

TEST(EngineLayoutTest, MoeRankGeometryAndExpertSources) {
  const ModelConfig c = Config(model::testing::kQwen3MoeJson);
  const QuantizationConfig q = Quant(128, kSlimeIgnore);
  // T=4, EP=2: moe_tp = 2; MoE-TP groups are contiguous {0,1}, {2,3}; EP groups strided.
  const int want_t[] = {0, 1, 0, 1}, want_ep[] = {0, 0, 1, 1};
  for (int r = 0; r < 4; ++r) {
    auto l = EngineLayout::Create(c, &q, {4, r, 2});
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->moe_tp_rank(), want_t[r]);
    EXPECT_EQ(l->ep_rank(), want_ep[r]);
    EXPECT_EQ(l->first_local_expert(), 4 * want_ep[r]);
    for (int e = 0; e < 8; ++e) {
      const HfSource& up = l->sources()[static_cast<size_t>(
          l->FindSource(absl::StrCat("model.layers.0.mlp.experts.", e, ".up_proj.weight_packed")))];
      const HfSource& down = l->sources()[static_cast<size_t>(
          l->FindSource(absl::StrCat("model.layers.0.mlp.experts.", e, ".down_proj.weight_scale")))];
      const bool owned = e / 4 == want_ep[r];
      EXPECT_EQ(up.action, owned ? HfSource::Action::kCopy : HfSource::Action::kSkip) << r << " " << e;
      EXPECT_EQ(up.shape, (Shape{256, 32}));
      if (!owned) continue;
      EXPECT_EQ(up.expert, e % 4);
      EXPECT_TRUE(up.transpose);
      EXPECT_EQ(up.src_row0, 128 * want_t[r]);  // I' = 128 rows of up_e
      EXPECT_EQ(up.rows, 128);
      EXPECT_EQ(up.cols, 32);               // all H/8 words
      EXPECT_EQ(up.dst_col0, 128);          // second half of 2I'
      EXPECT_EQ(down.src_col0, want_t[r]);  // I'/G = 1 group per rank
      EXPECT_EQ(down.cols, 1);
      EXPECT_EQ(down.rows, 256);  // all H rows
    }
  }
}

TEST(EngineLayoutTest, QkvReplicationAndVocabPadding) {
  const ModelConfig c = Config(model::testing::kLlamaJson);  // nh 8, nkv 2, hd 64, V 1000
  for (int r = 0; r < 4; ++r) {
    auto l = EngineLayout::Create(c, nullptr, {4, r, 1});
    ASSERT_TRUE(l.ok()) << l.status();
    const auto& s = l->sources();
    const HfSource& q = s[static_cast<size_t>(l->FindSource("model.layers.1.self_attn.q_proj.weight"))];
    const HfSource& v = s[static_cast<size_t>(l->FindSource("model.layers.1.self_attn.v_proj.weight"))];
    const HfSource& vb = s[static_cast<size_t>(l->FindSource("model.layers.1.self_attn.v_proj.bias"))];
    EXPECT_EQ(q.src_row0, r * 128);
    EXPECT_EQ(v.src_row0, (r / 2) * 64) << "s = r // replicas, replicas = 2";
    EXPECT_EQ(v.dst_row0, 192);
    EXPECT_EQ(vb.src_row0, v.src_row0);
    EXPECT_EQ(vb.dst_row0, 192);
    const HfSource& emb = s[static_cast<size_t>(l->FindSource("model.embed_tokens.weight"))];
    EXPECT_EQ(l->vocab_per_rank(), 256);
    EXPECT_EQ(emb.src_row0, 256 * r);
    EXPECT_EQ(emb.rows, r == 3 ? 1000 - 768 : 256);
    ExpectParam(*l, {"model.layers.1.self_attn.o_proj.bias", ParamRole::kRow, kPl, kB, {256}, {256}});
    // mlp_bias (F 512, 128 rows per rank): gate_up's bias takes gate's then up's rows of this rank,
    // down_proj's bias is whole, like o_proj's
    ExpectParam(*l, {"model.layers.1.mlp.gate_up_proj.bias", ParamRole::kGateUp, kPl, kB, {256}, {256}});
    ExpectParam(*l, {"model.layers.1.mlp.down_proj.bias", ParamRole::kRow, kPl, kB, {256}, {256}});
    const HfSource& gb = s[static_cast<size_t>(l->FindSource("model.layers.1.mlp.gate_proj.bias"))];
    const HfSource& ub = s[static_cast<size_t>(l->FindSource("model.layers.1.mlp.up_proj.bias"))];
    EXPECT_EQ(gb.src_row0, r * 128);
    EXPECT_EQ(gb.dst_row0, 0);
    EXPECT_EQ(ub.src_row0, r * 128);
    EXPECT_EQ(ub.dst_row0, 128);
    EXPECT_EQ(gb.rows, 128);
  }
  // Qwen2 tied: no lm_head param; a sent lm_head.weight is a known, skipped tensor.
  auto t = EngineLayout::Create(Config(model::testing::kQwen2Json), nullptr, {2, 0, 1});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_LT(t->FindParam("lm_head.weight"), 0);
  EXPECT_EQ(t->sources()[static_cast<size_t>(t->FindSource("lm_head.weight"))].action, HfSource::Action::kSkip);
  EXPECT_LT(t->FindParam("model.layers.0.self_attn.o_proj.bias"), 0);  // Qwen2: qkv bias only
}

struct RefusalCase {
  std::string label;
  std::string config_json;
  std::string quant_json;  // "" = bf16
  EngineParallel parallel;
  std::string want;  // substring of the error
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

std::string Edit(std::string json, const std::string& from, const std::string& to) {
  const size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) json.replace(at, from.size(), to);
  return json;
}

std::vector<RefusalCase> RefusalCases() {
  using model::testing::kDeepseekJson;
  using model::testing::kLlamaJson;
  using model::testing::kQwen3MoeJson;
  const std::string all_int4 = model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"});
  const std::string moe_int4 = model::testing::QuantJson(128, kSlimeIgnore);
  std::string llama12 =
      Edit(Edit(model::testing::kLlamaJson, R"("num_attention_heads": 8)", R"("num_attention_heads": 12)"),
           R"("head_dim": 64)", R"("head_dim": 32)");
  std::string trtllm = model::testing::QuantJson(32, {"lm_head", "re:.*embed_tokens.*"});
  trtllm.insert(1, R"("engine_layout": "trtllm-sm80", )");
  return {
      {"trtllm K, N % 64",
       Edit(kLlamaJson, R"("head_dim": 64)", R"("head_dim": 32)"),
       trtllm,
       {8, 0, 1},
       "TensorRT-LLM W4A16 layout needs K % 64 == 0 and N % 64 == 0, [K, N] = [256, 96]"},
      {"tp size", model::testing::kLlamaJson, "", {0, 0, 1}, "tp_size must be >= 1"},
      {"tp rank", model::testing::kLlamaJson, "", {2, 2, 1}, "tp_rank 2 is outside [0, 2)"},
      {"nh % T", kLlamaJson, "", {3, 0, 1}, "num_attention_heads 8 is not divisible by T 3"},
      {"T % nkv",
       Edit(Edit(kLlamaJson, R"("num_attention_heads": 8)", R"("num_attention_heads": 24)"),
            R"("num_key_value_heads": 2)", R"("num_key_value_heads": 8)"),
       "",
       {12, 0, 1},
       "T 12 >= num_key_value_heads 8 needs T % num_key_value_heads == 0"},
      {"nkv % T",
       Edit(llama12, R"("num_key_value_heads": 2)", R"("num_key_value_heads": 6)"),
       "",
       {4, 0, 1},
       "num_key_value_heads 6 is not divisible by T 4"},
      {"F % T",
       Edit(kLlamaJson, R"("intermediate_size": 512)", R"("intermediate_size": 510)"),
       "",
       {4, 0, 1},
       "intermediate_size F 510 is not divisible by T 4"},
      {"pad(V,64) % T",
       Edit(Edit(llama12, R"("num_key_value_heads": 2)", R"("num_key_value_heads": 6)"), R"("intermediate_size": 512)",
            R"("intermediate_size": 768)"),
       "",
       {3, 0, 1},
       "padded vocab pad(1000, 64) = 1024 is not divisible by T 3"},
      {"S % T",
       Edit(Edit(model::testing::kDeepseekJson, R"("moe_intermediate_size": 256)", R"("moe_intermediate_size": 250)"),
            R"("n_shared_experts": 2)", R"("n_shared_experts": 1)"),
       "",
       {4, 0, 4},
       "shared experts intermediate S = n_shared_experts * I = 250 is not divisible by T 4"},
      {"E % EP",
       Edit(model::testing::kQwen3MoeJson, R"("num_experts": 8)", R"("num_experts": 6)"),
       "",
       {4, 0, 4},
       "E_total 6 experts are not divisible by ep_size 4"},
      {"T % EP", model::testing::kQwen3MoeJson, "", {4, 0, 3}, "ep_size 3 does not divide T 4"},
      {"I % moe_tp",
       Edit(model::testing::kQwen3MoeJson, R"("moe_intermediate_size": 256)", R"("moe_intermediate_size": 250)"),
       "",
       {4, 0, 1},
       "moe_intermediate_size I 250 is not divisible by moe_tp = T/EP = 4"},
      {"EP on dense", kLlamaJson, "", {2, 0, 2}, "ep_size 2 > 1 needs an MoE model"},
      {"Qwen3-MoE tied",
       Edit(kQwen3MoeJson, R"("tie_word_embeddings": false)", R"("tie_word_embeddings": true)"),
       "",
       {1, 0, 1},
       "always builds its own lm_head"},
      {"mixed qkv",
       kLlamaJson,
       model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*k_proj"}),
       {1, 0, 1},
       "mixed quantization in fused layer model.layers.0.self_attn.qkv_proj"},
      {"mixed gate_up",
       kLlamaJson,
       model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*up_proj"}),
       {1, 0, 1},
       "mixed quantization in fused layer model.layers.0.mlp.gate_up_proj"},
      {"mixed experts",
       kQwen3MoeJson,
       model::testing::QuantJson(128, {"lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens.*",
                                       "model.layers.2.mlp.experts.5.down_proj"}),
       {1, 0, 1},
       "bf16 (ignored) for model.layers.2.mlp.experts.5.down_proj.weight"},
      {"mixed shared experts",
       model::testing::kDeepseekJson,
       model::testing::QuantJson(128, {"lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens.*",
                                       "re:.*shared_experts.gate_proj"}),
       {1, 0, 1},
       "mixed quantization in fused layer model.layers.1.mlp.shared_experts.gate_up_proj"},
      {"INT4 router",
       kQwen3MoeJson,
       model::testing::QuantJson(128, {"lm_head", "re:.*self_attn.*", "re:.*embed_tokens.*"}),
       {1, 0, 1},
       "INT4 router model.layers.0.mlp.gate refused"},
      {"INT4 embedding", kLlamaJson, model::testing::QuantJson(128, {"lm_head"}), {1, 0, 1}, "INT4 embedding refused"},
      {"INT4 lm_head",
       kLlamaJson,
       model::testing::QuantJson(128, {"re:.*embed_tokens.*"}),
       {1, 0, 1},
       "INT4 lm_head refused"},
      {"INT4 q_a",
       model::testing::kDeepseekJson,
       model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"}),
       {1, 0, 1},
       "INT4 model.layers.0.self_attn.q_a_proj refused"},
      {"INT4 kv_a fused",
       kDeepseekJson,
       model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$", "re:.*q_a_proj"}),
       {1, 0, 1},
       "INT4 model.layers.0.self_attn.kv_a_proj_with_mqa refused"},
      {"INT4 kv_b",
       kDeepseekJson,
       model::testing::QuantJson(
           128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$", "re:.*q_a_proj", "re:.*kv_a_proj_with_mqa"}),
       {1, 0, 1},
       "INT4 model.layers.0.self_attn.kv_b_proj refused"},
      {"row K_p % G", kLlamaJson, all_int4, {8, 0, 1}, "model.layers.0.self_attn.o_proj.weight: the INT4 shard"},
      {"row K_p % 8",
       Edit(kLlamaJson, R"("intermediate_size": 512)", R"("intermediate_size": 48)"),
       model::testing::QuantJson(
           -1, {"lm_head", "re:.*embed_tokens.*", "re:.*self_attn.*", "re:.*gate_proj", "re:.*up_proj"}),
       {4, 0, 1},
       "(K_p = 12), not a multiple of 8"},
      {"MoE I' % G",
       kQwen3MoeJson,
       moe_int4,
       {4, 0, 1},
       "INT4 needs I' = I / moe_tp = 256 / 4 = 64 to be a multiple of the group size 128"},
      {"MoE I' % 8",
       Edit(kQwen3MoeJson, R"("moe_intermediate_size": 256)", R"("moe_intermediate_size": 48)"),
       model::testing::QuantJson(-1, kSlimeIgnore),
       {4, 0, 1},
       "I' = I / moe_tp = 48 / 4 = 12 to be a multiple of 8"},
      {"Marlin size_n",
       Edit(kLlamaJson, R"("head_dim": 64)", R"("head_dim": 16)"),
       model::testing::QuantJson(-1, {"lm_head", "re:.*embed_tokens.*", "re:.*o_proj"}),
       {2, 0, 1},
       "qkv_proj.weight: Marlin repack needs size_n % 64 == 0, size_n = 96"},
      {"Marlin size_k",
       Edit(kLlamaJson, R"("hidden_size": 256)", R"("hidden_size": 264)"),
       model::testing::QuantJson(-1, {"lm_head", "re:.*embed_tokens.*"}),
       {1, 0, 1},
       "qkv_proj.weight: Marlin repack needs size_k % 16 == 0, size_k = 264"},
      {"MoE Marlin w13",
       Edit(kQwen3MoeJson, R"("moe_intermediate_size": 256)", R"("moe_intermediate_size": 80)"),
       model::testing::QuantJson(-1, kSlimeIgnore),
       {2, 0, 1},
       "Marlin repack needs H % 16 == 0 and 2I' % 64 == 0"},
      {"asymmetric",
       kLlamaJson,
       Edit(all_int4, R"("symmetric": true)", R"("symmetric": false)"),
       {1, 0, 1},
       "asymmetric",
       absl::StatusCode::kUnimplemented},
  };
}

TEST(EngineLayoutTest, Refusals) {
  for (const RefusalCase& rc : RefusalCases()) {
    SCOPED_TRACE(rc.label);
    auto c = ParseModelConfig(rc.config_json, rc.label);
    ASSERT_TRUE(c.ok()) << c.status();
    std::optional<QuantizationConfig> q;
    if (!rc.quant_json.empty()) {
      auto parsed = ParseQuantizationConfig(rc.quant_json, rc.label);
      ASSERT_TRUE(parsed.ok()) << parsed.status();
      q = *parsed;
    }
    auto l = EngineLayout::Create(*c, q ? &*q : nullptr, rc.parallel);
    ASSERT_FALSE(l.ok());
    EXPECT_EQ(l.status().code(), rc.code) << l.status();
    EXPECT_THAT(l.status().message(), HasSubstr(rc.want));
  }
}

TEST(EngineLayoutTest, AdvisoryChecksWarnButLoad) {
  // G = 32, T = 4: o_proj K_p = 128 ok; Qwen2 o_proj K_p = 64: not a multiple of 128 (advisory).
  const QuantizationConfig q = Quant(32, {"lm_head", "re:.*embed_tokens.*"});
  auto l = EngineLayout::Create(Config(model::testing::kQwen2Json), &q, {4, 0, 1});
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_FALSE(l->warnings().empty());
  EXPECT_THAT(l->warnings()[0], HasSubstr("model.layers.{i}.self_attn.o_proj.weight: advisory"));
  EXPECT_THAT(l->warnings()[0], HasSubstr("K_p = 64 is not a multiple of 128"));
  // One warning per module pattern, not per layer.
  EXPECT_EQ(l->warnings().size(), 1u) << l->warnings()[1];
  // MoE advisory: I' = 64 with G = 32 satisfies I' % max(64, G); H = 256 % 128 ok: no warning. I' = 32 warns.
  auto c =
      Config(Edit(model::testing::kQwen3MoeJson, R"("moe_intermediate_size": 256)", R"("moe_intermediate_size": 128)"));
  const QuantizationConfig mq = Quant(32, kSlimeIgnore);
  auto m = EngineLayout::Create(c, &mq, {4, 1, 1});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->warnings().size(), 1u);
  EXPECT_THAT(m->warnings()[0], HasSubstr("I' = 32 is not a multiple of max(64, G) = 64"));
  // w13 of I' = 32: 4I' = 128 > G = 32 -> grouped; w2: I' = 32 = G -> single perm.
  const auto& p = m->params()[static_cast<size_t>(m->FindParam("model.layers.0.mlp.experts.w2_weight_scale"))];
  EXPECT_FALSE(p.marlin.grouped_scale_perm);
}

TEST(EngineLayoutTest, ChannelwiseRowParallelScalesAreWhole) {
  const QuantizationConfig q = Quant(-1, {"lm_head", "re:.*embed_tokens.*"});
  auto l = EngineLayout::Create(Config(model::testing::kLlamaJson), &q, {2, 1, 1});
  ASSERT_TRUE(l.ok()) << l.status();
  ExpectParam(*l, {"model.layers.0.self_attn.o_proj.weight_scale", ParamRole::kRow, kSc, kB, {256, 1}, {1, 256}});
  ExpectParam(*l, {"model.layers.0.self_attn.o_proj.weight_packed", ParamRole::kRow, kPk, kI, {256, 32}, {16, 512}});
  const HfSource& s = l->sources()[static_cast<size_t>(l->FindSource("model.layers.0.self_attn.o_proj.weight_scale"))];
  EXPECT_EQ(s.shape, (Shape{256, 1}));
  EXPECT_EQ(s.src_col0, 0);
  EXPECT_EQ(s.cols, 1);
  const HfSource& p = l->sources()[static_cast<size_t>(l->FindSource("model.layers.0.self_attn.o_proj.weight_packed"))];
  EXPECT_EQ(p.src_col0, 32);  // K_p / 8 words per rank
  const auto& sp = l->params()[static_cast<size_t>(l->FindParam("model.layers.0.self_attn.o_proj.weight_scale"))];
  EXPECT_FALSE(sp.marlin.grouped_scale_perm);
}

}  // namespace
}  // namespace wsync::engine_model

namespace wsync::engine_model {
namespace {

TEST(EngineLayoutTest, W13ScalePermutationUsesSglangSizeK) {
  // H = G = 128: SGLang passes size_k = 4I' = 512 -> grouped; vLLM (size_k = H) would use the single perm.
  const ModelConfig c = Config(model::testing::kQwen3MoeH128Json);
  const QuantizationConfig q = Quant(128, kSlimeIgnore);
  auto l = EngineLayout::Create(c, &q, {2, 0, 2});
  ASSERT_TRUE(l.ok()) << l.status();
  const auto& w13 = l->params()[static_cast<size_t>(l->FindParam("model.layers.1.mlp.experts.w13_weight_scale"))];
  EXPECT_EQ(w13.marlin.scale_rows, 1);
  EXPECT_EQ(w13.marlin.scale_perm_size_k, 512);
  EXPECT_TRUE(w13.marlin.grouped_scale_perm);
  const auto& w2 = l->params()[static_cast<size_t>(l->FindParam("model.layers.1.mlp.experts.w2_weight_scale"))];
  EXPECT_EQ(w2.marlin.scale_perm_size_k, 128);
  EXPECT_FALSE(w2.marlin.grouped_scale_perm);
  // Dense: grouped iff G < K_p (a row-parallel shard with K_p == G uses the single perm).
  const auto& down = l->params()[static_cast<size_t>(l->FindParam("model.layers.0.mlp.down_proj.weight_scale"))];
  EXPECT_EQ(down.marlin.size_k, 128);
  EXPECT_FALSE(down.marlin.grouped_scale_perm);
  const auto& gu = l->params()[static_cast<size_t>(l->FindParam("model.layers.0.mlp.gate_up_proj.weight_scale"))];
  EXPECT_FALSE(gu.marlin.grouped_scale_perm);  // K = H = 128 = G
}

// ---- FP8 (docs/spec/FP8.md §4) ---------------------------------------------------------------------

constexpr const char* kFp8Block =
    R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})";
constexpr const char* kFp8Channel = R"({"quant_method": "compressed-tensors", "format": "float-quantized",
  "ignore": ["lm_head", "re:.*mlp\\.gate$"], "config_groups": {"group_0": {"targets": ["Linear"],
  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false}}}})";

QuantizationConfig Fp8(const char* json) {
  auto q = ParseQuantizationConfig(json, "fp8");
  EXPECT_TRUE(q.ok()) << q.status();
  return *q;
}

const HfSource& SourceOf(const EngineLayout& l, const std::string& hf) {
  const int i = l.FindSource(hf);
  EXPECT_GE(i, 0) << hf;
  return l.sources()[static_cast<size_t>(std::max(i, 0))];
}

constexpr auto kF8 = DType::kF8E4M3;
constexpr auto kF32 = DType::kF32;

// DeepSeek-V3 as published (block FP8), SGLang TP 8 rank 3: weight F8_E4M3 and weight_scale_inv
// F32 [ceil(N/128), ceil(K/128)] per linear, the fused MoE scales [E, 2 I'/128, H/128], and the
// scale blocks each shard's rows map to; the router, embeddings and lm_head stay bf16.
TEST(EngineLayoutTest, Fp8BlockDeepseekV3Tp8) {
  const ModelConfig c = Config(kDeepseekV3Full);
  const QuantizationConfig q = Fp8(kFp8Block);
  auto l = EngineLayout::Create(c, &q, {8, 3, 1});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->int4_format(), Int4Format::kFp8Block);
  const std::string A = "model.layers.0.self_attn.", M = "model.layers.3.mlp.";
  const std::vector<Want> want = {
      {A + "fused_qkv_a_proj_with_mqa.weight", ParamRole::kFusedQkvA, kPl, kF8, {2112, 7168}, {2112, 7168}},
      {A + "fused_qkv_a_proj_with_mqa.weight_scale_inv", ParamRole::kFusedQkvA, kPl, kF32, {17, 56}, {17, 56}},
      {A + "q_b_proj.weight_scale_inv", ParamRole::kColumn, kPl, kF32, {24, 12}, {24, 12}},
      {A + "kv_b_proj.weight", ParamRole::kColumn, kPl, kF8, {4096, 512}, {4096, 512}},
      {A + "kv_b_proj.weight_scale_inv", ParamRole::kColumn, kPl, kF32, {32, 4}, {32, 4}},
      {A + "o_proj.weight_scale_inv", ParamRole::kRow, kPl, kF32, {56, 16}, {56, 16}},
      {"model.layers.2.mlp.gate_up_proj.weight_scale_inv", ParamRole::kGateUp, kPl, kF32, {36, 56}, {36, 56}},
      {"model.layers.2.mlp.down_proj.weight_scale_inv", ParamRole::kRow, kPl, kF32, {56, 18}, {56, 18}},
      {M + "gate.weight", ParamRole::kReplicated, kPl, kB, {256, 7168}, {256, 7168}},
      {M + "experts.w13_weight", ParamRole::kExpertsW13, kPl, kF8, {256, 512, 7168}, {256, 512, 7168}},
      {M + "experts.w13_weight_scale_inv", ParamRole::kExpertsW13, kPl, kF32, {256, 4, 56}, {256, 4, 56}},
      {M + "experts.w2_weight", ParamRole::kExpertsW2, kPl, kF8, {256, 7168, 256}, {256, 7168, 256}},
      {M + "experts.w2_weight_scale_inv", ParamRole::kExpertsW2, kPl, kF32, {256, 56, 2}, {256, 56, 2}},
      {M + "shared_experts.gate_up_proj.weight_scale_inv", ParamRole::kGateUp, kPl, kF32, {4, 56}, {4, 56}},
      {"model.embed_tokens.weight", ParamRole::kVocab, kPl, kB, {16160, 7168}, {16160, 7168}},
  };
  for (const Want& w : want) ExpectParam(*l, w);
  // kv_a's 576 rows follow q_a's 1536 = 12 blocks: its 5 scale rows (the last one partial) at row 12.
  const HfSource& kva = SourceOf(*l, A + "kv_a_proj_with_mqa.weight_scale_inv");
  EXPECT_EQ(kva.shape, (Shape{5, 56}));
  EXPECT_EQ(kva.dst_row0, 12);
  EXPECT_EQ(kva.rows, 5);
  // kv_b rows 3 * 4096.. of 32768: scale rows 96..127.
  const HfSource& kvb = SourceOf(*l, A + "kv_b_proj.weight_scale_inv");
  EXPECT_EQ(kvb.src_row0, 96);
  EXPECT_EQ(kvb.rows, 32);
  // o_proj: columns 3 * 2048.. of 16384: scale columns 48..63.
  const HfSource& o = SourceOf(*l, A + "o_proj.weight_scale_inv");
  EXPECT_EQ(o.src_col0, 48);
  EXPECT_EQ(o.cols, 16);
  // expert 5's up_proj rows 768..1023 (moe_tp rank 3 of 8, I = 2048) -> scale rows 6..7 at row 2.
  const HfSource& up = SourceOf(*l, M + "experts.5.up_proj.weight_scale_inv");
  EXPECT_EQ(up.dtype, kF32);
  EXPECT_EQ(up.expert, 5);
  EXPECT_EQ(up.src_row0, 6);
  EXPECT_EQ(up.rows, 2);
  EXPECT_EQ(up.dst_row0, 2);
  const HfSource& upw = SourceOf(*l, M + "experts.5.up_proj.weight");
  EXPECT_EQ(upw.dtype, kF8);
  EXPECT_EQ(upw.src_row0, 768);
  EXPECT_EQ(upw.dst_row0, 256);
  EXPECT_FALSE(upw.transpose);
}

// The engines' block-shape refusals (SGLang's messages), before any byte moves; and per channel.
TEST(EngineLayoutTest, Fp8RefusalsAndChannelLayout) {
  const ModelConfig qwen = Config(kQwen3_30B);
  const QuantizationConfig block = Fp8(kFp8Block);
  // T=4, EP=1: I' = 768 / 4 = 192 is not a multiple of block_n (the Qwen3-235B-FP8-at-TP8 failure).
  auto moe = EngineLayout::Create(qwen, &block, {4, 0, 1});
  ASSERT_FALSE(moe.ok());
  EXPECT_EQ(moe.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(moe.status().message(),
              HasSubstr("The output_size of gate's and up's weight = 192 is not divisible by weight quantization "
                        "block_n = 128."));
  EXPECT_THAT(moe.status().message(), HasSubstr("model.layers.0.mlp.experts.w13_weight"));
  EXPECT_TRUE(EngineLayout::Create(qwen, &block, {4, 1, 4}).ok());  // EP 4 keeps I' = 768
  // Block 256 x 256 at T=4, EP=4: a k_proj partition of one 128-row head.
  QuantizationConfig big = block;
  big.block_n = big.block_k = 256;
  auto qkv = EngineLayout::Create(qwen, &big, {4, 0, 4});
  ASSERT_FALSE(qkv.ok());
  EXPECT_THAT(
      qkv.status().message(),
      HasSubstr("Weight output_partition_size = 128 (k_proj (kv shard 0)) is not divisible by weight quantization "
                "block_n = 256."));
  // A row-parallel K slice: o_proj at block_k 384, K' = 4096 / 4 = 1024.
  big.block_n = 128;
  big.block_k = 384;
  auto row = EngineLayout::Create(qwen, &big, {4, 0, 4});
  ASSERT_FALSE(row.ok());
  EXPECT_THAT(
      row.status().message(),
      HasSubstr("Weight input_size_per_partition = 1024 is not divisible by weight quantization block_k = 384."));
  // Per channel: weight_scale [(E,) N, 1] F32 whole rows, no block rules.
  const QuantizationConfig channel = Fp8(kFp8Channel);
  auto l = EngineLayout::Create(qwen, &channel, {4, 2, 1});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->int4_format(), Int4Format::kFp8Channel);
  const std::string L = "model.layers.47.";
  ExpectParam(*l, {L + "self_attn.qkv_proj.weight", ParamRole::kQkv, kPl, kF8, {1280, 2048}, {1280, 2048}});
  ExpectParam(*l, {L + "self_attn.qkv_proj.weight_scale", ParamRole::kQkv, kPl, kF32, {1280, 1}, {1280, 1}});
  ExpectParam(*l,
              {L + "mlp.experts.w13_weight_scale", ParamRole::kExpertsW13, kPl, kF32, {128, 384, 1}, {128, 384, 1}});
  ExpectParam(*l,
              {L + "mlp.experts.w2_weight_scale", ParamRole::kExpertsW2, kPl, kF32, {128, 2048, 1}, {128, 2048, 1}});
  const HfSource& up = SourceOf(*l, L + "mlp.experts.9.up_proj.weight_scale");
  EXPECT_EQ(up.shape, (Shape{768, 1}));
  EXPECT_EQ(up.src_row0, 2 * 192);
  EXPECT_EQ(up.rows, 192);
  EXPECT_EQ(up.dst_row0, 192);
  // An FP8 lm_head is refused (the engines never build one).
  QuantizationConfig head = channel;
  head.ignore.clear();
  EXPECT_THAT(EngineLayout::Create(qwen, &head, {1, 0, 1}).status().message(), HasSubstr("lm_head"));
}

}  // namespace
}  // namespace wsync::engine_model
