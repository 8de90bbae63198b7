// Tests of kernels/trtllm.h (CPU path) against a step-by-step reference written here from
// docs/spec/TRTLLM_INT4.md §1 (row permutation, sub-byte transpose, column interleave, bias and
// register interleave, each as its own pass over unpacked nibbles, not the kernels' closed form),
// §3 scale layouts, the spec's worked examples, and the golden file of tools/golden/int4_golden.py.
#include "kernels/trtllm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "hwy/targets.h"
#include "kernels/awq.h"
#include "kernels/format/trtllm_format.h"
#include "kernels/testing/golden.h"

namespace wsync::kernels {
namespace {

using ::testing::HasSubstr;

constexpr int kPermW4A16[32] = {0, 1, 8,  9,  16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
                                4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31};
constexpr int kPermW4AFp8[32] = {0, 1, 2,  3,  16, 17, 18, 19, 4,  5,  6,  7,  20, 21, 22, 23,
                                 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

// One expert: signed q[K][N] (from unsigned codes u: q = u - 8) through the four steps of §1.
// Returns the output words (K*N/8).
std::vector<uint32_t> RefPreprocess(const std::vector<int>& q, int64_t k, int64_t n, bool moe, TrtllmArch arch,
                                    bool w4afp8) {
  const bool sm90 = arch == TrtllmArch::kSm90;
  if (w4afp8 && sm90) {  // §3.2: transpose only, signed nibbles, [N, K/2]
    std::vector<uint32_t> out(static_cast<size_t>(k * n / 8), 0);
    for (int64_t c = 0; c < n; ++c)
      for (int64_t r = 0; r < k; ++r)
        out[(c * k + r) / 8] |= static_cast<uint32_t>(q[r * n + c] & 0xF) << (4 * (r % 8));
    return out;
  }
  // Step 1: rows permuted inside every 32-row block.
  const int* perm = w4afp8 ? kPermW4AFp8 : kPermW4A16;
  std::vector<int> p(q.size());
  for (int64_t r = 0; r < k; ++r)
    for (int64_t c = 0; c < n; ++c) p[r * n + c] = q[((r / 32) * 32 + perm[r % 32]) * n + c];
  // Step 2: sub-byte transpose -> [N, K], packed along K into words of 8.
  std::vector<uint32_t> t(static_cast<size_t>(k * n / 8), 0);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t r = 0; r < k; ++r) t[(c * k + r) / 8] |= static_cast<uint32_t>(p[r * n + c] & 0xF) << (4 * (r % 8));
  // Step 3: column interleave (not for dense sm90; MoE on sm90 is forced to sm80).
  std::vector<uint32_t> il = t;
  const bool interleave = !(sm90 && !moe);
  if (interleave) {
    const int64_t cols = w4afp8 ? 2 : 4, rpt = w4afp8 ? 128 : 64, vrpt = rpt / 8, kw = k / 8;
    for (int64_t c = 0; c < n; ++c)
      for (int64_t v = 0; v < kw; ++v) {
        const int64_t dst = (c / cols) * kw * cols + cols * vrpt * (v / vrpt) + vrpt * (c % cols) + v % vrpt;
        il[dst] = t[c * kw + v];
      }
  }
  // Step 4: +8 on every nibble, then [e7 e6 e5 e4 e3 e2 e1 e0] -> [e7 e5 e3 e1 e6 e4 e2 e0].
  for (auto& w : il) {
    uint32_t e[8];
    for (int i = 0; i < 8; ++i) e[i] = (((w >> (4 * i)) & 0xF) + 8) & 0xF;
    const uint32_t order_hi_to_lo[8] = {e[7], e[5], e[3], e[1], e[6], e[4], e[2], e[0]};
    uint32_t o = 0;
    for (int i = 0; i < 8; ++i) o = (o << 4) | order_hi_to_lo[i];
    w = o;
  }
  return il;
}

std::vector<uint32_t> PackGptq(const std::vector<uint8_t>& u, int64_t e, int64_t k, int64_t n) {
  // u [E, K, N] -> GPTQ orientation [E, K/8, N]
  std::vector<uint32_t> g(static_cast<size_t>(e * k / 8 * n), 0);
  for (int64_t x = 0; x < e; ++x)
    for (int64_t r = 0; r < k; ++r)
      for (int64_t c = 0; c < n; ++c)
        g[(x * k / 8 + r / 8) * n + c] |= static_cast<uint32_t>(u[(x * k + r) * n + c]) << (4 * (r % 8));
  return g;
}

template <typename T>
TensorView In(const std::vector<T>& v, DType dt, Shape s) {
  return TensorView(dt, std::move(s), std::as_bytes(std::span(v)));
}
template <typename T>
MutableTensorView Out(std::vector<T>& v, DType dt, Shape s) {
  return MutableTensorView(dt, std::move(s), std::as_writable_bytes(std::span(v)));
}
Shape Sh(int64_t e, std::initializer_list<int64_t> tail) {
  Shape s;
  if (e > 0) s.push_back(e);
  for (int64_t d : tail) s.push_back(d);
  return s;
}

TEST(TrtllmFormatTest, WorkedExamplesOfTheSpec) {
  // §1 step 4: a word holding nibbles 0..7 (0x76543210) after the +8 bias and the register
  // interleave is 0xFDB9ECA8: destination nibble j takes source nibble kRegSrc[j].
  uint32_t out = 0;
  for (int j = 0; j < 8; ++j) {
    out |= static_cast<uint32_t>((format::TrtllmRegSrc(format::TrtllmLayout::kSm80W4A16, j) + 8) & 0xF) << (4 * j);
  }
  EXPECT_EQ(out, 0xFDB9ECA8u);
  // §1.1: sm80 word 0 holds column 0 with source rows 0, 8, 16, 24, 1, 9, 17, 25 from bit 0 up.
  std::vector<uint8_t> u(64 * 64, 0);
  for (int r = 0; r < 32; ++r) u[r * 64] = static_cast<uint8_t>(r % 16);
  const std::vector<uint32_t> g = PackGptq(u, 1, 64, 64);
  std::vector<uint32_t> bytes(64 * 64 / 8);
  TrtllmOptions o;
  ASSERT_TRUE(PreprocessTrtllm(In(g, DType::kI32, {8, 64}), Out(bytes, DType::kI8, {64, 32}), o).ok());
  const int rows[8] = {0, 8, 16, 24, 1, 9, 17, 25};
  for (int j = 0; j < 8; ++j) EXPECT_EQ((bytes[0] >> (4 * j)) & 0xF, static_cast<uint32_t>(rows[j] % 16)) << j;
}

struct Variant {
  TrtllmArch arch;
  bool w4afp8;
};

// On every compiled SIMD target (the W4A16 preprocessing runs lanewise over columns).
TEST(TrtllmPreprocessTest, EveryLayoutMatchesTheStepByStepReferenceAndInverts) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    std::mt19937 rng(17);
    for (int64_t e : {0, 3}) {
      for (Variant v : {Variant{TrtllmArch::kSm80, false}, Variant{TrtllmArch::kSm90, false},
                        Variant{TrtllmArch::kSm80, true}, Variant{TrtllmArch::kSm90, true}}) {
        if (v.w4afp8 && e == 0) continue;  // W4AFP8 is MoE only
        SCOPED_TRACE(::testing::Message() << "E " << e << " sm" << (v.arch == TrtllmArch::kSm90 ? 90 : 80)
                                          << (v.w4afp8 ? " w4afp8" : " w4a16"));
        const int64_t ee = std::max<int64_t>(e, 1), k = 256, n = 192;
        std::vector<uint8_t> u(static_cast<size_t>(ee * k * n));
        for (auto& c : u) c = static_cast<uint8_t>(rng() & 0xF);
        const std::vector<uint32_t> codes = PackGptq(u, ee, k, n);
        TrtllmOptions o;
        o.arch = v.arch;
        o.w4afp8 = v.w4afp8;
        o.num_threads = 2;
        auto shape = TrtllmWeightShapeFor(Sh(e, {k / 8, n}), o);
        ASSERT_TRUE(shape.ok()) << shape.status();
        std::vector<uint32_t> bytes(codes.size());
        ASSERT_TRUE(
            PreprocessTrtllm(In(codes, DType::kI32, Sh(e, {k / 8, n})), Out(bytes, DType::kI8, *shape), o).ok());
        for (int64_t x = 0; x < ee; ++x) {
          std::vector<int> q(static_cast<size_t>(k * n));
          for (int64_t i = 0; i < k * n; ++i) q[i] = static_cast<int>(u[x * k * n + i]) - 8;
          const std::vector<uint32_t> ref = RefPreprocess(q, k, n, e > 0, v.arch, v.w4afp8);
          ASSERT_TRUE(std::equal(ref.begin(), ref.end(), bytes.begin() + x * k * n / 8)) << "expert " << x;
        }
        std::vector<uint32_t> back(codes.size(), 0xDEADBEEF);
        ASSERT_TRUE(
            UnpreprocessTrtllm(In(bytes, DType::kI8, *shape), Out(back, DType::kI32, Sh(e, {k / 8, n})), o).ok());
        EXPECT_EQ(back, codes);
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(TrtllmScalesTest, LayoutsAndZeros) {
  const int64_t e = 2, n = 64;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(0.001f, 0.1f);
  for (int64_t k : {512, 256, 128}) {
    const int64_t g = 64, rows = k / g;
    std::vector<uint16_t> s(static_cast<size_t>(e * rows * n));
    for (auto& x : s) x = F32ToBF16(uni(rng));
    TrtllmOptions o;
    o.arch = TrtllmArch::kSm90;
    o.w4afp8 = true;
    auto lay = TrtllmScaleLayoutFor(In(s, DType::kBF16, {e, rows, n}), k, g, o);
    ASSERT_TRUE(lay.ok()) << lay.status();
    const int il = k % (4 * g) == 0 ? 4 : (k % (2 * g) == 0 ? 2 : 1);
    EXPECT_EQ(lay->shape, (Shape{e, rows / il, n * il}));
    std::vector<uint16_t> out(s.size());
    ASSERT_TRUE(TrtllmScales(In(s, DType::kBF16, {e, rows, n}), k, g, Out(out, DType::kBF16, lay->shape), o).ok());
    for (int64_t x = 0; x < e; ++x)
      for (int64_t a = 0; a < rows / il; ++a)
        for (int64_t c = 0; c < n; ++c)
          for (int i = 0; i < il; ++i)
            ASSERT_EQ(out[(x * (rows / il) + a) * n * il + c * il + i], s[(x * rows + a * il + i) * n + c]);
    o.arch = TrtllmArch::kSm80;  // sm89: fp16 values
    ASSERT_TRUE(TrtllmScales(In(s, DType::kBF16, {e, rows, n}), k, g, Out(out, DType::kF16, {e, rows, n}), o).ok());
    for (size_t i = 0; i < s.size(); ++i) ASSERT_EQ(out[i], F32ToF16(BF16ToF32(s[i])));
    o.w4afp8 = false;  // W4A16: unchanged
    ASSERT_TRUE(TrtllmScales(In(s, DType::kBF16, {e, rows, n}), k, g, Out(out, DType::kBF16, {e, rows, n}), o).ok());
    EXPECT_EQ(out, s);
    // AWQ zeros: (8 - z) * s in the scale dtype.
    std::vector<uint32_t> qz(static_cast<size_t>(e * rows * n / 8));
    for (auto& w : qz) w = rng();
    ASSERT_TRUE(TrtllmZerosFromAwq(In(qz, DType::kI32, {e, rows, n / 8}), In(s, DType::kBF16, {e, rows, n}),
                                   Out(out, DType::kBF16, {e, rows, n}), o)
                    .ok());
    constexpr int kRev[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    for (int64_t r = 0; r < e * rows; ++r)
      for (int64_t c = 0; c < n; ++c) {
        const int z = static_cast<int>((qz[r * n / 8 + c / 8] >> (4 * kRev[c % 8])) & 0xF);
        ASSERT_EQ(out[r * n + c], F32ToBF16(static_cast<float>(8 - z) * BF16ToF32(s[r * n + c])));
      }
  }
}

TEST(TrtllmValidationTest, ShapesAndVariantsAreRefusedWithTheValues) {
  TrtllmOptions o;
  EXPECT_THAT(TrtllmWeightShapeFor({12, 64}, o).status().message(),
              HasSubstr("K = 96 is not a multiple of 64 (K % 64 = 32)"));
  EXPECT_THAT(TrtllmWeightShapeFor({8, 96}, o).status().message(), HasSubstr("N = 96 is not a multiple of 64"));
  o.w4afp8 = true;
  EXPECT_THAT(TrtllmWeightShapeFor({16, 64}, o).status().message(), HasSubstr("MoE expert stacks [E, K, N] only"));
  EXPECT_THAT(TrtllmWeightShapeFor({2, 8, 64}, o).status().message(), HasSubstr("K = 64 is not a multiple of 128"));
  EXPECT_THAT(TrtllmZerosFromAwq(TensorView(), TensorView(), MutableTensorView(), o).message(),
              HasSubstr("zero points are not supported with W4AFP8"));
  o.w4afp8 = false;
  std::vector<uint32_t> a(8 * 64), b(64 * 64 / 4);
  EXPECT_THAT(PreprocessTrtllm(In(a, DType::kI32, {8, 64}), Out(b, DType::kI8, {64, 64}), o).message(),
              HasSubstr("want I8[64, 32]"));
  EXPECT_THAT(PreprocessTrtllm(In(a, DType::kI32, {8, 64}), Out(a, DType::kI8, {64, 32}), o).message(),
              HasSubstr("overlap"));
}

// ---- golden file ----------------------------------------------------------------------------------

using kernels::testing::CopyOf;
using kernels::testing::JsonNames;

// [.., R, C] -> [.., C, R] of 4-byte or 2-byte elements.
template <typename T>
std::vector<T> Transpose(const std::vector<T>& v, int64_t e, int64_t r, int64_t c) {
  std::vector<T> t(v.size());
  for (int64_t x = 0; x < e; ++x)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) t[(x * c + j) * r + i] = v[(x * r + i) * c + j];
  return t;
}

TEST(TrtllmGoldenTest, MatchesThePythonFormulation) {
  auto file = SafetensorsFile::Open(testing::GoldenPath("trtllm_golden.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& md = file->metadata();
  const std::vector<std::string> cases = JsonNames(md.at("cases"));
  ASSERT_GE(cases.size(), 4u);
  int checked = 0;
  for (const std::string& c : cases) {
    SCOPED_TRACE(c);
    const int g = std::stoi(md.at(c + ".group_size"));
    const bool awq = md.at(c + ".kind") == "awq";
    // Codes in GPTQ orientation and scales [(E,) K/G, N] from either input format.
    std::vector<uint32_t> codes;
    std::vector<uint16_t> scales;
    Shape code_shape, scale_shape;
    DType sdt;
    std::vector<uint32_t> qz;
    if (awq) {
      const SafetensorsEntry& qw = *file->Find(c + ".qweight");
      const SafetensorsEntry& sc = *file->Find(c + ".scales");
      const Shape& s = qw.view.shape();
      const int64_t e = s.size() == 3 ? s[0] : 0, k = s[s.size() - 2], n = 8 * s.back();
      code_shape = Sh(e, {k / 8, n});
      codes.resize(qw.view.nbytes() / 4);
      const std::vector<uint32_t> qwv = CopyOf<uint32_t>(qw);
      ASSERT_TRUE(AwqToGptq(In(qwv, DType::kI32, s), Out(codes, DType::kI32, code_shape), KernelOptions{}).ok());
      scales = CopyOf<uint16_t>(sc);
      scale_shape = sc.view.shape();
      sdt = sc.view.dtype();
      qz = CopyOf<uint32_t>(*file->Find(c + ".qzeros"));
    } else {
      const SafetensorsEntry& wp = *file->Find(c + ".weight_packed");
      const SafetensorsEntry& ws = *file->Find(c + ".weight_scale");
      const Shape& s = wp.view.shape();
      const int64_t e = s.size() == 3 ? s[0] : 0, n = s[s.size() - 2], kw = s.back();
      codes = Transpose(CopyOf<uint32_t>(wp), std::max<int64_t>(e, 1), n, kw);
      code_shape = Sh(e, {kw, n});
      const Shape& ss = ws.view.shape();
      scales = Transpose(CopyOf<uint16_t>(ws), std::max<int64_t>(e, 1), ss[ss.size() - 2], ss.back());
      scale_shape = Sh(e, {ss.back(), ss[ss.size() - 2]});
      sdt = ws.view.dtype();
    }
    const int64_t k = 8 * code_shape[code_shape.size() - 2];
    for (const std::string& v : JsonNames(md.at(c + ".variants"))) {
      SCOPED_TRACE(v);
      TrtllmOptions o;
      o.arch = v.rfind("sm90", 0) == 0 ? TrtllmArch::kSm90 : TrtllmArch::kSm80;
      o.w4afp8 = v.find("w4afp8") != std::string::npos;
      auto ws = TrtllmWeightShapeFor(code_shape, o);
      ASSERT_TRUE(ws.ok()) << ws.status();
      std::vector<uint32_t> bytes(codes.size());
      ASSERT_TRUE(PreprocessTrtllm(In(codes, DType::kI32, code_shape), Out(bytes, DType::kI8, *ws), o).ok());
      const SafetensorsEntry& want = *file->Find(c + "." + v + ".weight");
      EXPECT_EQ(want.view.shape(), *ws);
      EXPECT_EQ(bytes, CopyOf<uint32_t>(want));
      auto lay = TrtllmScaleLayoutFor(In(scales, sdt, scale_shape), k, g, o);
      ASSERT_TRUE(lay.ok()) << lay.status();
      std::vector<uint16_t> so(scales.size());
      ASSERT_TRUE(TrtllmScales(In(scales, sdt, scale_shape), k, g, Out(so, lay->dtype, lay->shape), o).ok());
      const SafetensorsEntry& ws_want = *file->Find(c + "." + v + ".weight_scale");
      EXPECT_EQ(ws_want.view.dtype(), lay->dtype);
      EXPECT_EQ(ws_want.view.shape(), lay->shape);
      EXPECT_EQ(so, CopyOf<uint16_t>(ws_want));
      if (awq && !o.w4afp8) {
        std::vector<uint16_t> zo(scales.size());
        ASSERT_TRUE(TrtllmZerosFromAwq(In(qz, DType::kI32,
                                          Sh(scale_shape.size() == 3 ? scale_shape[0] : 0,
                                             {scale_shape[scale_shape.size() - 2], scale_shape.back() / 8})),
                                       In(scales, sdt, scale_shape), Out(zo, sdt, scale_shape), o)
                        .ok());
        EXPECT_EQ(zo, CopyOf<uint16_t>(*file->Find(c + "." + v + ".weight_zero")));
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 9);
}

}  // namespace
}  // namespace wsync::kernels
