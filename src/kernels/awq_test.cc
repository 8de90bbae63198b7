// Tests of kernels/awq.h (CPU path) against scalar references written here from docs/spec/AWQ.md:
// §1 with fp16 rounding through common/dtype.h's F32ToF16 and double arithmetic (not the kernels'
// (x + C) - C formula), §2 AutoAWQ's packing loop, §3.1 the closed form of the Marlin tile
// (FORMATS.md §4.2 dk/dn lists) and the identity with GptqToMarlin, §3.3 vLLM's unpack ->
// undo-interleave -> scale_perm -> interleave -> pack route; plus the golden files that
// tools/golden/int4_golden.py writes from the upstream formulations (pure Python).
#include "kernels/awq.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
#include "hwy/targets.h"
#include "kernels/format/awq_format.h"
#include "kernels/int4.h"
#include "kernels/testing/flipped.h"
#include "kernels/testing/golden.h"

namespace wsync::kernels {
namespace {

using ::testing::HasSubstr;

constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // AWQ.md: ORDER

float ToF32(uint16_t bits, DType dt) { return dt == DType::kBF16 ? BF16ToF32(bits) : F16ToF32(bits); }
float F16Round(double x) { return F16ToF32(F32ToF16(static_cast<float>(x))); }

// ---- references (AWQ.md, literally) ----------------------------------------------------------------

struct RefAwq {
  std::vector<uint8_t> u;     // [E, N, K]
  std::vector<uint8_t> z;     // [E, N, K/G]
  std::vector<uint16_t> s16;  // [E, K/G, N], the stored scales
};

// §1 per (row, group), fp16 (AutoAWQ) or fp32 arithmetic.
RefAwq RefQuantize(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k, int64_t g, bool fp16) {
  RefAwq r;
  const int64_t ng = k / g;
  r.u.resize(static_cast<size_t>(e * n * k));
  r.z.resize(static_cast<size_t>(e * n * ng));
  r.s16.resize(static_cast<size_t>(e * ng * n));
  const float inv15 = static_cast<float>(1.0 / 15.0);
  const float floor16 = F16Round(1e-5);
  for (int64_t row = 0; row < e * n; ++row) {
    for (int64_t gi = 0; gi < ng; ++gi) {
      std::vector<double> x(static_cast<size_t>(g));
      for (int64_t i = 0; i < g; ++i) {
        const float v = ToF32(w[row * k + gi * g + i], dt);
        x[i] = fp16 ? F16Round(v) : v;  // .half() of the layer
      }
      double mx = x[0], mn = x[0];
      for (double v : x) mx = std::max(mx, v), mn = std::min(mn, v);
      double scale, zero;
      if (fp16) {
        double d = F16Round(mx - mn);
        if (d < floor16) d = floor16;
        scale = F16Round(static_cast<float>(d * inv15));  // x * fl32(1/15) in float, then to half
        zero = -std::nearbyint(F16Round(mn / scale));
      } else {
        float d = static_cast<float>(mx - mn);
        if (d < 1e-5f) d = 1e-5f;
        scale = d / 15.0f;
        zero = -std::nearbyint(static_cast<float>(mn / scale));
      }
      zero = std::min(15.0, std::max(0.0, zero));
      r.z[row * ng + gi] = static_cast<uint8_t>(zero);
      const int64_t ex = row / n, rn = row % n;
      r.s16[(ex * ng + gi) * n + rn] =
          dt == DType::kBF16 ? F32ToBF16(static_cast<float>(scale)) : F32ToF16(static_cast<float>(scale));
      for (int64_t i = 0; i < g; ++i) {
        const double q = fp16 ? F16Round(x[i] / scale) : static_cast<float>(x[i] / scale);
        const double u = std::min(15.0, std::max(0.0, std::nearbyint(q) + zero));
        r.u[row * k + gi * g + i] = static_cast<uint8_t>(u);
      }
    }
  }
  return r;
}

// §2, AutoAWQ's loop: qweight[k, col] |= intweight[k, col*8 + order[i]] << 4i (per expert).
// v is [E, N, rows] (codes u[n, k] or zero points z[n, g]) and is packed into [E, rows, N/8].
std::vector<uint32_t> RefPackAwq(const std::vector<uint8_t>& v, int64_t e, int64_t n, int64_t rows) {
  std::vector<uint32_t> out(static_cast<size_t>(e * rows * (n / 8)), 0);
  for (int64_t x = 0; x < e; ++x)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < n / 8; ++col)
        for (int i = 0; i < 8; ++i) {
          const int64_t nn = col * 8 + kOrder[i];
          const uint32_t val = v[(x * n + nn) * rows + r];
          out[(x * rows + r) * (n / 8) + col] |= val << (4 * i);
        }
  return out;
}

uint32_t RefCode(const std::vector<uint8_t>& u, int64_t n, int64_t k, int64_t x, int64_t kk, int64_t nn) {
  return u[(x * n + nn) * k + kk];
}

// FORMATS.md §4.2 closed form on the unpermuted codes u[k, n]: word 4t + v of tile (kt, nt),
// nibble j = u[16kt + 2(t%4) + dk[j], 64nt + 16v + t/4 + dn[j]].
std::vector<uint32_t> RefMarlin(const std::vector<uint8_t>& u, int64_t e, int64_t n, int64_t k) {
  constexpr int dk[8] = {0, 8, 0, 8, 1, 9, 1, 9}, dn[8] = {0, 0, 8, 8, 0, 0, 8, 8};
  std::vector<uint32_t> out(static_cast<size_t>(e * k / 16 * 2 * n), 0);
  for (int64_t x = 0; x < e; ++x)
    for (int64_t kt = 0; kt < k / 16; ++kt)
      for (int64_t nt = 0; nt < n / 64; ++nt)
        for (int t = 0; t < 32; ++t)
          for (int v = 0; v < 4; ++v) {
            uint32_t word = 0;
            for (int j = 0; j < 8; ++j) {
              word |= RefCode(u, n, k, x, 16 * kt + 2 * (t % 4) + dk[j], 64 * nt + 16 * v + t / 4 + dn[j]) << (4 * j);
            }
            out[x * (k / 16) * 2 * n + (kt * (n / 64) + nt) * 128 + 4 * t + v] = word;
          }
  return out;
}

// §3.3 the vLLM route: z[g, n] -> within 64 columns scale_perm (out[8i + j] = in[i + 8j]) ->
// interleave every 8 with ORDER -> pack_cols (element c -> word c/8, nibble c%8).
std::vector<uint32_t> RefMarlinZeros(const std::vector<uint8_t>& z, int64_t e, int64_t n, int64_t ng) {
  std::vector<uint32_t> out(static_cast<size_t>(e * ng * (n / 8)), 0);
  for (int64_t x = 0; x < e; ++x)
    for (int64_t g = 0; g < ng; ++g) {
      std::vector<uint32_t> row(static_cast<size_t>(n)), perm(static_cast<size_t>(n)), il(static_cast<size_t>(n));
      for (int64_t c = 0; c < n; ++c) row[c] = z[(x * n + c) * ng + g];
      for (int64_t c = 0; c < n; ++c) perm[c] = row[(c / 64) * 64 + (c % 64) / 8 + 8 * (c % 8)];
      for (int64_t c = 0; c < n; ++c) il[c] = perm[(c / 8) * 8 + kOrder[c % 8]];
      for (int64_t c = 0; c < n; ++c) out[(x * ng + g) * (n / 8) + c / 8] |= il[c] << (4 * (c % 8));
    }
  return out;
}

std::vector<uint16_t> RandomWeights(size_t count, DType dt, uint32_t seed, float sigma = 0.02f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<uint16_t> w(count);
  for (auto& v : w) v = dt == DType::kBF16 ? F32ToBF16(dist(rng)) : F32ToF16(dist(rng));
  return w;
}

TensorView View(const std::vector<uint16_t>& v, DType dt, Shape s) {
  return TensorView(dt, std::move(s), std::as_bytes(std::span(v)));
}
template <typename T>
MutableTensorView Out(std::vector<T>& v, DType dt, Shape s) {
  return MutableTensorView(dt, std::move(s), std::as_writable_bytes(std::span(v)));
}
template <typename T>
TensorView In(const std::vector<T>& v, DType dt, Shape s) {
  return TensorView(dt, std::move(s), std::as_bytes(std::span(v)));
}
Shape Sh(int64_t e, std::initializer_list<int64_t> tail) {
  Shape s;
  if (e > 0) s.push_back(e);
  for (int64_t d : tail) s.push_back(d);
  return s;
}

struct AwqOut {
  std::vector<uint32_t> qweight, qzeros;
  std::vector<uint16_t> scales;
};

// Outputs for ee experts of [n, k] at group size gg, filled with a pattern no quantization writes.
AwqOut Unwritten(int64_t ee, int64_t n, int64_t k, int64_t gg) {
  AwqOut o;
  o.qweight.assign(static_cast<size_t>(ee * k * n / 8), 0xDEADBEEFu);
  o.qzeros.assign(static_cast<size_t>(ee * (k / gg) * n / 8), 0xDEADBEEFu);
  o.scales.assign(static_cast<size_t>(ee * (k / gg) * n), 0xFFFF);
  return o;
}

// e = 0 means a dense [N, K] weight; else [E, N, K].
absl::StatusOr<AwqOut> RunQuantize(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k, int g,
                                   AwqArith arith, int threads = 2) {
  const int64_t ee = std::max<int64_t>(e, 1), gg = g == kChannelwise ? k : g;
  AwqOut o = Unwritten(ee, n, k, gg);
  AwqQuantizeOptions opt;
  opt.group_size = g;
  opt.arith = arith;
  opt.num_threads = threads;
  RETURN_IF_ERROR(QuantizeAwq(View(w, dt, Sh(e, {n, k})), Out(o.qweight, DType::kI32, Sh(e, {k, n / 8})),
                              Out(o.qzeros, DType::kI32, Sh(e, {k / gg, n / 8})), Out(o.scales, dt, Sh(e, {k / gg, n})),
                              opt));
  return o;
}

void CheckQuantize(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k, int g, AwqArith arith,
                   int threads = 2) {
  SCOPED_TRACE(::testing::Message() << "dtype " << SafetensorsName(dt) << " E " << e << " N " << n << " K " << k
                                    << " G " << g << (arith == AwqArith::kFp16 ? " fp16" : " fp32"));
  const int64_t ee = std::max<int64_t>(e, 1), gg = g == kChannelwise ? k : g;
  auto got = RunQuantize(w, dt, e, n, k, g, arith, threads);
  ASSERT_TRUE(got.ok()) << got.status();
  const RefAwq ref = RefQuantize(w, dt, ee, n, k, gg, arith == AwqArith::kFp16);
  EXPECT_EQ(got->scales, ref.s16);
  EXPECT_EQ(got->qweight, RefPackAwq(ref.u, ee, n, k));
  EXPECT_EQ(got->qzeros, RefPackAwq(ref.z, ee, n, k / gg));
}

// ---- format helpers --------------------------------------------------------------------------------

TEST(AwqFormatTest, RoundToF16IsIeeeHalfRounding) {
  // Every float of the exponents that matter (2^-26 .. 2^17) on a stride, plus the boundaries.
  std::mt19937 rng(7);
  for (uint32_t e = 100; e <= 144; ++e) {
    for (int i = 0; i < 20000; ++i) {
      const uint32_t bits = (e << 23) | (rng() & 0x7FFFFFu) | (i % 2 ? 0x80000000u : 0u);
      float f;
      std::memcpy(&f, &bits, 4);
      const float want = F16ToF32(F32ToF16(f));
      const float got = format::RoundToF16(f);
      ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << "x = " << f << " bits 0x" << std::hex << bits;
    }
  }
  for (float f : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e30f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x1.5p-17f}) {
    const float want = F16ToF32(F32ToF16(f)), got = format::RoundToF16(f);
    EXPECT_EQ(std::memcmp(&want, &got, 4), 0) << f;
  }
  EXPECT_EQ(format::kF16ScaleFloor, F16Round(1e-5));
  EXPECT_EQ(format::kAwqInv15, static_cast<float>(1.0 / 15.0));
  uint32_t inv15_bits;
  std::memcpy(&inv15_bits, &format::kAwqInv15, 4);
  EXPECT_EQ(inv15_bits, 0x3D888889u);  // AWQ.md §1
}

TEST(AwqFormatTest, WorkedExamplesOfTheSpec) {
  // §2: columns 0..7 holding 0..7 -> 0x75316420.
  std::vector<uint8_t> codes(8);
  for (int c = 0; c < 8; ++c) codes[c] = static_cast<uint8_t>(c);
  EXPECT_EQ(RefPackAwq(codes, 1, 8, 1)[0], 0x75316420u);
  uint32_t gptq[8];
  for (int c = 0; c < 8; ++c) gptq[c] = static_cast<uint32_t>(c);  // row 0 holds c in column c
  uint32_t awq[8];
  format::GptqBlockToAwq(gptq, awq);
  EXPECT_EQ(awq[0], 0x75316420u);
  // §3.3: z[0, c] = c % 16 for 64 columns -> Marlin zero word 0 = 0x88880000.
  std::vector<uint8_t> z(64);
  for (int c = 0; c < 64; ++c) z[c] = static_cast<uint8_t>(c % 16);
  const std::vector<uint32_t> awq_z = RefPackAwq(z, 1, 64, 1);
  EXPECT_EQ(format::MarlinZeroWord(awq_z.data(), 0), 0x88880000u);
  EXPECT_EQ(RefMarlinZeros(z, 1, 64, 1)[0], 0x88880000u);
}

TEST(AwqFormatTest, NibbleTransposeIsATranspose) {
  std::mt19937 rng(11);
  for (int rep = 0; rep < 200; ++rep) {
    uint32_t m[8], t[8];
    for (auto& w : m) w = rng();
    std::memcpy(t, m, sizeof(m));
    format::TransposeNibbles8x8(t);
    for (int r = 0; r < 8; ++r)
      for (int i = 0; i < 8; ++i) ASSERT_EQ(format::GetNibble(t[i], r), format::GetNibble(m[r], i));
  }
}

// ---- quantization ----------------------------------------------------------------------------------

TEST(AwqQuantizeTest, RandomDenseAndStackedEveryGroupSizeBothArithmetics) {
  uint32_t seed = 100;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (AwqArith arith : {AwqArith::kFp16, AwqArith::kFp32}) {
      for (int g : {32, 64, 128, kChannelwise}) {
        ++seed;
        CheckQuantize(RandomWeights(136 * 256, dt, seed), dt, 0, 136, 256, g, arith);
        CheckQuantize(RandomWeights(3 * 24 * 128, dt, seed + 1000, 0.3f), dt, 3, 24, 128, g, arith, 3);
      }
    }
  }
}

// ---- reuse of an earlier call (delta sync) ----------------------------------------------------------

// One reuse call of QuantizeAwq into a fresh AwqOut (digests into `next`; with `earlier`, its
// outputs and digests `prev`); e = 0: dense.
absl::StatusOr<AwqOut> RunReusing(const std::vector<uint16_t>& w, DType dt, int64_t e, int64_t n, int64_t k, int g,
                                  const AwqOut* earlier, std::span<const uint64_t> prev, std::span<uint64_t> next,
                                  int64_t* reused) {
  const int64_t ee = std::max<int64_t>(e, 1), gg = g == kChannelwise ? k : g;
  AwqOut o = Unwritten(ee, n, k, gg);
  AwqQuantizeOptions opt;
  opt.group_size = g;
  opt.num_threads = 2;
  QuantizeReuse reuse;
  reuse.next_digests = next;
  if (earlier != nullptr) {
    reuse.digests = prev;
    reuse.packed = In(earlier->qweight, DType::kI32, Sh(e, {k, n / 8}));
    reuse.zeros = In(earlier->qzeros, DType::kI32, Sh(e, {k / gg, n / 8}));
    reuse.scales = In(earlier->scales, dt, Sh(e, {k / gg, n}));
  }
  RETURN_IF_ERROR(QuantizeAwq(View(w, dt, Sh(e, {n, k})), Out(o.qweight, DType::kI32, Sh(e, {k, n / 8})),
                              Out(o.qzeros, DType::kI32, Sh(e, {k / gg, n / 8})), Out(o.scales, dt, Sh(e, {k / gg, n})),
                              opt, reuse));
  *reused = reuse.reused_groups;
  return o;
}

// Units (8 rows' group g, in qzeros order) whose inputs have equal bits in a and b (1) or not (0).
std::vector<int> EqualAwqUnits(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t ee, int64_t n,
                               int64_t k, int64_t g) {
  const int64_t ng = k / g, nw = n / 8;
  std::vector<int> eq(static_cast<size_t>(ee * ng * nw), 1);
  for (int64_t x = 0; x < ee; ++x)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const size_t i = static_cast<size_t>((x * n + r) * k + c);
        if (a[i] != b[i]) eq[static_cast<size_t>((x * ng + c / g) * nw + r / 8)] = 0;
      }
  return eq;
}

// A call that reuses an earlier one's unchanged units gives the reference's bytes of the new
// weights and reuses exactly the units whose bits did not change (counted here from the bits);
// every group size, both dtypes, dense (N over one block of rows) and stacked.
TEST(AwqReuseTest, ReusedUnitsGiveTheReferencesBytes) {
  uint32_t seed = 700;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int g : {32, 128, kChannelwise}) {
      for (int64_t e : {0, 3}) {
        const int64_t n = e == 0 ? 136 : 24, k = 256, ee = std::max<int64_t>(e, 1), gg = g == kChannelwise ? k : g;
        seed += 2;
        SCOPED_TRACE(::testing::Message() << SafetensorsName(dt) << " G " << g << " E " << e << " seed " << seed);
        const auto w0 = RandomWeights(static_cast<size_t>(ee * n * k), dt, seed);
        const int64_t units = ee * (k / gg) * (n / 8);
        const auto w1 = testing::Flipped(w0, units / 2, seed + 1);
        std::vector<uint64_t> d0(static_cast<size_t>(units)), d1(d0.size()), fresh(d0.size());
        int64_t reused = -1;
        auto first = RunReusing(w0, dt, e, n, k, g, nullptr, {}, std::span(d0), &reused);
        ASSERT_TRUE(first.ok()) << first.status();
        EXPECT_EQ(reused, 0);
        auto second = RunReusing(w1, dt, e, n, k, g, &*first, d0, std::span(d1), &reused);
        ASSERT_TRUE(second.ok()) << second.status();
        const std::vector<int> eq = EqualAwqUnits(w0, w1, ee, n, k, gg);
        EXPECT_EQ(reused, std::count(eq.begin(), eq.end(), 1));
        EXPECT_GT(reused, 0);
        EXPECT_LT(reused, units);
        const RefAwq ref = RefQuantize(w1, dt, ee, n, k, gg, /*fp16=*/true);
        EXPECT_EQ(second->scales, ref.s16);
        EXPECT_EQ(second->qweight, RefPackAwq(ref.u, ee, n, k));
        EXPECT_EQ(second->qzeros, RefPackAwq(ref.z, ee, n, k / gg));
        ASSERT_TRUE(RunReusing(w1, dt, e, n, k, g, nullptr, {}, std::span(fresh), &reused).ok());
        EXPECT_EQ(fresh, d1);
      }
    }
  }
}

// The premise: unchanged units are copied from the earlier outputs, not computed. Earlier outputs
// that are not that input's quantization (flipped bits in every word and scale) show up in exactly
// those units.
TEST(AwqReuseTest, EarlierOutputsThatAreNotTheInputsShowInTheReusedUnits) {
  const int64_t n = 136, k = 256, g = 64, ng = k / g, nw = n / 8;
  const auto w0 = RandomWeights(static_cast<size_t>(n * k), DType::kBF16, 720);
  const auto w1 = testing::Flipped(w0, ng * nw / 2, 721);
  std::vector<uint64_t> d0(static_cast<size_t>(ng * nw)), d1(d0.size());
  int64_t reused = 0;
  auto first = RunReusing(w0, DType::kBF16, 0, n, k, g, nullptr, {}, std::span(d0), &reused);
  ASSERT_TRUE(first.ok()) << first.status();
  for (uint32_t& x : first->qweight) x ^= 0x1u;
  for (uint32_t& x : first->qzeros) x ^= 0x1u;
  for (uint16_t& x : first->scales) x ^= 0x1u;
  auto second = RunReusing(w1, DType::kBF16, 0, n, k, g, &*first, d0, std::span(d1), &reused);
  ASSERT_TRUE(second.ok()) << second.status();
  const RefAwq ref = RefQuantize(w1, DType::kBF16, 1, n, k, g, /*fp16=*/true);
  const std::vector<uint32_t> qw = RefPackAwq(ref.u, 1, n, k), qz = RefPackAwq(ref.z, 1, n, ng);
  std::vector<int> wrong(static_cast<size_t>(ng * nw), 0);
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t c = 0; c < nw; ++c)
      if (second->qweight[static_cast<size_t>(kk * nw + c)] != qw[static_cast<size_t>(kk * nw + c)])
        wrong[static_cast<size_t>((kk / g) * nw + c)] = 1;
  for (int64_t u = 0; u < ng * nw; ++u) {
    const bool zero_wrong = second->qzeros[static_cast<size_t>(u)] != qz[static_cast<size_t>(u)];
    const bool scale_wrong = second->scales[static_cast<size_t>((u / nw) * n + (u % nw) * 8)] !=
                             ref.s16[static_cast<size_t>((u / nw) * n + (u % nw) * 8)];
    EXPECT_EQ(zero_wrong, wrong[static_cast<size_t>(u)] == 1) << "unit " << u;
    EXPECT_EQ(scale_wrong, wrong[static_cast<size_t>(u)] == 1) << "unit " << u;
  }
  ASSERT_GT(reused, 0);
  EXPECT_EQ(wrong, EqualAwqUnits(w0, w1, 1, n, k, g));
}

TEST(AwqReuseTest, BadArgumentsAreRefused) {
  const int64_t n = 16, k = 128;
  const auto w = RandomWeights(static_cast<size_t>(n * k), DType::kBF16, 730);
  std::vector<uint32_t> qw(static_cast<size_t>(k * n / 8)), qz(n / 8), other(1);
  std::vector<uint16_t> sc(n);
  std::vector<uint64_t> d(2), earlier(2), wrong(3);
  AwqQuantizeOptions opt;  // G 128: 2 units
  auto refused = [&](QuantizeReuse r, const AwqQuantizeOptions& o, const char* what) {
    const absl::Status st = QuantizeAwq(View(w, DType::kBF16, {n, k}), Out(qw, DType::kI32, {k, n / 8}),
                                        Out(qz, DType::kI32, {1, n / 8}), Out(sc, DType::kBF16, {1, n}), o, r);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), what)) << st;
  };
  std::vector<uint32_t> eqw(qw.size()), eqz(qz.size());
  std::vector<uint16_t> esc(sc.size());
  const TensorView pw = In(eqw, DType::kI32, {k, n / 8}), pz = In(eqz, DType::kI32, {1, n / 8}),
                   ps = In(esc, DType::kBF16, {1, n});
  refused({{}, {}, {}, std::span(wrong)}, opt, "next_digests holds 3 entries, want one per qzeros word (2)");
  refused({wrong, pw, ps, std::span(d), 0, pz}, opt, "digests holds 3 entries, want 2");
  refused({earlier, pw, ps, std::span(d), 0, In(other, DType::kI32, {1, 1})}, opt, "the earlier qzeros are");
  refused({d, In(qw, DType::kI32, {k, n / 8}), ps, std::span(wrong).first(2), 0, pz}, opt, "must not overlap");
  AwqQuantizeOptions cuda = opt;
  cuda.device = Device::kCuda;
  refused({{}, {}, {}, std::span(d)}, cuda, "CPU kernel only");
  // next_digests over the qzeros output: refused (threads would write both).
  std::vector<uint64_t> shared(2);
  QuantizeReuse over{{}, {}, {}, std::span(shared)};
  const absl::Status st =
      QuantizeAwq(View(w, DType::kBF16, {n, k}), Out(qw, DType::kI32, {k, n / 8}),
                  MutableTensorView(DType::kI32, {1, n / 8}, std::as_writable_bytes(std::span(shared)).first(8)),
                  Out(sc, DType::kBF16, {1, n}), opt, over);
  EXPECT_TRUE(absl::StrContains(st.message(), "next_digests must not overlap")) << st;
  QuantizeReuse ok{earlier, pw, ps, std::span(d), 0, pz};
  EXPECT_TRUE(QuantizeAwq(View(w, DType::kBF16, {n, k}), Out(qw, DType::kI32, {k, n / 8}),
                          Out(qz, DType::kI32, {1, n / 8}), Out(sc, DType::kBF16, {1, n}), opt, ok)
                  .ok());
}

TEST(AwqQuantizeTest, EdgeGroups) {
  // Rows of 32 values (G = 32), one edge case per row; K = 64 so each row has a second group.
  const int64_t n = 8, k = 64;
  std::vector<float> v(static_cast<size_t>(n * k));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (auto& x : v) x = uni(rng);
  auto row = [&](int r) { return v.data() + r * k; };
  std::fill_n(row(0), 32, 0.0f);                                                        // all zero
  for (int i = 0; i < 32; ++i) row(1)[i] = 0.5f + 0.01f * i;                            // all positive: z = 0
  for (int i = 0; i < 32; ++i) row(2)[i] = -0.5f - 0.01f * i;                           // all negative: z = 15
  std::fill_n(row(3), 32, 0.75f);                                                       // constant
  for (int i = 0; i < 32; ++i) row(4)[i] = (i % 2 ? 1 : -1) * 20000.0f * (i + 1) / 32;  // huge
  for (int i = 0; i < 32; ++i) row(5)[i] = 1e-6f * (i - 16);                            // fp16 subnormals
  for (int i = 0; i < 32; ++i) row(6)[i] = i < 16 ? static_cast<float>(i) : static_cast<float>((i - 16) % 15) + 0.5f;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> w(v.size());
    for (size_t i = 0; i < v.size(); ++i) w[i] = dt == DType::kBF16 ? F32ToBF16(v[i]) : F32ToF16(v[i]);
    for (AwqArith arith : {AwqArith::kFp16, AwqArith::kFp32}) CheckQuantize(w, dt, 0, n, k, 32, arith);
    auto got = RunQuantize(w, dt, 0, n, k, 32, AwqArith::kFp16);
    ASSERT_TRUE(got.ok());
    // Row 0: all zero -> z = 0 (nibble REV[0] = 0 of word 0), every code 0.
    EXPECT_EQ(got->qzeros[0] & 0xFu, 0u);
    EXPECT_EQ(got->qweight[0] & 0xFu, 0u);
    // Row 1 (all positive) -> z = 0; row 2 (all negative) -> z = 15 (nibbles REV[1] = 4, REV[2] = 1).
    EXPECT_EQ(format::GetNibble(got->qzeros[0], 4), 0u);
    EXPECT_EQ(format::GetNibble(got->qzeros[0], 1), 15u);
    // Row 6, ties (min 0, max 15): s = 1, z = 0; 2.5 -> 2, 3.5 -> 4 (half to even) at columns 18 and 19.
    auto code = [&](int64_t kk, int64_t nn) { return format::AwqNibble(got->qweight[kk * (n / 8) + nn / 8], nn); };
    EXPECT_EQ(code(18, 6), 2u);
    EXPECT_EQ(code(19, 6), 4u);
  }
}

// Every finite bf16 value that fp16 can hold (|x| < 65520: exponents up to 2^15), positive then
// negative, in groups of 32 consecutive bit patterns: each is rounded to fp16 (the fp16 arithmetic's
// first step, subnormals and ties included) and divided by its group's scale, on every compiled SIMD
// target, bit-exact with the scalar reference.
TEST(AwqQuantizeTest, EveryBf16ValueFp16CanHoldOnEverySimdTarget) {
  std::vector<uint16_t> w;
  for (uint16_t sign : {0x0000, 0x8000})
    for (uint32_t bits = 0; bits < (143u << 7); ++bits) w.push_back(static_cast<uint16_t>(sign | bits));
  const int64_t k = 256, n = (static_cast<int64_t>(w.size()) + 8 * k - 1) / (8 * k) * 8;
  w.resize(static_cast<size_t>(n * k), 0);
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(t);
    SCOPED_TRACE(hwy::TargetName(t));
    for (AwqArith arith : {AwqArith::kFp16, AwqArith::kFp32}) CheckQuantize(w, DType::kBF16, 0, n, k, 32, arith);
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(AwqQuantizeTest, Fp16ArithmeticRefusesWhatFp16CannotHoldFp32Accepts) {
  const int64_t n = 8, k = 32;
  std::vector<uint16_t> w(static_cast<size_t>(n * k), F32ToBF16(0.01f));
  w[3 * k + 5] = F32ToBF16(70000.0f);  // beyond fp16
  auto st = RunQuantize(w, DType::kBF16, 0, n, k, 32, AwqArith::kFp16);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.status().message(), HasSubstr("expert 0, row 3, group 0 (columns 0..31)"));
  EXPECT_THAT(st.status().message(), HasSubstr("65520"));
  EXPECT_TRUE(RunQuantize(w, DType::kBF16, 0, n, k, 32, AwqArith::kFp32).ok());
  // A group range past fp16 although both ends fit: 40000 - (-40000).
  std::vector<uint16_t> w2(static_cast<size_t>(n * k), F32ToBF16(0.01f));
  w2[5 * k + 1] = F32ToBF16(40000.0f);
  w2[5 * k + 2] = F32ToBF16(-40000.0f);
  st = RunQuantize(w2, DType::kBF16, 0, n, k, 32, AwqArith::kFp16);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.status().message(), HasSubstr("row 5, group 0"));
}

// The group parameters are computed lanewise across rows (8 or 16 per vector) with a scalar
// remainder: the edge groups above and both refusals, placed inside a full vector of rows, give
// the reference's bits and name the same rows.
TEST(AwqQuantizeTest, EdgeGroupsAndRefusalsInsideAVectorOfRows) {
  const int64_t n = 40, k = 64;  // rows 0..31: whole vectors; 32..39: the remainder
  std::vector<float> v(static_cast<size_t>(n * k));
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (auto& x : v) x = uni(rng);
  auto row = [&](int r) { return v.data() + r * k; };
  std::fill_n(row(17), 32, 0.0f);
  for (int i = 0; i < 32; ++i) row(18)[i] = 0.5f + 0.01f * i;
  for (int i = 0; i < 32; ++i) row(19)[i] = -0.5f - 0.01f * i;
  std::fill_n(row(20), 32, 0.75f);
  for (int i = 0; i < 32; ++i) row(21)[i] = (i % 2 ? 1 : -1) * 20000.0f * (i + 1) / 32;
  for (int i = 0; i < 32; ++i) row(22)[i] = 1e-6f * (i - 16);
  for (int i = 0; i < 32; ++i) row(35)[i] = 1e-6f * (i - 16);  // and one in the remainder
  for (DType dt : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> w(v.size());
    for (size_t i = 0; i < v.size(); ++i) w[i] = dt == DType::kBF16 ? F32ToBF16(v[i]) : F32ToF16(v[i]);
    for (AwqArith arith : {AwqArith::kFp16, AwqArith::kFp32}) CheckQuantize(w, dt, 0, n, k, 32, arith);
  }
  std::vector<uint16_t> wide(static_cast<size_t>(n * k), F32ToBF16(0.01f));
  wide[13 * k + 40] = F32ToBF16(40000.0f);  // row 13, group 1: a range past fp16
  wide[13 * k + 41] = F32ToBF16(-40000.0f);
  auto st = RunQuantize(wide, DType::kBF16, 0, n, k, 32, AwqArith::kFp16);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.status().message(), HasSubstr("row 13, group 1"));
  EXPECT_TRUE(RunQuantize(wide, DType::kBF16, 0, n, k, 32, AwqArith::kFp32).ok());
  std::vector<uint16_t> inf(static_cast<size_t>(n * k), F32ToBF16(0.01f));
  inf[26 * k + 3] = 0x7F80;  // +inf in row 26, group 0
  st = RunQuantize(inf, DType::kBF16, 0, n, k, 32, AwqArith::kFp32);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.status().message(), HasSubstr("row 26, group 0"));
}

TEST(AwqQuantizeTest, NonFiniteAndBadShapesAreRefusedWithTheValues) {
  std::vector<uint16_t> w(16 * 64, F32ToF16(0.1f));
  w[9 * 64 + 40] = 0x7E00;  // NaN
  auto st = RunQuantize(w, DType::kF16, 0, 16, 64, 32, AwqArith::kFp32);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.status().message(), HasSubstr("Inf or NaN in expert 0, row 9, group 1 (columns 32..63)"));
  AwqOut o;
  o.qweight.resize(64), o.qzeros.resize(64), o.scales.resize(256);
  AwqQuantizeOptions opt;
  opt.group_size = 32;
  const Shape one{1};
  auto call = [&](DType dt, Shape s) {
    std::vector<uint16_t> x(4096);
    const absl::Status r =
        QuantizeAwq(TensorView(dt, s, std::as_bytes(std::span(x)).first(static_cast<size_t>(*NumBytes(dt, s)))),
                    Out(o.qweight, DType::kI32, one), Out(o.qzeros, DType::kI32, one), Out(o.scales, dt, one), opt);
    return r;
  };
  EXPECT_THAT(call(DType::kF16, {12, 64}).message(), HasSubstr("N = 12 is not a multiple of 8 (N % 8 = 4)"));
  EXPECT_THAT(call(DType::kF16, {16, 48}).message(), HasSubstr("K = 48 is not a multiple of the group size 32"));
  EXPECT_THAT(call(DType::kF32, {16, 64}).message(), HasSubstr("W dtype F32 unsupported"));
  EXPECT_THAT(call(DType::kF16, {1024}).message(), HasSubstr("rank 2 or 3"));
  EXPECT_THAT(call(DType::kF16, {16, 64}).message(), HasSubstr("qweight is I32[1], want I32[64, 2]"));
  opt.group_size = 48;
  EXPECT_THAT(call(DType::kF16, {16, 96}).message(), HasSubstr("group size 48 unsupported"));
}

// ---- layout conversions ----------------------------------------------------------------------------

// AWQ -> GPTQ orientation and back, AWQ -> Marlin against the closed form and GptqToMarlin; N = 192
// (24 words per row: whole vectors and a tail on every SIMD width).
void CheckAwqRepack() {
  for (int64_t e : {0, 2}) {
    const int64_t ee = std::max<int64_t>(e, 1), n = 192, k = 96;
    std::mt19937 rng(static_cast<uint32_t>(20 + e));
    std::vector<uint8_t> u(static_cast<size_t>(ee * n * k));
    for (auto& c : u) c = static_cast<uint8_t>(rng() & 0xF);
    const std::vector<uint32_t> awq = RefPackAwq(u, ee, n, k);
    KernelOptions ko;
    ko.num_threads = 2;
    std::vector<uint32_t> gptq(awq.size()), back(awq.size());
    ASSERT_TRUE(AwqToGptq(In(awq, DType::kI32, Sh(e, {k, n / 8})), Out(gptq, DType::kI32, Sh(e, {k / 8, n})), ko).ok());
    for (int64_t x = 0; x < ee; ++x)
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t c = 0; c < n; ++c)
          ASSERT_EQ(format::GetNibble(gptq[(x * k / 8 + kk / 8) * n + c], static_cast<int>(kk % 8)),
                    RefCode(u, n, k, x, kk, c));
    ASSERT_TRUE(
        GptqToAwq(In(gptq, DType::kI32, Sh(e, {k / 8, n})), Out(back, DType::kI32, Sh(e, {k, n / 8})), ko).ok());
    EXPECT_EQ(back, awq);
    std::vector<uint32_t> marlin(static_cast<size_t>(ee * k / 16 * 2 * n)), via_gptq(marlin.size());
    ASSERT_TRUE(
        AwqToMarlin(In(awq, DType::kI32, Sh(e, {k, n / 8})), Out(marlin, DType::kI32, Sh(e, {k / 16, 2 * n})), ko)
            .ok());
    EXPECT_EQ(marlin, RefMarlin(u, ee, n, k));
    // §3.1: identical to gptq_marlin_repack of the same codes with no permutation.
    ASSERT_TRUE(GptqToMarlin(In(gptq, DType::kI32, Sh(e, {k / 8, n})), nullptr,
                             Out(via_gptq, DType::kI32, Sh(e, {k / 16, 2 * n})), ko)
                    .ok());
    EXPECT_EQ(marlin, via_gptq);
  }
}

TEST(AwqRepackTest, GptqOrientationRoundTripsAndMarlinMatchesTheClosedForm) { CheckAwqRepack(); }

TEST(AwqRepackTest, MarlinZeroPointsMatchVllmsRouteAndInvert) {
  for (int64_t e : {0, 3}) {
    const int64_t ee = std::max<int64_t>(e, 1), n = 256, ng = 5;
    std::mt19937 rng(static_cast<uint32_t>(40 + e));
    std::vector<uint8_t> z(static_cast<size_t>(ee * n * ng));
    for (auto& c : z) c = static_cast<uint8_t>(rng() & 0xF);
    const std::vector<uint32_t> awq = RefPackAwq(z, ee, n, ng);
    std::vector<uint32_t> marlin(awq.size()), back(awq.size());
    KernelOptions ko;
    ASSERT_TRUE(
        AwqZerosToMarlin(In(awq, DType::kI32, Sh(e, {ng, n / 8})), Out(marlin, DType::kI32, Sh(e, {ng, n / 8})), ko)
            .ok());
    EXPECT_EQ(marlin, RefMarlinZeros(z, ee, n, ng));
    ASSERT_TRUE(
        MarlinZerosToAwq(In(marlin, DType::kI32, Sh(e, {ng, n / 8})), Out(back, DType::kI32, Sh(e, {ng, n / 8})), ko)
            .ok());
    EXPECT_EQ(back, awq);
  }
}

TEST(AwqRepackTest, ShapesAreCheckedWithTheValues) {
  std::vector<uint32_t> a(4096), b(4096);
  KernelOptions ko;
  auto st = AwqToMarlin(In(a, DType::kI32, {24, 8}), Out(b, DType::kI32, {1, 128}), ko);
  EXPECT_THAT(st.message(), HasSubstr("K = 24 is not a multiple of 16 (K % 16 = 8)"));
  st = AwqToMarlin(In(a, DType::kI32, {32, 12}), Out(b, DType::kI32, {2, 192}), ko);
  EXPECT_THAT(st.message(), HasSubstr("N = 96 is not a multiple of 64 (N % 64 = 32)"));
  std::vector<uint32_t> q(32 * 8), m(2 * 64), g(16 * 8);
  st = AwqToMarlin(In(q, DType::kI32, {32, 8}), Out(m, DType::kI32, {2, 64}), ko);
  EXPECT_THAT(st.message(), HasSubstr("want I32[2, 128]"));
  st = AwqZerosToMarlin(In(a, DType::kI32, {2, 4}), Out(b, DType::kI32, {2, 4}), ko);
  EXPECT_THAT(st.message(), HasSubstr("N = 32 is not a multiple of 64"));
  st = AwqToGptq(In(a, DType::kI32, {12, 8}), Out(b, DType::kI32, {1, 64}), ko);
  EXPECT_THAT(st.message(), HasSubstr("rows = 12 is not a multiple of 8"));
  st = AwqToGptq(In(g, DType::kI32, {16, 8}), Out(g, DType::kI32, {2, 64}), ko);
  EXPECT_THAT(st.message(), HasSubstr("overlap"));
}

TEST(AwqTargetsTest, EveryCompiledSimdTargetIsBitExact) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (int64_t t : targets) {
    hwy::SetSupportedTargetsForTest(t);
    SCOPED_TRACE(hwy::TargetName(t));
    uint32_t seed = 900;
    for (DType dt : {DType::kBF16, DType::kF16}) {
      for (AwqArith arith : {AwqArith::kFp16, AwqArith::kFp32}) {
        CheckQuantize(RandomWeights(40 * 96, dt, ++seed, 0.5f), dt, 0, 40, 96, 32, arith);
        CheckQuantize(RandomWeights(2 * 16 * 136, dt, ++seed), dt, 2, 16, 136, kChannelwise, arith);
      }
    }
    CheckAwqRepack();
  }
  hwy::SetSupportedTargetsForTest(0);
}

// ---- golden files (tools/golden/int4_golden.py: the upstream formulations, in Python) -------------

using kernels::testing::CopyOf;

TEST(AwqGoldenTest, MatchesThePythonFormulation) {
  auto file = SafetensorsFile::Open(testing::GoldenPath("awq_golden.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  const std::vector<std::string> cases = kernels::testing::JsonNames(file->metadata().at("cases"));
  ASSERT_GE(cases.size(), 4u);
  for (const std::string& c : cases) {
    SCOPED_TRACE(c);
    const SafetensorsEntry* w = file->Find(c + ".w");
    ASSERT_NE(w, nullptr);
    const int g = std::stoi(file->metadata().at(c + ".group_size"));
    const Shape& s = w->view.shape();
    const int64_t e = s.size() == 3 ? s[0] : 0, n = s[s.size() - 2], k = s.back();
    const std::vector<uint16_t> wv = CopyOf<uint16_t>(*w);
    for (const char* arith : {"fp16", "fp32"}) {
      SCOPED_TRACE(arith);
      auto got = RunQuantize(wv, w->view.dtype(), e, n, k, g,
                             std::string(arith) == "fp16" ? AwqArith::kFp16 : AwqArith::kFp32);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->qweight, CopyOf<uint32_t>(*file->Find(c + "." + arith + ".qweight")));
      EXPECT_EQ(got->qzeros, CopyOf<uint32_t>(*file->Find(c + "." + arith + ".qzeros")));
      EXPECT_EQ(got->scales, CopyOf<uint16_t>(*file->Find(c + "." + arith + ".scales")));
    }
    // Marlin forms of the fp16 result.
    const SafetensorsEntry& qw = *file->Find(c + ".fp16.qweight");
    const SafetensorsEntry& qz = *file->Find(c + ".fp16.qzeros");
    const SafetensorsEntry& sc = *file->Find(c + ".fp16.scales");
    const std::vector<uint32_t> qwv = CopyOf<uint32_t>(qw), qzv = CopyOf<uint32_t>(qz);
    const std::vector<uint16_t> scv = CopyOf<uint16_t>(sc);
    KernelOptions ko;
    std::vector<uint32_t> marlin(qwv.size()), mz(qzv.size());
    std::vector<uint16_t> ms(scv.size());
    ASSERT_TRUE(AwqToMarlin(In(qwv, DType::kI32, qw.view.shape()),
                            Out(marlin, DType::kI32, *AwqMarlinShapeFor(qw.view.shape())), ko)
                    .ok());
    EXPECT_EQ(marlin, CopyOf<uint32_t>(*file->Find(c + ".fp16.marlin_qweight")));
    ASSERT_TRUE(
        AwqZerosToMarlin(In(qzv, DType::kI32, qz.view.shape()), Out(mz, DType::kI32, qz.view.shape()), ko).ok());
    EXPECT_EQ(mz, CopyOf<uint32_t>(*file->Find(c + ".fp16.marlin_qzeros")));
    ASSERT_TRUE(PermuteMarlinScales(In(scv, sc.view.dtype(), sc.view.shape()), k, g,
                                    Out(ms, sc.view.dtype(), sc.view.shape()), ko)
                    .ok());
    EXPECT_EQ(ms, CopyOf<uint16_t>(*file->Find(c + ".fp16.marlin_scales")));
  }
}

}  // namespace
}  // namespace wsync::kernels
