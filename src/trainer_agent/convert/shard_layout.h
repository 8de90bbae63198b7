// Where each rank's shard of a parameter sits in the full tensor, as byte copies: the one place
// that defines the TP / expert-TP layouts of MEGATRON_TO_HF §2 for both directions.
//   MergeShards  assembles the full tensor from the group's shards (the all-gather's result):
//                cat along dim 0 or 1, GLU fc1 de-interleaved to [g_0..g_{T-1}, u_0..u_{T-1}].
//   ShardFull    cuts a rank's shard out of the full tensor (the sharder; the exact inverse).
// Each kind is at most two strided block copies, done with memcpy straight between the shards
// and `full`: no intermediate buffer.
//
// Errors: kInvalidArgument naming the parameter and the values (shard count != group size,
// a shard or output with the wrong dtype or shape, or overlapping output and input).
// Thread-safety: pure functions; concurrent calls writing different outputs are safe.
#pragma once

#include <cstdint>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/memory_space.h"
#include "common/tensor.h"
#include "trainer_agent/convert/megatron_param.h"

namespace wsync::trainer_agent {

// `count` copies of `bytes` bytes: the i-th from local + local_offset + i*local_stride to
// full + full_offset + i*full_stride.
struct StridedCopy {
  int64_t count = 1;
  int64_t local_offset = 0;
  int64_t local_stride = 0;
  int64_t full_offset = 0;
  int64_t full_stride = 0;
  int64_t bytes = 0;
};

// Copies `rows` rows of `row_bytes` from `src` (rows `src_pitch` bytes apart) to `dst` (rows
// `dst_pitch` apart) in `space` (MemorySpace::Copy2D: one memcpy where both are contiguous on the
// host, one cudaMemcpy2DAsync on a device). What every StridedCopy, and the AWQ holders' placement
// of a part in its triple, come down to. Errors: the space's (none on the host).
absl::Status CopyRows(std::byte* dst, uint64_t dst_pitch, const std::byte* src, uint64_t src_pitch, int64_t rows,
                      uint64_t row_bytes, const MemorySpace& space = MemorySpace::Host());

// The copies that place the shard of group rank `rank_in_group` in the full tensor.
absl::InlinedVector<StridedCopy, 2> ShardCopies(const MegatronParam& param, int rank_in_group);

// `shards[r]` is group rank r's local tensor (param.local_shape, param.dtype); `full` receives
// param.full_shape. For kReplicated, exactly one shard, copied.
// The views are memory of `space` (the device gathers merge on the GPU).
absl::Status MergeShards(const MegatronParam& param, absl::Span<const TensorView> shards, MutableTensorView full,
                         const MemorySpace& space = MemorySpace::Host());

// Writes group rank `rank_in_group`'s shard of `full` into `local`.
absl::Status ShardFull(const MegatronParam& param, const TensorView& full, int rank_in_group, MutableTensorView local,
                       const MemorySpace& space = MemorySpace::Host());
// Same, into a new tensor.
absl::StatusOr<Tensor> ShardFull(const MegatronParam& param, const TensorView& full, int rank_in_group);

}  // namespace wsync::trainer_agent
