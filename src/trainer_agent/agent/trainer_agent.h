// The trainer agent process (one per Megatron rank, launched by mpirun in Megatron's rank order).
//
// Every rank: joins the MPI world, opens its weight source (dir: a Megatron directory; shm: waits
// for its training process to register), makes its TP / ETP / EP sub-communicators, and waits on the
// command channel (a fixed-size Broadcast from rank 0 over the world). Rank 0 also hosts the
// Coordinator; its TrainerSide turns each sync into a command, so every rank runs the same sync:
//   1. each stage source forms its stage's data-plane group with the rollout agents (Gloo/NCCL,
//      rendezvous through the coordinator's store) - then all ranks vote, so a source that
//      could not form its group fails the sync everywhere before any gather starts;
//   2. RunRankSync (trainer_agent/sync): gathers on all ranks, convert/quantize/bucket/send on
//      the stage sources (BucketSender, progress counted in the store);
//   3. every rank's result is gathered to rank 0 (first error, per-phase times).
// A data-plane failure (a rollout agent lost mid-stream) turns the stage source's sink into a
// drain: the trainer collectives still complete on every rank, and the error is reported then.
//
// Thread-safety: Run() is the process's main loop; Stop() may be called from a signal handler.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/rpc_security.h"
#include "model/expert_map.h"

namespace wsync::trainer_agent {

struct TrainerAgentOptions {
  std::string source;                          // "dir:PATH" or "shm:NAME" (trainer_agent/source/)
  std::string coordinator = "127.0.0.1:7070";  // the coordinator's address as every rank and agent dials it
  std::string coordinator_listen;              // what rank 0 binds (e.g. 0.0.0.0:7070); empty: `coordinator`
  // The address the stage sources' data-plane (Gloo) endpoints listen on; empty: the local address
  // that faces the coordinator (each rank's own host, e.g. its InfiniBand or Ethernet interface).
  std::string data_host;
  std::string metrics_host = "127.0.0.1";  // the Prometheus endpoint's address (0.0.0.0 for a scraper elsewhere)
  std::string backend = "gloo";            // trainer -> rollout data plane
  // The GPU this rank's nccl data plane sends from (--cuda-device); -1: the GPU of the training
  // process's tensors when they are read in place (the device stages), else the local rank
  // (OMPI_COMM_WORLD_LOCAL_RANK, else SLURM_LOCALID, else LOCAL_RANK, else 0) modulo the GPUs visible.
  int cuda_device = -1;
  // Syncs that do not choose: every agent receives every byte (broadcast) or only its engine
  // rank's blocks (sharded; plan/delivery_plan.h).
  std::string delivery = "broadcast";
  // Syncs that do not choose: "off" (every byte), "auto" or "on" (only what changed since the
  // version the engines hold; coordinator/sync_coordinator.h DeltaMode).
  std::string delta = "off";
  uint64_t bucket_bytes = uint64_t{512} << 20;
  std::optional<QuantizationConfig> quant;     // the engines' quantization config (else the model's own)
  std::optional<model::ExpertMap> expert_map;  // expert pruning (checked against the model at every sync)
  int quant_threads = 0;
  // Delta syncs: a quantized block whose last comparison reused under this share of its groups is
  // quantized without digests for a while (QuantMemo::set_pause_below; 0: never).
  double reuse_pause_below = 0.1;
  absl::Duration sync_timeout = absl::Minutes(10);
  RpcSecurity security;
  bool bucket_mac = false;   // rank 0: authenticate every bucket (--bucket-mac; comm/bucket/bucket_mac.h)
  int metrics_port = -1;     // -1: none; 0: any
  std::string address_file;  // rank 0 writes the coordinator's bound address here
  std::string state_dir;     // rank 0: the coordinator's durable state (--state-dir; "": in memory only)
  // shm: sources: run the device stages where the training process's tensors are CUDA memory
  // (sync/rank_sync.h); false (--host-stages): copy them to the host first.
  bool device_stages = true;
  // The world without mpirun (launchers that start every rank on its own: wsync.ray, python/wsync/ray.py):
  // world_size > 0 forms a Gloo world of world_size ranks, this one world_rank, through a store
  // that rank 0 serves on world_store (HOST:PORT, bound by rank 0, dialled by the others), split
  // into the TP / ETP / EP groups as MPI's would be. 0: the mpirun world (MPI).
  int world_size = 0;
  int world_rank = -1;
  std::string world_store;
  absl::Duration world_join_timeout = absl::Minutes(2);  // every rank must have joined by then
};

// Runs until Stop() (or SIGINT/SIGTERM through the caller). Returns the first fatal error:
// kInvalidArgument for an incomplete store world (world_rank, world_store), kUnavailable when rank 0
// cannot bind world_store, kDeadlineExceeded naming the ranks that did not join it in time.
absl::Status RunTrainerAgent(const TrainerAgentOptions& options, const std::atomic<bool>* stop);

}  // namespace wsync::trainer_agent
