#include "trainer_agent/quantize/quant_select.h"

#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace wsync::quantize {
namespace {

// model.layers.{i}.* with i >= num_hidden_layers: an MTP (next-n) layer, not synced.
bool IsMtpLayerTensor(absl::string_view name, int64_t num_layers) {
  if (!absl::ConsumePrefix(&name, "model.layers.")) return false;
  const size_t dot = name.find('.');
  int64_t layer = 0;
  return dot != absl::string_view::npos && absl::SimpleAtoi(name.substr(0, dot), &layer) && layer >= num_layers;
}

}  // namespace

bool IsQuantTarget(absl::string_view hf_name, absl::Span<const int64_t> shape, const QuantizationConfig& config) {
  if (shape.size() != 2 || !absl::EndsWith(hf_name, ".weight")) return false;
  if (absl::EndsWith(hf_name, "embed_tokens.weight")) return false;
  return !config.IsIgnored(hf_name);
}

absl::StatusOr<std::vector<convert::HfTensor>> QuantizeHfTensor(absl::string_view hf_name, const TensorView& w,
                                                                const QuantizationConfig& config,
                                                                const QuantizeOptions& options) {
  RETURN_IF_ERROR(config.CheckInt4Supported());
  absl::string_view prefix = hf_name;
  if (!absl::ConsumeSuffix(&prefix, ".weight"))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\": not a *.weight tensor"));
  if (w.rank() != 2 || (w.dtype() != DType::kBF16 && w.dtype() != DType::kF16))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\" (", w.DebugString(),
                                                   "): INT4 targets are 2-D BF16 or F16 weights"));
  const int64_t n = w.dim(0), k = w.dim(1);
  if (k % 8 != 0 || (config.group_size != kernels::kChannelwise && k % config.group_size != 0))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\" (", w.DebugString(),
                                                   "): K=", k, " must be a multiple of 8 and of group_size ",
                                                   config.group_size));
  ASSIGN_OR_RETURN(kernels::QuantizedShapes shapes,
                   kernels::QuantizedShapesFor(w, config.group_size, kernels::PackFormat::kCompressedTensors));
  std::vector<convert::HfTensor> out(3);
  out[0].name = absl::StrCat(prefix, ".weight_packed");
  out[1].name = absl::StrCat(prefix, ".weight_scale");
  out[2].name = absl::StrCat(prefix, ".weight_shape");
  ASSIGN_OR_RETURN(out[0].owned, Tensor::Empty(DType::kI32, shapes.packed));
  ASSIGN_OR_RETURN(out[1].owned, Tensor::Empty(w.dtype(), shapes.scales));
  ASSIGN_OR_RETURN(out[2].owned, Tensor::Empty(DType::kI64, Shape{2}));
  kernels::QuantizeOptions q;
  q.group_size = config.group_size;
  q.variant = options.variant;
  q.format = kernels::PackFormat::kCompressedTensors;
  q.num_threads = options.num_threads;
  if (absl::Status s = kernels::QuantizeInt4(w, out[0].owned.mutable_view(), out[1].owned.mutable_view(), q); !s.ok())
    return Annotate(s, absl::StrCat("quantizing \"", hf_name, "\""));
  out[2].owned.data_as<int64_t>()[0] = n;
  out[2].owned.data_as<int64_t>()[1] = k;
  for (auto& t : out) t.view = t.owned.view();
  return out;
}

absl::StatusOr<std::vector<convert::HfTensor>> ExpectedSentTensors(const ModelConfig& model,
                                                                   const convert::HfCheckpoint& hf,
                                                                   const QuantizationConfig* quant,
                                                                   const QuantizeOptions& options) {
  if (quant != nullptr) RETURN_IF_ERROR(quant->CheckInt4Supported());
  ASSIGN_OR_RETURN(std::vector<convert::HfTensorSpec> specs, convert::HfTensorSpecs(model));
  std::set<std::string> known;
  for (const auto& s : specs) known.insert(s.name);
  for (const std::string& name : hf.Names()) {
    if (known.count(name) != 0) continue;
    if (name == "lm_head.weight" && model.tie_word_embeddings) continue;
    if (IsMtpLayerTensor(name, model.num_hidden_layers)) continue;
    return absl::InvalidArgumentError(absl::StrCat("HF checkpoint tensor \"", name, "\" is not a tensor of ",
                                                   model.architecture, " as configured"));
  }
  std::vector<convert::HfTensor> out;
  out.reserve(specs.size());
  for (const convert::HfTensorSpec& s : specs) {
    ASSIGN_OR_RETURN(TensorView v, hf.Get(s.name));
    if (v.shape() != s.shape)
      return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", s.name, "\" is ", v.DebugString(),
                                                     ", the config implies shape ", ShapeToString(s.shape)));
    convert::HfTensor t;
    t.name = s.name;
    t.view = v;
    if (v.dtype() != s.dtype) {
      if (s.dtype != DType::kF32)
        return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", s.name, "\" is ", v.DebugString(),
                                                       ", the config implies dtype ", SafetensorsName(s.dtype)));
      ASSIGN_OR_RETURN(t.owned, convert::WidenToF32(v));
      t.view = t.owned.view();
    }
    if (quant != nullptr && IsQuantTarget(s.name, s.shape, *quant)) {
      ASSIGN_OR_RETURN(std::vector<convert::HfTensor> q, QuantizeHfTensor(s.name, t.view, *quant, options));
      for (auto& x : q) out.push_back(std::move(x));
    } else {
      out.push_back(std::move(t));
    }
  }
  return out;
}

absl::StatusOr<ExpectedSync> ExpectedSentTensorsFromDir(const std::string& hf_dir,
                                                        const std::optional<QuantizationConfig>& quant,
                                                        const QuantizeOptions& options) {
  ExpectedSync out;
  ASSIGN_OR_RETURN(out.model, LoadModelConfig(hf_dir));
  ASSIGN_OR_RETURN(out.hf, convert::HfCheckpoint::Open(hf_dir));
  const QuantizationConfig* q = quant ? &*quant : (out.model.quantization ? &*out.model.quantization : nullptr);
  ASSIGN_OR_RETURN(out.tensors, ExpectedSentTensors(out.model, out.hf, q, options));
  return out;
}

}  // namespace wsync::quantize
