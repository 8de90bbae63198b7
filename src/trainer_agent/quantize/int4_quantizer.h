// The trainer's INT4 work in a sync (docs/spec/FORMATS.md §1-2): quantizing an HF tensor straight
// into a bucket, and the routed experts quantized where they live. sync/rank_sync.cc decides when
// and on which rank (gathers, batches, status records); this file decides how:
//   PlanExpert        whether an expert parameter is quantized by its holders, and how it travels:
//                     the INT4 block sizes, which rows of the Megatron tensor (or of this rank's ETP
//                     shard) are which HF tensor's rows, and whether each ETP rank quantizes its own
//                     shard (by_shard) or the merger quantizes after a bf16 merge;
//   QuantizeExpert    a shard or a full tensor into its block, as the plan says (QuantizeRows for
//                     compressed-tensors; AWQ triples for AWQ);
//   QuantizeRows      quantizes row segments of a shard or a full tensor into a block's packed and
//                     scale parts (compressed-tensors);
//   MergeInt4Shards   the ETP ranks' INT4 shard blocks -> the full tensor's block (MergeShards on
//                     the packed int32 and the scales, described as parameters; AWQ: each shard's
//                     triples placed at their rows and columns of the HF tensors' triples);
//   EmitExpert        cuts each HF tensor's packed / scale rows out of a full block into a bucket
//                     triplet (weight_packed, weight_scale, weight_shape; AWQ: qweight, qzeros, scales);
//   QuantizeInto      one HF tensor through the kernel straight into a bucket triplet (AWQ too:
//                     qweight / qzeros / scales; FP8: the pair weight / weight_scale_inv or
//                     weight_scale, docs/spec/FP8.md).
// FP8 experts are never quantized by their holders (PlanExpert: nullopt): they travel in bf16 and
// are quantized by the emitter like every other FP8 target.
// Quantization is row-local (groups run along K), so the rows of a tensor may be quantized in any
// split: every path yields the bytes of model::QuantizeHfTensor on each HF tensor (compressed-
// tensors packing, the configured group size and variant).
//
// An INT4 block of a parameter [R, K] (or of a shard [r, k]): packed int32 [R, K/8] at 0, scales
// [R, K/G] in the weight's dtype at scale_offset (64-byte aligned), the block padded to 64 bytes.
// AWQ packs along N (qweight [K, N/8]), so a row block of the Megatron tensor is a column block of
// the AWQ tensors: an AWQ block is instead one AWQ triple per part (AwqPart), each HF tensor whole
// in a full block, each of this shard's row segments in a shard block (docs/engine-formats.md,
// decision 3).
//
// Ownership: an Int4Quantizer keeps a pointer to its QuantizationConfig (not owned; must outlive
// it). Spans and views are the caller's; the bucket triplets belong to the BucketBuilder.
// Errors: kInvalidArgument naming the HF tensor (and its rows) for weights the kernel refuses:
// Inf / NaN, a K that is not a multiple of 8 or of the group size, a dtype other than bf16 / fp16,
// a bucket name that is not "*.weight"; kInternal for a parameter whose HF tensors are not row
// blocks of it; the BucketBuilder's errors (allocation, the sink) as they are.
// Thread-safety: an Int4Quantizer is used by one thread at a time (it counts into its stats); the
// kernels may use Int4Options::num_threads threads. The free functions are pure.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/bucket/builder.h"
#include "common/config.h"
#include "common/memory_space.h"
#include "common/tensor.h"
#include "kernels/awq.h"
#include "kernels/fp8.h"
#include "kernels/int4.h"
#include "model/quant_target.h"
#include "trainer_agent/convert/hf_convert.h"
#include "trainer_agent/convert/megatron_param.h"

namespace wsync::trainer_agent {

// Rows [row, row + rows) of a Megatron tensor (a shard or the full tensor) are rows
// [hf_row, hf_row + rows) of HF tensor hf_index (an index into MegatronParam::hf_names).
struct RowSegment {
  int hf_index = 0;
  int64_t row = 0, hf_row = 0, rows = 0;
  bool operator==(const RowSegment&) const = default;
};

// The HF rows of group rank `rank_in_group`'s shard of `p` (< 0: of the full tensor), from the
// parameter's shard copies (convert/shard_layout.h) and `map` (HfRowMapFor(p)). kInternal when
// the shard is neither row blocks nor column blocks of the full tensor.
absl::StatusOr<std::vector<RowSegment>> RowSegments(const MegatronParam& p, const HfRowMap& map, int rank_in_group);

// One AWQ triple in a block: HF tensor hf_index's output rows [n0, n0 + n) by input columns
// [k0, k0 + k), as qweight [k, n/8] int32, qzeros [k/G, n/8] int32 and scales [k/G, n] in the
// weight's dtype, at these offsets of the block (each 64-byte aligned; `end` too).
struct AwqPart {
  int hf_index = 0;
  int64_t n0 = 0, n = 0, k0 = 0, k = 0;
  Shape qweight, qzeros, scales;
  uint64_t qweight_at = 0, qzeros_at = 0, scales_at = 0, end = 0;
};

// How an expert parameter quantized by its holders travels. A member's block of the EP gather is
// the full Megatron tensor [R, K] quantized (block_bytes). With ETP > 1 and by_shard, every ETP rank
// quantizes its own shard (rows, or column blocks holding whole groups) into a shard block of
// local_block bytes, and the merger merges them with MergeInt4Shards; otherwise the merger merges
// bf16 and quantizes the full tensor.
struct Int4ExpertPlan {
  bool by_shard = false;
  MegatronParam packed, scales;  // the INT4 outputs described as parameters (shapes, ETP layout)
  uint64_t packed_bytes = 0, scale_offset = 0, scale_bytes = 0, block_bytes = 0;  // the full block
  // This rank's shard block (ETP > 1 and by_shard only).
  uint64_t local_packed_bytes = 0, local_scale_offset = 0, local_scale_bytes = 0, local_block = 0;
  std::vector<Shape> hf_shapes;        // parallel to the parameter's hf_names
  std::vector<RowSegment> full_rows;   // the HF tensors' rows in the full tensor
  std::vector<RowSegment> local_rows;  // in this rank's shard (by_shard; ETP 1: full_rows)
  // AWQ: the blocks hold AwqParts instead of packed rows then scales (the packed / scale fields
  // above are unused). awq_full: one part per HF tensor (block_bytes in all); awq_shards[r]: ETP
  // rank r's shard block (local_block bytes), one part per row segment of its shard (by_shard
  // with ETP > 1 only).
  bool awq = false;
  std::vector<AwqPart> awq_full;
  std::vector<std::vector<AwqPart>> awq_shards;
};

// What a stage source quantized in its last sync, for QuantizeInto to reuse the groups whose inputs
// did not change since (kernels::QuantizeReuse: INT4, AWQ and FP8, host memory). The delta
// base (sync/delta_sink.h) implements it: it holds those outputs as they were sent, and keeps a
// sync's digests only once every bucket of that sync went (a failed sync leaves none, so outputs
// and digests always come from the same sync). Used by the builder's thread only.
class QuantizedBase {
 public:
  struct Earlier {
    std::span<const uint64_t> digests;              // one per group
    std::vector<std::span<const uint8_t>> outputs;  // the outputs as sent, in the order asked for
  };
  virtual ~QuantizedBase() = default;
  // HF tensor `name`'s digests and outputs (named `outputs`) from the last sync, when that sync
  // quantized it under `key` (the quantization and input dtype) and sent them all; else nullopt.
  virtual std::optional<Earlier> FindQuantized(const std::string& name, absl::Span<const std::string> outputs,
                                               const std::string& key) const = 0;
  // Where this sync's `groups` digests of `name` (quantized under `key`) go.
  virtual std::span<uint64_t> NextDigests(const std::string& name, size_t groups, const std::string& key) = 0;
};

// A rank's memory of the blocks it quantized where no delta base holds them, kept across syncs by
// the trainer agent while deltas are on: experts quantized by their holders (QuantizeExpert), and
// the HF tensors the stage source quantizes without a base (QuantizeInto: sharded delivery, whose
// bases hold cut blocks, or buckets in device memory, which take no deltas). Per block
// (an expert parameter's full tensor or ETP shard; each AWQ triple of one; an HF tensor) the
// outputs last written (the codes, the scales, AWQ's zeros) and one XXH3-64 per quantization group
// of their inputs (FP8: block or row; AWQ: 8 rows' group), so that the next quantization of that
// block copies the groups whose inputs did not change (kernels::QuantizeReuse). A block's outputs
// and digests are replaced together after a call that succeeded: they always come from the same
// quantization, whatever became of the sync. Memory: those outputs (INT4: about 0.27 of their bf16
// bytes at G 128; FP8: 0.5) and 8 bytes per group.
//
// It also keeps when digests pay, per block of earlier outputs (its own blocks; the delta base's HF
// tensors, named "base <name>"). Digests cost 0.05-0.4 of a quantization per unit (wsync-bench-kernels'
// -dig rows), and at RL learning rates a large unit almost never has all its inputs unchanged (an
// FP8 128 x 128 block, an AWQ unit of 8 x G). So a block whose comparison reused under a tenth of its
// units (set_pause_below) is quantized without digests for its next 2 quantizations, then probed
// again (one records digests, the next compares); each poor probe doubles the pause, up to 16; a
// good one resets it.
// Used by one Int4Quantizer at a time.
class QuantMemo {
 public:
  uint64_t bytes() const;
  void Clear() {
    blocks_.clear();
    pauses_.clear();
  }
  // The share of a block's units a comparison must reuse for its digests to go on (0: never pause;
  // 1: pause unless every unit was reused). Where digests pay depends on the host: on this 2-core
  // VM they cost 0.05-0.4 of a quantization (docs/sync.md).
  void set_pause_below(double share) { pause_below_ = share; }

 private:
  friend class Int4Quantizer;
  struct Block {
    std::string key;  // the quantization and input dtype
    std::vector<uint64_t> digests;
    std::vector<std::vector<std::byte>> outputs;  // the codes, the scales (AWQ: and the zeros)
  };
  std::map<std::string, Block, std::less<>> blocks_;
  struct Pause {
    int left = 0;  // quantizations still to do without digests
    int next = 0;  // the pause after the next poor comparison (0: the first)
  };
  std::map<std::string, Pause, std::less<>> pauses_;
  double pause_below_ = 0.1;
};

// Bytes and time an Int4Quantizer spent, accumulated over its calls.
struct Int4Stats {
  absl::Duration quantize;       // inside kernels::QuantizeInt4
  absl::Duration copy;           // EmitExpert's copies of INT4 rows into buckets
  uint64_t quantized_bytes = 0;  // bf16 / fp16 bytes through the kernels
  uint64_t copied_bytes = 0;     // INT4 bytes EmitExpert copied into buckets
  uint64_t hf_bytes = 0;         // HF tensors EmitExpert sent, counted before quantization
  // Calls with a QuantizedBase or a QuantMemo (QuantizeInto, QuantizeRows, AWQ experts' triples),
  // once they succeeded: the groups quantized or reused, those reused, and those quantized without
  // digests (QuantMemo: reuse paused).
  uint64_t groups = 0, reused_groups = 0, undigested_groups = 0;
};

struct Int4Options {
  const QuantizationConfig* quant = nullptr;                    // non-null; not owned
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;  // compressed-tensors
  int num_threads = 0;                                          // of each kernel call; 0 = hardware concurrency
  // Where the weights, blocks and buckets are: host memory (the CPU kernels) or a CUDA device's
  // (the CUDA kernels; every copy on the device).
  MemorySpace space = MemorySpace::Host();
  kernels::AwqArith awq_arith = kernels::AwqArith::kFp16;  // AWQ (quant->is_awq())
  // FP8 (quant->is_fp8()): the block variant (nullopt: the config's) and the channel variant.
  std::optional<kernels::Fp8BlockVariant> fp8_block;
  kernels::Fp8ChannelVariant fp8_channel = kernels::Fp8ChannelVariant::kSlime;
};

// What every rank must agree on besides config.json and parallel.json for the INT4 path to pair
// its collectives (the quantization config and variant decide which experts travel as INT4).
// "quant none" for a null config.
std::string QuantFingerprint(const QuantizationConfig* quant, kernels::QuantVariant variant,
                             kernels::AwqArith awq_arith = kernels::AwqArith::kFp16);

// What one sync quantizes to: the engines' declared quantization_config (`engines_json`, agreed by
// the coordinator; empty: the engines serve bf16), checked against the trainer's own --quant-config
// (`trainer`; nullopt: none given, the trainer follows the engines). nullopt result: bf16.
// kFailedPrecondition naming both when the trainer's config is not what the engines serve (the
// engines' engine_layout does not count: QuantizationConfig::Canonical); the parse error of a
// malformed `engines_json`.
absl::StatusOr<std::optional<QuantizationConfig>> SyncQuantization(const std::optional<QuantizationConfig>& trainer,
                                                                   const std::string& engines_json);

// The ETP ranks' shard blocks of an expert parameter (`shards`: plan.packed.group_size blocks of
// plan.local_block bytes, in ETP rank order) merged into the full block `block` (block_bytes).
// Requires plan.by_shard. Both spans are memory of `space`. kInvalidArgument from MergeShards for
// mis-sized spans; the space's copy errors.
absl::Status MergeInt4Shards(const Int4ExpertPlan& plan, std::span<const std::byte> shards, std::span<std::byte> block,
                             const MemorySpace& space = MemorySpace::Host());

class Int4Quantizer {
 public:
  explicit Int4Quantizer(const Int4Options& options);

  // The kernel options every call uses: compressed-tensors packing, the config's group size, the
  // variant and thread count of the options.
  kernels::QuantizeOptions KernelOptions() const;

  // The plan of this rank's expert parameter `p` when it is quantized by its holders: when every
  // HF tensor it becomes on every EP member (`on_members`: the same parameter in each member's
  // plan, global expert ids differing) is an INT4 target and is a row block of it (copy, GLU
  // halves). std::nullopt: it travels in bf16 and the stage source converts it. `etp`: the ETP
  // size; each ETP rank quantizes its own shard when the shard splits rows (GLU fc1) or columns
  // at group boundaries (fc2 with K / ETP a multiple of the group size and of 8).
  absl::StatusOr<std::optional<Int4ExpertPlan>> PlanExpert(const ModelConfig& model, const MegatronParam& p,
                                                           absl::Span<const MegatronParam* const> on_members,
                                                           int etp) const;

  // Quantizes `w`, parameter `p`'s tensor as `plan` says: with `shard`, this rank's ETP shard into
  // its shard block (plan.local_block bytes; by_shard with ETP > 1), else the full tensor into the
  // full block (plan.block_bytes). `where` ends the error message ("ETP shard 1 of 2"). Errors as
  // QuantizeRows; kInvalidArgument for a block of another size.
  absl::Status QuantizeExpert(const MegatronParam& p, const TensorView& w, const Int4ExpertPlan& plan, bool shard,
                              std::span<std::byte> block, absl::string_view where);

  // Quantizes rows `rows` of `w` (parameter `p`'s tensor: a shard or the full tensor, [n, k])
  // into `packed` (n x k/8 int32) and `scales` (n x k/G), each segment at its own rows. `where`
  // ends the error message ("ETP shard 1 of 2"). Compressed-tensors only.
  absl::Status QuantizeRows(const MegatronParam& p, const TensorView& w, absl::Span<const RowSegment> rows,
                            std::span<std::byte> packed, std::span<std::byte> scales, absl::string_view where);

  // The HF tensors of expert parameter `p` (an EP member's, global names) from its full INT4
  // block into `builder`: one reserved triplet per HF tensor, the rows copied as plan.full_rows say.
  absl::Status EmitExpert(comm::BucketBuilder& builder, const MegatronParam& p, const Int4ExpertPlan& plan,
                          std::span<const std::byte> block);

  // Quantizes HF tensor `name` ("*.weight", [n, k]) straight into a triplet reserved in `builder`:
  // weight_packed / weight_scale / weight_shape, or for AWQ qweight / qzeros / scales
  // (kernels::QuantizeAwq with Int4Options::awq_arith).
  absl::Status QuantizeInto(comm::BucketBuilder& builder, const std::string& name, const TensorView& w);

  // With a base (not owned; nullptr: none), QuantizeInto in host memory copies each group (FP8:
  // block or row; AWQ: 8 rows' group) whose input is unchanged since the base's sync instead of
  // quantizing it (the bytes are the same: kernels::QuantizeReuse). Device memory: no reuse.
  void set_quantized_base(QuantizedBase* base) { base_ = space_.host() ? base : nullptr; }
  // With a memo (not owned; nullptr: none), QuantizeExpert in host memory (QuantizeRows; AWQ too)
  // copies each group of a block whose input is unchanged since the memo's last quantization of
  // that block; so does QuantizeInto without a base (sharded delivery, whose bases hold cut blocks,
  // not whole outputs), each HF tensor a block. With a base, QuantizeInto drops a tensor's block.
  void set_quant_memo(QuantMemo* memo) { memo_ = space_.host() ? memo : nullptr; }

  const Int4Stats& stats() const { return stats_; }

 private:
  absl::Status QuantizeAwqInto(comm::BucketBuilder& builder, const std::string& name, const TensorView& w);
  absl::Status QuantizeFp8Into(comm::BucketBuilder& builder, const std::string& name, const TensorView& w);
  // What a reuse's digests are valid under: the quantization, its variants and the input dtype.
  std::string ReuseKey(DType input) const;
  // The kernels' reuse of HF tensor `name` (quantized under `key`) from base_: this sync's digests
  // (one per unit: group, block or row) and, when base_ holds its last sync's digests and outputs
  // `names` of `dst`'s sizes, those. `names` / `dst`: the codes, the scales, and for AWQ the zeros.
  kernels::QuantizeReuse ReuseFromBase(const std::string& name, absl::Span<const std::string> names,
                                       absl::Span<const MutableTensorView> dst, const std::string& key, size_t units);
  // memo_'s block `id` when it was quantized under `key` into outputs of `dst`'s sizes with `units`
  // digests; else nullptr.
  const QuantMemo::Block* FindInMemo(const std::string& id, const std::string& key, size_t units,
                                     absl::Span<const std::span<std::byte>> dst) const;
  // memo_'s block `id` replaced by `outputs` and their digests, quantized under `key`.
  void KeepInMemo(const std::string& id, std::string key, std::vector<uint64_t> digests,
                  absl::Span<const std::span<std::byte>> outputs);
  // A kernel call with reuse that succeeded: its units and those reused into the stats.
  void CountReuse(size_t units, const kernels::QuantizeReuse& reuse);
  // A kernel call: with a reuse (digests), or without (nullptr: a plain quantization).
  using Kernel = absl::FunctionRef<absl::Status(kernels::QuantizeReuse*)>;
  // `kernel` into `dst` (the codes, the scales, for AWQ the zeros; `units` digests under `key`)
  // reusing memo_'s block `id`, which it then replaces when the kernel succeeded; while the block's
  // digests are paused, a plain quantization (and the block goes).
  absl::Status ReuseFromMemo(const std::string& id, absl::Span<const MutableTensorView> dst, const std::string& key,
                             size_t units, Kernel kernel);
  // QuantizeInto's kernel call with reuse for HF tensor `name` (its outputs `names` in `dst`):
  // from base_ (ReuseFromBase) when there is one, else from memo_ (ReuseFromMemo).
  absl::Status Reusing(const std::string& name, absl::Span<const std::string> names,
                       absl::Span<const MutableTensorView> dst, DType input, size_t units, Kernel kernel);
  // Whether block `id`'s quantization computes digests now (QuantMemo's pauses; always without a
  // memo). False spends one quantization of the pause.
  bool Digesting(const std::string& id);
  // A quantization without digests that succeeded: its units into the stats.
  void CountUndigested(size_t units);
  // A quantization of block `id` that compared its digests with earlier ones: `reused` of `units`
  // were copied. Under QuantMemo's pause_below of them: a pause.
  void Judge(const std::string& id, size_t units, int64_t reused);
  absl::StatusOr<std::optional<Int4ExpertPlan>> PlanAwqExpert(const MegatronParam& p, HfRowMap map, int etp) const;
  // Rows [row, row + part.n) of `w` quantized into AWQ triple `part` of `block`.
  absl::Status QuantizeAwqPart(const MegatronParam& p, const TensorView& w, int64_t row, const AwqPart& part,
                               std::span<std::byte> block, absl::string_view where);
  absl::Status EmitAwqExpert(comm::BucketBuilder& builder, const MegatronParam& p, const Int4ExpertPlan& plan,
                             std::span<const std::byte> block);

  const QuantizationConfig& quant_;
  const MemorySpace space_;
  const kernels::QuantizeOptions kernel_;
  const kernels::AwqQuantizeOptions awq_;
  const model::QuantizeOptions fp8_;
  QuantizedBase* base_ = nullptr;
  QuantMemo* memo_ = nullptr;
  Int4Stats stats_;
};

}  // namespace wsync::trainer_agent
