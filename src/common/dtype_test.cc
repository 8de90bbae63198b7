#include "common/dtype.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace wsync {
namespace {

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

// Reference fp32 -> bf16 round-to-nearest-even using double arithmetic, independent of the bit
// trick in dtype.h: pick the nearer of the two bf16 neighbours, the even one on a tie.
uint16_t RefF32ToBF16(float f) {
  if (std::isnan(f)) return 0;  // not used for NaN
  const uint32_t u = Bits(f);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  if ((u & 0xffff) == 0) return lo;
  const double x = f, a = BF16ToF32(lo);
  const double b = (hi & 0x7f80) == 0x7f80 && (hi & 0x7f) == 0 ? std::copysign(std::ldexp(1.0, 128), x)
                                                               : static_cast<double>(BF16ToF32(hi));
  const double da = std::fabs(x - a), db = std::fabs(b - x);
  if (da < db) return lo;
  if (db < da) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType t : kAllDTypes) {
    auto parsed = ParseSafetensorsDType(SafetensorsName(t));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, t);
    auto torch = ParseTorchDType(std::string("torch.") + std::string(TorchName(t)));
    ASSERT_TRUE(torch.ok());
    EXPECT_EQ(*torch, t);
  }
  EXPECT_EQ(ItemSize(DType::kBF16), 2u);
  EXPECT_EQ(ItemSize(DType::kI64), 8u);
  EXPECT_EQ(ItemSize(DType::kF8E4M3), 1u);
  for (const char* bad : {"F64", "BOOL", "F8_E5M2", "bf16", "", "U16"}) {
    auto r = ParseSafetensorsDType(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// All 65,536 bf16 patterns survive bf16 -> fp32 -> bf16 bit for bit; a signalling NaN comes back
// as the quiet NaN with the same sign and payload (quiet bit set), as on hardware.
TEST(DTypeTest, AllBF16PatternsRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = BF16ToF32(h);
    EXPECT_EQ(Bits(f), b << 16);
    const uint16_t back = F32ToBF16(f);
    const bool is_nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(BF16ToF32(back))) << std::hex << b;
      ASSERT_EQ(back, h | 0x0040) << std::hex << b;  // sign and payload kept, quiet bit set
    } else {
      ASSERT_EQ(back, h) << std::hex << b;
    }
  }
}

TEST(DTypeTest, BF16TiesRoundToEven) {
  // Exactly halfway between two bf16 values: low 16 bits == 0x8000.
  EXPECT_EQ(F32ToBF16(FromBits(0x3f808000)), 0x3f80);  // 1.0 + half ulp -> 1.0 (even)
  EXPECT_EQ(F32ToBF16(FromBits(0x3f818000)), 0x3f82);  // odd lower neighbour -> rounds up
  EXPECT_EQ(F32ToBF16(FromBits(0xbf818000)), 0xbf82);  // negative, same
  EXPECT_EQ(F32ToBF16(FromBits(0x3f808001)), 0x3f81);  // just above the tie -> up
  EXPECT_EQ(F32ToBF16(FromBits(0x3f807fff)), 0x3f80);  // just below -> down
  EXPECT_EQ(F32ToBF16(FromBits(0x7f7f8000)), 0x7f80);  // tie at the top -> +inf (even)
  EXPECT_EQ(F32ToBF16(FromBits(0x7f7f7fff)), 0x7f7f);  // largest below the tie stays finite
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(F32ToBF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToBF16(FromBits(0x00008000)), 0x0000);  // subnormal tie -> even (zero)
  EXPECT_EQ(F32ToBF16(FromBits(0x00018000)), 0x0002);
  // A NaN whose payload lives only in the low 16 bits must not become infinity.
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(FromBits(0x7f800001)))));
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(FromBits(0xff800001)))));
  EXPECT_EQ(F32ToBF16(FromBits(0xff800001)) & 0x8000, 0x8000);
}

TEST(DTypeTest, BF16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(20261121);  // seed recorded
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = FromBits(rng());
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToBF16(f), RefF32ToBF16(f)) << std::hex << Bits(f);
  }
}

TEST(DTypeTest, AllF16PatternsRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = F16ToF32(h);
    const bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(f));
      ASSERT_EQ(F32ToF16(f), h | 0x0200) << std::hex << b;
      continue;
    }
    // fp16 -> fp32 is exact: compare with an independent computation in double.
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double ref = e == 0 ? std::ldexp(m, -24) : e == 31 ? INFINITY : std::ldexp(1024 + m, e - 25);
    if (h & 0x8000) ref = -ref;
    ASSERT_EQ(static_cast<double>(f), ref) << std::hex << b;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0);
    ASSERT_EQ(F32ToF16(f), h) << std::hex << b;
  }
}

// Reference fp32 -> fp16 (RNE) by exhaustive neighbour search in double.
uint16_t RefF32ToF16(float f) {
  const double x = f;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double ax = std::fabs(x);
  if (ax >= 65520.0) return sign | 0x7c00;
  // Candidate magnitudes: find the largest pattern p with value(p) <= ax.
  uint16_t lo = 0;
  for (int step = 1 << 14; step > 0; step >>= 1)
    if (lo + step <= 0x7bff && static_cast<double>(F16ToF32(static_cast<uint16_t>(lo + step))) <= ax) lo += step;
  const double a = F16ToF32(lo);
  if (a == ax) return sign | lo;
  const uint16_t hi = lo + 1;
  const double b = hi == 0x7c00 ? 65536.0 : static_cast<double>(F16ToF32(hi));
  const double da = ax - a, db = b - ax;
  if (da < db) return sign | lo;
  if (db < da) return sign | hi;
  return sign | ((lo & 1) ? hi : lo);
}

TEST(DTypeTest, F16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(42);  // seed recorded
  std::uniform_real_distribution<float> exp_dist(-30.0f, 17.0f);
  for (int i = 0; i < 300'000; ++i) {
    // Values spread over the fp16 range, incl. subnormals and overflow, plus raw random bits.
    float f =
        (i % 2) ? std::ldexp(1.0f + static_cast<float>(rng() & 0xffffff) / 16777216.0f, static_cast<int>(exp_dist(rng)))
                : FromBits(rng());
    if (rng() & 1) f = -f;
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToF16(f), RefF32ToF16(f)) << std::hex << Bits(f) << " " << f;
  }
}

TEST(DTypeTest, F16EdgeCases) {
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65519.99f), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // tie between max and 2^16 -> even (inf)
  EXPECT_EQ(F32ToF16(1e10f), 0x7c00);
  EXPECT_EQ(F32ToF16(-1e10f), 0xfc00);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even (0)
  EXPECT_EQ(F32ToF16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);         // 1.5 units: tie -> 2 (even)
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -14)), 0x0400);         // smallest normal
  EXPECT_EQ(F32ToF16(std::ldexp(1023.5f, -24)), 0x0400);      // subnormal rounds up into normal
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
}

TEST(DTypeTest, BulkConversionsMatchScalar) {
  std::mt19937 rng(7);
  std::vector<float> f(1001);
  for (auto& x : f) x = std::ldexp(static_cast<float>(static_cast<int32_t>(rng())) / 2147483648.0f, rng() % 40 - 20);
  std::vector<uint16_t> h(f.size());
  std::vector<float> back(f.size());
  ConvertF32ToBF16(f.data(), h.data(), f.size());
  ConvertBF16ToF32(h.data(), back.data(), f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(h[i], F32ToBF16(f[i]));
    ASSERT_EQ(Bits(back[i]), Bits(BF16ToF32(h[i])));
  }
  ConvertF32ToF16(f.data(), h.data(), f.size());
  ConvertF16ToF32(h.data(), back.data(), f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(h[i], F32ToF16(f[i]));
    ASSERT_EQ(Bits(back[i]), Bits(F16ToF32(h[i])));
  }
  ConvertF32ToBF16(nullptr, nullptr, 0);  // n == 0 is fine
}

}  // namespace
}  // namespace wsync
