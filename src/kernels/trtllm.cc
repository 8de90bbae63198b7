#include "kernels/trtllm.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/int4_args.h"
#include "kernels/int4_dispatch.h"
#include "kernels/view_checks.h"

namespace wsync::kernels {
namespace {

using format::TrtllmLayout;
using internal::CheckBytes;
using internal::CheckDims;
using internal::CheckOutput;
using internal::Invalid;
using internal::Overlaps;
using internal::WithExperts;

const char* ArchName(const TrtllmOptions& o) {
  if (o.arch == TrtllmArch::kSm90) return o.w4afp8 ? "sm90 W4AFP8" : "sm90 W4A16";
  return o.w4afp8 ? "sm80 (sm89) W4AFP8" : "sm80 W4A16";
}

// §2: the layout of a weight of that rank under the options.
absl::StatusOr<TrtllmLayout> LayoutFor(absl::string_view fn, bool moe, const TrtllmOptions& o) {
  if (o.w4afp8) {
    if (!moe) {
      return Invalid(fn,
                     "W4AFP8 is specified for MoE expert stacks [E, K, N] only (TRTLLM_INT4.md §2); this weight is "
                     "dense");
    }
    return o.arch == TrtllmArch::kSm90 ? TrtllmLayout::kSm90W4AFp8 : TrtllmLayout::kSm80W4AFp8;
  }
  // MoE on sm90 runs the sm80 grouped GEMM (no Hopper specialization for bf16/fp16 x uint4).
  return (o.arch == TrtllmArch::kSm90 && !moe) ? TrtllmLayout::kSm90Dense : TrtllmLayout::kSm80W4A16;
}

absl::Status CheckKn(absl::string_view fn, absl::string_view name, int64_t k, int64_t n, const TrtllmOptions& o) {
  const int64_t kmul = o.w4afp8 ? 128 : 64;
  if (k % kmul != 0) {
    return Invalid(fn, absl::StrCat(name, ": K = ", k, " is not a multiple of ", kmul, " (K % ", kmul, " = ", k % kmul,
                                    ") as ", ArchName(o), " requires"));
  }
  if (n % 64 != 0) {
    return Invalid(fn, absl::StrCat(name, ": N = ", n, " is not a multiple of 64 (N % 64 = ", n % 64, ") as ",
                                    ArchName(o), " requires"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Shape> TrtllmWeightShapeFor(const Shape& g, const TrtllmOptions& o) {
  constexpr absl::string_view fn = "PreprocessTrtllm";
  RETURN_IF_ERROR(CheckDims(fn, "codes", g));
  const int64_t k = 8 * g[g.size() - 2], n = g.back();
  ASSIGN_OR_RETURN(const TrtllmLayout layout, LayoutFor(fn, g.size() == 3, o));
  RETURN_IF_ERROR(CheckKn(fn, "codes", k, n, o));
  if (layout == TrtllmLayout::kSm90W4AFp8) return WithExperts(g, {n, k / 2});
  return WithExperts(g, {k, n / 2});
}

absl::Status PreprocessTrtllm(const TensorView& codes, MutableTensorView out, const TrtllmOptions& o) {
  constexpr absl::string_view fn = "PreprocessTrtllm";
  if (codes.dtype() != DType::kI32) {
    return Invalid(fn, absl::StrCat("codes dtype ", SafetensorsName(codes.dtype()), " unsupported (want I32)"));
  }
  ASSIGN_OR_RETURN(const Shape want, TrtllmWeightShapeFor(codes.shape(), o));
  RETURN_IF_ERROR(CheckBytes(fn, "codes", codes.dtype(), codes.shape(), codes.nbytes(), codes.data(), 4));
  RETURN_IF_ERROR(CheckOutput(fn, "output", out, DType::kI8, want, 4));
  if (Overlaps(codes.data(), codes.nbytes(), out.data(), out.nbytes())) {
    return Invalid(fn, "codes and the output overlap");
  }
  const Shape& g = codes.shape();
  internal::TrtllmArgs a;
  a.codes = const_cast<uint32_t*>(codes.data_as<uint32_t>());  // read only (inverse = false)
  a.bytes = out.data_as<uint32_t>();
  a.experts = g.size() == 3 ? g[0] : 1;
  a.k = 8 * g[g.size() - 2];
  a.n = g.back();
  ASSIGN_OR_RETURN(a.layout, LayoutFor(fn, g.size() == 3, o));
  a.threads = internal::Threads(o);
  a.min_bytes_per_thread = internal::MinBytesPerThread(o);
  a.stream = o.cuda_stream;
  return internal::RunTrtllm(o.device, a);
}

absl::Status UnpreprocessTrtllm(const TensorView& bytes, MutableTensorView codes, const TrtllmOptions& o) {
  constexpr absl::string_view fn = "UnpreprocessTrtllm";
  if (bytes.dtype() != DType::kI8 && bytes.dtype() != DType::kU8) {
    return Invalid(fn, absl::StrCat("weight dtype ", SafetensorsName(bytes.dtype()), " unsupported (want I8)"));
  }
  RETURN_IF_ERROR(CheckDims(fn, "weight", bytes.shape()));
  const Shape& s = bytes.shape();
  const bool moe = s.size() == 3;
  ASSIGN_OR_RETURN(const TrtllmLayout layout, LayoutFor(fn, moe, o));
  const bool transposed = layout == TrtllmLayout::kSm90W4AFp8;
  const int64_t k = transposed ? 2 * s.back() : s[s.size() - 2];
  const int64_t n = transposed ? s[s.size() - 2] : 2 * s.back();
  RETURN_IF_ERROR(CheckKn(fn, "weight", k, n, o));
  RETURN_IF_ERROR(CheckBytes(fn, "weight", bytes.dtype(), s, bytes.nbytes(), bytes.data(), 4));
  RETURN_IF_ERROR(CheckOutput(fn, "codes", codes, DType::kI32, WithExperts(s, {k / 8, n}), 4));
  if (Overlaps(codes.data(), codes.nbytes(), bytes.data(), bytes.nbytes())) {
    return Invalid(fn, "the weight and the codes overlap");
  }
  internal::TrtllmArgs a;
  a.codes = codes.data_as<uint32_t>();
  a.bytes = const_cast<uint32_t*>(bytes.data_as<uint32_t>());  // read only (inverse = true)
  a.experts = moe ? s[0] : 1;
  a.k = k;
  a.n = n;
  a.layout = layout;
  a.inverse = true;
  a.threads = internal::Threads(o);
  a.min_bytes_per_thread = internal::MinBytesPerThread(o);
  a.stream = o.cuda_stream;
  return internal::RunTrtllm(o.device, a);
}

absl::StatusOr<TrtllmScaleLayout> TrtllmScaleLayoutFor(const TensorView& s, int64_t size_k, int group_size,
                                                       const TrtllmOptions& o) {
  constexpr absl::string_view fn = "TrtllmScales";
  if (s.dtype() != DType::kBF16 && s.dtype() != DType::kF16) {
    return Invalid(fn, absl::StrCat("scales dtype ", SafetensorsName(s.dtype()), " unsupported (want BF16 or F16)"));
  }
  RETURN_IF_ERROR(CheckDims(fn, "scales", s.shape()));
  ASSIGN_OR_RETURN(const TrtllmLayout layout, LayoutFor(fn, s.rank() == 3, o));
  if (size_k <= 0) return Invalid(fn, absl::StrCat("size_k = ", size_k, " must be positive"));
  ASSIGN_OR_RETURN(const int64_t g, internal::ResolveGroup(fn, group_size, size_k, /*any_divisor=*/false));
  const Shape& shape = s.shape();
  const int64_t rows = shape[shape.size() - 2], n = shape.back();
  if (rows != size_k / g) {
    return Invalid(fn, absl::StrCat("scales ", ShapeToString(shape), " have ", rows, " groups per column, but K = ",
                                    size_k, " with group size ", group_size, " gives ", size_k / g));
  }
  switch (layout) {
    case TrtllmLayout::kSm80W4AFp8: return TrtllmScaleLayout{DType::kF16, shape};
    case TrtllmLayout::kSm90W4AFp8: {
      const int il = format::TrtllmScaleInterleave(size_k, g);
      return TrtllmScaleLayout{DType::kBF16, WithExperts(shape, {rows / il, n * il})};
    }
    default: return TrtllmScaleLayout{s.dtype(), shape};
  }
}

absl::Status TrtllmScales(const TensorView& s, int64_t size_k, int group_size, MutableTensorView out,
                          const TrtllmOptions& o) {
  constexpr absl::string_view fn = "TrtllmScales";
  ASSIGN_OR_RETURN(const TrtllmScaleLayout want, TrtllmScaleLayoutFor(s, size_k, group_size, o));
  RETURN_IF_ERROR(CheckBytes(fn, "scales", s.dtype(), s.shape(), s.nbytes(), s.data(), 2));
  RETURN_IF_ERROR(CheckOutput(fn, "scales (output)", out, want.dtype, want.shape, 2));
  if (Overlaps(s.data(), s.nbytes(), out.data(), out.nbytes())) return Invalid(fn, "scales and the output overlap");
  const Shape& shape = s.shape();
  internal::TrtllmScaleArgs a;
  a.in = s.data_as<uint16_t>();
  a.in_bf16 = s.dtype() == DType::kBF16;
  a.out = out.data_as<uint16_t>();
  a.experts = shape.size() == 3 ? shape[0] : 1;
  a.rows = shape[shape.size() - 2];
  a.n = shape.back();
  ASSIGN_OR_RETURN(const TrtllmLayout layout, LayoutFor(fn, s.rank() == 3, o));
  if (layout == TrtllmLayout::kSm80W4AFp8) {
    a.mode = internal::TrtllmScaleMode::kToF16;
  } else if (layout == TrtllmLayout::kSm90W4AFp8) {
    a.mode = internal::TrtllmScaleMode::kToBf16Interleaved;
    a.interleave = static_cast<int>(want.shape.back() / a.n);
  }
  a.threads = internal::Threads(o);
  a.min_bytes_per_thread = internal::MinBytesPerThread(o);
  a.stream = o.cuda_stream;
  return internal::RunTrtllmScales(o.device, a);
}

absl::Status TrtllmZerosFromAwq(const TensorView& qzeros, const TensorView& scales, MutableTensorView out,
                                const TrtllmOptions& o) {
  constexpr absl::string_view fn = "TrtllmZerosFromAwq";
  if (o.w4afp8) return Invalid(fn, "zero points are not supported with W4AFP8 (TRTLLM_INT4.md §3.2)");
  if (scales.dtype() != DType::kBF16 && scales.dtype() != DType::kF16) {
    return Invalid(fn,
                   absl::StrCat("scales dtype ", SafetensorsName(scales.dtype()), " unsupported (want BF16 or F16)"));
  }
  RETURN_IF_ERROR(CheckDims(fn, "scales", scales.shape()));
  const Shape& s = scales.shape();
  const int64_t n = s.back();
  if (n % 8 != 0) return Invalid(fn, absl::StrCat("scales: N = ", n, " is not a multiple of 8"));
  const Shape zshape = WithExperts(s, {s[s.size() - 2], n / 8});
  if (qzeros.dtype() != DType::kI32 || qzeros.shape() != zshape) {
    return Invalid(fn, absl::StrCat("qzeros is ", SafetensorsName(qzeros.dtype()), ShapeToString(qzeros.shape()),
                                    ", want I32", ShapeToString(zshape)));
  }
  RETURN_IF_ERROR(CheckBytes(fn, "qzeros", qzeros.dtype(), zshape, qzeros.nbytes(), qzeros.data(), 4));
  RETURN_IF_ERROR(CheckBytes(fn, "scales", scales.dtype(), s, scales.nbytes(), scales.data(), 2));
  RETURN_IF_ERROR(CheckOutput(fn, "zeros (output)", out, scales.dtype(), s, 2));
  if (Overlaps(out.data(), out.nbytes(), scales.data(), scales.nbytes()) ||
      Overlaps(out.data(), out.nbytes(), qzeros.data(), qzeros.nbytes())) {
    return Invalid(fn, "the output overlaps an input");
  }
  internal::TrtllmScaleArgs a;
  a.in = scales.data_as<uint16_t>();
  a.in_bf16 = scales.dtype() == DType::kBF16;
  a.qzeros = qzeros.data_as<uint32_t>();
  a.out = out.data_as<uint16_t>();
  a.experts = s.size() == 3 ? s[0] : 1;
  a.rows = s[s.size() - 2];
  a.n = n;
  a.threads = internal::Threads(o);
  a.min_bytes_per_thread = internal::MinBytesPerThread(o);
  a.stream = o.cuda_stream;
  return internal::RunTrtllmZeros(o.device, a);
}

}  // namespace wsync::kernels
