// Internal: the device half of kernels/int4.h, awq.h, trtllm.h and fp8.h. Implemented in kernels/dispatch.cc, the one
// file that knows whether the CUDA kernels were compiled in (STYLE.md §1). Arguments are already validated by
// kernels/int4.cc; these pick kernels/cpu/ or kernels/cuda/ by device. Errors: kFailedPrecondition for Device::kCuda
// when CUDA is not compiled in; kInternal on CUDA runtime failures; kInvalidArgument for a bad perm (CUDA: checked on a
// host copy) or Inf/NaN weights. Thread-safety: reentrant.
#pragma once

#include "absl/status/status.h"
#include "kernels/fp8_args.h"
#include "kernels/int4.h"
#include "kernels/int4_args.h"

namespace wsync::kernels::internal {

absl::Status RunQuantize(Device device, const QuantizeArgs& args);
absl::Status RunGptqToMarlin(Device device, const RepackArgs& args);
absl::Status RunMarlinToGptq(Device device, const RepackArgs& args);
absl::Status RunPermuteScales(Device device, const ScalePermArgs& args);
absl::Status RunQuantizeAwq(Device device, const AwqQuantizeArgs& args);
absl::Status RunAwqToGptq(Device device, const AwqRepackArgs& args);
absl::Status RunGptqToAwq(Device device, const AwqRepackArgs& args);
absl::Status RunAwqToMarlin(Device device, const AwqRepackArgs& args);
absl::Status RunAwqZerosToMarlin(Device device, const AwqRepackArgs& args);
absl::Status RunMarlinZerosToAwq(Device device, const AwqRepackArgs& args);
absl::Status RunTrtllm(Device device, const TrtllmArgs& args);
absl::Status RunTrtllmScales(Device device, const TrtllmScaleArgs& args);
absl::Status RunTrtllmZeros(Device device, const TrtllmScaleArgs& args);
absl::Status RunFp8Quantize(Device device, const Fp8QuantizeArgs& args);
absl::Status RunFp8Dequantize(Device device, const Fp8DequantizeArgs& args);

}  // namespace wsync::kernels::internal
