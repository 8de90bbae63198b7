// wsync-bench-trainer: the trainer side of a sync (RunRankSync) per phase, on the ~2 GB bench2g
// Qwen3-MoE sharded TP2 x EP2 (or any source directory), under mpirun.
//
//   mpirun -np 4 wsync-bench-trainer [--source DIR | --work DIR] [--tp 2 --ep 2 --etp 1]
//          [--bucket-mb 512] [--gather-mb 0] [--quant experts|none|all] [-n 3] [-w 1]
//          [--cuda-device N | --gpu-per-rank]
//
// --cuda-device N puts every rank's tensors in CUDA memory of device N first (CudaResidentSource)
// and so runs the device stages (sync/rank_sync.h): its table adds the staging copies. With
// gathers in the layout the ranks then share one GPU and gather on host copies; --gpu-per-rank
// puts rank r's tensors on its node-local rank's GPU (OMPI_COMM_WORLD_LOCAL_RANK), so the TP / EP
// gathers run on the GPUs over NCCL (one GPU per rank of the node).
//
// Without --source, rank 0 generates the model (seed 1) and writes its Megatron source into --work
// (reused when it already holds one of the same layout; --regen forces a new one).
// Two sinks stand in for the data plane: `discard` hands every bucket straight back (the pipeline
// alone), `memcpy` copies it into a reused buffer first (what a local receiver at least costs).
// Per phase the table prints the stage source's mean seconds per sync and GB/s over that phase's
// bytes: open = this rank's shard file; gather = all-gather output; convert = HF bytes out of
// MergeShards / ToHf; quantize = bf16 bytes through the source's INT4 kernels (EP members
// quantize their own experts: see the per-rank line); bucket = bytes copied into buckets; send =
// bucket bytes handed to the sink; total = HF bytes per sync. The gather row also shows the
// slowest rank. Sinks and the SyncWorkspace persist across the syncs (as in the agent;
// --fresh-buffers allocates the gather buffers every sync). Peak RSS per rank (getrusage; mapped shard pages count) at
// the end.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/communicator.h"
#include "common/config.h"
#include "common/status.h"
#include "tools/synth/sharder.h"
#include "tools/synth/synthetic_model.h"
#include "trainer_agent/source/cuda_resident_source.h"
#include "trainer_agent/source/dir_source.h"
#include "trainer_agent/sync/rank_sync.h"

namespace wsync {
namespace {

class DiscardSink : public comm::BucketSink {
 public:
  absl::Status Send(v1::BucketManifest, Buffer data, uint64_t) override {
    free_ = std::move(data);
    return absl::OkStatus();
  }
  Buffer Recycle(uint64_t) override { return std::move(free_); }
  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  Buffer free_;
};

class MemcpySink : public comm::BucketSink {
 public:
  absl::Status Send(v1::BucketManifest, Buffer data, uint64_t nbytes) override {
    if (dst_.size() < nbytes) {
      dst_ = Buffer();
      ASSIGN_OR_RETURN(dst_, Buffer::Allocate(nbytes));
    }
    std::memcpy(dst_.data(), data.data(), nbytes);
    free_ = std::move(data);
    return absl::OkStatus();
  }
  Buffer Recycle(uint64_t) override { return std::move(free_); }
  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  Buffer dst_, free_;
};

// Experts (and the dense MLPs of models that have them) in INT4; attention, routers, lm_head bf16.
constexpr const char kExpertsInt4[] = R"json({"quant_method": "compressed-tensors", "format": "pack-quantized",
  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
  "strategy": "group", "group_size": 128, "symmetric": true, "actorder": null, "dynamic": false}}},
  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"]})json";
constexpr const char kAllInt4[] = R"json({"quant_method": "compressed-tensors", "format": "pack-quantized",
  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
  "strategy": "group", "group_size": 128, "symmetric": true, "actorder": null, "dynamic": false}}},
  "ignore": []})json";

// The phase values of one report, as doubles, for gathering over the world.
struct Row {
  double open, gather, convert, quantize, bucket, send_wait, total;
  double open_bytes, gather_bytes, hf_bytes, quantized_bytes, bucket_bytes, sent_bytes, buckets;
  double source, rss_mb, peak_bucket;
  double staging;  // device stages: device-to-host copies of the buckets (inside send_wait)
};

std::vector<Row> GatherRows(comm::Communicator& world, const Row& mine) {
  std::vector<Row> all(static_cast<size_t>(world.size()));
  comm::ConstBytes in{&mine, sizeof(Row)};
  comm::MutableBytes out{all.data(), all.size() * sizeof(Row)};
  absl::Status s = comm::Await(world.AllGather({&in, 1}, {&out, 1}));
  if (!s.ok()) std::fprintf(stderr, "gathering results: %s\n", s.ToString().c_str());
  return all;
}

double PeakRssMb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

absl::StatusOr<std::string> Generate(const std::string& work, const std::string& arch_name, const std::string& preset,
                                     const trainer_agent::SourceParallel& want, bool regen) {
  const std::string dir = work + "/src";
  if (!regen && std::filesystem::exists(dir + "/parallel.json")) {
    auto existing = trainer_agent::DirSource::Open(dir);
    if (existing.ok() && existing->parallel().tp == want.tp && existing->parallel().ep == want.ep &&
        existing->parallel().etp == want.etp && existing->parallel().pp == want.pp &&
        existing->parallel().world_size == want.world_size) {
      std::printf("# reusing %s\n", dir.c_str());
      return dir;
    }
  }
  std::filesystem::remove_all(dir);
  ASSIGN_OR_RETURN(Architecture arch, tools::ParseArchitectureFlag(arch_name));
  ASSIGN_OR_RETURN(tools::SyntheticModelOptions o, tools::PresetOptions(preset, arch));
  const absl::Time t0 = absl::Now();
  ASSIGN_OR_RETURN(tools::SyntheticModel m, tools::GenerateSyntheticModel(o, /*seed=*/1));
  ASSIGN_OR_RETURN(trainer_agent::SourceParallel p, trainer_agent::ResolveSourceParallel(m.config, want));
  ASSIGN_OR_RETURN(tools::WriteSourceStats st, tools::WriteMegatronSource(m.config_json, m.config, m.weights, p, dir));
  std::printf("# generated %s %s (%.2f GB bf16) and wrote %d+%d rank files (%.2f GB) in %.1f s\n", arch_name.c_str(),
              preset.c_str(), static_cast<double>(m.weights.TotalBytes()) / 1e9, st.files_built, st.files_copied,
              static_cast<double>(st.bytes_written) / 1e9, absl::ToDoubleSeconds(absl::Now() - t0));
  return dir;
}

int Run(int argc, char** argv) {
  CLI::App app{"wsync-bench-trainer: RunRankSync per-phase throughput (run under mpirun)"};
  std::string source_dir, work = "/tmp/wsync-bench-trainer", arch = "qwen3-moe", preset = "bench2g", quant = "experts";
  std::string sinks = "discard,memcpy";
  trainer_agent::SourceParallel p;
  p.tp = 2, p.ep = 2, p.etp = 1;
  int iters = 3, warmup = 1, threads = 0;
  double bucket_mb = 512, gather_mb = 0;
  bool regen = false, fresh_buffers = false;
  app.add_option("--source", source_dir, "an existing Megatron source directory (skips generation)");
  app.add_option("--work", work, "where rank 0 writes the generated source")->capture_default_str();
  app.add_option("--arch", arch, "architecture to generate")->capture_default_str();
  app.add_option("--preset", preset, "model size preset (tiny, small, bench2g)")->capture_default_str();
  app.add_option("--tp", p.tp)->capture_default_str();
  app.add_option("--ep", p.ep)->capture_default_str();
  app.add_option("--etp", p.etp)->capture_default_str();
  app.add_option("--pp", p.pp)->capture_default_str();
  app.add_flag("--regen", regen, "generate a new source even if --work holds one");
  app.add_flag("--fresh-buffers", fresh_buffers, "no SyncWorkspace: gather buffers allocated every sync");
  app.add_option("--bucket-mb", bucket_mb, "bucket size (MiB)")->capture_default_str();
  app.add_option("--gather-mb", gather_mb, "all-gather output per call (MiB, 0 = bucket size)")->capture_default_str();
  app.add_option("--quant", quant, "experts | all | none")->capture_default_str();
  app.add_option("--threads", threads, "quantization threads (0 = all cores)")->capture_default_str();
  app.add_option("--sinks", sinks, "discard,memcpy")->capture_default_str();
  int cuda_device = -1;
  bool gpu_per_rank = false;
  app.add_option("--cuda-device", cuda_device,
                 "every rank's tensors resident on this CUDA device: the device stages (the sinks get the buckets "
                 "through a SpaceStagingSink)");
  app.add_flag("--gpu-per-rank", gpu_per_rank,
               "rank r's tensors on the GPU of its node-local rank: the device stages with the gathers on the GPUs");
  app.add_option("-n,--iters", iters)->capture_default_str();
  app.add_option("-w,--warmup", warmup)->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto w = comm::CreateMpiWorld();
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
    return 1;
  }
  comm::Communicator& world = **w;
  const int me = world.rank();
  if (me != 0) std::fclose(stdout);  // rank 0 prints

  // Rank 0 generates; everyone learns the outcome.
  char dirbuf[4096] = {};
  int32_t code = 0;
  if (source_dir.empty()) {
    if (me == 0) {
      trainer_agent::SourceParallel want = p;
      want.world_size = world.size();
      want.dp = world.size() / (p.tp * p.pp * p.cp);
      absl::StatusOr<std::string> d = Generate(work, arch, preset, want, regen);
      code = static_cast<int32_t>(d.status().code());
      std::snprintf(dirbuf, sizeof(dirbuf), "%s", d.ok() ? d->c_str() : std::string(d.status().message()).c_str());
    }
    comm::MutableBytes b[2] = {{&code, sizeof(code)}, {dirbuf, sizeof(dirbuf)}};
    if (absl::Status s = comm::Await(world.Broadcast(b, 0, comm::CollectiveOptions{absl::Minutes(30)})); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    if (code != 0) {
      std::fprintf(stderr, "generating the model: %s\n", dirbuf);
      return 1;
    }
    source_dir = dirbuf;
  }
  auto dir_src = trainer_agent::DirSource::Open(source_dir);
  if (!dir_src.ok()) {
    std::fprintf(stderr, "%s\n", dir_src.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<trainer_agent::CudaResidentSource> resident;
  if (gpu_per_rank) {
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    cuda_device = local != nullptr ? std::atoi(local) : me;
  }
  if (cuda_device >= 0) {
    auto r = trainer_agent::CudaResidentSource::Create(*dir_src, {me}, cuda_device);
    if (!r.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", me, r.status().ToString().c_str());
      return 1;
    }
    resident = std::move(*r);
  }
  const trainer_agent::WeightSource& source =
      resident ? static_cast<const trainer_agent::WeightSource&>(*resident) : *dir_src;
  auto* src = &*dir_src;
  auto comms = trainer_agent::MakeTrainerComms(world, src->layout());
  if (!comms.ok()) {
    std::fprintf(stderr, "%s\n", comms.status().ToString().c_str());
    return 1;
  }
  std::optional<QuantizationConfig> q;
  if (quant != "none") {
    auto parsed = ParseQuantizationConfig(quant == "all" ? kAllInt4 : kExpertsInt4, "bench quantization config");
    if (!parsed.ok()) {
      std::fprintf(stderr, "%s\n", parsed.status().ToString().c_str());
      return 1;
    }
    q = std::move(*parsed);
  }
  uint64_t shard_bytes = 0;
  {
    std::error_code ec;
    shard_bytes = std::filesystem::file_size(src->RankPath(me), ec);
  }
  std::printf("# wsync-bench-trainer: %s, %s, world %d, bucket %.4g MiB, gather %.4g MiB, quant %s, stages on %s\n",
              src->model().architecture.c_str(), src->layout().DebugString().c_str(), world.size(), bucket_mb,
              gather_mb > 0 ? gather_mb : bucket_mb, quant.c_str(),
              cuda_device >= 0 ? absl::StrCat("cuda:", cuda_device).c_str() : "the host");
  std::fflush(stdout);

  for (const std::string& sink_name : {std::string("discard"), std::string("memcpy")}) {
    if (sinks.find(sink_name) == std::string::npos) continue;
    Row sum{};
    int counted = 0;
    // Persistent across syncs, as in the agent (its BucketSender keeps its free buffers).
    DiscardSink discard;
    MemcpySink copy;
    trainer_agent::SyncWorkspace workspace;
    for (int it = 0; it < warmup + iters; ++it) {
      comm::BucketSink* sink = nullptr;
      if (src->layout().IsStageSource(me))
        sink = sink_name == "discard" ? static_cast<comm::BucketSink*>(&discard) : &copy;
      trainer_agent::SyncOptions o;
      o.version = static_cast<uint64_t>(it + 1);
      o.bucket_bytes = static_cast<uint64_t>(bucket_mb * (1 << 20));
      o.gather_bytes = static_cast<uint64_t>(gather_mb * (1 << 20));
      o.quant = q ? &*q : nullptr;
      o.quant_threads = threads;
      o.collective.timeout = absl::Minutes(10);
      o.workspace = fresh_buffers ? nullptr : &workspace;
      if (!comm::Await(world.Barrier()).ok()) return 1;
      auto r = trainer_agent::RunRankSync(source, *comms, sink, o);
      if (!r.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", me, r.status().ToString().c_str());
        return 1;
      }
      if (it < warmup) continue;
      auto s = [](absl::Duration d) { return absl::ToDoubleSeconds(d); };
      Row row{s(r->open),
              s(r->gather),
              s(r->convert),
              s(r->quantize),
              s(r->bucket),
              s(r->send_wait),
              s(r->total),
              static_cast<double>(shard_bytes),
              static_cast<double>(r->gather_bytes),
              static_cast<double>(r->hf_bytes),
              static_cast<double>(r->quantized_bytes),
              static_cast<double>(r->copied_bytes),
              static_cast<double>(r->bytes),
              static_cast<double>(r->buckets),
              r->source ? 1.0 : 0.0,
              0,
              static_cast<double>(r->peak_bucket_bytes),
              s(r->staging)};
      double* a = reinterpret_cast<double*>(&sum);
      const double* b = reinterpret_cast<const double*>(&row);
      for (size_t k = 0; k < sizeof(Row) / sizeof(double); ++k) a[k] += b[k];
      ++counted;
    }
    double* a = reinterpret_cast<double*>(&sum);
    for (size_t k = 0; k < sizeof(Row) / sizeof(double); ++k) a[k] /= std::max(counted, 1);
    sum.rss_mb = PeakRssMb();
    const std::vector<Row> rows = GatherRows(world, sum);
    if (me != 0) continue;
    const Row& src_row = rows[0];  // rank 0 is stage 0's source
    double slowest_gather = 0, all_quantized = 0;
    for (const Row& r : rows) slowest_gather = std::max(slowest_gather, r.gather), all_quantized += r.quantized_bytes;
    std::printf("\n# sink %s: mean of %d syncs (after %d warm-up) on the stage source (rank 0)\n", sink_name.c_str(),
                counted, warmup);
    std::printf("#  %-10s %10s %10s %10s %8s\n", "phase", "time(s)", "bytes(GB)", "GB/s", "%total");
    auto line = [&](const char* name, double t, double bytes) {
      std::printf("   %-10s %10.3f %10.3f %10.2f %7.1f%%\n", name, t, bytes / 1e9, t > 0 ? bytes / 1e9 / t : 0.0,
                  src_row.total > 0 ? 100.0 * t / src_row.total : 0.0);
    };
    line("open", src_row.open, src_row.open_bytes);
    line("gather", src_row.gather, src_row.gather_bytes);
    line("convert", src_row.convert, src_row.hf_bytes);
    line("quantize", src_row.quantize, src_row.quantized_bytes);
    line("bucket", src_row.bucket, src_row.bucket_bytes);
    line("send_wait", src_row.send_wait, src_row.sent_bytes);
    if (cuda_device >= 0) line(" (staging)", src_row.staging, src_row.sent_bytes);
    const double accounted =
        src_row.open + src_row.gather + src_row.convert + src_row.quantize + src_row.bucket + src_row.send_wait;
    line("other", std::max(0.0, src_row.total - accounted), 0);
    line("total", src_row.total, src_row.hf_bytes);
    std::printf("#  buckets %.0f, sent %.3f GB (peak bucket %.1f MiB); slowest rank's gather %.3f s\n", src_row.buckets,
                src_row.sent_bytes / 1e9, src_row.peak_bucket / (1 << 20), slowest_gather);
    std::printf("#  per rank (s) gather / convert / quantize / total:");
    for (size_t r = 0; r < rows.size(); ++r)
      std::printf(" %zu: %.3f/%.3f/%.3f/%.3f", r, rows[r].gather, rows[r].convert, rows[r].quantize, rows[r].total);
    std::printf("\n#  quantized on all ranks %.3f GB (the source %.3f GB)\n", all_quantized / 1e9,
                src_row.quantized_bytes / 1e9);
    std::printf("#  peak RSS (MB) per rank:");
    for (size_t r = 0; r < rows.size(); ++r) std::printf(" %zu:%.0f", r, rows[r].rss_mb);
    std::printf("\n");
    std::fflush(stdout);
  }
  comms->tp.reset(), comms->etp.reset(), comms->ep.reset();
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) { return wsync::Run(argc, argv); }
