// CUDA INT4 kernels (compiled only with nvcc; reached through kernels/int4.h via dispatch.cc).
// Same functions and bit-exact results as kernels/cpu/int4_cpu.h, on device pointers. Each call
// enqueues on args.stream, then synchronizes it so that errors surface in the returned status.
// Errors: kInternal with the CUDA error string; kInvalidArgument for a bad perm (checked on a host
// copy). Thread-safety: reentrant; concurrent calls must not write overlapping outputs.
#pragma once

#include "absl/status/status.h"
#include "kernels/int4_args.h"

namespace wsync::kernels::cuda {

absl::Status Quantize(const internal::QuantizeArgs& args);
absl::Status GptqToMarlin(const internal::RepackArgs& args);
absl::Status MarlinToGptq(const internal::RepackArgs& args);
absl::Status PermuteScales(const internal::ScalePermArgs& args);

}  // namespace wsync::kernels::cuda
