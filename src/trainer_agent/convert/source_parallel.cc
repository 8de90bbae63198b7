#include "trainer_agent/convert/source_parallel.h"

#include <nlohmann/json.hpp>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "trainer_agent/convert/megatron_param.h"

namespace wsync::trainer_agent {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
}

absl::StatusOr<int64_t> IntField(const Json& j, const char* key, absl::string_view source, int64_t min) {
  const Json& v = j.at(key);
  if (!v.is_number_integer()) return Bad(source, absl::StrCat("\"", key, "\" must be an integer, got ", v.dump()));
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX))
    return Bad(source, absl::StrCat("\"", key, "\" is too large: ", v.dump()));
  const int64_t x = v.get<int64_t>();
  if (x < min) return Bad(source, absl::StrCat("\"", key, "\" must be >= ", min, ", got ", x));
  return x;
}

}  // namespace

ParallelSizes SourceParallel::Sizes(const ModelConfig& model) const {
  ParallelSizes s;
  s.world_size = world_size;
  s.tp = tp;
  s.cp = cp;
  s.pp = pp;
  s.ep = ep;
  s.etp = etp;
  s.order = order;
  s.num_experts = model.moe ? model.moe->num_experts : 0;
  return s;
}

int64_t SourceParallel::FirstLayer(int stage) const {
  int64_t first = 0;
  for (int s = 0; s < stage && s < static_cast<int>(layers_per_stage.size()); ++s)
    first += layers_per_stage[static_cast<size_t>(s)];
  return first;
}

int64_t PaddedVocabSize(int64_t vocab, int64_t divisible_by, int tp) {
  const int64_t multiple = divisible_by * tp;
  if (multiple <= 0) return vocab;
  return (vocab + multiple - 1) / multiple * multiple;
}

absl::StatusOr<SourceParallel> ParseSourceParallel(absl::string_view json_text, absl::string_view source) {
  Json j = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad(source, "not well-formed JSON");
  if (!j.is_object()) return Bad(source, "expected a JSON object");
  static constexpr const char* kKnown[] = {"tp",
                                           "pp",
                                           "ep",
                                           "etp",
                                           "dp",
                                           "cp",
                                           "world_size",
                                           "order",
                                           "make_vocab_size_divisible_by",
                                           "padded_vocab_size",
                                           "layers_per_stage"};
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* k : kKnown) known = known || key == k;
    if (!known)
      return Bad(source, absl::StrCat("unknown key \"", key,
                                      "\" (known: ", absl::StrJoin(std::begin(kKnown), std::end(kKnown), ", "), ")"));
  }
  auto has = [&](const char* k) { return j.contains(k) && !j.at(k).is_null(); };
  SourceParallel p;
  int* sizes[] = {&p.tp, &p.pp, &p.ep, &p.etp, &p.dp, &p.cp, &p.world_size};
  const char* names[] = {"tp", "pp", "ep", "etp", "dp", "cp", "world_size"};
  bool given[7] = {};
  for (int i = 0; i < 7; ++i) {
    if (!has(names[i])) continue;
    ASSIGN_OR_RETURN(int64_t v, IntField(j, names[i], source, 1));
    *sizes[i] = static_cast<int>(v);
    given[i] = true;
  }
  if (!given[3]) p.etp = p.tp;  // Megatron: expert_tensor_parallel_size defaults to TP
  const int model_ranks = p.tp * p.cp * p.pp;
  if (!given[4]) p.dp = given[6] ? std::max(1, p.world_size / model_ranks) : 1;
  if (!given[6]) p.world_size = model_ranks * p.dp;
  if (static_cast<int64_t>(p.tp) * p.cp * p.pp * p.dp != p.world_size)
    return Bad(source,
               absl::StrCat("world_size=", p.world_size, " != tp*cp*pp*dp = ", p.tp, "*", p.cp, "*", p.pp, "*", p.dp));
  if (has("order")) {
    if (!j.at("order").is_string())
      return Bad(source, absl::StrCat("\"order\" must be a string, got ", j.at("order").dump()));
    p.order = j.at("order").get<std::string>();
  }
  if (has("make_vocab_size_divisible_by")) {
    ASSIGN_OR_RETURN(p.make_vocab_size_divisible_by, IntField(j, "make_vocab_size_divisible_by", source, 1));
  }
  if (has("padded_vocab_size")) {
    ASSIGN_OR_RETURN(p.padded_vocab_size, IntField(j, "padded_vocab_size", source, 1));
  }
  if (has("layers_per_stage")) {
    const Json& v = j.at("layers_per_stage");
    if (!v.is_array()) return Bad(source, absl::StrCat("\"layers_per_stage\" must be a list, got ", v.dump()));
    for (const Json& e : v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX)
        return Bad(source, absl::StrCat("\"layers_per_stage\" must hold non-negative integers, got ", e.dump()));
      p.layers_per_stage.push_back(e.get<int64_t>());
    }
  }
  return p;
}

absl::StatusOr<SourceParallel> ResolveSourceParallel(const ModelConfig& model, SourceParallel p,
                                                     absl::string_view source) {
  auto bad = [&](const absl::Status& s) { return absl::Status(s.code(), absl::StrCat(source, ": ", s.message())); };
  if (p.padded_vocab_size == 0)
    p.padded_vocab_size = PaddedVocabSize(model.vocab_size, p.make_vocab_size_divisible_by, p.tp);
  const int64_t layers = model.num_hidden_layers;
  if (p.layers_per_stage.empty()) {
    if (layers % p.pp != 0)
      return Bad(source, absl::StrCat("num_hidden_layers=", layers, " does not split evenly over pp=", p.pp,
                                      "; give layers_per_stage"));
    p.layers_per_stage.assign(static_cast<size_t>(p.pp), layers / p.pp);
  }
  if (static_cast<int>(p.layers_per_stage.size()) != p.pp)
    return Bad(source, absl::StrCat("layers_per_stage has ", p.layers_per_stage.size(), " entries but pp=", p.pp));
  const int64_t sum = std::accumulate(p.layers_per_stage.begin(), p.layers_per_stage.end(), int64_t{0});
  if (sum != layers)
    return Bad(source, absl::StrCat("layers_per_stage [", absl::StrJoin(p.layers_per_stage, ", "), "] sums to ", sum,
                                    " but the model has num_hidden_layers=", layers));
  if (absl::Status s = CheckModelFitsLayout(model, p); !s.ok()) return bad(s);
  if (auto layout = ParallelLayout::Create(p.Sizes(model)); !layout.ok()) return bad(layout.status());
  return p;
}

absl::StatusOr<ParallelLayout> MakeLayout(const ModelConfig& model, const SourceParallel& parallel) {
  return ParallelLayout::Create(parallel.Sizes(model));
}

std::string SourceParallelToJson(const SourceParallel& p) {
  Json j = {{"tp", p.tp},
            {"pp", p.pp},
            {"ep", p.ep},
            {"etp", p.etp},
            {"dp", p.dp},
            {"cp", p.cp},
            {"world_size", p.world_size},
            {"order", p.order},
            {"make_vocab_size_divisible_by", p.make_vocab_size_divisible_by},
            {"padded_vocab_size", p.padded_vocab_size},
            {"layers_per_stage", p.layers_per_stage}};
  return j.dump(2) + "\n";
}

}  // namespace wsync::trainer_agent
