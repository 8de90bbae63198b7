#include "engine_model/staging.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace wsync::engine_model {
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
  s->sums_ = std::make_unique<uint64_t[]>(n);
  s->sum_known_ = std::make_unique<bool[]>(n);  // value-initialized: none known
  s->sum_uses_ = std::make_unique<int[]>(n);
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
  ForgetSums();
}

std::optional<uint64_t> Staging::known_sum(int source) const {
  const auto i = static_cast<size_t>(source);
  if (!sum_known_[i]) return std::nullopt;
  return sums_[i];
}

void Staging::ForgetSums() { std::fill_n(sum_known_.get(), layout_->sources().size(), false); }

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

absl::Status Staging::CheckComplete(bool loaded_only) const {
  constexpr size_t kShown = 32;
  const auto& sources = layout_->sources();
  std::vector<std::string> shown;
  int64_t missing = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const uint8_t st = state_[i].load(std::memory_order_acquire);
    if (!Required(sources[i]) || st == static_cast<uint8_t>(State::kLoaded) || (st != 0 && !loaded_only)) continue;
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

}  // namespace wsync::engine_model
