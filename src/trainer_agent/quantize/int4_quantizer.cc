#include "trainer_agent/quantize/int4_quantizer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "model/quant_target.h"
#include "trainer_agent/convert/shard_layout.h"

namespace wsync::trainer_agent {
namespace {

constexpr uint64_t kBlockAlignment = 64;
constexpr kernels::PackFormat kFormat = kernels::PackFormat::kCompressedTensors;

uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// The three outputs of INT4 target `name` (a "*.weight" of [n, k]), in one bucket; weight_shape
// is written here, packed and scales are the caller's to fill.
absl::StatusOr<std::vector<MutableTensorView>> ReserveTriplet(comm::BucketBuilder& builder, const MemorySpace& space,
                                                              absl::string_view name, DType dtype, const Shape& packed,
                                                              const Shape& scales, int64_t n, int64_t k) {
  absl::string_view prefix = name;
  if (!absl::ConsumeSuffix(&prefix, ".weight"))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", name, "\": not a *.weight tensor"));
  const comm::BucketBuilder::Pending pending[3] = {
      {absl::StrCat(prefix, ".weight_packed"), DType::kI32, packed},
      {absl::StrCat(prefix, ".weight_scale"), dtype, scales},
      {absl::StrCat(prefix, ".weight_shape"), DType::kI64, Shape{2}},
  };
  ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst, builder.Reserve(pending));
  const int64_t nk[2] = {n, k};
  RETURN_IF_ERROR(space.Copy(dst[2].data(), nk, sizeof(nk)));
  return dst;
}

// Bytes of an INT4 block's packed and scale parts, and where the scales start in it.
absl::Status BlockSizes(const kernels::QuantizedShapes& q, DType dtype, uint64_t* packed, uint64_t* scales,
                        uint64_t* scale_offset) {
  ASSIGN_OR_RETURN(const int64_t pb, NumBytes(DType::kI32, q.packed));
  ASSIGN_OR_RETURN(const int64_t sb, NumBytes(dtype, q.scales));
  *packed = static_cast<uint64_t>(pb);
  *scales = static_cast<uint64_t>(sb);
  *scale_offset = AlignUp(*packed, kBlockAlignment);
  return absl::OkStatus();
}

// The AWQ triple of HF tensor `hf_index`'s rows [n0, n0 + n) by columns [k0, k0 + k), its parts
// laid out from block offset `at` (AwqPart).
absl::StatusOr<AwqPart> MakeAwqPart(int hf_index, int64_t n0, int64_t n, int64_t k0, int64_t k, DType dtype, int group,
                                    uint64_t at) {
  ASSIGN_OR_RETURN(const kernels::AwqShapes shapes, kernels::AwqShapesFor(TensorView(dtype, Shape{n, k}, {}), group));
  AwqPart part{.hf_index = hf_index, .n0 = n0, .n = n, .k0 = k0, .k = k};
  part.qweight = shapes.qweight;
  part.qzeros = shapes.qzeros;
  part.scales = shapes.scales;
  ASSIGN_OR_RETURN(const int64_t qweight_bytes, NumBytes(DType::kI32, shapes.qweight));
  ASSIGN_OR_RETURN(const int64_t qzeros_bytes, NumBytes(DType::kI32, shapes.qzeros));
  ASSIGN_OR_RETURN(const int64_t scales_bytes, NumBytes(dtype, shapes.scales));
  part.qweight_at = AlignUp(at, kBlockAlignment);
  part.qzeros_at = AlignUp(part.qweight_at + static_cast<uint64_t>(qweight_bytes), kBlockAlignment);
  part.scales_at = AlignUp(part.qzeros_at + static_cast<uint64_t>(qzeros_bytes), kBlockAlignment);
  part.end = AlignUp(part.scales_at + static_cast<uint64_t>(scales_bytes), kBlockAlignment);
  return part;
}

// AWQ triple `src` (in `from`) written into triple `dst` of the same HF tensor (in `to`) at its
// rows and columns: qweight rows k0 - dst.k0 on, qzeros / scales rows (k0 - dst.k0) / G on, and
// words (n0 - dst.n0) / 8, scale columns n0 - dst.n0 on. Memory of `space`. kInternal, naming
// `what`, for a part that does not lie inside `dst` on whole words and groups, or outside its
// buffers; the space's copy errors.
absl::Status PlaceAwqPart(const AwqPart& src, std::span<const std::byte> from, const AwqPart& dst,
                          std::span<std::byte> to, DType scale_dtype, absl::string_view what,
                          const MemorySpace& space = MemorySpace::Host()) {
  const int64_t rows_per_scale = src.k / src.qzeros[0];  // G, or K for channelwise
  if (src.hf_index != dst.hf_index || src.n0 < dst.n0 || src.n0 + src.n > dst.n0 + dst.n ||
      (src.n0 - dst.n0) % 8 != 0 || src.k0 < dst.k0 || src.k0 + src.k > dst.k0 + dst.k ||
      (src.k0 - dst.k0) % rows_per_scale != 0 || src.end > from.size() || dst.end > to.size())
    return absl::InternalError(absl::StrCat(what, ": AWQ part rows ", src.n0, "+", src.n, " x columns ", src.k0, "+",
                                            src.k, " of HF tensor ", src.hf_index, " does not fit part rows ", dst.n0,
                                            "+", dst.n, " x columns ", dst.k0, "+", dst.k, " of HF tensor ",
                                            dst.hf_index, " (buffers of ", from.size(), " and ", to.size(), " bytes)"));
  const int64_t k_off = src.k0 - dst.k0, word_off = (src.n0 - dst.n0) / 8, col_off = src.n0 - dst.n0;
  const uint64_t item = ItemSize(scale_dtype);
  const uint64_t src_words = static_cast<uint64_t>(src.n / 8) * 4, dst_words = static_cast<uint64_t>(dst.n / 8) * 4;
  RETURN_IF_ERROR(CopyRows(
      to.data() + dst.qweight_at + static_cast<uint64_t>(k_off) * dst_words + static_cast<uint64_t>(word_off) * 4,
      dst_words, from.data() + src.qweight_at, src_words, src.k, src_words, space));
  const int64_t z_off = k_off / rows_per_scale;
  RETURN_IF_ERROR(CopyRows(
      to.data() + dst.qzeros_at + static_cast<uint64_t>(z_off) * dst_words + static_cast<uint64_t>(word_off) * 4,
      dst_words, from.data() + src.qzeros_at, src_words, src.qzeros[0], src_words, space));
  const uint64_t src_cols = static_cast<uint64_t>(src.n) * item, dst_cols = static_cast<uint64_t>(dst.n) * item;
  return CopyRows(
      to.data() + dst.scales_at + static_cast<uint64_t>(z_off) * dst_cols + static_cast<uint64_t>(col_off) * item,
      dst_cols, from.data() + src.scales_at, src_cols, src.scales[0], src_cols, space);
}

// A reuse writing this call's digests to `next` and, when `digests` is not empty, reading them and
// the earlier outputs `earlier` (the codes, the scales, the zeros: one per view of `dst`, whose
// dtypes and shapes they have).
kernels::QuantizeReuse MakeReuse(std::span<uint64_t> next, std::span<const uint64_t> digests,
                                 absl::Span<const std::span<const std::byte>> earlier,
                                 absl::Span<const MutableTensorView> dst) {
  kernels::QuantizeReuse reuse;
  reuse.next_digests = next;
  if (digests.empty()) return reuse;
  auto view = [&](size_t i) { return TensorView(dst[i].dtype(), dst[i].shape(), earlier[i]); };
  reuse.digests = digests;
  reuse.packed = view(0);
  reuse.scales = view(1);
  if (dst.size() > 2) reuse.zeros = view(2);
  return reuse;
}

// The first column of ETP rank `rank`'s shard of `p` in the full tensor: 0 for row blocks.
absl::StatusOr<int64_t> ShardColumn0(const MegatronParam& p, int rank) {
  if (p.local_shape.back() == p.full_shape.back()) return 0;
  const auto copies = ShardCopies(p, rank);
  if (copies.empty()) return absl::InternalError(absl::StrCat(p.global_name, ": shard ", rank, " has no copies"));
  return static_cast<int64_t>(copies.front().full_offset / ItemSize(p.dtype));
}

}  // namespace

absl::StatusOr<std::vector<RowSegment>> RowSegments(const MegatronParam& p, const HfRowMap& map, int rank_in_group) {
  std::vector<RowSegment> out;
  auto add = [&](int64_t local_row, int64_t full_row, int64_t rows) {
    for (const HfRowPiece& piece : map.pieces) {
      const int64_t lo = std::max(full_row, piece.full_row);
      const int64_t hi = std::min(full_row + rows, piece.full_row + piece.rows);
      if (lo < hi)
        out.push_back({piece.hf_index, local_row + (lo - full_row), piece.hf_row + (lo - piece.full_row), hi - lo});
    }
  };
  if (rank_in_group < 0) {
    add(0, 0, p.full_shape[0]);
    return out;
  }
  ASSIGN_OR_RETURN(const int64_t local_bytes, NumBytes(p.dtype, p.local_shape));
  ASSIGN_OR_RETURN(const int64_t full_bytes, NumBytes(p.dtype, p.full_shape));
  const int64_t local_row = local_bytes / p.local_shape[0], full_row = full_bytes / p.full_shape[0];
  for (const StridedCopy& c : ShardCopies(p, rank_in_group)) {
    if (c.count == 1 && local_row == full_row && c.local_offset % local_row == 0 && c.full_offset % full_row == 0 &&
        c.bytes % local_row == 0) {
      add(c.local_offset / local_row, c.full_offset / full_row, c.bytes / local_row);  // a block of whole rows
    } else if (c.count == p.local_shape[0] && c.bytes == local_row && c.local_stride == local_row &&
               c.full_stride == full_row) {
      add(0, 0, p.local_shape[0]);  // a column block: the shard has every row
    } else {
      return absl::InternalError(
          absl::StrCat(p.global_name, ": shard ", rank_in_group, " is neither row nor column blocks"));
    }
  }
  return out;
}

absl::StatusOr<std::optional<QuantizationConfig>> SyncQuantization(const std::optional<QuantizationConfig>& trainer,
                                                                   const std::string& engines_json) {
  std::optional<QuantizationConfig> engines;
  if (!engines_json.empty()) {
    ASSIGN_OR_RETURN(engines, ParseQuantizationConfig(engines_json, "the engines' quantization_config"));
  }
  if (!trainer) return engines;
  if (!engines || engines->Canonical() != trainer->Canonical())
    return absl::FailedPreconditionError(
        absl::StrCat("the trainer's --quant-config (", trainer->Describe(), ") is not what the engines serve (",
                     engines ? engines->Describe() : std::string("bf16"),
                     "); give the trainer the engines' config, or none: it then quantizes as the engines declare"));
  return trainer;
}

std::string QuantFingerprint(const QuantizationConfig* quant, kernels::QuantVariant variant,
                             kernels::AwqArith awq_arith) {
  if (quant == nullptr) return "quant none";
  const QuantizationConfig& q = *quant;
  return absl::StrCat("quant ", q.Canonical(), "|",
                      q.is_awq() ? (awq_arith == kernels::AwqArith::kFp16 ? "awq-fp16" : "awq-fp32")
                                 : (variant == kernels::QuantVariant::kQat ? "qat" : "slime"));
}

absl::Status MergeInt4Shards(const Int4ExpertPlan& plan, std::span<const std::byte> shards, std::span<std::byte> block,
                             const MemorySpace& space) {
  if (plan.awq) {
    const uint64_t etp = plan.awq_shards.size();
    const std::string what = absl::StrCat("merging the AWQ shard blocks of ", plan.scales.global_name);
    if (!plan.by_shard || etp == 0)
      return absl::InvalidArgumentError(absl::StrCat(what, ": the plan has no ETP shard blocks"));
    if (shards.size() != etp * plan.local_block || block.size() != plan.block_bytes)
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", shards.size(), " bytes of shards (want ", etp, " x ",
                                                     plan.local_block, "), a block of ", block.size(), " (want ",
                                                     plan.block_bytes, ")"));
    for (uint64_t r = 0; r < etp; ++r)
      for (const AwqPart& part : plan.awq_shards[r])
        RETURN_IF_ERROR(PlaceAwqPart(part, shards.subspan(r * plan.local_block, plan.local_block),
                                     plan.awq_full[static_cast<size_t>(part.hf_index)], block, plan.scales.dtype, what,
                                     space));
    return absl::OkStatus();
  }
  std::vector<TensorView> packed, scales;
  for (int r = 0; r < plan.packed.group_size; ++r) {
    std::span<const std::byte> shard = shards.subspan(static_cast<uint64_t>(r) * plan.local_block, plan.local_block);
    packed.emplace_back(DType::kI32, plan.packed.local_shape, shard.subspan(0, plan.local_packed_bytes));
    scales.emplace_back(plan.scales.dtype, plan.scales.local_shape,
                        shard.subspan(plan.local_scale_offset, plan.local_scale_bytes));
  }
  RETURN_IF_ERROR(
      MergeShards(plan.packed, packed,
                  MutableTensorView(DType::kI32, plan.packed.full_shape, block.subspan(0, plan.packed_bytes)), space));
  return MergeShards(
      plan.scales, scales,
      MutableTensorView(plan.scales.dtype, plan.scales.full_shape, block.subspan(plan.scale_offset, plan.scale_bytes)),
      space);
}

Int4Quantizer::Int4Quantizer(const Int4Options& options)
    : quant_(*options.quant),
      space_(options.space),
      kernel_([&] {
        kernels::QuantizeOptions ko;
        ko.group_size = options.quant->group_size;
        ko.variant = options.variant;
        ko.format = kFormat;
        ko.num_threads = options.num_threads;
        ko.device = options.space.host() ? kernels::Device::kCpu : kernels::Device::kCuda;
        return ko;
      }()),
      awq_([&] {
        kernels::AwqQuantizeOptions ao;
        ao.group_size = options.quant->group_size;
        ao.arith = options.awq_arith;
        ao.num_threads = options.num_threads;
        ao.device = options.space.host() ? kernels::Device::kCpu : kernels::Device::kCuda;
        return ao;
      }()),
      fp8_([&] {
        model::QuantizeOptions fo;
        fo.num_threads = options.num_threads;
        fo.fp8_block = options.fp8_block;
        fo.fp8_channel = options.fp8_channel;
        fo.device = options.space.host() ? kernels::Device::kCpu : kernels::Device::kCuda;
        return fo;
      }()) {}

kernels::QuantizeOptions Int4Quantizer::KernelOptions() const { return kernel_; }

absl::StatusOr<std::optional<Int4ExpertPlan>> Int4Quantizer::PlanExpert(
    const ModelConfig& model, const MegatronParam& p, absl::Span<const MegatronParam* const> on_members,
    int etp) const {
  // FP8 experts travel in bf16 and are quantized where they are emitted (README.md).
  if (quant_.is_fp8() || (p.hf_op != HfOp::kCopy && p.hf_op != HfOp::kGlu)) return std::nullopt;
  for (const MegatronParam* mp : on_members) {
    ASSIGN_OR_RETURN(HfRowMap map, HfRowMapFor(model, *mp));
    if (map.hf_shapes.size() != mp->hf_names.size())
      return absl::InternalError(absl::StrCat(mp->global_name, ": ", map.hf_shapes.size(), " HF shapes for ",
                                              mp->hf_names.size(), " HF names"));
    for (size_t h = 0; h < mp->hf_names.size(); ++h)
      if (!model::IsQuantTarget(mp->hf_names[h], map.hf_shapes[h], quant_)) return std::nullopt;
  }
  ASSIGN_OR_RETURN(HfRowMap map, HfRowMapFor(model, p));
  for (const Shape& s : map.hf_shapes)
    if (s.size() != 2 || s[1] != p.full_shape.back())
      return absl::InternalError(absl::StrCat(p.global_name, ": HF tensor ", ShapeToString(s),
                                              " is not a row block of ", ShapeToString(p.full_shape)));
  if (quant_.is_awq()) return PlanAwqExpert(p, std::move(map), etp);
  const int group = quant_.group_size;
  Int4ExpertPlan plan;
  absl::StatusOr<kernels::QuantizedShapes> full =
      kernels::QuantizedShapesFor(TensorView(p.dtype, p.full_shape, {}), group, kFormat);
  if (!full.ok())
    return Annotate(full.status(), absl::StrCat("quantizing \"", absl::StrJoin(p.hf_names, "\", \""), "\" (",
                                                SafetensorsName(p.dtype), ShapeToString(p.full_shape), ")"));
  plan.packed = plan.scales = p;
  plan.packed.dtype = DType::kI32;
  plan.packed.full_shape = full->packed;
  plan.scales.full_shape = full->scales;
  RETURN_IF_ERROR(BlockSizes(*full, p.dtype, &plan.packed_bytes, &plan.scale_bytes, &plan.scale_offset));
  plan.block_bytes = AlignUp(plan.scale_offset + plan.scale_bytes, kBlockAlignment);
  plan.hf_shapes = std::move(map.hf_shapes);
  ASSIGN_OR_RETURN(plan.full_rows, RowSegments(p, map, -1));
  const int64_t local_k = p.local_shape.back();
  plan.by_shard = etp == 1 || p.kind == ShardKind::kExpertGluFc1 ||
                  (p.kind == ShardKind::kExpertDim1 && group > 0 && local_k % group == 0 && local_k % 8 == 0);
  if (plan.by_shard && etp > 1) {
    absl::StatusOr<kernels::QuantizedShapes> local =
        kernels::QuantizedShapesFor(TensorView(p.dtype, p.local_shape, {}), group, kFormat);
    if (!local.ok()) return Annotate(local.status(), absl::StrCat(p.global_name, ": quantizing an ETP shard"));
    plan.packed.local_shape = local->packed;
    plan.scales.local_shape = local->scales;
    RETURN_IF_ERROR(
        BlockSizes(*local, p.dtype, &plan.local_packed_bytes, &plan.local_scale_bytes, &plan.local_scale_offset));
    plan.local_block = AlignUp(plan.local_scale_offset + plan.local_scale_bytes, kBlockAlignment);
    ASSIGN_OR_RETURN(plan.local_rows, RowSegments(p, map, p.rank_in_group));
  } else if (plan.by_shard) {
    plan.local_rows = plan.full_rows;
  }
  return plan;
}

absl::StatusOr<std::optional<Int4ExpertPlan>> Int4Quantizer::PlanAwqExpert(const MegatronParam& p, HfRowMap map,
                                                                           int etp) const {
  // Merges place AWQ parts row by row: host code. (The device stages run without gathers.)
  if (!space_.host() && etp > 1) return std::nullopt;
  const int group = quant_.group_size;
  Int4ExpertPlan plan;
  plan.awq = true;
  plan.packed = plan.scales = p;
  plan.packed.dtype = DType::kI32;
  plan.hf_shapes = std::move(map.hf_shapes);
  ASSIGN_OR_RETURN(plan.full_rows, RowSegments(p, map, -1));
  const int64_t k = p.full_shape.back();
  for (size_t h = 0; h < plan.hf_shapes.size(); ++h) {
    absl::StatusOr<AwqPart> part = MakeAwqPart(static_cast<int>(h), 0, plan.hf_shapes[h][0], 0, k, p.dtype, group,
                                               plan.awq_full.empty() ? 0 : plan.awq_full.back().end);
    if (!part.ok())
      return Annotate(part.status(), absl::StrCat("quantizing \"", p.hf_names[h], "\" (", SafetensorsName(p.dtype),
                                                  ShapeToString(plan.hf_shapes[h]), ") to AWQ"));
    plan.awq_full.push_back(*part);
  }
  plan.block_bytes = plan.awq_full.back().end;
  // A segment of an HF tensor's rows is a column block of its AWQ tensors, so segments must be whole
  // words of 8 rows: the full tensor's, or the holders do not quantize it (the stage source does);
  // an ETP shard's, or its ETP merge is in bf16 and its merger quantizes it.
  auto whole_words = [](const std::vector<RowSegment>& segs) {
    return std::all_of(segs.begin(), segs.end(),
                       [](const RowSegment& s) { return s.hf_row % 8 == 0 && s.rows % 8 == 0; });
  };
  if (!whole_words(plan.full_rows)) return std::nullopt;
  const int64_t local_k = p.local_shape.back();
  plan.by_shard = etp == 1 || p.kind == ShardKind::kExpertGluFc1 ||
                  (p.kind == ShardKind::kExpertDim1 && group > 0 && local_k % group == 0);
  if (plan.by_shard && etp > 1) {
    for (int r = 0; r < etp && plan.by_shard; ++r) {
      ASSIGN_OR_RETURN(const std::vector<RowSegment> segs, RowSegments(p, map, r));
      ASSIGN_OR_RETURN(const int64_t k0, ShardColumn0(p, r));
      std::vector<AwqPart> parts;
      plan.by_shard = whole_words(segs);
      for (size_t i = 0; i < segs.size() && plan.by_shard; ++i) {
        ASSIGN_OR_RETURN(AwqPart part, MakeAwqPart(segs[i].hf_index, segs[i].hf_row, segs[i].rows, k0, local_k, p.dtype,
                                                   group, parts.empty() ? 0 : parts.back().end));
        parts.push_back(std::move(part));
      }
      if (parts.empty()) plan.by_shard = false;
      if (!plan.by_shard) break;
      if (r == 0) plan.local_block = parts.back().end;
      if (parts.back().end != plan.local_block) plan.by_shard = false;  // shards of unequal blocks: merge in bf16
      plan.awq_shards.push_back(std::move(parts));
    }
    if (plan.by_shard) {
      ASSIGN_OR_RETURN(plan.local_rows, RowSegments(p, map, p.rank_in_group));
    } else {
      plan.awq_shards.clear();
      plan.local_block = 0;
    }
  } else if (plan.by_shard) {
    plan.local_rows = plan.full_rows;
  }
  return plan;
}

absl::Status Int4Quantizer::QuantizeExpert(const MegatronParam& p, const TensorView& w, const Int4ExpertPlan& plan,
                                           bool shard, std::span<std::byte> block, absl::string_view where) {
  const uint64_t want = shard ? plan.local_block : plan.block_bytes;
  if (block.size() != want || (shard && (!plan.by_shard || plan.local_block == 0)))
    return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": a block of ", block.size(), " bytes for its ",
                                                   shard ? "ETP shard" : "full tensor", " (the plan's: ", want,
                                                   plan.by_shard || !shard ? "" : ", not by shard", ")"));
  if (!plan.awq) {
    if (shard)
      return QuantizeRows(p, w, plan.local_rows, block.subspan(0, plan.local_packed_bytes),
                          block.subspan(plan.local_scale_offset, plan.local_scale_bytes), where);
    return QuantizeRows(p, w, plan.full_rows, block.subspan(0, plan.packed_bytes),
                        block.subspan(plan.scale_offset, plan.scale_bytes), where);
  }
  if (shard) {
    // The plan's shard parts are those of the rank it was made on (local_rows too).
    if (plan.awq_shards.empty() || p.rank_in_group != plan.scales.rank_in_group ||
        plan.awq_shards[static_cast<size_t>(p.rank_in_group)].size() != plan.local_rows.size())
      return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": ETP shard ", p.rank_in_group,
                                                     " and a plan made for shard ", plan.scales.rank_in_group, " of ",
                                                     plan.awq_shards.size()));
    const std::vector<AwqPart>& parts = plan.awq_shards[static_cast<size_t>(p.rank_in_group)];
    for (size_t i = 0; i < parts.size(); ++i)
      RETURN_IF_ERROR(QuantizeAwqPart(p, w, plan.local_rows[i].row, parts[i], block, where));
    return absl::OkStatus();
  }
  for (const RowSegment& seg : plan.full_rows) {
    const AwqPart& whole = plan.awq_full[static_cast<size_t>(seg.hf_index)];
    if (seg.hf_row == 0 && seg.rows == whole.n) {
      RETURN_IF_ERROR(QuantizeAwqPart(p, w, seg.row, whole, block, where));
      continue;
    }
    // Some rows of the HF tensor: a column block of its triple, quantized apart and placed.
    if (!space_.host())
      return absl::InternalError(absl::StrCat(p.global_name, ": an AWQ row segment to place in device memory"));
    ASSIGN_OR_RETURN(const AwqPart piece,
                     MakeAwqPart(seg.hf_index, seg.hf_row, seg.rows, 0, whole.k, p.dtype, quant_.group_size, 0));
    std::vector<std::byte> scratch(piece.end);
    RETURN_IF_ERROR(QuantizeAwqPart(p, w, seg.row, piece, scratch, where));
    RETURN_IF_ERROR(PlaceAwqPart(piece, scratch, whole, block, p.dtype, p.global_name));
  }
  return absl::OkStatus();
}

absl::Status Int4Quantizer::QuantizeAwqPart(const MegatronParam& p, const TensorView& w, int64_t row,
                                            const AwqPart& part, std::span<std::byte> block, absl::string_view where) {
  const int64_t k = w.dim(1);
  const uint64_t w_row = w.nbytes() / static_cast<uint64_t>(w.dim(0));
  if (row < 0 || row + part.n > w.dim(0) || part.k != k || part.end > block.size())
    return absl::InternalError(absl::StrCat(p.global_name, ": AWQ part of rows ", row, "..", row + part.n - 1, " x ",
                                            part.k, " columns does not fit ", w.DebugString(), " and a block of ",
                                            block.size(), " bytes"));
  const TensorView ws(w.dtype(), Shape{part.n, k},
                      w.bytes().subspan(static_cast<uint64_t>(row) * w_row, static_cast<uint64_t>(part.n) * w_row));
  auto view = [&](DType dtype, const Shape& shape, uint64_t at) {
    return MutableTensorView(dtype, shape, block.subspan(at, static_cast<uint64_t>(*NumBytes(dtype, shape))));
  };
  const MutableTensorView qweight = view(DType::kI32, part.qweight, part.qweight_at);
  const MutableTensorView qzeros = view(DType::kI32, part.qzeros, part.qzeros_at);
  const MutableTensorView scales = view(w.dtype(), part.scales, part.scales_at);
  const absl::Time t0 = absl::Now();
  absl::Status s;
  if (memo_ == nullptr) {
    s = kernels::QuantizeAwq(ws, qweight, qzeros, scales, awq_);
  } else {  // one memo block per triple; one unit per qzeros word (8 rows' group)
    const MutableTensorView dst[3] = {qweight, scales, qzeros};  // the codes, the scales, the zeros
    s = ReuseFromMemo(absl::StrCat(p.global_name, " AWQ ", part.hf_index, ": rows ", part.n0, "+", part.n,
                                   " x columns ", part.k0, "+", part.k),
                      dst, ReuseKey(w.dtype()), qzeros.nbytes() / 4, [&](kernels::QuantizeReuse* reuse) {
                        return reuse != nullptr ? kernels::QuantizeAwq(ws, qweight, qzeros, scales, awq_, *reuse)
                                                : kernels::QuantizeAwq(ws, qweight, qzeros, scales, awq_);
                      });
  }
  stats_.quantize += absl::Now() - t0;
  if (!s.ok()) {
    const std::string columns =
        k == p.full_shape.back() ? "" : absl::StrCat(", its columns ", part.k0, "..", part.k0 + k - 1);
    return Annotate(s, absl::StrCat("quantizing \"", p.hf_names[static_cast<size_t>(part.hf_index)], "\" (its rows ",
                                    part.n0, "..", part.n0 + part.n - 1, columns, " as the kernel's rows 0..",
                                    part.n - 1, "; ", where, ") to AWQ"));
  }
  stats_.quantized_bytes += ws.nbytes();
  return absl::OkStatus();
}

absl::Status Int4Quantizer::QuantizeRows(const MegatronParam& p, const TensorView& w, absl::Span<const RowSegment> rows,
                                         std::span<std::byte> packed, std::span<std::byte> scales,
                                         absl::string_view where) {
  const int64_t n = w.dim(0), k = w.dim(1);
  const uint64_t w_row = w.nbytes() / static_cast<uint64_t>(n);
  const uint64_t packed_row = packed.size() / static_cast<uint64_t>(n);
  const uint64_t scale_row = scales.size() / static_cast<uint64_t>(n);
  const int64_t scale_cols = static_cast<int64_t>(scale_row / ItemSize(w.dtype()));
  // With the memo: this block's outputs and digests from its last quantization, and this one's.
  const QuantMemo::Block* earlier = nullptr;
  std::string id, key;
  std::vector<uint64_t> next;
  bool undigested = false;  // the memo's digests of this block are paused
  const std::span<std::byte> outputs[2] = {packed, scales};
  if (memo_ != nullptr && n > 0) {
    id = absl::StrCat(p.global_name, " ", packed.size());  // the full tensor or a shard
    if (Digesting(id)) {
      key = ReuseKey(w.dtype());
      next.assign(static_cast<size_t>(n * scale_cols), 0);
      earlier = FindInMemo(id, key, next.size(), outputs);
    } else {
      memo_->blocks_.erase(id);
      id.clear();
      undigested = true;
    }
  }
  int64_t reused = 0;
  for (const RowSegment& seg : rows) {
    const uint64_t first = static_cast<uint64_t>(seg.row), count = static_cast<uint64_t>(seg.rows);
    const TensorView ws(w.dtype(), Shape{seg.rows, k}, w.bytes().subspan(first * w_row, count * w_row));
    MutableTensorView ps(DType::kI32, Shape{seg.rows, k / 8}, packed.subspan(first * packed_row, count * packed_row));
    MutableTensorView ss(w.dtype(), Shape{seg.rows, scale_cols}, scales.subspan(first * scale_row, count * scale_row));
    const absl::Time t0 = absl::Now();
    absl::Status s;
    if (!id.empty()) {  // this segment's groups of the block
      const size_t g0 = first * static_cast<size_t>(scale_cols), groups = count * static_cast<size_t>(scale_cols);
      std::span<const uint64_t> digests;
      std::vector<std::span<const std::byte>> from;
      if (earlier != nullptr) {
        digests = std::span(earlier->digests).subspan(g0, groups);
        from = {std::span<const std::byte>(earlier->outputs[0]).subspan(first * packed_row, count * packed_row),
                std::span<const std::byte>(earlier->outputs[1]).subspan(first * scale_row, count * scale_row)};
      }
      const MutableTensorView dst[2] = {ps, ss};
      kernels::QuantizeReuse reuse = MakeReuse(std::span(next).subspan(g0, groups), digests, from, dst);
      s = kernels::QuantizeInt4(ws, ps, ss, kernel_, reuse);
      if (s.ok()) CountReuse(groups, reuse);
      reused += reuse.reused_groups;
    } else {
      s = kernels::QuantizeInt4(ws, ps, ss, kernel_);
      if (s.ok() && undigested) CountUndigested(count * static_cast<size_t>(scale_cols));
    }
    stats_.quantize += absl::Now() - t0;
    const std::string& name = p.hf_names[static_cast<size_t>(seg.hf_index)];
    if (!s.ok())
      return Annotate(s,
                      absl::StrCat("quantizing \"", name, "\" (its rows ", seg.hf_row, "..", seg.hf_row + seg.rows - 1,
                                   " as the kernel's rows 0..", seg.rows - 1, "; ", where, ")"));
    stats_.quantized_bytes += ws.nbytes();
  }
  if (!id.empty()) {  // every segment succeeded
    if (earlier != nullptr) Judge(id, next.size(), reused);
    KeepInMemo(id, key, std::move(next), outputs);
  }
  return absl::OkStatus();
}

const QuantMemo::Block* Int4Quantizer::FindInMemo(const std::string& id, const std::string& key, size_t units,
                                                  absl::Span<const std::span<std::byte>> dst) const {
  const auto it = memo_->blocks_.find(id);
  if (it == memo_->blocks_.end() || it->second.key != key || it->second.digests.size() != units ||
      it->second.outputs.size() != dst.size())
    return nullptr;
  for (size_t i = 0; i < dst.size(); ++i)
    if (it->second.outputs[i].size() != dst[i].size()) return nullptr;
  return &it->second;
}

void Int4Quantizer::KeepInMemo(const std::string& id, std::string key, std::vector<uint64_t> digests,
                               absl::Span<const std::span<std::byte>> outputs) {
  QuantMemo::Block& b = memo_->blocks_[id];
  b.key = std::move(key);
  b.digests = std::move(digests);
  b.outputs.resize(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) b.outputs[i].assign(outputs[i].begin(), outputs[i].end());
}

void Int4Quantizer::CountReuse(size_t units, const kernels::QuantizeReuse& reuse) {
  stats_.groups += units;
  stats_.reused_groups += static_cast<uint64_t>(reuse.reused_groups);
}

absl::Status Int4Quantizer::ReuseFromMemo(const std::string& id, absl::Span<const MutableTensorView> dst,
                                          const std::string& key, size_t units, Kernel kernel) {
  if (!Digesting(id)) {
    memo_->blocks_.erase(id);
    RETURN_IF_ERROR(kernel(nullptr));
    CountUndigested(units);
    return absl::OkStatus();
  }
  std::vector<uint64_t> next(units);
  std::vector<std::span<std::byte>> outputs;
  for (const MutableTensorView& d : dst) outputs.push_back(d.bytes());
  const QuantMemo::Block* earlier = FindInMemo(id, key, units, outputs);
  std::vector<std::span<const std::byte>> from;
  std::span<const uint64_t> digests;
  if (earlier != nullptr) {
    from.assign(earlier->outputs.begin(), earlier->outputs.end());
    digests = earlier->digests;
  }
  kernels::QuantizeReuse reuse = MakeReuse(next, digests, from, dst);
  RETURN_IF_ERROR(kernel(&reuse));
  CountReuse(units, reuse);
  if (earlier != nullptr) Judge(id, units, reuse.reused_groups);
  KeepInMemo(id, key, std::move(next), outputs);
  return absl::OkStatus();
}

absl::Status Int4Quantizer::Reusing(const std::string& name, absl::Span<const std::string> names,
                                    absl::Span<const MutableTensorView> dst, DType input, size_t units, Kernel kernel) {
  const std::string key = ReuseKey(input);
  const std::string id = absl::StrCat("HF ", name);
  if (base_ == nullptr) return ReuseFromMemo(id, dst, key, units, kernel);
  if (memo_ != nullptr) memo_->blocks_.erase(id);  // the base holds its outputs: the memo's copy goes
  const std::string in_base = absl::StrCat("base ", name);
  if (!Digesting(in_base)) {  // the base keeps no digests of it: a probe records
    RETURN_IF_ERROR(kernel(nullptr));
    CountUndigested(units);
    return absl::OkStatus();
  }
  kernels::QuantizeReuse reuse = ReuseFromBase(name, names, dst, key, units);
  RETURN_IF_ERROR(kernel(&reuse));
  CountReuse(units, reuse);
  if (!reuse.digests.empty()) Judge(in_base, units, reuse.reused_groups);
  return absl::OkStatus();
}

bool Int4Quantizer::Digesting(const std::string& id) {
  if (memo_ == nullptr) return true;
  const auto it = memo_->pauses_.find(id);
  if (it == memo_->pauses_.end() || it->second.left == 0) return true;
  --it->second.left;
  return false;
}

void Int4Quantizer::CountUndigested(size_t units) {
  stats_.groups += units;
  stats_.undigested_groups += units;
}

void Int4Quantizer::Judge(const std::string& id, size_t units, int64_t reused) {
  if (memo_ == nullptr) return;
  constexpr int kFirstPause = 2, kLongestPause = 16;
  if (static_cast<double>(reused) >= memo_->pause_below_ * static_cast<double>(units)) {
    memo_->pauses_.erase(id);  // digests pay here: no pause, and the next poor one starts short
    return;
  }
  QuantMemo::Pause& p = memo_->pauses_[id];
  p.left = p.next == 0 ? kFirstPause : p.next;
  p.next = std::min(2 * p.left, kLongestPause);
}

std::string Int4Quantizer::ReuseKey(DType input) const {
  std::string key = QuantFingerprint(&quant_, kernel_.variant, awq_.arith);
  if (quant_.is_fp8())
    absl::StrAppend(&key, " fp8 ", static_cast<int>(model::Fp8BlockVariantFor(quant_, fp8_)), "/",
                    static_cast<int>(fp8_.fp8_channel));
  absl::StrAppend(&key, " ", SafetensorsName(input));
  return key;
}

uint64_t QuantMemo::bytes() const {
  uint64_t n = 0;
  for (const auto& [name, b] : blocks_) {
    n += b.digests.size() * sizeof(uint64_t);
    for (const std::vector<std::byte>& o : b.outputs) n += o.size();
  }
  return n;
}

absl::Status Int4Quantizer::EmitExpert(comm::BucketBuilder& builder, const MegatronParam& p, const Int4ExpertPlan& plan,
                                       std::span<const std::byte> block) {
  if (plan.awq) return EmitAwqExpert(builder, p, plan, block);
  const int64_t rows = p.full_shape[0];
  const uint64_t packed_row = plan.packed_bytes / static_cast<uint64_t>(rows);
  const uint64_t scale_row = plan.scale_bytes / static_cast<uint64_t>(rows);
  for (size_t h = 0; h < plan.hf_shapes.size(); ++h) {
    const Shape& hf = plan.hf_shapes[h];
    const Shape packed{hf[0], plan.packed.full_shape[1]}, scales{hf[0], plan.scales.full_shape[1]};
    ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst,
                     ReserveTriplet(builder, space_, p.hf_names[h], p.dtype, packed, scales, hf[0], hf[1]));
    const absl::Time t0 = absl::Now();
    for (const RowSegment& seg : plan.full_rows) {
      if (seg.hf_index != static_cast<int>(h)) continue;
      const uint64_t from = static_cast<uint64_t>(seg.row), to = static_cast<uint64_t>(seg.hf_row);
      const uint64_t count = static_cast<uint64_t>(seg.rows);
      RETURN_IF_ERROR(
          space_.Copy(dst[0].bytes().data() + to * packed_row, block.data() + from * packed_row, count * packed_row));
      RETURN_IF_ERROR(space_.Copy(dst[1].bytes().data() + to * scale_row,
                                  block.data() + plan.scale_offset + from * scale_row, count * scale_row));
      stats_.copied_bytes += count * (packed_row + scale_row);
    }
    stats_.copy += absl::Now() - t0;
    stats_.hf_bytes += static_cast<uint64_t>(hf[0] * hf[1]) * ItemSize(p.dtype);
  }
  return absl::OkStatus();
}

absl::Status Int4Quantizer::EmitAwqExpert(comm::BucketBuilder& builder, const MegatronParam& p,
                                          const Int4ExpertPlan& plan, std::span<const std::byte> block) {
  for (const AwqPart& part : plan.awq_full) {
    const std::string& name = p.hf_names[static_cast<size_t>(part.hf_index)];
    absl::string_view prefix = name;
    if (!absl::ConsumeSuffix(&prefix, ".weight"))
      return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", name, "\": not a *.weight tensor"));
    const std::vector<std::string> names = model::QuantizedNames(prefix, quant_);
    const comm::BucketBuilder::Pending pending[3] = {
        {names[0], DType::kI32, part.qweight},
        {names[1], DType::kI32, part.qzeros},
        {names[2], p.dtype, part.scales},
    };
    ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst, builder.Reserve(pending));
    const absl::Time t0 = absl::Now();
    const uint64_t at[3] = {part.qweight_at, part.qzeros_at, part.scales_at};
    for (size_t i = 0; i < 3; ++i) {
      RETURN_IF_ERROR(space_.Copy(dst[i].bytes().data(), block.data() + at[i], dst[i].nbytes()));
      stats_.copied_bytes += dst[i].nbytes();
    }
    stats_.copy += absl::Now() - t0;
    stats_.hf_bytes += static_cast<uint64_t>(part.n * part.k) * ItemSize(p.dtype);
  }
  return absl::OkStatus();
}

absl::Status Int4Quantizer::QuantizeInto(comm::BucketBuilder& builder, const std::string& name, const TensorView& w) {
  if (quant_.is_fp8()) return QuantizeFp8Into(builder, name, w);
  if (quant_.is_awq()) return QuantizeAwqInto(builder, name, w);
  absl::StatusOr<kernels::QuantizedShapes> shapes = kernels::QuantizedShapesFor(w, quant_.group_size, kFormat);
  if (!shapes.ok()) return Annotate(shapes.status(), absl::StrCat("quantizing \"", name, "\" (", w.DebugString(), ")"));
  ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst, ReserveTriplet(builder, space_, name, w.dtype(), shapes->packed,
                                                                      shapes->scales, w.dim(0), w.dim(1)));
  const absl::Time t0 = absl::Now();
  absl::Status s;
  if (base_ == nullptr && memo_ == nullptr) {
    s = kernels::QuantizeInt4(w, dst[0], dst[1], kernel_);
  } else {  // one unit per group
    absl::string_view prefix = name;
    absl::ConsumeSuffix(&prefix, ".weight");  // ReserveTriplet refused any other name
    const std::string names[2] = {absl::StrCat(prefix, ".weight_packed"), absl::StrCat(prefix, ".weight_scale")};
    s = Reusing(name, names, absl::MakeConstSpan(dst).subspan(0, 2), w.dtype(),
                dst[1].nbytes() / ItemSize(dst[1].dtype()), [&](kernels::QuantizeReuse* reuse) {
                  return reuse != nullptr ? kernels::QuantizeInt4(w, dst[0], dst[1], kernel_, *reuse)
                                          : kernels::QuantizeInt4(w, dst[0], dst[1], kernel_);
                });
  }
  stats_.quantize += absl::Now() - t0;
  if (!s.ok()) return Annotate(s, absl::StrCat("quantizing \"", name, "\""));
  stats_.quantized_bytes += w.nbytes();
  return absl::OkStatus();
}

kernels::QuantizeReuse Int4Quantizer::ReuseFromBase(const std::string& name, absl::Span<const std::string> names,
                                                    absl::Span<const MutableTensorView> dst, const std::string& key,
                                                    size_t units) {
  const std::span<uint64_t> next = base_->NextDigests(name, units, key);
  const std::optional<QuantizedBase::Earlier> earlier = base_->FindQuantized(name, names, key);
  if (!earlier || earlier->digests.size() != units || earlier->outputs.size() != dst.size())
    return MakeReuse(next, {}, {}, dst);
  std::vector<std::span<const std::byte>> outputs;
  for (size_t i = 0; i < dst.size(); ++i) {
    if (earlier->outputs[i].size() != dst[i].nbytes()) return MakeReuse(next, {}, {}, dst);
    outputs.push_back(std::as_bytes(earlier->outputs[i]));
  }
  return MakeReuse(next, earlier->digests, outputs, dst);
}

absl::Status Int4Quantizer::QuantizeFp8Into(comm::BucketBuilder& builder, const std::string& name,
                                            const TensorView& w) {
  const std::string where = absl::StrCat("quantizing \"", name, "\" (", w.DebugString(), ") to FP8");
  absl::string_view prefix = name;
  if (!absl::ConsumeSuffix(&prefix, ".weight"))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", name, "\": not a *.weight tensor"));
  absl::StatusOr<model::Fp8Shapes> shapes = model::Fp8ShapesFor(w, quant_, fp8_);
  if (!shapes.ok()) return Annotate(shapes.status(), where);
  const std::vector<std::string> names = model::QuantizedNames(prefix, quant_);
  const comm::BucketBuilder::Pending pending[2] = {
      {names[0], DType::kF8E4M3, w.shape()},
      {names[1], shapes->scale_dtype, shapes->scale},
  };
  ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst, builder.Reserve(pending));
  const absl::Time t0 = absl::Now();
  absl::Status s;
  if (base_ == nullptr && memo_ == nullptr) {
    s = model::QuantizeFp8(w, dst[0], dst[1], quant_, fp8_);
  } else {  // one unit per scale: a block or a row
    s = Reusing(
        name, absl::MakeConstSpan(names).subspan(0, 2), dst, w.dtype(), dst[1].nbytes() / ItemSize(dst[1].dtype()),
        [&](kernels::QuantizeReuse* reuse) { return model::QuantizeFp8(w, dst[0], dst[1], quant_, fp8_, reuse); });
  }
  stats_.quantize += absl::Now() - t0;
  if (!s.ok()) return Annotate(s, where);
  stats_.quantized_bytes += w.nbytes();
  return absl::OkStatus();
}

absl::Status Int4Quantizer::QuantizeAwqInto(comm::BucketBuilder& builder, const std::string& name,
                                            const TensorView& w) {
  const std::string where = absl::StrCat("quantizing \"", name, "\" (", w.DebugString(), ") to AWQ");
  absl::string_view prefix = name;
  if (!absl::ConsumeSuffix(&prefix, ".weight"))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", name, "\": not a *.weight tensor"));
  absl::StatusOr<kernels::AwqShapes> shapes = kernels::AwqShapesFor(w, quant_.group_size);
  if (!shapes.ok()) return Annotate(shapes.status(), where);
  const std::vector<std::string> names = model::QuantizedNames(prefix, quant_);
  const comm::BucketBuilder::Pending pending[3] = {
      {names[0], DType::kI32, shapes->qweight},
      {names[1], DType::kI32, shapes->qzeros},
      {names[2], w.dtype(), shapes->scales},
  };
  ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst, builder.Reserve(pending));
  const absl::Time t0 = absl::Now();
  absl::Status s;
  if (base_ == nullptr && memo_ == nullptr) {
    s = kernels::QuantizeAwq(w, dst[0], dst[1], dst[2], awq_);
  } else {                                                          // one unit per qzeros word: 8 rows' group
    const std::string outputs[3] = {names[0], names[2], names[1]};  // the codes, the scales, the zeros
    const MutableTensorView views[3] = {dst[0], dst[2], dst[1]};
    s = Reusing(name, outputs, views, w.dtype(), dst[1].nbytes() / 4, [&](kernels::QuantizeReuse* reuse) {
      return reuse != nullptr ? kernels::QuantizeAwq(w, dst[0], dst[1], dst[2], awq_, *reuse)
                              : kernels::QuantizeAwq(w, dst[0], dst[1], dst[2], awq_);
    });
  }
  stats_.quantize += absl::Now() - t0;
  if (!s.ok()) return Annotate(s, where);
  stats_.quantized_bytes += w.nbytes();
  return absl::OkStatus();
}

}  // namespace wsync::trainer_agent
