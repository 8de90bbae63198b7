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

// Python's // and % (floor division: the remainder takes the divisor's sign), as Megatron computes.
int64_t PyDiv(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0); }
int64_t PyMod(int64_t a, int64_t b) { return a - PyDiv(a, b) * b; }

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

int64_t SourceParallel::ChunkFirstLayer(int chunk) const {
  int64_t first = 0;
  for (int k = 0; k < chunk && k < static_cast<int>(layers_per_chunk.size()); ++k)
    first += layers_per_chunk[static_cast<size_t>(k)];
  return first;
}

// megatron-core 0.16.1, transformer_block.py get_num_layers_to_build and transformer_layer.py
// get_transformer_layer_offset (no --pipeline-model-parallel-layout), with the checks of
// TransformerConfig.__post_init__; MEGATRON_TO_HF.md §4.2 has them side by side. vpp = 1 is
// Megatron's virtual_pipeline_model_parallel_size = None.
absl::StatusOr<std::vector<int64_t>> MegatronChunkLayers(int64_t num_layers, const SourceParallel& p) {
  const int pp = p.pp, vpp = p.vpp;
  const bool vp = vpp > 1;
  const std::optional<int64_t>& first = p.num_layers_in_first_pipeline_stage;
  const std::optional<int64_t>& last = p.num_layers_in_last_pipeline_stage;
  const bool uneven = first.has_value() || last.has_value();
  const bool embedding = p.account_for_embedding_in_pipeline_split;
  const bool loss = p.account_for_loss_in_pipeline_split;
  auto refuse = [](auto&&... what) { return absl::InvalidArgumentError(absl::StrCat(what...)); };
  if (vp && pp < 2) return refuse("vpp=", vpp, " needs pipeline parallelism (pp > 1), got pp=", pp);
  int64_t per_rank = 0;       // layers of a middle (or every) pipeline rank
  int64_t middle_layers = 0;  // uneven: the layers left for the middle stages, and how many those are
  int64_t middle_stages = 0;
  if (uneven) {
    if (embedding || loss)
      return refuse(
          "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage cannot be set together with "
          "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split");
    middle_layers = num_layers;
    middle_stages = pp;
    for (const auto& [opt, name] : {std::pair{first, "first"}, std::pair{last, "last"}}) {
      if (!opt.has_value()) continue;
      if (*opt <= 0) return refuse("num_layers_in_", name, "_pipeline_stage must be larger than 0, got ", *opt);
      if (vp && *opt % vpp != 0)
        return refuse("num_layers_in_", name, "_pipeline_stage=", *opt, " must be divisible by vpp=", vpp);
      middle_layers -= *opt;
      --middle_stages;
    }
    // TransformerConfig's checks as written (Python's % and //: the sign of the divisor); a split
    // they let through with a negative layer count is refused below
    if ((middle_layers != 0) != (middle_stages != 0))
      return refuse(middle_layers, " middle layers remain for ", middle_stages, " middle pipeline stages");
    if (middle_stages != 0 && PyMod(middle_layers, middle_stages) != 0)
      return refuse(middle_layers, " middle layers do not split over ", middle_stages, " middle pipeline stages");
    if (middle_stages != 0 && vp && PyMod(PyDiv(middle_layers, middle_stages), vpp) != 0)
      return refuse(PyDiv(middle_layers, middle_stages),
                    " layers on each middle pipeline rank are not divisible by vpp=", vpp);
    per_rank = middle_stages > 0 ? middle_layers / middle_stages : 0;  // get_num_layers_to_build
  } else {
    const int64_t counted = num_layers + (embedding ? 1 : 0) + (loss ? 1 : 0);
    if (counted % pp != 0)
      return refuse("num_hidden_layers=", num_layers,
                    embedding || loss ? " (+1 for each of the embedding and the loss accounted for)" : "",
                    " does not split evenly over pp=", pp);
    per_rank = counted / pp;
  }
  std::vector<int64_t> chunks(static_cast<size_t>(pp) * vpp);
  int64_t next = 0;  // the first layer of the next chunk in layer order
  for (int v = 0; v < vpp; ++v) {
    for (int r = 0; r < pp; ++r) {
      const bool first_rank = r == 0, last_rank = r == pp - 1;
      int64_t n = per_rank;
      if (first_rank && first.has_value()) n = *first;
      if (last_rank && last.has_value()) n = *last;
      if (vp) {
        if (n < 0) return refuse("pipeline rank ", r, " would hold ", n, " layers");
        if (n % vpp != 0) return refuse("pipeline rank ", r, " has ", n, " layers, not divisible by vpp=", vpp);
        n /= vpp;
      }
      if (n < 0) return refuse("pipeline rank ", r, " would hold ", n, " layers");
      if (embedding && first_rank && v == 0 && --n < 0)
        return refuse("no layer left in the first virtual stage for the embedding to take its place");
      if (loss && last_rank && v == vpp - 1 && --n < 0)
        return refuse("no layer left in the last virtual stage for the loss to take its place");
      // get_transformer_layer_offset, which must put the chunk right after the previous one
      int64_t offset = 0;
      if (pp > 1 && uneven) {
        const int64_t f = first.value_or(0), l = last.value_or(0);
        const int64_t middle_rank = first.has_value() ? r - 1 : r;
        if (vp) {
          const int64_t f_vp = f / vpp, m_vp = middle_layers / vpp, l_vp = l / vpp;
          // megatron-core 0.16.1 divides m_vp by middle_stages even when it is 0 (a ZeroDivisionError
          // for pp = 2 with both stages set); the term is 0 then
          const int64_t per_middle = middle_stages > 0 ? m_vp / middle_stages : 0;
          offset = v * (f_vp + m_vp + l_vp) + (first_rank ? 0 : f_vp + middle_rank * per_middle);
        } else {
          offset = first_rank ? 0 : middle_rank * per_rank + f;
        }
      } else if (pp > 1) {
        const int64_t counted = num_layers + (embedding ? 1 : 0) + (loss ? 1 : 0);
        offset = vp ? v * (counted / vpp) + r * (per_rank / vpp) : r * per_rank;
        if (embedding && !(v == 0 && first_rank)) --offset;
      }
      if (offset != next)
        return refuse("Megatron's layer offset for pipeline rank ", r, ", virtual stage ", v, " is ", offset, ", not ",
                      next, " (the layers of the chunks before it): these options leave a gap or an overlap");
      chunks[static_cast<size_t>(v) * pp + r] = n;
      next += n;
    }
  }
  if (next != num_layers) return refuse("the chunks hold ", next, " layers, not num_hidden_layers=", num_layers);
  return chunks;
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
                                           "layers_per_stage",
                                           "vpp",
                                           "layers_per_chunk",
                                           "num_layers_in_first_pipeline_stage",
                                           "num_layers_in_last_pipeline_stage",
                                           "account_for_embedding_in_pipeline_split",
                                           "account_for_loss_in_pipeline_split",
                                           "mtp_num_layers"};
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
  for (const auto& [key, list] :
       {std::pair{"layers_per_stage", &p.layers_per_stage}, std::pair{"layers_per_chunk", &p.layers_per_chunk}}) {
    if (!has(key)) continue;
    const Json& v = j.at(key);
    if (!v.is_array()) return Bad(source, absl::StrCat("\"", key, "\" must be a list, got ", v.dump()));
    for (const Json& e : v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX)
        return Bad(source, absl::StrCat("\"", key, "\" must hold non-negative integers, got ", e.dump()));
      list->push_back(e.get<int64_t>());
    }
  }
  if (has("vpp")) {
    ASSIGN_OR_RETURN(int64_t v, IntField(j, "vpp", source, 1));
    p.vpp = static_cast<int>(v);
  }
  for (const auto& [key, opt] :
       {std::pair{"num_layers_in_first_pipeline_stage", &p.num_layers_in_first_pipeline_stage},
        std::pair{"num_layers_in_last_pipeline_stage", &p.num_layers_in_last_pipeline_stage}}) {
    if (!has(key)) continue;
    ASSIGN_OR_RETURN(*opt, IntField(j, key, source, 1));
  }
  for (const auto& [key, flag] :
       {std::pair{"account_for_embedding_in_pipeline_split", &p.account_for_embedding_in_pipeline_split},
        std::pair{"account_for_loss_in_pipeline_split", &p.account_for_loss_in_pipeline_split}}) {
    if (!has(key)) continue;
    if (!j.at(key).is_boolean())
      return Bad(source, absl::StrCat("\"", key, "\" must be true or false, got ", j.at(key).dump()));
    *flag = j.at(key).get<bool>();
  }
  if (has("mtp_num_layers")) {
    ASSIGN_OR_RETURN(p.mtp_num_layers, IntField(j, "mtp_num_layers", source, 0));
  }
  return p;
}

absl::StatusOr<SourceParallel> ResolveSourceParallel(const ModelConfig& model, SourceParallel p,
                                                     absl::string_view source) {
  auto bad = [&](const absl::Status& s) { return absl::Status(s.code(), absl::StrCat(source, ": ", s.message())); };
  if (p.padded_vocab_size == 0)
    p.padded_vocab_size = PaddedVocabSize(model.vocab_size, p.make_vocab_size_divisible_by, p.tp);
  const int64_t layers = model.num_hidden_layers;
  if (p.mtp_num_layers != 0 && p.mtp_num_layers != model.num_nextn_predict_layers)
    return Bad(source, absl::StrCat("mtp_num_layers=", p.mtp_num_layers, " but the HF config (", model.architecture,
                                    ") has num_nextn_predict_layers=", model.num_nextn_predict_layers,
                                    ": the engines load exactly the MTP layers the checkpoint declares"));
  const size_t chunks = static_cast<size_t>(p.pp) * p.vpp;
  if (p.vpp > 1 && p.pp < 2) return Bad(source, absl::StrCat("vpp=", p.vpp, " needs pipeline parallelism (pp > 1)"));
  if (!p.layers_per_stage.empty() && p.layers_per_stage.size() != static_cast<size_t>(p.pp))
    return Bad(source, absl::StrCat("layers_per_stage has ", p.layers_per_stage.size(), " entries but pp=", p.pp));
  if (!p.layers_per_chunk.empty() && p.layers_per_chunk.size() != chunks)
    return Bad(source, absl::StrCat("layers_per_chunk has ", p.layers_per_chunk.size(), " entries but pp*vpp=", p.pp,
                                    "*", p.vpp));
  if (p.vpp == 1 && p.layers_per_chunk.empty()) p.layers_per_chunk = p.layers_per_stage;
  const bool options = p.num_layers_in_first_pipeline_stage || p.num_layers_in_last_pipeline_stage ||
                       p.account_for_embedding_in_pipeline_split || p.account_for_loss_in_pipeline_split;
  if (p.layers_per_chunk.empty() || options) {
    absl::StatusOr<std::vector<int64_t>> megatron = MegatronChunkLayers(layers, p);
    if (!megatron.ok()) {
      if (p.layers_per_chunk.empty() && !options && p.layers_per_stage.empty())
        return Bad(source, absl::StrCat(megatron.status().message(), "; give ",
                                        p.vpp > 1 ? "layers_per_chunk" : "layers_per_stage"));
      return Bad(source, megatron.status().message());
    }
    if (p.layers_per_chunk.empty() && !p.layers_per_stage.empty()) {
      // vpp > 1 with only the stages' sums given: they must be the options' sums
      for (int s = 0; s < p.pp; ++s) {
        int64_t sum = 0;
        for (int v = 0; v < p.vpp; ++v) sum += (*megatron)[static_cast<size_t>(p.Chunk(s, v))];
        if (sum != p.layers_per_stage[static_cast<size_t>(s)])
          return Bad(source,
                     absl::StrCat("layers_per_stage [", absl::StrJoin(p.layers_per_stage, ", "),
                                  "] is not Megatron's split of ", layers, " layers over pp=", p.pp, " x vpp=", p.vpp,
                                  " (", absl::StrJoin(*megatron, ", "), " per chunk); give layers_per_chunk"));
      }
    }
    if (!p.layers_per_chunk.empty() && p.layers_per_chunk != *megatron)
      return Bad(source, absl::StrCat("layers_per_chunk [", absl::StrJoin(p.layers_per_chunk, ", "),
                                      "] is not Megatron's split for the options given [",
                                      absl::StrJoin(*megatron, ", "), "]"));
    p.layers_per_chunk = *std::move(megatron);
  }
  const int64_t sum = std::accumulate(p.layers_per_chunk.begin(), p.layers_per_chunk.end(), int64_t{0});
  if (sum != layers)
    return Bad(source, absl::StrCat(p.vpp > 1 ? "layers_per_chunk [" : "layers_per_stage [",
                                    absl::StrJoin(p.layers_per_chunk, ", "), "] sums to ", sum,
                                    " but the model has num_hidden_layers=", layers));
  std::vector<int64_t> per_stage(static_cast<size_t>(p.pp), 0);
  for (size_t k = 0; k < chunks; ++k) per_stage[k % static_cast<size_t>(p.pp)] += p.layers_per_chunk[k];
  if (!p.layers_per_stage.empty() && p.layers_per_stage != per_stage)
    return Bad(source, absl::StrCat("layers_per_stage [", absl::StrJoin(p.layers_per_stage, ", "),
                                    "] is not the sum of layers_per_chunk [", absl::StrJoin(p.layers_per_chunk, ", "),
                                    "] per pipeline rank"));
  p.layers_per_stage = std::move(per_stage);
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
  if (p.vpp > 1) {
    j["vpp"] = p.vpp;
    j["layers_per_chunk"] = p.layers_per_chunk;
  }
  if (p.num_layers_in_first_pipeline_stage)
    j["num_layers_in_first_pipeline_stage"] = *p.num_layers_in_first_pipeline_stage;
  if (p.num_layers_in_last_pipeline_stage)
    j["num_layers_in_last_pipeline_stage"] = *p.num_layers_in_last_pipeline_stage;
  if (p.account_for_embedding_in_pipeline_split) j["account_for_embedding_in_pipeline_split"] = true;
  if (p.account_for_loss_in_pipeline_split) j["account_for_loss_in_pipeline_split"] = true;
  if (p.mtp_num_layers > 0) j["mtp_num_layers"] = p.mtp_num_layers;
  return j.dump(2) + "\n";
}

}  // namespace wsync::trainer_agent
