// Differential test: the CUDA kernels against the CPU path, byte for byte (STYLE.md §5).
// Skips when no GPU is present (kernels::GpuAvailable()).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/testing/device_vec.h"
#include "kernels/dispatch.h"
#include "kernels/int4.h"

namespace wsync::kernels {
namespace {

using testing::DeviceVec;
using testing::HostMView;
using testing::HostView;

class Int4CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!GpuAvailable()) GTEST_SKIP() << "no CUDA device on this machine";
  }
};

TEST_F(Int4CudaTest, QuantizeMatchesCpu) {
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int g : {32, 64, 128, -1}) {
      for (PackFormat f : {PackFormat::kCompressedTensors, PackFormat::kGptq}) {
        for (QuantVariant v : {QuantVariant::kQat, QuantVariant::kSlime}) {
          for (auto [e, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 256, 1024}, {4, 64, 384}, {1, 192, 4096}}) {
            if (g > 0 && k % g != 0) continue;
            SCOPED_TRACE(::testing::Message() << "G=" << g << " E=" << e << " N=" << n << " K=" << k);
            std::vector<uint16_t> w(static_cast<size_t>(e * n * k));
            for (auto& x : w) x = dt == DType::kBF16 ? F32ToBF16(dist(rng)) : F32ToF16(dist(rng));
            for (size_t i = 0; i < 64; ++i) w[i] = 0;  // an all-zero group
            const Shape ws = e > 1 ? Shape{e, n, k} : Shape{n, k};
            auto shapes = QuantizedShapesFor(HostView(dt, ws, w), g, f);
            ASSERT_TRUE(shapes.ok()) << shapes.status();
            const int64_t np = e * n * k / 8, ns = e * n * (k / (g > 0 ? g : k));
            std::vector<uint32_t> cpu_p(np);
            std::vector<uint16_t> cpu_s(ns);
            QuantizeOptions opt;
            opt.group_size = g;
            opt.format = f;
            opt.variant = v;
            ASSERT_TRUE(QuantizeInt4(HostView(dt, ws, w), HostMView(DType::kI32, shapes->packed, cpu_p),
                                     HostMView(dt, shapes->scales, cpu_s), opt)
                            .ok());
            DeviceVec<uint16_t> dw(w);
            DeviceVec<uint32_t> dp(np);
            DeviceVec<uint16_t> ds(ns);
            opt.device = Device::kCuda;
            const absl::Status st =
                QuantizeInt4(dw.view(dt, ws), dp.mview(DType::kI32, shapes->packed), ds.mview(dt, shapes->scales), opt);
            ASSERT_TRUE(st.ok()) << st;
            EXPECT_EQ(dp.ToHost(), cpu_p);
            EXPECT_EQ(ds.ToHost(), cpu_s);
          }
        }
      }
    }
  }
}

TEST_F(Int4CudaTest, RepackRestoreAndScalesMatchCpu) {
  std::mt19937 rng(7);
  for (bool with_perm : {false, true}) {
    for (auto [e, k, n] : {std::tuple<int64_t, int64_t, int64_t>{1, 128, 64}, {1, 4096, 5632}, {8, 256, 192}}) {
      SCOPED_TRACE(::testing::Message() << "perm=" << with_perm << " E=" << e << " K=" << k << " N=" << n);
      std::vector<uint32_t> q(static_cast<size_t>(e * k / 8 * n));
      for (auto& x : q) x = rng();
      std::vector<int32_t> perm(static_cast<size_t>(e * k));
      for (int64_t i = 0; i < e; ++i) {
        std::iota(perm.begin() + i * k, perm.begin() + (i + 1) * k, 0);
        std::shuffle(perm.begin() + i * k, perm.begin() + (i + 1) * k, rng);
      }
      const Shape gs = e > 1 ? Shape{e, k / 8, n} : Shape{k / 8, n};
      const Shape ms = e > 1 ? Shape{e, k / 16, 2 * n} : Shape{k / 16, 2 * n};
      const Shape ps = e > 1 ? Shape{e, k} : Shape{k};
      std::vector<uint32_t> cpu_m(q.size());
      const TensorView hp = HostView(DType::kI32, ps, perm);
      ASSERT_TRUE(
          GptqToMarlin(HostView(DType::kI32, gs, q), with_perm ? &hp : nullptr, HostMView(DType::kI32, ms, cpu_m), {})
              .ok());
      DeviceVec<uint32_t> dq(q), dm(q.size()), dr(q.size());
      DeviceVec<int32_t> dperm(perm);
      const TensorView dpv = dperm.view(DType::kI32, ps);
      KernelOptions opt;
      opt.device = Device::kCuda;
      ASSERT_TRUE(
          GptqToMarlin(dq.view(DType::kI32, gs), with_perm ? &dpv : nullptr, dm.mview(DType::kI32, ms), opt).ok());
      EXPECT_EQ(dm.ToHost(), cpu_m);
      ASSERT_TRUE(
          MarlinToGptq(dm.view(DType::kI32, ms), with_perm ? &dpv : nullptr, dr.mview(DType::kI32, gs), opt).ok());
      EXPECT_EQ(dr.ToHost(), q);
    }
  }
  for (int g : {128, -1}) {
    const int64_t k = 1024, n = 256, rows = g > 0 ? k / g : 1;
    std::vector<uint16_t> s(static_cast<size_t>(rows * n));
    for (auto& x : s) x = static_cast<uint16_t>(rng());
    std::vector<uint16_t> cpu(s.size());
    ASSERT_TRUE(
        PermuteMarlinScales(HostView(DType::kBF16, {rows, n}, s), k, g, HostMView(DType::kBF16, {rows, n}, cpu), {})
            .ok());
    DeviceVec<uint16_t> ds(s), dout(s.size());
    KernelOptions opt;
    opt.device = Device::kCuda;
    ASSERT_TRUE(
        PermuteMarlinScales(ds.view(DType::kBF16, {rows, n}), k, g, dout.mview(DType::kBF16, {rows, n}), opt).ok());
    EXPECT_EQ(dout.ToHost(), cpu);
  }
}

}  // namespace
}  // namespace wsync::kernels
