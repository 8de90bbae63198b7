// One pipeline stage's stream on a rollout agent: form the stage's data-plane group (the trainer
// stage source is group rank 0, this agent is `rank`), receive its buckets (comm/bucket/stream.h:
// size and checksum checked there), check each manifest against the sync, load every entry into
// staging with the Loader (several entries of a bucket at once), and record the bucket if asked.
// The consumer loads bucket k while bucket k+1 arrives (the BucketReceiver's queue of one).
// Over NCCL the buckets arrive in device memory (the GPU `cuda_device`). The loader reads each
// bucket in its staging's space (docs/gpu.md "Receiving on the GPU", "Device staging"): a device
// bucket is loaded in place into a device staging, or copied once to a page-locked host buffer
// for a host staging; a host bucket (gloo, shm) is loaded in place into a host staging, or
// uploaded once into a device buffer for a device staging (SpaceBridge, receive/space_bridge.h). A
// device staging must be on the GPU the buckets arrive on.
//
// Checks per bucket, each failing the stage with an error naming stage and bucket:
//   manifest.version == the sync's version, manifest.pp_stage == the group's stage (kInvalidArgument);
//   no split entries (kUnimplemented: the agent loads whole tensors or blocks);
//   every entry through Loader::Load, or Loader::LoadBlock for a block entry (sharded delivery:
//   the block must be exactly this rank's) (kInvalidArgument unknown name / dtype / shape / block,
//   kAlreadyExists).
// A bucket whose `targets` is non-empty and does not hold this agent's rank is skipped.
//
// SyncCancel ties the stages of one sync together: Cancel(reason) sets the flag that group
// formation polls and aborts every registered communicator, so a blocked receive fails at once
// (kAborted) and the trainer side sees the failure (its peers' connections close). ReceiveStage
// aborts its own group when it fails; the caller cancels the other stages (the sync is lost anyway,
// and the senders learn it fast). A stage that fails because the sync was cancelled returns
// kAborted carrying the cancel reason.
//
// Thread-safety: ReceiveStage blocks its calling thread; SyncCancel is safe from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "common/buffer_pool.h"
#include "engine_model/loader.h"
#include "rollout_agent/receive/recorder.h"

namespace wsync::rollout_agent {

class SyncCancel {
 public:
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  // Sets the flag and aborts every registered communicator (and any registered later). The first
  // reason is kept. Never blocks for long.
  void Cancel(const std::string& reason);
  std::string reason() const;
  // Registers `comm` for Cancel(); if the sync is already cancelled, aborts it at once and returns
  // false. Unregister before destroying the communicator.
  bool Register(comm::Communicator* comm);
  void Unregister(comm::Communicator* comm);

 private:
  std::atomic<bool> cancelled_{false};
  mutable absl::Mutex mu_;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  std::vector<comm::Communicator*> comms_ ABSL_GUARDED_BY(mu_);
};

// The stages of one NCCL sync on one agent share its GPU, and NCCL's group formation allocates
// device memory, which may wait for the device while another stage's broadcast there waits for
// this process: every stage forms its group, then waits here until all have (or the sync is
// cancelled, or the join timeout passes) before it receives. Thread-safety: any thread.
class FormationLatch {
 public:
  explicit FormationLatch(int stages) : left_(stages) {}
  void Arrive();
  // OK once every stage arrived; kAborted when `cancel` is set first (polled every 20 ms);
  // kDeadlineExceeded naming how many stages are still forming after `timeout`.
  absl::Status Wait(const SyncCancel& cancel, absl::Duration timeout);

 private:
  absl::Mutex mu_;
  int left_ ABSL_GUARDED_BY(mu_);
};

struct StageOptions {
  comm::Backend backend = comm::Backend::kGloo;
  comm::Store* store = nullptr;  // not owned
  std::string group;             // SyncGroup.name
  uint32_t pp_stage = 0;
  int rank = 1;  // this agent's rank in the group (1..M)
  int size = 2;
  std::string host = "127.0.0.1";  // where this agent's data-plane endpoints listen (GroupOptions::host)
  uint64_t version = 0;            // the sync's version; every manifest must carry it
  absl::Duration join_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Minutes(5);  // per bucket broadcast
  engine_model::Loader* loader = nullptr;        // not owned
  const Recorder* recorder = nullptr;            // optional, not owned
  int load_threads = 2;                          // entries of one bucket loaded concurrently
  SyncCancel* cancel = nullptr;                  // not owned; required
  BufferPool* pool = nullptr;                    // optional, not owned: bucket buffers, each given back once loaded
  // The NCCL data plane (buckets received into device memory, comm/bucket/stream.h):
  int cuda_device = 0;                // the GPU this agent receives on (GroupOptions::cuda_device)
  BufferPool* device_pool = nullptr;  // optional, not owned: receive buffers on that GPU (else a pool of the stage's)
  // Host buffers a device bucket is copied into for the loader (page-locked: the copy runs at
  // the link's speed); optional, not owned (else a pool of the stage's). Pools given for an NCCL
  // stage must not free while streams run (BufferPool keep_until_trim).
  BufferPool* host_pool = nullptr;
  // Optional, not owned: the sync's formation latch (the rollout agent gives one to NCCL syncs).
  FormationLatch* formed = nullptr;
  // The sync's bucket key (comm/bucket/bucket_mac.h): every bucket's tag is verified; empty: none.
  std::string bucket_mac_key;
  // A delta sync: the version the staging holds, that deltas apply to (a manifest naming another
  // base is refused, kFailedPrecondition); 0: a full sync (a manifest of deltas is refused).
  uint64_t delta_base = 0;
};

struct StageStats {
  uint64_t buckets = 0;
  uint64_t bytes = 0;            // bucket data bytes
  uint64_t tensors = 0;          // entries received (loaded or accepted and skipped by the loader)
  absl::Duration join;           // forming the group
  absl::Duration transfer;       // group formed -> last bucket loaded
  absl::Duration load;           // wall time in the loader (overlaps the transfer)
  absl::Duration record;         // writing recordings
  absl::Duration to_host;        // NCCL: copying device buckets to host memory for a host staging (or the recorder)
  absl::Duration to_device;      // gloo / shm: uploading host buckets to a device staging's GPU
  uint64_t to_host_bytes = 0;    // bucket bytes copied device -> host (0: the payload stayed on the GPU)
  uint64_t to_device_bytes = 0;  // bucket bytes copied host -> device
};

// Loads every entry of one received bucket (manifest validated by comm::ValidateManifest) into
// staging, up to `threads` entries at once (one for buckets under 1 MiB of work: a delta entry counts its whole
// tensor); the first error, naming the stage and bucket. What ReceiveStage does per bucket; public for tests of other
// senders.
absl::Status LoadBucket(const v1::BucketManifest& m, const Buffer& data, engine_model::Loader& loader, int threads);

// See the file comment. Returns the stage's first error; on error the group is aborted.
absl::StatusOr<StageStats> ReceiveStage(const StageOptions& options);

}  // namespace wsync::rollout_agent
