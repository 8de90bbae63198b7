#include "kernels/dispatch.h"

#include "absl/strings/str_cat.h"
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

#if WSYNC_WITH_CUDA
absl::Status CudaQuantize(const QuantizeArgs& args) { return cuda::Quantize(args); }
absl::Status CudaGptqToMarlin(const RepackArgs& args) { return cuda::GptqToMarlin(args); }
absl::Status CudaMarlinToGptq(const RepackArgs& args) { return cuda::MarlinToGptq(args); }
absl::Status CudaPermuteScales(const ScalePermArgs& args) { return cuda::PermuteScales(args); }
#else
absl::Status CudaQuantize(const QuantizeArgs&) { return NoCuda("QuantizeInt4"); }
absl::Status CudaGptqToMarlin(const RepackArgs&) { return NoCuda("GptqToMarlin"); }
absl::Status CudaMarlinToGptq(const RepackArgs&) { return NoCuda("MarlinToGptq"); }
absl::Status CudaPermuteScales(const ScalePermArgs&) { return NoCuda("PermuteMarlinScales"); }
#endif

}  // namespace internal
}  // namespace wsync::kernels
