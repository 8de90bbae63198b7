// Internal: validated, device-neutral argument blocks of the INT4 kernels. kernels/int4.cc builds
// them from TensorViews after checking shapes, dtypes and alignment; kernels/cpu/ and
// kernels/cuda/ consume them without re-checking. Not a public API.
// Thread-safety: plain values; the pointed-to memory follows the callers' contract.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/format/int4_format.h"

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

}  // namespace wsync::kernels::internal
