// Packing a stage source's HF tensors into buckets (flat buffers + BucketManifest,
// proto/wsync/v1/tensor.proto) and handing them to a BucketSink.
//
//   BucketSink        where full buckets go: the trainer agent's sink over the data plane's
//                     BucketSender (stream.h), or a test / benchmark sink. Send may block (double
//                     buffering).
//   BucketBuilder     appends tensors in call order; starts a new bucket when the next tensor
//                     does not fit; a tensor larger than a bucket gets a bucket of its own size
//                     (never split). Entry offsets are aligned to kEntryAlignment bytes (bucket_format.h) (the gap is
//                     zeroed, so the bytes sent are deterministic). Finish() sends the remaining
//                     bucket with `last` set (possibly empty: every stream ends with exactly one
//                     last bucket), then calls BucketSink::Finish.
// Manifests carry version, pp_stage, index (0, 1, ...), last, nbytes and one entry per tensor
// (TensorSpec name / dtype / shape, offset, nbytes == total_nbytes, split_offset 0); xxh3_64 is
// left to the sink (BucketSender computes it while the previous bucket is on the wire).
//
// Memory: the builder holds one bucket buffer while filling it, taken from BucketSink::Recycle()
// when that has a buffer at least bucket_bytes large, else allocated. With BucketSender's two
// buckets in flight a sender holds three bucket buffers at most (plus a tensor's own oversized
// one while it is in flight).
//
// Errors: kInvalidArgument for a bad name / view (empty name, bytes disagreeing with dtype and
// shape); kResourceExhausted if a buffer cannot be allocated; the sink's errors (returned as is).
// kFailedPrecondition for Add/Finish after Finish.
// Thread-safety: a BucketBuilder is used by one thread; the sink is called from that thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/bucket/stream.h"
#include "common/memory_space.h"
#include "common/tensor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::comm {

class BucketSink {
 public:
  virtual ~BucketSink() = default;
  // Takes bucket `manifest` (nbytes set) with data[0, nbytes). May block until the sink has room
  // (BucketSender: until fewer than two buckets are on the wire); returns once the bucket is queued.
  virtual absl::Status Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) = 0;
  // A buffer of at least `min_bytes` that the sink is done with, for reuse; an empty Buffer if
  // none is free.
  virtual Buffer Recycle(uint64_t min_bytes) = 0;
  // Blocks until every bucket handed to Send has left; the first error of any of them.
  virtual absl::Status Finish() = 0;
  // Where the buckets handed to Send must be (a SpaceStagingSink bridges another space): host
  // memory, or a CUDA device's for a sink that sends device buckets (the NCCL data plane).
  virtual MemorySpace space() const { return MemorySpace::Host(); }
};

struct BucketBuilderOptions {
  uint64_t bucket_bytes = 512ull << 20;  // > 0
  uint64_t version = 0;
  uint32_t pp_stage = 0;
  // Where buckets are built (common/memory_space.h): host memory, or device memory of a CUDA
  // device (the trainer's device stages: Add copies on the device, Reserve hands out device views
  // for kernels; the sink gets device Buffers, see space_staging.h). Recycled buffers of another
  // space are dropped.
  MemorySpace space = MemorySpace::Host();
};

struct BucketBuilderStats {
  uint64_t buckets = 0;            // buckets handed to the sink (the last one included)
  uint64_t bytes = 0;              // their data bytes (alignment gaps included)
  uint64_t tensors = 0;            // entries
  uint64_t peak_bucket_bytes = 0;  // the largest bucket's data bytes
  absl::Duration copy;             // copying tensors into buckets (and zeroing gaps)
  absl::Duration send_wait;        // inside BucketSink::Send and Finish
};

class BucketBuilder {
 public:
  BucketBuilder(BucketSink& sink, const BucketBuilderOptions& options);

  // Appends a copy of `tensor` under `name`; may first send the current bucket.
  absl::Status Add(absl::string_view name, const TensorView& tensor);
  // Room for tensors the caller writes itself (straight into the bucket, e.g. a quantization
  // kernel's outputs) before the next Add / Reserve / Finish. All of them go into one bucket
  // (together larger than a bucket: a bucket of their own), in order.
  struct Pending {
    std::string name;
    DType dtype = DType::kU8;
    Shape shape;
  };
  absl::StatusOr<std::vector<MutableTensorView>> Reserve(std::span<const Pending> tensors);
  // Sends the current bucket as the last one, then BucketSink::Finish.
  absl::Status Finish();

  const BucketBuilderStats& stats() const { return stats_; }

 private:
  absl::Status SendCurrent(bool last);
  absl::Status EnsureBuffer(uint64_t min_bytes);

  BucketSink& sink_;
  const BucketBuilderOptions options_;
  Buffer buffer_;
  uint64_t capacity_ = 0;  // usable bytes of buffer_ for this bucket
  uint64_t cursor_ = 0;
  v1::BucketManifest manifest_;
  uint32_t index_ = 0;
  bool finished_ = false;
  BucketBuilderStats stats_;
};

}  // namespace wsync::comm
