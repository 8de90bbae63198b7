#include "ref_engine/ref_core.h"

#include <utility>

#include "common/status.h"

namespace wsync::ref_engine {
namespace {

class RefModel final : public engine_side::ServedModel {
 public:
  explicit RefModel(EngineModel model) : model_(std::move(model)) {}
  absl::Status Prepare(uint64_t) override { return model_.Prepare(); }
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int max_new_tokens,
                                                const StepHook& before_step) override {
    return model_.Generate(prompt, max_new_tokens, before_step);
  }

 private:
  EngineModel model_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<engine_side::EngineCore>> CreateEngineCore(const ModelConfig& config, EngineRank rank,
                                                                          ParamLookup lookup,
                                                                          engine_side::EngineCoreOptions options,
                                                                          EngineModelOptions model_options) {
  auto make_model = [&](TpCollectives coll) -> absl::StatusOr<std::unique_ptr<engine_side::ServedModel>> {
    ASSIGN_OR_RETURN(EngineModel model,
                     EngineModel::Create(config, rank, std::move(lookup), std::move(coll), model_options));
    return std::make_unique<RefModel>(std::move(model));
  };
  return engine_side::EngineCore::Create(config, rank, make_model, std::move(options));
}

}  // namespace wsync::ref_engine
