// Internal: validated, device-neutral argument blocks of the FP8 kernels. kernels/fp8.cc builds
// them from TensorViews after checking shapes, dtypes and alignment; kernels/cpu/fp8_cpu.cc and
// kernels/cuda/fp8_kernels.cu consume them without re-checking. Not a public API.
// Thread-safety: plain values; the pointed-to memory follows the callers' contract.
#pragma once

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/format/fp8_format.h"

namespace wsync::kernels::internal {

// Quantize W [E, N, K] (bf16 or fp16 bit patterns) to codes [E, N, K] and scales.
//   block:   scales f32 [E, ceil(N/bn), ceil(K/bk)]
//   channel: scales [E, N, 1], f32 (slime) or W's 16-bit type (compressed-tensors)
struct Fp8QuantizeArgs {
  const uint16_t* w = nullptr;
  bool is_bf16 = true;
  int64_t experts = 1, n = 0, k = 0;
  bool block = true;
  int64_t bn = 128, bk = 128;  // block only
  format::Fp8BlockVariant block_variant = format::Fp8BlockVariant::kSlime;
  format::Fp8ChannelVariant channel_variant = format::Fp8ChannelVariant::kSlime;
  uint8_t* q = nullptr;
  void* scales = nullptr;  // float* or uint16_t* (compressed-tensors channel scales)
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
  // Reuse (CPU; QuantizeReuse in int4.h): with next_digests, each unit's (block's or row's)
  // XXH3-64 of its input is written there, in scale order; with digests too, a unit whose digest is
  // unchanged copies its codes and scale from prev_q / prev_scales (the outputs' layout).
  uint64_t* next_digests = nullptr;
  const uint64_t* digests = nullptr;
  const uint8_t* prev_q = nullptr;
  const void* prev_scales = nullptr;
  int64_t* reused = nullptr;  // out: the units copied (set when next_digests is)
};

// Dequantize codes [E, N, K] with block (f32 [E, ceil(N/bn), ceil(K/bk)]) or channel ([E, N, 1],
// f32 or 16-bit) scales into out [E, N, K] (f32, or bf16 RNE of the f32 product).
struct Fp8DequantizeArgs {
  const uint8_t* q = nullptr;
  const void* scales = nullptr;
  int scale_kind = 0;  // 0: f32, 1: bf16, 2: fp16
  int64_t experts = 1, n = 0, k = 0;
  bool block = true;
  int64_t bn = 128, bk = 128;
  void* out = nullptr;
  bool out_bf16 = false;  // else f32
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
};

// The error for a block (or row) of W holding Inf or NaN; `index` is the smallest such unit:
// block (e * ceil(N/bn) + bi) * ceil(K/bk) + bj, or row e * N + n.
inline absl::Status Fp8NonFiniteError(const Fp8QuantizeArgs& a, int64_t index) {
  if (!a.block)
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeFp8Channel: W holds Inf or NaN in expert ", index / a.n, ", row ", index % a.n));
  const int64_t nb = (a.n + a.bn - 1) / a.bn, kb = (a.k + a.bk - 1) / a.bk;
  const int64_t bj = index % kb, bi = (index / kb) % nb, e = index / kb / nb;
  return absl::InvalidArgumentError(absl::StrCat(
      "QuantizeFp8Block: W holds Inf or NaN in expert ", e, ", block (", bi, ", ", bj, ") (rows ", bi * a.bn, "..",
      std::min(a.n, (bi + 1) * a.bn) - 1, ", columns ", bj * a.bk, "..", std::min(a.k, (bj + 1) * a.bk) - 1, ")"));
}

}  // namespace wsync::kernels::internal
