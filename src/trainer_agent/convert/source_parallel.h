// The parallel layout of a Megatron run as recorded beside its shards (`parallel.json` of a
// source directory), and what follows from it for the weights: the padded vocabulary and the
// decoder layers of each pipeline stage and of each of its model chunks (virtual pipeline stages).
// Spec: docs/spec/MEGATRON_TO_HF.md §2.5 (vocab padding), §4 (PP and VPP layer split, from
// megatron-core's get_num_layers_to_build / get_transformer_layer_offset), RANKS.md (the rank
// grids, built by ParallelLayout).
//
//   {"tp": 2, "pp": 2, "ep": 2, "etp": 1, "dp": 2, "cp": 1, "world_size": 8,
//    "order": "tp-cp-ep-dp-pp", "make_vocab_size_divisible_by": 128,
//    "padded_vocab_size": 4096, "layers_per_stage": [2, 2]}
//
//   virtual pipeline (--virtual-pipeline-model-parallel-size 2) and Megatron's split options:
//   {"pp": 2, "vpp": 2, "layers_per_chunk": [1, 2, 2, 1],
//    "num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2,
//    "account_for_embedding_in_pipeline_split": false, "account_for_loss_in_pipeline_split": false}
//
// Model chunks in layer order: chunk k is virtual stage k / pp of pipeline rank k % pp, and holds
// the layers after those of chunks 0..k-1 (Megatron's interleaved assignment). Every key is
// optional: sizes default to 1 (etp to tp, as Megatron does; dp to world_size / (tp*cp*pp) when
// world_size is given), make_vocab_size_divisible_by to 128, padded_vocab_size to Megatron's
// formula ceil(V / (m*tp)) * (m*tp). The layer split: layers_per_chunk (or, when vpp = 1,
// layers_per_stage) as given, for any contiguous split (e.g. Megatron's
// --pipeline-model-parallel-layout without MTP); otherwise Megatron's own split from the four
// options (defaults: even). When both are given they must agree. Unknown keys are refused, so that
// a misspelt or newer setting never goes unnoticed. "mtp_num_layers": the MTP layers trained
// beside the decoder (default 0), which do not count in the split.
//
// Errors: kInvalidArgument naming the file, the key and the values (malformed JSON, a size < 1,
// world_size != tp*cp*pp*dp, vpp > 1 without pp > 1, a split Megatron refuses (with its reason), a
// given split that is not the options' one, a layout the model cannot have: heads, query groups,
// FFN widths, experts or the padded vocabulary not divisible by the parallel sizes, layer counts
// not summing to the model's layers, mtp_num_layers other than the HF config's
// num_nextn_predict_layers). kUnimplemented for models wsync cannot convert (see
// CheckModelSupported in megatron_param.h).
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "trainer_agent/layout/parallel_layout.h"

namespace wsync::trainer_agent {

inline constexpr const char kDefaultRankOrder[] = "tp-cp-ep-dp-pp";
inline constexpr int64_t kDefaultVocabDivisibleBy = 128;

struct SourceParallel {
  int tp = 1;
  int pp = 1;
  int ep = 1;
  int etp = 1;
  int dp = 1;
  int cp = 1;
  int world_size = 1;
  std::string order = kDefaultRankOrder;
  int64_t make_vocab_size_divisible_by = kDefaultVocabDivisibleBy;
  int vpp = 1;                            // model chunks per pipeline rank
  int64_t padded_vocab_size = 0;          // 0 until resolved: Megatron's formula
  std::vector<int64_t> layers_per_stage;  // per pipeline rank, its chunks' sum; empty until resolved
  std::vector<int64_t> layers_per_chunk;  // pp * vpp, in layer order; empty until resolved
  // Megatron's split options (TransformerConfig names): unset / false unless given.
  std::optional<int64_t> num_layers_in_first_pipeline_stage;
  std::optional<int64_t> num_layers_in_last_pipeline_stage;
  bool account_for_embedding_in_pipeline_split = false;
  bool account_for_loss_in_pipeline_split = false;
  // MTP layers the run trains (TransformerConfig.mtp_num_layers, --mtp-num-layers): 0 without. They
  // sit after the decoder on the last model chunk and are synced as model.layers.{L+k}.* (§5.7);
  // the HF config's num_nextn_predict_layers must equal it.
  int64_t mtp_num_layers = 0;

  // ParallelSizes for ParallelLayout::Create (num_experts from the model).
  ParallelSizes Sizes(const ModelConfig& model) const;
  // Chunk index (in layer order) of virtual stage `vp` of pipeline rank `stage`: vp * pp + stage.
  int Chunk(int stage, int vp) const { return vp * pp + stage; }
  // Global index of the first decoder layer of chunk `chunk` (resolved configs only).
  int64_t ChunkFirstLayer(int chunk) const;
};

// Megatron's own split of `num_layers` decoder layers over pp * vpp chunks (layer order) for the
// options of `parallel` (its layer lists are ignored): megatron-core's get_num_layers_to_build for
// every (pipeline rank, virtual stage), checked against get_transformer_layer_offset.
// kInvalidArgument with Megatron's reason when it would refuse the options.
absl::StatusOr<std::vector<int64_t>> MegatronChunkLayers(int64_t num_layers, const SourceParallel& parallel);

// Megatron's vocab_size_with_padding: ceil(vocab / (divisible_by * tp)) * (divisible_by * tp).
int64_t PaddedVocabSize(int64_t vocab, int64_t divisible_by, int tp);

// Parses parallel.json text (`source` names the file in errors). The result is not yet resolved.
absl::StatusOr<SourceParallel> ParseSourceParallel(absl::string_view json_text, absl::string_view source);

// Fills padded_vocab_size and layers_per_stage where they are unset and checks the whole layout
// against the model (see the file comment). `source` names the file in errors.
absl::StatusOr<SourceParallel> ResolveSourceParallel(const ModelConfig& model, SourceParallel parallel,
                                                     absl::string_view source = "parallel.json");

// The rank grids of a resolved layout.
absl::StatusOr<ParallelLayout> MakeLayout(const ModelConfig& model, const SourceParallel& parallel);

// parallel.json text with every key written (a resolved config round-trips exactly).
std::string SourceParallelToJson(const SourceParallel& parallel);

}  // namespace wsync::trainer_agent
