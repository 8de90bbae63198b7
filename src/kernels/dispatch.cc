#include "kernels/dispatch.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/int4_cpu.h"
#include "kernels/int4_dispatch.h"

#if WSYNC_WITH_CUDA
#include "kernels/cuda/device.h"
#include "kernels/cuda/int4_cuda.h"
#endif

namespace wsync::kernels {

bool CudaCompiledIn() { return WSYNC_WITH_CUDA != 0; }

absl::StatusOr<int> CudaDeviceCount() {
#if WSYNC_WITH_CUDA
  return cuda::DeviceCount();
#else
  return 0;
#endif
}

bool GpuAvailable() {
  auto n = CudaDeviceCount();
  return n.ok() && *n > 0;
}

namespace internal {
namespace {

[[maybe_unused]] absl::Status NoCuda(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": Device::kCuda requested but this binary was built without CUDA"));
}

}  // namespace

absl::Status RunQuantize(Device device, const QuantizeArgs& args) {
  if (device == Device::kCpu) return cpu::Quantize(args);
#if WSYNC_WITH_CUDA
  return cuda::Quantize(args);
#else
  return NoCuda("QuantizeInt4");
#endif
}

absl::Status RunGptqToMarlin(Device device, const RepackArgs& args) {
  if (device == Device::kCpu) return cpu::GptqToMarlin(args);
#if WSYNC_WITH_CUDA
  return cuda::GptqToMarlin(args);
#else
  return NoCuda("GptqToMarlin");
#endif
}

absl::Status RunMarlinToGptq(Device device, const RepackArgs& args) {
  if (device == Device::kCpu) return cpu::MarlinToGptq(args);
#if WSYNC_WITH_CUDA
  return cuda::MarlinToGptq(args);
#else
  return NoCuda("MarlinToGptq");
#endif
}

absl::Status RunPermuteScales(Device device, const ScalePermArgs& args) {
  if (device == Device::kCpu) return cpu::PermuteScales(args);
#if WSYNC_WITH_CUDA
  return cuda::PermuteScales(args);
#else
  return NoCuda("PermuteMarlinScales");
#endif
}

}  // namespace internal
}  // namespace wsync::kernels
