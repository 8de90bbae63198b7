#include "tools/wsyncctl/verify.h"

#include "common/status.h"
#include "engine_model/loader.h"
#include "engine_model/repack.h"

namespace wsync::tools {

absl::StatusOr<std::map<std::string, uint64_t>> ChecksumWeights(const engine_model::EngineWeights& weights) {
  std::map<std::string, uint64_t> out;
  ASSIGN_OR_RETURN(const std::vector<uint64_t> sums, weights.Checksums());
  for (size_t i = 0; i < sums.size(); ++i) out[weights.buffers()[i].name] = sums[i];
  return out;
}

absl::StatusOr<std::unique_ptr<engine_model::OwnedEngineWeights>> ExpectedEngineWeights(
    const engine_model::EngineLayout& layout, const std::vector<model::HfTensor>& sent) {
  ASSIGN_OR_RETURN(auto staging, engine_model::Staging::Create(layout));
  engine_model::Loader loader(staging.get());
  for (const auto& t : sent) RETURN_IF_ERROR(loader.Load(t.name, t.view));
  RETURN_IF_ERROR(loader.CheckComplete());
  ASSIGN_OR_RETURN(auto engine, engine_model::OwnedEngineWeights::Allocate(layout));
  RETURN_IF_ERROR(engine_model::Commit(*staging, engine->weights()));
  return engine;
}

VerifyResult CompareChecksums(const std::map<std::string, uint64_t>& expected,
                              const std::map<std::string, uint64_t>& actual) {
  VerifyResult r;
  r.params = expected.size();
  for (const auto& [name, sum] : expected) {
    auto it = actual.find(name);
    if (it == actual.end())
      r.missing.push_back(name);
    else if (it->second != sum)
      r.mismatched.push_back(name);
  }
  for (const auto& [name, sum] : actual) {
    if (!expected.count(name)) r.unexpected.push_back(name);
  }
  return r;
}

}  // namespace wsync::tools
