#include "kernels/dispatch.h"

#include <gtest/gtest.h>

namespace wsync::kernels {
namespace {

TEST(DispatchTest, DeviceCountNeverFailsOnMissingGpu) {
  auto n = CudaDeviceCount();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_GE(*n, 0);
  if (!CudaCompiledIn()) {
    EXPECT_EQ(*n, 0);
  }
  EXPECT_EQ(GpuAvailable(), *n > 0);
}

TEST(DispatchTest, GpuPresentWhenReported) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA device on this machine";
  EXPECT_TRUE(CudaCompiledIn());
}

}  // namespace
}  // namespace wsync::kernels
