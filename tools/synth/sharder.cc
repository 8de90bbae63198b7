#include "tools/synth/sharder.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "trainer_agent/convert/hf_convert.h"
#include "trainer_agent/convert/shard_layout.h"
#include "trainer_agent/source/dir_source.h"

namespace wsync::tools {
namespace {

namespace fs = std::filesystem;

// Writes `path` through a temporary file in the same directory and a rename.
absl::Status WriteFileAtomic(const std::string& path, absl::string_view text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return ErrnoToStatus(errno, absl::StrCat("cannot create ", tmp));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      return ErrnoToStatus(errno, absl::StrCat("cannot write ", tmp));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status CopyFileAtomic(const std::string& from, const std::string& to) {
  const std::string tmp = absl::StrCat(to, ".tmp.", getpid());
  std::error_code ec;
  fs::copy_file(from, tmp, fs::copy_options::overwrite_existing, ec);
  if (!ec) fs::rename(tmp, to, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return absl::InternalError(absl::StrCat("cannot copy ", from, " to ", to, ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<RankTensor>> BuildRankTensors(const ModelConfig& model, const ParallelLayout& layout,
                                                         const SourceParallel& parallel, const model::HfCheckpoint& hf,
                                                         int global_rank) {
  ASSIGN_OR_RETURN(std::vector<trainer_agent::MegatronParam> plan,
                   trainer_agent::PlanRank(model, layout, parallel, global_rank));
  std::vector<RankTensor> out;
  out.reserve(plan.size());
  for (trainer_agent::MegatronParam& p : plan) {
    RankTensor t;
    // The full tensor: the HF tensor itself when the op is a plain copy, else built once.
    TensorView full;
    Tensor built;
    if (p.hf_op == HfOp::kCopy) {
      ASSIGN_OR_RETURN(TensorView v, hf.Get(p.hf_names[0]));
      if (v.dtype() == p.dtype && v.shape() == p.full_shape) full = v;
    }
    if (full.nbytes() == 0) {
      ASSIGN_OR_RETURN(built, HfToMegatronFull(model, p, hf));
      full = built.view();
    }
    if (p.group_size == 1 && built.nbytes() == 0) {
      t.view = full;  // unsharded and unchanged: the HF bytes themselves
    } else if (p.group_size == 1) {
      t.owned = std::move(built);
      t.view = t.owned.view();
    } else {
      ASSIGN_OR_RETURN(t.owned, ShardFull(p, full, p.rank_in_group));
      t.view = t.owned.view();
    }
    t.param = std::move(p);
    out.push_back(std::move(t));
  }
  return out;
}

absl::StatusOr<WriteSourceStats> WriteMegatronSource(const std::string& config_json_text, const ModelConfig& model,
                                                     const model::HfCheckpoint& hf, const SourceParallel& parallel,
                                                     const std::string& out_dir) {
  ASSIGN_OR_RETURN(trainer_agent::SourceParallel par,
                   trainer_agent::ResolveSourceParallel(model, parallel, "requested parallel layout"));
  ASSIGN_OR_RETURN(trainer_agent::ParallelLayout layout, trainer_agent::MakeLayout(model, par));
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/config.json", config_json_text));
  RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/parallel.json", trainer_agent::SourceParallelToJson(par)));

  // Ranks that differ only in dp / edp hold identical tensors: build one, copy the others.
  WriteSourceStats stats;
  std::map<std::tuple<int, int, int, int>, std::string> built;
  for (int rank = 0; rank < layout.world_size(); ++rank) {
    const DenseCoord d = layout.Dense(rank);
    const ExpertCoord e = layout.Expert(rank);
    const std::string path = absl::StrCat(out_dir, "/", trainer_agent::RankFileName(rank));
    const auto key = std::make_tuple(d.pp, d.tp, e.etp, e.ep);
    if (auto it = built.find(key); it != built.end()) {
      RETURN_IF_ERROR(CopyFileAtomic(it->second, path));
      ++stats.files_copied;
      stats.bytes_written += fs::file_size(path, ec);
      continue;
    }
    ASSIGN_OR_RETURN(std::vector<RankTensor> tensors, BuildRankTensors(model, layout, par, hf, rank));
    SafetensorsWriter writer;
    writer.SetMetadata("format", "wsync-megatron-shard");
    writer.SetMetadata("global_rank", absl::StrCat(rank));
    for (const RankTensor& t : tensors) RETURN_IF_ERROR(writer.Add(t.param.local_name, t.view));
    RETURN_IF_ERROR(writer.Write(path));
    ++stats.files_built;
    stats.bytes_written += fs::file_size(path, ec);
    built.emplace(key, path);
  }
  return stats;
}

}  // namespace wsync::tools
