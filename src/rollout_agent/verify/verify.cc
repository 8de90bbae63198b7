#include "rollout_agent/verify/verify.h"

#include "common/checksum.h"
#include "common/status.h"
#include "rollout_agent/load/loader.h"
#include "rollout_agent/repack/repack.h"

namespace wsync::rollout {

std::map<std::string, uint64_t> ChecksumWeights(const EngineWeights& weights) {
  std::map<std::string, uint64_t> out;
  for (const auto& b : weights.buffers()) {
    out[b.name] = Xxh3_64({static_cast<const std::byte*>(b.data), b.nbytes});
  }
  return out;
}

absl::StatusOr<std::unique_ptr<OwnedEngineWeights>> ExpectedEngineWeights(const EngineLayout& layout,
                                                                          const std::vector<convert::HfTensor>& sent) {
  ASSIGN_OR_RETURN(auto staging, Staging::Create(layout));
  Loader loader(staging.get());
  for (const auto& t : sent) RETURN_IF_ERROR(loader.Load(t.name, t.view));
  RETURN_IF_ERROR(loader.CheckComplete());
  ASSIGN_OR_RETURN(auto engine, OwnedEngineWeights::Allocate(layout));
  RETURN_IF_ERROR(Commit(*staging, engine->weights()));
  return engine;
}

VerifyResult CompareChecksums(const std::map<std::string, uint64_t>& expected,
                              const std::map<std::string, uint64_t>& actual) {
  VerifyResult r;
  r.params = expected.size();
  for (const auto& [name, sum] : expected) {
    auto it = actual.find(name);
    if (it == actual.end()) r.missing.push_back(name);
    else if (it->second != sum) r.mismatched.push_back(name);
  }
  for (const auto& [name, sum] : actual) {
    if (!expected.count(name)) r.unexpected.push_back(name);
  }
  return r;
}

}  // namespace wsync::rollout
