// Differential test of the CUDA FP8 kernels against the CPU ones (kernels/fp8.h): every byte of q
// and every scale bit equal, for every variant, bf16 and fp16, dense and stacked, N and K not
// multiples of the block, seeded weights with edge values; the non-finite refusal names the same
// block or row; dequantize equal. Skips when no GPU is present (kernels::GpuAvailable()).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/testing/device_vec.h"
#include "kernels/dispatch.h"
#include "kernels/fp8.h"

namespace wsync::kernels {
namespace {

using testing::DeviceVec;
using testing::HostMView;
using testing::HostView;

class Fp8CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!GpuAvailable()) GTEST_SKIP() << "no CUDA device on this machine";
  }
};

std::vector<uint16_t> Weights(uint64_t seed, DType dt, size_t n, float sigma) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<uint16_t> w(n);
  for (auto& h : w) h = dt == DType::kBF16 ? F32ToBF16(normal(rng)) : F32ToF16(normal(rng));
  const float edges[] = {0.0f, -0.0f, 3e-39f, 0x1p-10f, 1.0625f, 1e4f, 448.0f, 464.0f, 65504.0f};
  std::uniform_int_distribution<size_t> at(0, n - 1);
  for (float f : edges) w[at(rng)] = dt == DType::kBF16 ? F32ToBF16(f) : F32ToF16(f);
  return w;
}

struct Shape3 {
  int64_t e, n, k;
};

TEST_F(Fp8CudaTest, BlockEqualsTheCpuForEveryVariant) {
  const Shape3 shapes[] = {{1, 256, 384}, {3, 200, 300}, {2, 130, 129}, {1, 1, 7}, {4, 512, 7168}};
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (const Shape3& sh : shapes) {
      const Shape s = sh.e > 1 ? Shape{sh.e, sh.n, sh.k} : Shape{sh.n, sh.k};
      const std::vector<uint16_t> w = Weights(7 + sh.n, dt, static_cast<size_t>(sh.e * sh.n * sh.k), 0.3f);
      for (auto v : {Fp8BlockVariant::kSlime, Fp8BlockVariant::kVllm, Fp8BlockVariant::kUe8m0}) {
        SCOPED_TRACE(::testing::Message()
                     << SafetensorsName(dt) << " " << ShapeToString(s) << " variant " << static_cast<int>(v));
        Fp8BlockOptions o;
        o.variant = v;
        const Shape ss = *Fp8BlockScaleShape(s, 128, 128);
        const size_t ns = static_cast<size_t>(ss.size() == 3 ? ss[0] * ss[1] * ss[2] : ss[0] * ss[1]);
        std::vector<uint8_t> q(w.size());
        std::vector<float> sc(ns);
        ASSERT_TRUE(
            QuantizeFp8Block(HostView(dt, s, w), HostMView(DType::kF8E4M3, s, q), HostMView(DType::kF32, ss, sc), o)
                .ok());
        DeviceVec<uint16_t> dw(w);
        DeviceVec<uint8_t> dq(w.size());
        DeviceVec<float> ds(ns);
        o.device = Device::kCuda;
        auto st = QuantizeFp8Block(dw.view(dt, s), dq.mview(DType::kF8E4M3, s), ds.mview(DType::kF32, ss), o);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_EQ(dq.ToHost(), q);
        const std::vector<float> got = ds.ToHost();
        EXPECT_EQ(0, std::memcmp(got.data(), sc.data(), ns * 4));
        // dequantize on both
        std::vector<float> out(w.size());
        ASSERT_TRUE(DequantizeFp8Block(HostView(DType::kF8E4M3, s, q), HostView(DType::kF32, ss, sc), 128, 128,
                                       HostMView(DType::kF32, s, out), {})
                        .ok());
        DeviceVec<float> dout(w.size());
        KernelOptions ko;
        ko.device = Device::kCuda;
        ASSERT_TRUE(DequantizeFp8Block(dq.view(DType::kF8E4M3, s), ds.view(DType::kF32, ss), 128, 128,
                                       dout.mview(DType::kF32, s), ko)
                        .ok());
        const std::vector<float> dh = dout.ToHost();
        EXPECT_EQ(0, std::memcmp(dh.data(), out.data(), out.size() * 4));
      }
    }
  }
}

TEST_F(Fp8CudaTest, ChannelEqualsTheCpuForBothVariants) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (auto v : {Fp8ChannelVariant::kSlime, Fp8ChannelVariant::kCompressedTensors}) {
      const Shape s{3, 130, 700};
      const std::vector<uint16_t> w = Weights(99, dt, 3 * 130 * 700, 2.0f);
      const bool ct = v == Fp8ChannelVariant::kCompressedTensors;
      const DType sdt = ct ? dt : DType::kF32;
      Fp8ChannelOptions o;
      o.variant = v;
      std::vector<uint8_t> q(w.size());
      std::vector<uint32_t> sc(3 * 130);  // room for either width
      MutableTensorView sv(sdt, {3, 130, 1}, std::as_writable_bytes(std::span(sc)).first(3 * 130 * ItemSize(sdt)));
      ASSERT_TRUE(QuantizeFp8Channel(HostView(dt, s, w), HostMView(DType::kF8E4M3, s, q), sv, o).ok());
      DeviceVec<uint16_t> dw(w);
      DeviceVec<uint8_t> dq(w.size());
      DeviceVec<uint8_t> ds(3 * 130 * ItemSize(sdt));
      o.device = Device::kCuda;
      auto st = QuantizeFp8Channel(dw.view(dt, s), dq.mview(DType::kF8E4M3, s), ds.mview(sdt, {3, 130, 1}), o);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(dq.ToHost(), q);
      const std::vector<uint8_t> got = ds.ToHost();
      EXPECT_EQ(0, std::memcmp(got.data(), sc.data(), got.size()));
    }
  }
}

TEST_F(Fp8CudaTest, NonFiniteIsNamedLikeOnTheCpu) {
  std::vector<uint16_t> w(2 * 300 * 260, F32ToBF16(0.25f));
  w[(1 * 300 + 200) * 260 + 250] = 0x7FC0;
  std::vector<uint8_t> q(w.size());
  std::vector<float> sc(18);
  const absl::Status cpu =
      QuantizeFp8Block(HostView(DType::kBF16, {2, 300, 260}, w), HostMView(DType::kF8E4M3, {2, 300, 260}, q),
                       HostMView(DType::kF32, {2, 3, 3}, sc), {});
  DeviceVec<uint16_t> dw(w);
  DeviceVec<uint8_t> dq(w.size());
  DeviceVec<float> ds(18);
  Fp8BlockOptions o;
  o.device = Device::kCuda;
  const absl::Status gpu =
      QuantizeFp8Block(dw.view(DType::kBF16, {2, 300, 260}), dq.mview(DType::kF8E4M3, {2, 300, 260}),
                       ds.mview(DType::kF32, {2, 3, 3}), o);
  EXPECT_TRUE(absl::IsInvalidArgument(gpu)) << gpu;
  EXPECT_EQ(gpu.message(), cpu.message());
}

}  // namespace
}  // namespace wsync::kernels
