#include "kernels/fp8.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/fp8_args.h"
#include "kernels/int4_dispatch.h"
#include "kernels/view_checks.h"

namespace wsync::kernels {
namespace {

using internal::CheckBytes;
using internal::CheckDims;
using internal::CheckOutput;
using internal::Invalid;

absl::Status CheckWeight(absl::string_view fn, const TensorView& w) {
  if (w.dtype() != DType::kBF16 && w.dtype() != DType::kF16)
    return Invalid(fn, absl::StrCat("W dtype ", SafetensorsName(w.dtype()), " unsupported (want BF16 or F16)"));
  return CheckDims(fn, "W", w.shape());
}

absl::Status CheckBlock(absl::string_view fn, int64_t bn, int64_t bk) {
  if (bn < 1 || bk < 1 || bn > (int64_t{1} << 20) || bk > (int64_t{1} << 20))
    return Invalid(fn,
                   absl::StrCat("block sizes ", bn, " x ", bk, " (want 1 .. 2^20 each; checkpoints use 128 x 128)"));
  return absl::OkStatus();
}

void SetDims(const Shape& s, int64_t* experts, int64_t* n, int64_t* k) {
  *experts = s.size() == 3 ? s[0] : 1;
  *n = s[s.size() - 2];
  *k = s.back();
}

bool Overlap3(const void* a, size_t na, const void* b, size_t nb, const void* c, size_t nc) {
  return internal::AnyOverlap({{a, na}, {b, nb}, {c, nc}});
}

format::Fp8BlockVariant ToFormat(Fp8BlockVariant v) {
  switch (v) {
    case Fp8BlockVariant::kSlime: return format::Fp8BlockVariant::kSlime;
    case Fp8BlockVariant::kVllm: return format::Fp8BlockVariant::kVllm;
    case Fp8BlockVariant::kUe8m0: return format::Fp8BlockVariant::kUe8m0;
  }
  return format::Fp8BlockVariant::kSlime;
}

// The arguments both quantizers share.
internal::Fp8QuantizeArgs QuantizeArgsFor(const TensorView& w, MutableTensorView q, void* scales,
                                          const KernelOptions& o) {
  internal::Fp8QuantizeArgs a;
  a.w = w.data_as<uint16_t>();
  a.is_bf16 = w.dtype() == DType::kBF16;
  SetDims(w.shape(), &a.experts, &a.n, &a.k);
  a.q = q.data_as<uint8_t>();
  a.scales = scales;
  a.threads = internal::Threads(o);
  a.min_bytes_per_thread = internal::MinBytesPerThread(o);
  a.stream = o.cuda_stream;
  return a;
}

int ScaleKind(DType t) { return t == DType::kF32 ? 0 : t == DType::kBF16 ? 1 : 2; }

}  // namespace

absl::StatusOr<Shape> Fp8BlockScaleShape(const Shape& w, int64_t block_n, int64_t block_k) {
  constexpr absl::string_view fn = "QuantizeFp8Block";
  RETURN_IF_ERROR(CheckDims(fn, "W", w));
  RETURN_IF_ERROR(CheckBlock(fn, block_n, block_k));
  const int64_t n = w[w.size() - 2], k = w.back();
  return internal::WithExperts(w, {(n + block_n - 1) / block_n, (k + block_k - 1) / block_k});
}

namespace {

// The checked argument blocks of QuantizeFp8Block / QuantizeFp8Channel.
absl::StatusOr<internal::Fp8QuantizeArgs> BlockArgs(absl::string_view fn, const TensorView& w, MutableTensorView q,
                                                    MutableTensorView scale_inv, const Fp8BlockOptions& options) {
  RETURN_IF_ERROR(CheckWeight(fn, w));
  ASSIGN_OR_RETURN(const Shape scale_shape, Fp8BlockScaleShape(w.shape(), options.block_n, options.block_k));
  RETURN_IF_ERROR(CheckBytes(fn, "W", w.dtype(), w.shape(), w.nbytes(), w.data(), 2));
  RETURN_IF_ERROR(CheckOutput(fn, "q", q, DType::kF8E4M3, w.shape(), 1));
  RETURN_IF_ERROR(CheckOutput(fn, "scale_inv", scale_inv, DType::kF32, scale_shape, 4));
  if (Overlap3(w.data(), w.nbytes(), q.data(), q.nbytes(), scale_inv.data(), scale_inv.nbytes()))
    return Invalid(fn, "W, q and scale_inv must not overlap");
  internal::Fp8QuantizeArgs a = QuantizeArgsFor(w, q, scale_inv.data(), options);
  a.block = true;
  a.bn = options.block_n;
  a.bk = options.block_k;
  a.block_variant = ToFormat(options.variant);
  return a;
}

absl::StatusOr<internal::Fp8QuantizeArgs> ChannelArgs(absl::string_view fn, const TensorView& w, MutableTensorView q,
                                                      MutableTensorView scale, const Fp8ChannelOptions& options) {
  RETURN_IF_ERROR(CheckWeight(fn, w));
  RETURN_IF_ERROR(CheckBytes(fn, "W", w.dtype(), w.shape(), w.nbytes(), w.data(), 2));
  RETURN_IF_ERROR(CheckOutput(fn, "q", q, DType::kF8E4M3, w.shape(), 1));
  const bool ct = options.variant == Fp8ChannelVariant::kCompressedTensors;
  const Shape& s = w.shape();
  RETURN_IF_ERROR(CheckOutput(fn, "scale", scale, ct ? w.dtype() : DType::kF32,
                              internal::WithExperts(s, {s[s.size() - 2], 1}), ct ? 2 : 4));
  if (Overlap3(w.data(), w.nbytes(), q.data(), q.nbytes(), scale.data(), scale.nbytes()))
    return Invalid(fn, "W, q and scale must not overlap");
  internal::Fp8QuantizeArgs a = QuantizeArgsFor(w, q, scale.data(), options);
  a.block = false;
  a.channel_variant = ct ? format::Fp8ChannelVariant::kCompressedTensors : format::Fp8ChannelVariant::kSlime;
  return a;
}

// Runs `a` (W, q and scale already checked): plainly, or with `reuse` (one unit per scale).
absl::Status Run(absl::string_view fn, absl::StatusOr<internal::Fp8QuantizeArgs> a, const TensorView& w,
                 const MutableTensorView& q, const MutableTensorView& scale, Device device, QuantizeReuse* reuse) {
  if (!a.ok()) return a.status();
  if (reuse == nullptr) return internal::RunFp8Quantize(device, *a);
  if (device != Device::kCpu) return Invalid(fn, "reuse is for the CPU kernel only");
  RETURN_IF_ERROR(internal::CheckReuse(
      fn, w, q, scale, *reuse, static_cast<size_t>(scale.nbytes() / ItemSize(scale.dtype())), "scale (block or row)"));
  if (!reuse->digests.empty()) {
    a->digests = reuse->digests.data();
    a->prev_q = reuse->packed.data_as<uint8_t>();
    a->prev_scales = reuse->scales.data();
  }
  a->next_digests = reuse->next_digests.data();
  a->reused = &reuse->reused_groups;
  reuse->reused_groups = 0;
  return internal::RunFp8Quantize(device, *a);
}

constexpr absl::string_view kBlock = "QuantizeFp8Block", kBlockReuse = "QuantizeFp8Block (reuse)";
constexpr absl::string_view kChannel = "QuantizeFp8Channel", kChannelReuse = "QuantizeFp8Channel (reuse)";

}  // namespace

absl::Status QuantizeFp8Block(const TensorView& w, MutableTensorView q, MutableTensorView scale_inv,
                              const Fp8BlockOptions& options) {
  return Run(kBlock, BlockArgs(kBlock, w, q, scale_inv, options), w, q, scale_inv, options.device, nullptr);
}

absl::Status QuantizeFp8Block(const TensorView& w, MutableTensorView q, MutableTensorView scale_inv,
                              const Fp8BlockOptions& options, QuantizeReuse& reuse) {
  return Run(kBlockReuse, BlockArgs(kBlockReuse, w, q, scale_inv, options), w, q, scale_inv, options.device, &reuse);
}

absl::Status QuantizeFp8Channel(const TensorView& w, MutableTensorView q, MutableTensorView scale,
                                const Fp8ChannelOptions& options) {
  return Run(kChannel, ChannelArgs(kChannel, w, q, scale, options), w, q, scale, options.device, nullptr);
}

absl::Status QuantizeFp8Channel(const TensorView& w, MutableTensorView q, MutableTensorView scale,
                                const Fp8ChannelOptions& options, QuantizeReuse& reuse) {
  return Run(kChannelReuse, ChannelArgs(kChannelReuse, w, q, scale, options), w, q, scale, options.device, &reuse);
}

namespace {

absl::Status Dequantize(absl::string_view fn, const TensorView& q, const TensorView& scale, bool block, int64_t bn,
                        int64_t bk, MutableTensorView out, const KernelOptions& options) {
  if (q.dtype() != DType::kF8E4M3)
    return Invalid(fn, absl::StrCat("q dtype ", SafetensorsName(q.dtype()), " (want F8_E4M3)"));
  RETURN_IF_ERROR(CheckDims(fn, "q", q.shape()));
  RETURN_IF_ERROR(CheckBytes(fn, "q", q.dtype(), q.shape(), q.nbytes(), q.data(), 1));
  const Shape& s = q.shape();
  Shape want;
  if (block) {
    ASSIGN_OR_RETURN(want, Fp8BlockScaleShape(s, bn, bk));
    if (scale.dtype() != DType::kF32 || scale.shape() != want)
      return Invalid(fn, absl::StrCat("scale_inv is ", SafetensorsName(scale.dtype()), ShapeToString(scale.shape()),
                                      ", want F32", ShapeToString(want)));
  } else {
    want = internal::WithExperts(s, {s[s.size() - 2], 1});
    if (!IsFloating(scale.dtype()) || scale.shape() != want)
      return Invalid(fn, absl::StrCat("scale is ", SafetensorsName(scale.dtype()), ShapeToString(scale.shape()),
                                      ", want F32, BF16 or F16", ShapeToString(want)));
  }
  RETURN_IF_ERROR(
      CheckBytes(fn, "scale", scale.dtype(), scale.shape(), scale.nbytes(), scale.data(), ItemSize(scale.dtype())));
  if (out.dtype() != DType::kF32 && out.dtype() != DType::kBF16)
    return Invalid(fn, absl::StrCat("out dtype ", SafetensorsName(out.dtype()), " (want F32 or BF16)"));
  RETURN_IF_ERROR(CheckOutput(fn, "out", out, out.dtype(), s, ItemSize(out.dtype())));
  if (Overlap3(q.data(), q.nbytes(), scale.data(), scale.nbytes(), out.data(), out.nbytes()))
    return Invalid(fn, "q, scale and out must not overlap");
  internal::Fp8DequantizeArgs a;
  a.q = q.data_as<uint8_t>();
  a.scales = scale.data();
  a.scale_kind = ScaleKind(scale.dtype());
  SetDims(s, &a.experts, &a.n, &a.k);
  a.block = block;
  a.bn = bn;
  a.bk = bk;
  a.out = out.data();
  a.out_bf16 = out.dtype() == DType::kBF16;
  a.threads = internal::Threads(options);
  a.min_bytes_per_thread = internal::MinBytesPerThread(options);
  a.stream = options.cuda_stream;
  return internal::RunFp8Dequantize(options.device, a);
}

}  // namespace

absl::Status DequantizeFp8Block(const TensorView& q, const TensorView& scale_inv, int64_t block_n, int64_t block_k,
                                MutableTensorView out, const KernelOptions& options) {
  return Dequantize("DequantizeFp8Block", q, scale_inv, true, block_n, block_k, out, options);
}

absl::Status DequantizeFp8Channel(const TensorView& q, const TensorView& scale, MutableTensorView out,
                                  const KernelOptions& options) {
  return Dequantize("DequantizeFp8Channel", q, scale, false, 0, 0, out, options);
}

}  // namespace wsync::kernels
