#include "plan/sharded_sink.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/bucket/bucket_format.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "common/tensor.h"

namespace wsync::plan {

ShardedSink::ShardedSink(const ShardPlan* plan, std::vector<std::unique_ptr<comm::BucketSink>> groups,
                         std::vector<comm::BroadcastSink*> broadcast)
    : plan_(plan),
      groups_(std::move(groups)),
      broadcast_(std::move(broadcast)),
      next_index_(groups_.size(), 0),
      group_bytes_(groups_.size(), 0) {}

absl::Status ShardedSink::status() const {
  for (comm::BroadcastSink* b : broadcast_)
    if (!b->status().ok()) return b->status();
  return absl::OkStatus();
}

absl::Status ShardedSink::CutGroup(int g, const v1::BucketManifest& full, const Buffer& data, Cut* cut) {
  struct Piece {
    const v1::BucketEntry* entry;
    DType dtype;
    Block block;
    uint64_t offset, nbytes;
  };
  std::vector<Piece> pieces;
  uint64_t end = 0;
  for (const v1::BucketEntry& e : full.entries()) {
    if (e.has_delta())  // its bytes are a payload, not the tensor: no block can be cut from them
      return absl::UnimplementedError(absl::StrCat(e.tensor().name(), ": sharded delivery of a delta entry"));
    ASSIGN_OR_RETURN(const DType dtype, comm::FromProto(e.tensor().dtype()));
    const std::span<const int64_t> shape(e.tensor().shape().data(), static_cast<size_t>(e.tensor().shape_size()));
    ASSIGN_OR_RETURN(const std::optional<Block> b, plan_->BlockFor(g, e.tensor().name(), dtype, shape));
    if (!b) continue;
    const uint64_t n = b->nbytes;
    const uint64_t at = pieces.empty() ? 0 : comm::AlignEntry(end);
    pieces.push_back({&e, dtype, *b, at, n});
    end = at + n;
  }
  if (pieces.empty() && !full.last()) return absl::OkStatus();  // nothing for this group
  const MemorySpace space = MemorySpace::Of(data);              // the group sinks' (Send checked it)
  Buffer out = groups_[static_cast<size_t>(g)]->Recycle(end);
  if (out.size() < end || MemorySpace::Of(out) != space) {
    out = Buffer();
    auto b = space.Allocate(std::max<uint64_t>(end, 1));
    if (!b.ok()) return Annotate(b.status(), absl::StrCat("a bucket of receiver group ", g));
    out = std::move(*b);
  }
  v1::BucketManifest m;
  m.set_version(full.version());
  m.set_pp_stage(full.pp_stage());
  m.set_index(next_index_[static_cast<size_t>(g)]++);
  m.set_last(full.last());
  m.set_nbytes(end);
  uint64_t cursor = 0;
  for (const Piece& p : pieces) {
    if (p.offset > cursor) RETURN_IF_ERROR(space.Zero(out.data() + cursor, p.offset - cursor));
    cursor = p.offset + p.nbytes;
    const v1::BucketEntry& e = *p.entry;
    const std::byte* src = data.data() + e.offset();
    std::byte* dst = out.data() + p.offset;
    v1::BucketEntry* ne = m.add_entries();
    *ne->mutable_tensor() = e.tensor();
    ne->set_offset(p.offset);
    ne->set_nbytes(p.nbytes);
    ne->set_split_offset(0);
    ne->set_total_nbytes(e.total_nbytes());
    if (p.block.whole) {
      RETURN_IF_ERROR(space.Copy(dst, src, p.nbytes));
      continue;
    }
    v1::TensorBlock* tb = ne->mutable_block();
    tb->set_row0(p.block.row0);
    tb->set_rows(p.block.rows);
    tb->set_col0(p.block.col0);
    tb->set_cols(p.block.cols);
    const MatrixDims dims =
        MatrixOf(std::span<const int64_t>(e.tensor().shape().data(), static_cast<size_t>(e.tensor().shape_size())));
    // Into a dense block: a row cut is one copy, a column cut one 2D copy (a memcpy per row on the
    // host, cudaMemcpy2DAsync on a device).
    const uint64_t item = ItemSize(p.dtype);
    RETURN_IF_ERROR(space.Copy2D(dst, static_cast<size_t>(p.block.cols) * item,
                                 src + (static_cast<uint64_t>(p.block.row0) * dims.cols + p.block.col0) * item,
                                 static_cast<size_t>(dims.cols) * item, static_cast<size_t>(p.block.cols) * item,
                                 static_cast<size_t>(p.block.rows)));
  }
  cut->manifest = std::move(m);
  cut->data = std::move(out);
  cut->nbytes = end;
  cut->send = true;
  return absl::OkStatus();
}

absl::Status ShardedSink::Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) {
  if (MemorySpace::Of(data) != space()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sharded delivery cuts buckets in the group streams' memory (", space().Name(),
                     "), this one is in ", MemorySpace::Of(data).Name(), ": stage it there first (SpaceStagingSink)"));
  }
  if (!status().ok()) return absl::OkStatus();  // draining
  if (nbytes != manifest.nbytes() || nbytes > data.size())
    return absl::InvalidArgumentError(absl::StrCat("ShardedSink: bucket of ", nbytes, " bytes, manifest says ",
                                                   manifest.nbytes(), ", buffer holds ", data.size()));
  const absl::Time t0 = absl::Now();
  const int n = static_cast<int>(groups_.size());
  std::vector<absl::Status> st(static_cast<size_t>(n));
  std::vector<Cut> cuts(static_cast<size_t>(n));
  // A thread per group, except for small buckets (a thread costs more than their copies).
  if (n > 1 && nbytes >= (uint64_t{1} << 20)) {
    std::vector<std::thread> threads;
    for (int g = 1; g < n; ++g)
      threads.emplace_back([&, g] { st[static_cast<size_t>(g)] = CutGroup(g, manifest, data, &cuts[g]); });
    st[0] = CutGroup(0, manifest, data, &cuts[0]);
    for (auto& t : threads) t.join();
  } else {
    for (int g = 0; g < n; ++g) st[static_cast<size_t>(g)] = CutGroup(g, manifest, data, &cuts[g]);
  }
  cut_ += absl::Now() - t0;
  spare_ = std::move(data);
  for (const absl::Status& s : st) RETURN_IF_ERROR(s);
  // The group sinks are sent to from this thread only (a BucketSink is single-threaded).
  for (int g = 0; g < n; ++g) {
    Cut& c = cuts[static_cast<size_t>(g)];
    if (!c.send) continue;
    group_bytes_[static_cast<size_t>(g)] += c.nbytes;
    const absl::Status sent = groups_[static_cast<size_t>(g)]->Send(std::move(c.manifest), std::move(c.data), c.nbytes);
    if (!sent.ok()) {  // the sync fails: the other groups' receivers must not wait for their buckets
      for (comm::BroadcastSink* b : broadcast_) b->Abort(sent);
      return sent;
    }
  }
  const absl::Status failed = status();
  if (!failed.ok()) {
    for (comm::BroadcastSink* b : broadcast_) b->Abort(failed);
  }
  return absl::OkStatus();
}

Buffer ShardedSink::Recycle(uint64_t min_bytes) {
  if (spare_.size() >= min_bytes && MemorySpace::Of(spare_) == space()) return std::move(spare_);
  return Buffer();
}

absl::Status ShardedSink::Finish() {
  absl::Status first;
  for (auto& g : groups_) {
    absl::Status s = g->Finish();
    if (first.ok()) first = s;
  }
  const absl::Status failed = status();
  if (!failed.ok()) {
    for (comm::BroadcastSink* b : broadcast_) b->Abort(failed);
  }
  return first;
}

}  // namespace wsync::plan
