// The parallel layout of a Megatron run as recorded beside its shards (`parallel.json` of a
// source directory), and what follows from it for the weights: the padded vocabulary and the
// decoder layers of each pipeline stage. Spec: docs/spec/MEGATRON_TO_HF.md §2.5 (vocab padding),
// §4 (PP layer offsets), RANKS.md (the rank grids, built by ParallelLayout).
//
//   {"tp": 2, "pp": 2, "ep": 2, "etp": 1, "dp": 2, "cp": 1, "world_size": 8,
//    "order": "tp-cp-ep-dp-pp", "make_vocab_size_divisible_by": 128,
//    "padded_vocab_size": 4096, "layers_per_stage": [2, 2]}
//
// Every key is optional: sizes default to 1 (etp to tp, as Megatron does; dp to
// world_size / (tp*cp*pp) when world_size is given), make_vocab_size_divisible_by to 128,
// padded_vocab_size to Megatron's formula ceil(V / (m*tp)) * (m*tp), layers_per_stage to an even
// split. Unknown keys are refused, so that a misspelt or newer setting (e.g. virtual pipeline
// stages) never goes unnoticed.
//
// Errors: kInvalidArgument naming the file, the key and the values (malformed JSON, a size < 1,
// world_size != tp*cp*pp*dp, a layout the model cannot have: heads, query groups, FFN widths,
// experts or the padded vocabulary not divisible by the parallel sizes, layers_per_stage not
// summing to the model's layers). kUnimplemented for models wsync cannot convert (see
// CheckModelSupported in megatron_param.h).
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
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
  int64_t padded_vocab_size = 0;          // 0 until resolved: Megatron's formula
  std::vector<int64_t> layers_per_stage;  // empty until resolved: an even split

  // ParallelSizes for ParallelLayout::Create (num_experts from the model).
  ParallelSizes Sizes(const ModelConfig& model) const;
  // Global index of the first decoder layer of `stage` (resolved configs only).
  int64_t FirstLayer(int stage) const;
};

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
