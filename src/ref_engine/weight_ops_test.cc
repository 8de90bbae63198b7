// The in-place weight kernels (weight_ops.h) are bit-exact, on random inputs with fixed recorded
// seeds:
//  * the Marlin decoder (MaterializeWeight, DecodeMarlinTile) equals src/kernels MarlinToGptq +
//    UnpermuteMarlinScales + bf16((u - 8) * s) for dense and stacked weights, bf16 and f16 scales,
//    grouped (including odd group counts and G < 16), channelwise, G == K, and SGLang's w13 scale
//    quirk in both directions (ENGINE_LAYOUT.md §4);
//  * MatMul over kMarlin / kBF16 / kF32 weights equals ops.h Dot over the materialized f32 matrix,
//    bit for bit, for 1 and several tokens, as do RowDot / RowAxpy / RowToFloats;
//  * the finiteness checks find the first bad element and judge Marlin scales exactly at the
//    overflow boundary.
#include "ref_engine/weight_ops.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/format/int4_format.h"
#include "kernels/int4.h"
#include "ref_engine/ops.h"

namespace wsync::ref_engine {
namespace {

struct MarlinCase {
  std::string name;
  int64_t experts, n, k;
  int group;  // -1 = channelwise
  bool f16 = false;
  std::optional<bool> grouped_perm;  // SGLang's choice when it differs from the kernel's
  uint64_t seed = 1;
};

void PrintTo(const MarlinCase& c, std::ostream* os) { *os << c.name; }

Tensor Must(absl::StatusOr<Tensor> t) {
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

// Random Marlin words (every word pattern is a valid tile) and random permuted scales.
struct MarlinData {
  Tensor packed, scales;
};
MarlinData RandomMarlin(const MarlinCase& c) {
  std::mt19937_64 rng(c.seed);
  const int64_t gc = c.group == -1 ? c.k : c.group;
  MarlinData d;
  d.packed = Must(Tensor::Empty(DType::kI32, {c.experts, c.k / 16, 2 * c.n}));
  for (int64_t i = 0; i < d.packed.view().numel(); ++i) d.packed.data_as<uint32_t>()[i] = static_cast<uint32_t>(rng());
  d.scales = Must(Tensor::Empty(c.f16 ? DType::kF16 : DType::kBF16, {c.experts, c.k / gc, c.n}));
  std::normal_distribution<float> logs(-4.0f, 2.0f);
  for (int64_t i = 0; i < d.scales.view().numel(); ++i) {
    const float s = std::exp(logs(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    d.scales.data_as<uint16_t>()[i] = c.f16 ? F32ToF16(s) : F32ToBF16(s);
  }
  return d;
}

// The kernels' path: [E, N, K] floats.
std::vector<float> KernelsReference(const MarlinCase& c, const MarlinData& d) {
  kernels::KernelOptions opts;
  opts.num_threads = 1;
  const int64_t gc = c.group == -1 ? c.k : c.group, rows = c.k / gc;
  Tensor gptq = Must(Tensor::Empty(DType::kI32, {c.experts, c.k / 8, c.n}));
  EXPECT_TRUE(kernels::MarlinToGptq(d.packed.view(), nullptr, gptq.mutable_view(), opts).ok());
  Tensor unperm = Must(Tensor::Empty(d.scales.dtype(), d.scales.shape()));
  const bool kernel_grouped = c.group != -1 && c.group < c.k;
  if (!c.grouped_perm || *c.grouped_perm == kernel_grouped) {
    const absl::Status s = kernels::UnpermuteMarlinScales(d.scales.view(), c.k, c.group, unperm.mutable_view(), opts);
    EXPECT_TRUE(s.ok()) << s;
  } else {
    // The kernel API cannot express SGLang's w13 choice: undo the permutation with the tables.
    const bool grouped = *c.grouped_perm;
    const int width = grouped ? kernels::format::kScalePermGroupedWidth : kernels::format::kScalePermChannelWidth;
    const uint16_t* in = d.scales.view().data_as<uint16_t>();
    uint16_t* out = unperm.data_as<uint16_t>();
    for (int64_t row = 0; row < c.experts * rows; ++row)
      for (int64_t b = 0; b < c.n; b += width)
        for (int q = 0; q < width; ++q) {
          const int src = grouped ? kernels::format::ScalePermGrouped(q) : kernels::format::ScalePermChannel(q);
          out[row * c.n + b + src] = in[row * c.n + b + q];
        }
  }
  std::vector<float> ref(static_cast<size_t>(c.experts * c.n * c.k));
  const uint32_t* q = gptq.view().data_as<uint32_t>();
  const uint16_t* s = unperm.view().data_as<uint16_t>();
  for (int64_t e = 0; e < c.experts; ++e)
    for (int64_t k = 0; k < c.k; ++k)
      for (int64_t n = 0; n < c.n; ++n) {
        const uint32_t word = q[(e * (c.k / 8) + k / 8) * c.n + n];
        const int u = static_cast<int>((word >> (4 * (k % 8))) & 0xfu);
        const uint16_t sb = s[(e * rows + k / gc) * c.n + n];
        const float scale = c.f16 ? F16ToF32(sb) : BF16ToF32(sb);
        ref[static_cast<size_t>((e * c.n + n) * c.k + k)] = BF16ToF32(F32ToBF16(static_cast<float>(u - 8) * scale));
      }
  return ref;
}

WeightRef MarlinWeight(const MarlinCase& c, const MarlinData& d) {
  WeightRef w;
  w.form = WeightForm::kMarlin;
  w.shape = {c.experts, c.n, c.k};
  w.rows = c.experts * c.n;
  w.cols = c.k;
  w.marlin.packed = d.packed.view().data_as<uint32_t>();
  w.marlin.scales = d.scales.view().data_as<uint16_t>();
  w.marlin.scales_f16 = c.f16;
  w.marlin.experts = c.experts;
  w.marlin.n = c.n;
  w.marlin.k = c.k;
  w.marlin.group = c.group == -1 ? c.k : c.group;
  w.marlin.grouped_perm = c.grouped_perm.value_or(c.group != -1 && c.group < c.k);
  return w;
}

std::vector<float> RandomFloats(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class MarlinDecodeTest : public ::testing::TestWithParam<MarlinCase> {};

TEST_P(MarlinDecodeTest, MaterializeEqualsKernelsPath) {
  const MarlinCase& c = GetParam();
  const MarlinData d = RandomMarlin(c);
  const std::vector<float> want = KernelsReference(c, d);
  const WeightRef w = MarlinWeight(c, d);
  std::vector<float> got(want.size(), -1.0f);
  MaterializeWeight(w, got.data());
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << "element " << i << " (expert " << i / static_cast<size_t>(c.n * c.k) << ", row "
        << (i / static_cast<size_t>(c.k)) % static_cast<size_t>(c.n) << ", k " << i % static_cast<size_t>(c.k) << ")";
  // One tile of the last expert through the public tile decoder.
  const int64_t e = c.experts - 1, kt = c.k / 16 - 1, nt = c.n / 64 - 1;
  std::vector<float> tile(16 * 64);
  DecodeMarlinTile(w.marlin, e, kt, nt, tile.data());
  for (int kl = 0; kl < 16; ++kl)
    for (int cl = 0; cl < 64; ++cl)
      ASSERT_EQ(tile[static_cast<size_t>(kl * 64 + cl)],
                want[static_cast<size_t>((e * c.n + 64 * nt + cl) * c.k + 16 * kt + kl)])
          << kl << ", " << cl;
}

TEST_P(MarlinDecodeTest, MatMulEqualsDotOverMaterialized) {
  const MarlinCase& c = GetParam();
  const MarlinData d = RandomMarlin(c);
  const WeightRef w = MarlinWeight(c, d);
  std::vector<float> dense(static_cast<size_t>(w.rows * w.cols));
  MaterializeWeight(w, dense.data());
  std::mt19937_64 rng(c.seed + 100);
  for (int64_t tokens : {1, 3, 8}) {
    const std::vector<float> x = RandomFloats(rng, static_cast<size_t>(tokens * c.k));
    for (int64_t e = 0; e < c.experts; ++e) {
      const WeightRef we = w.Expert(e, c.experts);
      std::vector<float> y(static_cast<size_t>(tokens * c.n), -1.0f);
      MatMul(x.data(), tokens, we, y.data());
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t n = 0; n < c.n; ++n) {
          const float want = Dot(x.data() + t * c.k, dense.data() + (e * c.n + n) * c.k, c.k);
          ASSERT_EQ(std::bit_cast<uint32_t>(y[static_cast<size_t>(t * c.n + n)]), std::bit_cast<uint32_t>(want))
              << "tokens " << tokens << " expert " << e << " token " << t << " row " << n;
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, MarlinDecodeTest,
    ::testing::Values(MarlinCase{"dense_g32", 1, 128, 256, 32, false, std::nullopt, 11},
                      MarlinCase{"dense_g128_f16", 1, 192, 256, 128, true, std::nullopt, 12},
                      MarlinCase{"odd_groups_g16_k48", 1, 64, 48, 16, false, std::nullopt, 13},
                      MarlinCase{"odd_groups_g32_k96_experts", 3, 128, 96, 32, false, std::nullopt, 14},
                      MarlinCase{"five_groups_g16_k80", 2, 64, 80, 16, true, std::nullopt, 15},
                      MarlinCase{"g8_below_tile", 1, 64, 32, 8, false, std::nullopt, 16},
                      MarlinCase{"channelwise", 2, 128, 128, -1, false, std::nullopt, 17},
                      MarlinCase{"g_equals_k", 1, 64, 64, 64, false, std::nullopt, 18},
                      // w13 with H == G: one scale row, but SGLang used the grouped permutation.
                      MarlinCase{"w13_quirk_grouped_one_row", 4, 256, 64, 64, false, true, 19},
                      // w13 with 4I' <= G < H: two rows, but SGLang used the channelwise permutation.
                      MarlinCase{"w13_quirk_channel_two_rows", 2, 64, 256, 128, false, false, 20}),
    [](const ::testing::TestParamInfo<MarlinCase>& i) { return i.param.name; });

TEST(FloatWeights, MatMulAndRowOpsEqualDotOverFloats) {
  std::mt19937_64 rng(31);
  for (int64_t cols : {1, 7, 8, 13, 64, 100}) {
    const int64_t rows = 5;
    const std::vector<float> f = RandomFloats(rng, static_cast<size_t>(rows * cols));
    std::vector<uint16_t> b(f.size());
    std::vector<float> fb(f.size());
    for (size_t i = 0; i < f.size(); ++i) {
      b[i] = F32ToBF16(f[i]);
      fb[i] = BF16ToF32(b[i]);
    }
    WeightRef wb{{rows, cols}, WeightForm::kBF16, rows, cols, b.data(), {}};
    WeightRef wf{{rows, cols}, WeightForm::kF32, rows, cols, fb.data(), {}};
    const std::vector<float> x = RandomFloats(rng, static_cast<size_t>(3 * cols));
    for (const WeightRef* w : {&wb, &wf}) {
      std::vector<float> y(static_cast<size_t>(3 * rows));
      MatMul(x.data(), 3, *w, y.data());
      std::vector<float> m(fb.size()), row(static_cast<size_t>(cols));
      MaterializeWeight(*w, m.data());
      ASSERT_EQ(0, std::memcmp(m.data(), fb.data(), fb.size() * sizeof(float)));
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t t = 0; t < 3; ++t)
          ASSERT_EQ(y[static_cast<size_t>(t * rows + i)], Dot(x.data() + t * cols, fb.data() + i * cols, cols))
              << cols << " " << i << " " << t;
        ASSERT_EQ(RowDot(*w, i, x.data()), Dot(fb.data() + i * cols, x.data(), cols));
        std::vector<float> acc(x.begin(), x.begin() + cols), want = acc;
        RowAxpy(*w, i, 0.37f, acc.data());
        Axpy(0.37f, fb.data() + i * cols, want.data(), cols);
        ASSERT_EQ(acc, want);
        RowToFloats(*w, i, row.data());
        ASSERT_EQ(0, std::memcmp(row.data(), fb.data() + i * cols, row.size() * sizeof(float)));
      }
    }
  }
}

TEST(Finiteness, FirstNonFiniteFindsTheFirstAtAnyAlignment) {
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    const size_t es = dt == DType::kF32 ? 4 : 2;
    std::vector<std::byte> raw(1 + 100 * es);
    std::byte* p = raw.data() + 1;  // misaligned on purpose
    auto put = [&](int64_t i, float v) {
      if (dt == DType::kF32) {
        std::memcpy(p + i * 4, &v, 4);
      } else {
        const uint16_t h = dt == DType::kBF16 ? F32ToBF16(v) : F32ToF16(v);
        std::memcpy(p + i * 2, &h, 2);
      }
    };
    for (int64_t i = 0; i < 100; ++i) put(i, 0.5f * static_cast<float>(i) - 20.0f);
    EXPECT_FALSE(FirstNonFinite(dt, p, 0, 100).has_value()) << SafetensorsName(dt);
    put(70, std::numeric_limits<float>::infinity());
    put(41, std::nanf(""));
    EXPECT_EQ(FirstNonFinite(dt, p, 0, 100), 41) << SafetensorsName(dt);
    EXPECT_EQ(FirstNonFinite(dt, p, 42, 100), 70);
    EXPECT_FALSE(FirstNonFinite(dt, p, 0, 41).has_value());
    EXPECT_TRUE(std::isnan(FloatAt(dt, p, 41)));
    EXPECT_EQ(FloatAt(dt, p, 3), -18.5f);
  }
}

TEST(Finiteness, MarlinScalesJudgedAtTheOverflowBoundary) {
  auto bf16 = [](uint16_t bits) {
    std::vector<std::byte> v(7);
    const uint16_t s[3] = {0x3f80, bits, 0xbc00};  // 1.0, the probe, -0.0078125
    std::memcpy(v.data() + 1, s, 6);               // misaligned
    return MarlinScalesCertainlyFinite(v.data() + 1, false, 3);
  };
  EXPECT_TRUE(bf16(0x7dff));                 // 8 |s| is the largest finite exponent: every value finite
  EXPECT_TRUE(bf16(0xfdff));                 // sign does not matter
  EXPECT_FALSE(bf16(0x7e00));                // 8 |s| overflows bf16: maybe not finite (u = 0 decides)
  EXPECT_FALSE(bf16(0x7f80));                // Inf
  EXPECT_FALSE(bf16(0x7fc1));                // NaN
  const uint16_t f16[2] = {0x7bff, 0x3c00};  // 65504, 1.0
  EXPECT_TRUE(MarlinScalesCertainlyFinite(reinterpret_cast<const std::byte*>(f16), true, 2));
  const uint16_t f16_inf[1] = {0x7c00};
  EXPECT_FALSE(MarlinScalesCertainlyFinite(reinterpret_cast<const std::byte*>(f16_inf), true, 1));
}

}  // namespace
}  // namespace wsync::ref_engine
