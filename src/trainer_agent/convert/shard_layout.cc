#include "trainer_agent/convert/shard_layout.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/memory_space.h"
#include "common/status.h"

namespace wsync::trainer_agent {
namespace {

int64_t Bytes(DType dtype, const Shape& shape) {
  int64_t n = static_cast<int64_t>(ItemSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status CheckView(const MegatronParam& p, DType dtype, const Shape& shape, size_t nbytes, const Shape& want,
                       absl::string_view what) {
  if (dtype != p.dtype || shape != want || static_cast<int64_t>(nbytes) != Bytes(p.dtype, want))
    return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": ", what, " is ", SafetensorsName(dtype),
                                                   ShapeToString(shape), " (", nbytes, " bytes), expected ",
                                                   SafetensorsName(p.dtype), ShapeToString(want)));
  return absl::OkStatus();
}

bool Overlap(std::span<const std::byte> a, std::span<const std::byte> b) {
  if (a.empty() || b.empty()) return false;
  return a.data() < b.data() + b.size() && b.data() < a.data() + a.size();
}

}  // namespace

absl::InlinedVector<StridedCopy, 2> ShardCopies(const MegatronParam& p, int r) {
  const int64_t local = Bytes(p.dtype, p.local_shape);
  absl::InlinedVector<StridedCopy, 2> out;
  switch (p.kind) {
    case ShardKind::kReplicated: out.push_back({1, 0, 0, 0, 0, local}); break;
    case ShardKind::kTpDim0:
    case ShardKind::kVocab: out.push_back({1, 0, 0, r * local, 0, local}); break;
    case ShardKind::kTpGluFc1:
    case ShardKind::kExpertGluFc1: {
      // Rank r holds [gate_r; up_r]; the full tensor is [gate_0..gate_{T-1}; up_0..up_{T-1}].
      const int64_t half = local / 2;
      const int64_t full_half = half * p.group_size;
      out.push_back({1, 0, 0, r * half, 0, half});
      out.push_back({1, half, 0, full_half + r * half, 0, half});
      break;
    }
    case ShardKind::kTpDim1:
    case ShardKind::kExpertDim1: {
      const int64_t rows = p.local_shape[0];
      const int64_t local_row = rows > 0 ? local / rows : 0;
      const int64_t full_row = local_row * p.group_size;
      out.push_back({rows, 0, local_row, r * local_row, full_row, local_row});
      break;
    }
  }
  return out;
}

absl::Status CopyRows(std::byte* dst, uint64_t dst_pitch, const std::byte* src, uint64_t src_pitch, int64_t rows,
                      uint64_t row_bytes, const MemorySpace& space) {
  if (rows <= 0) return absl::OkStatus();
  return space.Copy2D(dst, dst_pitch, src, src_pitch, row_bytes, static_cast<size_t>(rows));
}

absl::Status MergeShards(const MegatronParam& p, absl::Span<const TensorView> shards, MutableTensorView full,
                         const MemorySpace& space) {
  if (static_cast<int>(shards.size()) != p.group_size)
    return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": ", shards.size(), " shard(s) given, the ",
                                                   ShardKindName(p.kind), " group has ", p.group_size));
  RETURN_IF_ERROR(CheckView(p, full.dtype(), full.shape(), full.nbytes(), p.full_shape, "the output"));
  for (size_t r = 0; r < shards.size(); ++r) {
    RETURN_IF_ERROR(CheckView(p, shards[r].dtype(), shards[r].shape(), shards[r].nbytes(), p.local_shape,
                              absl::StrCat("shard ", r)));
    if (Overlap(shards[r].bytes(), full.bytes()))
      return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": shard ", r, " overlaps the output"));
  }
  std::byte* dst = full.bytes().data();
  for (size_t r = 0; r < shards.size(); ++r) {
    const std::byte* src = shards[r].bytes().data();
    for (const StridedCopy& c : ShardCopies(p, static_cast<int>(r)))
      RETURN_IF_ERROR(CopyRows(dst + c.full_offset, static_cast<uint64_t>(c.full_stride), src + c.local_offset,
                               static_cast<uint64_t>(c.local_stride), c.count, static_cast<uint64_t>(c.bytes), space));
  }
  return absl::OkStatus();
}

absl::Status ShardFull(const MegatronParam& p, const TensorView& full, int r, MutableTensorView local,
                       const MemorySpace& space) {
  if (r < 0 || r >= p.group_size)
    return absl::InvalidArgumentError(
        absl::StrCat(p.global_name, ": group rank ", r, " is outside the group of ", p.group_size));
  RETURN_IF_ERROR(CheckView(p, full.dtype(), full.shape(), full.nbytes(), p.full_shape, "the full tensor"));
  RETURN_IF_ERROR(CheckView(p, local.dtype(), local.shape(), local.nbytes(), p.local_shape, "the output"));
  if (Overlap(full.bytes(), local.bytes()))
    return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": the output overlaps the full tensor"));
  const std::byte* src = full.bytes().data();
  std::byte* dst = local.bytes().data();
  for (const StridedCopy& c : ShardCopies(p, r))
    RETURN_IF_ERROR(CopyRows(dst + c.local_offset, static_cast<uint64_t>(c.local_stride), src + c.full_offset,
                             static_cast<uint64_t>(c.full_stride), c.count, static_cast<uint64_t>(c.bytes), space));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> ShardFull(const MegatronParam& p, const TensorView& full, int r) {
  ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(p.dtype, p.local_shape));
  RETURN_IF_ERROR(ShardFull(p, full, r, t.mutable_view()));
  return t;
}

}  // namespace wsync::trainer_agent
