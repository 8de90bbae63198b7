#include "kernels/dispatch.h"

#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/checksum.h"
#include "kernels/cpu/awq_cpu.h"
#include "kernels/cpu/fp8_cpu.h"
#include "kernels/cpu/int4_cpu.h"
#include "kernels/int4_dispatch.h"
#include "kernels/transpose.h"

#if WSYNC_WITH_CUDA
#include "kernels/cuda/awq_cuda.h"
#include "kernels/cuda/checksum_cuda.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/fp8_cuda.h"
#include "kernels/cuda/int4_cuda.h"
#include "kernels/cuda/transpose_cuda.h"
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

absl::StatusOr<uint64_t> Sum64(const MemorySpace& space, const void* data, size_t nbytes, void* device_word) {
  if (space.host()) return Sum64Host({static_cast<const std::byte*>(data), nbytes});
#if WSYNC_WITH_CUDA
  return cuda::Sum64(space.cuda_device(), data, nbytes, device_word);
#else
  (void)device_word;
  return absl::FailedPreconditionError(
      absl::StrCat("Sum64 of ", nbytes, " bytes in ", space.Name(), ": this binary was built without CUDA"));
#endif
}

absl::Status TransposeBlock(const MemorySpace& space, const TransposeArgs& a) {
  if (space.host())
    return absl::InvalidArgumentError("TransposeBlock: host memory (the host's transposes are the loader's own)");
  if (a.item != 1 && a.item != 2 && a.item != 4 && a.item != 8)
    return absl::InvalidArgumentError(absl::StrCat("TransposeBlock: elements of ", a.item, " bytes"));
  if (a.rows < 0 || a.cols < 0 || a.r0 < 0 || a.c0 < 0 || a.dr < 0 || a.dc < 0 || a.src_ld < a.c0 + a.cols ||
      a.dst_ld < a.dc + a.rows || ((a.rows > 0 && a.cols > 0) && (a.src == nullptr || a.dst == nullptr)))
    return absl::InvalidArgumentError(absl::StrCat("TransposeBlock: a block of ", a.rows, " x ", a.cols, " at (", a.r0,
                                                   ", ", a.c0, ") of rows of ", a.src_ld, " into (", a.dr, ", ", a.dc,
                                                   ") of rows of ", a.dst_ld));
#if WSYNC_WITH_CUDA
  return cuda::TransposeBlock(space.cuda_device(), a);
#else
  return absl::FailedPreconditionError(
      absl::StrCat("TransposeBlock in ", space.Name(), ": this binary was built without CUDA"));
#endif
}

namespace internal {
namespace {

// The CUDA entry point of a kernel, or nullptr when this binary has no CUDA.
#if WSYNC_WITH_CUDA
#define WSYNC_CUDA_ENTRY(fn) (&cuda::fn)
#else
#define WSYNC_CUDA_ENTRY(fn) nullptr
#endif

template <typename Args>
absl::Status Run(Device device, const Args& args, absl::Status (*on_cpu)(const Args&),
                 std::type_identity_t<absl::Status (*)(const Args&)> on_cuda, absl::string_view what) {
  if (device == Device::kCpu) return on_cpu(args);
  if (on_cuda == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": Device::kCuda requested but this binary was built without CUDA"));
  return on_cuda(args);
}

}  // namespace

absl::Status RunFp8Quantize(Device device, const Fp8QuantizeArgs& args) {
  return Run(device, args, &cpu::QuantizeFp8, WSYNC_CUDA_ENTRY(QuantizeFp8),
             args.block ? "QuantizeFp8Block" : "QuantizeFp8Channel");
}
absl::Status RunFp8Dequantize(Device device, const Fp8DequantizeArgs& args) {
  return Run(device, args, &cpu::DequantizeFp8, WSYNC_CUDA_ENTRY(DequantizeFp8), "DequantizeFp8");
}
absl::Status RunQuantize(Device device, const QuantizeArgs& args) {
  return Run(device, args, &cpu::Quantize, WSYNC_CUDA_ENTRY(Quantize), "QuantizeInt4");
}
absl::Status RunGptqToMarlin(Device device, const RepackArgs& args) {
  return Run(device, args, &cpu::GptqToMarlin, WSYNC_CUDA_ENTRY(GptqToMarlin), "GptqToMarlin");
}
absl::Status RunMarlinToGptq(Device device, const RepackArgs& args) {
  return Run(device, args, &cpu::MarlinToGptq, WSYNC_CUDA_ENTRY(MarlinToGptq), "MarlinToGptq");
}
absl::Status RunPermuteScales(Device device, const ScalePermArgs& args) {
  return Run(device, args, &cpu::PermuteScales, WSYNC_CUDA_ENTRY(PermuteScales), "PermuteMarlinScales");
}
absl::Status RunQuantizeAwq(Device device, const AwqQuantizeArgs& args) {
  return Run(device, args, &cpu::QuantizeAwq, WSYNC_CUDA_ENTRY(QuantizeAwq), "QuantizeAwq");
}
absl::Status RunAwqToGptq(Device device, const AwqRepackArgs& args) {
  return Run(device, args, &cpu::AwqToGptq, WSYNC_CUDA_ENTRY(AwqToGptq), "AwqToGptq");
}
absl::Status RunGptqToAwq(Device device, const AwqRepackArgs& args) {
  return Run(device, args, &cpu::GptqToAwq, WSYNC_CUDA_ENTRY(GptqToAwq), "GptqToAwq");
}
absl::Status RunAwqToMarlin(Device device, const AwqRepackArgs& args) {
  return Run(device, args, &cpu::AwqToMarlin, WSYNC_CUDA_ENTRY(AwqToMarlin), "AwqToMarlin");
}
absl::Status RunAwqZerosToMarlin(Device device, const AwqRepackArgs& args) {
  return Run(device, args, &cpu::AwqZerosToMarlin, WSYNC_CUDA_ENTRY(AwqZerosToMarlin), "AwqZerosToMarlin");
}
absl::Status RunMarlinZerosToAwq(Device device, const AwqRepackArgs& args) {
  return Run(device, args, &cpu::MarlinZerosToAwq, WSYNC_CUDA_ENTRY(MarlinZerosToAwq), "MarlinZerosToAwq");
}
absl::Status RunTrtllm(Device device, const TrtllmArgs& args) {
  return Run(device, args, &cpu::Trtllm, WSYNC_CUDA_ENTRY(Trtllm), "PreprocessTrtllm");
}
absl::Status RunTrtllmScales(Device device, const TrtllmScaleArgs& args) {
  return Run(device, args, &cpu::TrtllmScales, WSYNC_CUDA_ENTRY(TrtllmScales), "TrtllmScales");
}
absl::Status RunTrtllmZeros(Device device, const TrtllmScaleArgs& args) {
  return Run(device, args, &cpu::TrtllmZeros, WSYNC_CUDA_ENTRY(TrtllmZeros), "TrtllmZerosFromAwq");
}

}  // namespace internal
}  // namespace wsync::kernels
