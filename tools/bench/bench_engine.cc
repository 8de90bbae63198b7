// wsync-bench-engine: what the reference engine's Continue costs (EngineModel::Prepare) on one
// TP-1 engine rank of a real-sized model, per weight mode, in time and memory.
//
//   wsync-bench-engine (--checkpoint DIR | --work DIR [--preset bench2g]) [--quant-config FILE|none]
//                      [--threads N] [--load-threads N] [--prompt 8] [--new-tokens 4] [--only-in-place]
//
// Each mode runs in its own forked process, exactly as wsync-ref-engine --checkpoint starts: the
// rank's EngineLayout in one POSIX shm ParamArena, the checkpoint loaded through the rollout Loader
// + Commit (bf16 weights of INT4 linears quantized at load), then EngineModel::Create + Prepare
// twice (the first Continue and a later one) and one Generate. Modes:
//   f32-copy   WeightMode::kFloat32Copy, the unoptimised baseline mode (a fresh float32 copy of every
//              weight per Prepare, one thread) -- the "before";
//   in-place   WeightMode::kInPlace with 1 thread and with --threads (0 = all cores) -- the "after".
// Columns: checked = bytes Prepare scanned for NaN / Inf (Marlin: its scales; f32-copy: its
// copies), alloc = bytes Prepare allocated, in_place = parameter bytes the forward pass reads
// where they are. Memory: RSS after the load (the shm pages the loader wrote count in it), then the peak RSS from
// there to the end (VmHWM reset through /proc/self/clear_refs after the load), i.e. the load's own
// transient peak is excluded. Without --checkpoint, --work DIR/hf gets the preset's random Qwen3-MoE
// (seed 7, what tools/bench-sync.sh uses) unless it exists. The default quantization config is
// bench-sync.sh's: INT4 G=128 experts, bf16 attention / embeddings / router / norms.
// Timings on a shared machine are noisy: compare the rows of one run (the ratios are printed).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/status.h"
#include "engine_memory/param_arena.h"
#include "engine_model/engine_layout.h"
#include "engine_side/checkpoint.h"
#include "ref_engine/model.h"
#include "tools/synth/synthetic_model.h"

namespace wsync {
namespace {

struct Flags {
  std::string checkpoint, work, preset = "bench2g", quant_config;
  int threads = 0, load_threads = 0, prompt = 8, new_tokens = 4;
  bool only_in_place = false;
};

struct Mode {
  const char* name;
  ref_engine::WeightMode mode;
  int threads;
};

// What one mode's child reports through the pipe.
struct Result {
  int ok = 0;
  int threads = 0;
  double load_s = 0, prepare1_s = 0, prepare2_s = 0, generate_s = 0;
  double alloc1_mib = 0, alloc2_mib = 0, in_place_mib = 0, checked_mib = 0;
  double shm_mib = 0, rss_after_load_mib = 0, peak_after_load_mib = 0;
  char error[512] = {};
};

double StatusKib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atof(line.c_str() + std::strlen(key));
  return 0;
}

absl::Status RunMode(const Flags& f, const std::string& dir, const Mode& mode, Result* out) {
  ASSIGN_OR_RETURN(ModelConfig config, tools::BenchModelConfig(dir, f.quant_config));
  ref_engine::EngineRank rank;  // TP 1
  ASSIGN_OR_RETURN(
      engine_model::EngineLayout layout,
      engine_model::EngineLayout::Create(config, config.quantization ? &*config.quantization : nullptr, rank));
  ASSIGN_OR_RETURN(std::unique_ptr<engine_memory::ParamArena> arena,
                   engine_memory::ParamArena::Create(layout, engine_memory::UniqueShmName("bench-engine", 0)));
  out->shm_mib = static_cast<double>(arena->segment().size()) / (1 << 20);
  absl::Time t0 = absl::Now();
  engine_side::CheckpointOptions co;
  co.num_threads = f.load_threads;
  RETURN_IF_ERROR(engine_side::LoadCheckpoint(dir, layout, arena->weights(), co).status());
  out->load_s = absl::ToDoubleSeconds(absl::Now() - t0);
  out->rss_after_load_mib = StatusKib("VmRSS:") / 1024;
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";  // resets VmHWM to the current RSS
  }
  engine_model::EngineWeights* weights = &arena->weights();
  ref_engine::ParamLookup lookup = [weights](absl::string_view name) -> absl::StatusOr<TensorView> {
    ASSIGN_OR_RETURN(MutableTensorView v, weights->View(name));
    return TensorView(v);
  };
  ref_engine::EngineModelOptions mo;
  mo.weights = mode.mode;
  mo.prepare_threads = mode.threads;
  ASSIGN_OR_RETURN(ref_engine::EngineModel model, ref_engine::EngineModel::Create(config, rank, lookup, {}, mo));
  t0 = absl::Now();
  RETURN_IF_ERROR(model.Prepare());
  out->prepare1_s = absl::ToDoubleSeconds(absl::Now() - t0);
  out->alloc1_mib = static_cast<double>(model.last_prepare().bytes_allocated) / (1 << 20);
  out->in_place_mib = static_cast<double>(model.last_prepare().bytes_in_place) / (1 << 20);
  out->checked_mib = static_cast<double>(model.last_prepare().bytes_checked) / (1 << 20);
  t0 = absl::Now();
  RETURN_IF_ERROR(model.Prepare());
  out->prepare2_s = absl::ToDoubleSeconds(absl::Now() - t0);
  out->alloc2_mib = static_cast<double>(model.last_prepare().bytes_allocated) / (1 << 20);
  out->threads = model.last_prepare().threads;
  std::vector<int32_t> prompt;
  for (int i = 0; i < f.prompt; ++i) prompt.push_back(static_cast<int32_t>((i * 7919 + 17) % config.vocab_size));
  t0 = absl::Now();
  ASSIGN_OR_RETURN(std::vector<int32_t> tokens, model.Generate(prompt, f.new_tokens));
  out->generate_s = absl::ToDoubleSeconds(absl::Now() - t0);
  out->peak_after_load_mib = StatusKib("VmHWM:") / 1024;
  return absl::OkStatus();
}

// Runs one mode in a child process (so that each has its own peak RSS) and returns its result.
Result RunChild(const Flags& f, const std::string& dir, const Mode& mode) {
  Result r;
  int fds[2];
  if (pipe(fds) != 0) {
    std::snprintf(r.error, sizeof(r.error), "pipe: %s", std::strerror(errno));
    return r;
  }
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    Result mine;
    const absl::Status s = RunMode(f, dir, mode, &mine);
    mine.ok = s.ok();
    if (!s.ok()) std::snprintf(mine.error, sizeof(mine.error), "%s", s.ToString().c_str());
    const ssize_t n = write(fds[1], &mine, sizeof(mine));
    _exit(n == static_cast<ssize_t>(sizeof(mine)) ? 0 : 1);
  }
  close(fds[1]);
  const ssize_t n = pid > 0 ? read(fds[0], &r, sizeof(r)) : -1;
  close(fds[0]);
  if (pid > 0) waitpid(pid, nullptr, 0);
  if (n != static_cast<ssize_t>(sizeof(r))) {
    r = Result();
    std::snprintf(r.error, sizeof(r.error), "the %s child died", mode.name);
  }
  return r;
}

int Run(const Flags& f) {
  auto model_dir = tools::EnsureBenchModel(f.checkpoint, f.work, f.preset);
  if (!model_dir.ok()) {
    std::fprintf(stderr, "wsync-bench-engine: %s\n", model_dir.status().ToString().c_str());
    return model_dir.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  const std::string dir = *model_dir;
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int n = f.threads > 0 ? f.threads : all;
  std::vector<Mode> modes;
  if (!f.only_in_place) modes.push_back({"f32-copy", ref_engine::WeightMode::kFloat32Copy, 1});
  if (!f.only_in_place || n == 1) modes.push_back({"in-place", ref_engine::WeightMode::kInPlace, 1});
  if (n > 1) modes.push_back({"in-place", ref_engine::WeightMode::kInPlace, n});
  std::vector<Result> results;
  for (const Mode& m : modes) results.push_back(RunChild(f, dir, m));
  std::printf("# wsync-bench-engine: %s, TP 1, %s, prompt %d + %d new tokens, %d cores\n", dir.c_str(),
              f.quant_config == "none"
                  ? "bf16"
                  : (f.quant_config.empty() ? "INT4 experts G=128 (bench-sync.sh)" : f.quant_config.c_str()),
              f.prompt, f.new_tokens, all);
  std::printf("#%11s %7s %7s %10s %10s %9s %9s %9s %9s %8s %9s %9s %9s\n", "mode", "threads", "load", "prepare1",
              "prepare2", "checked", "alloc1", "alloc2", "in_place", "shm", "rss_load", "peak", "generate");
  std::printf("#%11s %7s %7s %10s %10s %9s %9s %9s %9s %8s %9s %9s %9s\n", "", "", "(s)", "(s)", "(s)", "(MiB)",
              "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(s)");
  int rc = 0;
  for (size_t i = 0; i < modes.size(); ++i) {
    const Result& r = results[i];
    if (!r.ok) {
      std::printf(" %11s %7d  failed: %s\n", modes[i].name, modes[i].threads, r.error);
      rc = 1;
      continue;
    }
    std::printf(" %11s %7d %7.2f %10.4f %10.4f %9.1f %9.1f %9.1f %9.1f %8.1f %9.1f %9.1f %9.3f\n", modes[i].name,
                r.threads, r.load_s, r.prepare1_s, r.prepare2_s, r.checked_mib, r.alloc1_mib, r.alloc2_mib,
                r.in_place_mib, r.shm_mib, r.rss_after_load_mib, r.peak_after_load_mib, r.generate_s);
  }
  if (rc == 0 && !f.only_in_place) {
    const Result& before = results[0];
    const Result& after = results.back();
    std::printf(
        "# prepare (first / later) in-place %d thread(s) vs f32-copy: %.4f / %.4f of the time (%.1fx / %.1fx faster)\n",
        after.threads, after.prepare1_s / before.prepare1_s, after.prepare2_s / before.prepare2_s,
        before.prepare1_s / after.prepare1_s, before.prepare2_s / after.prepare2_s);
    std::printf("# peak RSS after the load: %.1f MiB vs %.1f MiB (%.2fx); generate: %.2fx the f32-copy time\n",
                after.peak_after_load_mib, before.peak_after_load_mib,
                after.peak_after_load_mib / before.peak_after_load_mib, after.generate_s / before.generate_s);
  }
  return rc;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  wsync::Flags f;
  CLI::App app{"wsync-bench-engine: the reference engine's Prepare (Continue) per weight mode"};
  app.add_option("--checkpoint", f.checkpoint, "HF checkpoint directory (config.json + *.safetensors)");
  app.add_option("--work", f.work, "without --checkpoint: DIR/hf holds (or gets) the preset's model");
  app.add_option("--preset", f.preset, "wsync-model-gen preset for --work (tiny, small, bench2g)");
  app.add_option("--quant-config", f.quant_config, "compressed-tensors JSON object, or none (default: bench-sync's)");
  app.add_option("--threads", f.threads, "in-place Prepare threads for the last row (0: all cores)");
  app.add_option("--load-threads", f.load_threads, "checkpoint load / quantize threads (0: all cores)");
  app.add_option("--prompt", f.prompt, "prompt tokens for the Generate column")->check(CLI::Range(1, 4096));
  app.add_option("--new-tokens", f.new_tokens, "new tokens for the Generate column")->check(CLI::Range(0, 4096));
  app.add_flag("--only-in-place", f.only_in_place, "skip the f32-copy row (and the 1-thread row if --threads > 1)");
  CLI11_PARSE(app, argc, argv);
  return wsync::Run(f);
}
