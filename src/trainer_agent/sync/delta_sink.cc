#include "trainer_agent/sync/delta_sink.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/bucket/bucket_format.h"
#include "common/failpoint.h"
#include "common/status.h"
#include "kernels/checksum.h"
#include "kernels/delta.h"

namespace wsync::trainer_agent {
namespace {

using engine_model::EngineLayout;
using engine_model::HfSource;

// Sum64 of the dense bytes of `k` in the row-major [.., cols] matrix at `t` (item bytes each): in
// place when its rows are whole (contiguous), else through `scratch`.
uint64_t BlockSum(const uint8_t* t, int64_t cols, size_t item, const engine_model::KeptBlock& k,
                  std::vector<uint8_t>& scratch) {
  if (k.empty()) return kernels::Sum64Host({});
  const size_t row = static_cast<size_t>(k.cols) * item;
  if (k.col0 == 0 && k.cols == cols) {
    const auto* first = reinterpret_cast<const std::byte*>(t) + static_cast<size_t>(k.row0) * row;
    return kernels::Sum64Host({first, static_cast<size_t>(k.rows) * row});
  }
  scratch.resize(static_cast<size_t>(k.rows) * row);
  for (int64_t r = 0; r < k.rows; ++r)
    std::memcpy(scratch.data() + static_cast<size_t>(r) * row,
                t + (static_cast<size_t>(k.row0 + r) * static_cast<size_t>(cols) + static_cast<size_t>(k.col0)) * item,
                row);
  return kernels::Sum64Host(std::as_bytes(std::span(scratch)));
}

}  // namespace

std::optional<QuantizedBase::Earlier> DeltaBase::FindQuantized(const std::string& name,
                                                               absl::Span<const std::string> outputs,
                                                               const std::string& key) const {
  const auto d = earlier_.find(name);
  if (d == earlier_.end() || d->second.key != key) return std::nullopt;
  Earlier e{d->second.groups, {}};
  for (const std::string& output : outputs) {
    const auto t = tensors_.find(output);
    if (t == tensors_.end()) return std::nullopt;
    e.outputs.push_back(t->second);
  }
  return e;
}

std::span<uint64_t> DeltaBase::NextDigests(const std::string& name, size_t groups, const std::string& key) {
  Digests& d = next_[name];
  d.key = key;
  d.groups.assign(groups, 0);
  return d.groups;
}

DeltaSink::DeltaSink(comm::BucketSink& inner, DeltaBase& base, std::vector<const EngineLayout*> receivers,
                     uint64_t base_version, uint64_t version)
    : inner_(inner),
      base_(base),
      receivers_(std::move(receivers)),
      base_version_(base_version),
      version_(version),
      delta_(base_version != 0 && base.version() == base_version) {
  base_.version_ = 0;  // being rewritten: a failed sync leaves no named base
  // The last sync's digests are this one's to reuse; none are kept until this one finishes.
  base_.earlier_ = std::move(base_.digests_);
  base_.digests_.clear();
  base_.next_.clear();
  base_.digest_bytes_ = 0;
  // The base's block sums hold for these receivers' layouts only.
  std::string key;
  for (const EngineLayout* l : receivers_) {
    const engine_model::EngineParallel& p = l->parallel();
    absl::StrAppend(&key, p.tp_size, "/", p.tp_rank, "/", p.ep_size, "/", p.mtp_draft, "/", l->sources().size(), ";");
  }
  if (key != base_.sums_key_) base_.sums_.clear();
  base_.sums_key_ = std::move(key);
}

DeltaSink::DeltaSink(std::unique_ptr<comm::BucketSink> inner, DeltaBase& base,
                     std::vector<const EngineLayout*> receivers, uint64_t base_version, uint64_t version)
    : DeltaSink(*inner, base, std::move(receivers), base_version, version) {
  owned_ = std::move(inner);
}

absl::Status DeltaSink::Rewrite(v1::BucketEntry& e, const uint8_t* bytes, uint8_t* out, uint64_t& cursor) {
  const std::string& name = e.tensor().name();
  const uint64_t n = e.nbytes();
  ASSIGN_OR_RETURN(const DType dtype, comm::FromProto(e.tensor().dtype()));
  const auto item = static_cast<uint32_t>(ItemSize(dtype));
  const Shape shape(e.tensor().shape().begin(), e.tensor().shape().end());
  // The entry's elements: the whole tensor, or the block of it a sharded group is sent.
  const MatrixDims whole = MatrixOf(shape);
  const engine_model::KeptBlock region =
      e.has_block() ? engine_model::KeptBlock{e.block().row0(), e.block().rows(), e.block().col0(), e.block().cols()}
                    : engine_model::KeptBlock{0, whole.rows, 0, whole.cols};
  auto it = base_.tensors_.find(name);
  bool as_delta = delta_ && !receivers_.empty() && it != base_.tensors_.end() && it->second.size() == n &&
                  n == static_cast<uint64_t>(region.rows * region.cols) * item && shape.size() <= 2 &&
                  (item == 1 || item == 2 || item == 4 || item == 8) && e.split_offset() == 0;
  // Whole: an INT4 weight_shape, a tensor some receiver's layout describes otherwise (its block
  // would not be this tensor's; the receiver refuses the tensor itself), and a block that does not
  // hold all a receiver keeps. `blocks[i]`: receiver i's block within the entry's elements.
  std::vector<engine_model::KeptBlock> blocks(receivers_.size());
  for (size_t i = 0; i < receivers_.size(); ++i) {
    const int idx = receivers_[i]->FindSource(name);
    if (idx < 0) continue;
    const HfSource& src = receivers_[i]->sources()[static_cast<size_t>(idx)];
    if (src.action == HfSource::Action::kCheckShape || src.dtype != dtype || src.shape != shape) as_delta = false;
    engine_model::KeptBlock k = engine_model::KeptBlockOf(src);
    if (k.empty()) continue;
    if (k.row0 < region.row0 || k.row0 + k.rows > region.row0 + region.rows || k.col0 < region.col0 ||
        k.col0 + k.cols > region.col0 + region.cols)
      as_delta = false;
    k.row0 -= region.row0;
    k.col0 -= region.col0;
    blocks[i] = k;
  }
  cursor = comm::AlignEntry(cursor);
  ++stats_.entries;
  stats_.tensor_bytes += n;
  if (as_delta) {
    const std::span<const uint8_t> base(it->second), next(bytes, n);
    ASSIGN_OR_RETURN(const kernels::DeltaPlan plan, kernels::PlanDelta(base, next, item));
    RETURN_IF_ERROR(kernels::WriteDelta(plan, base, next, {out + cursor, plan.payload_bytes}));
    // System tests: a delta that does not turn the base into the sums' version (a sender's bug).
    if (plan.payload_bytes > 0 && FailpointHit("delta.corrupt")) out[cursor + plan.payload_bytes - 1] ^= 1;
    v1::EntryDelta* d = e.mutable_delta();
    d->set_encoding(static_cast<uint32_t>(plan.encoding));
    d->set_changed_items(plan.changed_items);
    const int64_t cols = region.cols;
    // The base's sums are the new ones of the sync that sent it (kept per tensor), else computed.
    std::vector<uint64_t>& sums = base_.sums_[name];
    const bool cached = sums.size() == receivers_.size();
    sums.resize(receivers_.size());
    for (size_t i = 0; i < receivers_.size(); ++i) {
      const EngineLayout* l = receivers_[i];
      const engine_model::KeptBlock& k = blocks[i];
      v1::DeltaSum* s = d->add_sums();
      s->set_tp_size(static_cast<uint32_t>(l->parallel().tp_size));
      s->set_tp_rank(static_cast<uint32_t>(l->parallel().tp_rank));
      s->set_ep_size(static_cast<uint32_t>(l->parallel().ep_size));
      s->set_mtp_draft(l->parallel().mtp_draft);
      s->set_base_sum64(cached ? sums[i] : BlockSum(base.data(), cols, item, k, scratch_));
      s->set_sum64(plan.changed_items == 0 ? s->base_sum64() : BlockSum(bytes, cols, item, k, scratch_));
      sums[i] = s->sum64();
    }
    e.set_offset(cursor);
    e.set_nbytes(plan.payload_bytes);
    cursor += plan.payload_bytes;
    ++stats_.delta_entries;
    stats_.items += plan.items;
    stats_.changed_items += plan.changed_items;
  } else {
    if (n > 0) std::memmove(out + cursor, bytes, n);
    e.set_offset(cursor);
    cursor += n;
  }
  stats_.sent_bytes += e.nbytes();
  if (e.has_delta() && e.delta().changed_items() == 0) return absl::OkStatus();  // the base holds it
  if (!e.has_delta()) base_.sums_.erase(name);  // sent whole: its block sums are not known
  // The new base of this tensor.
  std::vector<uint8_t>& kept = base_.tensors_[name];
  base_.bytes_ = base_.bytes_ - kept.size() + n;
  kept.assign(bytes, bytes + n);
  return absl::OkStatus();
}

absl::Status DeltaSink::Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) {
  if (!failed_.ok()) return failed_;
  failed_ = SendDelta(std::move(manifest), std::move(data), nbytes);
  return failed_;
}

absl::Status DeltaSink::SendDelta(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) {
  if (data.device() >= 0)
    return absl::FailedPreconditionError("delta delivery builds its buckets in host memory (a device bucket came)");
  // Every entry's output is at most its input (a delta is never larger than the tensor) at an offset
  // no later than its own, so the output fits in nbytes.
  Buffer out = inner_.Recycle(std::max<uint64_t>(nbytes, 1));
  if (out.size() < nbytes || out.device() >= 0) {
    ASSIGN_OR_RETURN(out, Buffer::Allocate(std::max<uint64_t>(nbytes, 1)));
  }
  auto* dst = reinterpret_cast<uint8_t*>(out.data());
  const auto* src = reinterpret_cast<const uint8_t*>(data.data());
  uint64_t cursor = 0;
  bool any_delta = false;
  for (v1::BucketEntry& e : *manifest.mutable_entries()) {
    const uint64_t at = cursor;
    RETURN_IF_ERROR(Rewrite(e, src + e.offset(), dst, cursor));
    std::memset(dst + at, 0, e.offset() - at);  // the alignment gap, as the builder zeroes it
    any_delta = any_delta || e.has_delta();
  }
  if (any_delta) manifest.set_base_version(base_version_);
  manifest.set_nbytes(cursor);
  free_.push_back(std::move(data));
  return inner_.Send(std::move(manifest), std::move(out), cursor);
}

Buffer DeltaSink::Recycle(uint64_t min_bytes) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->size() >= min_bytes) {
      Buffer b = std::move(*it);
      free_.erase(it);
      return b;
    }
  }
  return Buffer();
}

absl::Status DeltaSink::Finish() {
  const absl::Status inner = inner_.Finish();
  RETURN_IF_ERROR(failed_);  // a bucket was not sent: the base stays unnamed
  RETURN_IF_ERROR(inner);
  base_.version_ = version_;
  base_.digests_ = std::move(base_.next_);
  base_.next_.clear();
  base_.earlier_.clear();
  for (const auto& [name, d] : base_.digests_) base_.digest_bytes_ += d.groups.size() * sizeof(uint64_t);
  return absl::OkStatus();
}

}  // namespace wsync::trainer_agent
