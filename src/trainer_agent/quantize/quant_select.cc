#include "trainer_agent/quantize/quant_select.h"

#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "model/quant_target.h"

namespace wsync::trainer_agent {
namespace {

// model.layers.{i}.* with i >= num_hidden_layers: an MTP (next-n) layer (not synced unless asked).
bool IsMtpLayerTensor(absl::string_view name, int64_t num_layers) {
  if (!absl::ConsumePrefix(&name, "model.layers.")) return false;
  const size_t dot = name.find('.');
  int64_t layer = 0;
  return dot != absl::string_view::npos && absl::SimpleAtoi(name.substr(0, dot), &layer) && layer >= num_layers;
}

}  // namespace

absl::StatusOr<std::vector<model::HfTensor>> ExpectedSentTensors(const ModelConfig& model,
                                                                 const model::HfCheckpoint& hf,
                                                                 const QuantizationConfig* quant,
                                                                 const model::QuantizeOptions& options,
                                                                 int64_t mtp_num_layers) {
  if (quant != nullptr) RETURN_IF_ERROR(quant->CheckSupported());
  ASSIGN_OR_RETURN(std::vector<model::HfTensorSpec> specs, HfTensorSpecs(model, mtp_num_layers));
  std::set<std::string> known;
  for (const auto& s : specs) known.insert(s.name);
  for (const std::string& name : hf.Names()) {
    if (known.count(name) != 0) continue;
    if (name == "lm_head.weight" && model.tie_word_embeddings) continue;
    if (IsMtpLayerTensor(name, model.num_hidden_layers)) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("HF checkpoint tensor \"", name, "\" is not a tensor of ", model.architecture, " as configured"));
  }
  std::vector<model::HfTensor> out;
  out.reserve(specs.size());
  for (const model::HfTensorSpec& s : specs) {
    ASSIGN_OR_RETURN(TensorView v, hf.Get(s.name));
    if (v.shape() != s.shape)
      return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", s.name, "\" is ", v.DebugString(),
                                                     ", the config implies shape ", ShapeToString(s.shape)));
    model::HfTensor t;
    t.name = s.name;
    t.view = v;
    if (v.dtype() != s.dtype) {
      if (s.dtype != DType::kF32)
        return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", s.name, "\" is ", v.DebugString(),
                                                       ", the config implies dtype ", SafetensorsName(s.dtype)));
      ASSIGN_OR_RETURN(t.owned, WidenToF32(v));
      t.view = t.owned.view();
    }
    if (quant != nullptr && model::IsQuantTarget(s.name, s.shape, *quant)) {
      ASSIGN_OR_RETURN(std::vector<model::HfTensor> q, model::QuantizeHfTensor(s.name, t.view, *quant, options));
      for (auto& x : q) out.push_back(std::move(x));
    } else {
      out.push_back(std::move(t));
    }
  }
  return out;
}

absl::StatusOr<ExpectedSync> ExpectedSentTensorsFromDir(const std::string& hf_dir,
                                                        const std::optional<QuantizationConfig>& quant,
                                                        const model::QuantizeOptions& options, int64_t mtp_num_layers) {
  ExpectedSync out;
  ASSIGN_OR_RETURN(out.model, LoadModelConfig(hf_dir));
  ASSIGN_OR_RETURN(out.hf, model::HfCheckpoint::Open(hf_dir));
  const QuantizationConfig* q = quant ? &*quant : (out.model.quantization ? &*out.model.quantization : nullptr);
  ASSIGN_OR_RETURN(out.tensors, ExpectedSentTensors(out.model, out.hf, q, options, mtp_num_layers));
  return out;
}

}  // namespace wsync::trainer_agent
