// Internal to the independent verifier (reference.h): FP8 E4M3 quantization of a checkpoint weight
// written from docs/spec/FP8.md alone, sharing no code with src/kernels. The E4M3FN code of a value
// is found by its definition (§1): the nearest of the 126 finite positive codes' values, ties to the
// code with an even mantissa; the scales follow §2.1 (slime, the default), §2.3 (ue8m0, when the
// config says scale_fmt "ue8m0") and §3.1 (per channel, slime), the variants a sync sends (§6).
// Errors: kInvalidArgument for a weight that is not a 2-D bf16 / fp16 tensor or holds NaN / Inf.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/tensor.h"

namespace wsync::tools::reference {

// The E4M3FN code nearest to x (|x| < 464 rounds to a finite code, RNE; larger gives NaN 0x7F/0xFF).
uint8_t E4m3CodeOf(float x);
// The value of an E4M3FN code (NaN for 0x7F / 0xFF).
float E4m3ValueOf(uint8_t code);

// W [N, K] -> codes [N, K] and F32 scales: block (bn, bk > 0): [ceil(N/bn), ceil(K/bk)], the
// multiplier of each block (weight_scale_inv); per channel (bn == 0): [N, 1].
absl::Status QuantizeFp8Scalar(const TensorView& w, int64_t bn, int64_t bk, bool ue8m0, std::vector<uint8_t>* codes,
                               std::vector<float>* scales);

}  // namespace wsync::tools::reference
