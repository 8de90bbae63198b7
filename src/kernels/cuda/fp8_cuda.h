// CUDA FP8 kernels (compiled only with nvcc; reached through kernels/fp8.h via dispatch.cc). Same
// functions and bit-exact results as kernels/cpu/fp8_cpu.h, on device pointers; each call enqueues
// on args.stream and synchronizes it. Errors: kInvalidArgument for Inf/NaN in W (the smallest block
// or row, as the CPU names it); kInternal with the CUDA error string.
// Thread-safety: reentrant; concurrent calls must not write overlapping outputs.
#pragma once

#include "absl/status/status.h"
#include "kernels/fp8_args.h"

namespace wsync::kernels::cuda {

absl::Status QuantizeFp8(const internal::Fp8QuantizeArgs& args);
absl::Status DequantizeFp8(const internal::Fp8DequantizeArgs& args);

}  // namespace wsync::kernels::cuda
