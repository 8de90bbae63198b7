// Internal: the argument checks every public kernel entry point (int4.cc, awq.cc, trtllm.cc) runs
// before building its device-neutral argument block: sizes, dtypes, shapes, alignment, overlap,
// group sizes, thread counts. Not a public API.
// Errors: kInvalidArgument "<fn>: <what>, <values>". Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/int4.h"

namespace wsync::kernels::internal {

inline absl::Status Invalid(absl::string_view fn, absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat(fn, ": ", msg));
}

inline int Threads(const KernelOptions& o) {
  if (o.num_threads > 0) return o.num_threads;
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

// With the automatic thread count, each thread gets at least this much input: below it, starting
// a thread costs more than it saves. An explicit num_threads is used as given.
inline int64_t MinBytesPerThread(const KernelOptions& o) { return o.num_threads > 0 ? 0 : int64_t{1} << 20; }

// Size, alignment and device-independent sanity of one view.
inline absl::Status CheckBytes(absl::string_view fn, absl::string_view name, DType dtype, const Shape& shape,
                               size_t nbytes, const void* data, size_t alignment) {
  ASSIGN_OR_RETURN(const int64_t want, NumBytes(dtype, shape));
  if (static_cast<size_t>(want) != nbytes) {
    return Invalid(fn, absl::StrCat(name, " ", SafetensorsName(dtype), ShapeToString(shape), " needs ", want,
                                    " bytes but the view has ", nbytes));
  }
  if (want > 0 && data == nullptr) return Invalid(fn, absl::StrCat(name, " has no data"));
  if (reinterpret_cast<uintptr_t>(data) % alignment != 0) {
    return Invalid(fn, absl::StrCat(name, " data pointer ", reinterpret_cast<uintptr_t>(data), " is not ", alignment,
                                    "-byte aligned"));
  }
  return absl::OkStatus();
}

inline absl::Status CheckOutput(absl::string_view fn, absl::string_view name, const MutableTensorView& v, DType dtype,
                                const Shape& shape, size_t alignment) {
  if (v.dtype() != dtype || v.shape() != shape) {
    return Invalid(fn, absl::StrCat(name, " is ", SafetensorsName(v.dtype()), ShapeToString(v.shape()), ", want ",
                                    SafetensorsName(dtype), ShapeToString(shape)));
  }
  return CheckBytes(fn, name, v.dtype(), v.shape(), v.nbytes(), v.data(), alignment);
}

inline bool Overlaps(const void* a, size_t na, const void* b, size_t nb) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

inline absl::Status CheckDims(absl::string_view fn, absl::string_view name, const Shape& shape) {
  if (shape.size() != 2 && shape.size() != 3) {
    return Invalid(fn, absl::StrCat(name, " must have rank 2 or 3 (stacked experts), got ", ShapeToString(shape)));
  }
  for (int64_t d : shape) {
    if (d <= 0) return Invalid(fn, absl::StrCat(name, " has an empty or negative dimension: ", ShapeToString(shape)));
  }
  return absl::OkStatus();
}

inline Shape WithExperts(const Shape& like, std::initializer_list<int64_t> tail) {
  Shape s;
  if (like.size() == 3) s.push_back(like[0]);
  for (int64_t d : tail) s.push_back(d);
  return s;
}

// Resolves G (-1 -> K) and checks it against K.
inline absl::StatusOr<int64_t> ResolveGroup(absl::string_view fn, int group_size, int64_t k, bool any_divisor) {
  if (group_size == kChannelwise) return k;
  const bool listed = group_size == 32 || group_size == 64 || group_size == 128;
  if (!listed && !(any_divisor && group_size > 0)) {
    return Invalid(fn, absl::StrCat("group size ", group_size, " unsupported (want 32, 64, 128 or -1)"));
  }
  if (k % group_size != 0) {
    return Invalid(fn, absl::StrCat("K = ", k, " is not a multiple of the group size ", group_size,
                                    " (K % G = ", k % group_size, ")"));
  }
  return static_cast<int64_t>(group_size);
}

// True when any two of the (pointer, size) ranges overlap.
inline bool AnyOverlap(std::initializer_list<std::pair<const void*, size_t>> ranges) {
  for (auto i = ranges.begin(); i != ranges.end(); ++i) {
    for (auto j = i + 1; j != ranges.end(); ++j) {
      if (Overlaps(i->first, i->second, j->first, j->second)) return true;
    }
  }
  return false;
}

// The checks of a quantizer's `reuse` (QuantizeReuse, int4.h) for W and its outputs `codes` and
// `scales` (and AWQ's `zeros`), of `units` digests (one per `unit`: group, block or row): next_digests of one each, not
// overlapping W or the outputs; digests empty or of that size; the earlier outputs of the
// outputs' dtypes and shapes, overlapping nothing.
inline absl::Status CheckReuse(absl::string_view fn, const TensorView& w, const MutableTensorView& codes,
                               const MutableTensorView& scales, const QuantizeReuse& reuse, size_t units,
                               absl::string_view unit, const MutableTensorView* zeros = nullptr) {
  const std::pair<const void*, size_t> z = zeros != nullptr
                                               ? std::pair<const void*, size_t>{zeros->data(), zeros->nbytes()}
                                               : std::pair<const void*, size_t>{nullptr, 0};
  if (reuse.next_digests.size() != units)
    return Invalid(fn, absl::StrCat("next_digests holds ", reuse.next_digests.size(), " entries, want one per ", unit,
                                    " (", units, ")"));
  if (AnyOverlap({{reuse.next_digests.data(), reuse.next_digests.size_bytes()},
                  {codes.data(), codes.nbytes()},
                  {scales.data(), scales.nbytes()},
                  z,
                  {w.data(), w.nbytes()}}))
    return Invalid(fn, "next_digests must not overlap W or the outputs");
  if (reuse.digests.empty()) return absl::OkStatus();
  if (reuse.digests.size() != units)
    return Invalid(fn, absl::StrCat("digests holds ", reuse.digests.size(), " entries, want ", units));
  if (reuse.packed.dtype() != codes.dtype() || reuse.packed.shape() != codes.shape() ||
      reuse.scales.dtype() != scales.dtype() || reuse.scales.shape() != scales.shape())
    return Invalid(fn, absl::StrCat("the earlier outputs are ", reuse.packed.DebugString(), " and ",
                                    reuse.scales.DebugString(), ", want the outputs' dtypes and shapes"));
  if (AnyOverlap({{codes.data(), codes.nbytes()},
                  {scales.data(), scales.nbytes()},
                  z,
                  {reuse.zeros.data(), reuse.zeros.nbytes()},
                  {reuse.packed.data(), reuse.packed.nbytes()},
                  {reuse.scales.data(), reuse.scales.nbytes()},
                  {reuse.next_digests.data(), reuse.next_digests.size_bytes()},
                  {reuse.digests.data(), reuse.digests.size_bytes()},
                  {w.data(), w.nbytes()}}))
    return Invalid(fn, "the earlier outputs and digests must not overlap W, the outputs, next_digests or each other");
  return absl::OkStatus();
}

// Fills the weight dimensions of a quantizer's argument block from W [(E,) N, K] (already checked).
template <typename Args>
void SetWeightDims(Args& a, const TensorView& w, int group_size) {
  const Shape& s = w.shape();
  a.w = w.data_as<uint16_t>();
  a.is_bf16 = w.dtype() == DType::kBF16;
  a.experts = s.size() == 3 ? s[0] : 1;
  a.n = s[s.size() - 2];
  a.k = s.back();
  a.group = group_size == kChannelwise ? a.k : group_size;
}

}  // namespace wsync::kernels::internal
