// The shm backend: a group of processes on one host (the colocated mode: trainer agents and
// rollout agents beside the same GPUs) that moves bytes through one POSIX shared-memory segment,
// with no network and no NCCL group. Formed through the rendezvous Store like Gloo.
//
// Formation: every member announces "<boot id>/<device of /dev/shm>" (JoinGroup; a member that
// does not come is named). Members on another host, or in a container with another /dev/shm,
// are refused with kFailedPrecondition naming both. Rank 0 creates the segment (shm_open
// O_EXCL, mode 0600, a random name), publishes its name in the store, waits until every member
// has mapped it and unlinks it: a crash can leave nothing behind in /dev/shm.
//
// Segment: a header (per rank: pid, start time, chunks consumed; the group's published chunk
// count; a "broken" flag with the rank and reason), then a ring of kSlots slots of kSlotBytes.
// Every collective is built on one primitive, a chunked broadcast through the ring: the root
// copies chunk g into slot g % kSlots once every member has consumed chunk g - kSlots, then
// publishes it; receivers copy it out and count it consumed. Chunk numbers are global (every
// member issues the same operations with the same sizes), so roots may change between operations.
// An operation ends on every member only when every member has consumed its last chunk, so a
// completed Broadcast means delivered everywhere (and a 1-byte one is a barrier).
//   AllGather / AllGatherV   one broadcast per rank, in rank order (own block copied locally)
//   Barrier                  a 1-byte broadcast from rank 0
// Waiting: spin, then short sleeps; every 20 ms the waiter checks its deadline and Abort (the
// OpContext), the broken flag, and that every peer process is alive (its /proc entry, start time
// and not a zombie): a dead peer gives kUnavailable naming it within ~20 ms, a peer's failure or
// Abort (OnBroken sets the flag) kUnavailable naming its rank.
// Limits: 2..kMaxRanks members (1 is allowed: operations are local copies).
//
// Device ring (Ring::kDevice, the colocated hand-off on GPUs): the same protocol with the ring's
// slots in one CUDA allocation of rank 0 on its GroupOptions::cuda_device (kDeviceSlots slots of
// kDeviceSlotBytes), which every member opens once by its IPC handle when the group forms; the
// header stays in the host segment. space() is then that device: every operation's buffers are
// device memory (or host memory, as MemorySpace::Copy allows), chunks move device to device, and
// a chunk is published (or counted consumed) only after its copy finished on the device. Rank 0
// publishes the ring's handle with the segment's name, or why it has none (no GPU, allocation
// refused): every member then fails formation with that reason instead of waiting for a ring. When
// a member's device cannot open the handle (another GPU without peer access), every member falls
// back to the host ring in the segment (space() is then the host), and each logs it once, with
// that member's reason, when the group forms.
// Thread-safety: as Communicator.
#pragma once

#include <memory>
#include <string>

#include "comm/queued_communicator.h"
#include "common/memory_space.h"

namespace wsync::comm {

class ShmCommunicator final : public QueuedCommunicator {
 public:
  static constexpr int kMaxRanks = 256;
  static constexpr int kSlots = 4;
  static constexpr size_t kSlotBytes = size_t{4} << 20;

  static constexpr int kDeviceSlots = 4;
  static constexpr size_t kDeviceSlotBytes = size_t{32} << 20;

  enum class Ring { kHost, kDevice };

  // See GroupOptions (host is unused; cuda_device only for Ring::kDevice). Blocks until every
  // member has mapped the segment (and opened the device ring). kInvalidArgument for bad options,
  // kFailedPrecondition for members on different hosts or a device ring that cannot be made or
  // opened (the reason named on every member), kUnimplemented for a device ring in a build without
  // CUDA, the store's and JoinGroup's errors, errno codes (naming the segment) for shm failures.
  static absl::StatusOr<std::unique_ptr<Communicator>> Create(const GroupOptions& options, Ring ring = Ring::kHost);
  ~ShmCommunicator() override;

  absl::string_view Name() const override { return "shm"; }
  MemorySpace space() const override { return space_; }

 protected:
  absl::Status DoBroadcast(const OpContext& ctx, absl::Span<const MutableBytes> buffers, int root) override;
  absl::Status DoAllGather(const OpContext& ctx, absl::Span<const ConstBytes> inputs,
                           absl::Span<const MutableBytes> outputs) override;
  absl::Status DoAllGatherV(const OpContext& ctx, ConstBytes input, MutableBytes output,
                            absl::Span<const size_t> bytes_per_rank) override;
  absl::Status DoBarrier(const OpContext& ctx) override;
  void Interrupt() override {}  // waits poll the OpContext
  void OnBroken() override;
  absl::Status ReleaseBackend() override;

 private:
  struct Header;
  struct DeviceRing;
  ShmCommunicator(const GroupOptions& options, void* base, size_t bytes);
  // Rank 0: allocates the device ring and returns its handle; the others open `handle`.
  absl::StatusOr<std::string> MakeDeviceRing(const GroupOptions& options, const std::string& handle);
  // Every member, when some member cannot open the device ring: the host ring of the segment.
  void UseHostRing(const std::string& because);
  // The chunked broadcast of the concatenation of `pieces` from `root` (see the file comment).
  absl::Status Stream(const OpContext& ctx, absl::Span<const MutableBytes> pieces, int root);
  // Waits until `ready()`; kUnavailable / kDeadlineExceeded / kAborted as in the file comment.
  template <typename Ready>
  absl::Status WaitFor(const OpContext& ctx, Ready&& ready, const char* what);
  absl::Status CheckPeers() const;

  Header* header_;
  std::byte* ring_;  // the slots: in the host segment, or device memory of space_
  size_t bytes_;
  MemorySpace space_ = MemorySpace::Host();
  int slots_ = kSlots;
  size_t slot_bytes_ = kSlotBytes;
  std::unique_ptr<DeviceRing> device_ring_;
  uint64_t next_chunk_ = 0;  // global chunk number of this member's next operation
};

}  // namespace wsync::comm
