// wsync-inspect --delta-from BASE NEW: what a delta sync would send between two versions of the
// engine-form tensors (two recordings of a rollout agent's --record-dir, DIR/v<N>, or two HF
// checkpoint directories): per class of tensor, the elements that changed and the bytes of the
// delta (kernels/delta.h PlanDelta: the smallest encoding per tensor) against the full bytes.
//
// Classes, by name and dtype: "bf16" (every float tensor not below), "int4 words" (an INT4
// `weight_packed` int32 word: 8 codes; its "codes" row counts the 4-bit codes that changed),
// "int4 scales" (`weight_scale` beside a `weight_packed`), "fp8" (F8_E4M3 tensors), "fp8 scales"
// (`weight_scale_inv`), "other" (weight_shape and any integer tensor).
// Errors (kInvalidArgument, naming the tensor): a tensor whose dtype or shape differs between the
// two versions; one present in only one of them. The directories' own errors (HfCheckpoint::Open).
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace wsync::tools {

struct DeltaClassStats {
  uint64_t tensors = 0, items = 0, changed_items = 0;
  uint64_t codes = 0, changed_codes = 0;  // int4 words only: their 4-bit codes
  uint64_t full_bytes = 0, delta_bytes = 0;
};

// Class name -> figures, plus "total".
absl::StatusOr<std::map<std::string, DeltaClassStats>> DeltaStatsBetween(const std::string& base_dir,
                                                                         const std::string& next_dir);

// Prints the table (or JSON) of DeltaStatsBetween; returns the exit code (0, or 1 with the error on stderr).
int PrintDeltaStats(const std::string& base_dir, const std::string& next_dir, bool json);

}  // namespace wsync::tools
