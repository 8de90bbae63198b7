// Expert pruning during a sync (seed 003; docs/expert-pruning.md): which routed experts of each
// MoE layer the engines keep, and in which order. The trainer's model keeps all E experts; the
// engines serve a model with K <= E experts per MoE layer, expert k of layer L being original
// expert layers[L][k]. The trainer agent converts, quantizes and sends only kept experts (renamed
// to their compact ids) and slices the router to match (trainer_agent/convert/expert_prune.h);
// the engines register the pruned config (PrunedConfigJson). PruneHfCheckpoint is the oracle: the
// pruned model's HF checkpoint, written from the original one without any of the sync's code.
//
// The map file (JSON; every MoE decoder layer listed, every list the same length K):
//   {"num_experts": 8, "layers": {"1": [5, 0, 3, 6], "2": [1, 2, 4, 7]}}
// The pruned model has no group-limited routing (n_group = topk_group = 1: the original groups do
// not survive pruning) and no MTP layers (a sync never delivers them and the map does not cover
// them).
//
// Errors: kInvalidArgument naming the source and the field / layer / expert and the values;
// kNotFound for a missing map file; PruneHfCheckpoint: kInvalidArgument naming a checkpoint tensor
// whose shape the map does not fit.
// Thread-safety: plain values; const methods are safe to call concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "model/hf_checkpoint.h"

namespace wsync::model {

struct ExpertMap {
  int64_t num_experts = 0;                         // E: routed experts of the trainer's model
  std::map<int64_t, std::vector<int64_t>> layers;  // global layer -> kept original ids (position = compact id)

  // K: experts kept per layer (every layer keeps as many).
  int64_t kept() const { return layers.empty() ? 0 : static_cast<int64_t>(layers.begin()->second.size()); }
  // The compact id of original expert `expert` of `layer`; -1 when it is pruned (or the layer is
  // not in the map).
  int64_t CompactId(int64_t layer, int64_t expert) const;
  // One line of JSON, layers in order: the ranks' fingerprint and the logs.
  std::string Canonical() const;
};

// Parses a map file's text; `source` names it in errors. Checks its own consistency: E > 0, at least
// one layer, layer keys decimal integers >= 0, every list non-empty, of ids in [0, E) without
// repeats, and all of one length. Unknown fields are refused (a typo would silently keep experts).
absl::StatusOr<ExpertMap> ParseExpertMap(absl::string_view json_text, absl::string_view source);
absl::StatusOr<ExpertMap> LoadExpertMap(const std::string& path);

// Whether `map` fits the trainer's (unpruned) `model`: a MoE model with E routed experts, the map's
// layers exactly its MoE decoder layers, and K >= num_experts_per_tok.
absl::Status CheckExpertMapFits(const ExpertMap& map, const ModelConfig& model);

// The pruned model's config.json from the original text: the routed-expert count (num_experts /
// n_routed_experts) set to K, n_group and topk_group set to 1, num_nextn_predict_layers to 0; every
// other field as it was. The result parses (ParseModelConfig) or this fails.
absl::StatusOr<std::string> PrunedConfigJson(absl::string_view config_json, const ExpertMap& map,
                                             absl::string_view source);

// The pruned model's checkpoint from the original model's (`model` its config; CheckExpertMapFits
// must hold): kept experts under their compact ids, pruned ones dropped, the router rows
// (mlp.gate.weight) and e_score_correction_bias entries picked in map order, MTP layers dropped,
// every other tensor copied as is.
absl::StatusOr<HfCheckpoint> PruneHfCheckpoint(const ModelConfig& model, const ExpertMap& map, const HfCheckpoint& hf);

}  // namespace wsync::model
