// One weight sync on one trainer rank: this rank's shard -> TP / ETP / EP all-gathers -> (on the
// pipeline stage's source rank) Megatron -> HF conversion, INT4 quantization, buckets -> a
// BucketSink; routed experts that are INT4 targets are quantized where they live (each ETP / EP
// rank its own shard) before the ETP / EP all-gathers; the INT4 steps themselves (plans, row
// quantization, shard merge, triplets into buckets) are quantize/int4_quantizer.h. Spec:
// docs/spec/MEGATRON_TO_HF.md, docs/spec/RANKS.md; the bucket format: docs/bucket_format.md.
// Design and measurements: README.md beside this file.
//
// Steps, on every rank of the world (each rank runs RunRankSync with the same options):
//  1. open   WeightSource::OpenRank(own rank) (dir: the file is mapped anew every sync; shm: the
//            trainer's update lock is held shared until the sync ends), then one world
//            agreement (two small AllGathers): every rank learns whether every rank opened its
//            shard and whether all ranks run the same source config and options. On any failure
//            every rank returns the same error, naming the first failing rank and its error
//            (e.g. the missing or truncated file), before anyone enters a gather.
//  2. dense  the ranks of the stage source's TP group (dp = cp = 0) all-gather the TP-sharded
//            non-expert parameters in plan order, batched: one AllGather call per batch of about
//            gather_bytes of output, many tensors per call, double-buffered (batch k+1 is in flight
//            while the source converts batch k). Replicated parameters are not gathered (the source
//            uses its own), nor is the tied output-layer copy of the last stage (never sent).
//  3. expert the ranks of the stage's expert block (edp = 0) gather routed experts: ETP
//            all-gather + MergeShards into the full local experts (when ETP > 1), then an EP
//            all-gather among the etp = 0 ranks (in place); EP communicator rank r holds global
//            experts [r * E/EP, (r+1) * E/EP) (MegatronParam::global_expert of rank r's plan).
//            INT4 experts: when EP or ETP > 1 and an expert parameter's HF tensors are INT4
//            targets on every EP member (and are row blocks of it: fc1 gate/up, fc2), the ranks
//            holding it quantize it before the gathers, which then carry packed int32 + scales
//            instead of bf16. Quantization is row-local (groups run along K), so the full Megatron
//            tensor [R, K] is quantized as one: with ETP > 1 every ETP rank quantizes its own shard
//            when that shard is rows (GLU fc1) or column blocks of whole groups (fc2 with K/ETP a
//            multiple of the group size), and the etp = 0 rank merges the INT4 shards; otherwise
//            (channelwise fc2, ...) it merges bf16 and quantizes. The source cuts the HF tensors'
//            rows out of the gathered INT4 (the same kernel and options: identical bytes). Every
//            ETP and EP gather also carries one status record per member: a member that failed (a
//            NaN refused by its quantizer, a merge) says so and why; the merger, then the stage
//            source, fail instead of using its blocks.
//  4. source (layout.StageSourceRank(pp) only) per gathered parameter: the full tensor (a view into
//            the gather buffer when the all-gather's rank order already is the full layout: dim-0,
//            vocab and full expert tensors; else MergeShards into a scratch tensor), ToHf (views),
//            then per HF tensor either INT4 (IsQuantTarget under options.quant; the kernel writes
//            straight into the bucket) or a copy into the bucket; experts quantized by their EP
//            member are copied as gathered (weight_packed, weight_scale; weight_shape written).
//            Non-expert tensors first, then experts (per batch: EP rank order, then plan order).
//            BucketBuilder sends full buckets to `sink` while the next gathers run, and ends with
//            a `last` bucket and BucketSink::Finish.
// Device stages: when the shard is CUDA memory (RankShard::cuda_device, the shm: source's CUDA
// tensors read in place), steps 2-4 run on that device: the gather buffers, ETP buffer and merge
// scratch are device memory; the TP / ETP / EP all-gathers run over NCCL groups of the same members
// (TrainerComms::device, formed by EnsureDeviceComms over the host groups at the first such sync,
// kept while every rank's GPU stays the same); the merges are cudaMemcpy2D copies
// (MemorySpace::Copy2D), the members' status records are copied into and out of the gather
// buffers; ToHf's copies, the CUDA INT4 kernels and the buckets are in device memory; a sink on
// that GPU (the nccl data plane) sends them as they are, and for a host sink a SpaceStagingSink
// (comm/bucket/space_staging.h) copies each full bucket once to a page-locked host buffer (host
// stages in front of an nccl sink: one upload per bucket; an nccl sink on another GPU than the
// shard's is refused). Same bytes as the host stages. The opening agreement carries each rank's
// host and GPU (DecideGathers): when some ranks are on GPUs and others in host memory, or two
// members of one TP / ETP / EP group are on the same GPU of one host (NCCL needs one GPU per
// member), every rank copies its shard to host memory, prepares again and agrees again, and the
// host stages run. AWQ experts with ETP > 1 travel in bf16 to the stage source on the device
// (their row placement is host code).
// Ranks outside those groups (dense DP / expert EDP replicas) only open their shard and agree.
// PP stages run in parallel: after the opening agreement a stage only talks within its groups.
//
// Memory: every gathering rank holds two gather buffers of about gather_bytes (all-gathers
// deliver every shard to every member, so the TP/EP peers of a source receive the same batches
// the source does; batches are sized by their bf16 bytes, so INT4 expert batches need about 3.6x
// less), plus one ETP buffer of gather_bytes / EP when ETP > 1; the source also holds up to three
// bucket buffers (one filling, two on the wire) and a scratch tensor the size of the largest
// parameter merged along dim 1 / GLU (ETP > 1: every merger, for experts merged in bf16 then
// quantized).
//
// Failures after step 1: a rank that fails (a NaN refused by the quantizer, an allocation, the
// sink) stops converting and sending but keeps taking part in the remaining gathers with the same
// sizes, so its peers never hang; it returns its first error. An EP member's failure also reaches
// its merger and stage source through the status records of the next ETP / EP gather: they fail
// too ("EP rank e (world rank r) could not produce its experts: <the member's error>"). A
// data-plane error (timeout, abort)
// breaks that communicator (comm/communicator.h); the buffers of a failed MPI operation are never
// freed (MPI may still write them) and the process is expected to exit. A failed sync leaves the
// sink without its `last` bucket and without Finish(): the caller aborts the stream.
//
// Errors: kInvalidArgument (sink given on a non-source rank or missing on the source, bad options,
// communicators not matching the layout, ranks with different configs / gather sizes /
// quantization configs), the opening errors of any rank (see 1: kNotFound, kInvalidArgument, ...),
// conversion / quantization errors naming the tensor (and, on the source, the EP member that
// hit them), and the data plane's kDeadlineExceeded / kAborted / kUnavailable.
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
//                host and the gathers run there (as before the device gathers; logged once)
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
};

absl::StatusOr<SyncReport> RunRankSync(const WeightSource& src, TrainerComms& comms, comm::BucketSink* sink,
                                       const SyncOptions& options);

}  // namespace wsync::trainer_agent
