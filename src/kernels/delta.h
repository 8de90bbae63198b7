// The sparse encoding of one tensor's change (this header is its spec): the items of its engine-form bytes
// (bf16 elements, packed INT4 words, scales, FP8 codes: `item_bytes` each) that differ between the
// base version a receiver holds and the new one, in whichever of three encodings is smallest:
//   kDense    the new bytes, whole (items x item_bytes);
//   kIndices  u64 count, count ascending item indices, then the count new items;
//   kRuns     u64 count, count (start, length) pairs of ascending, disjoint item ranges, then the
//             new items of every range in order. Runs of changed items closer than one pair's
//             bytes are merged (the unchanged items between them travel as values).
// Indices, starts and lengths are u32 when the tensor has fewer than 2^32 items, else u64; all
// little-endian, packed, no padding. The payload names neither the tensor nor its base: the
// bucket's manifest entry does (and the base's and the result's checksums with it).
//
// The sender plans (one pass over base and new: sizes of the three encodings, the smallest) and
// writes (a second pass); the receiver applies a payload onto its copy of the base (all of it, or
// the block its engine rank keeps) in place, after checking the whole payload, so a malformed one
// changes nothing. Whether the base was the right one and the result is the new version is for
// the checksums around this (an applied delta of the wrong base is well-formed and wrong):
// ApplyDeltaChecked below checks the result's against the one the manifest carries.
// Thread-safety: pure functions over caller-owned memory.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wsync::kernels {

enum class DeltaEncoding : uint8_t { kDense = 0, kIndices = 1, kRuns = 2 };
absl::string_view DeltaEncodingName(DeltaEncoding e);

// What PlanDelta found and chose.
struct DeltaPlan {
  DeltaEncoding encoding = DeltaEncoding::kDense;
  uint32_t item_bytes = 0;
  uint64_t items = 0;          // the tensor's items
  uint64_t changed_items = 0;  // items whose bytes differ (0: the tensor did not change)
  uint64_t runs = 0;           // runs of changed items after merging (kRuns' count)
  uint64_t payload_bytes = 0;  // of the chosen encoding
  uint64_t dense_bytes = 0, indices_bytes = 0, runs_bytes = 0;  // of each encoding
};

// Compares base and next (the same size, a multiple of item_bytes, which is 1, 2, 4 or 8) item by
// item and picks the smallest encoding (ties: dense, then runs, then indices). kInvalidArgument for
// sizes that differ or are not whole items, or another item size.
absl::StatusOr<DeltaPlan> PlanDelta(std::span<const uint8_t> base, std::span<const uint8_t> next, uint32_t item_bytes);

// The payload PlanDelta would choose at most for `changed` of `items` items changed far apart (a
// uniformly random change, no two neighbours): the index list, or the dense bytes when smaller.
// What wsync-plan --changed-fraction projects per tensor.
uint64_t ScatteredDeltaBytes(uint64_t items, uint32_t item_bytes, uint64_t changed);

// Writes plan's payload for base -> next into out (exactly plan.payload_bytes). kInvalidArgument
// when out's size or the tensors are not those the plan was made from.
absl::Status WriteDelta(const DeltaPlan& plan, std::span<const uint8_t> base, std::span<const uint8_t> next,
                        std::span<uint8_t> out);

// Applies payload (encoded as `encoding`) onto `tensor`, the receiver's copy of the base, in place.
// The whole payload is checked first: its size against its counts, every index / range ascending,
// disjoint, non-empty and inside the tensor. A payload that fails is kDataLoss naming `what` and
// what is wrong, and tensor is left untouched. kInvalidArgument for a tensor that is not whole
// items or another item size.
absl::Status ApplyDelta(absl::string_view what, DeltaEncoding encoding, uint32_t item_bytes,
                        std::span<const uint8_t> payload, std::span<uint8_t> tensor);

// The block a receiver keeps of a tensor viewed as a [tensor_rows, tensor_cols] matrix of items
// (common/tensor.h MatrixOf, in items): rows [row0, row0 + rows) x columns [col0, col0 + cols).
struct DeltaBlock {
  uint64_t tensor_rows = 0, tensor_cols = 0;
  uint64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
};

// ApplyDelta for a receiver that holds only `block` of the tensor, dense row-major in `bytes`
// (rows x cols items): the payload is the whole tensor's and is checked whole as ApplyDelta checks
// it; only the items inside the block are written (an engine rank's slice under broadcast
// delivery). kInvalidArgument for a block outside the tensor or `bytes` of another size.
absl::Status ApplyDeltaToBlock(absl::string_view what, DeltaEncoding encoding, uint32_t item_bytes,
                               std::span<const uint8_t> payload, const DeltaBlock& block, std::span<uint8_t> bytes);

// Where a receiver's block lives in its memory: item (r, c) of the block (dense row-major as sent)
// at data + (r * row_stride + c * col_stride) * item_bytes, strides in items. A block kept as sent,
// in a matrix of `ld` columns: {at, ld, 1}; kept transposed: {at, 1, ld}.
struct StridedItems {
  uint8_t* data = nullptr;
  uint64_t row_stride = 0, col_stride = 1;
};

// ApplyDeltaToBlock onto a block held in place at `at`, kept only if the result is the new
// version: `base_sum` is the Sum64 (format/sum64.h) of the block's dense bytes as they are now
// (the caller knows it: it checked or wrote them), `sum` the new version's. A sparse payload
// (indices, runs) is applied word by word, each changed word visited once: read, its term in
// base_sum replaced by the new word's, written, and logged; when the updated sum is not `sum`,
// every logged word is put back before it returns. So it costs the changed words, not a pass over
// the block, and it trusts base_sum for the words it does not touch. A dense payload is summed
// from its own bytes, and written only when that sum is `sum`.
// Errors, the block as it was: kDataLoss for a malformed payload (as ApplyDelta, checked whole
// before any word is touched) or a result whose Sum64 is not `sum`; kInvalidArgument for a block
// outside the tensor or an item size other than 1, 2, 4 or 8. That `at` holds the block's items
// (rows x cols of them at its strides) is the caller's to ensure: no memory size is passed.
// Thread-safety: nothing else may read or write `at`'s block while it runs.
absl::Status ApplyDeltaChecked(absl::string_view what, DeltaEncoding encoding, uint32_t item_bytes,
                               std::span<const uint8_t> payload, const DeltaBlock& block, StridedItems at,
                               uint64_t base_sum, uint64_t sum);

}  // namespace wsync::kernels
