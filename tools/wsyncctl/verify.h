// Verification of what an engine holds: per-parameter XXH3-64 of engine memory (computed by the
// rollout agent), and the same checksums recomputed from a checkpoint (by `wsyncctl verify`): the
// checkpoint's sent tensors are loaded into a fresh staging set and committed into scratch engine
// memory exactly as a sync would, so equal checksums mean bit-identical engine weights.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine_model/engine_layout.h"
#include "engine_model/engine_weights.h"
#include "trainer_agent/convert/hf_convert.h"

namespace wsync::tools {

// name -> XXH3-64 of the buffer's bytes, for every buffer (EngineWeights::Checksums' errors).
absl::StatusOr<std::map<std::string, uint64_t>> ChecksumWeights(const engine_model::EngineWeights& weights);

// The engine weights one rank of `layout` holds after a sync of `sent` (HF names, INT4 triplets):
// Loader + CheckComplete + Commit into fresh memory. Errors as the loader's.
absl::StatusOr<std::unique_ptr<engine_model::OwnedEngineWeights>> ExpectedEngineWeights(
    const engine_model::EngineLayout& layout, const std::vector<model::HfTensor>& sent);

struct VerifyResult {
  size_t params = 0;
  std::vector<std::string> mismatched;  // names whose checksums differ
  std::vector<std::string> missing;     // expected but not reported
  std::vector<std::string> unexpected;  // reported but not expected
  bool ok() const { return mismatched.empty() && missing.empty() && unexpected.empty(); }
};
VerifyResult CompareChecksums(const std::map<std::string, uint64_t>& expected,
                              const std::map<std::string, uint64_t>& actual);

}  // namespace wsync::tools
