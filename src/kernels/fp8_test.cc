// FP8 kernels (kernels/fp8.h) against two references the kernels do not share code with:
//  - a scalar reference written from docs/spec/FP8.md here: the E4M3 code chosen by searching the
//    nearest of the 127 finite magnitudes (built with ldexp from the code's definition), ties to
//    the even code; the scales in plain float32 expressions; 16-bit roundings from common/dtype.h;
//  - the golden file tools/golden/fp8_golden.py writes with torch (its float32 ops and its own
//    `.to(torch.float8_e4m3fn)`), every byte of q and every bit of the scales.
// Seeded random weights (seeds in the test names' traces), the spec's edge cases (all-zero blocks
// and rows, subnormals, ties, values at and beyond 448, N and K not multiples of the block), every
// variant, bf16 and fp16, dense and stacked; refusals (NaN / Inf named, bad shapes and dtypes).
#include "kernels/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kernels/testing/flipped.h"
#include "kernels/testing/golden.h"

namespace wsync::kernels {
namespace {

// ---- the reference ---------------------------------------------------------------------------------

// The 127 finite non-negative E4M3FN values, by code 0x00..0x7E (§1).
std::vector<double> Magnitudes() {
  std::vector<double> v(127);
  for (int c = 0; c < 127; ++c) {
    const int e = c >> 3, m = c & 7;
    v[c] = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  }
  return v;
}

// Nearest code to x (|x| <= 448), ties to the even code; the sign bit of x kept.
uint8_t RefCode(float x) {
  static const std::vector<double> mags = Magnitudes();
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  for (int c = 1; c < 127; ++c) {
    const double d = std::fabs(mags[c] - a), db = std::fabs(mags[best] - a);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

float ToF32(uint16_t h, DType dt) { return dt == DType::kBF16 ? BF16ToF32(h) : F16ToF32(h); }
float Round16(float x, DType dt) { return dt == DType::kBF16 ? BF16ToF32(F32ToBF16(x)) : F16ToF32(F32ToF16(x)); }
float Clamp448(float x) { return std::min(std::max(x, -448.0f), 448.0f); }

struct Result {
  std::vector<uint8_t> q;
  std::vector<float> s32;     // f32 scales
  std::vector<uint16_t> s16;  // 16-bit scales (compressed-tensors)
};

// §2, one variant, tile by tile.
Result RefBlock(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k, int64_t bn, int64_t bk,
                Fp8BlockVariant v) {
  const int64_t nb = (n + bn - 1) / bn, kb = (k + bk - 1) / bk;
  Result r;
  r.q.resize(w.size());
  r.s32.resize(static_cast<size_t>(e * nb * kb));
  for (int64_t x = 0; x < e; ++x)
    for (int64_t bi = 0; bi < nb; ++bi)
      for (int64_t bj = 0; bj < kb; ++bj) {
        float amax = 0;
        for (int64_t i = bi * bn; i < std::min(n, (bi + 1) * bn); ++i)
          for (int64_t j = bj * bk; j < std::min(k, (bj + 1) * bk); ++j)
            amax = std::max(amax, std::fabs(ToF32(w[(x * n + i) * k + j], dt)));
        float s = 0;
        if (v == Fp8BlockVariant::kSlime) {
          s = std::max(amax, 1e-10f) / 448.0f;
        } else {
          s = std::max(amax, 1e-4f) / 448.0f;
          if (v == Fp8BlockVariant::kUe8m0) s = std::exp2(std::ceil(std::log2(static_cast<double>(s))));
        }
        r.s32[(x * nb + bi) * kb + bj] = s;
        const float rr = 1.0f / s;
        for (int64_t i = bi * bn; i < std::min(n, (bi + 1) * bn); ++i)
          for (int64_t j = bj * bk; j < std::min(k, (bj + 1) * bk); ++j) {
            const int64_t o = (x * n + i) * k + j;
            r.q[o] = RefCode(Clamp448(ToF32(w[o], dt) * rr));
          }
      }
  return r;
}

// §3, one variant, row by row.
Result RefChannel(const std::vector<uint16_t>& w, DType dt, int64_t rows, int64_t k, Fp8ChannelVariant v) {
  Result r;
  r.q.resize(w.size());
  for (int64_t i = 0; i < rows; ++i) {
    float amax = 0;
    for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(ToF32(w[i * k + j], dt)));
    if (v == Fp8ChannelVariant::kSlime) {
      const float s = std::max(amax, BF16ToF32(F32ToBF16(1e-12f))) / 448.0f;
      r.s32.push_back(s);
      for (int64_t j = 0; j < k; ++j) r.q[i * k + j] = RefCode(Clamp448(ToF32(w[i * k + j], dt) / s));
    } else {
      float s = Round16(amax / 448.0f, dt);
      if (s == 0) s = dt == DType::kBF16 ? 0x1p-7f : 0x1p-10f;
      r.s16.push_back(dt == DType::kBF16 ? F32ToBF16(s) : F32ToF16(s));
      for (int64_t j = 0; j < k; ++j) r.q[i * k + j] = RefCode(Clamp448(Round16(ToF32(w[i * k + j], dt) / s, dt)));
    }
  }
  return r;
}

// ---- running the kernels ---------------------------------------------------------------------------

Shape Sh(int64_t e, int64_t n, int64_t k) { return e > 1 ? Shape{e, n, k} : Shape{n, k}; }
TensorView In16(const std::vector<uint16_t>& w, DType dt, const Shape& s) {
  return TensorView(dt, s, std::as_bytes(std::span(w)));
}

absl::StatusOr<Result> RunBlock(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k,
                                Fp8BlockOptions o) {
  const Shape s = Sh(e, n, k);
  ASSIGN_OR_RETURN(const Shape ss, Fp8BlockScaleShape(s, o.block_n, o.block_k));
  Result r;
  r.q.assign(w.size(), 0xAA);
  r.s32.assign(static_cast<size_t>(ss.size() == 3 ? ss[0] * ss[1] * ss[2] : ss[0] * ss[1]), -1.0f);
  RETURN_IF_ERROR(QuantizeFp8Block(In16(w, dt, s),
                                   MutableTensorView(DType::kF8E4M3, s, std::as_writable_bytes(std::span(r.q))),
                                   MutableTensorView(DType::kF32, ss, std::as_writable_bytes(std::span(r.s32))), o));
  return r;
}

absl::StatusOr<Result> RunChannel(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k,
                                  Fp8ChannelOptions o) {
  const Shape s = Sh(e, n, k);
  const Shape ss = e > 1 ? Shape{e, n, 1} : Shape{n, 1};
  Result r;
  r.q.assign(w.size(), 0xAA);
  MutableTensorView scale;
  if (o.variant == Fp8ChannelVariant::kSlime) {
    r.s32.assign(static_cast<size_t>(e * n), -1.0f);
    scale = MutableTensorView(DType::kF32, ss, std::as_writable_bytes(std::span(r.s32)));
  } else {
    r.s16.assign(static_cast<size_t>(e * n), 0xFFFF);
    scale = MutableTensorView(dt, ss, std::as_writable_bytes(std::span(r.s16)));
  }
  RETURN_IF_ERROR(QuantizeFp8Channel(
      In16(w, dt, s), MutableTensorView(DType::kF8E4M3, s, std::as_writable_bytes(std::span(r.q))), scale, o));
  return r;
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  if (!v.empty()) std::memcpy(b.data(), v.data(), v.size() * 4);  // an empty vector's data() may be null
  return b;
}

// Seeded N(0, sigma) weights with the edge values scattered in (and an all-zero first block and last row).
std::vector<uint16_t> Weights(uint64_t seed, DType dt, int64_t e, int64_t n, int64_t k, float sigma) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<uint16_t> w(static_cast<size_t>(e * n * k));
  auto to16 = [&](float f) { return dt == DType::kBF16 ? F32ToBF16(f) : F32ToF16(f); };
  for (auto& h : w) h = to16(normal(rng));
  const float edges[] = {0.0f,   -0.0f, 1e-30f, 3e-39f,   0x1p-9f, 0x1p-10f, 3 * 0x1p-10f, 1.0625f,
                         -17.0f, 1e4f,  -3e4f,  65504.0f, 448.0f,  464.0f,   480.0f,       1e-8f};
  std::uniform_int_distribution<size_t> at(0, w.size() - 1);
  for (int rep = 0; rep < 4; ++rep)
    for (float f : edges) w[at(rng)] = to16(f);
  for (int64_t i = 0; i < std::min<int64_t>(n, 128); ++i)
    for (int64_t j = 0; j < std::min<int64_t>(k, 128); ++j) w[i * k + j] = to16(0.0f);
  for (int64_t j = 0; j < k; ++j) w[(e * n - 1) * k + j] = to16(-0.0f);
  return w;
}

struct Case {
  DType dt;
  int64_t e, n, k;
  uint64_t seed;
};

const Case kCases[] = {
    {DType::kBF16, 1, 256, 384, 11}, {DType::kBF16, 3, 200, 300, 12}, {DType::kBF16, 2, 130, 129, 13},
    {DType::kBF16, 1, 1, 7, 14},     {DType::kF16, 1, 256, 256, 15},  {DType::kF16, 2, 130, 200, 16},
};

TEST(Fp8Block, EveryVariantEqualsTheReferenceOnSeededWeightsAndEdges) {
  for (const Case& c : kCases) {
    for (float sigma : {0.02f, 30.0f}) {
      const std::vector<uint16_t> w = Weights(c.seed, c.dt, c.e, c.n, c.k, sigma);
      for (auto v : {Fp8BlockVariant::kSlime, Fp8BlockVariant::kVllm, Fp8BlockVariant::kUe8m0}) {
        for (int threads : {1, 3}) {
          SCOPED_TRACE(::testing::Message()
                       << SafetensorsName(c.dt) << " " << c.e << "x" << c.n << "x" << c.k << " seed " << c.seed
                       << " sigma " << sigma << " variant " << static_cast<int>(v) << " threads " << threads);
          Fp8BlockOptions o;
          o.variant = v;
          o.num_threads = threads;
          auto got = RunBlock(w, c.dt, c.e, c.n, c.k, o);
          ASSERT_TRUE(got.ok()) << got.status();
          const Result want = RefBlock(w, c.dt, c.e, c.n, c.k, 128, 128, v);
          EXPECT_EQ(Bits(got->s32), Bits(want.s32));
          EXPECT_EQ(got->q, want.q);
        }
      }
    }
  }
}

TEST(Fp8Block, OddBlockSizesEqualTheReference) {
  const std::vector<uint16_t> w = Weights(21, DType::kBF16, 2, 70, 90, 0.5f);
  for (auto [bn, bk] : {std::pair<int64_t, int64_t>{1, 1}, {7, 33}, {64, 128}, {128, 64}, {200, 200}}) {
    SCOPED_TRACE(::testing::Message() << bn << " x " << bk);
    Fp8BlockOptions o;
    o.block_n = bn;
    o.block_k = bk;
    auto got = RunBlock(w, DType::kBF16, 2, 70, 90, o);
    ASSERT_TRUE(got.ok()) << got.status();
    const Result want = RefBlock(w, DType::kBF16, 2, 70, 90, bn, bk, Fp8BlockVariant::kSlime);
    EXPECT_EQ(Bits(got->s32), Bits(want.s32));
    EXPECT_EQ(got->q, want.q);
  }
}

// A block whose amax is 448 has s = 1 in every variant: x * r = x lands exactly on the codes and on
// their midpoints, which must go to the even code; 464 (beyond the largest code) clamps to 448.
TEST(Fp8Block, TiesGoToTheEvenCodeAndHugeOrTinyBlocksQuantize) {
  // Midpoints whose even neighbour is below (1.0625, 17, 2^-10, 5 x 2^-10, 400) or above (1.1875, 19,
  // 3 x 2^-10): each must take the even code.
  const float xs[] = {448.0f,  1.0625f, 17.0f,   3 * 0x1p-10f, 0x1p-10f,     0x1p-9f,  1.5f * 0x1p-6f, -0.0f,
                      -448.0f, 0.0f,    1.1875f, 19.0f,        5 * 0x1p-10f, -1.1875f, 400.0f};
  const uint8_t want[] = {0x7E, 0x38, 0x58, 0x02, 0x00, 0x01, 0x0C, 0x80, 0xFE, 0x00, 0x3A, 0x5A, 0x02, 0xBA, 0x7C};
  for (auto v : {Fp8BlockVariant::kSlime, Fp8BlockVariant::kVllm, Fp8BlockVariant::kUe8m0}) {
    std::vector<uint16_t> w;
    std::vector<uint8_t> expect;
    for (int rep = 0; rep < 5; ++rep)  // 75 values: the vector lanes (8 or 16) and the scalar tail see each
      for (size_t i = 0; i < std::size(xs); ++i) w.push_back(F32ToBF16(xs[i])), expect.push_back(want[i]);
    Fp8BlockOptions o;
    o.variant = v;
    auto got = RunBlock(w, DType::kBF16, 1, 1, static_cast<int64_t>(w.size()), o);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->s32[0], 1.0f);
    EXPECT_EQ(got->q, expect);
  }
  // Huge and tiny blocks: the largest bf16 magnitudes take the top code, a block below the floor
  // gives zeros (its scale is the floor's).
  auto huge = RunBlock({F32ToBF16(3e38f), F32ToBF16(1e-38f), F32ToBF16(-3e38f)}, DType::kBF16, 1, 1, 3, {});
  ASSERT_TRUE(huge.ok());
  EXPECT_EQ(huge->q, (std::vector<uint8_t>{0x7E, 0x00, 0xFE}));
  auto tiny = RunBlock({F32ToBF16(1e-38f), F32ToBF16(-1e-39f)}, DType::kBF16, 1, 1, 2, {});
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->q, (std::vector<uint8_t>{0x00, 0x80}));
  EXPECT_EQ(tiny->s32[0], 1e-10f / 448.0f);
}

TEST(Fp8Channel, BothVariantsEqualTheReference) {
  for (const Case& c : kCases) {
    for (float sigma : {0.02f, 30.0f}) {
      const std::vector<uint16_t> w = Weights(c.seed + 100, c.dt, c.e, c.n, c.k, sigma);
      for (auto v : {Fp8ChannelVariant::kSlime, Fp8ChannelVariant::kCompressedTensors}) {
        SCOPED_TRACE(::testing::Message() << SafetensorsName(c.dt) << " " << c.e << "x" << c.n << "x" << c.k << " seed "
                                          << c.seed + 100 << " sigma " << sigma << " variant " << static_cast<int>(v));
        Fp8ChannelOptions o;
        o.variant = v;
        auto got = RunChannel(w, c.dt, c.e, c.n, c.k, o);
        ASSERT_TRUE(got.ok()) << got.status();
        const Result want = RefChannel(w, c.dt, c.e * c.n, c.k, v);
        EXPECT_EQ(Bits(got->s32), Bits(want.s32));
        EXPECT_EQ(got->s16, want.s16);
        EXPECT_EQ(got->q, want.q);
      }
    }
  }
}

TEST(Fp8Dequantize, IsTheCodeTimesItsScale) {
  const std::vector<uint16_t> w = Weights(31, DType::kBF16, 2, 130, 200, 1.0f);
  auto b = RunBlock(w, DType::kBF16, 2, 130, 200, Fp8BlockOptions{});
  ASSERT_TRUE(b.ok());
  static const std::vector<double> mags = Magnitudes();
  std::vector<float> out(w.size());
  ASSERT_TRUE(DequantizeFp8Block(TensorView(DType::kF8E4M3, {2, 130, 200}, std::as_bytes(std::span(b->q))),
                                 TensorView(DType::kF32, {2, 2, 2}, std::as_bytes(std::span(b->s32))), 128, 128,
                                 MutableTensorView(DType::kF32, {2, 130, 200}, std::as_writable_bytes(std::span(out))),
                                 KernelOptions{})
                  .ok());
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i) {
    const int64_t e = i / (130 * 200), r = i / 200 % 130, c = i % 200;
    const uint8_t q = b->q[i];
    const float v = static_cast<float>((q & 0x80 ? -1 : 1) * mags[q & 0x7F]);
    ASSERT_EQ(out[i], v * b->s32[(e * 2 + r / 128) * 2 + c / 128]) << i;
    // and within half a code step of W (the quantization error bound, relative to the block scale)
    const float x = BF16ToF32(w[i]);
    ASSERT_LE(std::fabs(out[i] - x), std::fabs(x) / 16 + b->s32[(e * 2 + r / 128) * 2 + c / 128] * 0x1p-9f) << i;
  }
  // channel scales in BF16, output in BF16
  Fp8ChannelOptions co;
  co.variant = Fp8ChannelVariant::kCompressedTensors;
  auto ch = RunChannel(w, DType::kBF16, 2, 130, 200, co);
  ASSERT_TRUE(ch.ok());
  std::vector<uint16_t> out16(w.size());
  ASSERT_TRUE(
      DequantizeFp8Channel(TensorView(DType::kF8E4M3, {2, 130, 200}, std::as_bytes(std::span(ch->q))),
                           TensorView(DType::kBF16, {2, 130, 1}, std::as_bytes(std::span(ch->s16))),
                           MutableTensorView(DType::kBF16, {2, 130, 200}, std::as_writable_bytes(std::span(out16))),
                           KernelOptions{})
          .ok());
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i) {
    const uint8_t q = ch->q[i];
    const float v = static_cast<float>((q & 0x80 ? -1 : 1) * mags[q & 0x7F]) * BF16ToF32(ch->s16[i / 200]);
    ASSERT_EQ(out16[i], F32ToBF16(v)) << i;
  }
}

TEST(Fp8Refusals, NonFiniteWeightsAreNamedByBlockOrRow) {
  std::vector<uint16_t> w(3 * 200 * 300, F32ToBF16(0.5f));
  w[(2 * 200 + 150) * 300 + 140] = 0x7FC0;  // NaN in expert 2, block (1, 1)
  auto b = RunBlock(w, DType::kBF16, 3, 200, 300, Fp8BlockOptions{});
  ASSERT_TRUE(absl::IsInvalidArgument(b.status()));
  EXPECT_TRUE(absl::StrContains(b.status().message(), "expert 2, block (1, 1) (rows 128..199, columns 128..255)"))
      << b.status();
  w[(2 * 200 + 150) * 300 + 140] = F32ToBF16(0.5f);
  w[(1 * 200 + 7) * 300 + 3] = 0x7F80;  // +Inf in expert 1, row 7
  auto c = RunChannel(w, DType::kBF16, 3, 200, 300, Fp8ChannelOptions{});
  ASSERT_TRUE(absl::IsInvalidArgument(c.status()));
  EXPECT_TRUE(absl::StrContains(c.status().message(), "expert 1, row 7")) << c.status();
  std::vector<uint16_t> h(64, F32ToF16(1.0f));
  h[5] = 0xFC00;  // fp16 -Inf
  EXPECT_TRUE(absl::IsInvalidArgument(RunBlock(h, DType::kF16, 1, 1, 64, Fp8BlockOptions{}).status()));
}

TEST(Fp8Refusals, BadShapesDtypesAndBlocks) {
  std::vector<uint16_t> w(64);
  std::vector<uint8_t> q(64);
  std::vector<float> s(1);
  auto qv = [&](Shape sh) {
    return MutableTensorView(DType::kF8E4M3, std::move(sh), std::as_writable_bytes(std::span(q)));
  };
  auto sv = [&](Shape sh) {
    return MutableTensorView(DType::kF32, std::move(sh), std::as_writable_bytes(std::span(s)));
  };
  const TensorView wv(DType::kBF16, {8, 8}, std::as_bytes(std::span(w)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      QuantizeFp8Block(TensorView(DType::kBF16, {64}, std::as_bytes(std::span(w))), qv({64}), sv({1}), {})));
  EXPECT_TRUE(absl::IsInvalidArgument(
      QuantizeFp8Block(TensorView(DType::kF32, {4, 8}, std::as_bytes(std::span(w))), qv({4, 8}), sv({1, 1}), {})));
  EXPECT_TRUE(absl::IsInvalidArgument(QuantizeFp8Block(wv, qv({8, 8}), sv({1, 2}), {})));  // scale shape
  EXPECT_TRUE(absl::IsInvalidArgument(QuantizeFp8Block(
      wv, MutableTensorView(DType::kU8, {8, 8}, std::as_writable_bytes(std::span(q))), sv({1, 1}), {})));  // q dtype
  Fp8BlockOptions zero;
  zero.block_k = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(QuantizeFp8Block(wv, qv({8, 8}), sv({1, 1}), zero)));
  EXPECT_TRUE(absl::IsInvalidArgument(QuantizeFp8Channel(wv, qv({8, 8}), sv({1, 1}), {})));  // want [8, 1]
  EXPECT_TRUE(absl::IsInvalidArgument(
      QuantizeFp8Block(wv, MutableTensorView(DType::kF8E4M3, {8, 8}, std::as_writable_bytes(std::span(w)).first(64)),
                       sv({1, 1}), {})));  // q overlaps W
  EXPECT_TRUE(QuantizeFp8Block(wv, qv({8, 8}), sv({1, 1}), {}).ok());
  EXPECT_EQ(*Fp8BlockScaleShape({3, 129, 7168}, 128, 128), (Shape{3, 2, 56}));
}

// ---- reuse of an earlier call (delta sync) ----------------------------------------------------------

// The unit (block, in scale order, or row) of every element of [e, n, k].
std::vector<int64_t> UnitOf(int64_t e, int64_t n, int64_t k, bool block, int64_t bn, int64_t bk) {
  std::vector<int64_t> u(static_cast<size_t>(e * n * k));
  const int64_t nb = (n + bn - 1) / bn, kb = (k + bk - 1) / bk;
  for (int64_t x = 0; x < e; ++x)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j)
        u[static_cast<size_t>((x * n + i) * k + j)] = block ? (x * nb + i / bn) * kb + j / bk : x * n + i;
  return u;
}

// Units whose elements all have equal bits in a and b (1) or not (0).
std::vector<int> EqualUnits(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                            const std::vector<int64_t>& unit, int64_t units) {
  std::vector<int> eq(static_cast<size_t>(units), 1);
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) eq[static_cast<size_t>(unit[i])] = 0;
  return eq;
}

// One reuse call: (block or channel) of w into a fresh Result, with digests `next` and, when
// `earlier` is set, its outputs and digests `prev`.
absl::StatusOr<Result> RunReusing(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k,
                                  const Fp8BlockOptions* bo, const Fp8ChannelOptions* co, const Result* earlier,
                                  std::span<const uint64_t> prev, std::span<uint64_t> next, int64_t* reused) {
  const Shape s = Sh(e, n, k);
  Shape ss = e > 1 ? Shape{e, n, 1} : Shape{n, 1};
  if (bo != nullptr) {
    ASSIGN_OR_RETURN(ss, Fp8BlockScaleShape(s, bo->block_n, bo->block_k));
  }
  const bool s16 = co != nullptr && co->variant == Fp8ChannelVariant::kCompressedTensors;
  const DType sdt = s16 ? dt : DType::kF32;
  const size_t units = next.size();
  Result r;
  r.q.assign(w.size(), 0xAA);
  if (s16)
    r.s16.assign(units, 0xFFFF);
  else
    r.s32.assign(units, -1.0f);
  auto scale_bytes = [&](Result& x) {
    return s16 ? std::as_writable_bytes(std::span(x.s16)) : std::as_writable_bytes(std::span(x.s32));
  };
  QuantizeReuse reuse;
  reuse.next_digests = next;
  if (earlier != nullptr) {
    reuse.digests = prev;
    reuse.packed = TensorView(DType::kF8E4M3, s, std::as_bytes(std::span(earlier->q)));
    reuse.scales =
        TensorView(sdt, ss, s16 ? std::as_bytes(std::span(earlier->s16)) : std::as_bytes(std::span(earlier->s32)));
  }
  const MutableTensorView q(DType::kF8E4M3, s, std::as_writable_bytes(std::span(r.q)));
  const MutableTensorView scale(sdt, ss, scale_bytes(r));
  RETURN_IF_ERROR(bo != nullptr ? QuantizeFp8Block(In16(w, dt, s), q, scale, *bo, reuse)
                                : QuantizeFp8Channel(In16(w, dt, s), q, scale, *co, reuse));
  *reused = reuse.reused_groups;
  return r;
}

// Every block variant and both channel variants, on the odd-shaped and stacked cases: a call that
// reuses an earlier one's unchanged blocks or rows gives the reference's bytes of the new weights,
// and reuses exactly the units whose bits did not change (counted here from the bits).
TEST(Fp8Reuse, ReusedBlocksAndRowsGiveTheReferencesBytes) {
  struct Mode {
    bool block;
    Fp8BlockVariant bv;
    Fp8ChannelVariant cv;
  };
  const Mode modes[] = {{true, Fp8BlockVariant::kSlime, {}},
                        {true, Fp8BlockVariant::kVllm, {}},
                        {true, Fp8BlockVariant::kUe8m0, {}},
                        {false, {}, Fp8ChannelVariant::kSlime},
                        {false, {}, Fp8ChannelVariant::kCompressedTensors}};
  for (const Case& c : kCases) {
    for (const Mode& m : modes) {
      const uint64_t seed = c.seed + 500;
      SCOPED_TRACE(::testing::Message() << SafetensorsName(c.dt) << " " << c.e << "x" << c.n << "x" << c.k << " seed "
                                        << seed << (m.block ? " block " : " channel ")
                                        << static_cast<int>(m.block ? static_cast<int>(m.bv) : static_cast<int>(m.cv)));
      Fp8BlockOptions bo;
      bo.block_n = 64;
      bo.block_k = 64;
      bo.variant = m.bv;
      bo.num_threads = 2;
      Fp8ChannelOptions co;
      co.variant = m.cv;
      co.num_threads = 2;
      const std::vector<int64_t> unit = UnitOf(c.e, c.n, c.k, m.block, 64, 64);
      const int64_t units = *std::max_element(unit.begin(), unit.end()) + 1;
      const std::vector<uint16_t> w0 = Weights(seed, c.dt, c.e, c.n, c.k, 1.0f);
      const std::vector<uint16_t> w1 = testing::Flipped(w0, std::max<int64_t>(1, units / 2), seed + 1);
      auto ref = [&](const std::vector<uint16_t>& w) {
        return m.block ? RefBlock(w, c.dt, c.e, c.n, c.k, 64, 64, m.bv) : RefChannel(w, c.dt, c.e * c.n, c.k, m.cv);
      };
      const Fp8BlockOptions* b = m.block ? &bo : nullptr;
      const Fp8ChannelOptions* ch = m.block ? nullptr : &co;
      std::vector<uint64_t> d0(static_cast<size_t>(units)), d1(d0.size()), fresh(d0.size());
      int64_t reused = -1;
      auto first = RunReusing(w0, c.dt, c.e, c.n, c.k, b, ch, nullptr, {}, std::span(d0), &reused);
      ASSERT_TRUE(first.ok()) << first.status();
      EXPECT_EQ(reused, 0);
      const Result want0 = ref(w0);
      EXPECT_EQ(first->q, want0.q);
      EXPECT_EQ(Bits(first->s32), Bits(want0.s32));
      EXPECT_EQ(first->s16, want0.s16);
      auto second = RunReusing(w1, c.dt, c.e, c.n, c.k, b, ch, &*first, d0, std::span(d1), &reused);
      ASSERT_TRUE(second.ok()) << second.status();
      const std::vector<int> eq = EqualUnits(w0, w1, unit, units);
      EXPECT_EQ(reused, std::count(eq.begin(), eq.end(), 1));
      if (units > 2) {
        EXPECT_GT(reused, 0);
        EXPECT_LT(reused, units);
      }
      const Result want1 = ref(w1);
      EXPECT_EQ(second->q, want1.q);
      EXPECT_EQ(Bits(second->s32), Bits(want1.s32));
      EXPECT_EQ(second->s16, want1.s16);
      // The digests are a function of the unit's bits: a call on w1 from nothing gives the same.
      ASSERT_TRUE(RunReusing(w1, c.dt, c.e, c.n, c.k, b, ch, nullptr, {}, std::span(fresh), &reused).ok());
      EXPECT_EQ(fresh, d1);
    }
  }
}

// The premise: unchanged units are copied from the earlier outputs, not computed. Earlier codes
// that are not that input's quantization (here: flipped bits) show up in exactly those units.
TEST(Fp8Reuse, EarlierOutputsThatAreNotTheInputsShowInTheReusedUnits) {
  const int64_t e = 2, n = 130, k = 200;
  for (bool block : {true, false}) {
    SCOPED_TRACE(block ? "block" : "channel");
    Fp8BlockOptions bo;
    bo.block_n = 64;
    bo.block_k = 64;
    const Fp8ChannelOptions co;
    const std::vector<int64_t> unit = UnitOf(e, n, k, block, 64, 64);
    const int64_t units = *std::max_element(unit.begin(), unit.end()) + 1;
    const std::vector<uint16_t> w0 = Weights(610, DType::kBF16, e, n, k, 1.0f);
    const std::vector<uint16_t> w1 = testing::Flipped(w0, units / 2, 611);
    std::vector<uint64_t> d0(static_cast<size_t>(units)), d1(d0.size());
    int64_t reused = 0;
    const Fp8BlockOptions* b = block ? &bo : nullptr;
    const Fp8ChannelOptions* ch = block ? nullptr : &co;
    auto first = RunReusing(w0, DType::kBF16, e, n, k, b, ch, nullptr, {}, std::span(d0), &reused);
    ASSERT_TRUE(first.ok()) << first.status();
    for (uint8_t& x : first->q) x ^= 0x01;
    auto second = RunReusing(w1, DType::kBF16, e, n, k, b, ch, &*first, d0, std::span(d1), &reused);
    ASSERT_TRUE(second.ok()) << second.status();
    const Result want = block ? RefBlock(w1, DType::kBF16, e, n, k, 64, 64, Fp8BlockVariant::kSlime)
                              : RefChannel(w1, DType::kBF16, e * n, k, Fp8ChannelVariant::kSlime);
    std::vector<int> wrong(static_cast<size_t>(units), 0);
    for (size_t i = 0; i < want.q.size(); ++i)
      if (second->q[i] != want.q[i]) wrong[static_cast<size_t>(unit[i])] = 1;
    const std::vector<int> eq = EqualUnits(w0, w1, unit, units);
    ASSERT_GT(reused, 0);
    EXPECT_EQ(wrong, eq);
  }
}

TEST(Fp8Reuse, BadArgumentsAreRefused) {
  const std::vector<uint16_t> w = Weights(620, DType::kBF16, 1, 8, 128, 1.0f);
  std::vector<uint8_t> q(8 * 128);
  std::vector<float> s(8), other(4);
  std::vector<uint64_t> d(8), wrong(7);
  const TensorView wv = In16(w, DType::kBF16, {8, 128});
  const MutableTensorView qv(DType::kF8E4M3, {8, 128}, std::as_writable_bytes(std::span(q)));
  const MutableTensorView sv(DType::kF32, {8, 1}, std::as_writable_bytes(std::span(s)));
  const Fp8ChannelOptions co;
  auto refused = [&](QuantizeReuse r, const Fp8ChannelOptions& o, const char* what) {
    const absl::Status st = QuantizeFp8Channel(wv, qv, sv, o, r);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), what)) << st;
  };
  const TensorView earlier_q(DType::kF8E4M3, {8, 128}, std::as_bytes(std::span(q)));
  const TensorView earlier_s(DType::kF32, {8, 1}, std::as_bytes(std::span(s)));
  refused({{}, {}, {}, std::span(wrong)}, co, "next_digests holds 7 entries, want one per scale (block or row) (8)");
  refused({wrong, earlier_q, earlier_s, std::span(d)}, co, "digests holds 7 entries, want 8");
  refused({d, earlier_q, TensorView(DType::kF32, {4, 1}, std::as_bytes(std::span(other))), std::span(d)}, co,
          "want the outputs' dtypes and shapes");
  refused({d, earlier_q, earlier_s, std::span(d)}, co, "must not overlap");
  Fp8ChannelOptions cuda = co;
  cuda.device = Device::kCuda;
  refused({{}, {}, {}, std::span(d)}, cuda, "CPU kernel only");
  QuantizeReuse ok{{}, {}, {}, std::span(d)};
  EXPECT_TRUE(QuantizeFp8Channel(wv, qv, sv, co, ok).ok());
}

// ---- the golden file (torch) -------------------------------------------------------------------------

TEST(Fp8Golden, EveryCaseEqualsTorch) {
  auto file = SafetensorsFile::Open(testing::GoldenPath("fp8_golden.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<std::string> cases = testing::JsonNames(file->metadata().at("cases"));
  ASSERT_GE(cases.size(), 30u);
  for (const std::string& c : cases) {
    SCOPED_TRACE(c);
    const std::string base = c.substr(0, c.find('.'));
    const SafetensorsEntry* w = file->Find(base + ".w");
    ASSERT_NE(w, nullptr);
    const Shape& s = w->view.shape();  // [E, N, K]
    const std::vector<uint16_t> wv = testing::CopyOf<uint16_t>(*w);
    const std::vector<uint8_t> want_q = testing::CopyOf<uint8_t>(*file->Find(c + ".q"));
    const SafetensorsEntry& ws = *file->Find(c + ".s");
    absl::StatusOr<Result> got;
    const std::string v = c.substr(c.find('.') + 1);
    if (absl::StartsWith(v, "block_")) {
      Fp8BlockOptions o;
      o.variant = v == "block_slime"  ? Fp8BlockVariant::kSlime
                  : v == "block_vllm" ? Fp8BlockVariant::kVllm
                                      : Fp8BlockVariant::kUe8m0;
      got = RunBlock(wv, w->view.dtype(), s[0], s[1], s[2], o);
    } else {
      Fp8ChannelOptions o;
      o.variant = v == "channel_slime" ? Fp8ChannelVariant::kSlime : Fp8ChannelVariant::kCompressedTensors;
      got = RunChannel(wv, w->view.dtype(), s[0], s[1], s[2], o);
    }
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->q, want_q);
    if (ws.view.dtype() == DType::kF32)
      EXPECT_EQ(Bits(got->s32), Bits(testing::CopyOf<float>(ws)));
    else
      EXPECT_EQ(got->s16, testing::CopyOf<uint16_t>(ws));
  }
}

}  // namespace
}  // namespace wsync::kernels
