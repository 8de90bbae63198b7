// CPU FP8 kernels (the reference path): block-wise and per-channel E4M3 quantization and the
// dequantization of kernels/fp8.h, vectorized with Highway (runtime dispatch) and split over
// args.threads std::threads by (expert, row block) or rows. Reached through kernels/fp8.h, which
// validates every argument first. Errors: kInvalidArgument for Inf/NaN in W (the smallest block or
// row named, internal::Fp8NonFiniteError); nothing else for valid arguments.
// Thread-safety: reentrant; concurrent calls must not write overlapping outputs.
#pragma once

#include "absl/status/status.h"
#include "kernels/fp8_args.h"

namespace wsync::kernels::cpu {

absl::Status QuantizeFp8(const internal::Fp8QuantizeArgs& args);
absl::Status DequantizeFp8(const internal::Fp8DequantizeArgs& args);

}  // namespace wsync::kernels::cpu
