#include "common/config.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace wsync {
namespace {

using Json = nlohmann::json;

// Typed field access with errors that name the source, the field and the offending value.
class Fields {
 public:
  Fields(const Json& j, absl::string_view source, absl::string_view prefix) : j_(j), source_(source), prefix_(prefix) {}

  absl::Status Error(absl::string_view field, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field \"", prefix_, field, "\" ", what));
  }
  bool Has(const char* f) const { return j_.contains(f) && !j_.at(f).is_null(); }

  absl::StatusOr<int64_t> Int(const char* f, std::optional<int64_t> def = std::nullopt, int64_t min = 1) const {
    if (!Has(f)) {
      if (def) return *def;
      return Error(f, "is required");
    }
    const Json& v = j_.at(f);
    if (!v.is_number_integer()) return Error(f, absl::StrCat("must be an integer, got ", v.dump()));
    const int64_t x =
        v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
    if (x < min) return Error(f, absl::StrCat("must be >= ", min, ", got ", x));
    return x;
  }
  absl::StatusOr<double> Number(const char* f, double def) const {
    if (!Has(f)) return def;
    const Json& v = j_.at(f);
    if (!v.is_number()) return Error(f, absl::StrCat("must be a number, got ", v.dump()));
    return v.get<double>();
  }
  absl::StatusOr<bool> Bool(const char* f, bool def) const {
    if (!Has(f)) return def;
    const Json& v = j_.at(f);
    if (!v.is_boolean()) return Error(f, absl::StrCat("must be true or false, got ", v.dump()));
    return v.get<bool>();
  }
  absl::StatusOr<std::string> String(const char* f, std::optional<std::string> def = std::nullopt) const {
    if (!Has(f)) {
      if (def) return *def;
      return Error(f, "is required");
    }
    const Json& v = j_.at(f);
    if (!v.is_string()) return Error(f, absl::StrCat("must be a string, got ", v.dump()));
    return v.get<std::string>();
  }
  absl::StatusOr<std::vector<std::string>> Strings(const char* f) const {
    std::vector<std::string> out;
    if (!Has(f)) return out;
    const Json& v = j_.at(f);
    if (!v.is_array()) return Error(f, absl::StrCat("must be a list of strings, got ", v.dump()));
    for (const Json& e : v) {
      if (!e.is_string()) return Error(f, absl::StrCat("must be a list of strings, got element ", e.dump()));
      out.push_back(e.get<std::string>());
    }
    return out;
  }
  absl::StatusOr<std::vector<int64_t>> Ints(const char* f) const {
    std::vector<int64_t> out;
    if (!Has(f)) return out;
    const Json& v = j_.at(f);
    if (!v.is_array()) return Error(f, absl::StrCat("must be a list of integers, got ", v.dump()));
    for (const Json& e : v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0)
        return Error(f, absl::StrCat("must be a list of non-negative integers, got element ", e.dump()));
      out.push_back(e.get<int64_t>());
    }
    return out;
  }

 private:
  const Json& j_;
  std::string source_;
  std::string prefix_;
};

absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view source) {
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(source, ": not well-formed JSON"));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": expected a JSON object"));
  return j;
}

struct ArchName {
  Architecture arch;
  const char* model_type;
  const char* class_name;
};
constexpr ArchName kArchs[] = {
    {Architecture::kLlama, "llama", "LlamaForCausalLM"},
    {Architecture::kQwen2, "qwen2", "Qwen2ForCausalLM"},
    {Architecture::kQwen3, "qwen3", "Qwen3ForCausalLM"},
    {Architecture::kQwen3Moe, "qwen3_moe", "Qwen3MoeForCausalLM"},
    {Architecture::kDeepseekV3, "deepseek_v3", "DeepseekV3ForCausalLM"},
    {Architecture::kGlm4Moe, "glm4_moe", "Glm4MoeForCausalLM"},
};

std::string SupportedArchs() {
  std::vector<std::string> names;
  for (const auto& a : kArchs) names.push_back(absl::StrCat(a.class_name, " (", a.model_type, ")"));
  return absl::StrJoin(names, ", ");
}

// The first of `keys` present in `q` (AWQConfig.from_config's get_from_keys), or nullptr.
const char* FirstKey(const Json& q, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (q.contains(k) && !q.at(k).is_null()) return k;
  return nullptr;
}

// The modules SGLang and vLLM build unquantized under AWQ and Fp8Config whatever the config lists:
// lm_head and the token embedding (not LinearBase) and MoE routers (ReplicatedLinear without a
// quant_config): appended to c.ignore.
absl::Status AddNeverQuantized(QuantizationConfig& c) {
  for (const char* never : {"lm_head", "model.embed_tokens", "re:.*mlp\\.gate$"}) {
    ASSIGN_OR_RETURN(IgnoreRule r, IgnoreRule::Parse(never));
    c.ignore.push_back(std::move(r));
  }
  return absl::OkStatus();
}

// quant_method "awq" (config.h): AutoAWQ's and transformers' spellings.
absl::StatusOr<QuantizationConfig> ParseAwqObject(const Json& q, const Fields& f, QuantizationConfig c) {
  const char* bits_key = FirstKey(q, {"w_bit", "bits"});
  if (bits_key == nullptr) return f.Error("bits", "is required (or \"w_bit\")");
  ASSIGN_OR_RETURN(int64_t bits, f.Int(bits_key));
  c.num_bits = static_cast<int>(std::min<int64_t>(bits, 64));
  const char* gs_key = FirstKey(q, {"q_group_size", "group_size"});
  if (gs_key == nullptr) return f.Error("group_size", "is required (or \"q_group_size\")");
  ASSIGN_OR_RETURN(int64_t gs, f.Int(gs_key, std::nullopt, -1));
  if (gs == 0 || gs > (int64_t{1} << 30)) return f.Error(gs_key, absl::StrCat("must be positive or -1, got ", gs));
  c.group_size = static_cast<int>(gs);
  c.strategy = gs == -1 ? "channel" : "group";
  if (!f.Has("zero_point")) return f.Error("zero_point", "is required");
  ASSIGN_OR_RETURN(const bool zero_point, f.Bool("zero_point", true));
  c.symmetric = !zero_point;
  ASSIGN_OR_RETURN(c.format, f.String("version", "gemm"));
  c.format = absl::AsciiStrToLower(c.format);
  c.targets = {"Linear"};
  ASSIGN_OR_RETURN(c.engine_layout, f.String("engine_layout", "marlin"));
  ASSIGN_OR_RETURN(std::vector<std::string> skip, f.Strings("modules_to_not_convert"));
  for (std::string& text : skip) {
    if (text.empty()) return f.Error("modules_to_not_convert", "holds an empty entry (it would match every module)");
    IgnoreRule r;
    r.text = std::move(text);
    r.substring = true;
    c.ignore.push_back(std::move(r));
  }
  // What the engines build unquantized under AWQ whatever the config says (config.h).
  RETURN_IF_ERROR(AddNeverQuantized(c));
  return c;
}

// quant_method "fp8" (config.h): DeepSeek-V3's block form.
absl::StatusOr<QuantizationConfig> ParseFp8Object(const Json& q, const Fields& f, QuantizationConfig c) {
  ASSIGN_OR_RETURN(c.format, f.String("fmt", "e4m3"));
  c.num_bits = 8;
  c.type = "float";
  c.strategy = "block";
  c.targets = {"Linear"};
  ASSIGN_OR_RETURN(c.activation_scheme, f.String("activation_scheme", "dynamic"));
  ASSIGN_OR_RETURN(c.scale_fmt, f.String("scale_fmt", ""));
  ASSIGN_OR_RETURN(c.engine_layout, f.String("engine_layout", "fp8"));
  if (f.Has("weight_block_size")) {
    ASSIGN_OR_RETURN(std::vector<int64_t> block, f.Ints("weight_block_size"));
    if (block.size() != 2)
      return f.Error("weight_block_size",
                     absl::StrCat("must hold two sizes [block_n, block_k], got ", q.at("weight_block_size").dump()));
    for (int64_t b : block)
      if (b <= 0 || b > 4096)
        return f.Error("weight_block_size",
                       absl::StrCat("sizes must be in 1..4096, got ", q.at("weight_block_size").dump()));
    c.block_n = block[0];
    c.block_k = block[1];
  }
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    ASSIGN_OR_RETURN(std::vector<std::string> skip, f.Strings(key));
    for (std::string& text : skip) {
      if (text.empty()) return f.Error(key, "holds an empty entry (it would match every module)");
      absl::StatusOr<IgnoreRule> r = IgnoreRule::Parse(std::move(text));  // names, prefixes, wsync's "re:"
      if (!r.ok()) return f.Error(key, r.status().message());
      c.ignore.push_back(std::move(*r));
    }
  }
  // What the engines build unquantized under Fp8Config whatever the config says (config.h).
  RETURN_IF_ERROR(AddNeverQuantized(c));
  return c;
}

absl::StatusOr<QuantizationConfig> ParseQuantizationObject(const Json& q, absl::string_view source) {
  if (!q.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": quantization_config must be an object, got ", q.dump()));
  Fields f(q, source, "quantization_config.");
  QuantizationConfig c;
  ASSIGN_OR_RETURN(c.quant_method, f.String("quant_method"));
  if (c.quant_method == "awq") return ParseAwqObject(q, f, std::move(c));
  if (c.quant_method == "fp8") return ParseFp8Object(q, f, std::move(c));
  if (c.quant_method != "compressed-tensors")
    return f.Error(
        "quant_method",
        absl::StrCat("is \"", c.quant_method, "\"; wsync reads compressed-tensors, awq and fp8 quantization configs"));
  ASSIGN_OR_RETURN(c.format, f.String("format", "pack-quantized"));
  ASSIGN_OR_RETURN(c.engine_layout, f.String("engine_layout", "marlin"));
  ASSIGN_OR_RETURN(std::vector<std::string> ignore, f.Strings("ignore"));
  for (auto& text : ignore) {
    auto rule = IgnoreRule::Parse(text);
    if (!rule.ok()) return f.Error("ignore", rule.status().message());
    c.ignore.push_back(std::move(*rule));
  }
  if (!f.Has("config_groups") || !q.at("config_groups").is_object() || q.at("config_groups").empty())
    return f.Error("config_groups", "must be a non-empty object");
  const Json& groups = q.at("config_groups");
  if (groups.size() != 1)
    return f.Error("config_groups", absl::StrCat("has ", groups.size(), " groups; wsync supports exactly one"));
  const std::string gname = groups.begin().key();
  const Json& g = groups.begin().value();
  if (!g.is_object()) return f.Error(absl::StrCat("config_groups.", gname), "must be an object");
  Fields gf(g, source, absl::StrCat("quantization_config.config_groups.", gname, "."));
  ASSIGN_OR_RETURN(c.targets, gf.Strings("targets"));
  if (!gf.Has("weights") || !g.at("weights").is_object()) return gf.Error("weights", "must be an object");
  Fields w(g.at("weights"), source, absl::StrCat("quantization_config.config_groups.", gname, ".weights."));
  ASSIGN_OR_RETURN(int64_t bits, w.Int("num_bits"));
  c.num_bits = static_cast<int>(std::min<int64_t>(bits, 64));
  ASSIGN_OR_RETURN(c.type, w.String("type", "int"));
  ASSIGN_OR_RETURN(c.strategy, w.String("strategy"));
  ASSIGN_OR_RETURN(c.symmetric, w.Bool("symmetric", true));
  if (w.Has("dynamic") && g.at("weights").at("dynamic").is_string()) {
    c.dynamic = true;  // "local" and friends
  } else {
    ASSIGN_OR_RETURN(c.dynamic, w.Bool("dynamic", false));
  }
  if (w.Has("actorder")) {
    const Json& a = g.at("weights").at("actorder");
    if (a.is_string()) {
      c.actorder = a.get<std::string>();
    } else if (a.is_boolean()) {
      c.actorder = a.get<bool>() ? "group" : "";
    } else {
      return w.Error("actorder", absl::StrCat("must be null, a string or a boolean, got ", a.dump()));
    }
  }
  if (c.strategy == "group") {
    ASSIGN_OR_RETURN(int64_t gs, w.Int("group_size", std::nullopt, -1));
    if (gs == 0 || gs > (int64_t{1} << 30))
      return w.Error("group_size", absl::StrCat("must be positive or -1, got ", gs));
    c.group_size = static_cast<int>(gs);
  } else if (c.strategy == "channel") {
    ASSIGN_OR_RETURN(int64_t gs, w.Int("group_size", -1, -1));
    if (gs != -1)
      return w.Error("group_size", absl::StrCat("must be absent or -1 with strategy \"channel\", got ", gs));
    c.group_size = -1;
  } else {
    return w.Error("strategy", absl::StrCat("is \"", c.strategy, "\"; expected \"group\" or \"channel\""));
  }
  // FP8 weights are held by the engines as FP8 tensors (config.h).
  if (c.type == "float" && !f.Has("engine_layout")) c.engine_layout = "fp8";
  return c;
}

}  // namespace

absl::string_view ArchitectureName(Architecture a) {
  for (const auto& n : kArchs)
    if (n.arch == a) return n.model_type;
  return "?";
}

constexpr size_t kMaxIgnorePatternBytes = 1024;

absl::StatusOr<IgnoreRule> IgnoreRule::Parse(std::string text) {
  IgnoreRule r;
  if (absl::StartsWith(text, "re:")) {
    const std::string pattern = text.substr(3);
    // libstdc++'s regex compiler recurses per construct and overflows on long numbers
    // ({m,n} counts, back-references): bound both before it sees the pattern.
    if (pattern.size() > kMaxIgnorePatternBytes)
      return absl::InvalidArgumentError(absl::StrCat("regular expression of ", pattern.size(),
                                                     " bytes exceeds the limit of ", kMaxIgnorePatternBytes));
    size_t digits = 0;
    for (char c : pattern) {
      digits = (c >= '0' && c <= '9') ? digits + 1 : 0;
      if (digits > 6)
        return absl::InvalidArgumentError(
            absl::StrCat("regular expression \"", pattern.substr(0, 64), "\" has a number of more than 6 digits"));
    }
    try {
      r.regex.emplace(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot compile regular expression \"", pattern, "\": ", e.what()));
    }
  } else if (text.empty()) {
    return absl::InvalidArgumentError("empty ignore entry");
  }
  r.text = std::move(text);
  return r;
}

bool IgnoreRule::Matches(absl::string_view name) const {
  if (regex) {
    std::cmatch m;
    return std::regex_search(name.data(), name.data() + name.size(), m, *regex, std::regex_constants::match_continuous);
  }
  if (substring) return absl::StrContains(name, text);
  return absl::StartsWith(name, text);
}

std::string QuantizationConfig::Canonical() const {
  std::vector<std::string> rules;
  for (const IgnoreRule& r : ignore) rules.push_back(r.substring ? absl::StrCat("~", r.text) : r.text);
  return absl::StrCat(quant_method, "|", format, "|", num_bits, "|", type, "|", strategy, "|", group_size, "|",
                      symmetric, "|", dynamic, "|", actorder, "|", absl::StrJoin(targets, ","), "|", block_n, "x",
                      block_k, "|", scale_fmt, "|", activation_scheme, "|", absl::StrJoin(rules, "\n"));
}

std::string QuantizationConfig::Describe() const {
  if (is_fp8_block())
    return absl::StrCat("fp8 ", format, " ", block_n > 0 ? absl::StrCat("block ", block_n, "x", block_k) : "per-tensor",
                        scale_fmt.empty() ? "" : absl::StrCat(" scale_fmt ", scale_fmt), ", ", ignore.size(),
                        " ignore rule", ignore.size() == 1 ? "" : "s");
  return absl::StrCat(quant_method, " ", format, " ", num_bits, "-bit ",
                      group_size == -1 ? std::string("channelwise") : absl::StrCat("group ", group_size),
                      symmetric ? " symmetric" : " with zero points", ", ", ignore.size(), " ignore rule",
                      ignore.size() == 1 ? "" : "s");
}

bool QuantizationConfig::IsIgnored(absl::string_view param_name) const {
  absl::string_view module = param_name;
  absl::ConsumeSuffix(&module, ".weight");
  for (const auto& rule : ignore)
    if (rule.Matches(module) || rule.Matches(param_name)) return true;
  return false;
}

absl::Status QuantizationConfig::CheckInt4Supported() const {
  auto unsupported = [](absl::string_view what) {
    return absl::UnimplementedError(
        absl::StrCat("quantization_config: ", what, " is not supported by wsync's INT4 path"));
  };
  if (is_fp8()) return unsupported(absl::StrCat("FP8 (", Describe(), ")"));
  if (is_awq()) {
    if (format != "gemm") return unsupported(absl::StrCat("AWQ version \"", format, "\" (supported: gemm)"));
    if (num_bits != 4) return unsupported(absl::StrCat("AWQ bits ", num_bits));
    if (symmetric) return unsupported("AWQ without zero points (zero_point: false)");
  } else {
    if (quant_method != "compressed-tensors") return unsupported(absl::StrCat("quant_method \"", quant_method, "\""));
    if (format != "pack-quantized") return unsupported(absl::StrCat("format \"", format, "\""));
    if (num_bits != 4) return unsupported(absl::StrCat("num_bits ", num_bits));
    if (!symmetric) return unsupported("asymmetric quantization (symmetric: false)");
  }
  if (type != "int") return unsupported(absl::StrCat("type \"", type, "\""));
  if (engine_layout != "marlin" && engine_layout != "trtllm-sm80" && engine_layout != "trtllm-sm90")
    return unsupported(
        absl::StrCat("engine_layout \"", engine_layout, "\" (supported: marlin, trtllm-sm80, trtllm-sm90)"));
  if (is_awq() && engine_layout != "marlin")
    return unsupported(absl::StrCat("AWQ with engine_layout \"", engine_layout,
                                    "\" (TensorRT-LLM engines take symmetric compressed-tensors INT4 from a sync)"));
  if (!actorder.empty()) return unsupported(absl::StrCat("act-order (actorder: \"", actorder, "\")"));
  if (dynamic) return unsupported("dynamic quantization");
  if (group_size != -1 && group_size != 32 && group_size != 64 && group_size != 128)
    return unsupported(absl::StrCat("group_size ", group_size, " (supported: 32, 64, 128, -1)"));
  return absl::OkStatus();
}

absl::Status QuantizationConfig::CheckFp8Supported() const {
  auto unsupported = [](absl::string_view what) {
    return absl::UnimplementedError(
        absl::StrCat("quantization_config: ", what, " is not supported by wsync's FP8 path"));
  };
  if (!is_fp8())
    return absl::InvalidArgumentError(
        absl::StrCat("quantization_config: ", Describe(), " is not an FP8 configuration"));
  if (num_bits != 8) return unsupported(absl::StrCat("num_bits ", num_bits));
  if (is_fp8_block()) {
    if (format != "e4m3") return unsupported(absl::StrCat("fmt \"", format, "\" (supported: e4m3)"));
    if (block_n <= 0 || block_k <= 0) return unsupported("per-tensor FP8 (no weight_block_size)");
    if (!scale_fmt.empty() && scale_fmt != "ue8m0")
      return unsupported(absl::StrCat("scale_fmt \"", scale_fmt, "\" (supported: ue8m0 or absent)"));
    if (activation_scheme != "dynamic" && activation_scheme != "static")
      return unsupported(absl::StrCat("activation_scheme \"", activation_scheme, "\""));
  } else {
    if (format != "float-quantized")
      return unsupported(absl::StrCat("format \"", format, "\" (supported: float-quantized)"));
    if (strategy != "channel") return unsupported(absl::StrCat("FP8 strategy \"", strategy, "\" (supported: channel)"));
    if (!symmetric) return unsupported("asymmetric FP8 (symmetric: false)");
    if (dynamic) return unsupported("dynamic weight quantization");
    if (!actorder.empty()) return unsupported(absl::StrCat("act-order (actorder: \"", actorder, "\")"));
  }
  if (engine_layout != "fp8")
    return unsupported(absl::StrCat("engine_layout \"", engine_layout, "\" with FP8 weights (supported: fp8)"));
  return absl::OkStatus();
}

absl::Status QuantizationConfig::CheckSupported() const {
  return is_fp8() ? CheckFp8Supported() : CheckInt4Supported();
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (!moe || layer < 0 || layer >= num_hidden_layers) return false;
  if (arch == Architecture::kQwen3Moe) {
    for (int64_t l : moe->mlp_only_layers)
      if (l == layer) return false;
    return (layer + 1) % moe->decoder_sparse_step == 0;
  }
  if (arch == Architecture::kDeepseekV3) return layer >= moe->first_k_dense_replace && layer % moe->moe_layer_freq == 0;
  if (arch == Architecture::kGlm4Moe) return layer >= moe->first_k_dense_replace;  // Glm4MoeDecoderLayer
  return false;
}

namespace {

// Qwen3-MoE's expert fields, checked against the layers of `c`.
absl::StatusOr<MoeConfig> ParseQwen3MoeFields(const Fields& f, const ModelConfig& c) {
  MoeConfig m;
  ASSIGN_OR_RETURN(m.num_experts, f.Int("num_experts"));
  ASSIGN_OR_RETURN(m.num_experts_per_tok, f.Int("num_experts_per_tok"));
  ASSIGN_OR_RETURN(m.moe_intermediate_size, f.Int("moe_intermediate_size"));
  ASSIGN_OR_RETURN(m.norm_topk_prob, f.Bool("norm_topk_prob", false));
  ASSIGN_OR_RETURN(m.decoder_sparse_step, f.Int("decoder_sparse_step", 1));
  ASSIGN_OR_RETURN(m.mlp_only_layers, f.Ints("mlp_only_layers"));
  for (int64_t l : m.mlp_only_layers)
    if (l >= c.num_hidden_layers)
      return f.Error("mlp_only_layers", absl::StrCat("names layer ", l, " but the model has ", c.num_hidden_layers));
  return m;
}

// The expert fields DeepSeek-V3 and GLM-4.5 share (DeepseekV3Config, Glm4MoeConfig), with each
// class's defaults (nullopt: required), and their checks against the layers of `c`.
struct DeepseekMoeDefaults {
  std::optional<int64_t> experts, topk, moe_ffn;
  int64_t first_k_dense = 0;
  double routed_scaling_factor = 1.0;
};
absl::StatusOr<MoeConfig> ParseDeepseekStyleMoe(const Fields& f, const ModelConfig& c, const DeepseekMoeDefaults& d) {
  MoeConfig m;
  m.deepseek_routing = true;
  ASSIGN_OR_RETURN(m.num_experts, f.Int("n_routed_experts", d.experts));
  ASSIGN_OR_RETURN(m.num_experts_per_tok, f.Int("num_experts_per_tok", d.topk));
  ASSIGN_OR_RETURN(m.moe_intermediate_size, f.Int("moe_intermediate_size", d.moe_ffn));
  ASSIGN_OR_RETURN(m.num_shared_experts, f.Int("n_shared_experts", 1, 0));
  ASSIGN_OR_RETURN(m.norm_topk_prob, f.Bool("norm_topk_prob", true));
  ASSIGN_OR_RETURN(m.first_k_dense_replace, f.Int("first_k_dense_replace", d.first_k_dense, 0));
  ASSIGN_OR_RETURN(m.n_group, f.Int("n_group", 1));
  ASSIGN_OR_RETURN(m.topk_group, f.Int("topk_group", 1));
  ASSIGN_OR_RETURN(m.routed_scaling_factor, f.Number("routed_scaling_factor", d.routed_scaling_factor));
  if (m.first_k_dense_replace > c.num_hidden_layers)
    return f.Error("first_k_dense_replace",
                   absl::StrCat(m.first_k_dense_replace, " exceeds num_hidden_layers ", c.num_hidden_layers));
  if (m.num_experts % m.n_group != 0)
    return f.Error("n_group", absl::StrCat(m.n_group, " does not divide n_routed_experts ", m.num_experts));
  if (m.topk_group > m.n_group)
    return f.Error("topk_group", absl::StrCat(m.topk_group, " exceeds n_group ", m.n_group));
  return m;
}

// GLM-4.5's expert fields (transformers' Glm4MoeConfig defaults): DeepSeek-V3's routing, always
// with the e_score_correction_bias (Glm4MoeTopkRouter), dense layers before first_k_dense_replace.
absl::StatusOr<MoeConfig> ParseGlm4MoeFields(const Fields& f, const ModelConfig& c) {
  ASSIGN_OR_RETURN(MoeConfig m, ParseDeepseekStyleMoe(f, c, {128, 8, 1408, 1, 1.0}));
  m.scoring_func = "sigmoid";
  m.topk_method = "noaux_tc";
  if (m.num_shared_experts > 1)
    return f.Error("n_shared_experts", absl::StrCat(m.num_shared_experts, ": Glm4MoeMoE builds one shared MLP of ",
                                                    "moe_intermediate_size * n_shared_experts; wsync takes 0 or 1"));
  return m;
}

// DeepSeek-V3's expert and MLA fields: sets c.moe, c.mla, c.head_dim and c.num_nextn_predict_layers.
absl::Status ParseDeepseekV3Fields(const Fields& f, ModelConfig& c) {
  ASSIGN_OR_RETURN(MoeConfig m, ParseDeepseekStyleMoe(f, c, {std::nullopt, std::nullopt, std::nullopt, 0, 2.5}));
  ASSIGN_OR_RETURN(m.moe_layer_freq, f.Int("moe_layer_freq", 1));
  ASSIGN_OR_RETURN(m.scoring_func, f.String("scoring_func", "sigmoid"));
  ASSIGN_OR_RETURN(m.topk_method, f.String("topk_method", "noaux_tc"));
  if (m.scoring_func != "sigmoid" && m.scoring_func != "softmax")
    return f.Error("scoring_func", absl::StrCat("is \"", m.scoring_func, "\"; expected sigmoid or softmax"));
  c.moe = m;
  MlaConfig a;
  if (f.Has("q_lora_rank")) {
    ASSIGN_OR_RETURN(a.q_lora_rank, f.Int("q_lora_rank"));
  }
  ASSIGN_OR_RETURN(a.kv_lora_rank, f.Int("kv_lora_rank"));
  ASSIGN_OR_RETURN(a.qk_nope_head_dim, f.Int("qk_nope_head_dim"));
  ASSIGN_OR_RETURN(a.qk_rope_head_dim, f.Int("qk_rope_head_dim"));
  ASSIGN_OR_RETURN(a.v_head_dim, f.Int("v_head_dim"));
  if (a.qk_rope_head_dim % 2 != 0)
    return f.Error("qk_rope_head_dim", absl::StrCat("must be even for rotary embeddings, got ", a.qk_rope_head_dim));
  c.mla = a;
  c.head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;
  ASSIGN_OR_RETURN(c.num_nextn_predict_layers, f.Int("num_nextn_predict_layers", 0, 0));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, absl::string_view source) {
  ASSIGN_OR_RETURN(Json j, ParseJson(json_text, source));
  Fields f(j, source, "");
  ModelConfig c;
  ASSIGN_OR_RETURN(c.model_type, f.String("model_type", ""));
  ASSIGN_OR_RETURN(std::vector<std::string> archs, f.Strings("architectures"));
  if (!archs.empty()) c.architecture = archs[0];
  const ArchName* found = nullptr;
  for (const auto& a : kArchs) {
    if ((!c.architecture.empty() && c.architecture == a.class_name) ||
        (c.architecture.empty() && c.model_type == a.model_type))
      found = &a;
  }
  if (found == nullptr)
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": unsupported model (architectures ",
                     j.contains("architectures") ? j.at("architectures").dump() : "absent", ", model_type \"",
                     c.model_type, "\"); supported: ", SupportedArchs()));
  if (!c.model_type.empty() && c.model_type != found->model_type)
    return f.Error("model_type", absl::StrCat("is \"", c.model_type, "\" but architectures says ", found->class_name));
  c.arch = found->arch;
  if (c.architecture.empty()) c.architecture = found->class_name;
  c.model_type = found->model_type;

  ASSIGN_OR_RETURN(c.hidden_size, f.Int("hidden_size"));
  ASSIGN_OR_RETURN(c.num_hidden_layers, f.Int("num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_attention_heads, f.Int("num_attention_heads"));
  ASSIGN_OR_RETURN(c.num_key_value_heads, f.Int("num_key_value_heads", c.num_attention_heads));
  ASSIGN_OR_RETURN(c.intermediate_size, f.Int("intermediate_size"));
  ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size"));
  ASSIGN_OR_RETURN(c.max_position_embeddings, f.Int("max_position_embeddings", 4096));
  ASSIGN_OR_RETURN(c.rms_norm_eps, f.Number("rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(c.rope_theta, f.Number("rope_theta", 10000.0));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, f.Bool("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(std::string dtype, f.String("torch_dtype", "bfloat16"));
  auto dt = ParseTorchDType(dtype);
  if (!dt.ok() || !IsFloating(*dt))
    return f.Error("torch_dtype", absl::StrCat("is \"", dtype, "\"; expected bfloat16, float16 or float32"));
  c.dtype = *dt;
  if (c.rms_norm_eps <= 0) return f.Error("rms_norm_eps", absl::StrCat("must be positive, got ", c.rms_norm_eps));
  if (c.rope_theta <= 0) return f.Error("rope_theta", absl::StrCat("must be positive, got ", c.rope_theta));

  const bool is_qwen3 = c.arch == Architecture::kQwen3 || c.arch == Architecture::kQwen3Moe;
  const bool is_mla = c.arch == Architecture::kDeepseekV3;
  const bool is_glm = c.arch == Architecture::kGlm4Moe;
  c.qk_norm = is_qwen3;
  if (c.arch == Architecture::kQwen2) {
    c.qkv_bias = true;  // Qwen2Attention builds q/k/v with bias=True unconditionally
  } else if (!is_mla) {
    ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
    c.o_proj_bias = c.qkv_bias && !is_glm;  // Glm4MoeAttention: o_proj bias=False
  }
  // LlamaMLP builds gate/up/down_proj with bias=config.mlp_bias; the others' MLPs have none.
  if (c.arch == Architecture::kLlama) {
    ASSIGN_OR_RETURN(c.mlp_bias, f.Bool("mlp_bias", false));
  }
  if (is_glm) {
    ASSIGN_OR_RETURN(c.qk_norm, f.Bool("use_qk_norm", false));
    // transformers reads it at the top level or in rope_parameters (Glm4MoeConfig default 0.5)
    c.partial_rotary_factor = 0.5;
    if (j.contains("rope_parameters") && j.at("rope_parameters").is_object()) {
      Fields rp(j.at("rope_parameters"), source, "rope_parameters.");
      ASSIGN_OR_RETURN(c.partial_rotary_factor, rp.Number("partial_rotary_factor", c.partial_rotary_factor));
    }
    ASSIGN_OR_RETURN(c.partial_rotary_factor, f.Number("partial_rotary_factor", c.partial_rotary_factor));
  }
  // head_dim: explicit, or HF's default (Qwen3: 128; others: hidden_size / heads).
  if (f.Has("head_dim")) {
    ASSIGN_OR_RETURN(c.head_dim, f.Int("head_dim"));
  } else if (is_qwen3) {
    c.head_dim = 128;
  } else if (!is_mla) {
    if (c.hidden_size % c.num_attention_heads != 0)
      return f.Error("hidden_size", absl::StrCat(c.hidden_size, " is not divisible by num_attention_heads ",
                                                 c.num_attention_heads, " and head_dim is not given"));
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (!is_mla && c.num_attention_heads % c.num_key_value_heads != 0)
    return f.Error("num_key_value_heads",
                   absl::StrCat(c.num_key_value_heads, " does not divide num_attention_heads ", c.num_attention_heads));

  if (c.arch == Architecture::kQwen3Moe) {
    ASSIGN_OR_RETURN(c.moe, ParseQwen3MoeFields(f, c));
  } else if (is_glm) {
    ASSIGN_OR_RETURN(c.moe, ParseGlm4MoeFields(f, c));
    ASSIGN_OR_RETURN(c.num_nextn_predict_layers, f.Int("num_nextn_predict_layers", 0, 0));
  } else if (is_mla) {
    RETURN_IF_ERROR(ParseDeepseekV3Fields(f, c));
  }
  if (c.moe && c.moe->num_experts_per_tok > c.moe->num_experts)
    return f.Error("num_experts_per_tok",
                   absl::StrCat(c.moe->num_experts_per_tok, " exceeds the number of experts ", c.moe->num_experts));
  if (!is_mla && c.head_dim % 2 != 0)
    return f.Error("head_dim", absl::StrCat("must be even for rotary embeddings, got ", c.head_dim));
  if (c.partial_rotary_factor <= 0 || c.partial_rotary_factor > 1 || c.RotaryDim() % 2 != 0 || c.RotaryDim() < 2)
    return f.Error("partial_rotary_factor",
                   absl::StrCat(c.partial_rotary_factor, " of head_dim ", c.head_dim, " gives ", c.RotaryDim(),
                                " rotary dims; expected an even number >= 2"));

  if (f.Has("quantization_config")) {
    ASSIGN_OR_RETURN(c.quantization, ParseQuantizationObject(j.at("quantization_config"), source));
  }
  return c;
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoToStatus(errno, absl::StrCat("cannot read ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return ErrnoToStatus(errno, absl::StrCat("cannot read ", path));
  return ss.str();
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::string file = path;
  std::ifstream probe(path + "/config.json");
  if (probe.good()) file = path + "/config.json";
  ASSIGN_OR_RETURN(std::string text, ReadTextFile(file));
  return ParseModelConfig(text, file);
}

absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(absl::string_view json_text, absl::string_view source) {
  ASSIGN_OR_RETURN(Json j, ParseJson(json_text, source));
  if (j.contains("quantization_config")) return ParseQuantizationObject(j.at("quantization_config"), source);
  if (j.contains("architectures") || j.contains("model_type"))
    return absl::NotFoundError(absl::StrCat(source, ": the model config has no quantization_config"));
  return ParseQuantizationObject(j, source);
}

absl::StatusOr<QuantizationConfig> LoadQuantizationConfig(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  return ParseQuantizationConfig(text, path);
}

}  // namespace wsync
