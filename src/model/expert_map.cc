#include "model/expert_map.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace wsync::model {
namespace {

using OrderedJson = nlohmann::ordered_json;

absl::Status Bad(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
}

// "model.layers.L.REST" -> L and REST; false for other names.
bool SplitLayerName(absl::string_view name, int64_t* layer, absl::string_view* rest) {
  constexpr absl::string_view kPrefix = "model.layers.";
  if (!absl::ConsumePrefix(&name, kPrefix)) return false;
  const size_t dot = name.find('.');
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(name.substr(0, dot), layer)) return false;
  *rest = name.substr(dot + 1);
  return true;
}

// Rows `ids` of `t` (a 1-D tensor's elements, or the rows of a 2-D one), in that order.
absl::StatusOr<Tensor> PickRows(const std::string& name, const TensorView& t, const std::vector<int64_t>& ids,
                                int64_t num_experts) {
  if (t.shape().empty() || t.shape()[0] != num_experts)
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", name, "\" is ", t.DebugString(), ": its first dimension is not ", "the map's num_experts ", num_experts));
  Shape shape = t.shape();
  shape[0] = static_cast<int64_t>(ids.size());
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(t.dtype(), shape));
  const size_t row = t.nbytes() / static_cast<size_t>(num_experts);
  std::byte* dst = out.mutable_view().bytes().data();
  for (size_t k = 0; k < ids.size(); ++k)
    std::memcpy(dst + k * row, t.bytes().data() + static_cast<size_t>(ids[k]) * row, row);
  return out;
}

}  // namespace

int64_t ExpertMap::CompactId(int64_t layer, int64_t expert) const {
  auto it = layers.find(layer);
  if (it == layers.end()) return -1;
  for (size_t k = 0; k < it->second.size(); ++k)
    if (it->second[k] == expert) return static_cast<int64_t>(k);
  return -1;
}

std::string ExpertMap::Canonical() const {
  std::vector<std::string> parts;
  for (const auto& [layer, ids] : layers)
    parts.push_back(absl::StrCat("\"", layer, "\": [", absl::StrJoin(ids, ", "), "]"));
  return absl::StrCat("{\"num_experts\": ", num_experts, ", \"layers\": {", absl::StrJoin(parts, ", "), "}}");
}

absl::StatusOr<ExpertMap> ParseExpertMap(absl::string_view json_text, absl::string_view source) {
  nlohmann::json j = nlohmann::json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad(source, "not valid JSON");
  if (!j.is_object()) return Bad(source, "the expert map must be a JSON object");
  for (const auto& [key, value] : j.items())
    if (key != "num_experts" && key != "layers")
      return Bad(source,
                 absl::StrCat("unknown field \"", key, "\" (an expert map has \"num_experts\" and \"layers\")"));
  ExpertMap m;
  auto e = j.find("num_experts");
  if (e == j.end() || !e->is_number_integer() || e->get<int64_t>() <= 0)
    return Bad(source, absl::StrCat("\"num_experts\" must be a positive integer (the trainer model's routed experts)",
                                    e == j.end() ? ", and is missing" : absl::StrCat(", not ", e->dump())));
  m.num_experts = e->get<int64_t>();
  auto layers = j.find("layers");
  if (layers == j.end() || !layers->is_object() || layers->empty())
    return Bad(source, "\"layers\" must be a non-empty object {\"<layer>\": [kept expert ids], ...}");
  for (const auto& [key, value] : layers->items()) {
    int64_t layer = -1;
    if (key.empty() || key.find_first_not_of("0123456789") != std::string::npos || !absl::SimpleAtoi(key, &layer))
      return Bad(source, absl::StrCat("layer key \"", key, "\" is not a decimal layer index >= 0"));
    if (m.layers.count(layer) != 0) return Bad(source, absl::StrCat("layer ", layer, " is listed twice"));
    if (!value.is_array() || value.empty())
      return Bad(source, absl::StrCat("layer ", layer, ": the kept experts must be a non-empty array of ids"));
    std::vector<int64_t> ids;
    std::set<int64_t> seen;
    for (const auto& v : value) {
      if (!v.is_number_integer())
        return Bad(source, absl::StrCat("layer ", layer, ": expert id ", v.dump(), " is not an integer"));
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id >= m.num_experts)
        return Bad(source, absl::StrCat("layer ", layer, ": expert id ", id, " is outside [0, ", m.num_experts, ")"));
      if (!seen.insert(id).second) return Bad(source, absl::StrCat("layer ", layer, ": expert ", id, " is kept twice"));
      ids.push_back(id);
    }
    m.layers.emplace(layer, std::move(ids));
  }
  const auto& [first_layer, first_ids] = *m.layers.begin();
  for (const auto& [layer, ids] : m.layers)
    if (ids.size() != first_ids.size())
      return Bad(source, absl::StrCat("layer ", layer, " keeps ", ids.size(), " experts, layer ", first_layer, " ",
                                      first_ids.size(), ": every layer must keep as many (the pruned config has one ",
                                      "expert count)"));
  return m;
}

absl::StatusOr<ExpertMap> LoadExpertMap(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  return ParseExpertMap(text, path);
}

absl::Status CheckExpertMapFits(const ExpertMap& map, const ModelConfig& model) {
  const std::string who = absl::StrCat("the expert map (", map.num_experts, " experts, ", map.layers.size(),
                                       " layers keeping ", map.kept(), ")");
  if (!model.moe)
    return absl::InvalidArgumentError(
        absl::StrCat(who, " is for a MoE model; ", model.architecture, " has no routed experts"));
  if (map.num_experts != model.moe->num_experts)
    return absl::InvalidArgumentError(absl::StrCat(who, " has num_experts ", map.num_experts, ", the model ",
                                                   model.moe->num_experts, " routed experts"));
  std::vector<int64_t> missing;
  for (int64_t l = 0; l < model.num_hidden_layers; ++l)
    if (model.IsMoeLayer(l) && map.layers.count(l) == 0) missing.push_back(l);
  if (!missing.empty())
    return absl::InvalidArgumentError(absl::StrCat(who, " does not list MoE layer(s) ", absl::StrJoin(missing, ", "),
                                                   " (every MoE layer of the ", model.num_hidden_layers,
                                                   " decoder layers must be listed)"));
  for (const auto& [layer, ids] : map.layers)
    if (!model.IsMoeLayer(layer))
      return absl::InvalidArgumentError(absl::StrCat(who, " lists layer ", layer,
                                                     ", which is not a MoE decoder layer of ", "the model (",
                                                     model.num_hidden_layers, " layers)"));
  if (map.kept() < model.moe->num_experts_per_tok)
    return absl::InvalidArgumentError(absl::StrCat(who, " keeps ", map.kept(), " experts per layer, fewer than the ",
                                                   model.moe->num_experts_per_tok, " each token is routed to"));
  return absl::OkStatus();
}

absl::StatusOr<std::string> PrunedConfigJson(absl::string_view config_json, const ExpertMap& map,
                                             absl::string_view source) {
  ASSIGN_OR_RETURN(ModelConfig model, ParseModelConfig(config_json, source));
  RETURN_IF_ERROR(Annotate(CheckExpertMapFits(map, model), source));
  OrderedJson j = OrderedJson::parse(config_json.begin(), config_json.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Bad(source, "not a JSON object");
  j[model.arch == Architecture::kQwen3Moe ? "num_experts" : "n_routed_experts"] = map.kept();
  if (j.contains("n_group")) j["n_group"] = 1;
  if (j.contains("topk_group")) j["topk_group"] = 1;
  if (j.contains("num_nextn_predict_layers")) j["num_nextn_predict_layers"] = 0;
  std::string out = j.dump(2);
  out += "\n";
  RETURN_IF_ERROR(Annotate(ParseModelConfig(out, "the pruned config").status(), source));
  return out;
}

absl::StatusOr<HfCheckpoint> PruneHfCheckpoint(const ModelConfig& model, const ExpertMap& map, const HfCheckpoint& hf) {
  RETURN_IF_ERROR(CheckExpertMapFits(map, model));
  HfCheckpoint out;
  for (const std::string& name : hf.Names()) {
    ASSIGN_OR_RETURN(TensorView t, hf.Get(name));
    int64_t layer = -1;
    absl::string_view rest;
    std::string new_name = name;
    if (SplitLayerName(name, &layer, &rest)) {
      if (layer >= model.num_hidden_layers) continue;  // MTP
      auto kept = map.layers.find(layer);
      if (kept != map.layers.end()) {
        if (absl::ConsumePrefix(&rest, "mlp.experts.")) {
          const size_t dot = rest.find('.');
          int64_t expert = -1;
          if (dot == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, dot), &expert))
            return absl::InvalidArgumentError(absl::StrCat("\"", name, "\" is not model.layers.L.mlp.experts.J.*"));
          if (expert < 0 || expert >= map.num_experts)
            return absl::InvalidArgumentError(
                absl::StrCat("\"", name, "\": expert ", expert, " is outside the map's [0, ", map.num_experts, ")"));
          const int64_t compact = map.CompactId(layer, expert);
          if (compact < 0) continue;
          new_name = absl::StrCat("model.layers.", layer, ".mlp.experts.", compact, rest.substr(dot));
        } else if (rest == "mlp.gate.weight" || rest == "mlp.gate.e_score_correction_bias") {
          ASSIGN_OR_RETURN(Tensor picked, PickRows(name, t, kept->second, map.num_experts));
          RETURN_IF_ERROR(out.Add(name, std::move(picked)));
          continue;
        }
      }
    }
    ASSIGN_OR_RETURN(Tensor copy, Tensor::Empty(t.dtype(), t.shape()));
    if (t.nbytes() > 0) std::memcpy(copy.mutable_view().bytes().data(), t.bytes().data(), t.nbytes());
    RETURN_IF_ERROR(out.Add(std::move(new_name), std::move(copy)));
  }
  return out;
}

}  // namespace wsync::model
