#include "trainer_agent/source/dir_source.h"

#include <filesystem>
#include <map>
#include <system_error>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "trainer_agent/convert/sharder.h"

namespace wsync::source {

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
  ASSIGN_OR_RETURN(SourceModel model, ParseSourceModel(std::move(config_json), config_path, parallel_json, parallel_path));
  return DirSource(dir, std::move(model));
}

absl::StatusOr<SourceModel> ParseSourceModel(std::string config_json, absl::string_view config_where,
                                             absl::string_view parallel_json, absl::string_view parallel_where) {
  ASSIGN_OR_RETURN(ModelConfig model, ParseModelConfig(config_json, config_where));
  ASSIGN_OR_RETURN(convert::SourceParallel parallel, convert::ParseSourceParallel(parallel_json, parallel_where));
  ASSIGN_OR_RETURN(parallel, convert::ResolveSourceParallel(model, std::move(parallel), parallel_where));
  auto layout = convert::MakeLayout(model, parallel);
  if (!layout.ok()) return Annotate(layout.status(), parallel_where);
  return SourceModel{std::move(config_json), std::move(model), std::move(parallel), std::move(*layout)};
}

std::string DirSource::RankPath(int global_rank) const {
  return absl::StrCat(dir_, "/", convert::RankFileName(global_rank));
}

absl::StatusOr<RankShard> DirSource::OpenRank(int global_rank, uint64_t /*version: files carry none*/) const {
  if (global_rank < 0 || global_rank >= layout().world_size())
    return absl::InvalidArgumentError(absl::StrCat("weight source ", dir_, ": rank ", global_rank,
                                                   " is outside the world of ", layout().world_size(),
                                                   " ranks (parallel.json)"));
  RankShard shard;
  shard.global_rank = global_rank;
  ASSIGN_OR_RETURN(shard.params, convert::PlanRank(model(), layout(), parallel(), global_rank));
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
  ASSIGN_OR_RETURN(shard.tensors, convert::BindToPlan(shard.params, tensors, path));
  return shard;
}

absl::StatusOr<convert::VerifyReport> VerifyDirSource(const DirSource& source, const convert::HfCheckpoint& hf) {
  struct Open {
    RankShard shard;
    absl::flat_hash_map<std::string, size_t> index;  // local name -> position
  };
  std::map<int, Open> open;
  convert::RankTensorLookup lookup = [&](int rank, const convert::MegatronParam& p) -> absl::StatusOr<TensorView> {
    auto it = open.find(rank);
    if (it == open.end()) {
      Open o;
      ASSIGN_OR_RETURN(o.shard, source.OpenRank(rank));
      for (size_t i = 0; i < o.shard.params.size(); ++i) o.index.emplace(o.shard.params[i].local_name, i);
      it = open.emplace(rank, std::move(o)).first;
    }
    auto found = it->second.index.find(p.local_name);
    if (found == it->second.index.end())
      return absl::NotFoundError(absl::StrCat("rank ", rank, " holds no parameter ", p.local_name));
    return it->second.shard.tensors[found->second];
  };
  return convert::VerifyAgainstHf(source.model(), source.layout(), source.parallel(), lookup, hf);
}

}  // namespace wsync::source
