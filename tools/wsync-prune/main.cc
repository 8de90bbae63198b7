// wsync-prune: the pruned model an expert map describes (model/expert_map.h, docs/expert-pruning.md).
//
//   wsync-prune --expert-map MAP --config DIR_OR_CONFIG --out-config FILE
//       the pruned config.json the engines register and serve (what a sync with
//       `wsync-trainer-agent --expert-map MAP` delivers to);
//   wsync-prune --expert-map MAP --hf DIR --out DIR
//       the pruned HF checkpoint (config.json + model.safetensors): kept experts under their compact
//       ids, routers sliced in map order, MTP layers dropped. The oracle a pruned sync is verified
//       against (`wsyncctl verify --against DIR`), and a checkpoint engines can start from.
//
// Exit codes: 0 ok, 1 refused (the message names the map field / layer / tensor), 2 bad command line.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/status.h"
#include "model/expert_map.h"
#include "tools/synth/synthetic_model.h"

namespace wsync::tools {
namespace {

absl::Status WriteConfig(const std::string& path, const std::string& text) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream f(path, std::ios::trunc);
  f << text;
  f.close();
  if (!f) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status Run(const std::string& map_file, std::string config, const std::string& out_config, const std::string& hf,
                 const std::string& out) {
  ASSIGN_OR_RETURN(model::ExpertMap map, model::LoadExpertMap(map_file));
  if (!hf.empty()) config = hf;
  if (std::filesystem::is_directory(config)) config += "/config.json";
  ASSIGN_OR_RETURN(std::string text, ReadTextFile(config));
  ASSIGN_OR_RETURN(ModelConfig original, ParseModelConfig(text, config));
  SyntheticModel pruned;
  ASSIGN_OR_RETURN(pruned.config_json, model::PrunedConfigJson(text, map, config));
  ASSIGN_OR_RETURN(pruned.config, ParseModelConfig(pruned.config_json, "the pruned config"));
  if (hf.empty()) {
    RETURN_IF_ERROR(WriteConfig(out_config, pruned.config_json));
    std::printf("wrote %s: %s with %lld of %lld routed experts per layer\n", out_config.c_str(),
                original.architecture.c_str(), static_cast<long long>(map.kept()),
                static_cast<long long>(map.num_experts));
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(model::HfCheckpoint checkpoint, model::HfCheckpoint::Open(hf));
  ASSIGN_OR_RETURN(pruned.weights, model::PruneHfCheckpoint(original, map, checkpoint));
  RETURN_IF_ERROR(WriteHfModel(pruned, out));
  std::printf("wrote %s: %s with %lld of %lld routed experts per layer, %zu of %zu tensors, %.1f MiB\n", out.c_str(),
              original.architecture.c_str(), static_cast<long long>(map.kept()),
              static_cast<long long>(map.num_experts), pruned.weights.size(), checkpoint.size(),
              static_cast<double>(pruned.weights.TotalBytes()) / (1 << 20));
  return absl::OkStatus();
}

}  // namespace
}  // namespace wsync::tools

int main(int argc, char** argv) {
  CLI::App app{"wsync-prune: the pruned config.json or HF checkpoint an expert map describes"};
  std::string map_file, config, out_config, hf, out;
  app.add_option("--expert-map", map_file, "the expert map (JSON)")->required();
  auto* c = app.add_option("--config", config, "the original config.json (or its directory)");
  auto* oc = app.add_option("--out-config", out_config, "write the pruned config.json here");
  auto* h = app.add_option("--hf", hf, "the original HF checkpoint directory");
  auto* o = app.add_option("--out", out, "write the pruned checkpoint here (created)");
  c->needs(oc)->excludes(h);
  oc->needs(c);
  h->needs(o);
  o->needs(h);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (config.empty() && hf.empty()) {
    std::fprintf(stderr, "wsync-prune: give --config FILE --out-config FILE or --hf DIR --out DIR\n");
    return 2;
  }
  if (absl::Status s = wsync::tools::Run(map_file, config, out_config, hf, out); !s.ok()) {
    std::fprintf(stderr, "wsync-prune: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
