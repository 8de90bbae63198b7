// wsync-bench-repack: the rollout agent's commit (staging -> engine memory: transposes, GPTQ ->
// Marlin, scale permutations, plain copies) into host memory and into CUDA device memory, on one
// TP-1 engine rank of a real-sized model, next to the copy of the same bytes in the same run.
//
//   wsync-bench-repack (--checkpoint DIR | --work DIR [--preset bench2g]) [--quant-config FILE|none]
//                      [--threads N] [-n 5] [--device 0]
//
// The staging is what a sync of the checkpoint would have received (LoadCheckpoint into host
// engine memory, then Restore). Rows (time = best of n; GB/s = staging bytes / time):
//   memcpy        memcpy of the staging bytes, host to host (the host baseline)
//   commit-host   Commit into host engine memory (--threads threads; what a shm engine gets)
//   h2d-copy      cudaMemcpy of the staging bytes from (pageable) host memory to the device (the
//                 device baseline: the bytes must cross PCIe / C2C once)
//   commit-cuda   Commit into an engine arena in device memory (ParamArena::CreateOnDevice): the
//                 host transposes, the upload and the CUDA repack straight into it
//   checksum-cuda EngineWeights::Checksums of the device arena (what `wsyncctl verify` costs)
//   h2d-pinned, commit-cuda (pinned)   the same with the source page-locked, as the rollout agent
//                 pins a CUDA engine's staging (Staging::PinForDevice)
//   d2d-copy, commit-cuda (device staging)   a device-to-device copy of the staging bytes, and the
//                 commit from a staging in device memory (--staging device: the transposes and the
//                 CUDA repack on the device, nothing crosses the link)
// and `same` says whether the device arena's bytes equal the host engine memory's (every param's
// XXH3-64). Without a CUDA device the device rows say so and are skipped.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "engine_memory/param_arena.h"
#include "engine_model/engine_layout.h"
#include "engine_model/loader.h"
#include "engine_model/repack.h"
#include "engine_side/checkpoint.h"
#include "kernels/dispatch.h"
#include "tools/synth/synthetic_model.h"

namespace wsync {
namespace {

struct Flags {
  std::string checkpoint, work, preset = "bench2g", quant_config;
  int threads = 0, repeats = 5, device = 0;
};

template <typename F>
absl::StatusOr<double> Best(int n, F&& f) {
  double best = 1e30;
  for (int i = 0; i < n; ++i) {
    const absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(f());
    best = std::min(best, absl::ToDoubleSeconds(absl::Now() - t0));
  }
  return best;
}

void Row(const char* name, double seconds, uint64_t bytes, double baseline, const std::string& note = "") {
  std::printf(" %-14s %10.2f %9.2f %8.3f  %s\n", name, seconds * 1e3, static_cast<double>(bytes) / seconds / 1e9,
              baseline > 0 ? baseline / seconds : 0.0, note.c_str());
}

absl::Status Run(const Flags& f) {
  ASSIGN_OR_RETURN(const std::string dir, tools::EnsureBenchModel(f.checkpoint, f.work, f.preset));
  ASSIGN_OR_RETURN(ModelConfig config, tools::BenchModelConfig(dir, f.quant_config));
  ASSIGN_OR_RETURN(engine_model::EngineLayout layout,
                   engine_model::EngineLayout::Create(config, config.quantization ? &*config.quantization : nullptr,
                                                      engine_model::EngineParallel{}));
  // The staging a sync of this checkpoint fills: load into host engine memory, restore from it.
  ASSIGN_OR_RETURN(auto host, engine_model::OwnedEngineWeights::Allocate(layout));
  engine_side::CheckpointOptions co;
  co.num_threads = f.threads;
  RETURN_IF_ERROR(engine_side::LoadCheckpoint(dir, layout, host->weights(), co).status());
  ASSIGN_OR_RETURN(auto staging, engine_model::Staging::Create(layout));
  RETURN_IF_ERROR(engine_model::Restore(host->weights(), *staging, {.num_threads = f.threads}));
  uint64_t bytes = 0;
  for (size_t i = 0; i < layout.params().size(); ++i) bytes += staging->param(static_cast<int>(i)).nbytes();
  ASSIGN_OR_RETURN(Buffer flat_src, Buffer::Allocate(bytes));
  ASSIGN_OR_RETURN(Buffer flat_dst, Buffer::Allocate(bytes));
  {
    uint64_t off = 0;
    for (size_t i = 0; i < layout.params().size(); ++i) {
      const TensorView v = staging->param(static_cast<int>(i));
      std::memcpy(flat_src.data() + off, v.data(), v.nbytes());
      off += v.nbytes();
    }
    std::memset(flat_dst.data(), 0, bytes);
  }

  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::printf(
      "# wsync-bench-repack: %s, TP 1, %s, %zu params, %.1f MiB staged, best of %d, %d cores, repack threads %d\n",
      dir.c_str(), config.quantization ? "INT4" : "bf16", layout.params().size(),
      static_cast<double>(bytes) / (1 << 20), f.repeats, cores, f.threads > 0 ? f.threads : cores);
  std::printf("# %-13s %10s %9s %8s  %s\n", "row", "ms", "GB/s", "x base", "note");
  const int n = std::max(1, f.repeats);
  ASSIGN_OR_RETURN(double memcpy_s, Best(n, [&] {
                     std::memcpy(flat_dst.data(), flat_src.data(), bytes);
                     return absl::OkStatus();
                   }));
  Row("memcpy", memcpy_s, bytes, memcpy_s);
  ASSIGN_OR_RETURN(double host_s, Best(n, [&] {
                     return engine_model::Commit(*staging, host->weights(), {.num_threads = f.threads});
                   }));
  Row("commit-host", host_s, bytes, memcpy_s);
  ASSIGN_OR_RETURN(const std::vector<uint64_t> want, host->weights().Checksums());

  if (!kernels::GpuAvailable()) {
    std::printf("# no CUDA device: the device rows (h2d-copy, commit-cuda, checksum-cuda) are skipped\n");
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(auto flat_dev, AllocateCuda(bytes, f.device));
  ASSIGN_OR_RETURN(double h2d_s,
                   Best(n, [&] { return CopyHostToDevice(flat_dev->data(), flat_src.data(), bytes, f.device); }));
  Row("h2d-copy", h2d_s, bytes, h2d_s, "pageable host memory");
  flat_dev.reset();
  ASSIGN_OR_RETURN(auto arena, engine_memory::ParamArena::CreateOnDevice(layout, f.device));
  ASSIGN_OR_RETURN(double dev_s, Best(n, [&] {
                     return engine_model::Commit(*staging, arena->weights(), {.num_threads = f.threads});
                   }));
  std::vector<uint64_t> got;
  ASSIGN_OR_RETURN(double sum_s, Best(n, [&]() -> absl::Status {
                     ASSIGN_OR_RETURN(got, arena->weights().Checksums());
                     return absl::OkStatus();
                   }));
  bool same = got == want;
  Row("commit-cuda", dev_s, bytes, h2d_s, same ? "same bytes as commit-host" : "DIFFERS from commit-host");
  Row("checksum-cuda", sum_s, bytes, h2d_s, "device -> host, XXH3-64");
  // Page-locked: the staging pinned as the rollout agent pins it for CUDA engines.
  ASSIGN_OR_RETURN(auto pin_src, PinHostMemory(flat_src.data(), bytes));
  ASSIGN_OR_RETURN(flat_dev, AllocateCuda(bytes, f.device));
  ASSIGN_OR_RETURN(double h2d_pinned_s,
                   Best(n, [&] { return CopyHostToDevice(flat_dev->data(), flat_src.data(), bytes, f.device); }));
  flat_dev.reset();
  Row("h2d-pinned", h2d_pinned_s, bytes, h2d_pinned_s, "page-locked host memory");
  RETURN_IF_ERROR(staging->PinForDevice());
  ASSIGN_OR_RETURN(auto arena2, engine_memory::ParamArena::CreateOnDevice(layout, f.device));
  ASSIGN_OR_RETURN(double pinned_s, Best(n, [&] {
                     return engine_model::Commit(*staging, arena2->weights(), {.num_threads = f.threads});
                   }));
  ASSIGN_OR_RETURN(got, arena2->weights().Checksums());
  same = same && got == want;
  Row("commit-cuda", pinned_s, bytes, h2d_pinned_s,
      got == want ? "pinned staging; same bytes as commit-host" : "pinned staging; DIFFERS from commit-host");
  // A device staging, holding what a sync leaves there (Restore from the device arena: the same
  // bytes as the host staging, or the commit below differs).
  arena.reset();
  const MemorySpace gpu = MemorySpace::Cuda(f.device);
  {
    ASSIGN_OR_RETURN(Buffer a, gpu.Allocate(bytes));
    ASSIGN_OR_RETURN(Buffer b, gpu.Allocate(bytes));
    ASSIGN_OR_RETURN(double d2d_s, Best(n, [&] {
                       RETURN_IF_ERROR(gpu.Copy(b.data(), a.data(), bytes));
                       return gpu.Synchronize();
                     }));
    Row("d2d-copy", d2d_s, bytes, d2d_s, "device memory");
    a = Buffer();
    b = Buffer();
    ASSIGN_OR_RETURN(auto dev_staging, engine_model::Staging::Create(layout, gpu));
    RETURN_IF_ERROR(engine_model::Restore(arena2->weights(), *dev_staging, {.num_threads = f.threads}));
    ASSIGN_OR_RETURN(auto arena3, engine_memory::ParamArena::CreateOnDevice(layout, f.device));
    ASSIGN_OR_RETURN(double staged_s, Best(n, [&] {
                       return engine_model::Commit(*dev_staging, arena3->weights(), {.num_threads = f.threads});
                     }));
    ASSIGN_OR_RETURN(got, arena3->weights().Checksums());
    same = same && got == want;
    Row("commit-cuda", staged_s, bytes, d2d_s,
        got == want ? "device staging; same bytes as commit-host" : "device staging; DIFFERS from commit-host");
  }
  if (!same) return absl::InternalError("the device commit differs from the host commit");
  return absl::OkStatus();
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  wsync::Flags f;
  CLI::App app{"wsync-bench-repack: the rollout commit into host and into CUDA device memory"};
  app.add_option("--checkpoint", f.checkpoint, "HF checkpoint directory (config.json + *.safetensors)");
  app.add_option("--work", f.work, "without --checkpoint: DIR/hf holds (or gets) the preset's model");
  app.add_option("--preset", f.preset, "wsync-model-gen preset for --work (tiny, small, bench2g)");
  app.add_option("--quant-config", f.quant_config, "compressed-tensors JSON object, or none (default: bench-sync's)");
  app.add_option("--threads", f.threads, "repack / load threads (0: all cores)");
  app.add_option("-n", f.repeats, "repeats per row (the best is shown)")->check(CLI::Range(1, 1000));
  app.add_option("--device", f.device, "CUDA device of the device rows")->check(CLI::Range(0, 1023));
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = wsync::Run(f);
  if (!s.ok()) {
    std::fprintf(stderr, "wsync-bench-repack: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
