// RunRankSync: one weight sync on one trainer rank. Every rank of the world calls it with the same
// options; the ranks the stage's source needs gather (TP / ETP / EP all-gathers), and the stage
// source converts Megatron -> HF, quantizes INT4 targets and hands full buckets to its BucketSink
// (with spread_senders, every rank of StageSenders does this for its share). The steps, the
// decisions and the figures are in README.md beside this file; the INT4 steps are
// quantize/int4_quantizer.h. Specs: docs/spec/MEGATRON_TO_HF.md, docs/spec/RANKS.md; the bucket
// bytes: docs/bucket_format.md.
//
// Contract:
//  - Opening agreement: before any gather, every rank learns whether every rank opened its shard
//    with the same config, gather size, quantization and options; on a failure every rank returns
//    the same error, naming the first failing rank.
//  - Tensors in CUDA memory (RankShard::cuda_device) run the device stages on that GPU (same
//    bytes as the host stages); DecideGathers says where the gathers run, identically on every rank.
//  - A rank that fails after the agreement keeps taking part in the remaining collectives with the
//    same sizes, so no peer hangs, and returns its first error; an expert holder's failure reaches
//    its merger and the stage source through the status records of the ETP / EP gathers, which
//    then fail naming it. A failed sync leaves the sink without its `last` bucket and without
//    Finish(): the caller aborts the stream.
//  - Memory per gathering rank: two gather buffers of about gather_bytes, one ETP buffer of
//    gather_bytes / EP when ETP > 1, a merge scratch (the largest parameter merged along dim 1 /
//    GLU); the source also holds up to three bucket buffers (one filling, two on the wire).
//
// Ownership: the caller owns `src`, the communicators, the sink, and everything SyncOptions points
// to (quant, workspace, expert_map); they must outlive the call.
// Errors: kInvalidArgument (a sink given on a rank that sends nothing or missing on one that
// sends, bad options, communicators not matching the layout, ranks that disagree), the opening
// errors of any rank (kNotFound, kInvalidArgument, ...), conversion / quantization errors naming
// the tensor (and the EP member that hit them), and the data plane's kDeadlineExceeded / kAborted /
// kUnavailable. After a failed collective the communicator is broken and the buffers of a failed
// MPI operation are never freed (MPI may still write them): the process is expected to exit.
// Thread-safety: one RunRankSync per TrainerComms at a time. `src` may be shared.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/bucket/builder.h"
#include "comm/communicator.h"
#include "common/config.h"
#include "kernels/awq.h"
#include "kernels/int4.h"
#include "model/expert_map.h"
#include "trainer_agent/gather/trainer_comms.h"
#include "trainer_agent/quantize/int4_quantizer.h"
#include "trainer_agent/source/weight_source.h"

namespace wsync::trainer_agent {

// Buffers a rank keeps from one sync to the next (the two gather buffers, the ETP buffer, the
// merge scratch, ToHf's scratch), in the shard's memory space, so that their pages stay mapped: a fresh allocation pays
// a page fault per 4 KiB page on first touch, which costs more than the all-gather's copy itself on small hosts. They
// grow to the largest batch seen. Owned by the caller; used by one RunRankSync at a time. After a
// failed collective the buffers are given up (see "Failures") and the workspace starts empty.
class SyncWorkspace {
 public:
  uint64_t bytes() const;  // held now

 private:
  friend class RankSync;
  std::array<Buffer, 2> slots_;
  Buffer etp_, scratch_;
  Buffer hf_;  // ToHf's gathered HF tensors (the emitters')
};

struct SyncOptions {
  uint64_t version = 0;
  uint64_t bucket_bytes = 512ull << 20;
  // Output bytes of one all-gather call (a parameter larger than that is gathered alone);
  // 0 = bucket_bytes. Must be the same on every rank (checked at the opening agreement).
  uint64_t gather_bytes = 0;
  // none: everything unquantized. Not owned. With quant_variant, the same on every rank (EP
  // members quantize their own experts; checked at the opening agreement).
  const QuantizationConfig* quant = nullptr;
  kernels::QuantVariant quant_variant = kernels::QuantVariant::kQat;
  kernels::AwqArith awq_arith = kernels::AwqArith::kFp16;  // AWQ configs (quant->is_awq()); same on every rank
  int quant_threads = 0;                                   // per rank; 0 = hardware concurrency
  comm::CollectiveOptions collective;                      // every collective of the sync
  SyncWorkspace* workspace = nullptr;                      // null: buffers live for this sync only. Not owned.
  // Expert pruning (model/expert_map.h): only kept experts are converted, quantized and sent, under
  // their compact ids, and the routers are sliced. A batch item whose expert every EP member prunes
  // is not gathered at all; in a mixed one, a member's pruned block travels unfilled (its holder
  // neither merges nor quantizes it). The same on every rank (the opening agreement). Not owned.
  const model::ExpertMap* expert_map = nullptr;
  // Spread senders (sharded delivery): every rank that holds gathered data sends part of its
  // stage, instead of the stage source alone. The dense parameters are shared out among the stage
  // source's TP group (each parameter to one TP rank, greedily by bytes in plan order: the same
  // assignment on every member), which converts and quantizes the ones it owns; every etp = 0 rank
  // of the stage's expert block converts and sends its own experts, so there is no EP all-gather.
  // Every rank of StageSenders(layout, stage, true) needs a sink; their streams together hold
  // every tensor of the stage once. The same on every rank (the opening agreement).
  bool spread_senders = false;
  // The stage source's delta base (delta delivery; nullptr: none): its INT4 quantization reuses the
  // groups whose inputs did not change (Int4Quantizer::set_quantized_base). Not owned.
  QuantizedBase* quantized_base = nullptr;
  // This rank's memory of the INT4 expert blocks it quantizes as their holder (delta syncs; nullptr:
  // none): the groups whose inputs did not change are copied (Int4Quantizer::set_quant_memo). Not owned.
  QuantMemo* quant_memo = nullptr;
};

// Where a rank's tensors are: the CUDA device (-1: host memory) of which host (a hash of its name),
// and which physical GPU that is.
struct RankPlace {
  uint64_t host = 0;
  int device = -1;
  uint64_t gpu = 0;  // the physical GPU (a hash of its PCI bus id); 0 for host memory
};
// Where the TP / ETP / EP gathers of `layout` run, from every world rank's place (`places`, as the
// opening agreement delivers them, so every rank decides the same):
//   kNone        the layout has no gathers (each rank stays in its own space)
//   kHost        every rank's tensors are in host memory
//   kDevice      every rank's are on a GPU and no two members of a group share one (same host and
//                `gpu`): NCCL groups
//   kHostCopies  otherwise (`why` says which ranks): the ranks on GPUs copy their tensors to the
//                host and the gathers run there (logged once)
// kInvalidArgument for `places` of another size than the world.
enum class GatherSpace { kNone, kHost, kDevice, kHostCopies };
struct GatherDecision {
  GatherSpace space = GatherSpace::kNone;
  std::string why;  // kHostCopies: the ranks that prevent the device gathers
};
absl::StatusOr<GatherDecision> DecideGathers(const ParallelLayout& layout, absl::Span<const RankPlace> places);

// The ranks that send stage `stage` (ascending; the stage source first): the source alone, or
// with `spread` the source's TP group and the etp = 0 ranks of its EP group (SyncOptions::
// spread_senders).
std::vector<int> StageSenders(const ParallelLayout& layout, int stage, bool spread);

struct SyncReport {
  // Wall time per phase on this rank. gather: issuing and waiting for all-gathers; convert:
  // MergeShards + ToHf (source; expert mergers); quantize: INT4 kernels (source; every rank of
  // the expert block with INT4 experts); bucket: copies into buckets; send_wait: blocked in
  // BucketSink::Send / Finish.
  absl::Duration open, gather, convert, quantize, bucket, send_wait, total;
  uint64_t bytes = 0;  // bucket data bytes handed to the sink
  uint64_t buckets = 0;
  uint64_t tensors = 0;  // manifest entries (an INT4 weight counts 3)
  bool source = false;
  uint64_t peak_bucket_bytes = 0;
  uint64_t gather_bytes = 0;     // all-gather output bytes on this rank
  uint64_t hf_bytes = 0;         // HF tensors sent, counted before quantization (source)
  uint64_t quantized_bytes = 0;  // bf16 / fp16 bytes through the INT4 kernels on this rank
  uint64_t copied_bytes = 0;     // bytes copied into buckets: unquantized tensors and gathered INT4 (source)
  uint64_t gather_calls = 0;     // all-gather calls issued by this rank
  int cuda_device = -1;          // >= 0: the device stages ran on this CUDA device
  absl::Duration staging;        // copying buckets between the builder's memory and the sink's (SpaceStagingSink)
  // With SyncOptions::quantized_base or quant_memo: the quantization groups (INT4 groups, FP8 blocks
  // or rows, AWQ units) this rank quantized or reused, those reused, and those quantized without
  // digests (reuse paused where it did not pay: QuantMemo).
  uint64_t quant_groups = 0, reused_groups = 0, undigested_groups = 0;
};

absl::StatusOr<SyncReport> RunRankSync(const WeightSource& src, TrainerComms& comms, comm::BucketSink* sink,
                                       const SyncOptions& options);

}  // namespace wsync::trainer_agent
