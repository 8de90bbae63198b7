// Host emulation of the CUDA AWQ / TensorRT-LLM kernels: every item of every per-thread body in
// awq_kernel_bodies.h runs on the host (as the grid would run it) and must reproduce the CPU path
// byte for byte, so the kernels' index arithmetic is checked without a GPU.
#include "kernels/cuda/awq_kernel_bodies.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/awq_cpu.h"

namespace wsync::kernels {
namespace {

namespace body = ::wsync::kernels::cuda_body;

std::vector<uint16_t> Weights(size_t count, bool bf16, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<uint16_t> w(count);
  for (auto& v : w) v = bf16 ? F32ToBF16(dist(rng)) : F32ToF16(dist(rng));
  return w;
}

TEST(AwqKernelBodiesTest, QuantizePassesMatchTheCpuPath) {
  for (bool bf16 : {true, false}) {
    for (auto arith : {format::AwqArith::kFp16, format::AwqArith::kFp32}) {
      // (K, G): 8-aligned groups (the 16-byte load path) and K = G = 196 (rows not 16-byte aligned).
      for (auto [k, g] : {std::pair<int64_t, int64_t>{256, 32}, {256, 128}, {256, 256}, {196, 196}}) {
        internal::AwqQuantizeArgs a;
        const std::vector<uint16_t> w = Weights(2 * 72 * k, bf16, static_cast<uint32_t>(g + bf16));
        a.w = w.data();
        a.is_bf16 = bf16;
        a.experts = 2, a.n = 72, a.k = k, a.group = g, a.arith = arith;
        const int64_t ng = a.k / g, groups = a.experts * a.n * ng;
        std::vector<uint32_t> qw(a.experts * a.k * a.n / 8), qz(a.experts * ng * a.n / 8);
        std::vector<uint16_t> sc(a.experts * ng * a.n);
        a.qweight = qw.data(), a.qzeros = qz.data(), a.scales = sc.data();
        ASSERT_TRUE(cpu::QuantizeAwq(a).ok());
        std::vector<uint32_t> qw2(qw.size()), qz2(qz.size());
        std::vector<uint16_t> sc2(sc.size());
        a.qweight = qw2.data(), a.qzeros = qz2.data(), a.scales = sc2.data();
        std::vector<float> ts(groups);
        std::vector<uint8_t> tz(groups);
        for (int64_t t = 0; t < groups; ++t) ASSERT_EQ(body::AwqParamsItem(t, a, ts.data(), tz.data()), -1);
        for (int64_t t = 0; t < static_cast<int64_t>(qw.size()); ++t) body::AwqPackItem(t, a, ts.data(), tz.data());
        for (int64_t t = 0; t < static_cast<int64_t>(qz.size()); ++t) body::AwqZerosItem(t, a, tz.data());
        EXPECT_EQ(qw2, qw);
        EXPECT_EQ(qz2, qz);
        EXPECT_EQ(sc2, sc);
      }
    }
  }
}

TEST(AwqKernelBodiesTest, RepacksMatchTheCpuPath) {
  std::mt19937 rng(3);
  const int64_t e = 2, rows = 64, n = 128;
  std::vector<uint32_t> in(e * rows * n / 8);
  for (auto& x : in) x = rng();
  using Fn = absl::Status (*)(const internal::AwqRepackArgs&);
  using Item = void (*)(int64_t, const internal::AwqRepackArgs&);
  const std::pair<Fn, Item> pairs[] = {{&cpu::AwqToGptq, &body::AwqToGptqItem},
                                       {&cpu::GptqToAwq, &body::GptqToAwqItem},
                                       {&cpu::AwqToMarlin, &body::AwqToMarlinItem},
                                       {&cpu::AwqZerosToMarlin, &body::AwqZerosToMarlinItem},
                                       {&cpu::MarlinZerosToAwq, &body::MarlinZerosToAwqItem}};
  for (const auto& [fn, item] : pairs) {
    std::vector<uint32_t> want(in.size()), got(in.size());
    internal::AwqRepackArgs a;
    a.in = in.data(), a.experts = e, a.rows = rows, a.n = n;
    a.out = want.data();
    ASSERT_TRUE(fn(a).ok());
    a.out = got.data();
    const int64_t items = static_cast<int64_t>(got.size()) / (item == &body::AwqToMarlinItem ? 8 : 1);
    for (int64_t t = 0; t < items; ++t) item(t, a);
    EXPECT_EQ(got, want);
  }
}

TEST(AwqKernelBodiesTest, TrtllmMatchesTheCpuPath) {
  std::mt19937 rng(4);
  const int64_t e = 2, k = 256, n = 128;
  std::vector<uint32_t> codes(e * k * n / 8);
  for (auto& x : codes) x = rng();
  for (auto layout : {format::TrtllmLayout::kSm80W4A16, format::TrtllmLayout::kSm80W4AFp8,
                      format::TrtllmLayout::kSm90Dense, format::TrtllmLayout::kSm90W4AFp8}) {
    std::vector<uint32_t> want(codes.size()), got(codes.size()), back(codes.size());
    internal::TrtllmArgs a;
    a.codes = codes.data(), a.bytes = want.data(), a.experts = e, a.k = k, a.n = n, a.layout = layout;
    ASSERT_TRUE(cpu::Trtllm(a).ok());
    a.bytes = got.data();
    for (int64_t t = 0; t < static_cast<int64_t>(got.size()) / 4; ++t) body::TrtllmBlockItem(t, a);
    EXPECT_EQ(got, want);
    // The per-nibble form of the spec (format::TrtllmWord / TrtllmCodeAt) agrees word for word.
    for (int64_t w = 0; w < static_cast<int64_t>(got.size()); ++w) {
      const int64_t ex = w / (k * n / 8);
      auto code = [&](int64_t row, int64_t col) {
        return format::GetNibble(codes[ex * (k * n / 8) + (row / 8) * n + col], static_cast<int>(row % 8));
      };
      ASSERT_EQ(format::TrtllmWord(layout, w % (k * n / 8), k, code), want[w]) << "word " << w;
      const int64_t row = (w % (k * n / 8)) / n * 8, col = w % n;
      ASSERT_EQ(format::TrtllmCodeAt(layout, want.data() + ex * (k * n / 8), row, col, k),
                format::GetNibble(codes[w], 0))
          << "code at word " << w;
    }
    a.inverse = true;
    a.codes = back.data();
    for (int64_t t = 0; t < static_cast<int64_t>(back.size()) / 4; ++t) body::TrtllmBlockItem(t, a);
    EXPECT_EQ(back, codes);
  }
  // Scales (every mode) and zeros.
  const int64_t rows = 8;
  std::vector<uint16_t> s(e * rows * n);
  for (auto& x : s) x = F32ToBF16(0.01f * static_cast<float>(rng() % 100 + 1));
  std::vector<uint32_t> qz(e * rows * n / 8);
  for (auto& x : qz) x = rng();
  for (auto mode : {internal::TrtllmScaleMode::kCopy, internal::TrtllmScaleMode::kToF16,
                    internal::TrtllmScaleMode::kToBf16Interleaved}) {
    std::vector<uint16_t> want(s.size()), got(s.size());
    internal::TrtllmScaleArgs a;
    a.in = s.data(), a.in_bf16 = true, a.experts = e, a.rows = rows, a.n = n, a.mode = mode, a.interleave = 4;
    a.qzeros = qz.data();
    a.out = want.data();
    ASSERT_TRUE(cpu::TrtllmScales(a).ok());
    a.out = got.data();
    for (int64_t t = 0; t < static_cast<int64_t>(got.size()); ++t) body::TrtllmScaleItem(t, a);
    EXPECT_EQ(got, want);
    a.out = want.data();
    ASSERT_TRUE(cpu::TrtllmZeros(a).ok());
    a.out = got.data();
    for (int64_t t = 0; t < static_cast<int64_t>(got.size()); ++t) body::TrtllmZeroItem(t, a);
    EXPECT_EQ(got, want);
  }
}

}  // namespace
}  // namespace wsync::kernels
