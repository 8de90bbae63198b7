// Staging and loading: sent HF tensors -> the slices one engine rank owns, in SGLang's *loaded*
// form (ENGINE_LAYOUT.md §2, §3), before repack/ writes them into the engine.
//
// Staging owns one buffer per engine parameter of an EngineLayout, in ParamForm::kLoaded
// (bf16 [N_p, K_p]; INT4 compressed-tensors [N_p, K_p/8] + [N_p, K_p/G]; MoE GPTQ orientation
// [E_loc, K/8, N] + [E_loc, K/G, N]), zero-initialized (the vocab padding rows stay zero), and a
// coverage state per piece (HfSource): missing, restored (filled from the engine by Restore()),
// or loaded (by Loader::Load in this sync).
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
// the Restore() of repack/ and Commit() must not run concurrently with Load. The Staging must
// outlive its Loader; the EngineLayout must outlive both.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "common/tensor.h"
#include "rollout_agent/load/engine_layout.h"

namespace wsync::rollout_agent {

class Staging {
 public:
  enum class PieceState : uint8_t { kMissing = 0, kRestored = 1, kLoaded = 2 };

  // Allocates zeroed buffers for every param in `space` (kResourceExhausted on failure; for a CUDA
  // device also kFailedPrecondition without that device, kUnimplemented without CUDA).
  static absl::StatusOr<std::unique_ptr<Staging>> Create(const EngineLayout& layout,
                                                         const MemorySpace& space = MemorySpace::Host());

  const EngineLayout& layout() const { return *layout_; }
  const MemorySpace& space() const { return space_; }
  // Waits for the loads enqueued on a device staging (a no-op on the host); their first error.
  absl::Status Synchronize() const { return space_.Synchronize(); }
  // Param `index` of layout().params() in its loaded form; the memory is owned by this Staging.
  MutableTensorView param(int index) const;
  // By SGLang name; kNotFound naming it.
  absl::StatusOr<MutableTensorView> Find(absl::string_view name) const;

  // Start of a sync: every piece missing again (buffer contents are kept).
  void ResetCoverage();
  // Every required piece restored (repack/'s Restore() calls this after filling all buffers).
  void MarkAllRestored();
  PieceState state(int source) const;

  // OK when every piece this rank needs (copies and INT4 weight_shape checks) is restored or loaded.
  absl::Status CheckComplete() const;
  // "<param>: <piece> missing (<hf tensor>)" for every missing piece, in layout order.
  std::vector<std::string> MissingPieces() const;
  int64_t num_required() const { return num_required_; }
  int64_t num_missing() const;

  // Page-locks every staging buffer (cuda_ipc.h PinHostMemory), for engines whose memory is on a
  // CUDA device: Commit's uploads then run at the link's speed. Idempotent; on failure nothing
  // stays pinned (Commit still works, through pageable copies). The pins end with the Staging.
  // A device staging has nothing to pin (OK, pinned() stays false).
  absl::Status PinForDevice();
  bool pinned() const { return !pins_.empty(); }

 private:
  friend class Loader;
  Staging(const EngineLayout& layout, const MemorySpace& space);
  static bool Required(const HfSource& s) { return s.action != HfSource::Action::kSkip; }

  const EngineLayout* layout_;
  MemorySpace space_;
  std::vector<Buffer> buffers_;
  std::unique_ptr<std::atomic<uint8_t>[]> state_;       // per layout source
  std::vector<std::unique_ptr<PinnedHostRange>> pins_;  // declared after buffers_: unpinned first
  int64_t num_required_ = 0;
};

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

  absl::Status CheckComplete() const { return staging_->CheckComplete(); }
  Staging& staging() const { return *staging_; }

 private:
  // The checks and the claim both loads share: the source index to copy, -1 when nothing is to be
  // copied (skipped, ignored, a weight_shape).
  absl::StatusOr<int> CheckAndClaim(absl::string_view hf_name, DType dtype, std::span<const int64_t> shape,
                                    const TensorView& data, const BlockRef* block);
  // Copies source `idx`'s piece from `src` (row stride `src_ld` elements), its block starting at
  // (r0, c0); on a device copy's failure the piece is missing again (kInternal).
  absl::Status CopyPiece(int idx, const std::byte* src, int64_t src_ld, int64_t r0, int64_t c0);

  Staging* staging_;
};

}  // namespace wsync::rollout_agent
