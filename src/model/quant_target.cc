#include "model/quant_target.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace wsync::model {

bool IsQuantTarget(absl::string_view hf_name, absl::Span<const int64_t> shape, const QuantizationConfig& config) {
  if (shape.size() != 2 || !absl::EndsWith(hf_name, ".weight")) return false;
  if (absl::EndsWith(hf_name, "embed_tokens.weight")) return false;
  return !config.IsIgnored(hf_name);
}

absl::StatusOr<std::vector<HfTensor>> QuantizeHfTensor(absl::string_view hf_name, const TensorView& w,
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
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\" (", w.DebugString(), "): K=", k,
                                                   " must be a multiple of 8 and of group_size ", config.group_size));
  ASSIGN_OR_RETURN(kernels::QuantizedShapes shapes,
                   kernels::QuantizedShapesFor(w, config.group_size, kernels::PackFormat::kCompressedTensors));
  std::vector<HfTensor> out(3);
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

}  // namespace wsync::model
