// CPU INT4 kernels (the reference path): fused quantize+pack, GPTQ <-> Marlin repack, Marlin
// scale permutation. Vectorized with Highway (runtime dispatch to the best x86 target) and split
// over `args.threads` std::threads by rows / k-tiles. Reached through kernels/int4.h, which
// validates every argument first; these functions trust their (already checked) arguments.
// Thread-safety: reentrant; concurrent calls must not write overlapping outputs.
#pragma once

#include "absl/status/status.h"
#include "kernels/int4_args.h"

namespace wsync::kernels::cpu {

// FORMATS.md §1 + §2/§3: writes args.packed and args.scales. Always OK for valid arguments.
absl::Status Quantize(const internal::QuantizeArgs& args);
// FORMATS.md §4 (+ §4.3 perm, §6 per expert): GPTQ [E, K/8, N] -> Marlin [E, K/16, 2N].
absl::Status GptqToMarlin(const internal::RepackArgs& args);
// Exact inverse of GptqToMarlin (with the same perm).
absl::Status MarlinToGptq(const internal::RepackArgs& args);
// FORMATS.md §5 (and its inverse when args.inverse), per expert.
absl::Status PermuteScales(const internal::ScalePermArgs& args);

// Name of the SIMD target Highway picked on this machine ("AVX3", "AVX2", ...), for benchmarks.
const char* SimdTargetName();

}  // namespace wsync::kernels::cpu
