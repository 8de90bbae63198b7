// model/quant_target: what a sync sends for an FP8 target, checked against torch. Every 2-D case
// of tests/data/golden/fp8_golden.safetensors (tools/golden/fp8_golden.py: torch's float32 ops and
// its own float8_e4m3fn cast) goes through QuantizeHfTensor under the quantization_config that
// selects its variant; the names, dtypes, shapes and every byte must be torch's.
#include "model/quant_target.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "kernels/testing/golden.h"

namespace wsync::model {
namespace {

constexpr const char* kBlock =
    R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})";
constexpr const char* kBlockUe8m0 = R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "modules_to_not_convert": ["model.layers.0.mlp"]})";
constexpr const char* kChannel = R"({"quant_method": "compressed-tensors", "format": "float-quantized",
  "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"],
  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false}}}})";

QuantizationConfig Config(const char* json) {
  auto q = ParseQuantizationConfig(json, "test");
  EXPECT_TRUE(q.ok()) << q.status();
  return *q;
}

std::vector<std::byte> Bytes(const TensorView& v) {
  std::vector<std::byte> out(v.nbytes());
  std::memcpy(out.data(), v.data(), v.nbytes());
  return out;
}

TEST(QuantTargetFp8, NamesAndTargets) {
  const QuantizationConfig block = Config(kBlockUe8m0), channel = Config(kChannel);
  EXPECT_EQ(QuantizedNames("model.layers.1.mlp.down_proj", block),
            (std::vector<std::string>{"model.layers.1.mlp.down_proj.weight",
                                      "model.layers.1.mlp.down_proj.weight_scale_inv"}));
  EXPECT_EQ(
      QuantizedNames("model.layers.1.mlp.down_proj", channel),
      (std::vector<std::string>{"model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight_scale"}));
  const Shape s{256, 256};
  EXPECT_TRUE(IsQuantTarget("model.layers.1.mlp.down_proj.weight", s, block));
  EXPECT_FALSE(IsQuantTarget("model.layers.0.mlp.down_proj.weight", s, block));  // modules_to_not_convert
  EXPECT_FALSE(IsQuantTarget("model.layers.1.mlp.gate.weight", s, block));       // a router, never FP8
  EXPECT_FALSE(IsQuantTarget("lm_head.weight", s, block));
  EXPECT_FALSE(IsQuantTarget("model.embed_tokens.weight", s, channel));
  EXPECT_FALSE(IsQuantTarget("model.norm.weight", Shape{256}, block));
}

TEST(QuantTargetFp8, EveryTwoDimensionalGoldenCaseEqualsTorch) {
  auto file = SafetensorsFile::Open(kernels::testing::GoldenPath("fp8_golden.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  int checked = 0;
  for (const std::string& c : kernels::testing::JsonNames(file->metadata().at("cases"))) {
    const std::string base = c.substr(0, c.find('.')), variant = c.substr(c.find('.') + 1);
    const SafetensorsEntry* w = file->Find(base + ".w");
    ASSERT_NE(w, nullptr) << c;
    if (w->view.dim(0) != 1 || variant == "block_vllm") continue;  // [1, N, K] cases; vllm is not a config's
    SCOPED_TRACE(c);
    const std::vector<uint16_t> wv = kernels::testing::CopyOf<uint16_t>(*w);  // aligned
    const TensorView w2(w->view.dtype(), Shape{w->view.dim(1), w->view.dim(2)}, std::as_bytes(std::span(wv)));
    QuantizeOptions options;
    QuantizationConfig q;
    if (variant == "block_slime") {
      q = Config(kBlock);
    } else if (variant == "block_ue8m0") {
      q = Config(kBlockUe8m0);  // scale_fmt "ue8m0" chooses the variant
    } else {
      q = Config(kChannel);
      if (variant == "channel_compressed-tensors") options.fp8_channel = kernels::Fp8ChannelVariant::kCompressedTensors;
    }
    auto out = QuantizeHfTensor("model.layers.1.mlp.down_proj.weight", w2, q, options);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 2u);
    EXPECT_EQ((*out)[0].name, "model.layers.1.mlp.down_proj.weight");
    EXPECT_EQ((*out)[1].name, absl::StartsWith(variant, "block") ? "model.layers.1.mlp.down_proj.weight_scale_inv"
                                                                 : "model.layers.1.mlp.down_proj.weight_scale");
    const SafetensorsEntry& want_q = *file->Find(c + ".q");
    const SafetensorsEntry& want_s = *file->Find(c + ".s");
    EXPECT_EQ((*out)[0].view.dtype(), DType::kF8E4M3);
    EXPECT_EQ((*out)[0].view.shape(), w2.shape());
    EXPECT_EQ((*out)[1].view.dtype(), want_s.view.dtype());
    EXPECT_EQ((*out)[1].view.shape(), (Shape{want_s.view.dim(1), want_s.view.dim(2)}));
    EXPECT_EQ(Bytes((*out)[0].view), Bytes(want_q.view));
    EXPECT_EQ(Bytes((*out)[1].view), Bytes(want_s.view));
    ++checked;
  }
  EXPECT_GE(checked, 12);
}

TEST(QuantTargetFp8, BadWeightsAreRefusedNamingTheTensor) {
  const QuantizationConfig q = Config(kBlock);
  std::vector<uint16_t> w(4 * 8, 0x3F80);  // bf16 1.0
  w[13] = 0x7F80;                          // +Inf
  const TensorView inf(DType::kBF16, Shape{4, 8}, std::as_bytes(std::span(w)));
  auto out = QuantizeHfTensor("model.layers.2.self_attn.o_proj.weight", inf, q);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("model.layers.2.self_attn.o_proj.weight"), std::string::npos) << out.status();
  std::vector<float> f32(32, 1.0f);
  auto wide = QuantizeHfTensor("x.weight", TensorView(DType::kF32, Shape{4, 8}, std::as_bytes(std::span(f32))), q);
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument);
  QuantizationConfig per_tensor = q;
  per_tensor.block_n = per_tensor.block_k = 0;
  w[13] = 0x3F80;
  EXPECT_EQ(QuantizeHfTensor("x.weight", inf, per_tensor).status().code(), absl::StatusCode::kUnimplemented);
}

// An FP8 checkpoint as a trainer holds it: torch's codes and scales of a golden case dequantized
// to bf16(value(code) x scale), value() by the E4M3 definition (sign, 4 exponent bits of bias 7, 3
// mantissa bits, subnormals below 2^-6); non-FP8 tensors copied, scales dropped.
TEST(QuantTargetFp8, DequantizeFp8CheckpointByTheDefinition) {
  auto file = SafetensorsFile::Open(kernels::testing::GoldenPath("fp8_golden.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  for (const char* variant : {"block_slime", "channel_slime"}) {
    SCOPED_TRACE(variant);
    const std::string c = std::string("bf16_1x160x256_edges.") + variant;
    const std::vector<uint8_t> q = kernels::testing::CopyOf<uint8_t>(*file->Find(c + ".q"));
    const std::vector<float> s = kernels::testing::CopyOf<float>(*file->Find(c + ".s"));
    const bool block = std::string(variant) == "block_slime";
    HfCheckpoint ckpt;
    Tensor codes = *Tensor::Empty(DType::kF8E4M3, Shape{160, 256});
    std::memcpy(codes.data_as<uint8_t>(), q.data(), q.size());
    const Shape sshape = block ? Shape{2, 2} : Shape{160, 1};
    Tensor scales = *Tensor::Empty(DType::kF32, sshape);
    std::memcpy(scales.data_as<float>(), s.data(), s.size() * 4);
    Tensor norm = *Tensor::Empty(DType::kBF16, Shape{4});
    for (int i = 0; i < 4; ++i) norm.data_as<uint16_t>()[i] = 0x3F80;
    ASSERT_TRUE(ckpt.Add("m.weight", std::move(codes)).ok());
    ASSERT_TRUE(ckpt.Add(block ? "m.weight_scale_inv" : "m.weight_scale", std::move(scales)).ok());
    ASSERT_TRUE(ckpt.Add("norm.weight", std::move(norm)).ok());
    const QuantizationConfig cfg = Config(block ? kBlock : kChannel);
    auto dense = DequantizeFp8Checkpoint(ckpt, cfg);
    ASSERT_TRUE(dense.ok()) << dense.status();
    EXPECT_EQ(dense->Names(), (std::vector<std::string>{"m.weight", "norm.weight"}));
    const TensorView w = *dense->Get("m.weight");
    ASSERT_EQ(w.dtype(), DType::kBF16);
    for (int64_t n = 0; n < 160; ++n)
      for (int64_t k = 0; k < 256; ++k) {
        const uint8_t code = q[static_cast<size_t>(n * 256 + k)];
        const int e = (code >> 3) & 0xF, m = code & 7;
        float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
        if (code & 0x80) v = -v;
        const float sc = block ? s[static_cast<size_t>((n / 128) * 2 + k / 128)] : s[static_cast<size_t>(n)];
        ASSERT_EQ(w.data_as<uint16_t>()[n * 256 + k], F32ToBF16(v * sc)) << n << ", " << k;
      }
  }
  // An FP8 weight without its scale is refused by name.
  HfCheckpoint bare;
  ASSERT_TRUE(bare.Add("x.weight", *Tensor::Empty(DType::kF8E4M3, Shape{2, 2})).ok());
  auto refused = DequantizeFp8Checkpoint(bare, Config(kBlock));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("x.weight_scale_inv"), std::string::npos) << refused.status();
}

}  // namespace
}  // namespace wsync::model
