// Tests of kernels/int4.h (CPU path) against plain scalar references written directly from
// FORMATS.md in this file: §1 quantization, §2/§3 packing, §4.4 the vLLM Python Marlin reference
// (marlin_permute_weights + get_weight_perm, a different route than the kernel's closed form),
// §5 scale permutation lists. They use neither the optimized code nor kernels/format/.
#include "kernels/int4.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "hwy/targets.h"
#include "kernels/cpu/int4_cpu.h"
#include "kernels/dispatch.h"
#include "kernels/format/int4_format.h"

namespace wsync::kernels {
namespace {

using ::testing::HasSubstr;

// ---- references (FORMATS.md, literally) ----------------------------------------------------------

float ToF32(uint16_t bits, DType dt) { return dt == DType::kBF16 ? BF16ToF32(bits) : F16ToF32(bits); }
uint16_t FromF32(float f, DType dt) { return dt == DType::kBF16 ? F32ToBF16(f) : F32ToF16(f); }

struct RefQuant {
  std::vector<int> q;        // [E, N, K]
  std::vector<float> scale;  // [E, N, K/G], f32
};

// §1: amax, scale by the variant, q = clamp(roundHalfEven(x / scale), -7, 7).
RefQuant RefQuantize(const std::vector<uint16_t>& w, DType dt, int64_t rows, int64_t k, int64_t g,
                     QuantVariant variant) {
  RefQuant r;
  r.q.resize(static_cast<size_t>(rows * k));
  r.scale.resize(static_cast<size_t>(rows * (k / g)));
  const float sym_cons = 1.0f / 7.0f;  // fl32(1/7), computed, not copied from the spec's hex
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t gi = 0; gi < k / g; ++gi) {
      float amax = 0.0f;
      for (int64_t i = 0; i < g; ++i) amax = std::max(amax, std::fabs(ToF32(w[row * k + gi * g + i], dt)));
      float scale = variant == QuantVariant::kQat ? amax / 7.0f : amax * sym_cons;
      if (scale < 1e-5f) scale = 1e-5f;  // clamp(min=1e-5)
      r.scale[row * (k / g) + gi] = scale;
      for (int64_t i = 0; i < g; ++i) {
        const float x = ToF32(w[row * k + gi * g + i], dt);
        float v = std::nearbyint(x / scale);  // default rounding mode: half to even
        v = std::min(7.0f, std::max(-7.0f, v));
        r.q[row * k + gi * g + i] = static_cast<int>(v);
      }
    }
  }
  return r;
}

// §2: word j of a row = OR_i (q[8j+i] + 8) << 4i.
uint32_t PackEight(const int* q) {
  uint32_t word = 0;
  for (int i = 0; i < 8; ++i) word |= (static_cast<uint32_t>(q[i] + 8) & 0xFu) << (4 * i);
  return word;
}

// get_weight_perm(4) of V1, §4.4 item 2.
std::vector<int> RefWeightPerm() {
  std::vector<int> perm;
  for (int i = 0; i < 32; ++i) {
    std::vector<int> perm1;
    const int col = i / 4;
    for (int block = 0; block < 2; ++block) {
      for (int row : {2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1}) {
        perm1.push_back(16 * row + col + 8 * block);
      }
    }
    for (int j = 0; j < 4; ++j) {
      for (int p : perm1) perm.push_back(p + 256 * j);
    }
  }
  const int interleave[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  std::vector<int> out(perm.size());
  for (size_t b = 0; b < perm.size(); b += 8) {
    for (int i = 0; i < 8; ++i) out[b + i] = perm[b + interleave[i]];
  }
  return out;
}

// marlin_weights(q_w[K, N]) of §4.4: u[k][n] in 0..15 -> int32 [K/16, 2N].
std::vector<uint32_t> RefMarlin(const std::vector<int>& u, int64_t k, int64_t n) {
  // 1. [K/16, 16, N/16, 16] -> permute(0, 2, 1, 3) -> [K/16, 16N]
  std::vector<int> tmp(static_cast<size_t>(k * n));
  for (int64_t kt = 0; kt < k / 16; ++kt)
    for (int64_t nb = 0; nb < n / 16; ++nb)
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) tmp[kt * 16 * n + (nb * 16 + i) * 16 + j] = u[(16 * kt + i) * n + 16 * nb + j];
  // 2. reshape [-1, 1024] and index each chunk with the weight perm
  static const std::vector<int> perm = RefWeightPerm();
  std::vector<int> res(tmp.size());
  for (size_t c = 0; c < tmp.size(); c += 1024)
    for (int x = 0; x < 1024; ++x) res[c + x] = tmp[c + perm[x]];
  // 3. pack_cols along the last dim of [K/16, 16N]
  std::vector<uint32_t> out(static_cast<size_t>(k * n / 8), 0u);
  for (size_t i = 0; i < res.size(); ++i) out[i / 8] |= static_cast<uint32_t>(res[i]) << (4 * (i % 8));
  return out;
}

// u[k][n] of a GPTQ qweight[K/8, N].
std::vector<int> UnpackGptq(const uint32_t* qw, int64_t k, int64_t n) {
  std::vector<int> u(static_cast<size_t>(k * n));
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t c = 0; c < n; ++c) u[kk * n + c] = static_cast<int>((qw[(kk / 8) * n + c] >> (4 * (kk % 8))) & 0xF);
  return u;
}

// §5 lists.
std::vector<int> RefScalePerm(bool single) {
  std::vector<int> p;
  if (!single) {
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j) p.push_back(i + 8 * j);
  } else {
    for (int i = 0; i < 4; ++i)
      for (int j : {0, 1, 8, 9, 16, 17, 24, 25}) p.push_back(2 * i + j);
  }
  return p;
}

// ---- helpers -------------------------------------------------------------------------------------

template <typename T>
TensorView View(DType dt, Shape shape, const std::vector<T>& v) {
  return TensorView(dt, std::move(shape),
                    std::span<const std::byte>(reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(T)));
}

Tensor MustEmpty(DType dt, Shape shape) {
  auto t = Tensor::Empty(dt, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(t).value();
}

// bf16/fp16 bits of randn * sigma.
std::vector<uint16_t> RandomWeights(int64_t count, DType dt, uint32_t seed, float sigma = 0.02f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<uint16_t> w(static_cast<size_t>(count));
  for (auto& x : w) x = FromF32(dist(rng), dt);
  return w;
}

std::vector<uint32_t> RandomWords(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> w(static_cast<size_t>(count));
  for (auto& x : w) x = rng();
  return w;
}

std::vector<int32_t> RandomPerm(int64_t experts, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(experts * k));
  for (int64_t e = 0; e < experts; ++e) {
    std::iota(p.begin() + e * k, p.begin() + (e + 1) * k, 0);
    std::shuffle(p.begin() + e * k, p.begin() + (e + 1) * k, rng);
  }
  return p;
}

struct QuantCase {
  DType dtype;
  QuantVariant variant;
  int group;  // 32, 64, 128, -1
  PackFormat format;
};

int64_t CountReferenceMismatches(const std::vector<uint16_t>& w, int64_t e, int64_t n, int64_t k, const QuantCase& c,
                                 const Tensor& packed, const Tensor& scales, bool report = true);

// Quantizes with the kernel and checks every word and scale against the reference.

void CheckQuantize(const std::vector<uint16_t>& w, int64_t e, int64_t n, int64_t k, const QuantCase& c,
                   int threads = 2) {
  SCOPED_TRACE(testing::Message() << "E=" << e << " N=" << n << " K=" << k << " dtype=" << SafetensorsName(c.dtype)
                                  << " variant=" << static_cast<int>(c.variant) << " G=" << c.group
                                  << " format=" << static_cast<int>(c.format) << " threads=" << threads);
  const Shape wshape = e > 1 ? Shape{e, n, k} : Shape{n, k};
  const TensorView wv = View(c.dtype, wshape, w);
  auto shapes = QuantizedShapesFor(wv, c.group, c.format);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  Tensor packed = MustEmpty(DType::kI32, shapes->packed);
  Tensor scales = MustEmpty(c.dtype, shapes->scales);
  QuantizeOptions opt;
  opt.group_size = c.group;
  opt.variant = c.variant;
  opt.format = c.format;
  opt.num_threads = threads;
  ASSERT_TRUE(QuantizeInt4(wv, packed.mutable_view(), scales.mutable_view(), opt).ok());
  EXPECT_EQ(CountReferenceMismatches(w, e, n, k, c, packed, scales), 0);
}

// The words and scales of `packed` / `scales` that differ from the scalar reference's (with
// `report`, the first 5 are test failures).
int64_t CountReferenceMismatches(const std::vector<uint16_t>& w, int64_t e, int64_t n, int64_t k, const QuantCase& c,
                                 const Tensor& packed, const Tensor& scales, bool report) {
  const int64_t g = c.group == -1 ? k : c.group, ng = k / g, kw = k / 8;
  const RefQuant ref = RefQuantize(w, c.dtype, e * n, k, g, c.variant);
  const auto* pw = packed.view().data_as<uint32_t>();
  const auto* ps = scales.view().data_as<uint16_t>();
  int64_t bad = 0;
  for (int64_t ex = 0; ex < e; ++ex) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = ex * n + r;
      for (int64_t j = 0; j < kw; ++j) {
        const uint32_t want = PackEight(&ref.q[row * k + 8 * j]);
        const uint32_t got = c.format == PackFormat::kGptq ? pw[(ex * kw + j) * n + r] : pw[row * kw + j];
        if (got != want && bad++ < 5 && report)
          ADD_FAILURE() << "word e=" << ex << " n=" << r << " j=" << j << std::hex << " got 0x" << got << " want 0x"
                        << want;
      }
      for (int64_t gi = 0; gi < ng; ++gi) {
        const uint16_t want = FromF32(ref.scale[row * ng + gi], c.dtype);
        const uint16_t got = c.format == PackFormat::kGptq ? ps[(ex * ng + gi) * n + r] : ps[row * ng + gi];
        if (got != want && bad++ < 5 && report)
          ADD_FAILURE() << "scale e=" << ex << " n=" << r << " g=" << gi << std::hex << " got 0x" << got << " want 0x"
                        << want;
      }
    }
  }
  return bad;
}

std::vector<QuantCase> AllQuantCases() {
  std::vector<QuantCase> cases;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (QuantVariant v : {QuantVariant::kQat, QuantVariant::kSlime})
      for (int g : {32, 64, 128, -1})
        for (PackFormat f : {PackFormat::kCompressedTensors, PackFormat::kGptq}) cases.push_back({dt, v, g, f});
  return cases;
}

// ---- worked examples of FORMATS.md ---------------------------------------------------------------

TEST(Int4FormatTest, WorkedPackingExample) {
  const int q[8] = {-8, -7, -1, 0, 1, 2, 6, 7};
  EXPECT_EQ(PackEight(q), 0xFEA98710u);  // reference itself, §2 example
  // Through the quantizer: a row whose q is [-7,-7,-1,0,1,2,6,7] (scale 1: amax 7).
  std::vector<uint16_t> w(32, F32ToBF16(0.0f));
  const float vals[8] = {-7, -7, -1, 0, 1, 2, 6, 7};
  for (int i = 0; i < 8; ++i) w[i] = F32ToBF16(vals[i]);
  std::vector<uint32_t> packed(4);
  std::vector<uint16_t> scales(1);
  QuantizeOptions opt;
  opt.group_size = 32;
  ASSERT_TRUE(QuantizeInt4(View(DType::kBF16, {1, 32}, w),
                           MutableTensorView(DType::kI32, {1, 4}, std::as_writable_bytes(std::span(packed))),
                           MutableTensorView(DType::kBF16, {1, 1}, std::as_writable_bytes(std::span(scales))), opt)
                  .ok());
  EXPECT_EQ(packed[0], 0xFEA98711u);  // the example with -8 -> -7 in slot 0
  EXPECT_EQ(packed[1], 0x88888888u);
  EXPECT_EQ(scales[0], F32ToBF16(1.0f));
}

TEST(Int4FormatTest, MarlinWordZeroOfTileZero) {
  const int64_t k = 16, n = 64;
  const auto gptq = RandomWords(k / 8 * n, 7);
  std::vector<uint32_t> marlin(static_cast<size_t>(k / 16 * 2 * n));
  ASSERT_TRUE(GptqToMarlin(View(DType::kI32, {k / 8, n}, gptq), nullptr,
                           MutableTensorView(DType::kI32, {k / 16, 2 * n}, std::as_writable_bytes(std::span(marlin))),
                           {})
                  .ok());
  const auto u = UnpackGptq(gptq.data(), k, n);
  // §4.2: from bit 0 up, u[0,0], u[8,0], u[0,8], u[8,8], u[1,0], u[9,0], u[1,8], u[9,8].
  const int want[8][2] = {{0, 0}, {8, 0}, {0, 8}, {8, 8}, {1, 0}, {9, 0}, {1, 8}, {9, 8}};
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ((marlin[0] >> (4 * s)) & 0xF, static_cast<uint32_t>(u[want[s][0] * n + want[s][1]])) << "slot " << s;
  }
}

// The per-word helpers the CUDA kernels use (the CPU path uses the byte-plane form): MarlinWord
// with WordRow/WordCol/TileOffset must rebuild RefMarlin, LocateInTile must invert it, and the
// scale-permutation helpers must equal the §5 lists.
TEST(Int4FormatTest, PerWordHelpersMatchTheReference) {
  const int64_t k = 64, n = 192;
  const auto gptq = RandomWords(k / 8 * n, 77);
  const auto u = UnpackGptq(gptq.data(), k, n);
  const auto want = RefMarlin(u, k, n);
  std::vector<uint32_t> got(want.size());
  for (int64_t kt = 0; kt < k / 16; ++kt) {
    const uint32_t* a = gptq.data() + 2 * kt * n;
    const uint32_t* b = a + n;
    for (int64_t nt = 0; nt < n / 64; ++nt) {
      for (int w = 0; w < format::kTileWords; ++w) {
        const int64_t c = 64 * nt + format::WordCol(w);
        got[format::TileOffset(kt, nt, n) + w] =
            format::MarlinWord(a[c], b[c], a[c + 8], b[c + 8], format::WordRow(w) / 2);
      }
    }
  }
  EXPECT_EQ(got, want);
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t c = 0; c < n; ++c) {
      const format::TileSlot s = format::LocateInTile(static_cast<int>(kk % 16), static_cast<int>(c % 64));
      const uint32_t word = want[format::TileOffset(kk / 16, c / 64, n) + s.word];
      ASSERT_EQ(static_cast<int>(format::GetNibble(word, s.slot)), u[kk * n + c]) << "k=" << kk << " n=" << c;
    }
  }
  const auto grouped = RefScalePerm(false), single = RefScalePerm(true);
  for (int p = 0; p < 64; ++p) EXPECT_EQ(format::ScalePermGrouped(p), grouped[p]);
  for (int p = 0; p < 32; ++p) EXPECT_EQ(format::ScalePermChannel(p), single[p]);
  const int dk[8] = {0, 8, 0, 8, 1, 9, 1, 9}, dn[8] = {0, 0, 8, 8, 0, 0, 8, 8};  // as printed in §4.2
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ(format::SlotDk(s), dk[s]);
    EXPECT_EQ(format::SlotDn(s), dn[s]);
  }
}

// ---- quantization --------------------------------------------------------------------------------

TEST(Int4QuantizeTest, AllVariantsDtypesGroupsFormatsSmall) {
  uint32_t seed = 1000;
  for (const QuantCase& c : AllQuantCases()) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{64, 128}, {48, 512}, {5, 384}}) {
      if (c.group > 0 && k % c.group != 0) continue;
      ++seed;
      CheckQuantize(RandomWeights(n * k, c.dtype, seed), 1, n, k, c, 1 + static_cast<int>(seed % 3));
    }
  }
}

TEST(Int4QuantizeTest, StackedExperts) {
  uint32_t seed = 2000;
  for (const QuantCase& c : AllQuantCases()) {
    for (int64_t e : {2, 8}) CheckQuantize(RandomWeights(e * 32 * 256, c.dtype, ++seed), e, 32, 256, c, 3);
  }
}

TEST(Int4QuantizeTest, LargeShape) {
  const int64_t n = 5632, k = 4096;
  const auto w = RandomWeights(n * k, DType::kBF16, 31337);
  CheckQuantize(w, 1, n, k, {DType::kBF16, QuantVariant::kQat, 128, PackFormat::kCompressedTensors}, 0);
  CheckQuantize(w, 1, n, k, {DType::kBF16, QuantVariant::kSlime, 32, PackFormat::kGptq}, 0);
}

// ---- quantization with reuse (delta sync) ---------------------------------------------------------

// The groups of `a` and `b` ([rows, k] bits) whose bits are all equal, counted by comparing them.
int64_t EqualGroups(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t g) {
  int64_t same = 0;
  for (size_t at = 0; at < a.size(); at += static_cast<size_t>(g))
    same += std::equal(a.begin() + static_cast<ptrdiff_t>(at), a.begin() + static_cast<ptrdiff_t>(at) + g,
                       b.begin() + static_cast<ptrdiff_t>(at));
  return same;
}

// `w` with the lowest bit of about `fraction` of its elements flipped (seeded), and group 1 of
// row 0 zeroed (an all-zero group: the scale floor).
std::vector<uint16_t> Perturbed(std::vector<uint16_t> w, double fraction, uint32_t seed, int64_t g) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution flip(fraction);
  for (auto& x : w)
    if (flip(rng)) x ^= 1u;
  std::fill(w.begin() + g, w.begin() + 2 * g, uint16_t{0});
  return w;
}

TEST(Int4QuantizeReuseTest, ReusedGroupsGiveTheReferencesBytes) {
  uint32_t seed = 4000;
  for (const QuantCase& c : AllQuantCases()) {
    if (c.format != PackFormat::kCompressedTensors) continue;
    for (int64_t e : {1, 3}) {
      const int64_t n = 24, k = 256, g = c.group == -1 ? k : c.group;
      SCOPED_TRACE(testing::Message() << "E=" << e << " G=" << c.group << " dtype=" << SafetensorsName(c.dtype)
                                      << " variant=" << static_cast<int>(c.variant) << " seed=" << seed);
      const Shape shape = e > 1 ? Shape{e, n, k} : Shape{n, k};
      const auto w0 = RandomWeights(e * n * k, c.dtype, ++seed);
      const auto w1 = Perturbed(w0, 0.004, ++seed, g);
      auto shapes = QuantizedShapesFor(View(c.dtype, shape, w0), c.group, c.format);
      ASSERT_TRUE(shapes.ok()) << shapes.status();
      const auto groups = static_cast<size_t>(e * n * (k / g));
      QuantizeOptions opt;
      opt.group_size = c.group;
      opt.variant = c.variant;
      opt.num_threads = 2;
      // The first call has nothing to reuse; the second reuses the first's unchanged groups.
      Tensor p0 = MustEmpty(DType::kI32, shapes->packed), s0 = MustEmpty(c.dtype, shapes->scales);
      std::vector<uint64_t> d0(groups), d1(groups);
      QuantizeReuse first{{}, {}, {}, std::span(d0)};
      ASSERT_TRUE(QuantizeInt4(View(c.dtype, shape, w0), p0.mutable_view(), s0.mutable_view(), opt, first).ok());
      EXPECT_EQ(first.reused_groups, 0);
      EXPECT_EQ(CountReferenceMismatches(w0, e, n, k, c, p0, s0), 0);
      Tensor p1 = MustEmpty(DType::kI32, shapes->packed), s1 = MustEmpty(c.dtype, shapes->scales);
      QuantizeReuse second{d0, p0.view(), s0.view(), std::span(d1)};
      ASSERT_TRUE(QuantizeInt4(View(c.dtype, shape, w1), p1.mutable_view(), s1.mutable_view(), opt, second).ok());
      const int64_t same = EqualGroups(w0, w1, g);
      EXPECT_EQ(second.reused_groups, same);
      if (g < k) {
        EXPECT_GT(same, 0);
      }
      EXPECT_EQ(CountReferenceMismatches(w1, e, n, k, c, p1, s1), 0);
      // The digests are a function of the group's bits: a call on w1 from nothing gives the same.
      std::vector<uint64_t> fresh(groups);
      QuantizeReuse again{{}, {}, {}, std::span(fresh)};
      ASSERT_TRUE(QuantizeInt4(View(c.dtype, shape, w1), p1.mutable_view(), s1.mutable_view(), opt, again).ok());
      EXPECT_EQ(fresh, d1);
    }
  }
}

// The premise: unchanged groups are copied from the earlier outputs, not computed. Earlier outputs
// that are not that input's quantization (here: flipped bits) give wrong bytes in those groups only.
TEST(Int4QuantizeReuseTest, EarlierOutputsThatAreNotTheInputsShowInTheReusedGroups) {
  const QuantCase c{DType::kBF16, QuantVariant::kQat, 64, PackFormat::kCompressedTensors};
  const int64_t n = 16, k = 512;
  const Shape shape{n, k};
  const auto w0 = RandomWeights(n * k, c.dtype, 4100);
  const auto w1 = Perturbed(w0, 0.01, 4101, 64);
  auto shapes = QuantizedShapesFor(View(c.dtype, shape, w0), c.group, c.format);
  ASSERT_TRUE(shapes.ok());
  QuantizeOptions opt;
  opt.group_size = c.group;
  Tensor p0 = MustEmpty(DType::kI32, shapes->packed), s0 = MustEmpty(c.dtype, shapes->scales);
  std::vector<uint64_t> d0(static_cast<size_t>(n * k / 64)), d1(d0.size());
  QuantizeReuse first{{}, {}, {}, std::span(d0)};
  ASSERT_TRUE(QuantizeInt4(View(c.dtype, shape, w0), p0.mutable_view(), s0.mutable_view(), opt, first).ok());
  for (size_t i = 0; i < p0.view().nbytes() / 4; ++i) p0.mutable_view().data_as<uint32_t>()[i] ^= 0x10u;
  Tensor p1 = MustEmpty(DType::kI32, shapes->packed), s1 = MustEmpty(c.dtype, shapes->scales);
  QuantizeReuse second{d0, p0.view(), s0.view(), std::span(d1)};
  ASSERT_TRUE(QuantizeInt4(View(c.dtype, shape, w1), p1.mutable_view(), s1.mutable_view(), opt, second).ok());
  const int64_t same = EqualGroups(w0, w1, 64);
  ASSERT_GT(same, 0);
  EXPECT_EQ(second.reused_groups, same);
  EXPECT_EQ(CountReferenceMismatches(w1, 1, n, k, c, p1, s1, /*report=*/false), same * (64 / 8));
}

TEST(Int4QuantizeReuseTest, BadArgumentsAreRefused) {
  const auto w = RandomWeights(8 * 128, DType::kBF16, 4200);
  const TensorView wv = View(DType::kBF16, {8, 128}, w);
  Tensor p = MustEmpty(DType::kI32, {8, 16}), s = MustEmpty(DType::kBF16, {8, 1});
  Tensor p_other = MustEmpty(DType::kI32, {8, 8});
  std::vector<uint64_t> d(8), wrong(7);
  QuantizeOptions opt;  // G 128
  auto refused = [&](QuantizeReuse r, QuantizeOptions o, const char* what) {
    const absl::Status st = QuantizeInt4(wv, p.mutable_view(), s.mutable_view(), o, r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(), HasSubstr(what));
  };
  refused({{}, {}, {}, std::span(wrong)}, opt, "next_digests holds 7 entries, want one per group (8)");
  refused({wrong, p.view(), s.view(), std::span(d)}, opt, "digests holds 7 entries, want 8");
  refused({d, p_other.view(), s.view(), std::span(d)}, opt, "want the outputs' dtypes and shapes");
  refused({d, p.view(), s.view(), std::span(d).subspan(0, 8)}, opt, "must not overlap");
  QuantizeOptions gptq = opt;
  gptq.format = PackFormat::kGptq;
  Tensor pg = MustEmpty(DType::kI32, {16, 8});
  QuantizeReuse r{{}, {}, {}, std::span(d)};
  const absl::Status st = QuantizeInt4(wv, pg.mutable_view(), s.mutable_view(), gptq, r);
  EXPECT_THAT(st.message(), HasSubstr("compressed-tensors format only"));
}

// Groups built so that 7 * W / amax is an exact half-integer: round half to even decides.
TEST(Int4QuantizeTest, ExactTiesRoundHalfToEven) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> w(64);
    const float vals[16] = {7,     0.5f,  1.5f,  2.5f,  3.5f,  4.5f,  5.5f,  6.5f,
                            -0.5f, -1.5f, -2.5f, -3.5f, -4.5f, -5.5f, -6.5f, 0};
    const int want[16] = {7, 0, 2, 2, 4, 4, 6, 6, 0, -2, -2, -4, -4, -6, -6, 0};
    for (int i = 0; i < 64; ++i) w[i] = FromF32(vals[i % 16] * 0.25f, dt);  // amax 1.75, scale 0.25 exactly
    for (QuantVariant v : {QuantVariant::kQat, QuantVariant::kSlime}) {
      std::vector<uint32_t> packed(8);
      std::vector<uint16_t> scales(2);
      QuantizeOptions opt;
      opt.group_size = 32;
      opt.variant = v;
      ASSERT_TRUE(QuantizeInt4(View(dt, {1, 64}, w),
                               MutableTensorView(DType::kI32, {1, 8}, std::as_writable_bytes(std::span(packed))),
                               MutableTensorView(dt, {1, 2}, std::as_writable_bytes(std::span(scales))), opt)
                      .ok());
      for (int i = 0; i < 64; ++i) {
        EXPECT_EQ(static_cast<int>((packed[i / 8] >> (4 * (i % 8))) & 0xF) - 8, want[i % 16]) << "element " << i;
      }
      EXPECT_EQ(scales[0], FromF32(0.25f, dt));
    }
  }
  // And random bf16 data rich in ties (values with few mantissa bits), against the reference.
  std::mt19937 rng(99);
  std::vector<uint16_t> w(64 * 256);
  for (auto& x : w) x = F32ToBF16(static_cast<float>(static_cast<int>(rng() % 29) - 14) * 0.0625f);
  for (const QuantCase& c : AllQuantCases()) {
    if (c.dtype == DType::kBF16) CheckQuantize(w, 1, 64, 256, c);
  }
}

TEST(Int4QuantizeTest, AllZeroGroupGetsScaleFloor) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (QuantVariant v : {QuantVariant::kQat, QuantVariant::kSlime}) {
      std::vector<uint16_t> w(128, FromF32(0.0f, dt));
      w[64] = FromF32(-0.0f, dt);  // -0 is zero too
      std::vector<uint32_t> packed(16);
      std::vector<uint16_t> scales(1);
      QuantizeOptions opt;
      opt.group_size = kChannelwise;
      opt.variant = v;
      ASSERT_TRUE(QuantizeInt4(View(dt, {1, 128}, w),
                               MutableTensorView(DType::kI32, {1, 16}, std::as_writable_bytes(std::span(packed))),
                               MutableTensorView(dt, {1, 1}, std::as_writable_bytes(std::span(scales))), opt)
                      .ok());
      EXPECT_EQ(scales[0], FromF32(1e-5f, dt));  // §1.1 clamp(min=1e-5), stored in the weight dtype
      for (uint32_t word : packed) EXPECT_EQ(word, 0x88888888u);
    }
  }
}

TEST(Int4QuantizeTest, TinyHugeAndSubnormalValues) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const uint16_t max_bits = dt == DType::kBF16 ? 0x7F7F : 0x7BFF;  // bf16 max 3.39e38, fp16 max 65504
    std::vector<uint16_t> w(4 * 128);
    std::mt19937 rng(5);
    for (int i = 0; i < 128; ++i)
      w[i] = static_cast<uint16_t>((rng() % 0x7F + 1) | (i % 2 ? 0x8000 : 0));          // subnormals
    const uint32_t finite_span = dt == DType::kBF16 ? 0x7F80 : 0x7C00;                  // patterns below Inf
    for (int i = 128; i < 256; ++i) w[i] = static_cast<uint16_t>(rng() % finite_span);  // wide range, then maxima
    w[130] = max_bits;
    w[131] = static_cast<uint16_t>(max_bits | 0x8000);
    for (int i = 256; i < 384; ++i) w[i] = FromF32(1e-6f * static_cast<float>(i - 320), dt);  // below the floor
    for (int i = 384; i < 512; ++i) w[i] = static_cast<uint16_t>(max_bits - (rng() % 64)) | (i % 3 ? 0 : 0x8000);
    for (const QuantCase& c : AllQuantCases()) {
      if (c.dtype == dt) CheckQuantize(w, 1, 4, 128, c, 1);
    }
  }
}

TEST(Int4QuantizeTest, NonFiniteWeightsAreRejected) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const uint16_t inf = dt == DType::kBF16 ? 0x7F80 : 0x7C00, nan = dt == DType::kBF16 ? 0x7FC0 : 0x7E00;
    for (uint16_t bad : {inf, static_cast<uint16_t>(inf | 0x8000), nan}) {
      for (int g : {32, -1}) {
        std::vector<uint16_t> w = RandomWeights(4 * 128, dt, 8);
        w[2 * 128 + 40] = bad;  // row 2, column 40: group 1 with G = 32
        w[3 * 128 + 100] = bad;
        std::vector<uint32_t> packed(4 * 16);
        std::vector<uint16_t> scales(4 * 4);
        QuantizeOptions opt;
        opt.group_size = g;
        opt.num_threads = 2;
        const int64_t ng = g == -1 ? 1 : 4;
        const absl::Status st = QuantizeInt4(
            View(dt, {4, 128}, w), MutableTensorView(DType::kI32, {4, 16}, std::as_writable_bytes(std::span(packed))),
            MutableTensorView(dt, {4, ng}, std::as_writable_bytes(std::span(scales)).first(8 * ng)), opt);
        EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(st.message(), HasSubstr(g == -1 ? "expert 0, row 2, group 0 (columns 0..127)"
                                                    : "expert 0, row 2, group 1 (columns 32..63)"));
      }
    }
  }
}

TEST(Int4FormatTest, SlimeConstantIsRoundedReciprocalOfSeven) {
  EXPECT_EQ(std::bit_cast<uint32_t>(format::kSymCons), 0x3E124925u);  // §1.2
  EXPECT_EQ(format::kSymCons, 1.0f / 7.0f);
}

TEST(Int4QuantizeTest, GptqOrientationIsTheTransposeOfCompressedTensors) {
  const int64_t n = 192, k = 256;
  const auto w = RandomWeights(n * k, DType::kF16, 77);
  std::vector<uint32_t> ct(n * k / 8), gq(n * k / 8);
  std::vector<uint16_t> cts(n * k / 64), gqs(n * k / 64);
  QuantizeOptions opt;
  opt.group_size = 64;
  ASSERT_TRUE(QuantizeInt4(View(DType::kF16, {n, k}, w),
                           MutableTensorView(DType::kI32, {n, k / 8}, std::as_writable_bytes(std::span(ct))),
                           MutableTensorView(DType::kF16, {n, k / 64}, std::as_writable_bytes(std::span(cts))), opt)
                  .ok());
  opt.format = PackFormat::kGptq;
  ASSERT_TRUE(QuantizeInt4(View(DType::kF16, {n, k}, w),
                           MutableTensorView(DType::kI32, {k / 8, n}, std::as_writable_bytes(std::span(gq))),
                           MutableTensorView(DType::kF16, {k / 64, n}, std::as_writable_bytes(std::span(gqs))), opt)
                  .ok());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k / 8; ++j) ASSERT_EQ(gq[j * n + r], ct[r * (k / 8) + j]);
    for (int64_t g = 0; g < k / 64; ++g) ASSERT_EQ(gqs[g * n + r], cts[r * (k / 64) + g]);
  }
}

// ---- repack --------------------------------------------------------------------------------------

void CheckRepack(int64_t e, int64_t k, int64_t n, bool with_perm, uint32_t seed, int threads) {
  SCOPED_TRACE(testing::Message() << "E=" << e << " K=" << k << " N=" << n << " perm=" << with_perm << " seed=" << seed
                                  << " threads=" << threads);
  const auto gptq = RandomWords(e * k / 8 * n, seed);
  const auto perm = RandomPerm(e, k, seed + 1);
  const Shape gshape = e > 1 ? Shape{e, k / 8, n} : Shape{k / 8, n};
  const Shape mshape = e > 1 ? Shape{e, k / 16, 2 * n} : Shape{k / 16, 2 * n};
  const Shape pshape = e > 1 ? Shape{e, k} : Shape{k};
  const TensorView pv = View(DType::kI32, pshape, perm);
  const TensorView* pp = with_perm ? &pv : nullptr;
  KernelOptions opt;
  opt.num_threads = threads;
  Tensor marlin = MustEmpty(DType::kI32, mshape);
  ASSERT_TRUE(GptqToMarlin(View(DType::kI32, gshape, gptq), pp, marlin.mutable_view(), opt).ok());
  for (int64_t ex = 0; ex < e; ++ex) {
    auto u = UnpackGptq(gptq.data() + ex * (k / 8) * n, k, n);
    if (with_perm) {  // §4.3: marlin_repack(qweight, perm) = marlin_repack(pack_gptq(q[:, perm]))
      std::vector<int> up(u.size());
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t c = 0; c < n; ++c) up[kk * n + c] = u[perm[ex * k + kk] * n + c];
      u = std::move(up);
    }
    const auto want = RefMarlin(u, k, n);
    const uint32_t* got = marlin.data_as<uint32_t>() + ex * (k / 16) * 2 * n;
    ASSERT_EQ(0, std::memcmp(got, want.data(), want.size() * 4)) << "expert " << ex;
  }
  Tensor back = MustEmpty(DType::kI32, gshape);
  ASSERT_TRUE(MarlinToGptq(marlin.view(), pp, back.mutable_view(), opt).ok());
  ASSERT_EQ(0, std::memcmp(back.data_as<uint32_t>(), gptq.data(), gptq.size() * 4)) << "restore(repack(x)) != x";
}

TEST(Int4RepackTest, MatchesPythonReferenceAndRoundTrips) {
  uint32_t seed = 1;
  for (bool perm : {false, true}) {
    for (auto [k, n] : {std::pair<int64_t, int64_t>{128, 64}, {16, 64}, {256, 192}, {1024, 256}, {640, 448}}) {
      ++seed;
      CheckRepack(1, k, n, perm, seed, 1 + static_cast<int>(seed % 3));
    }
  }
}

TEST(Int4RepackTest, StackedExperts) {
  for (bool perm : {false, true}) {
    CheckRepack(2, 128, 128, perm, 11, 2);
    CheckRepack(8, 256, 64, perm, 12, 3);
  }
}

TEST(Int4RepackTest, LargeShape) {
  CheckRepack(1, 4096, 5632, false, 21, 0);
  CheckRepack(1, 4096, 5632, true, 22, 0);
}

// ---- scale permutation ---------------------------------------------------------------------------

void CheckScalePerm(int64_t e, int64_t k, int group, int64_t n, DType dt, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "E=" << e << " K=" << k << " G=" << group << " N=" << n);
  const int64_t rows = group == -1 ? 1 : k / group;
  std::mt19937 rng(seed);
  std::vector<uint16_t> s(static_cast<size_t>(e * rows * n));
  for (auto& x : s) x = static_cast<uint16_t>(rng());
  const Shape shape = e > 1 ? Shape{e, rows, n} : Shape{rows, n};
  Tensor out = MustEmpty(dt, shape);
  ASSERT_TRUE(PermuteMarlinScales(View(dt, shape, s), k, group, out.mutable_view(), {}).ok());
  const bool single = !(group != -1 && group < k);  // §5 condition, literally
  const auto perm = RefScalePerm(single);
  const int64_t width = static_cast<int64_t>(perm.size());
  const auto* got = out.data_as<uint16_t>();
  for (int64_t i = 0; i < static_cast<int64_t>(s.size()); i += width)
    for (int64_t p = 0; p < width; ++p) ASSERT_EQ(got[i + p], s[i + perm[p]]) << "at " << i + p;
  Tensor back = MustEmpty(dt, shape);
  ASSERT_TRUE(UnpermuteMarlinScales(out.view(), k, group, back.mutable_view(), {}).ok());
  ASSERT_EQ(0, std::memcmp(back.data_as<uint16_t>(), s.data(), s.size() * 2));
}

TEST(Int4ScalePermTest, GroupedChannelwiseAndInverse) {
  uint32_t seed = 3;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int g : {32, 64, 128, -1}) {
      CheckScalePerm(1, 512, g, 192, dt, seed++);
      CheckScalePerm(4, 256, g, 128, dt, seed++);
    }
    CheckScalePerm(1, 128, 128, 64, dt, seed++);  // G == K: the single perm (§5)
  }
}

// ---- every SIMD target Highway compiled ---------------------------------------------------------

// The runtime dispatch picks one target per machine; force each compiled one (AVX3, AVX2, SSE4,
// SSSE3, scalar) so that all of them are held to the same bits (fp16 promotion, Round emulation,
// tails).
TEST(Int4TargetsTest, EveryCompiledSimdTargetIsBitExact) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (int64_t t : targets) {
    hwy::SetSupportedTargetsForTest(t);
    SCOPED_TRACE(hwy::TargetName(t));
    EXPECT_STREQ(cpu::SimdTargetName(), hwy::TargetName(t));
    uint32_t seed = 500;
    for (const QuantCase& c : AllQuantCases()) {
      ++seed;
      CheckQuantize(RandomWeights(40 * 136, c.dtype, seed, 0.5f), 1, 40, 136, {c.dtype, c.variant, -1, c.format}, 2);
      if (c.group > 0) CheckQuantize(RandomWeights(2 * 17 * 256, c.dtype, seed), 2, 17, 256, c, 2);
    }
    CheckRepack(1, 256, 192, false, 41, 2);
    CheckRepack(2, 128, 128, true, 42, 2);
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the real CPU
  std::string names;
  for (int64_t t : targets) names += std::string(" ") + hwy::TargetName(t);
  std::printf("SIMD targets checked:%s\n", names.c_str());
}

// ---- validation ----------------------------------------------------------------------------------

TEST(Int4ValidationTest, QuantizeErrorsNameTheValues) {
  std::vector<uint16_t> w(64 * 96);
  std::vector<uint32_t> p(64 * 96);
  std::vector<uint16_t> s(64 * 96);
  auto out = [&](Shape shape) {
    return MutableTensorView(DType::kI32, shape,
                             std::as_writable_bytes(std::span(p)).first(NumBytes(DType::kI32, shape).value()));
  };
  auto sc = [&](DType dt, Shape shape) {
    return MutableTensorView(dt, shape, std::as_writable_bytes(std::span(s)).first(NumBytes(dt, shape).value()));
  };
  QuantizeOptions opt;
  opt.group_size = 64;
  absl::Status st = QuantizeInt4(View(DType::kBF16, {64, 96}, w), out({64, 12}), sc(DType::kBF16, {64, 1}), opt);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("K = 96 is not a multiple of the group size 64"));
  opt.group_size = 48;
  st = QuantizeInt4(View(DType::kBF16, {64, 96}, w), out({64, 12}), sc(DType::kBF16, {64, 2}), opt);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("group size 48 unsupported"));
  opt.group_size = 32;
  st = QuantizeInt4(View(DType::kF32, {64, 48}, w), out({64, 6}), sc(DType::kF32, {64, 1}), opt);
  EXPECT_THAT(st.message(), HasSubstr("W dtype F32 unsupported"));
  st = QuantizeInt4(View(DType::kBF16, {64, 12}, w), out({64, 1}), sc(DType::kBF16, {64, 1}), opt);
  EXPECT_THAT(st.message(), HasSubstr("K = 12 is not a multiple of 8"));
  st = QuantizeInt4(View(DType::kBF16, {64, 96}, w), out({64, 11}), sc(DType::kBF16, {64, 3}), opt);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("packed is I32[64, 11], want I32[64, 12]"));
  st = QuantizeInt4(View(DType::kBF16, {64, 96}, w), out({64, 12}), sc(DType::kF16, {64, 3}), opt);
  EXPECT_THAT(st.message(), HasSubstr("scales is F16[64, 3], want BF16[64, 3]"));
  opt.format = PackFormat::kGptq;
  st = QuantizeInt4(View(DType::kBF16, {64, 96}, w), out({64, 12}), sc(DType::kBF16, {64, 3}), opt);
  EXPECT_THAT(st.message(), HasSubstr("want I32[12, 64]"));
  st = QuantizeInt4(View(DType::kBF16, {0, 4, 96}, w), out({0, 12, 4}), sc(DType::kBF16, {0, 3, 4}), opt);
  EXPECT_THAT(st.message(), HasSubstr("empty or negative dimension: [0, 4, 96]"));
  st = QuantizeInt4(View(DType::kBF16, {2, 2, 4, 96}, w), out({64, 12}), sc(DType::kBF16, {64, 3}), opt);
  EXPECT_THAT(st.message(), HasSubstr("rank 2 or 3"));
  // A view whose byte size does not match its shape.
  st = QuantizeInt4(TensorView(DType::kBF16, {64, 96}, std::as_bytes(std::span(w)).first(100)), out({12, 64}),
                    sc(DType::kBF16, {3, 64}), opt);
  EXPECT_THAT(st.message(), HasSubstr("needs 12288 bytes but the view has 100"));
}

TEST(Int4ValidationTest, RepackErrorsNameTheValues) {
  std::vector<uint32_t> a(4096), b(4096);
  auto in = [&](Shape shape) {
    return TensorView(DType::kI32, shape, std::as_bytes(std::span(a)).first(NumBytes(DType::kI32, shape).value()));
  };
  auto out = [&](Shape shape) {
    return MutableTensorView(DType::kI32, shape,
                             std::as_writable_bytes(std::span(b)).first(NumBytes(DType::kI32, shape).value()));
  };
  absl::Status st = GptqToMarlin(in({3, 64}), nullptr, out({1, 128}), {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("K = 24 is not a multiple of 16"));
  st = GptqToMarlin(in({2, 96}), nullptr, out({1, 192}), {});
  EXPECT_THAT(st.message(), HasSubstr("N = 96 is not a multiple of 64"));
  st = GptqToMarlin(in({2, 64}), nullptr, out({2, 64}), {});
  EXPECT_THAT(st.message(), HasSubstr("want I32[1, 128]"));
  st = GptqToMarlin(in({2, 2, 64}), nullptr, out({3, 1, 128}), {});
  EXPECT_THAT(st.message(), HasSubstr("want I32[2, 1, 128]"));
  st = MarlinToGptq(in({1, 127}), nullptr, out({2, 64}), {});
  EXPECT_THAT(st.message(), HasSubstr("last dimension 127 is odd"));
  std::vector<int32_t> perm(16);
  std::iota(perm.begin(), perm.end(), 0);
  perm[3] = 5;
  const TensorView pv = View(DType::kI32, {16}, perm);
  st = GptqToMarlin(in({2, 64}), &pv, out({1, 128}), {});
  EXPECT_THAT(st.message(), HasSubstr("perm[0, 5] = 5 repeats a value"));
  perm[3] = 16;
  st = GptqToMarlin(in({2, 64}), &pv, out({1, 128}), {});
  EXPECT_THAT(st.message(), HasSubstr("perm[0, 3] = 16 is out of range [0, 16)"));
  st = GptqToMarlin(in({2, 2, 64}), &pv, out({2, 1, 128}), {});
  EXPECT_THAT(st.message(), HasSubstr("perm is I32[16], want I32[2, 16]"));
  const TensorView pv64(DType::kI64, {16}, std::as_bytes(std::span(a)).first(128));
  st = GptqToMarlin(in({2, 64}), &pv64, out({1, 128}), {});
  EXPECT_THAT(st.message(), HasSubstr("perm is I64[16]"));
  st = GptqToMarlin(TensorView(DType::kBF16, {2, 64}, std::as_bytes(std::span(a)).first(256)), nullptr, out({1, 128}),
                    {});
  EXPECT_THAT(st.message(), HasSubstr("dtype BF16 unsupported (want I32)"));
  // Output aliasing the input.
  st = GptqToMarlin(in({2, 64}), nullptr,
                    MutableTensorView(DType::kI32, {1, 128}, std::as_writable_bytes(std::span(a)).first(512)), {});
  EXPECT_THAT(st.message(), HasSubstr("overlap"));
}

TEST(Int4ValidationTest, CudaDeviceWithoutCudaIsFailedPrecondition) {
  if (CudaCompiledIn()) GTEST_SKIP() << "CUDA is compiled in; the differential test covers Device::kCuda";
  std::vector<uint32_t> a(2 * 64), b(2 * 64);
  KernelOptions opt;
  opt.device = Device::kCuda;
  const absl::Status st =
      GptqToMarlin(View(DType::kI32, {2, 64}, a), nullptr,
                   MutableTensorView(DType::kI32, {1, 128}, std::as_writable_bytes(std::span(b))), opt);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("built without CUDA"));
}

TEST(Int4ValidationTest, ScalePermErrorsNameTheValues) {
  std::vector<uint16_t> a(4096), b(4096);
  auto in = [&](DType dt, Shape shape) {
    return TensorView(dt, shape, std::as_bytes(std::span(a)).first(NumBytes(dt, shape).value()));
  };
  auto out = [&](DType dt, Shape shape) {
    return MutableTensorView(dt, shape, std::as_writable_bytes(std::span(b)).first(NumBytes(dt, shape).value()));
  };
  absl::Status st = PermuteMarlinScales(in(DType::kBF16, {4, 64}), 512, 128, out(DType::kBF16, {4, 64}), {});
  EXPECT_TRUE(st.ok()) << st;  // the valid baseline of the cases below
  st = PermuteMarlinScales(in(DType::kBF16, {3, 64}), 512, 128, out(DType::kBF16, {3, 64}), {});
  EXPECT_THAT(st.message(), HasSubstr("have 3 groups per column, but K = 512 with group size 128 gives 4"));
  st = PermuteMarlinScales(in(DType::kBF16, {4, 96}), 512, 128, out(DType::kBF16, {4, 96}), {});
  EXPECT_THAT(st.message(), HasSubstr("N = 96 is not a multiple of 64"));
  st = PermuteMarlinScales(in(DType::kBF16, {4, 64}), 500, 128, out(DType::kBF16, {4, 64}), {});
  EXPECT_THAT(st.message(), HasSubstr("K = 500 is not a multiple of the group size 128"));
  st = PermuteMarlinScales(in(DType::kF32, {4, 64}), 512, 128, out(DType::kF32, {4, 64}), {});
  EXPECT_THAT(st.message(), HasSubstr("dtype F32 unsupported"));
  st = PermuteMarlinScales(in(DType::kBF16, {4, 64}), 512, 128, out(DType::kF16, {4, 64}), {});
  EXPECT_THAT(st.message(), HasSubstr("want BF16[4, 64]"));
}

}  // namespace
}  // namespace wsync::kernels
