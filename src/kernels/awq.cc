#include "kernels/awq.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/int4_args.h"
#include "kernels/int4_dispatch.h"
#include "kernels/view_checks.h"

namespace wsync::kernels {
namespace {

using internal::AwqQuantizeArgs;
using internal::AwqRepackArgs;
using internal::CheckBytes;
using internal::CheckDims;
using internal::CheckOutput;
using internal::Invalid;
using internal::Overlaps;
using internal::WithExperts;

template <typename Args>
void SetCommon(Args& a, const KernelOptions& o) {
  a.threads = internal::Threads(o);
  a.min_bytes_per_thread = internal::MinBytesPerThread(o);
  a.stream = o.cuda_stream;
}

absl::Status CheckAwqInput(const TensorView& w, int group_size, int64_t* group) {
  constexpr absl::string_view fn = "QuantizeAwq";
  if (w.dtype() != DType::kBF16 && w.dtype() != DType::kF16) {
    return Invalid(fn, absl::StrCat("W dtype ", SafetensorsName(w.dtype()), " unsupported (want BF16 or F16)"));
  }
  RETURN_IF_ERROR(CheckDims(fn, "W", w.shape()));
  const int64_t n = w.shape()[w.shape().size() - 2], k = w.shape().back();
  if (n % 8 != 0) {
    return Invalid(fn, absl::StrCat("W: N = ", n, " is not a multiple of 8 (N % 8 = ", n % 8,
                                    "): AWQ packs 8 output columns per word"));
  }
  ASSIGN_OR_RETURN(*group, internal::ResolveGroup(fn, group_size, k, /*any_divisor=*/false));
  return absl::OkStatus();
}

// An AWQ-packed [(E,) R, N/8] (or GPTQ-orientation [(E,) R/8, N]) I32 input and its dims.
struct Packed {
  int64_t experts, rows, n;
};
absl::StatusOr<Packed> CheckPacked(absl::string_view fn, absl::string_view name, const TensorView& v, bool awq,
                                   int64_t row_multiple, bool n_multiple_of_64) {
  if (v.dtype() != DType::kI32) {
    return Invalid(fn, absl::StrCat(name, " dtype ", SafetensorsName(v.dtype()), " unsupported (want I32)"));
  }
  RETURN_IF_ERROR(CheckDims(fn, name, v.shape()));
  const Shape& s = v.shape();
  Packed p;
  p.experts = s.size() == 3 ? s[0] : 1;
  p.rows = awq ? s[s.size() - 2] : 8 * s[s.size() - 2];
  p.n = awq ? 8 * s.back() : s.back();
  if (p.rows % row_multiple != 0) {
    return Invalid(fn, absl::StrCat(name, ": ", awq ? "" : "8 x ", "rows = ", p.rows, " is not a multiple of ",
                                    row_multiple, " (% ", row_multiple, " = ", p.rows % row_multiple, ")"));
  }
  if (!awq && p.n % 8 != 0) {
    return Invalid(fn, absl::StrCat(name, ": N = ", p.n, " is not a multiple of 8 (N % 8 = ", p.n % 8, ")"));
  }
  if (n_multiple_of_64 && p.n % 64 != 0) {
    return Invalid(fn, absl::StrCat(name, ": N = ", p.n, " is not a multiple of 64 (N % 64 = ", p.n % 64, ")"));
  }
  RETURN_IF_ERROR(CheckBytes(fn, name, v.dtype(), s, v.nbytes(), v.data(), 4));
  return p;
}

absl::Status RunPacked(absl::string_view fn, const TensorView& in, MutableTensorView out, const KernelOptions& o,
                       const Packed& p, const Shape& want, absl::Status (*run)(Device, const AwqRepackArgs&)) {
  RETURN_IF_ERROR(CheckOutput(fn, "output", out, DType::kI32, want, 4));
  if (Overlaps(in.data(), in.nbytes(), out.data(), out.nbytes())) {
    return Invalid(fn, "the input and the output overlap (no in-place conversion)");
  }
  AwqRepackArgs a;
  a.in = in.data_as<uint32_t>();
  a.out = out.data_as<uint32_t>();
  a.experts = p.experts;
  a.rows = p.rows;
  a.n = p.n;
  SetCommon(a, o);
  return run(o.device, a);
}

}  // namespace

absl::StatusOr<AwqShapes> AwqShapesFor(const TensorView& w, int group_size) {
  int64_t g = 0;
  RETURN_IF_ERROR(CheckAwqInput(w, group_size, &g));
  const Shape& s = w.shape();
  const int64_t n = s[s.size() - 2], k = s.back();
  return AwqShapes{WithExperts(s, {k, n / 8}), WithExperts(s, {k / g, n / 8}), WithExperts(s, {k / g, n})};
}

namespace {

// The checked argument block of QuantizeAwq.
absl::StatusOr<AwqQuantizeArgs> QuantizeAwqArgs(absl::string_view fn, const TensorView& w, MutableTensorView qweight,
                                                MutableTensorView qzeros, MutableTensorView scales,
                                                const AwqQuantizeOptions& options) {
  ASSIGN_OR_RETURN(const AwqShapes shapes, AwqShapesFor(w, options.group_size));
  const bool cuda = options.device == Device::kCuda;
  RETURN_IF_ERROR(CheckBytes(fn, "W", w.dtype(), w.shape(), w.nbytes(), w.data(), cuda ? 16 : 2));
  RETURN_IF_ERROR(CheckOutput(fn, "qweight", qweight, DType::kI32, shapes.qweight, 4));
  RETURN_IF_ERROR(CheckOutput(fn, "qzeros", qzeros, DType::kI32, shapes.qzeros, 4));
  RETURN_IF_ERROR(CheckOutput(fn, "scales", scales, w.dtype(), shapes.scales, 2));
  if (internal::AnyOverlap({{w.data(), w.nbytes()},
                            {qweight.data(), qweight.nbytes()},
                            {qzeros.data(), qzeros.nbytes()},
                            {scales.data(), scales.nbytes()}})) {
    return Invalid(fn, "W, qweight, qzeros and scales must not overlap");
  }
  AwqQuantizeArgs a;
  internal::SetWeightDims(a, w, options.group_size);
  a.arith = options.arith == AwqArith::kFp16 ? format::AwqArith::kFp16 : format::AwqArith::kFp32;
  a.qweight = qweight.data_as<uint32_t>();
  a.qzeros = qzeros.data_as<uint32_t>();
  a.scales = scales.data_as<uint16_t>();
  SetCommon(a, options);
  return a;
}

}  // namespace

absl::Status QuantizeAwq(const TensorView& w, MutableTensorView qweight, MutableTensorView qzeros,
                         MutableTensorView scales, const AwqQuantizeOptions& options) {
  ASSIGN_OR_RETURN(const AwqQuantizeArgs a, QuantizeAwqArgs("QuantizeAwq", w, qweight, qzeros, scales, options));
  return internal::RunQuantizeAwq(options.device, a);
}

absl::Status QuantizeAwq(const TensorView& w, MutableTensorView qweight, MutableTensorView qzeros,
                         MutableTensorView scales, const AwqQuantizeOptions& options, QuantizeReuse& reuse) {
  constexpr absl::string_view fn = "QuantizeAwq (reuse)";
  ASSIGN_OR_RETURN(AwqQuantizeArgs a, QuantizeAwqArgs(fn, w, qweight, qzeros, scales, options));
  if (options.device != Device::kCpu) return Invalid(fn, "reuse is for the CPU kernel only");
  const auto units = static_cast<size_t>(qzeros.nbytes() / 4);
  if (!reuse.digests.empty() && (reuse.zeros.dtype() != DType::kI32 || reuse.zeros.shape() != qzeros.shape()))
    return Invalid(fn, absl::StrCat("the earlier qzeros are ", reuse.zeros.DebugString(), ", want I32",
                                    ShapeToString(qzeros.shape())));
  RETURN_IF_ERROR(internal::CheckReuse(fn, w, qweight, scales, reuse, units, "qzeros word", &qzeros));
  if (!reuse.digests.empty()) {
    a.digests = reuse.digests.data();
    a.prev_qweight = reuse.packed.data_as<uint32_t>();
    a.prev_qzeros = reuse.zeros.data_as<uint32_t>();
    a.prev_scales = reuse.scales.data_as<uint16_t>();
  }
  a.next_digests = reuse.next_digests.data();
  a.reused = &reuse.reused_groups;
  reuse.reused_groups = 0;
  return internal::RunQuantizeAwq(options.device, a);
}

absl::Status AwqToGptq(const TensorView& awq, MutableTensorView gptq, const KernelOptions& options) {
  constexpr absl::string_view fn = "AwqToGptq";
  ASSIGN_OR_RETURN(const Packed p, CheckPacked(fn, "AWQ tensor", awq, /*awq=*/true, 8, false));
  return RunPacked(fn, awq, gptq, options, p, WithExperts(awq.shape(), {p.rows / 8, p.n}), &internal::RunAwqToGptq);
}

absl::Status GptqToAwq(const TensorView& gptq, MutableTensorView awq, const KernelOptions& options) {
  constexpr absl::string_view fn = "GptqToAwq";
  ASSIGN_OR_RETURN(const Packed p, CheckPacked(fn, "GPTQ tensor", gptq, /*awq=*/false, 8, false));
  return RunPacked(fn, gptq, awq, options, p, WithExperts(gptq.shape(), {p.rows, p.n / 8}), &internal::RunGptqToAwq);
}

absl::StatusOr<Shape> AwqMarlinShapeFor(const Shape& s) {
  constexpr absl::string_view fn = "AwqToMarlin";
  RETURN_IF_ERROR(CheckDims(fn, "AWQ qweight", s));
  const int64_t k = s[s.size() - 2], n = 8 * s.back();
  if (k % 16 != 0)
    return Invalid(fn, absl::StrCat("AWQ qweight: K = ", k, " is not a multiple of 16 (K % 16 = ", k % 16, ")"));
  if (n % 64 != 0)
    return Invalid(fn, absl::StrCat("AWQ qweight: N = ", n, " is not a multiple of 64 (N % 64 = ", n % 64, ")"));
  return WithExperts(s, {k / 16, 2 * n});
}

absl::Status AwqToMarlin(const TensorView& qweight, MutableTensorView marlin, const KernelOptions& options) {
  constexpr absl::string_view fn = "AwqToMarlin";
  ASSIGN_OR_RETURN(const Shape want, AwqMarlinShapeFor(qweight.shape()));
  ASSIGN_OR_RETURN(const Packed p, CheckPacked(fn, "AWQ qweight", qweight, /*awq=*/true, 16, true));
  return RunPacked(fn, qweight, marlin, options, p, want, &internal::RunAwqToMarlin);
}

absl::Status AwqZerosToMarlin(const TensorView& qzeros, MutableTensorView out, const KernelOptions& options) {
  constexpr absl::string_view fn = "AwqZerosToMarlin";
  ASSIGN_OR_RETURN(const Packed p, CheckPacked(fn, "AWQ qzeros", qzeros, /*awq=*/true, 1, true));
  return RunPacked(fn, qzeros, out, options, p, qzeros.shape(), &internal::RunAwqZerosToMarlin);
}

absl::Status MarlinZerosToAwq(const TensorView& marlin_zeros, MutableTensorView out, const KernelOptions& options) {
  constexpr absl::string_view fn = "MarlinZerosToAwq";
  ASSIGN_OR_RETURN(const Packed p, CheckPacked(fn, "Marlin zero points", marlin_zeros, /*awq=*/true, 1, true));
  return RunPacked(fn, marlin_zeros, out, options, p, marlin_zeros.shape(), &internal::RunMarlinZerosToAwq);
}

}  // namespace wsync::kernels
