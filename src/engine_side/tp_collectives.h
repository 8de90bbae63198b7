// The collectives an engine rank's model may call inside its forward pass, over the engine's own
// TP group (EngineCore provides them; they fail once the group breaks). all_reduce_sum sums the
// span element-wise over all T ranks, in place; all_gather writes the T ranks' `local` spans
// (equal sizes) into `gathered` (T * local.size()) in rank order. Both block until every rank has
// joined. Empty functions with T = 1.
#pragma once

#include <functional>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace wsync::engine_side {

struct TpCollectives {
  std::function<absl::Status(absl::Span<float>)> all_reduce_sum;
  std::function<absl::Status(absl::Span<const float> local, absl::Span<float> gathered)> all_gather;
};

}  // namespace wsync::engine_side
