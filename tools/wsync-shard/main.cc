// wsync-shard: HF checkpoint -> Megatron source directory (config.json, parallel.json,
// rank-{global_rank:05d}.safetensors), and its bit-exact check.
//
//   wsync-shard --hf HF_DIR --out SRC_DIR --tp N [--pp N --ep N --etp N --dp N --cp N]
//               [--layers-per-stage a,b,...] [--make-vocab-size-divisible-by N]
//               [--padded-vocab-size N] [--mtp-num-layers N] [--verify]
//   wsync-shard --hf HF_DIR --src SRC_DIR --verify        check an existing source directory
//   wsync-shard --src SRC_DIR --to-hf HF_DIR                 the HF checkpoint a source directory holds
//
// An FP8 HF checkpoint (DeepSeek-V3's block form or compressed-tensors per channel, as its
// config.json says) is dequantized first (model::DequantizeFp8Checkpoint, to the config's
// torch_dtype): the source holds what a trainer trains, without the quantization_config.
// world_size = tp*cp*pp*dp; etp defaults to tp (Megatron's default). --verify reads the rank files
// back as the trainer agent does, simulates every stage's TP / EP / ETP gathers in-process,
// converts to HF and compares every tensor bit for bit with HF_DIR.
// Exit codes: 0 ok, 1 refused or mismatch (the message names the file / tensor / values),
// 2 bad command line.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/config.h"
#include "model/hf_checkpoint.h"
#include "model/quant_target.h"
#include "tools/synth/reassemble.h"
#include "tools/synth/sharder.h"
#include "tools/wsync-quant/quant_tool.h"
#include "trainer_agent/source/dir_source.h"

namespace wsync::tools {
namespace {

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int Run(int argc, char** argv) {
  CLI::App app{"wsync-shard: HF checkpoint -> Megatron per-rank shard files (and their bit-exact check)"};
  std::string hf_dir, out_dir, src_dir;
  trainer_agent::SourceParallel p;
  std::vector<int64_t> layers_per_stage, layers_per_chunk;
  bool verify = false;
  std::string to_hf;
  app.add_option("--hf", hf_dir, "HF checkpoint directory (config.json + *.safetensors)");
  auto* out_opt = app.add_option("--out", out_dir, "source directory to write");
  auto* src_opt = app.add_option("--src", src_dir, "existing source directory to verify");
  out_opt->excludes(src_opt);
  app.add_option("--tp", p.tp, "tensor parallel size")->capture_default_str();
  app.add_option("--pp", p.pp, "pipeline parallel size")->capture_default_str();
  app.add_option("--ep", p.ep, "expert parallel size")->capture_default_str();
  auto* etp_opt = app.add_option("--etp", p.etp, "expert tensor parallel size (default: tp)");
  app.add_option("--dp", p.dp, "data parallel size")->capture_default_str();
  app.add_option("--cp", p.cp, "context parallel size")->capture_default_str();
  app.add_option("--layers-per-stage", layers_per_stage, "decoder layers of each PP stage (default: even split)")
      ->delimiter(',');
  app.add_option("--vpp", p.vpp, "virtual pipeline stages (model chunks) per PP stage")->capture_default_str();
  app.add_option("--layers-per-chunk", layers_per_chunk,
                 "decoder layers of each model chunk in layer order, pp*vpp entries (default: Megatron's split)")
      ->delimiter(',');
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  auto* first_opt = app.add_option("--decoder-first-pipeline-num-layers", first_stage_layers,
                                   "Megatron's uneven first stage (num_layers_in_first_pipeline_stage)");
  auto* last_opt = app.add_option("--decoder-last-pipeline-num-layers", last_stage_layers,
                                  "Megatron's uneven last stage (num_layers_in_last_pipeline_stage)");
  app.add_flag("--account-for-embedding-in-pipeline-split", p.account_for_embedding_in_pipeline_split,
               "Megatron's option: the embedding takes a layer's place in the first virtual stage");
  app.add_flag("--account-for-loss-in-pipeline-split", p.account_for_loss_in_pipeline_split,
               "Megatron's option: the loss takes a layer's place in the last virtual stage");
  app.add_option("--mtp-num-layers", p.mtp_num_layers,
                 "Megatron's MTP layers (mtp.layers.{k}, synced as model.layers.{L+k}; the HF config's "
                 "num_nextn_predict_layers, whose tensors the checkpoint must hold)")
      ->capture_default_str();
  app.add_option("--make-vocab-size-divisible-by", p.make_vocab_size_divisible_by)->capture_default_str();
  app.add_option("--padded-vocab-size", p.padded_vocab_size, "override Megatron's padded vocab formula");
  app.add_flag("--verify", verify, "simulate the gathers and compare with the HF checkpoint bit for bit");
  auto* to_hf_opt = app.add_option(
      "--to-hf", to_hf, "with --src: write the HF checkpoint the source holds (config.json, model.safetensors)");
  try {
    app.parse(argc, argv);
    if (out_opt->count() == 0 && src_opt->count() == 0) throw CLI::RequiredError("--out or --src");
    if (to_hf_opt->count() > 0 && (src_opt->count() == 0 || verify || !hf_dir.empty()))
      throw CLI::ValidationError("--to-hf", "takes --src only (no --hf, --verify)");
    if (src_opt->count() > 0 && !verify && to_hf_opt->count() == 0)
      throw CLI::RequiredError("--verify or --to-hf (with --src)");
    if (to_hf_opt->count() == 0 && hf_dir.empty()) throw CLI::RequiredError("--hf");
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  };
  auto t0 = std::chrono::steady_clock::now();
  if (to_hf_opt->count() > 0) {
    auto src = trainer_agent::DirSource::Open(src_dir);
    if (!src.ok()) return fail(src.status());
    auto report = tools::WriteHfOfDirSource(*src, to_hf);
    if (!report.ok()) return fail(report.status());
    std::printf("%s\n", absl::StrFormat("wrote %s from %s: %d parameters -> %d HF tensors (%.1f MiB), %.2f s", to_hf,
                                        src_dir, report->params, report->hf_tensors,
                                        static_cast<double>(report->hf_bytes) / (1 << 20), Since(t0))
                            .c_str());
    return 0;
  }
  auto hf = model::HfCheckpoint::Open(hf_dir);
  if (!hf.ok()) return fail(hf.status());
  auto config_text = ReadTextFile(hf_dir + "/config.json");
  if (!config_text.ok()) return fail(config_text.status());
  auto model = ParseModelConfig(*config_text, hf_dir + "/config.json");
  if (!model.ok()) return fail(model.status());
  if (model->quantization && model->quantization->is_fp8()) {
    auto dense = model::DequantizeFp8Checkpoint(*hf, *model->quantization, model->dtype);
    if (!dense.ok()) return fail(dense.status());
    auto text = WithoutQuantizationConfig(*config_text, hf_dir + "/config.json");
    if (!text.ok()) return fail(text.status());
    std::printf("dequantized the FP8 checkpoint %s (%s) to %s\n", hf_dir.c_str(),
                model->quantization->Describe().c_str(), SafetensorsName(model->dtype).data());
    *hf = std::move(*dense);
    *config_text = std::move(*text);
    model->quantization.reset();
  }

  if (out_opt->count() > 0) {
    if (etp_opt->count() == 0) p.etp = p.tp;
    p.world_size = p.tp * p.cp * p.pp * p.dp;
    p.layers_per_stage = layers_per_stage;
    p.layers_per_chunk = layers_per_chunk;
    if (first_opt->count() > 0) p.num_layers_in_first_pipeline_stage = first_stage_layers;
    if (last_opt->count() > 0) p.num_layers_in_last_pipeline_stage = last_stage_layers;
    auto stats = tools::WriteMegatronSource(*config_text, *model, *hf, p, out_dir);
    if (!stats.ok()) return fail(stats.status());
    std::printf("%s\n",
                absl::StrFormat("wrote %s: %d rank files (%d built, %d DP copies), %.1f MiB, %.2f s", out_dir,
                                stats->files_built + stats->files_copied, stats->files_built, stats->files_copied,
                                static_cast<double>(stats->bytes_written) / (1 << 20), Since(t0))
                    .c_str());
    src_dir = out_dir;
  }
  if (verify) {
    t0 = std::chrono::steady_clock::now();
    auto src = trainer_agent::DirSource::Open(src_dir);
    if (!src.ok()) return fail(src.status());
    auto report = tools::VerifyDirSource(*src, *hf);
    if (!report.ok()) return fail(report.status());
    std::printf("%s\n",
                absl::StrFormat("verified %s against %s: %s, %d parameters -> %d HF tensors (%.1f MiB) "
                                "bit-exact, %.2f s",
                                src_dir, hf_dir, src->layout().DebugString(), report->params, report->hf_tensors,
                                static_cast<double>(report->hf_bytes) / (1 << 20), Since(t0))
                    .c_str());
  }
  return 0;
}

}  // namespace
}  // namespace wsync::tools

int main(int argc, char** argv) { return wsync::tools::Run(argc, argv); }
