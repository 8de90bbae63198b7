#include "plan/delivery_plan.h"

#include <algorithm>
#include <numeric>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/tensor.h"

namespace wsync::plan {

using engine_model::EngineLayout;
using engine_model::EngineParallel;
using engine_model::HfSource;

absl::StatusOr<Delivery> ParseDelivery(absl::string_view name) {
  if (name == "broadcast") return Delivery::kBroadcast;
  if (name == "sharded") return Delivery::kSharded;
  return absl::InvalidArgumentError(absl::StrCat("unknown delivery \"", name, "\" (broadcast or sharded)"));
}

absl::string_view DeliveryName(Delivery d) { return d == Delivery::kSharded ? "sharded" : "broadcast"; }

Grouping GroupReceivers(std::span<const EngineParallel> agents) {
  auto key = [](const EngineParallel& p) {
    return std::make_tuple(p.tp_size, std::max(p.ep_size, 1), p.tp_rank, p.mtp_draft);
  };
  std::vector<int> order(agents.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(agents[a]) < key(agents[b]); });
  Grouping g;
  g.group_of.assign(agents.size(), -1);
  g.rank_in_group.assign(agents.size(), -1);
  for (int a : order) {
    if (g.groups.empty() || key(g.groups.back()) != key(agents[a])) {
      EngineParallel p = agents[a];
      p.ep_size = std::max(p.ep_size, 1);
      g.groups.push_back(p);
      g.members.emplace_back();
    }
    g.group_of[a] = static_cast<int>(g.groups.size()) - 1;
    g.members.back().push_back(a);
  }
  // Positions in agent order, so that a group's ranks follow the agents' ranks.
  for (auto& m : g.members) {
    std::sort(m.begin(), m.end());
    for (size_t i = 0; i < m.size(); ++i) g.rank_in_group[m[i]] = static_cast<int>(i);
  }
  return g;
}

absl::StatusOr<ShardPlan> ShardPlan::Create(const ModelConfig& config, const QuantizationConfig* quantization,
                                            std::span<const EngineParallel> groups) {
  ShardPlan plan;
  for (const EngineParallel& p : groups) {
    auto layout = EngineLayout::Create(config, quantization, p);
    if (!layout.ok()) {
      return Annotate(layout.status(), absl::StrCat("the engine layout of TP rank ", p.tp_rank, " of ", p.tp_size,
                                                    " (EP ", p.ep_size, p.mtp_draft ? ", NextN draft" : "", ")"));
    }
    plan.layouts_.push_back(std::make_unique<EngineLayout>(std::move(*layout)));
  }
  return plan;
}

absl::StatusOr<std::optional<Block>> ShardPlan::BlockFor(int group, absl::string_view hf_name, DType dtype,
                                                         std::span<const int64_t> shape) const {
  const EngineLayout& layout = *layouts_[static_cast<size_t>(group)];
  const int idx = layout.FindSource(hf_name);
  if (idx < 0) {
    if (layout.IsIgnoredHfName(hf_name)) return std::nullopt;
    return absl::InvalidArgumentError(absl::StrCat("sharded delivery: ", hf_name, " (", SafetensorsName(dtype),
                                                   ShapeToString(shape), ") is not part of the engine layout"));
  }
  const HfSource& s = layout.sources()[static_cast<size_t>(idx)];
  const bool dtype_ok = dtype == s.dtype || (s.dtype == DType::kI64 && dtype == DType::kI32);
  if (!dtype_ok || !std::equal(shape.begin(), shape.end(), s.shape.begin(), s.shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat("sharded delivery: ", hf_name, " is ", SafetensorsName(dtype),
                                                   ShapeToString(shape), ", the engine expects ",
                                                   SafetensorsName(s.dtype), ShapeToString(s.shape)));
  }
  const engine_model::KeptBlock k = engine_model::KeptBlockOf(s);
  if (k.empty()) return std::nullopt;
  const MatrixDims m = MatrixOf(shape);
  ASSIGN_OR_RETURN(const int64_t whole_bytes, NumBytes(dtype, shape));
  // Tensors of more than two dims are never cut (the loader's blocks are of matrices).
  if (shape.size() > 2 || (k.row0 == 0 && k.col0 == 0 && k.rows == m.rows && k.cols == m.cols))
    return Block{0, m.rows, 0, m.cols, true, static_cast<uint64_t>(whole_bytes)};
  return Block{k.row0, k.rows, k.col0, k.cols, false, static_cast<uint64_t>(k.rows * k.cols) * ItemSize(dtype)};
}

}  // namespace wsync::plan
