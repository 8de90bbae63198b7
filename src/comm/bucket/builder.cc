#include "comm/bucket/builder.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync::comm {
BucketBuilder::BucketBuilder(BucketSink& sink, const BucketBuilderOptions& options) : sink_(sink), options_(options) {}

absl::Status BucketBuilder::EnsureBuffer(uint64_t min_bytes) {
  const uint64_t want = std::max<uint64_t>(std::max<uint64_t>(options_.bucket_bytes, 1), min_bytes);
  if (buffer_.size() < want) {
    Buffer b = sink_.Recycle(want);
    if (b.size() >= want && MemorySpace::Of(b) == options_.space) {
      buffer_ = std::move(b);
    } else {
      b = Buffer();  // too small for this bucket, or of another space: freed
      buffer_ = Buffer();
      ASSIGN_OR_RETURN(buffer_, options_.space.Allocate(want));
    }
  }
  capacity_ = want;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<MutableTensorView>> BucketBuilder::Reserve(std::span<const Pending> tensors) {
  if (finished_) return absl::FailedPreconditionError("bucket builder: Reserve after Finish");
  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  uint64_t group = 0;  // bytes of the group placed at an aligned offset
  for (const Pending& t : tensors) {
    if (t.name.empty()) return absl::InvalidArgumentError("bucket builder: a tensor without a name");
    absl::StatusOr<int64_t> nb = NumBytes(t.dtype, t.shape);
    if (!nb.ok()) return Annotate(nb.status(), absl::StrCat("bucket builder: \"", t.name, "\""));
    sizes.push_back(static_cast<uint64_t>(*nb));
    group = AlignEntry(group) + sizes.back();
  }
  uint64_t start = AlignEntry(cursor_);
  if (capacity_ == 0 || start + group > capacity_) {
    if (manifest_.entries_size() > 0) RETURN_IF_ERROR(SendCurrent(/*last=*/false));
    RETURN_IF_ERROR(EnsureBuffer(group));
    start = 0;
  }
  std::vector<MutableTensorView> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Pending& t = tensors[i];
    start = AlignEntry(cursor_);
    if (start > cursor_) RETURN_IF_ERROR(options_.space.Zero(buffer_.data() + cursor_, start - cursor_));
    v1::BucketEntry* e = manifest_.add_entries();
    v1::TensorSpec* spec = e->mutable_tensor();
    spec->set_name(t.name);
    spec->set_dtype(ToProto(t.dtype));
    for (int64_t d : t.shape) spec->add_shape(d);
    e->set_offset(start);
    e->set_nbytes(sizes[i]);
    e->set_split_offset(0);
    e->set_total_nbytes(sizes[i]);
    cursor_ = start + sizes[i];
    ++stats_.tensors;
    out.emplace_back(t.dtype, t.shape, buffer_.span().subspan(start, sizes[i]));
  }
  return out;
}

absl::Status BucketBuilder::Add(absl::string_view name, const TensorView& tensor) {
  ASSIGN_OR_RETURN(const int64_t nb, NumBytes(tensor.dtype(), tensor.shape()));
  if (static_cast<size_t>(nb) != tensor.nbytes())
    return absl::InvalidArgumentError(absl::StrCat("bucket builder: \"", name, "\" is ", tensor.DebugString(),
                                                   " but its view holds ", tensor.nbytes(), " bytes"));
  const Pending p{std::string(name), tensor.dtype(), tensor.shape()};
  ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst, Reserve({&p, 1}));
  const absl::Time t0 = absl::Now();
  absl::Status s = options_.space.Copy(dst[0].data(), tensor.data(), tensor.nbytes());
  stats_.copy += absl::Now() - t0;
  return Annotate(s, absl::StrCat("bucket builder: copying \"", name, "\" into a bucket"));
}

absl::Status BucketBuilder::SendCurrent(bool last) {
  manifest_.set_version(options_.version);
  manifest_.set_pp_stage(options_.pp_stage);
  manifest_.set_index(index_);
  manifest_.set_last(last);
  manifest_.set_nbytes(cursor_);
  const uint64_t nbytes = cursor_;
  ++stats_.buckets;
  stats_.bytes += nbytes;
  stats_.peak_bucket_bytes = std::max(stats_.peak_bucket_bytes, nbytes);
  ++index_;
  v1::BucketManifest m = std::move(manifest_);
  manifest_ = v1::BucketManifest();
  Buffer data = std::move(buffer_);
  buffer_ = Buffer();
  cursor_ = 0;
  capacity_ = 0;
  const absl::Time t0 = absl::Now();
  absl::Status s = sink_.Send(std::move(m), std::move(data), nbytes);
  stats_.send_wait += absl::Now() - t0;
  return s;
}

absl::Status BucketBuilder::Finish() {
  if (finished_) return absl::FailedPreconditionError("bucket builder: Finish called twice");
  finished_ = true;
  RETURN_IF_ERROR(SendCurrent(/*last=*/true));
  const absl::Time t0 = absl::Now();
  absl::Status s = sink_.Finish();
  stats_.send_wait += absl::Now() - t0;
  return s;
}

}  // namespace wsync::comm
