#include "engine_side/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "engine_model/loader.h"
#include "engine_model/repack.h"
#include "model/quant_target.h"

namespace wsync::engine_side {
namespace {

// "X.weight_packed" -> "X" for the INT4 suffixes (compressed-tensors and AWQ), else "".
std::string Int4Prefix(absl::string_view name) {
  for (absl::string_view suffix :
       {".weight_packed", ".weight_scale", ".weight_shape", ".qweight", ".qzeros", ".scales"}) {
    if (absl::EndsWith(name, suffix)) return std::string(name.substr(0, name.size() - suffix.size()));
  }
  return "";
}

}  // namespace

absl::StatusOr<CheckpointStats> LoadCheckpoint(const std::string& dir, const engine_model::EngineLayout& layout,
                                               engine_model::EngineWeights& weights, const CheckpointOptions& options) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  if (ec) return absl::NotFoundError(absl::StrCat("checkpoint ", dir, ": ", ec.message()));
  if (files.empty()) return absl::NotFoundError(absl::StrCat("checkpoint ", dir, " holds no *.safetensors file"));
  std::sort(files.begin(), files.end());

  ASSIGN_OR_RETURN(std::unique_ptr<engine_model::Staging> staging, engine_model::Staging::Create(layout));
  engine_model::Loader loader(staging.get());
  CheckpointStats stats;
  std::vector<std::string> unknown;
  for (const std::string& path : files) {
    ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
    ++stats.files;
    for (const SafetensorsEntry& e : file.tensors()) {
      const std::string& name = e.name;
      stats.bytes += static_cast<int64_t>(e.view.nbytes());
      auto where = [&](const absl::Status& s) { return Annotate(s, absl::StrCat("checkpoint ", path)); };
      // An FP8 engine's "X.weight" is F8_E4M3: a bf16 / fp16 one is quantized below, an FP8 one loads.
      const int source = layout.FindSource(name);
      const bool to_fp8 = source >= 0 && layout.sources()[static_cast<size_t>(source)].dtype == DType::kF8E4M3 &&
                          (e.view.dtype() == DType::kBF16 || e.view.dtype() == DType::kF16);
      if (source >= 0 && !to_fp8) {
        RETURN_IF_ERROR(where(loader.Load(name, e.view)));
        ++stats.tensors;
        continue;
      }
      if (layout.IsIgnoredHfName(name) || absl::EndsWith(name, ".rotary_emb.inv_freq")) {
        ++stats.skipped;
        continue;
      }
      // A bf16 weight of a linear the engine serves in INT4 or FP8: quantize it the way a sync sends it.
      if (absl::EndsWith(name, ".weight") && layout.quantization() != nullptr) {
        const std::string prefix = name.substr(0, name.size() - 7);
        const std::vector<std::string> sent = model::QuantizedNames(prefix, *layout.quantization());
        if (layout.FindSource(sent[0]) >= 0) {
          if (e.view.shape().size() != 2)
            return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", name, " has rank ",
                                                           e.view.shape().size(), ", want a 2-D weight to quantize"));
          model::QuantizeOptions q;
          q.variant = options.variant;
          q.num_threads = options.num_threads;
          absl::StatusOr<std::vector<model::HfTensor>> tensors =
              model::QuantizeHfTensor(name, e.view, *layout.quantization(), q);
          if (!tensors.ok()) return where(tensors.status());
          for (const model::HfTensor& t : *tensors) RETURN_IF_ERROR(where(loader.Load(t.name, t.view)));
          ++stats.quantized;
          continue;
        }
      }
      const std::string int4 = Int4Prefix(name);
      if (!int4.empty() && layout.FindSource(int4 + ".weight") >= 0)
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint ", path, ": ", name, " is INT4 but the engine serves ", int4,
            ".weight in bf16 (no quantization config, or the linear is ignored by it); the engine does not "
            "dequantize checkpoints"));
      unknown.push_back(name);
    }
  }
  if (!unknown.empty()) {
    const size_t shown = std::min<size_t>(unknown.size(), 8);
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", dir, ": ", unknown.size(), " tensor(s) the ", ArchitectureName(layout.config().arch),
        " engine layout does not know: ", absl::StrJoin(unknown.begin(), unknown.begin() + shown, ", "),
        unknown.size() > shown ? ", ..." : ""));
  }
  RETURN_IF_ERROR(Annotate(loader.CheckComplete(), absl::StrCat("checkpoint ", dir)));
  engine_model::RepackOptions ro;
  ro.num_threads = options.num_threads;
  ro.verify = true;
  RETURN_IF_ERROR(Annotate(engine_model::Commit(*staging, weights, ro), absl::StrCat("checkpoint ", dir)));
  return stats;
}

}  // namespace wsync::engine_side
