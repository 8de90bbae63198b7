// Loading: sent HF tensors -> the slices one engine rank owns, in SGLang's *loaded*
// form (ENGINE_LAYOUT.md §2, §3), into a Staging (staging.h), before repack.h writes them into the engine.
//
// Loader::Load(hf_name, data) checks the name (known to the layout), dtype and shape, the values
// of an INT4 weight_shape, then copies the block this rank owns into staging: column narrowing,
// row narrowing in packed words / groups, qkv with KV replication, gate_up halves, MoE w13/w2
// transposed to the GPTQ orientation, local experts only. A sent tensor the rank does not own
// (another EP rank's expert, a vocab range past this rank, a tied lm_head.weight, a DeepSeek MTP
// layer) is accepted and skipped. A piece loaded twice in one sync is an error (kAlreadyExists):
// each tensor is sent once per version, so a duplicate is a sender bug, not a retry. A restored
// piece may be overwritten by one load (partial updates on top of the engine's current weights).
//
// Errors (nothing is written to staging when Load fails): kInvalidArgument for an unknown name,
// a wrong dtype / shape / weight_shape value or a view whose byte size disagrees with its shape;
// kAlreadyExists for a duplicate. CheckComplete(): kNotFound naming every missing piece (the
// message lists the first 32; MissingPieces() returns all).
//
// Memory space. The staging is host memory by default, or the memory of one CUDA device (a device
// staging, for an engine whose parameters are on that GPU and which has room for a second copy of
// them: docs/gpu.md "Device staging"). Then param() views are device memory (for the kernels and
// MemorySpace copies only), every view given to Load / LoadBlock must be memory of that device too
// (the receiver puts each bucket there), and a load's copy is enqueued on the device's legacy
// default stream: Synchronize() before the source memory is reused (LoadBucket does, per bucket);
// Commit and Restore run on the same stream, after the loads. The weight_shape values are read back
// to the host to be checked. A device copy that cannot be enqueued is kInternal and its piece stays
// missing; one that fails while running surfaces at Synchronize (the sync fails).
//
// Thread-safety: Load may be called concurrently from several threads (different tensors, even
// of the same param: pieces never overlap and each piece is claimed atomically). ResetCoverage,
// MarkAllRestored, ForgetSums, set_recheck_every, Restore() and Commit() (repack.h) must not run
// concurrently with Load. The Staging must
// outlive its Loader; the EngineLayout must outlive both.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "common/tensor.h"
#include "engine_model/engine_layout.h"
#include "engine_model/staging.h"
#include "kernels/delta.h"

namespace wsync::engine_model {

class Loader {
 public:
  explicit Loader(Staging* staging) : staging_(staging) {}

  // See the file comment. `data` is a dense row-major view of the whole sent tensor (any
  // alignment); it is only read during the call.
  absl::Status Load(absl::string_view hf_name, const TensorView& data);

  // Sharded delivery: `data` is a dense row-major [rows, cols] block of the sent tensor `hf_name`
  // (dtype, shape: the whole tensor's, at most 2 dims), at (row0, col0) of its matrix view
  // (MatrixOf). The block must be exactly the one this rank keeps (HfSource's rows and columns;
  // all of a weight_shape), else kInvalidArgument naming both, nothing written: a block for a
  // rank that keeps none of the tensor is refused too. Otherwise as Load.
  struct BlockRef {
    int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  };
  absl::Status LoadBlock(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape, const BlockRef& block,
                         const TensorView& data);

  // Delta delivery (kernels/delta.h): `payload` is the change of the sent tensor `hf_name` (dtype,
  // shape: the whole tensor's, at most 2 dims) from the version this staging holds, in
  // `delta.encoding` over its elements (items of the dtype's size); only the elements inside the
  // block this rank keeps are applied. `base_sum` and `sum` are the Sum64 (kernels/format/sum64.h)
  // of that block's dense row-major bytes, as sent, in the base version and in the new one. The
  // staging's block must be the base: the sum the staging recorded when it last checked the block
  // (Staging::known_sum) or, when none is known and at every Staging::recheck_every()-th delta of
  // the piece, the block read back and summed, must be base_sum. The delta is then applied in
  // place by kernels::ApplyDeltaChecked, and kept only if the result's Sum64 (updated over the
  // changed words; a dense payload's summed whole) is `sum`; it becomes the piece's known sum. A
  // sparse delta costs its changed words, not passes over the block; the staging's other bytes are
  // trusted for at most recheck_every() deltas.
  // Errors, the piece left as it was: kFailedPrecondition when the piece holds no base (not
  // restored: Staging::MarkAllRestored); kDataLoss when the staging's block is not the base, the
  // payload is malformed or the result is not the new version; kAlreadyExists as Load;
  // kInvalidArgument for a wrong name, dtype or shape, or an INT4 weight_shape (sent whole, never as
  // a delta); kUnimplemented for a device staging. A tensor this rank keeps none of is checked and skipped.
  // With `block` (sharded delivery), the delta's elements are those of that block of the tensor
  // (dense [rows, cols]), which must hold all this rank keeps (else kInvalidArgument, nothing claimed).
  struct DeltaRef {
    kernels::DeltaEncoding encoding = kernels::DeltaEncoding::kDense;
    uint64_t base_sum = 0, sum = 0;
    std::optional<BlockRef> block;
  };
  absl::Status LoadDelta(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape, const DeltaRef& delta,
                         std::span<const uint8_t> payload);

  absl::Status CheckComplete(bool loaded_only = false) const { return staging_->CheckComplete(loaded_only); }
  Staging& staging() const { return *staging_; }

 private:
  // The sent tensor's source index after checking its name, dtype and shape; -1 for a tensor the
  // layout ignores (only when `whole`: a block or delta of it is refused).
  absl::StatusOr<int> FindSent(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                               bool whole) const;
  // The checks and the claim both loads share: the source index to copy, -1 when nothing is to be
  // copied (skipped, ignored, a weight_shape).
  absl::StatusOr<int> CheckAndClaim(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                                    const TensorView& data, const BlockRef* block);
  // Copies source `idx`'s piece from `src` (row stride `src_ld` elements), its block starting at
  // (r0, c0); on a device copy's failure the piece is missing again (kInternal).
  absl::Status CopyPiece(int idx, const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0);

  Staging* staging_;
};

}  // namespace wsync::engine_model
