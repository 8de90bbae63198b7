#include "model/quant_target.h"

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/dtype.h"
#include "common/status.h"

namespace wsync::model {

bool IsQuantTarget(absl::string_view hf_name, absl::Span<const int64_t> shape, const QuantizationConfig& config) {
  if (shape.size() != 2 || !absl::EndsWith(hf_name, ".weight")) return false;
  if (absl::EndsWith(hf_name, "embed_tokens.weight")) return false;
  // An MTP layer's eh_proj: SGLang's NextN models build it as a plain nn.Linear, which loads only
  // a bf16 weight (MEGATRON_TO_HF.md §5.7), whatever the ignore list says
  if (absl::EndsWith(hf_name, ".eh_proj.weight")) return false;
  return !config.IsIgnored(hf_name);
}

std::vector<std::string> QuantizedNames(absl::string_view prefix, const QuantizationConfig& config) {
  if (config.is_fp8_block()) return {absl::StrCat(prefix, ".weight"), absl::StrCat(prefix, ".weight_scale_inv")};
  if (config.is_fp8_channel()) return {absl::StrCat(prefix, ".weight"), absl::StrCat(prefix, ".weight_scale")};
  if (config.is_awq())
    return {absl::StrCat(prefix, ".qweight"), absl::StrCat(prefix, ".qzeros"), absl::StrCat(prefix, ".scales")};
  return {absl::StrCat(prefix, ".weight_packed"), absl::StrCat(prefix, ".weight_scale"),
          absl::StrCat(prefix, ".weight_shape")};
}

namespace {

absl::StatusOr<std::vector<HfTensor>> QuantizeAwqTensor(absl::string_view hf_name, absl::string_view prefix,
                                                        const TensorView& w, const QuantizationConfig& config,
                                                        const QuantizeOptions& options) {
  const int64_t n = w.dim(0), k = w.dim(1);
  if (n % 8 != 0 || (config.group_size != kernels::kChannelwise && k % config.group_size != 0))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\" (", w.DebugString(),
                                                   ") to AWQ: N=", n, " must be a multiple of 8 and K=", k,
                                                   " a multiple of group_size ", config.group_size));
  ASSIGN_OR_RETURN(kernels::AwqShapes shapes, kernels::AwqShapesFor(w, config.group_size));
  const std::vector<std::string> names = QuantizedNames(prefix, config);
  std::vector<HfTensor> out(3);
  for (size_t i = 0; i < 3; ++i) out[i].name = names[i];
  ASSIGN_OR_RETURN(out[0].owned, Tensor::Empty(DType::kI32, shapes.qweight));
  ASSIGN_OR_RETURN(out[1].owned, Tensor::Empty(DType::kI32, shapes.qzeros));
  ASSIGN_OR_RETURN(out[2].owned, Tensor::Empty(w.dtype(), shapes.scales));
  kernels::AwqQuantizeOptions q;
  q.group_size = config.group_size;
  q.arith = options.awq_arith;
  q.num_threads = options.num_threads;
  if (absl::Status s = kernels::QuantizeAwq(w, out[0].owned.mutable_view(), out[1].owned.mutable_view(),
                                            out[2].owned.mutable_view(), q);
      !s.ok())
    return Annotate(s, absl::StrCat("quantizing \"", hf_name, "\" to AWQ"));
  for (auto& t : out) t.view = t.owned.view();
  return out;
}

absl::StatusOr<std::vector<HfTensor>> QuantizeFp8Tensor(absl::string_view hf_name, absl::string_view prefix,
                                                        const TensorView& w, const QuantizationConfig& config,
                                                        const QuantizeOptions& options) {
  ASSIGN_OR_RETURN(Fp8Shapes shapes, Fp8ShapesFor(w, config, options));
  const std::vector<std::string> names = QuantizedNames(prefix, config);
  std::vector<HfTensor> out(2);
  for (size_t i = 0; i < 2; ++i) out[i].name = names[i];
  ASSIGN_OR_RETURN(out[0].owned, Tensor::Empty(DType::kF8E4M3, w.shape()));
  ASSIGN_OR_RETURN(out[1].owned, Tensor::Empty(shapes.scale_dtype, shapes.scale));
  if (absl::Status s = QuantizeFp8(w, out[0].owned.mutable_view(), out[1].owned.mutable_view(), config, options);
      !s.ok())
    return Annotate(s, absl::StrCat("quantizing \"", hf_name, "\" to FP8"));
  for (auto& t : out) t.view = t.owned.view();
  return out;
}

}  // namespace

absl::StatusOr<Fp8Shapes> Fp8ShapesFor(const TensorView& w, const QuantizationConfig& config,
                                       const QuantizeOptions& options) {
  Fp8Shapes out;
  if (config.is_fp8_block()) {
    ASSIGN_OR_RETURN(out.scale, kernels::Fp8BlockScaleShape(w.shape(), config.block_n, config.block_k));
    return out;
  }
  if (!config.is_fp8_channel())
    return absl::InvalidArgumentError(absl::StrCat("Fp8ShapesFor: ", config.Describe(), " is not FP8"));
  out.scale = w.shape();
  if (!out.scale.empty()) out.scale.back() = 1;
  if (options.fp8_channel == kernels::Fp8ChannelVariant::kCompressedTensors) out.scale_dtype = w.dtype();
  return out;
}

absl::Status QuantizeFp8(const TensorView& w, MutableTensorView q, MutableTensorView scale,
                         const QuantizationConfig& config, const QuantizeOptions& options,
                         kernels::QuantizeReuse* reuse) {
  if (config.is_fp8_block()) {
    kernels::Fp8BlockOptions o;
    o.block_n = config.block_n;
    o.block_k = config.block_k;
    o.variant = Fp8BlockVariantFor(config, options);
    o.num_threads = options.num_threads;
    o.device = options.device;
    return reuse != nullptr ? kernels::QuantizeFp8Block(w, q, scale, o, *reuse)
                            : kernels::QuantizeFp8Block(w, q, scale, o);
  }
  kernels::Fp8ChannelOptions o;
  o.variant = options.fp8_channel;
  o.num_threads = options.num_threads;
  o.device = options.device;
  return reuse != nullptr ? kernels::QuantizeFp8Channel(w, q, scale, o, *reuse)
                          : kernels::QuantizeFp8Channel(w, q, scale, o);
}

kernels::Fp8BlockVariant Fp8BlockVariantFor(const QuantizationConfig& config, const QuantizeOptions& options) {
  if (options.fp8_block) return *options.fp8_block;
  return config.scale_fmt == "ue8m0" ? kernels::Fp8BlockVariant::kUe8m0 : kernels::Fp8BlockVariant::kSlime;
}

absl::StatusOr<HfCheckpoint> DequantizeFp8Checkpoint(const HfCheckpoint& fp8, const QuantizationConfig& q, DType dtype,
                                                     int num_threads) {
  RETURN_IF_ERROR(q.CheckFp8Supported());
  if (dtype != DType::kBF16 && dtype != DType::kF16)
    return absl::InvalidArgumentError("DequantizeFp8Checkpoint: the output dtype must be BF16 or F16");
  const absl::string_view suffix = q.is_fp8_block() ? "_scale_inv" : "_scale";
  HfCheckpoint out;
  kernels::KernelOptions ko;
  ko.num_threads = num_threads;
  for (const std::string& name : fp8.Names()) {
    ASSIGN_OR_RETURN(const TensorView v, fp8.Get(name));
    absl::string_view base = name;
    if (absl::ConsumeSuffix(&base, suffix) && absl::EndsWith(base, ".weight") && fp8.Contains(base)) {
      ASSIGN_OR_RETURN(const TensorView w, fp8.Get(base));
      if (w.dtype() == DType::kF8E4M3) continue;  // consumed with its weight
    }
    if (v.dtype() != DType::kF8E4M3) {
      ASSIGN_OR_RETURN(Tensor copy, Tensor::CopyOf(v));
      RETURN_IF_ERROR(out.Add(name, std::move(copy)));
      continue;
    }
    const std::string sname = absl::StrCat(name, suffix);
    if (!absl::EndsWith(name, ".weight") || !fp8.Contains(sname))
      return absl::InvalidArgumentError(
          absl::StrCat("FP8 tensor \"", name, "\" (", v.DebugString(), ") has no \"", sname, "\" to dequantize it"));
    ASSIGN_OR_RETURN(const TensorView sv, fp8.Get(sname));
    Tensor wide;  // the engines hold scales in F32; a BF16 / F16 one widens exactly
    TensorView scale = sv;
    if (sv.dtype() == DType::kBF16 || sv.dtype() == DType::kF16) {
      ASSIGN_OR_RETURN(wide, Tensor::Empty(DType::kF32, sv.shape()));
      for (int64_t i = 0; i < sv.numel(); ++i) {
        uint16_t h;
        std::memcpy(&h, sv.bytes().data() + 2 * i, 2);
        wide.data_as<float>()[i] = sv.dtype() == DType::kBF16 ? BF16ToF32(h) : F16ToF32(h);
      }
      scale = wide.view();
    }
    ASSIGN_OR_RETURN(Tensor f32, Tensor::Empty(DType::kF32, v.shape()));
    absl::Status st = q.is_fp8_block()
                          ? kernels::DequantizeFp8Block(v, scale, q.block_n, q.block_k, f32.mutable_view(), ko)
                          : kernels::DequantizeFp8Channel(v, scale, f32.mutable_view(), ko);
    if (!st.ok()) return Annotate(st, absl::StrCat("dequantizing \"", name, "\""));
    ASSIGN_OR_RETURN(Tensor narrow, Tensor::Empty(dtype, v.shape()));
    const float* src = f32.data_as<float>();
    uint16_t* dst = narrow.data_as<uint16_t>();
    for (int64_t i = 0; i < v.numel(); ++i) dst[i] = dtype == DType::kBF16 ? F32ToBF16(src[i]) : F32ToF16(src[i]);
    RETURN_IF_ERROR(out.Add(name, std::move(narrow)));
  }
  return out;
}

absl::StatusOr<std::vector<HfTensor>> QuantizeHfTensor(absl::string_view hf_name, const TensorView& w,
                                                       const QuantizationConfig& config,
                                                       const QuantizeOptions& options) {
  RETURN_IF_ERROR(config.CheckSupported());
  absl::string_view prefix = hf_name;
  if (!absl::ConsumeSuffix(&prefix, ".weight"))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\": not a *.weight tensor"));
  if (w.rank() != 2 || (w.dtype() != DType::kBF16 && w.dtype() != DType::kF16))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\" (", w.DebugString(),
                                                   "): quantized targets are 2-D BF16 or F16 weights"));
  if (config.is_fp8()) return QuantizeFp8Tensor(hf_name, prefix, w, config, options);
  if (config.is_awq()) return QuantizeAwqTensor(hf_name, prefix, w, config, options);
  const int64_t n = w.dim(0), k = w.dim(1);
  if (k % 8 != 0 || (config.group_size != kernels::kChannelwise && k % config.group_size != 0))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", hf_name, "\" (", w.DebugString(), "): K=", k,
                                                   " must be a multiple of 8 and of group_size ", config.group_size));
  ASSIGN_OR_RETURN(kernels::QuantizedShapes shapes,
                   kernels::QuantizedShapesFor(w, config.group_size, kernels::PackFormat::kCompressedTensors));
  const std::vector<std::string> names = QuantizedNames(prefix, config);
  std::vector<HfTensor> out(3);
  for (size_t i = 0; i < 3; ++i) out[i].name = names[i];
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
