// wsync-int4: quantize safetensors weights to symmetric INT4 and convert GPTQ <-> Marlin.
//
//   wsync-int4 quantize --in W.safetensors --out Q.safetensors --group-size G
//              [--format compressed-tensors|gptq] [--variant qat|slime] [--ignore REGEX]...
//   wsync-int4 marlin-repack  --in Q.safetensors --out M.safetensors --group-size G [--perm-from NAME]
//   wsync-int4 marlin-restore --in M.safetensors --out Q.safetensors --group-size G [--perm-from NAME]
//   wsync-int4 quantize --format awq [--arith fp16|fp32] --group-size G --in W.safetensors --out A.safetensors
//   wsync-int4 awq-marlin-repack --in A.safetensors --out M.safetensors
//   wsync-int4 trtllm-preprocess --arch sm80|sm90 [--w4afp8] --in Q.safetensors --out T.safetensors
//
// See int4_tool.h for what each command does and docs/kernels.md for the formats.
// Exit codes: 0 ok, 1 conversion refused (the message names the tensor and values; no output file
// is left behind), 2 bad command line.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <string>

#include "int4_tool.h"

namespace wsync::tools {
namespace {

int Run(int argc, char** argv) {
  CLI::App app{
      "wsync-int4: INT4 quantization (symmetric, AWQ) and engine layouts (Marlin, AWQ-Marlin, TensorRT-LLM) "
      "of safetensors files"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("-t,--threads", threads, "CPU threads (0 = all)");

  QuantizeFileOptions q;
  std::string format = "compressed-tensors", variant = "qat", arith = "fp16";
  CLI::App* quantize = app.add_subcommand("quantize", "quantize every floating *.weight (2-D or 3-D) to INT4");
  quantize->add_option("--in", q.in, "input safetensors file")->required();
  quantize->add_option("--out", q.out, "output safetensors file")->required();
  quantize->add_option("--group-size", q.group_size, "32, 64, 128 or -1 (channelwise)")->required();
  quantize->add_option("--format", format, "output format")
      ->check(CLI::IsMember({"compressed-tensors", "gptq", "awq"}));
  quantize->add_option("--arith", arith, "awq: fp16 (AutoAWQ on a GPU, the default) or fp32")
      ->check(CLI::IsMember({"fp16", "fp32"}));
  quantize->add_option("--variant", variant, "qat (amax / 7) or slime (amax * fl32(1/7))")
      ->check(CLI::IsMember({"qat", "slime"}));
  quantize->add_option("--ignore", q.ignore, "regex of module/tensor names to keep unquantized (repeatable)");

  RepackFileOptions r;
  CLI::App* repack = app.add_subcommand("marlin-repack", "GPTQ / compressed-tensors INT4 -> Marlin layout");
  CLI::App* restore = app.add_subcommand("marlin-restore", "Marlin layout -> GPTQ / compressed-tensors INT4");
  for (CLI::App* sub : {repack, restore}) {
    sub->add_option("--in", r.in, "input safetensors file")->required();
    sub->add_option("--out", r.out, "output safetensors file")->required();
    sub->add_option("--group-size", r.group_size, "32, 64, 128 or -1 (channelwise)")->required();
    sub->add_option("--perm-from", r.perm_from, "act-order: perm = stable argsort of <prefix>.<NAME> (e.g. g_idx)");
  }
  ConvertFileOptions c;
  std::string arch = "sm80";
  CLI::App* awq_marlin = app.add_subcommand("awq-marlin-repack", "AWQ qweight/qzeros/scales -> vLLM AWQ-Marlin");
  CLI::App* trtllm = app.add_subcommand("trtllm-preprocess", "compressed-tensors or AWQ INT4 -> TensorRT-LLM layout");
  for (CLI::App* sub : {awq_marlin, trtllm}) {
    sub->add_option("--in", c.in, "input safetensors file")->required();
    sub->add_option("--out", c.out, "output safetensors file")->required();
  }
  trtllm->add_option("--arch", arch, "GPU family: sm80 (sm75-89, sm100+) or sm90")
      ->required()
      ->check(CLI::IsMember({"sm80", "sm90"}));
  trtllm->add_flag("--w4afp8", c.w4afp8, "FP8 activations (MoE only; sm80 gives the sm89 layout)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  absl::Status st;
  if (quantize->parsed()) {
    q.format = format == "gptq"  ? QuantFileFormat::kGptq
               : format == "awq" ? QuantFileFormat::kAwq
                                 : QuantFileFormat::kCompressedTensors;
    q.arith = arith == "fp32" ? kernels::AwqArith::kFp32 : kernels::AwqArith::kFp16;
    q.variant = variant == "slime" ? kernels::QuantVariant::kSlime : kernels::QuantVariant::kQat;
    q.threads = threads;
    st = QuantizeFile(q);
  } else if (awq_marlin->parsed() || trtllm->parsed()) {
    c.threads = threads;
    c.arch = arch == "sm90" ? kernels::TrtllmArch::kSm90 : kernels::TrtllmArch::kSm80;
    st = awq_marlin->parsed() ? AwqMarlinRepackFile(c) : TrtllmPreprocessFile(c);
  } else {
    r.threads = threads;
    st = repack->parsed() ? MarlinRepackFile(r) : MarlinRestoreFile(r);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace wsync::tools

int main(int argc, char** argv) { return wsync::tools::Run(argc, argv); }
