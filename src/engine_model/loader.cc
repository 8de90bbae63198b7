#include "engine_model/loader.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "engine_model/block_copy.h"
#include "kernels/checksum.h"

namespace wsync::engine_model {
namespace {

using State = Staging::PieceState;

}  // namespace

absl::StatusOr<int> Loader::FindSent(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                                     bool whole) const {
  const EngineLayout& layout = staging_->layout();
  const int idx = layout.FindSource(hf_name);
  auto what = [&] { return absl::StrCat(SafetensorsName(dtype), ShapeToString(shape)); };
  if (idx < 0) {
    if (layout.IsIgnoredHfName(hf_name) && whole) return -1;
    return absl::InvalidArgumentError(absl::StrCat("unknown tensor ", hf_name, " (", what(), "): not part of the ",
                                                   ArchitectureName(layout.config().arch),
                                                   layout.quantized() ? " INT4" : " bf16", " engine layout",
                                                   whole ? "" : " (a block of it was sent to this rank)"));
  }
  const HfSource& s = layout.sources()[static_cast<size_t>(idx)];
  // weight_shape (the only I64 tensors): int64 as compressed-tensors writes it, or int32 as slime sends it.
  const bool any_int = s.dtype == DType::kI64;
  const bool dtype_ok = dtype == s.dtype || (any_int && dtype == DType::kI32);
  if (!dtype_ok || !std::equal(shape.begin(), shape.end(), s.shape.begin(), s.shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(hf_name, ": got ", what(), ", want ", SafetensorsName(s.dtype),
                                                   ShapeToString(s.shape), any_int ? " (or I32)" : ""));
  }
  return idx;
}

absl::StatusOr<int> Loader::CheckAndClaim(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                                          const TensorView& data, const BlockRef* block) {
  const EngineLayout& layout = staging_->layout();
  ASSIGN_OR_RETURN(const int idx, FindSent(hf_name, dtype, shape, block == nullptr));
  if (idx < 0) return -1;
  // Only for errors: no string is built for a tensor that loads.
  auto what = [&] { return absl::StrCat(SafetensorsName(dtype), ShapeToString(shape)); };
  const HfSource& s = layout.sources()[static_cast<size_t>(idx)];
  const bool shape_tensor = s.action == HfSource::Action::kCheckShape;
  ASSIGN_OR_RETURN(const int64_t want_bytes, block == nullptr
                                                 ? NumBytes(dtype, shape)
                                                 : NumBytes(dtype, std::array<int64_t, 2>{block->rows, block->cols}));
  if (static_cast<int64_t>(data.nbytes()) != want_bytes || (want_bytes > 0 && data.data() == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(hf_name, ": the view holds ", data.nbytes(), " bytes, but ",
                                                   block == nullptr ? what() : "its block", " needs ", want_bytes));
  }
  if (block != nullptr) {
    // A block must be exactly what this rank keeps (all of a weight_shape): sharded delivery sends
    // each rank its own bytes, nothing more and nothing less.
    const KeptBlock k = KeptBlockOf(s);
    if (k.empty() || block->row0 != k.row0 || block->rows != k.rows || block->col0 != k.col0 || block->cols != k.cols) {
      return absl::InvalidArgumentError(
          absl::StrCat(hf_name, ": got its block rows [", block->row0, ", ", block->row0 + block->rows, ") x columns [",
                       block->col0, ", ", block->col0 + block->cols, "), but engine rank ", layout.parallel().tp_rank,
                       " of ", layout.parallel().tp_size,
                       k.empty() ? " keeps none of it"
                                 : absl::StrCat(" keeps rows [", k.row0, ", ", k.row0 + k.rows, ") x columns [", k.col0,
                                                ", ", k.col0 + k.cols, ")")));
    }
  }
  if (s.action == HfSource::Action::kSkip) return -1;
  if (shape_tensor) {
    // Two values, read back to the host first from a device staging's memory.
    std::byte raw[16];
    const std::byte* at = data.bytes().data();
    if (!staging_->space().host()) {
      RETURN_IF_ERROR(Annotate(staging_->space().CopyToHost(raw, at, data.nbytes()),
                               absl::StrCat("reading ", hf_name, " from ", staging_->space().Name())));
      at = raw;
    }
    int64_t v[2];
    for (int i = 0; i < 2; ++i) {
      if (dtype == DType::kI64) {
        std::memcpy(&v[i], at + 8 * i, 8);
      } else {
        int32_t x;
        std::memcpy(&x, at + 4 * i, 4);
        v[i] = x;
      }
    }
    if (v[0] != s.shape_values[0] || v[1] != s.shape_values[1]) {
      return absl::InvalidArgumentError(absl::StrCat(hf_name, " holds [", v[0], ", ", v[1], "], want [",
                                                     s.shape_values[0], ", ", s.shape_values[1], "]"));
    }
  }
  // Claim the piece: missing or restored -> loaded; a second load of it is an error.
  std::atomic<uint8_t>& st = staging_->state_[static_cast<size_t>(idx)];
  uint8_t cur = st.load(std::memory_order_acquire);
  do {
    if (cur == static_cast<uint8_t>(State::kLoaded)) {
      return absl::AlreadyExistsError(
          absl::StrCat(hf_name, " was already loaded in this sync (", shape_tensor ? "weight_shape" : s.what, ")"));
    }
  } while (!st.compare_exchange_weak(cur, static_cast<uint8_t>(State::kLoaded), std::memory_order_acq_rel));
  return shape_tensor ? -1 : idx;
}

absl::Status Loader::CopyPiece(int idx, const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0) {
  const EngineLayout& layout = staging_->layout();
  const HfSource& s = layout.sources()[static_cast<size_t>(idx)];
  const EngineParam& p = layout.params()[static_cast<size_t>(s.param)];
  const MutableTensorView dst = staging_->param(s.param);
  const MatrixDims d = MatrixOf(p.loaded_shape);
  const size_t item = ItemSize(p.dtype);
  std::byte* base = dst.bytes().data() + s.expert * d.rows * d.cols * static_cast<int64_t>(item);
  staging_->sum_known_[static_cast<size_t>(idx)] = false;  // its bytes are not those of the known sum
  const absl::Status st = internal::CopyBlockIn(staging_->space(), src, src_ld, r0, c0, s.rows, s.cols, base, d.cols,
                                                s.dst_row0, s.dst_col0, item, s.transpose);
  if (st.ok()) return st;
  staging_->state_[static_cast<size_t>(idx)].store(static_cast<uint8_t>(State::kMissing), std::memory_order_release);
  return absl::InternalError(
      absl::StrCat(s.hf_name, ": copying into the staging in ", staging_->space().Name(), " failed: ", st.message()));
}

absl::Status Loader::Load(absl::string_view hf_name, const TensorView& data) {
  ASSIGN_OR_RETURN(const int idx, CheckAndClaim(hf_name, data.dtype(), data.shape(), data, nullptr));
  if (idx < 0) return absl::OkStatus();
  const HfSource& s = staging_->layout().sources()[static_cast<size_t>(idx)];
  return CopyPiece(idx, data.bytes().data(), MatrixOf(s.shape).cols, s.src_row0, s.src_col0);
}

absl::Status Loader::LoadBlock(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                               const BlockRef& block, const TensorView& data) {
  if (shape.size() > 2)
    return absl::InvalidArgumentError(absl::StrCat(hf_name, ": a block of a ", shape.size(), "-dim tensor"));
  ASSIGN_OR_RETURN(const int idx, CheckAndClaim(hf_name, dtype, shape, data, &block));
  if (idx < 0) return absl::OkStatus();
  return CopyPiece(idx, data.bytes().data(), block.cols, 0, 0);
}

absl::Status Loader::LoadDelta(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                               const DeltaRef& delta, std::span<const uint8_t> payload) {
  if (shape.size() > 2)
    return absl::InvalidArgumentError(absl::StrCat(hf_name, ": a delta of a ", shape.size(), "-dim tensor"));
  ASSIGN_OR_RETURN(const int idx, FindSent(hf_name, dtype, shape, true));
  if (idx < 0) return absl::OkStatus();
  const HfSource& s = staging_->layout().sources()[static_cast<size_t>(idx)];
  if (s.action == HfSource::Action::kCheckShape)
    return absl::InvalidArgumentError(absl::StrCat(hf_name, ": a weight_shape is sent whole, not as a delta"));
  if (s.action == HfSource::Action::kSkip) return absl::OkStatus();
  if (!staging_->space().host())
    return absl::UnimplementedError(
        absl::StrCat(hf_name, ": a delta into a staging in ", staging_->space().Name(), " (host stagings only)"));
  // The delta's elements: the whole tensor, or (sharded delivery) a block holding this rank's.
  const MatrixDims whole = MatrixOf(s.shape);
  kernels::DeltaBlock kept{static_cast<uint64_t>(whole.rows), static_cast<uint64_t>(whole.cols),
                           static_cast<uint64_t>(s.src_row0), static_cast<uint64_t>(s.rows),
                           static_cast<uint64_t>(s.src_col0), static_cast<uint64_t>(s.cols)};
  if (delta.block) {
    const BlockRef& b = *delta.block;
    if (s.src_row0 < b.row0 || s.src_row0 + s.rows > b.row0 + b.rows || s.src_col0 < b.col0 ||
        s.src_col0 + s.cols > b.col0 + b.cols)
      return absl::InvalidArgumentError(
          absl::StrCat(hf_name, ": a delta of rows [", b.row0, ", ", b.row0 + b.rows, ") x columns [", b.col0, ", ",
                       b.col0 + b.cols, "), and this rank keeps rows [", s.src_row0, ", ", s.src_row0 + s.rows,
                       ") x columns [", s.src_col0, ", ", s.src_col0 + s.cols, ") (", s.what, ")"));
    kept = {static_cast<uint64_t>(b.rows),
            static_cast<uint64_t>(b.cols),
            static_cast<uint64_t>(s.src_row0 - b.row0),
            static_cast<uint64_t>(s.rows),
            static_cast<uint64_t>(s.src_col0 - b.col0),
            static_cast<uint64_t>(s.cols)};
  }
  // Claim the piece: it must hold the base (restored), and it is loaded once in a sync.
  std::atomic<uint8_t>& st = staging_->state_[static_cast<size_t>(idx)];
  uint8_t cur = static_cast<uint8_t>(State::kRestored);
  if (!st.compare_exchange_strong(cur, static_cast<uint8_t>(State::kLoaded), std::memory_order_acq_rel)) {
    if (cur == static_cast<uint8_t>(State::kLoaded))
      return absl::AlreadyExistsError(absl::StrCat(hf_name, " was already loaded in this sync (", s.what, ")"));
    return absl::FailedPreconditionError(
        absl::StrCat(hf_name, ": a delta, and the staging holds no base for it (", s.what, " not restored)"));
  }
  auto unclaim = [&](absl::Status e) {
    st.store(static_cast<uint8_t>(State::kRestored), std::memory_order_release);
    return e;
  };
  // Where the kept block (dense [rows, cols] as sent) lives in the staging: in place, or transposed.
  const EngineParam& p = staging_->layout().params()[static_cast<size_t>(s.param)];
  const MatrixDims d = MatrixOf(p.loaded_shape);
  const size_t item = ItemSize(p.dtype);
  if (ItemSize(dtype) != item)
    return unclaim(absl::InvalidArgumentError(absl::StrCat(hf_name, ": a delta of ", SafetensorsName(dtype),
                                                           " elements into a param of ", SafetensorsName(p.dtype))));
  std::byte* param = staging_->param(s.param).bytes().data() + s.expert * d.rows * d.cols * static_cast<int64_t>(item);
  auto* first = reinterpret_cast<uint8_t*>(param) + (s.dst_row0 * d.cols + s.dst_col0) * static_cast<int64_t>(item);
  const auto ld = static_cast<uint64_t>(d.cols);
  const kernels::StridedItems at =
      s.transpose ? kernels::StridedItems{first, 1, ld} : kernels::StridedItems{first, ld, 1};
  // The base check: the Sum64 the staging recorded for the block when it last checked it, but
  // for every recheck_every()-th use of it and when none is known: then the block is read back and
  // summed (the uses start staggered over the pieces, so that the re-reads spread over the syncs).
  const size_t i = static_cast<size_t>(idx);
  const int every = staging_->recheck_every_;
  const bool known = staging_->sum_known_[i];
  if (!known || ++staging_->sum_uses_[i] >= every) {
    std::vector<std::byte> block(static_cast<size_t>(s.rows * s.cols) * item);
    if (s.transpose) {
      internal::CopyBlock(param, d.cols, s.dst_row0, s.dst_col0, s.cols, s.rows, block.data(), s.cols, 0, 0, item,
                          true);
    } else {
      internal::CopyBlock(param, d.cols, s.dst_row0, s.dst_col0, s.rows, s.cols, block.data(), s.cols, 0, 0, item,
                          false);
    }
    staging_->sums_[i] = kernels::Sum64Host(block);
    staging_->sum_known_[i] = true;
    staging_->sum_uses_[i] = known ? 0 : static_cast<int>(i % static_cast<size_t>(every));
  }
  if (const uint64_t got = staging_->sums_[i]; got != delta.base_sum)
    return unclaim(absl::DataLossError(absl::StrFormat(
        "%s: the staging does not hold the delta's base (Sum64 of the kept block %016x, the base's %016x)", hf_name,
        got, delta.base_sum)));
  // An unchanged tensor (a delta of no item: a zero count): the staging holds the new version already.
  if (delta.encoding != kernels::DeltaEncoding::kDense && payload.size() == sizeof(uint64_t) &&
      std::all_of(payload.begin(), payload.end(), [](uint8_t b) { return b == 0; })) {
    if (delta.sum == delta.base_sum) return absl::OkStatus();
    return unclaim(absl::DataLossError(
        absl::StrFormat("%s: an empty delta, and the new version's Sum64 %016x is not the base's %016x", hf_name,
                        delta.sum, delta.base_sum)));
  }
  // Applied in place; kept only when the result's Sum64 (the base's, updated over the changed
  // words) is the new version's, else put back.
  if (absl::Status a = kernels::ApplyDeltaChecked(hf_name, delta.encoding, static_cast<uint32_t>(item), payload, kept,
                                                  at, delta.base_sum, delta.sum);
      !a.ok())
    return unclaim(a);
  staging_->sums_[i] = delta.sum;
  return absl::OkStatus();
}

}  // namespace wsync::engine_model
