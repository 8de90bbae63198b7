#include "rollout_agent/load/loader.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "rollout_agent/load/block_copy.h"

namespace wsync::rollout_agent {
namespace {

using State = Staging::PieceState;

std::string PieceName(const EngineLayout& layout, const HfSource& s) {
  if (s.action == HfSource::Action::kCheckShape)
    return absl::StrCat(s.hf_name, " missing (weight_shape of ", s.what, ")");
  return absl::StrCat(layout.params()[static_cast<size_t>(s.param)].name, ": ", s.what, " missing (", s.hf_name, ")");
}

}  // namespace

Staging::Staging(const EngineLayout& layout, const MemorySpace& space) : layout_(&layout), space_(space) {}

absl::Status Staging::PinForDevice() {
  if (!pins_.empty() || !space_.host()) return absl::OkStatus();
  std::vector<std::unique_ptr<PinnedHostRange>> pins;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i].size() == 0) continue;
    auto pin = PinHostMemory(buffers_[i].data(), buffers_[i].size());
    if (!pin.ok()) return Annotate(pin.status(), absl::StrCat("pinning the staging of ", layout_->params()[i].name));
    pins.push_back(std::move(*pin));
  }
  pins_ = std::move(pins);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Staging>> Staging::Create(const EngineLayout& layout, const MemorySpace& space) {
  std::unique_ptr<Staging> s(new Staging(layout, space));
  s->buffers_.reserve(layout.params().size());
  for (const EngineParam& p : layout.params()) {
    ASSIGN_OR_RETURN(const int64_t bytes, NumBytes(p.dtype, p.loaded_shape));
    auto buf =
        space.host() ? Buffer::AllocateZeroed(static_cast<size_t>(bytes)) : space.Allocate(static_cast<size_t>(bytes));
    if (buf.ok() && !space.host()) {
      if (absl::Status z = space.Zero(buf->data(), buf->size()); !z.ok()) buf = z;
    }
    if (!buf.ok()) return Annotate(buf.status(), absl::StrCat("staging buffer for ", p.name, " in ", space.Name()));
    s->buffers_.push_back(std::move(*buf));
  }
  RETURN_IF_ERROR(Annotate(space.Synchronize(), absl::StrCat("zeroing the staging in ", space.Name())));
  const size_t n = layout.sources().size();
  s->state_ = std::make_unique<std::atomic<uint8_t>[]>(n);
  for (size_t i = 0; i < n; ++i) {
    s->state_[i].store(0, std::memory_order_relaxed);
    if (Required(layout.sources()[i])) ++s->num_required_;
  }
  return s;
}

MutableTensorView Staging::param(int index) const {
  const EngineParam& p = layout_->params()[static_cast<size_t>(index)];
  return MutableTensorView(p.dtype, p.loaded_shape, buffers_[static_cast<size_t>(index)].span());
}

absl::StatusOr<MutableTensorView> Staging::Find(absl::string_view name) const {
  const int i = layout_->FindParam(name);
  if (i < 0) return absl::NotFoundError(absl::StrCat("staging: no engine parameter named ", name));
  return param(i);
}

void Staging::ResetCoverage() {
  for (size_t i = 0; i < layout_->sources().size(); ++i) state_[i].store(0, std::memory_order_relaxed);
}

void Staging::MarkAllRestored() {
  for (size_t i = 0; i < layout_->sources().size(); ++i)
    state_[i].store(static_cast<uint8_t>(State::kRestored), std::memory_order_relaxed);
}

Staging::PieceState Staging::state(int source) const {
  return static_cast<PieceState>(state_[static_cast<size_t>(source)].load(std::memory_order_acquire));
}

int64_t Staging::num_missing() const {
  int64_t missing = 0;
  const auto& sources = layout_->sources();
  for (size_t i = 0; i < sources.size(); ++i)
    if (Required(sources[i]) && state_[i].load(std::memory_order_acquire) == 0) ++missing;
  return missing;
}

std::vector<std::string> Staging::MissingPieces() const {
  std::vector<std::string> out;
  const auto& sources = layout_->sources();
  for (size_t i = 0; i < sources.size(); ++i)
    if (Required(sources[i]) && state_[i].load(std::memory_order_acquire) == 0)
      out.push_back(PieceName(*layout_, sources[i]));
  return out;
}

absl::Status Staging::CheckComplete() const {
  constexpr size_t kShown = 32;
  const auto& sources = layout_->sources();
  std::vector<std::string> shown;
  int64_t missing = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    if (!Required(sources[i]) || state_[i].load(std::memory_order_acquire) != 0) continue;
    if (shown.size() < kShown) shown.push_back(PieceName(*layout_, sources[i]));
    ++missing;
  }
  if (missing == 0) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat("engine rank ", layout_->parallel().tp_rank, ": ", missing, " of ", num_required_,
                   " pieces missing: ", absl::StrJoin(shown, "; "),
                   missing > static_cast<int64_t>(kShown)
                       ? absl::StrCat("; ... and ", missing - static_cast<int64_t>(kShown), " more")
                       : ""));
}

absl::StatusOr<int> Loader::CheckAndClaim(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                                          const TensorView& data, const BlockRef* block) {
  const EngineLayout& layout = staging_->layout();
  const int idx = layout.FindSource(hf_name);
  // Only for errors: no string is built for a tensor that loads.
  auto what = [&] { return absl::StrCat(SafetensorsName(dtype), ShapeToString(shape)); };
  if (idx < 0) {
    if (layout.IsIgnoredHfName(hf_name) && block == nullptr) return -1;
    return absl::InvalidArgumentError(absl::StrCat("unknown tensor ", hf_name, " (", what(), "): not part of the ",
                                                   ArchitectureName(layout.config().arch),
                                                   layout.quantized() ? " INT4" : " bf16", " engine layout",
                                                   block != nullptr ? " (a block of it was sent to this rank)" : ""));
  }
  const HfSource& s = layout.sources()[static_cast<size_t>(idx)];
  const bool shape_tensor = s.action == HfSource::Action::kCheckShape;
  // weight_shape (the only I64 tensors): int64 as compressed-tensors writes it, or int32 as slime sends it.
  const bool any_int = s.dtype == DType::kI64;
  const bool dtype_ok = dtype == s.dtype || (any_int && dtype == DType::kI32);
  if (!dtype_ok || !std::equal(shape.begin(), shape.end(), s.shape.begin(), s.shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(hf_name, ": got ", what(), ", want ", SafetensorsName(s.dtype),
                                                   ShapeToString(s.shape), any_int ? " (or I32)" : ""));
  }
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

}  // namespace wsync::rollout_agent
