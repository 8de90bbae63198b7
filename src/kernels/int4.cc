#include "kernels/int4.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/int4_args.h"
#include "kernels/int4_dispatch.h"
#include "kernels/view_checks.h"

namespace wsync::kernels {
namespace {

using internal::CheckBytes;
using internal::CheckDims;
using internal::CheckOutput;
using internal::Invalid;
using internal::MinBytesPerThread;
using internal::Overlaps;
using internal::QuantizeArgs;
using internal::RepackArgs;
using internal::ResolveGroup;
using internal::ScalePermArgs;
using internal::Threads;
using internal::WithExperts;

absl::Status CheckRepackDims(absl::string_view fn, absl::string_view name, int64_t k, int64_t n) {
  if (k % 16 != 0)
    return Invalid(fn, absl::StrCat(name, ": K = ", k, " is not a multiple of 16 (K % 16 = ", k % 16, ")"));
  if (n % 64 != 0)
    return Invalid(fn, absl::StrCat(name, ": N = ", n, " is not a multiple of 64 (N % 64 = ", n % 64, ")"));
  return absl::OkStatus();
}

absl::StatusOr<const int32_t*> CheckPerm(absl::string_view fn, const TensorView* perm, int64_t experts, int64_t k,
                                         bool stacked, Device device) {
  if (perm == nullptr) return nullptr;
  const Shape want = stacked ? Shape{experts, k} : Shape{k};
  if (perm->dtype() != DType::kI32 || perm->shape() != want) {
    return Invalid(fn, absl::StrCat("perm is ", SafetensorsName(perm->dtype()), ShapeToString(perm->shape()),
                                    ", want I32", ShapeToString(want)));
  }
  RETURN_IF_ERROR(CheckBytes(fn, "perm", perm->dtype(), perm->shape(), perm->nbytes(), perm->data(), 4));
  const auto* p = perm->data_as<int32_t>();
  if (device == Device::kCpu) RETURN_IF_ERROR(Annotate(internal::ValidatePerm(p, experts, k), fn));
  return p;  // CUDA: validated on a host copy by the CUDA wrapper
}

absl::Status CheckQuantizeInputs(const TensorView& w, int group_size, int64_t* group) {
  constexpr absl::string_view fn = "QuantizeInt4";
  if (w.dtype() != DType::kBF16 && w.dtype() != DType::kF16) {
    return Invalid(fn, absl::StrCat("W dtype ", SafetensorsName(w.dtype()), " unsupported (want BF16 or F16)"));
  }
  RETURN_IF_ERROR(CheckDims(fn, "W", w.shape()));
  const int64_t k = w.shape().back();
  if (k % 8 != 0) return Invalid(fn, absl::StrCat("W: K = ", k, " is not a multiple of 8 (K % 8 = ", k % 8, ")"));
  ASSIGN_OR_RETURN(*group, ResolveGroup(fn, group_size, k, /*any_divisor=*/false));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<QuantizedShapes> QuantizedShapesFor(const TensorView& w, int group_size, PackFormat format) {
  int64_t g = 0;
  RETURN_IF_ERROR(CheckQuantizeInputs(w, group_size, &g));
  const Shape& s = w.shape();
  const int64_t n = s[s.size() - 2], k = s.back();
  if (format == PackFormat::kCompressedTensors) {
    return QuantizedShapes{WithExperts(s, {n, k / 8}), WithExperts(s, {n, k / g})};
  }
  return QuantizedShapes{WithExperts(s, {k / 8, n}), WithExperts(s, {k / g, n})};
}

namespace {

// The checked arguments of QuantizeInt4 (without reuse).
absl::StatusOr<QuantizeArgs> QuantizeArgsFor(const TensorView& w, MutableTensorView packed, MutableTensorView scales,
                                             const QuantizeOptions& options) {
  constexpr absl::string_view fn = "QuantizeInt4";
  ASSIGN_OR_RETURN(const QuantizedShapes shapes, QuantizedShapesFor(w, options.group_size, options.format));
  const bool cuda = options.device == Device::kCuda;
  RETURN_IF_ERROR(CheckBytes(fn, "W", w.dtype(), w.shape(), w.nbytes(), w.data(), cuda ? 16 : 2));
  RETURN_IF_ERROR(CheckOutput(fn, "packed", packed, DType::kI32, shapes.packed, cuda ? 16 : 4));
  RETURN_IF_ERROR(CheckOutput(fn, "scales", scales, w.dtype(), shapes.scales, 2));
  if (internal::AnyOverlap(
          {{packed.data(), packed.nbytes()}, {scales.data(), scales.nbytes()}, {w.data(), w.nbytes()}})) {
    return Invalid(fn, "W, packed and scales must not overlap");
  }
  QuantizeArgs a;
  internal::SetWeightDims(a, w, options.group_size);
  a.variant = options.variant == QuantVariant::kQat ? format::Variant::kQat : format::Variant::kSlime;
  a.layout = options.format == PackFormat::kGptq ? internal::Layout::kGptq : internal::Layout::kCompressedTensors;
  a.packed = packed.data_as<uint32_t>();
  a.scales = scales.data_as<uint16_t>();
  a.threads = Threads(options);
  a.min_bytes_per_thread = MinBytesPerThread(options);
  a.stream = options.cuda_stream;
  return a;
}

}  // namespace

absl::Status QuantizeInt4(const TensorView& w, MutableTensorView packed, MutableTensorView scales,
                          const QuantizeOptions& options) {
  ASSIGN_OR_RETURN(const QuantizeArgs a, QuantizeArgsFor(w, packed, scales, options));
  return internal::RunQuantize(options.device, a);
}

absl::Status QuantizeInt4(const TensorView& w, MutableTensorView packed, MutableTensorView scales,
                          const QuantizeOptions& options, QuantizeReuse& reuse) {
  constexpr absl::string_view fn = "QuantizeInt4 (reuse)";
  if (options.device != Device::kCpu || options.format != PackFormat::kCompressedTensors)
    return Invalid(fn, "reuse is for the CPU kernel and the compressed-tensors format only");
  ASSIGN_OR_RETURN(QuantizeArgs a, QuantizeArgsFor(w, packed, scales, options));
  RETURN_IF_ERROR(
      internal::CheckReuse(fn, w, packed, scales, reuse, static_cast<size_t>(scales.nbytes() / 2), "group"));
  if (!reuse.digests.empty()) {
    a.digests = reuse.digests.data();
    a.prev_packed = reuse.packed.data_as<uint32_t>();
    a.prev_scales = reuse.scales.data_as<uint16_t>();
  }
  a.next_digests = reuse.next_digests.data();
  a.reused_groups = &reuse.reused_groups;
  reuse.reused_groups = 0;
  return internal::RunQuantize(options.device, a);
}

absl::StatusOr<Shape> MarlinShapeFor(const Shape& g) {
  constexpr absl::string_view fn = "GptqToMarlin";
  RETURN_IF_ERROR(CheckDims(fn, "GPTQ qweight", g));
  const int64_t k = 8 * g[g.size() - 2], n = g.back();
  RETURN_IF_ERROR(CheckRepackDims(fn, "GPTQ qweight", k, n));
  return WithExperts(g, {k / 16, 2 * n});
}

absl::StatusOr<Shape> GptqShapeFor(const Shape& m) {
  constexpr absl::string_view fn = "MarlinToGptq";
  RETURN_IF_ERROR(CheckDims(fn, "Marlin qweight", m));
  const int64_t k = 16 * m[m.size() - 2];
  if (m.back() % 2 != 0) return Invalid(fn, absl::StrCat("Marlin qweight: last dimension ", m.back(), " is odd"));
  const int64_t n = m.back() / 2;
  RETURN_IF_ERROR(CheckRepackDims(fn, "Marlin qweight", k, n));
  return WithExperts(m, {k / 8, n});
}

namespace {

absl::Status Repack(absl::string_view fn, bool to_marlin, const TensorView& in, const TensorView* perm,
                    MutableTensorView out, const KernelOptions& options) {
  const absl::string_view in_name = to_marlin ? "GPTQ qweight" : "Marlin qweight";
  const absl::string_view out_name = to_marlin ? "Marlin qweight (output)" : "GPTQ qweight (output)";
  if (in.dtype() != DType::kI32) {
    return Invalid(fn, absl::StrCat(in_name, " dtype ", SafetensorsName(in.dtype()), " unsupported (want I32)"));
  }
  ASSIGN_OR_RETURN(const Shape want, to_marlin ? MarlinShapeFor(in.shape()) : GptqShapeFor(in.shape()));
  const bool cuda = options.device == Device::kCuda;
  RETURN_IF_ERROR(CheckBytes(fn, in_name, in.dtype(), in.shape(), in.nbytes(), in.data(), cuda ? 16 : 4));
  RETURN_IF_ERROR(CheckOutput(fn, out_name, out, DType::kI32, want, cuda ? 16 : 4));
  if (Overlaps(in.data(), in.nbytes(), out.data(), out.nbytes())) {
    return Invalid(fn, absl::StrCat(in_name, " and the output overlap (no in-place repack)"));
  }
  const Shape& g = to_marlin ? in.shape() : want;
  RepackArgs a;
  a.experts = g.size() == 3 ? g[0] : 1;
  a.k = 8 * g[g.size() - 2];
  a.n = g.back();
  ASSIGN_OR_RETURN(a.perm, CheckPerm(fn, perm, a.experts, a.k, g.size() == 3, options.device));
  a.in = in.data_as<uint32_t>();
  a.out = out.data_as<uint32_t>();
  a.threads = Threads(options);
  a.min_bytes_per_thread = MinBytesPerThread(options);
  a.stream = options.cuda_stream;
  return to_marlin ? internal::RunGptqToMarlin(options.device, a) : internal::RunMarlinToGptq(options.device, a);
}

absl::Status ScalePerm(absl::string_view fn, bool inverse, const TensorView& s, int64_t size_k, int group_size,
                       MutableTensorView out, const KernelOptions& options) {
  if (s.dtype() != DType::kBF16 && s.dtype() != DType::kF16) {
    return Invalid(fn, absl::StrCat("scales dtype ", SafetensorsName(s.dtype()), " unsupported (want BF16 or F16)"));
  }
  RETURN_IF_ERROR(CheckDims(fn, "scales", s.shape()));
  if (size_k <= 0) return Invalid(fn, absl::StrCat("size_k = ", size_k, " must be positive"));
  ASSIGN_OR_RETURN(const int64_t g, ResolveGroup(fn, group_size, size_k, /*any_divisor=*/true));
  const Shape& shape = s.shape();
  const int64_t rows = shape[shape.size() - 2], n = shape.back();
  if (rows != size_k / g) {
    return Invalid(fn, absl::StrCat("scales ", ShapeToString(shape), " have ", rows, " groups per column, but K = ",
                                    size_k, " with group size ", group_size, " gives ", size_k / g));
  }
  if (n % 64 != 0)
    return Invalid(fn, absl::StrCat("scales: N = ", n, " is not a multiple of 64 (N % 64 = ", n % 64, ")"));
  RETURN_IF_ERROR(CheckBytes(fn, "scales", s.dtype(), shape, s.nbytes(), s.data(), 2));
  RETURN_IF_ERROR(CheckOutput(fn, "scales (output)", out, s.dtype(), shape, 2));
  if (Overlaps(s.data(), s.nbytes(), out.data(), out.nbytes())) return Invalid(fn, "scales and the output overlap");
  ScalePermArgs a;
  a.in = s.data_as<uint16_t>();
  a.out = out.data_as<uint16_t>();
  a.experts = shape.size() == 3 ? shape[0] : 1;
  a.rows = rows;
  a.n = n;
  a.channelwise = group_size == kChannelwise || g >= size_k;
  a.inverse = inverse;
  a.threads = Threads(options);
  a.min_bytes_per_thread = MinBytesPerThread(options);
  a.stream = options.cuda_stream;
  return internal::RunPermuteScales(options.device, a);
}

}  // namespace

absl::Status GptqToMarlin(const TensorView& gptq, const TensorView* perm, MutableTensorView marlin,
                          const KernelOptions& options) {
  return Repack("GptqToMarlin", true, gptq, perm, marlin, options);
}

absl::Status MarlinToGptq(const TensorView& marlin, const TensorView* perm, MutableTensorView gptq,
                          const KernelOptions& options) {
  return Repack("MarlinToGptq", false, marlin, perm, gptq, options);
}

absl::Status PermuteMarlinScales(const TensorView& scales, int64_t size_k, int group_size, MutableTensorView out,
                                 const KernelOptions& options) {
  return ScalePerm("PermuteMarlinScales", false, scales, size_k, group_size, out, options);
}

absl::Status UnpermuteMarlinScales(const TensorView& scales, int64_t size_k, int group_size, MutableTensorView out,
                                   const KernelOptions& options) {
  return ScalePerm("UnpermuteMarlinScales", true, scales, size_k, group_size, out, options);
}

}  // namespace wsync::kernels
