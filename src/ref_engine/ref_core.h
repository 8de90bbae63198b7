// The reference engine's rank: an engine_side::EngineCore serving the reference EngineModel
// (model.h) over the parameter memory `lookup` reads, T ranks in lockstep over the core's TP
// collectives.
//
// Errors: EngineModel::Create's (the geometry, ENGINE_LAYOUT.md §6) pass through.
// Ownership: the memory behind `lookup` must outlive the core.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "engine_side/core.h"
#include "ref_engine/model.h"

namespace wsync::ref_engine {

// `model_options` is the reference model's own (EngineModel::Prepare's threads); `options` the
// core's, as for any served model.
absl::StatusOr<std::unique_ptr<engine_side::EngineCore>> CreateEngineCore(const ModelConfig& config, EngineRank rank,
                                                                          ParamLookup lookup,
                                                                          engine_side::EngineCoreOptions options,
                                                                          EngineModelOptions model_options = {});

}  // namespace wsync::ref_engine
