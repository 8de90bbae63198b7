#include "tools/wsync-quant/quant_tool.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "model/hf_checkpoint.h"
#include "model/quant_target.h"
#include "nlohmann/json.hpp"

namespace wsync::tools {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

absl::StatusOr<json> ReadConfig(const std::string& dir) {
  ASSIGN_OR_RETURN(std::string text, ReadTextFile(dir + "/config.json"));
  RETURN_IF_ERROR(ParseModelConfig(text, dir + "/config.json").status());
  return json::parse(text);
}

// Writes `tensors` (one model.safetensors) and `config` into a temporary directory beside `out`,
// copies the other files of `in`, then renames it to `out`.
absl::Status WriteCheckpoint(const std::string& in, const std::string& out, const json& config,
                             const std::vector<std::pair<std::string, TensorView>>& tensors) {
  std::error_code ec;
  if (fs::exists(out, ec))
    return absl::AlreadyExistsError(absl::StrCat(out, " exists; wsync-quant writes a new directory"));
  const std::string tmp = out + ".tmp-wsync-quant";
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec))
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", tmp, ": ", ec.message()));
  auto fail = [&](absl::Status s) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    return s;
  };
  SafetensorsWriter writer;
  for (const auto& [name, view] : tensors)
    if (absl::Status s = writer.Add(name, view); !s.ok()) return fail(s);
  if (absl::Status s = writer.Write(tmp + "/model.safetensors"); !s.ok()) return fail(s);
  std::ofstream(tmp + "/config.json") << config.dump(2) << "\n";
  for (const fs::directory_entry& e : fs::directory_iterator(in, ec)) {
    const std::string name = e.path().filename().string();
    if (name == "config.json" || e.path().extension() == ".safetensors" || name == "model.safetensors.index.json" ||
        !e.is_regular_file())
      continue;
    fs::copy_file(e.path(), tmp + "/" + name, ec);
    if (ec) return fail(absl::PermissionDeniedError(absl::StrCat("copying ", e.path().string(), ": ", ec.message())));
  }
  fs::rename(tmp, out, ec);
  if (ec) return fail(absl::PermissionDeniedError(absl::StrCat("renaming ", tmp, " to ", out, ": ", ec.message())));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> WithoutQuantizationConfig(const std::string& config_json, const std::string& source) {
  json j = json::parse(config_json, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  j.erase("quantization_config");
  return j.dump(2) + "\n";
}

absl::Status QuantizeCheckpointFp8(const Fp8CheckpointOptions& o) {
  ASSIGN_OR_RETURN(json config, ReadConfig(o.in));
  if (config.contains("quantization_config"))
    return absl::InvalidArgumentError(absl::StrCat(
        o.in, "/config.json already has a quantization_config; wsync-quant fp8 reads a bf16 / fp16 checkpoint"));
  json q;
  if (o.channel) {
    json ignore = json::array({"lm_head", "re:.*mlp\\.gate$"});
    for (const std::string& i : o.ignore) ignore.push_back(i);
    q = {{"quant_method", "compressed-tensors"},
         {"format", "float-quantized"},
         {"quantization_status", "compressed"},
         {"ignore", ignore},
         {"config_groups",
          {{"group_0",
            {{"targets", json::array({"Linear"})},
             {"weights",
              {{"num_bits", 8}, {"type", "float"}, {"strategy", "channel"}, {"symmetric", true}, {"dynamic", false}}},
             {"input_activations",
              {{"num_bits", 8}, {"type", "float"}, {"strategy", "token"}, {"symmetric", true}, {"dynamic", true}}}}}}}};
  } else {
    q = {{"quant_method", "fp8"},
         {"fmt", "e4m3"},
         {"activation_scheme", "dynamic"},
         {"weight_block_size", json::array({o.block_n, o.block_k})},
         {"modules_to_not_convert", o.ignore}};
    if (o.ue8m0) q["scale_fmt"] = "ue8m0";
  }
  ASSIGN_OR_RETURN(QuantizationConfig quant, ParseQuantizationConfig(q.dump(), "wsync-quant fp8 options"));
  RETURN_IF_ERROR(quant.CheckFp8Supported());
  ASSIGN_OR_RETURN(model::HfCheckpoint hf, model::HfCheckpoint::Open(o.in));
  model::QuantizeOptions qo;
  qo.num_threads = o.threads;
  std::vector<model::HfTensor> owned;
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const std::string& name : hf.Names()) {
    ASSIGN_OR_RETURN(const TensorView v, hf.Get(name));
    if (v.dtype() == DType::kF8E4M3)
      return absl::InvalidArgumentError(absl::StrCat(o.in, ": ", name, " is already FP8"));
    if (!model::IsQuantTarget(name, v.shape(), quant)) {
      tensors.emplace_back(name, v);
      continue;
    }
    ASSIGN_OR_RETURN(std::vector<model::HfTensor> out, model::QuantizeHfTensor(name, v, quant, qo));
    for (model::HfTensor& t : out) owned.push_back(std::move(t));
  }
  for (const model::HfTensor& t : owned) tensors.emplace_back(t.name, t.view);
  config["quantization_config"] = q;
  return WriteCheckpoint(o.in, o.out, config, tensors);
}

absl::Status DequantizeCheckpoint(const DequantizeOptions& o) {
  ASSIGN_OR_RETURN(json config, ReadConfig(o.in));
  ASSIGN_OR_RETURN(QuantizationConfig quant, LoadQuantizationConfig(o.in + "/config.json"));
  if (!quant.is_fp8())
    return absl::InvalidArgumentError(
        absl::StrCat(o.in, "/config.json: quantization_config is ", quant.Describe(), ", not FP8"));
  ASSIGN_OR_RETURN(model::HfCheckpoint hf, model::HfCheckpoint::Open(o.in));
  ASSIGN_OR_RETURN(model::HfCheckpoint dense, model::DequantizeFp8Checkpoint(hf, quant, o.dtype, o.threads));
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const std::string& name : dense.Names()) {
    ASSIGN_OR_RETURN(const TensorView v, dense.Get(name));
    tensors.emplace_back(name, v);
  }
  config.erase("quantization_config");
  return WriteCheckpoint(o.in, o.out, config, tensors);
}

}  // namespace wsync::tools
