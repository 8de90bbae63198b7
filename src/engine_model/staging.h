// Staging: one engine rank's parameters in SGLang's *loaded* form (ENGINE_LAYOUT.md §2, §3), the
// place a sync writes into (loader.h) while the engine serves, and what repack.h's Commit writes
// into the engine and Restore refills from it.
//
// Staging owns one buffer per engine parameter of an EngineLayout, in ParamForm::kLoaded
// (bf16 [N_p, K_p]; INT4 compressed-tensors [N_p, K_p/8] + [N_p, K_p/G]; MoE GPTQ orientation
// [E_loc, K/8, N] + [E_loc, K/G, N]), zero-initialized (the vocab padding rows stay zero), and a
// coverage state per piece (HfSource): missing, restored (filled from the engine by Restore()),
// or loaded (by Loader::Load in this sync).
//
// Memory space. The staging is host memory by default, or the memory of one CUDA device (a device
// staging, for an engine whose parameters are on that GPU and which has room for a second copy of
// them: docs/gpu.md "Device staging"). Then param() views are device memory (for the kernels and
// MemorySpace copies only); loads are enqueued on the device's legacy default stream, and
// Synchronize() waits for them.
//
// Errors: Create: kResourceExhausted (allocation), kFailedPrecondition (no such device),
// kUnimplemented (a device staging without CUDA). CheckComplete(): kNotFound naming every missing
// piece (the message lists the first 32; MissingPieces() returns all).
//
// Thread-safety: the piece states are atomic (Loader claims pieces concurrently); ResetCoverage,
// MarkAllRestored, ForgetSums and Restore() / Commit() must not run concurrently with loads. Ownership: the
// Staging owns its buffers and pins; the EngineLayout must outlive it.
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

namespace wsync::engine_model {

class Loader;

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

  // Start of a sync: every piece missing again (buffer contents are kept, their known sums dropped).
  void ResetCoverage();
  // Every required piece restored (repack.h's Restore() calls this after filling all buffers).
  void MarkAllRestored();
  PieceState state(int source) const;

  // The Sum64 (kernels/format/sum64.h) of piece `source`'s kept block, dense as sent, when this
  // staging knows it: a delta load that checked the block records it (Loader::LoadDelta), and every
  // other write drops it (Loader's other loads, ResetCoverage, ForgetSums, which Restore and the
  // copy from a peer call). A delta's base is then checked against it without reading the block,
  // except at every recheck_every()-th delta of the piece (staggered over the pieces; default 16,
  // 1: at every delta), when the block is read back and summed whole: bytes no delta writes are
  // trusted for at most that many deltas of their piece. Whoever writes param() bytes by other means must call
  // ForgetSums.
  std::optional<uint64_t> known_sum(int source) const;
  void ForgetSums();
  int recheck_every() const { return recheck_every_; }
  void set_recheck_every(int n) { recheck_every_ = n < 1 ? 1 : n; }

  // OK when every piece this rank needs (copies and INT4 weight_shape checks) is restored or loaded;
  // `loaded_only`: loaded in this sync (a delta sync, which begins with every piece restored: a
  // tensor that did not arrive is missing, not taken as unchanged).
  absl::Status CheckComplete(bool loaded_only = false) const;
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
  std::unique_ptr<std::atomic<uint8_t>[]> state_;  // per layout source
  // Per layout source: known_sum's value, and whether it is known. A piece's entries are written
  // by the one load that claimed it, so loads of different pieces never share one.
  std::unique_ptr<uint64_t[]> sums_;
  std::unique_ptr<bool[]> sum_known_;
  std::unique_ptr<int[]> sum_uses_;  // deltas checked against the sum (from source % every at the first read)
  int recheck_every_ = 16;
  std::vector<std::unique_ptr<PinnedHostRange>> pins_;  // declared after buffers_: unpinned first
  int64_t num_required_ = 0;
};

}  // namespace wsync::engine_model
