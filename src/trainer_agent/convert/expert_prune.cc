#include "trainer_agent/convert/expert_prune.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync::trainer_agent {

absl::Status PruneExperts(const ModelConfig& model, const model::ExpertMap& map, std::vector<MegatronParam>& plan) {
  RETURN_IF_ERROR(model::CheckExpertMapFits(map, model));
  for (const MegatronParam& p : plan)  // checked before anything changes
    if (p.global_layer >= model.num_hidden_layers)
      return absl::UnimplementedError(
          absl::StrCat(p.global_name,
                       ": expert pruning with MTP layers synced (mtp_num_layers) is not supported: "
                       "the pruned checkpoint declares no MTP layer (num_nextn_predict_layers 0)"));
  for (MegatronParam& p : plan) {
    if (p.global_layer < 0) continue;
    auto kept = map.layers.find(p.global_layer);
    if (kept == map.layers.end()) continue;  // a dense layer (CheckExpertMapFits: every MoE layer is mapped)
    if (p.is_expert) {
      const int64_t compact = map.CompactId(p.global_layer, p.global_expert);
      if (compact < 0) {
        p.pruned = true;
        continue;
      }
      const std::string from = absl::StrCat(".mlp.experts.", p.global_expert, ".");
      const std::string to = absl::StrCat(".mlp.experts.", compact, ".");
      for (std::string& name : p.hf_names) {
        const size_t at = name.find(from);
        if (at == std::string::npos)
          return absl::InternalError(
              absl::StrCat(p.global_name, ": HF name \"", name, "\" does not hold \"", from, "\""));
        name.replace(at, from.size(), to);
      }
    } else if (absl::EndsWith(p.global_name, ".mlp.router.weight") ||
               absl::EndsWith(p.global_name, ".mlp.router.expert_bias")) {
      if (p.hf_op != HfOp::kCopy || p.full_shape.empty() || p.full_shape[0] != map.num_experts)
        return absl::InternalError(absl::StrCat(p.global_name, " is ", ShapeToString(p.full_shape),
                                                ", not one row per ", "each of the map's ", map.num_experts,
                                                " experts"));
      p.kept_rows = kept->second;
    }
  }
  return absl::OkStatus();
}

}  // namespace wsync::trainer_agent
