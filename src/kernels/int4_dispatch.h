// Internal: the device half of kernels/int4.h. Implemented in kernels/dispatch.cc, the one file
// that knows whether the CUDA kernels were compiled in (STYLE.md §1). Arguments are already
// validated by kernels/int4.cc.
// Errors: kFailedPrecondition when CUDA is not compiled in; kInternal on CUDA runtime failures;
// kInvalidArgument for a bad perm (checked on a host copy).
// Thread-safety: reentrant.
#pragma once

#include "absl/status/status.h"
#include "kernels/int4_args.h"

namespace wsync::kernels::internal {

absl::Status CudaQuantize(const QuantizeArgs& args);
absl::Status CudaGptqToMarlin(const RepackArgs& args);
absl::Status CudaMarlinToGptq(const RepackArgs& args);
absl::Status CudaPermuteScales(const ScalePermArgs& args);

}  // namespace wsync::kernels::internal
