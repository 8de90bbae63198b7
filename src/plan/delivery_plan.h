// Sharded delivery: which block of every sent HF tensor each group of engine ranks keeps, so that
// a stage source sends every receiver only the bytes its engine rank keeps (docs/sync.md "Sharded
// delivery"), and the cost of a sync in each delivery mode for the planner (wsync-plan).
//
// A *receiver group* is the set of rollout agents whose engine ranks keep the same blocks: ranks
// with the same (TP size, TP rank, EP size, NextN draft or not) of engines serving the trainer's model. Identical
// engine replicas therefore share one group per rank, and the stage source sends each block once per group (a Broadcast
// to the group; Gloo chains it, NCCL rings it), never once per replica.
//
// ShardPlan::Create builds one EngineLayout (engine_model/engine_layout.h, the same code the
// receiving agent loads with) per group; BlockFor answers, for a sent tensor, the block of its
// matrix view (MatrixOf) a group keeps, read from that layout's HfSource: the TP row or column cut,
// qkv with KV replication, gate_up halves, vocab rows, a local expert whole, an INT4 weight_packed
// and weight_scale cut at the same group boundaries the loader copies. The agent's Loader::LoadBlock
// refuses any other block, so sender and receiver cannot disagree silently.
//
// Errors: Create returns the engine layout's refusal (kInvalidArgument / kUnimplemented) naming the
// group's TP rank and size; BlockFor returns kInvalidArgument for a tensor the layout does not know
// (and does not ignore), or whose dtype or shape differs from what the engine expects.
// Thread-safety: immutable after Create; every method is const and safe from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "common/dtype.h"
#include "engine_model/engine_layout.h"

namespace wsync::plan {

enum class Delivery {
  kBroadcast,  // every agent receives every byte of its stage (one group per stage)
  kSharded,    // every agent receives only its engine rank's blocks (one group per stage and receiver group)
};
absl::StatusOr<Delivery> ParseDelivery(absl::string_view name);  // "broadcast" | "sharded"
absl::string_view DeliveryName(Delivery d);

// The block of a tensor's matrix view that a receiver keeps.
struct Block {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  bool whole = false;   // the whole tensor (then row0 = col0 = 0 and rows x cols its matrix)
  uint64_t nbytes = 0;  // what the receiver gets: the tensor's bytes when whole, else rows x cols elements
};

// Receivers grouped by the blocks they keep: `group_of[a]` is agent a's group, `rank_in_group[a]`
// its position there (agents in the order given), groups ordered by (TP size, EP size, TP rank,
// draft).
struct Grouping {
  std::vector<engine_model::EngineParallel> groups;
  std::vector<std::vector<int>> members;  // agent indices per group
  std::vector<int> group_of;
  std::vector<int> rank_in_group;
};
Grouping GroupReceivers(std::span<const engine_model::EngineParallel> agents);

class ShardPlan {
 public:
  // `quantization` null: a bf16 engine. Copies what it needs; nothing is kept by reference.
  static absl::StatusOr<ShardPlan> Create(const ModelConfig& config, const QuantizationConfig* quantization,
                                          std::span<const engine_model::EngineParallel> groups);

  int num_groups() const { return static_cast<int>(layouts_.size()); }
  const engine_model::EngineLayout& layout(int group) const { return *layouts_[static_cast<size_t>(group)]; }

  // The block group `group` keeps of the sent tensor, std::nullopt if it keeps none of it (another
  // EP rank's expert, a vocab range past the rank, a tied lm_head, a part of the checkpoint the
  // engine does not load). Tensors of more than two dims are kept whole or not at all.
  absl::StatusOr<std::optional<Block>> BlockFor(int group, absl::string_view hf_name, DType dtype,
                                                std::span<const int64_t> shape) const;

 private:
  std::vector<std::unique_ptr<engine_model::EngineLayout>> layouts_;
};

}  // namespace wsync::plan
