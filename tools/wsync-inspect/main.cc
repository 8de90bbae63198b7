// wsync-inspect: look inside the files wsync reads and writes.
//
//   wsync-inspect model.safetensors [--checksum] [--json]   tensors: name, dtype, shape, bytes, offset
//   wsync-inspect config.json | MODEL_DIR [--json]          the parsed and validated HF config
//   wsync-inspect NEW_DIR --delta-from BASE_DIR [--json]    what a delta sync would send from one
//                                                           version to the next (delta_stats.h)
//
// Every file is validated exactly as the agents validate it, so this is also the way to ask
// "why does wsync refuse this file?": the error names the file, the tensor and the values.
// Exit codes: 0 ok, 1 a file was refused, 2 bad command line.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/safetensors.h"
#include "common/units.h"
#include "tools/wsync-inspect/delta_stats.h"

namespace wsync {
namespace {

int InspectSafetensors(const std::string& path, bool checksum, bool json) {
  auto f = SafetensorsFile::Open(path);
  if (!f.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(f.status().message()).c_str());
    return 1;
  }
  const auto* base = f->tensors().empty() ? nullptr : f->tensors().front().view.bytes().data();
  uint64_t total = 0;
  nlohmann::json out = {{"file", path}, {"tensors", nlohmann::json::array()}, {"metadata", f->metadata()}};
  if (!json) std::printf("%s: %zu tensors\n", path.c_str(), f->tensors().size());
  for (const auto& e : f->tensors()) {
    total += e.view.nbytes();
    nlohmann::json t = {{"name", e.name},
                        {"dtype", std::string(SafetensorsName(e.view.dtype()))},
                        {"shape", std::vector<int64_t>(e.view.shape().begin(), e.view.shape().end())},
                        {"nbytes", e.view.nbytes()}};
    std::string sum;
    if (checksum) {
      sum = absl::StrFormat("%016x", Xxh3_64(e.view.bytes()));
      t["xxh3_64"] = sum;
    }
    if (json) {
      out["tensors"].push_back(t);
    } else {
      const long long off = base && e.view.nbytes() ? static_cast<long long>(e.view.bytes().data() - base) : 0;
      std::printf("  %-64s %-4s %-22s %12s  @%-12lld %s\n", e.name.c_str(),
                  std::string(SafetensorsName(e.view.dtype())).c_str(), ShapeToString(e.view.shape()).c_str(),
                  FormatBytes(e.view.nbytes()).c_str(), off, sum.c_str());
    }
  }
  if (json) {
    out["total_bytes"] = total;
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    for (const auto& [k, v] : f->metadata()) std::printf("  metadata %s = %s\n", k.c_str(), v.c_str());
    std::printf("  total %s\n", FormatBytes(total).c_str());
  }
  return 0;
}

int InspectConfig(const std::string& path, bool json) {
  auto c = LoadModelConfig(path);
  if (!c.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(c.status().message()).c_str());
    return 1;
  }
  std::vector<int64_t> moe_layers;
  for (int64_t l = 0; l < c->num_hidden_layers; ++l)
    if (c->IsMoeLayer(l)) moe_layers.push_back(l);
  nlohmann::json out = {{"architecture", c->architecture},
                        {"model_type", c->model_type},
                        {"hidden_size", c->hidden_size},
                        {"num_hidden_layers", c->num_hidden_layers},
                        {"num_attention_heads", c->num_attention_heads},
                        {"num_key_value_heads", c->num_key_value_heads},
                        {"head_dim", c->head_dim},
                        {"intermediate_size", c->intermediate_size},
                        {"vocab_size", c->vocab_size},
                        {"tie_word_embeddings", c->tie_word_embeddings},
                        {"qkv_bias", c->qkv_bias},
                        {"qk_norm", c->qk_norm},
                        {"dtype", std::string(TorchName(c->dtype))},
                        {"moe_layers", moe_layers}};
  if (c->moe)
    out["moe"] = {{"num_experts", c->moe->num_experts},
                  {"num_experts_per_tok", c->moe->num_experts_per_tok},
                  {"moe_intermediate_size", c->moe->moe_intermediate_size},
                  {"num_shared_experts", c->moe->num_shared_experts}};
  if (c->mla)
    out["mla"] = {{"q_lora_rank", c->mla->q_lora_rank},
                  {"kv_lora_rank", c->mla->kv_lora_rank},
                  {"qk_nope_head_dim", c->mla->qk_nope_head_dim},
                  {"qk_rope_head_dim", c->mla->qk_rope_head_dim},
                  {"v_head_dim", c->mla->v_head_dim}};
  if (c->quantization) {
    const auto& q = *c->quantization;
    std::vector<std::string> ignore;
    for (const auto& r : q.ignore) ignore.push_back(r.text);
    auto sup = q.CheckInt4Supported();
    out["quantization"] = {{"quant_method", q.quant_method},
                           {"format", q.format},
                           {"num_bits", q.num_bits},
                           {"group_size", q.group_size},
                           {"strategy", q.strategy},
                           {"symmetric", q.symmetric},
                           {"ignore", ignore},
                           {"int4_supported", sup.ok() ? "yes" : std::string(sup.message())}};
  }
  if (json) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("%s\n", path.c_str());
    for (auto it = out.begin(); it != out.end(); ++it)
      std::printf("  %-22s %s\n", it.key().c_str(), it.value().dump().c_str());
  }
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  CLI::App app{"wsync-inspect: validate and describe safetensors files and HF model configs"};
  std::vector<std::string> paths;
  bool checksum = false, json = false;
  std::string delta_from;
  app.add_option("paths", paths, "*.safetensors files, config.json files or model directories")->required();
  app.add_option("--delta-from", delta_from,
                 "A directory of the previous version's tensors (a recording, an HF checkpoint): per class of "
                 "tensor, what changed in the one directory given and the bytes of a delta sync");
  app.add_flag("--checksum", checksum, "Print the XXH3-64 of every tensor's bytes");
  app.add_flag("--json", json, "Machine-readable output");
  CLI11_PARSE(app, argc, argv);
  if (!delta_from.empty()) {
    if (paths.size() != 1) {
      std::fprintf(stderr, "wsync-inspect: --delta-from compares one directory with it (got %zu)\n", paths.size());
      return 2;
    }
    return wsync::tools::PrintDeltaStats(delta_from, paths[0], json);
  }
  int rc = 0;
  for (const auto& p : paths) {
    const bool st = absl::EndsWith(p, ".safetensors");
    const int r = st ? wsync::InspectSafetensors(p, checksum, json) : wsync::InspectConfig(p, json);
    if (r != 0) rc = r;
  }
  return rc;
}
