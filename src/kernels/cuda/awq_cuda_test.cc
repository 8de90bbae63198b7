// Differential test: the CUDA AWQ and TensorRT-LLM kernels against the CPU path, byte for byte
// (STYLE.md §5), including the refusal of a group fp16 cannot hold. Skips without a GPU.
#include <gtest/gtest.h>

#include <random>
#include <tuple>
#include <vector>

#include "common/dtype.h"
#include "kernels/awq.h"
#include "kernels/cuda/testing/device_vec.h"
#include "kernels/dispatch.h"
#include "kernels/trtllm.h"

namespace wsync::kernels {
namespace {

using testing::DeviceVec;
using testing::HostMView;
using testing::HostView;

class AwqCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!GpuAvailable()) GTEST_SKIP() << "no CUDA device on this machine";
  }
};

Shape Sh(int64_t e, std::initializer_list<int64_t> tail) {
  Shape s;
  if (e > 1) s.push_back(e);
  for (int64_t d : tail) s.push_back(d);
  return s;
}

TEST_F(AwqCudaTest, QuantizeMatchesCpu) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (AwqArith arith : {AwqArith::kFp16, AwqArith::kFp32}) {
      for (int g : {32, 64, 128, -1}) {
        // {2, 136, 196}: partial 32 x 32 pack tiles in both directions, rows not 16-byte aligned.
        for (auto [e, n, k] :
             {std::tuple<int64_t, int64_t, int64_t>{1, 256, 1024}, {4, 64, 384}, {1, 2304, 256}, {2, 136, 196}}) {
          if (g > 0 && k % g != 0) continue;
          SCOPED_TRACE(::testing::Message() << "G=" << g << " E=" << e << " N=" << n << " K=" << k);
          const int64_t gg = g < 0 ? k : g;
          std::vector<uint16_t> w(static_cast<size_t>(e * n * k));
          for (auto& x : w) x = dt == DType::kBF16 ? F32ToBF16(dist(rng)) : F32ToF16(dist(rng));
          for (size_t i = 0; i < 32; ++i) w[i] = 0;  // an all-zero group
          std::vector<uint32_t> qw(e * k * n / 8), qz(e * (k / gg) * n / 8);
          std::vector<uint16_t> sc(e * (k / gg) * n);
          AwqQuantizeOptions opt;
          opt.group_size = g;
          opt.arith = arith;
          const Shape ws = Sh(e, {n, k}), qs = Sh(e, {k, n / 8}), zs = Sh(e, {k / gg, n / 8}), ss = Sh(e, {k / gg, n});
          ASSERT_TRUE(QuantizeAwq(HostView(dt, ws, w), HostMView(DType::kI32, qs, qw), HostMView(DType::kI32, zs, qz),
                                  HostMView(dt, ss, sc), opt)
                          .ok());
          DeviceVec<uint16_t> dw(w), dsc(sc.size());
          DeviceVec<uint32_t> dqw(qw.size()), dqz(qz.size());
          opt.device = Device::kCuda;
          const absl::Status st = QuantizeAwq(dw.view(dt, ws), dqw.mview(DType::kI32, qs), dqz.mview(DType::kI32, zs),
                                              dsc.mview(dt, ss), opt);
          ASSERT_TRUE(st.ok()) << st;
          EXPECT_EQ(dqw.ToHost(), qw);
          EXPECT_EQ(dqz.ToHost(), qz);
          EXPECT_EQ(dsc.ToHost(), sc);
        }
      }
    }
  }
}

TEST_F(AwqCudaTest, Fp16RangeRefusalNamesTheSameGroup) {
  std::vector<uint16_t> w(64 * 128, F32ToBF16(0.01f));
  w[37 * 128 + 70] = F32ToBF16(70000.0f);
  AwqQuantizeOptions opt;
  opt.group_size = 64;
  std::vector<uint32_t> qw(128 * 8), qz(2 * 8);
  std::vector<uint16_t> sc(2 * 64);
  const absl::Status cpu = QuantizeAwq(HostView(DType::kBF16, {64, 128}, w), HostMView(DType::kI32, {128, 8}, qw),
                                       HostMView(DType::kI32, {2, 8}, qz), HostMView(DType::kBF16, {2, 64}, sc), opt);
  DeviceVec<uint16_t> dw(w), dsc(sc.size());
  DeviceVec<uint32_t> dqw(qw.size()), dqz(qz.size());
  opt.device = Device::kCuda;
  const absl::Status gpu = QuantizeAwq(dw.view(DType::kBF16, {64, 128}), dqw.mview(DType::kI32, {128, 8}),
                                       dqz.mview(DType::kI32, {2, 8}), dsc.mview(DType::kBF16, {2, 64}), opt);
  ASSERT_FALSE(cpu.ok());
  EXPECT_EQ(gpu, cpu);
}

TEST_F(AwqCudaTest, LayoutConversionsMatchCpu) {
  std::mt19937 rng(8);
  for (int64_t e : {1, 3}) {
    const int64_t k = 256, n = 192, groups = 4;
    std::vector<uint32_t> awq(e * k * n / 8), zeros(e * groups * n / 8);
    for (auto& x : awq) x = rng();
    for (auto& x : zeros) x = rng();
    KernelOptions cpu, gpu;
    gpu.device = Device::kCuda;
    DeviceVec<uint32_t> dawq(awq), dzeros(zeros);
    // AWQ -> GPTQ, and back.
    std::vector<uint32_t> g(awq.size());
    DeviceVec<uint32_t> dg(awq.size()), dback(awq.size());
    ASSERT_TRUE(
        AwqToGptq(HostView(DType::kI32, Sh(e, {k, n / 8}), awq), HostMView(DType::kI32, Sh(e, {k / 8, n}), g), cpu)
            .ok());
    ASSERT_TRUE(
        AwqToGptq(dawq.view(DType::kI32, Sh(e, {k, n / 8})), dg.mview(DType::kI32, Sh(e, {k / 8, n})), gpu).ok());
    EXPECT_EQ(dg.ToHost(), g);
    ASSERT_TRUE(
        GptqToAwq(dg.view(DType::kI32, Sh(e, {k / 8, n})), dback.mview(DType::kI32, Sh(e, {k, n / 8})), gpu).ok());
    EXPECT_EQ(dback.ToHost(), awq);
    // AWQ -> Marlin, zero points both ways.
    std::vector<uint32_t> m(awq.size()), mz(zeros.size());
    DeviceVec<uint32_t> dm(awq.size()), dmz(zeros.size()), dz2(zeros.size());
    ASSERT_TRUE(AwqToMarlin(HostView(DType::kI32, Sh(e, {k, n / 8}), awq),
                            HostMView(DType::kI32, Sh(e, {k / 16, 2 * n}), m), cpu)
                    .ok());
    ASSERT_TRUE(
        AwqToMarlin(dawq.view(DType::kI32, Sh(e, {k, n / 8})), dm.mview(DType::kI32, Sh(e, {k / 16, 2 * n})), gpu)
            .ok());
    EXPECT_EQ(dm.ToHost(), m);
    const Shape zs = Sh(e, {groups, n / 8});
    ASSERT_TRUE(AwqZerosToMarlin(HostView(DType::kI32, zs, zeros), HostMView(DType::kI32, zs, mz), cpu).ok());
    ASSERT_TRUE(AwqZerosToMarlin(dzeros.view(DType::kI32, zs), dmz.mview(DType::kI32, zs), gpu).ok());
    EXPECT_EQ(dmz.ToHost(), mz);
    ASSERT_TRUE(MarlinZerosToAwq(dmz.view(DType::kI32, zs), dz2.mview(DType::kI32, zs), gpu).ok());
    EXPECT_EQ(dz2.ToHost(), zeros);
  }
}

TEST_F(AwqCudaTest, TrtllmMatchesCpu) {
  std::mt19937 rng(9);
  const int64_t e = 2, k = 256, n = 128, g = 64;
  std::vector<uint32_t> codes(e * k / 8 * n), qz(e * (k / g) * n / 8);
  for (auto& x : codes) x = rng();
  for (auto& x : qz) x = rng();
  std::vector<uint16_t> s(e * (k / g) * n);
  for (auto& x : s) x = F32ToBF16(0.001f * static_cast<float>(rng() % 100 + 1));
  DeviceVec<uint32_t> dcodes(codes), dqz(qz);
  DeviceVec<uint16_t> ds(s);
  for (int64_t ee : {int64_t{1}, e}) {
    for (auto [arch, f8] : {std::pair{TrtllmArch::kSm80, false}, std::pair{TrtllmArch::kSm90, false},
                            std::pair{TrtllmArch::kSm80, true}, std::pair{TrtllmArch::kSm90, true}}) {
      if (f8 && ee == 1) continue;  // W4AFP8: MoE only
      TrtllmOptions cpu, gpu;
      cpu.arch = gpu.arch = arch;
      cpu.w4afp8 = gpu.w4afp8 = f8;
      gpu.device = Device::kCuda;
      const Shape cs = Sh(ee, {k / 8, n});
      const Shape bs = *TrtllmWeightShapeFor(cs, cpu);
      const size_t words = static_cast<size_t>(ee * k * n / 8);
      std::vector<uint32_t> hcodes(codes.begin(), codes.begin() + words), out(words);
      DeviceVec<uint32_t> dc(hcodes), dout(words), dback(words);
      ASSERT_TRUE(PreprocessTrtllm(HostView(DType::kI32, cs, hcodes), HostMView(DType::kI8, bs, out), cpu).ok());
      ASSERT_TRUE(PreprocessTrtllm(dc.view(DType::kI32, cs), dout.mview(DType::kI8, bs), gpu).ok());
      EXPECT_EQ(dout.ToHost(), out);
      ASSERT_TRUE(UnpreprocessTrtllm(dout.view(DType::kI8, bs), dback.mview(DType::kI32, cs), gpu).ok());
      EXPECT_EQ(dback.ToHost(), hcodes);
      // Scales (and AWQ zeros for W4A16) on the stack.
      const Shape ss = Sh(e, {k / g, n});
      const TrtllmScaleLayout lay = *TrtllmScaleLayoutFor(HostView(DType::kBF16, ss, s), k, g, cpu);
      std::vector<uint16_t> so(s.size());
      DeviceVec<uint16_t> dso(s.size());
      ASSERT_TRUE(TrtllmScales(HostView(DType::kBF16, ss, s), k, g, HostMView(lay.dtype, lay.shape, so), cpu).ok());
      ASSERT_TRUE(TrtllmScales(ds.view(DType::kBF16, ss), k, g, dso.mview(lay.dtype, lay.shape), gpu).ok());
      EXPECT_EQ(dso.ToHost(), so);
      if (!f8) {
        const Shape zs = Sh(e, {k / g, n / 8});
        const TensorView hz = HostView(DType::kI32, zs, qz), hs = HostView(DType::kBF16, ss, s);
        const MutableTensorView ho = HostMView(DType::kBF16, ss, so);
        ASSERT_TRUE(TrtllmZerosFromAwq(hz, hs, ho, cpu).ok());
        const TensorView dzv = dqz.view(DType::kI32, zs), dsv = ds.view(DType::kBF16, ss);
        const MutableTensorView dov = dso.mview(DType::kBF16, ss);
        ASSERT_TRUE(TrtllmZerosFromAwq(dzv, dsv, dov, gpu).ok());
        EXPECT_EQ(dso.ToHost(), so);
      }
    }
  }
}

}  // namespace
}  // namespace wsync::kernels
