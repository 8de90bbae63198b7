#include "tools/synth/reassemble.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "trainer_agent/convert/shard_layout.h"

namespace wsync::tools {
namespace {

absl::Status GatherAndEmit(const ModelConfig& model, int stage, const MegatronParam& p, const std::vector<int>& group,
                           const RankTensorLookup& lookup, const StageSink& sink) {
  std::vector<TensorView> shards;
  shards.reserve(group.size());
  for (int member : group) {
    ASSIGN_OR_RETURN(TensorView v, lookup(member, p));
    shards.push_back(v);
  }
  ASSIGN_OR_RETURN(Tensor full, Tensor::Empty(p.dtype, p.full_shape));
  RETURN_IF_ERROR(trainer_agent::MergeShards(p, shards, full.mutable_view()));
  ASSIGN_OR_RETURN(std::vector<model::HfTensor> hf, trainer_agent::ToHf(model, p, full.view()));
  return sink(stage, p, full.view(), std::move(hf));
}

std::vector<int> GroupOf(const ParallelLayout& layout, const MegatronParam& p, int rank) {
  switch (p.kind) {
    case ShardKind::kReplicated: return {rank};
    case ShardKind::kExpertDim1:
    case ShardKind::kExpertGluFc1: return layout.EtpGroup(rank);
    default: return layout.TpGroup(rank);
  }
}

}  // namespace

absl::Status ReassembleModel(const ModelConfig& model, const ParallelLayout& layout, const SourceParallel& parallel,
                             const RankTensorLookup& lookup, const StageSink& sink) {
  for (int stage = 0; stage < layout.pp(); ++stage) {
    const int source = layout.StageSourceRank(stage);
    ASSIGN_OR_RETURN(std::vector<trainer_agent::MegatronParam> plan,
                     trainer_agent::PlanRank(model, layout, parallel, source));
    for (const MegatronParam& p : plan)
      if (!p.is_expert) RETURN_IF_ERROR(GatherAndEmit(model, stage, p, GroupOf(layout, p, source), lookup, sink));
    // Routed experts: every EP rank of the stage, each over its own expert-TP group.
    for (int ep_member : layout.EpGroup(source)) {
      ASSIGN_OR_RETURN(std::vector<trainer_agent::MegatronParam> member_plan,
                       trainer_agent::PlanRank(model, layout, parallel, ep_member));
      for (const MegatronParam& p : member_plan)
        if (p.is_expert) RETURN_IF_ERROR(GatherAndEmit(model, stage, p, GroupOf(layout, p, ep_member), lookup, sink));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<VerifyReport> VerifyAgainstHf(const ModelConfig& model, const ParallelLayout& layout,
                                             const SourceParallel& parallel, const RankTensorLookup& lookup,
                                             const model::HfCheckpoint& hf) {
  ASSIGN_OR_RETURN(std::vector<model::HfTensorSpec> specs,
                   trainer_agent::HfTensorSpecs(model, parallel.mtp_num_layers));
  std::map<std::string, const model::HfTensorSpec*> expected;
  for (const model::HfTensorSpec& s : specs) expected.emplace(s.name, &s);
  std::set<std::string> emitted;
  VerifyReport report;

  auto compare = [&](absl::string_view what, const TensorView& got, TensorView want) -> absl::Status {
    Tensor widened;  // a bf16/fp16 HF source of an fp32 parameter (router.expert_bias) is compared widened
    if (got.dtype() == DType::kF32 && (want.dtype() == DType::kBF16 || want.dtype() == DType::kF16) &&
        got.shape() == want.shape()) {
      ASSIGN_OR_RETURN(widened, trainer_agent::WidenToF32(want));
      want = widened.view();
    }
    if (got.dtype() != want.dtype() || got.shape() != want.shape())
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": reassembled ", got.DebugString(), ", HF checkpoint ", want.DebugString()));
    const auto* a = reinterpret_cast<const unsigned char*>(got.data());
    const auto* b = reinterpret_cast<const unsigned char*>(want.data());
    if (std::memcmp(a, b, got.nbytes()) != 0) {
      size_t i = 0;
      while (a[i] == b[i]) ++i;
      return absl::DataLossError(
          absl::StrCat(what, ": reassembled bytes differ from the HF checkpoint at byte ", i, " of ", got.nbytes()));
    }
    return absl::OkStatus();
  };

  StageSink sink = [&](int stage, const MegatronParam& p, TensorView full,
                       std::vector<model::HfTensor> tensors) -> absl::Status {
    ++report.params;
    if (!p.sent) {
      // The tied output copy: its first vocab_size rows must equal the embedding.
      ASSIGN_OR_RETURN(TensorView emb, hf.Get(p.hf_names[0]));
      const size_t row_bytes = full.nbytes() / static_cast<size_t>(p.full_shape[0]);
      Shape shape = p.full_shape;
      shape[0] = model.vocab_size;
      TensorView head(p.dtype, shape, full.bytes().subspan(0, row_bytes * static_cast<size_t>(model.vocab_size)));
      return compare(absl::StrCat("stage ", stage, " ", p.global_name, " (tied copy of ", p.hf_names[0], ")"), head,
                     emb);
    }
    for (const model::HfTensor& t : tensors) {
      if (!emitted.insert(t.name).second)
        return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", t.name, "\" emitted twice (stage ", stage, ")"));
      if (expected.find(t.name) == expected.end())
        return absl::InvalidArgumentError(
            absl::StrCat("HF tensor \"", t.name, "\" emitted by ", p.global_name, " is not a tensor of the model"));
      ASSIGN_OR_RETURN(TensorView want, hf.Get(t.name));
      RETURN_IF_ERROR(compare(absl::StrCat("stage ", stage, " ", t.name, " (from ", p.global_name, ")"), t.view, want));
      ++report.hf_tensors;
      report.hf_bytes += t.view.nbytes();
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(ReassembleModel(model, layout, parallel, lookup, sink));
  for (const model::HfTensorSpec& s : specs)
    if (emitted.count(s.name) == 0)
      return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", s.name, "\" was never emitted by any stage"));
  return report;
}

namespace {

// Each rank file of `source` opened once, on first use; the views stay valid while it lives.
class RankFiles {
 public:
  explicit RankFiles(const trainer_agent::DirSource& source) : source_(source) {}
  RankTensorLookup Lookup() {
    return [this](int rank, const MegatronParam& p) -> absl::StatusOr<TensorView> {
      auto it = open_.find(rank);
      if (it == open_.end()) {
        Open o;
        ASSIGN_OR_RETURN(o.shard, source_.OpenRank(rank));
        for (size_t i = 0; i < o.shard.params.size(); ++i) o.index.emplace(o.shard.params[i].local_name, i);
        it = open_.emplace(rank, std::move(o)).first;
      }
      auto found = it->second.index.find(p.local_name);
      if (found == it->second.index.end())
        return absl::NotFoundError(absl::StrCat("rank ", rank, " holds no parameter ", p.local_name));
      return it->second.shard.tensors[found->second];
    };
  }

 private:
  struct Open {
    trainer_agent::RankShard shard;
    absl::flat_hash_map<std::string, size_t> index;  // local name -> position
  };
  const trainer_agent::DirSource& source_;
  std::map<int, Open> open_;
};

}  // namespace

absl::StatusOr<VerifyReport> VerifyDirSource(const trainer_agent::DirSource& source, const model::HfCheckpoint& hf) {
  RankFiles files(source);
  return VerifyAgainstHf(source.model(), source.layout(), source.parallel(), files.Lookup(), hf);
}

absl::StatusOr<VerifyReport> WriteHfOfDirSource(const trainer_agent::DirSource& source, const std::string& out_dir) {
  RankFiles files(source);
  std::vector<model::HfTensor> out;  // each copied: a converted tensor may alias a gather buffer
  VerifyReport report;
  RETURN_IF_ERROR(ReassembleModel(source.model(), source.layout(), source.parallel(), files.Lookup(),
                                  [&](int, const MegatronParam&, TensorView, std::vector<model::HfTensor> hf) {
                                    ++report.params;
                                    for (model::HfTensor& t : hf) {
                                      ASSIGN_OR_RETURN(Tensor copy, Tensor::CopyOf(t.view));
                                      report.hf_bytes += t.view.nbytes();
                                      out.push_back({std::move(t.name), copy.view(), std::move(copy)});
                                    }
                                    return absl::OkStatus();
                                  }));
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("creating ", out_dir, ": ", ec.message()));
  SafetensorsWriter writer;
  for (const model::HfTensor& t : out) RETURN_IF_ERROR(writer.Add(t.name, t.owned.view()));
  RETURN_IF_ERROR(writer.Write(out_dir + "/model.safetensors"));
  {
    std::ofstream config(out_dir + "/config.json", std::ios::binary | std::ios::trunc);
    config << source.config_json();
    if (!config.flush()) return absl::InternalError(absl::StrCat("writing ", out_dir, "/config.json"));
  }
  report.hf_tensors = static_cast<int64_t>(out.size());
  return report;
}

}  // namespace wsync::tools
