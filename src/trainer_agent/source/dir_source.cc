#include "trainer_agent/source/dir_source.h"

#include <filesystem>
#include <map>
#include <system_error>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace wsync::trainer_agent {

int RankShard::Find(absl::string_view local_name) const {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].local_name == local_name) return static_cast<int>(i);
  return -1;
}

absl::StatusOr<DirSource> DirSource::Open(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return absl::NotFoundError(absl::StrCat("weight source ", dir, ": not a directory"));
  const std::string config_path = dir + "/config.json";
  const std::string parallel_path = dir + "/parallel.json";
  ASSIGN_OR_RETURN(std::string config_json, ReadTextFile(config_path));
  ASSIGN_OR_RETURN(std::string parallel_json, ReadTextFile(parallel_path));
  ASSIGN_OR_RETURN(SourceModel model,
                   ParseSourceModel(std::move(config_json), config_path, parallel_json, parallel_path));
  return DirSource(dir, std::move(model));
}

absl::StatusOr<SourceModel> ParseSourceModel(std::string config_json, absl::string_view config_where,
                                             absl::string_view parallel_json, absl::string_view parallel_where) {
  ASSIGN_OR_RETURN(ModelConfig model, ParseModelConfig(config_json, config_where));
  ASSIGN_OR_RETURN(SourceParallel parallel, ParseSourceParallel(parallel_json, parallel_where));
  ASSIGN_OR_RETURN(parallel, ResolveSourceParallel(model, std::move(parallel), parallel_where));
  auto layout = MakeLayout(model, parallel);
  if (!layout.ok()) return Annotate(layout.status(), parallel_where);
  return SourceModel{std::move(config_json), std::move(model), std::move(parallel), std::move(*layout)};
}

std::string DirSource::RankPath(int global_rank) const { return absl::StrCat(dir_, "/", RankFileName(global_rank)); }

absl::StatusOr<RankShard> DirSource::OpenRank(int global_rank, uint64_t /*version: files carry none*/) const {
  if (global_rank < 0 || global_rank >= layout().world_size())
    return absl::InvalidArgumentError(absl::StrCat("weight source ", dir_, ": rank ", global_rank,
                                                   " is outside the world of ", layout().world_size(),
                                                   " ranks (parallel.json)"));
  RankShard shard;
  shard.global_rank = global_rank;
  ASSIGN_OR_RETURN(shard.params, PlanRank(model(), layout(), parallel(), global_rank));
  const std::string path = RankPath(global_rank);
  auto file = SafetensorsFile::Open(path);
  if (!file.ok()) {
    if (absl::IsNotFound(file.status()))
      return absl::NotFoundError(absl::StrCat("weight source ", dir_, ": rank file ", path, " of rank ", global_rank,
                                              " is missing (", file.status().message(), ")"));
    return file.status();
  }
  auto mapped = std::make_shared<const SafetensorsFile>(std::move(*file));
  shard.backing = mapped;
  std::vector<std::pair<std::string, TensorView>> tensors;
  tensors.reserve(mapped->tensors().size());
  for (const SafetensorsEntry& e : mapped->tensors()) tensors.emplace_back(e.name, e.view);
  ASSIGN_OR_RETURN(shard.tensors, BindToPlan(shard.params, tensors, path));
  return shard;
}

std::string RankFileName(int global_rank) { return absl::StrFormat("rank-%05d.safetensors", global_rank); }

}  // namespace wsync::trainer_agent
