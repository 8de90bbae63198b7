// SpaceBridge: the receive-side counterpart of comm::SpaceStagingSink (comm/bucket/space_staging.h).
// Buckets arrive in the data-plane group's memory space (host for gloo / shm, the group's GPU for
// NCCL) and the loader reads them in the staging's space; a recorder reads them in host memory.
// Per bucket (Bridge), by arrival -> staging space:
//   host   -> host     nothing moves: the received buffer is loaded and recorded;
//   device -> host     one copy into a page-locked host buffer, which is loaded and recorded; the
//                      device buffer goes back to its pool at once (free for the next receive);
//   device -> device   nothing moves for the loader (loaded in place); with a recorder, one copy
//                      into a page-locked host buffer for it;
//   host   -> device   one upload into a buffer on the staging's GPU, which is loaded; the received
//                      buffer is recorded.
// A device bucket on another GPU than a device staging's is refused (Check).
// Copies are synchronous on the calling thread (docs/gpu.md "Receiving on the GPU", "Device staging").
//
// Ownership: buffers come from the pools in SpaceBridgeOptions (not owned; they must outlive the
// bridge), else from pools of the bridge's own (device and page-locked ones free nothing until
// the bridge goes, as NCCL needs: BufferPool keep_until_trim). Every buffer a Bridged holds is
// returned with GiveBack once loaded and recorded.
// Errors: Check: kFailedPrecondition naming both spaces. Bridge: the pool's allocation error or
// the copy's (kInternal naming the CUDA error), annotated with `where` and the bucket.
// Thread-safety: one thread (a stage's receive loop); the pools given may be shared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/buffer_pool.h"
#include "common/memory_space.h"

namespace wsync::rollout_agent {

struct SpaceBridgeOptions {
  MemorySpace arrive = MemorySpace::Host();  // where buckets arrive (Communicator::space())
  MemorySpace load = MemorySpace::Host();    // where the loader reads them (the staging's space)
  bool record = false;                       // a recorder reads every bucket in host memory
  // Optional, not owned: host receive buffers (StageOptions::pool); null: the receiver's own.
  BufferPool* host_receive_pool = nullptr;
  // Optional, not owned: device buffers, received into (NCCL) or uploaded into (device staging).
  BufferPool* device_pool = nullptr;
  // Optional, not owned: page-locked host buffers a device bucket is copied into.
  BufferPool* pinned_pool = nullptr;
};

// One bucket on both sides of the bridge. Empty buffers are the ones its path does not use.
struct Bridged {
  Buffer received;   // as it arrived (emptied once given back early: device -> host)
  Buffer host_copy;  // device arrival: its bytes in host memory, for a host staging or the recorder
  Buffer uploaded;   // host arrival into a device staging: its bytes on the staging's GPU
};

struct SpaceBridgeStats {
  absl::Duration to_host;    // copying device buckets to host memory
  absl::Duration to_device;  // uploading host buckets to a device staging's GPU
  uint64_t to_host_bytes = 0;
  uint64_t to_device_bytes = 0;
};

class SpaceBridge {
 public:
  // OK unless buckets arrive on one GPU and the staging is on another (kFailedPrecondition).
  static absl::Status Check(MemorySpace arrive, MemorySpace load);

  // `o` as Check allows it.
  explicit SpaceBridge(const SpaceBridgeOptions& o);
  SpaceBridge(const SpaceBridge&) = delete;
  SpaceBridge& operator=(const SpaceBridge&) = delete;

  // The pool to receive buckets into (comm::BucketReceiver); null: the receiver allocates.
  BufferPool* receive_pool() const { return receive_pool_; }

  // Moves `received` (its first `nbytes`) to where the loader and the recorder read it. `where`
  // and `bucket` name the stage and the bucket in errors. On error `out` holds what to give back.
  absl::Status Bridge(Buffer received, uint64_t nbytes, const std::string& where, const std::string& bucket,
                      Bridged* out);
  // The buffer the loader reads (in the staging's space), and the bytes the recorder writes (in
  // host memory; null unless SpaceBridgeOptions::record or a host arrival).
  const Buffer& Loadable(const Bridged& b) const;
  const std::byte* HostBytes(const Bridged& b) const;

  // Returns a buffer (empty ones are ignored) or all of a bucket's to the pool it came from.
  void GiveBack(Buffer b);
  void GiveBack(Bridged& b);

  const SpaceBridgeStats& stats() const { return stats_; }

 private:
  const MemorySpace arrive_;
  const MemorySpace load_;
  std::optional<BufferPool> own_device_pool_, own_host_pool_, own_upload_pool_;
  BufferPool* receive_pool_ = nullptr;
  BufferPool* host_pool_ = nullptr;    // page-locked host copies of device buckets
  BufferPool* upload_pool_ = nullptr;  // device buffers a host bucket is uploaded into (device staging)
  SpaceBridgeStats stats_;
};

}  // namespace wsync::rollout_agent
