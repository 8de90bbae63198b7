#include "model/hf_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync::model {

absl::StatusOr<HfCheckpoint> HfCheckpoint::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  std::vector<std::string> paths;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (absl::EndsWith(it->path().filename().string(), ".safetensors")) paths.push_back(it->path().string());
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": ", ec.message()));
  if (paths.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no *.safetensors files"));
  std::sort(paths.begin(), paths.end());
  HfCheckpoint ckpt;
  std::map<std::string, std::string> owner;
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(path));
    auto file = std::make_shared<const SafetensorsFile>(std::move(f));
    for (const SafetensorsEntry& e : file->tensors()) {
      auto [it, inserted] = owner.emplace(e.name, path);
      if (!inserted)
        return absl::InvalidArgumentError(
            absl::StrCat("tensor \"", e.name, "\" is in both ", it->second, " and ", path));
      ckpt.index_.emplace(e.name, e.view);
    }
    ckpt.files_.push_back(std::move(file));
  }
  return ckpt;
}

absl::Status HfCheckpoint::Add(std::string name, Tensor tensor) {
  if (index_.count(name) != 0) return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" added twice"));
  auto t = std::make_unique<Tensor>(std::move(tensor));
  index_.emplace(std::move(name), t->view());
  owned_.push_back(std::move(t));
  return absl::OkStatus();
}

absl::StatusOr<TensorView> HfCheckpoint::Get(absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return absl::NotFoundError(absl::StrCat("HF checkpoint has no tensor \"", name, "\""));
  return it->second;
}

std::vector<std::string> HfCheckpoint::Names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, view] : index_) out.push_back(name);
  return out;
}

uint64_t HfCheckpoint::TotalBytes() const {
  uint64_t n = 0;
  for (const auto& [name, view] : index_) n += view.nbytes();
  return n;
}

}  // namespace wsync::model
