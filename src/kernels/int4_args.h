// Internal: validated, device-neutral argument blocks of the INT4 kernels. kernels/int4.cc builds
// them from TensorViews after checking shapes, dtypes and alignment; kernels/cpu/ and
// kernels/cuda/ consume them without re-checking. Not a public API.
// Thread-safety: plain values; the pointed-to memory follows the callers' contract.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/format/awq_format.h"
#include "kernels/format/int4_format.h"
#include "kernels/format/trtllm_format.h"

namespace wsync::kernels::internal {

enum class Layout : int { kCompressedTensors = 0, kGptq = 1 };

struct QuantizeArgs {
  const uint16_t* w = nullptr;  // [E, N, K] bf16 or fp16 bit patterns
  bool is_bf16 = true;          // else fp16
  int64_t experts = 1, n = 0, k = 0;
  int64_t group = 0;  // resolved group size (K for channelwise)
  format::Variant variant = format::Variant::kQat;
  Layout layout = Layout::kCompressedTensors;
  uint32_t* packed = nullptr;        // CT [E, N, K/8] or GPTQ [E, K/8, N]
  uint16_t* scales = nullptr;        // CT [E, N, K/G] or GPTQ [E, K/G, N], same dtype as w
  int threads = 1;                   // CPU only
  int64_t min_bytes_per_thread = 0;  // CPU: fewer threads for small inputs (0 = use `threads` as is)
  void* stream = nullptr;            // CUDA only (cudaStream_t)
  // Reuse (CPU, compressed-tensors only; QuantizeReuse in int4.h): with next_digests, each group's
  // XXH3-64 of its input is written there, [E, N, K/G]; with digests too, a group whose digest is
  // unchanged copies its words and scale from prev_packed / prev_scales (the outputs' layout).
  uint64_t* next_digests = nullptr;
  const uint64_t* digests = nullptr;
  const uint32_t* prev_packed = nullptr;
  const uint16_t* prev_scales = nullptr;
  int64_t* reused_groups = nullptr;  // out: the groups copied (set when next_digests is)
};

struct RepackArgs {
  const uint32_t* in = nullptr;  // GPTQ [E, K/8, N] (repack) or Marlin [E, K/16, 2N] (restore)
  uint32_t* out = nullptr;
  const int32_t* perm = nullptr;  // [E, K] permutation of 0..K-1, or nullptr
  int64_t experts = 1, k = 0, n = 0;
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
};

struct ScalePermArgs {
  const uint16_t* in = nullptr;  // [E, rows, N] 16-bit scales
  uint16_t* out = nullptr;
  int64_t experts = 1, rows = 0, n = 0;
  bool channelwise = false;  // scale_perm_single (G == -1 or G == K) instead of scale_perm
  bool inverse = false;
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
};

// The error for a group holding Inf or NaN; `index` = (e * N + n) * (K / G) + g, the smallest found.
inline absl::Status NonFiniteError(const QuantizeArgs& a, int64_t index) {
  const int64_t ng = a.k / a.group, g = index % ng, row = index / ng;
  return absl::InvalidArgumentError(absl::StrCat("QuantizeInt4: W holds Inf or NaN in expert ", row / a.n, ", row ",
                                                 row % a.n, ", group ", g, " (columns ", g * a.group, "..",
                                                 (g + 1) * a.group - 1, "); refusing to quantize non-finite weights"));
}

// Checks that every row of a host-resident perm [experts, k] is a permutation of 0..k-1.
// kInvalidArgument naming the first bad expert/position/value.
inline absl::Status ValidatePerm(const int32_t* perm, int64_t experts, int64_t k) {
  std::vector<uint8_t> seen(static_cast<size_t>(k));
  for (int64_t e = 0; e < experts; ++e) {
    std::fill(seen.begin(), seen.end(), uint8_t{0});
    for (int64_t i = 0; i < k; ++i) {
      const int32_t p = perm[e * k + i];
      if (p < 0 || p >= k) {
        return absl::InvalidArgumentError(
            absl::StrCat("perm[", e, ", ", i, "] = ", p, " is out of range [0, ", k, ")"));
      }
      if (seen[static_cast<size_t>(p)]++ != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("perm[", e, ", ", i, "] = ", p, " repeats a value: not a permutation of 0..", k - 1));
      }
    }
  }
  return absl::OkStatus();
}

// ---- AWQ (kernels/awq.h) -------------------------------------------------------------------------

struct AwqQuantizeArgs {
  const uint16_t* w = nullptr;  // [E, N, K] bf16 or fp16 bit patterns
  bool is_bf16 = true;
  int64_t experts = 1, n = 0, k = 0;
  int64_t group = 0;  // resolved group size (K for channelwise)
  format::AwqArith arith = format::AwqArith::kFp16;
  uint32_t* qweight = nullptr;  // [E, K, N/8]
  uint32_t* qzeros = nullptr;   // [E, K/G, N/8]
  uint16_t* scales = nullptr;   // [E, K/G, N], same dtype as w
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
  // Reuse (CPU; QuantizeReuse in int4.h): with next_digests, each unit's (8 rows' group, one
  // qzeros word) XXH3-64 of its input is written there, [E, K/G, N/8]; with digests too, a unit
  // whose digest is unchanged copies its words, zero word and scales from the prev_* arrays.
  uint64_t* next_digests = nullptr;
  const uint64_t* digests = nullptr;
  const uint32_t* prev_qweight = nullptr;
  const uint32_t* prev_qzeros = nullptr;
  const uint16_t* prev_scales = nullptr;
  int64_t* reused = nullptr;  // out: the units copied (set when next_digests is)
};

// Why a group was refused; the kernels report min(index * 2 + reason) over all groups.
enum class AwqRefusal : int { kNonFinite = 0, kF16Range = 1 };

// The error for the smallest refused group; `code` = ((e * N + n) * (K / G) + g) * 2 + reason.
inline absl::Status AwqRefusedError(const AwqQuantizeArgs& a, int64_t code) {
  const int64_t index = code / 2, ng = a.k / a.group, g = index % ng, row = index / ng;
  const std::string where = absl::StrCat("expert ", row / a.n, ", row ", row % a.n, ", group ", g, " (columns ",
                                         g * a.group, "..", (g + 1) * a.group - 1, ")");
  if (code % 2 == static_cast<int>(AwqRefusal::kNonFinite)) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeAwq: W holds Inf or NaN in ", where, "; refusing to quantize non-finite weights"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("QuantizeAwq: the fp16 arithmetic cannot hold ", where,
                   ": a value or max - min is at least 65520, which fp16 rounds to Inf (use the fp32 arithmetic)"));
}

// AwqToGptq / GptqToAwq / AwqToMarlin / zero points: `rows` is K (qweight) or K/G (qzeros).
struct AwqRepackArgs {
  const uint32_t* in = nullptr;
  uint32_t* out = nullptr;
  int64_t experts = 1, rows = 0, n = 0;
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
};

// ---- TensorRT-LLM (kernels/trtllm.h) -------------------------------------------------------------

struct TrtllmArgs {
  uint32_t* codes = nullptr;  // GPTQ orientation [E, K/8, N] (read by preprocess, written by the inverse)
  uint32_t* bytes = nullptr;  // the preprocessed weight as [E, K*N/8] words
  int64_t experts = 1, k = 0, n = 0;
  format::TrtllmLayout layout = format::TrtllmLayout::kSm80W4A16;
  bool inverse = false;
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
};

enum class TrtllmScaleMode : int { kCopy = 0, kToF16 = 1, kToBf16Interleaved = 2 };

struct TrtllmScaleArgs {
  const uint16_t* in = nullptr;  // [E, rows, N] 16-bit scales
  bool in_bf16 = true;
  uint16_t* out = nullptr;  // kCopy/kToF16: [E, rows, N]; kToBf16Interleaved: [E, rows/I, N*I]
  int64_t experts = 1, rows = 0, n = 0;
  TrtllmScaleMode mode = TrtllmScaleMode::kCopy;
  int interleave = 1;
  const uint32_t* qzeros = nullptr;  // zeros mode (TrtllmZerosFromAwq): AWQ qzeros [E, rows, N/8]
  int threads = 1;
  int64_t min_bytes_per_thread = 0;
  void* stream = nullptr;
};

}  // namespace wsync::kernels::internal
