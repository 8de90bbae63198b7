// wsync-quant: HF checkpoints to and from FP8 (quant_tool.h; INT4 files: wsync-int4).
//
//   wsync-quant fp8 --hf DIR --out DIR [--block N,K | --channel] [--scale-fmt ue8m0] [--ignore NAME]...
//   wsync-quant dequantize --hf DIR --out DIR [--dtype bf16|f16]
//
// Exit codes: 0 ok, 1 refused (the message names the file, tensor and values; nothing is written),
// 2 bad command line.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "tools/wsync-quant/quant_tool.h"

namespace wsync::tools {
namespace {

int Run(int argc, char** argv) {
  CLI::App app{"wsync-quant: HF checkpoints to FP8 (block or per channel) and back, as a sync sends them"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("-t,--threads", threads, "CPU threads (0 = all)");
  Fp8CheckpointOptions f;
  std::vector<int64_t> block = {128, 128};
  std::string scale_fmt;
  CLI::App* fp8 = app.add_subcommand("fp8", "bf16 / fp16 checkpoint -> FP8 (DeepSeek-V3 block form or per channel)");
  fp8->add_option("--hf", f.in, "input HF checkpoint directory")->required();
  fp8->add_option("--out", f.out, "output directory (must not exist)")->required();
  auto* block_opt = fp8->add_option("--block", block, "weight_block_size N,K")->delimiter(',')->expected(2);
  fp8->add_flag("--channel", f.channel, "per channel (compressed-tensors float-quantized) instead of blocks")
      ->excludes(block_opt);
  fp8->add_option("--scale-fmt", scale_fmt, "ue8m0: power-of-two block scales")->check(CLI::IsMember({"ue8m0"}));
  fp8->add_option("--ignore", f.ignore, "module kept in bf16 (repeatable; lm_head, embeddings, routers always are)");
  DequantizeOptions d;
  std::string dtype = "bf16";
  CLI::App* deq = app.add_subcommand("dequantize", "FP8 checkpoint -> bf16 / fp16 (what a trainer holds)");
  deq->add_option("--hf", d.in, "input FP8 HF checkpoint directory")->required();
  deq->add_option("--out", d.out, "output directory (must not exist)")->required();
  deq->add_option("--dtype", dtype, "bf16 or f16")->check(CLI::IsMember({"bf16", "f16"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  absl::Status s;
  if (fp8->parsed()) {
    f.block_n = block[0];
    f.block_k = block[1];
    f.ue8m0 = scale_fmt == "ue8m0";
    f.threads = threads;
    if (f.channel && f.ue8m0) {
      std::fprintf(stderr, "wsync-quant: --scale-fmt applies to the block form only\n");
      return 2;
    }
    s = QuantizeCheckpointFp8(f);
  } else {
    d.dtype = dtype == "f16" ? DType::kF16 : DType::kBF16;
    d.threads = threads;
    s = DequantizeCheckpoint(d);
  }
  if (!s.ok()) {
    std::fprintf(stderr, "wsync-quant: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("wsync-quant: wrote %s\n", (fp8->parsed() ? f.out : d.out).c_str());
  return 0;
}

}  // namespace
}  // namespace wsync::tools

int main(int argc, char** argv) { return wsync::tools::Run(argc, argv); }
