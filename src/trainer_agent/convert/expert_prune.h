// Expert pruning in the trainer's plans (model/expert_map.h, docs/expert-pruning.md): a rank's plan
// (PlanRank / PlanFullModel) rewritten so that a sync delivers the pruned model. Each routed
// expert's parameter of a mapped layer either keeps its place under the compact id (its HF names
// renamed: model.layers.L.mlp.experts.<compact>.*) or is marked pruned (MegatronParam::pruned: never
// converted, quantized or sent); each router weight / expert_bias gets its kept rows in map order
// (MegatronParam::kept_rows). Megatron names, shapes and the gathers are unchanged.
//
// Errors: CheckExpertMapFits's kInvalidArgument for a map that does not fit `model`; kInternal for a
// plan whose expert or router parameters are not what the map describes (names, row counts).
// Thread-safety: a pure function over values.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "common/config.h"
#include "model/expert_map.h"
#include "trainer_agent/convert/megatron_param.h"

namespace wsync::trainer_agent {

absl::Status PruneExperts(const ModelConfig& model, const model::ExpertMap& map, std::vector<MegatronParam>& plan);

}  // namespace wsync::trainer_agent
