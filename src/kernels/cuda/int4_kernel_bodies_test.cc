// Host emulation of the CUDA INT4 kernels: runs the per-thread bodies of int4_kernel_bodies.h
// for every (block, thread) in the launch order of int4_kernels.cu (phases separated as by the
// kernels' barriers; atomics become plain min / or) and compares with the CPU path byte for byte.
// This tests the GPU path's index arithmetic without a GPU; int4_cuda_test.cc runs the real
// kernels where a device exists.
#include "kernels/cuda/int4_kernel_bodies.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/int4.h"

namespace wsync::kernels {
namespace {

namespace body = cuda_body;
using internal::Layout;

constexpr int kRowThreads = 256;  // QuantizeRowKernel's block size
constexpr int kTileThreads = 128;

template <int kG, bool kBf16, Layout kLayout>
int64_t EmulateGrouped(const uint16_t* w, int64_t e, int64_t n, int64_t k, format::Variant v, uint32_t* p,
                       uint16_t* s) {
  int64_t bad = INT64_MAX;
  for (int64_t t = 0; t < e * n * (k / kG); ++t) {
    const int64_t b = body::QuantizeGroupedItem<kG, kBf16, kLayout>(t, w, n, k, v, p, s);
    if (b >= 0) bad = std::min(bad, b);
  }
  return bad;
}

template <bool kBf16, Layout kLayout>
int64_t EmulateRow(const uint16_t* w, int64_t e, int64_t n, int64_t k, format::Variant v, uint32_t* p, uint16_t* s) {
  int64_t bad = INT64_MAX;
  for (int64_t row = 0; row < e * n; ++row) {
    uint32_t m = 0;
    for (int tid = 0; tid < kRowThreads; ++tid) m = std::max(m, body::RowAbsMaxPart(w, row, k, tid, kRowThreads));
    for (int tid = 0; tid < kRowThreads; ++tid) {
      const int64_t b = body::RowQuantizePart<kBf16, kLayout>(w, row, n, k, v, m, tid, kRowThreads, p, s);
      if (b >= 0) bad = std::min(bad, b);
    }
  }
  return bad;
}

template <bool kBf16, Layout kLayout>
int64_t Emulate(int g, const uint16_t* w, int64_t e, int64_t n, int64_t k, format::Variant v, uint32_t* p,
                uint16_t* s) {
  switch (g) {
    case 32: return EmulateGrouped<32, kBf16, kLayout>(w, e, n, k, v, p, s);
    case 64: return EmulateGrouped<64, kBf16, kLayout>(w, e, n, k, v, p, s);
    case 128: return EmulateGrouped<128, kBf16, kLayout>(w, e, n, k, v, p, s);
    default: return EmulateRow<kBf16, kLayout>(w, e, n, k, v, p, s);
  }
}

std::vector<uint16_t> Aligned16(size_t n) { return std::vector<uint16_t>(n); }  // operator new: 16-byte aligned

TEST(Int4KernelBodiesTest, QuantizeMatchesCpu) {
  std::mt19937 rng(123);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (PackFormat f : {PackFormat::kCompressedTensors, PackFormat::kGptq}) {
      for (QuantVariant qv : {QuantVariant::kQat, QuantVariant::kSlime}) {
        for (int g : {32, 64, 128, -1}) {
          const int64_t e = 2, n = 24, k = 384;
          SCOPED_TRACE(testing::Message() << SafetensorsName(dt) << " format=" << static_cast<int>(f)
                                          << " variant=" << static_cast<int>(qv) << " G=" << g);
          std::vector<uint16_t> w = Aligned16(static_cast<size_t>(e * n * k));
          for (auto& x : w) x = dt == DType::kBF16 ? F32ToBF16(dist(rng)) : F32ToF16(dist(rng));
          std::fill(w.begin(), w.begin() + 128, uint16_t{0});  // zero groups
          const TensorView wv(dt, {e, n, k}, std::as_bytes(std::span(w)));
          auto shapes = QuantizedShapesFor(wv, g, f);
          ASSERT_TRUE(shapes.ok());
          const int64_t ng = k / (g > 0 ? g : k);
          std::vector<uint32_t> cpu_p(e * n * k / 8), emu_p(cpu_p.size(), 0xDEADBEEF);
          std::vector<uint16_t> cpu_s(e * n * ng), emu_s(cpu_s.size(), 0xBEEF);
          QuantizeOptions opt;
          opt.group_size = g;
          opt.format = f;
          opt.variant = qv;
          ASSERT_TRUE(
              QuantizeInt4(wv, MutableTensorView(DType::kI32, shapes->packed, std::as_writable_bytes(std::span(cpu_p))),
                           MutableTensorView(dt, shapes->scales, std::as_writable_bytes(std::span(cpu_s))), opt)
                  .ok());
          const auto v = qv == QuantVariant::kQat ? format::Variant::kQat : format::Variant::kSlime;
          const bool gptq = f == PackFormat::kGptq;
          int64_t bad;
          if (dt == DType::kBF16) {
            bad = gptq ? Emulate<true, Layout::kGptq>(g, w.data(), e, n, k, v, emu_p.data(), emu_s.data())
                       : Emulate<true, Layout::kCompressedTensors>(g, w.data(), e, n, k, v, emu_p.data(), emu_s.data());
          } else {
            bad = gptq
                      ? Emulate<false, Layout::kGptq>(g, w.data(), e, n, k, v, emu_p.data(), emu_s.data())
                      : Emulate<false, Layout::kCompressedTensors>(g, w.data(), e, n, k, v, emu_p.data(), emu_s.data());
          }
          EXPECT_EQ(bad, INT64_MAX);
          EXPECT_EQ(emu_p, cpu_p);
          EXPECT_EQ(emu_s, cpu_s);
        }
      }
    }
  }
}

TEST(Int4KernelBodiesTest, NonFiniteGroupIsReported) {
  std::vector<uint16_t> w = Aligned16(4 * 128);
  w[2 * 128 + 70] = 0x7F80;  // +Inf, row 2, group 2 of G = 32
  w[3 * 128 + 5] = 0x7FC0;
  std::vector<uint32_t> p(4 * 16);
  std::vector<uint16_t> s(4 * 4);
  EXPECT_EQ(
      (Emulate<true, Layout::kCompressedTensors>(32, w.data(), 1, 4, 128, format::Variant::kQat, p.data(), s.data())),
      2 * 4 + 2);
  EXPECT_EQ((Emulate<true, Layout::kGptq>(-1, w.data(), 1, 4, 128, format::Variant::kQat, p.data(), s.data())), 2);
}

TEST(Int4KernelBodiesTest, RepackRestoreAndScalePermMatchCpu) {
  std::mt19937 rng(321);
  for (bool with_perm : {false, true}) {
    const int64_t e = 3, k = 128, n = 192;
    SCOPED_TRACE(testing::Message() << "perm=" << with_perm);
    std::vector<uint32_t> q(e * k / 8 * n);
    for (auto& x : q) x = rng();
    std::vector<int32_t> perm(e * k);
    for (int64_t i = 0; i < e; ++i) {
      std::iota(perm.begin() + i * k, perm.begin() + (i + 1) * k, 0);
      std::shuffle(perm.begin() + i * k, perm.begin() + (i + 1) * k, rng);
    }
    const TensorView pv(DType::kI32, {e, k}, std::as_bytes(std::span(perm)));
    std::vector<uint32_t> cpu(q.size());
    ASSERT_TRUE(
        GptqToMarlin(TensorView(DType::kI32, {e, k / 8, n}, std::as_bytes(std::span(q))), with_perm ? &pv : nullptr,
                     MutableTensorView(DType::kI32, {e, k / 16, 2 * n}, std::as_writable_bytes(std::span(cpu))), {})
            .ok());
    const int32_t* pp = with_perm ? perm.data() : nullptr;
    const int64_t tiles = e * (k / 16) * (n / 64);
    std::vector<uint32_t> marlin(q.size(), 0xDEADBEEF);
    for (int64_t t = 0; t < tiles * 32; ++t) body::RepackGroupItem(t, q.data(), pp, k, n, marlin.data());
    EXPECT_EQ(marlin, cpu);
    std::vector<uint32_t> back(q.size(), with_perm ? 0u : 0xDEADBEEF);  // the kernel memsets with perm
    if (pp == nullptr) {
      for (int64_t t = 0; t < tiles * 32; ++t) body::RestoreGroupItem(t, marlin.data(), k, n, back.data());
    } else {
      for (int64_t block = 0; block < tiles; ++block) {
        const body::TileIndex ti = body::TileOfBlock(block, k, n);
        uint32_t words[format::kTileWords];
        for (int tid = 0; tid < kTileThreads; ++tid) body::RestoreStage(marlin.data(), k, n, ti, tid, words);
        for (int tid = 0; tid < kTileThreads; ++tid) {
          body::RestoreScatter(pp, k, n, ti, tid, words, back.data(), [](uint32_t* p, uint32_t bits) { *p |= bits; });
        }
      }
    }
    EXPECT_EQ(back, q);
  }
  for (int g : {64, -1}) {
    const int64_t e = 2, k = 256, n = 128, rows = g > 0 ? k / g : 1;
    std::vector<uint16_t> s(e * rows * n);
    for (auto& x : s) x = static_cast<uint16_t>(rng());
    std::vector<uint16_t> cpu(s.size()), emu(s.size()), inv(s.size());
    ASSERT_TRUE(
        PermuteMarlinScales(TensorView(DType::kBF16, {e, rows, n}, std::as_bytes(std::span(s))), k, g,
                            MutableTensorView(DType::kBF16, {e, rows, n}, std::as_writable_bytes(std::span(cpu))), {})
            .ok());
    for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i)
      body::ScalePermItem(i, s.data(), emu.data(), g == -1, false);
    EXPECT_EQ(emu, cpu);
    for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i)
      body::ScalePermItem(i, emu.data(), inv.data(), g == -1, true);
    EXPECT_EQ(inv, s);
  }
}

}  // namespace
}  // namespace wsync::kernels
