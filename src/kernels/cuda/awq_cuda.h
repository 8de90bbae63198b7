// CUDA AWQ and TensorRT-LLM INT4 kernels (compiled only with nvcc; reached through kernels/awq.h
// and kernels/trtllm.h via dispatch.cc). Same functions and bit-exact results as
// kernels/cpu/awq_cpu.h, on device pointers. Each call enqueues on args.stream, then synchronizes
// it so that errors surface in the returned status.
// Errors: kInternal with the CUDA error string; kInvalidArgument for a refused AWQ group.
// Thread-safety: reentrant; concurrent calls must not write overlapping outputs.
#pragma once

#include "absl/status/status.h"
#include "kernels/int4_args.h"

namespace wsync::kernels::cuda {

absl::Status QuantizeAwq(const internal::AwqQuantizeArgs& args);
absl::Status AwqToGptq(const internal::AwqRepackArgs& args);
absl::Status GptqToAwq(const internal::AwqRepackArgs& args);
absl::Status AwqToMarlin(const internal::AwqRepackArgs& args);
absl::Status AwqZerosToMarlin(const internal::AwqRepackArgs& args);
absl::Status MarlinZerosToAwq(const internal::AwqRepackArgs& args);
absl::Status Trtllm(const internal::TrtllmArgs& args);
absl::Status TrtllmScales(const internal::TrtllmScaleArgs& args);
absl::Status TrtllmZeros(const internal::TrtllmScaleArgs& args);

}  // namespace wsync::kernels::cuda
