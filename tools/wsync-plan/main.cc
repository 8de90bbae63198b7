// wsync-plan: the delivery plan of a sync and its projected time on a cluster described on the
// command line, for both delivery modes (docs/sync.md "Planning a cluster").
//
//   wsync-plan --config FILE|kimi-k2|default [--quant-config FILE|int4-experts|fp8-block|none|model]
//              --trainer-gpus W --trainer-tp T --trainer-pp P --trainer-ep E [--trainer-etp TP]
//              --engines N --engine-tp T --engine-ep E
//              [--nic-gbps 400] [--nvlink-gbps N] [--bucket-mib 512] [--rates h200|h200-device|local|FILE]
//              [--cores C] [--changed-fraction F] [--json]
//
// The bytes come from the plan itself: the sent tensors (every HF tensor an engine of TP 1 loads,
// INT4 triplets and FP8 pairs included), the stage of each (layers split evenly over the pipeline stages), the
// trainer ranks that send it (broadcast: the stage source; sharded: StageSenders, dense tensors
// owned greedily by bytes over the source's TP group, experts by the EP rank holding them) and
// the block every receiver group keeps (plan::ShardPlan, the agents' own layouts). The times come
// from per-phase rates (GB/s): quantize (bf16 in), stage (device buckets to the host), cut (the
// sharded copy), load (receiver, bucket to staging), commit (staging to the engine, repack
// included), the NIC and NVLink (--nvlink-gbps: default the profile's). The built-in profiles are
// figures of this build measured where a result file has them (h200: one H200 host,
// docs/results/h200/2026-11-28-8a0d3c4, docs/gpu.md; local: this 2-core VM, docs/sync.md) and stated
// assumptions elsewhere (NVLink 450 GB/s; h200-device's receive, cut and load in device memory,
// 1000 GB/s). A GPU's time is the longest of its link (in
// and out are full duplex) and its own work, the pipeline adds one bucket per chain hop, and the
// commit follows the transfer. With --cores C every process shares C cores (a single host): the
// projection is then at least all the CPU work divided by C.
// --changed-fraction F adds a delta sync (broadcast delivery, docs/sync.md "Delta sync"): F of every
// sent tensor's items changed far apart, each tensor sent as kernels::ScatteredDeltaBytes of it (the
// index list, or dense when smaller); the trainer still gathers and quantizes everything, the
// receivers apply the deltas to what they keep (at the load rate) and repack it all (the commit).
//
// The physical limit is the largest number of bytes any one GPU must receive or send (an engine
// rank's own share; a trainer GPU's share of the unique bytes) over its NIC rate. Exit codes: 0,
// 1 refused (the message says why), 2 bad command line.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/default_model.h"
#include "common/status.h"
#include "common/tensor.h"
#include "engine_model/engine_layout.h"
#include "kernels/delta.h"
#include "nlohmann/json.hpp"
#include "plan/delivery_plan.h"
#include "presets.h"
#include "trainer_agent/layout/parallel_layout.h"
#include "trainer_agent/sync/rank_sync.h"

namespace wsync::tools {
namespace {

using json = nlohmann::json;
using engine_model::EngineLayout;
using engine_model::EngineParallel;
using engine_model::HfSource;

constexpr double kGB = 1e9;

struct Rates {  // GB/s
  double quantize = 0, stage = 0, cut = 0, load = 0, commit = 0, nvlink = 0;
  // Single host only (--cores): CPU cost of moving one byte between two processes (send + receive),
  // and of building a bucket (copies), as GB per core-second. 0: not CPU-bound (GPU cluster).
  double hop = 0, build = 0;
  std::string source;
};

absl::StatusOr<Rates> LoadRates(const std::string& name) {
  Rates r;
  if (name == "h200" || name == "h200-device") {
    // Measured on one H200 host (16 cores), files in docs/results/h200/2026-11-28-8a0d3c4/:
    //   quantize 145.07  the CUDA INT4 kernel in the trainer's device stages (bench_trainer_device.log)
    //   stage     55.22  device buckets staged to pinned host memory (bench_trainer_device.log)
    //   cut       11.67  a host copy: one memcpy stream (bench_repack.log)
    //   load       8.03  the agent's load, sharded: 381482864 bytes in 0.0475 s, INT4 transposes
    //                    included (bench_sync.log)
    //   commit    50.21  pinned host staging into device engine memory, upload-bound (bench_repack.log)
    // Assumed, not measured: NVLink 450 GB/s per GPU and direction (needs two GPUs).
    // h200-device: buckets received into device memory, cut and loaded there into a device staging
    // (--staging device): stage, cut and load 1000 GB/s are assumed (HBM copies; the NCCL receive
    // has not run); commit 835.60 GB/s is measured (device staging, bench2g, bench_repack.log).
    r = {145.07, 55.22, 11.67, 8.03, 50.21, 450, 0, 0, ""};
    r.source = "measured on an H200 host (docs/results/h200/2026-11-28-8a0d3c4); NVLink 450 GB/s assumed";
    if (name == "h200-device") {
      r.stage = 1000, r.cut = 1000, r.load = 1000, r.commit = 835.60;
      r.source =
          "H200 rates with receive, cut and load in device memory at 1000 GB/s (assumed) and the "
          "device-staging commit (measured); NVLink 450 GB/s assumed";
    }
    return r;
  }
  if (name == "local") {
    // This 2-core VM, bench2g broadcast runs of tools/bench-sync.sh (docs/sync.md): the INT4 CPU
    // kernel ~3.2 GB/s per rank, the agents' load 1.35-2.3 GB/s, commit (transpose + repack) ~4 GB/s;
    // a loopback gloo hop ~3.9 GB per core-s (send + receive), bucket building ~5 GB per core-s.
    r = {3.2, 0, 5, 1.8, 4, 0, 3.9, 5, "this 2-core VM (bench2g broadcast runs, docs/sync.md)"};
    return r;
  }
  auto text = ReadTextFile(name);
  if (!text.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("--rates: not a profile (h200, h200-device, local) and ", text.status().message()));
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(name, ": not a JSON object"));
  for (auto [key, field] : std::vector<std::pair<const char*, double*>>{{"quantize", &r.quantize},
                                                                        {"stage", &r.stage},
                                                                        {"cut", &r.cut},
                                                                        {"load", &r.load},
                                                                        {"commit", &r.commit},
                                                                        {"nvlink", &r.nvlink},
                                                                        {"hop", &r.hop},
                                                                        {"build", &r.build}}) {
    if (j.contains(key)) {
      if (!j[key].is_number() || j[key].get<double>() < 0)
        return absl::InvalidArgumentError(absl::StrCat(name, ": \"", key, "\" must be a number >= 0 (GB/s)"));
      *field = j[key].get<double>();
    }
  }
  r.source = name;
  return r;
}

// One sent HF tensor.
struct Sent {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t bytes = 0;
  int stage = 0;
  int64_t expert = -1;     // global routed expert id, -1 for dense
  uint64_t quantized = 0;  // bf16 bytes the INT4 kernel reads for it (weight_packed only)
};

int64_t Field(absl::string_view name, absl::string_view key) {  // "model.layers.12." -> 12
  const size_t at = name.find(key);
  if (at == absl::string_view::npos) return -1;
  absl::string_view rest = name.substr(at + key.size());
  int64_t v = 0;
  return absl::SimpleAtoi(rest.substr(0, rest.find('.')), &v) ? v : -1;
}

struct Load {  // one GPU's bytes and work
  uint64_t in = 0, out = 0, built = 0, cut = 0, quantized = 0, kept = 0, nvlink = 0;
};

struct Projection {
  std::string mode;
  std::map<std::string, Load> gpus;  // "trainer R" / "engine E rank R"
  double seconds = 0, limit = 0, link = 0, work = 0, cpu = 0, commit = 0, fill = 0;
  std::string busiest;
};

struct Setup {
  ModelConfig config;
  const QuantizationConfig* quant = nullptr;
  trainer_agent::ParallelLayout trainer;
  int engines = 1;
  EngineParallel engine;
  double nic = 50;  // GB/s per GPU
  uint64_t bucket = 512ull << 20;
  int cores = 0;
  Rates rates;
  double changed = -1;  // --changed-fraction (< 0: none)
};

// The bytes a delta sync sends for `t` (Setup::changed of its items changed far apart).
uint64_t DeltaBytes(const Sent& t, double changed) {
  const auto item = static_cast<uint32_t>(ItemSize(t.dtype));
  const uint64_t items = t.bytes / item;
  return kernels::ScatteredDeltaBytes(items, item, static_cast<uint64_t>(std::ceil(changed * items)));
}

absl::StatusOr<std::vector<Sent>> SentTensors(const Setup& s) {
  ASSIGN_OR_RETURN(EngineLayout whole, EngineLayout::Create(s.config, s.quant, {1, 0, 1}));
  const int64_t layers = s.config.num_hidden_layers;
  const int pp = s.trainer.pp();
  std::vector<Sent> out;
  for (const HfSource& src : whole.sources()) {
    if (src.action == HfSource::Action::kSkip) continue;  // a tied lm_head
    Sent t;
    t.name = src.hf_name;
    t.dtype = src.dtype;
    t.shape = src.shape;
    ASSIGN_OR_RETURN(const int64_t nb, NumBytes(src.dtype, src.shape));
    t.bytes = static_cast<uint64_t>(nb);
    const int64_t layer = Field(t.name, "model.layers.");
    if (layer >= 0) {
      t.stage = static_cast<int>(std::min<int64_t>(pp - 1, layer * pp / std::max<int64_t>(layers, 1)));
    } else {
      t.stage = absl::StrContains(t.name, "embed_tokens") ? 0 : pp - 1;
    }
    t.expert = Field(t.name, ".mlp.experts.");
    // [N, K/8] (compressed-tensors) or [K, N/8] (AWQ) int32 <- [N, K] bf16; FP8 [N, K] <- [N, K] bf16
    if (absl::EndsWith(t.name, ".weight_packed") || absl::EndsWith(t.name, ".qweight")) t.quantized = t.bytes * 4;
    if (t.dtype == DType::kF8E4M3) t.quantized = t.bytes * 2;
    out.push_back(std::move(t));
  }
  return out;
}

// `shard`: the plan over the engine's TP ranks (one receiver group per rank; replicas share it).
// `delta`: broadcast delivery of a delta sync (Setup::changed).
absl::StatusOr<Projection> Project(const Setup& s, const std::vector<Sent>& sent, const plan::ShardPlan& shard,
                                   bool sharded, bool delta = false) {
  Projection p;
  p.mode = sharded ? "sharded" : delta ? "delta" : "broadcast";
  const auto& L = s.trainer;
  const int ep = L.ep();
  const int64_t per_ep = ep > 0 && L.num_experts() > 0 ? L.num_experts() / ep : 1;
  auto trainer = [](int r) { return absl::StrFormat("trainer %05d", r); };
  const size_t groups = static_cast<size_t>(shard.num_groups());
  std::vector<uint64_t> group_in(groups, 0), keep(groups, 0);
  uint64_t wire = 0;  // the bytes on the wire (a delta's: DeltaBytes)
  std::vector<std::vector<uint64_t>> dense_load(static_cast<size_t>(L.pp()), std::vector<uint64_t>(L.tp(), 0));
  for (const Sent& t : sent) {
    const uint64_t out = delta ? DeltaBytes(t, s.changed) : t.bytes;
    wire += out;
    const int source = L.StageSourceRank(t.stage);
    // Who builds (and quantizes) it.
    int sender = source;
    if (t.expert >= 0 && ep > 1) {
      sender = L.EpGroup(source)[static_cast<size_t>(t.expert / per_ep)];  // quantized by its holder (both modes)
    }
    int builder = sender;
    if (sharded && t.expert < 0) {
      auto& load = dense_load[static_cast<size_t>(t.stage)];
      const int owner = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      load[static_cast<size_t>(owner)] += std::max<uint64_t>(t.quantized > 0 ? t.quantized : t.bytes, 1);
      builder = L.TpGroup(source)[static_cast<size_t>(owner)];
    }
    if (!sharded) builder = source;  // the source builds every bucket; holders only quantize experts
    // What each receiver group keeps of it (sharded: what it receives).
    const std::span<const int64_t> shape(t.shape.data(), t.shape.size());
    std::vector<uint64_t> block(groups, 0);
    for (size_t g = 0; g < groups; ++g) {
      ASSIGN_OR_RETURN(const std::optional<plan::Block> blk,
                       shard.BlockFor(static_cast<int>(g), t.name, t.dtype, shape));
      if (blk) block[g] = blk->nbytes;
      keep[g] += block[g];
    }
    Load& q = p.gpus[trainer(t.expert >= 0 ? sender : builder)];
    q.quantized += t.quantized;
    Load& b = p.gpus[trainer(builder)];
    b.built += t.bytes;
    if (t.expert < 0 && L.tp() > 1) b.nvlink += t.bytes * static_cast<uint64_t>(L.tp() - 1) / L.tp();
    if (!sharded) {
      b.out += out;
      if (t.expert >= 0 && ep > 1) {  // the EP all-gather brings every expert to the source's EP group
        for (int m : L.EpGroup(source)) {
          p.gpus[trainer(m)].in += t.bytes;
          if (m != sender) p.gpus[trainer(sender)].out += t.bytes;
        }
      }
      continue;
    }
    for (size_t g = 0; g < groups; ++g) {
      group_in[g] += block[g];
      b.out += block[g];
      b.cut += block[g];
    }
  }
  // Receivers: every group chains through its replicas (broadcast: one chain through all ranks).
  const int replicas = s.engines;
  for (int e = 0; e < replicas; ++e) {
    for (int r = 0; r < s.engine.tp_size; ++r) {
      Load& l = p.gpus[absl::StrFormat("engine %04d rank %02d", e, r)];
      l.in = sharded ? group_in[static_cast<size_t>(r)] : wire;
      const bool last = sharded ? e == replicas - 1 : (e == replicas - 1 && r == s.engine.tp_size - 1);
      l.out = last ? 0 : l.in;
      l.kept = keep[static_cast<size_t>(r)];  // broadcast receives more than that
    }
  }
  // Times.
  const Rates& R = s.rates;
  auto t = [](uint64_t bytes, double gbps) { return gbps > 0 ? static_cast<double>(bytes) / (gbps * kGB) : 0.0; };
  uint64_t limit_bytes = (wire + static_cast<uint64_t>(L.world_size()) - 1) / static_cast<uint64_t>(L.world_size());
  double cpu = 0;
  for (auto& [name, l] : p.gpus) {
    const double link = t(std::max(l.in, l.out), s.nic);
    const bool engine = absl::StartsWith(name, "engine");
    // A delta is applied to the kept block (read back, checked, written): load work on all of it.
    const double work =
        engine ? t(delta ? l.kept : l.in, R.load)
               : t(l.quantized, R.quantize) + t(l.built, R.stage) + t(l.cut, R.cut) + t(l.nvlink, R.nvlink);
    if (std::max(link, work) > std::max(p.link, p.work) || p.busiest.empty()) {
      p.busiest = absl::StrFormat("%s (in %.2f GB, out %.2f GB; %s)", name, l.in / kGB, l.out / kGB,
                                  link >= work ? "link-bound" : "work-bound");
    }
    p.link = std::max(p.link, link);
    p.work = std::max(p.work, work);
    p.commit = std::max(p.commit, engine ? t(l.kept, R.commit) : 0.0);
    if (engine) limit_bytes = std::max(limit_bytes, delta ? l.in : l.kept);
    // Single host: every byte moved costs both ends, every byte built and quantized costs a core.
    cpu += t(l.out, R.hop) + t(l.built, R.build) + t(l.quantized, R.quantize) + t(l.cut, R.cut) +
           (engine ? t(delta ? l.kept : l.in, R.load) + t(l.kept, R.commit) : 0.0);
  }
  // The first bucket crosses every hop of the longest chain before the last receiver has it.
  uint64_t biggest_out = 0;
  for (const auto& [name, l] : p.gpus)
    if (absl::StartsWith(name, "trainer")) biggest_out = std::max(biggest_out, l.built);
  const int chain = sharded ? replicas : replicas * s.engine.tp_size;
  p.fill = t(std::min(s.bucket, biggest_out), s.nic) * chain;
  p.seconds = std::max(p.link, p.work) + p.fill + p.commit;
  if (s.cores > 0) {
    p.cpu = cpu / s.cores;
    p.seconds = std::max(p.seconds, p.cpu);
  }
  p.limit = t(limit_bytes, s.nic);
  return p;
}

int Main(int argc, char** argv) {
  CLI::App app{"wsync-plan: a sync's delivery plan and its projected time on a cluster"};
  std::string config_arg = "default", quant_arg = "model", rates_arg = "h200";
  int world = 4, tp = 2, pp = 1, ep = 2, etp = 0, engines = 2, etp_engine = 1;
  int engine_tp = 2;
  double nic_gbps = 400, nvlink_gbps = 0;
  int bucket_mib = 512, cores = 0;
  double changed = -1;
  bool as_json = false;
  app.add_option("--config", config_arg, "HF config.json, or a preset: kimi-k2, default (the demo model)")
      ->capture_default_str();
  app.add_option("--quant-config", quant_arg,
                 "quantization config (file), int4-experts (G 128, experts only), fp8-block (DeepSeek-V3's block FP8), "
                 "none, or model (the config's own)")
      ->capture_default_str();
  app.add_option("--trainer-gpus", world, "Trainer ranks (Megatron world size)")->capture_default_str();
  app.add_option("--trainer-tp", tp, "Megatron TP")->capture_default_str();
  app.add_option("--trainer-pp", pp, "Megatron PP")->capture_default_str();
  app.add_option("--trainer-ep", ep, "Megatron EP")->capture_default_str();
  app.add_option("--trainer-etp", etp, "Megatron expert TP (0: the same as TP, Megatron's default)")
      ->capture_default_str();
  app.add_option("--engines", engines, "Identical engine replicas")->capture_default_str();
  app.add_option("--engine-tp", engine_tp, "GPUs per engine (SGLang TP)")->capture_default_str();
  app.add_option("--engine-ep", etp_engine, "Engine MoE expert parallelism (divides --engine-tp)")
      ->capture_default_str();
  app.add_option("--nic-gbps", nic_gbps, "NIC rate per GPU, Gb/s")->capture_default_str();
  app.add_option("--nvlink-gbps", nvlink_gbps, "NVLink rate per GPU and direction, GB/s (default: the profile's)");
  app.add_option("--bucket-mib", bucket_mib, "Bucket size")->capture_default_str();
  app.add_option("--rates", rates_arg, "Per-phase rates: h200, h200-device, local, or a JSON file of GB/s")
      ->capture_default_str();
  app.add_option("--cores", cores, "Everything on one host of this many cores (CPU-bound model); 0: a cluster");
  app.add_option("--changed-fraction", changed,
                 "Also project a delta sync (broadcast) where this fraction of every tensor's items changed since "
                 "the version the engines hold (docs/sync.md \"Delta sync\")")
      ->check(CLI::Range(0.0, 1.0));
  app.add_flag("--json", as_json, "JSON output");
  CLI11_PARSE(app, argc, argv);

  auto fail = [](const absl::Status& st) {
    std::fprintf(stderr, "wsync-plan: %s\n", std::string(st.message()).c_str());
    return 1;
  };
  std::string text;
  if (config_arg == "kimi-k2") {
    text = kKimiK2ConfigJson;
  } else if (config_arg == "default") {
    text = kDefaultModelConfigJson;
  } else {
    auto t = ReadTextFile(config_arg);
    if (!t.ok()) return fail(t.status());
    text = *t;
  }
  auto config = ParseModelConfig(text, config_arg);
  if (!config.ok()) return fail(config.status());
  std::optional<QuantizationConfig> quant;
  if (quant_arg == "int4-experts" || quant_arg == "fp8-block") {
    auto q = ParseQuantizationConfig(quant_arg == "fp8-block" ? kFp8BlockJson : kInt4ExpertsJson, quant_arg);
    if (!q.ok()) return fail(q.status());
    quant = *q;
  } else if (quant_arg == "model") {
    quant = config->quantization;
  } else if (quant_arg != "none") {
    auto q = LoadQuantizationConfig(quant_arg);
    if (!q.ok()) return fail(q.status());
    quant = *q;
  }
  auto layout = trainer_agent::ParallelLayout::Create({.world_size = world,
                                                       .tp = tp,
                                                       .pp = pp,
                                                       .ep = ep,
                                                       .etp = etp,
                                                       .num_experts = config->moe ? config->moe->num_experts : 0});
  if (!layout.ok()) return fail(layout.status());
  auto rates = LoadRates(rates_arg);
  if (!rates.ok()) return fail(rates.status());
  if (nvlink_gbps > 0) rates->nvlink = nvlink_gbps;
  Setup s{*config,
          quant ? &*quant : nullptr,
          *layout,
          engines,
          {engine_tp, 0, etp_engine},
          nic_gbps / 8,
          static_cast<uint64_t>(bucket_mib) << 20,
          cores,
          *rates,
          changed};
  auto sent = SentTensors(s);
  if (!sent.ok()) return fail(sent.status());
  std::vector<EngineParallel> groups;
  for (int r = 0; r < engine_tp; ++r) groups.push_back({engine_tp, r, etp_engine});
  auto shard = plan::ShardPlan::Create(s.config, s.quant, groups);
  if (!shard.ok()) return fail(shard.status());
  std::vector<Projection> out;
  for (bool sharded : {false, true}) {
    auto p = Project(s, *sent, *shard, sharded);
    if (!p.ok()) return fail(p.status());
    out.push_back(std::move(*p));
  }
  if (changed >= 0) {
    auto p = Project(s, *sent, *shard, false, true);
    if (!p.ok()) return fail(p.status());
    out.push_back(std::move(*p));
  }
  uint64_t total = 0, experts = 0;
  for (const Sent& t : *sent) {
    total += t.bytes;
    if (t.expert >= 0) experts += t.bytes;
  }
  if (as_json) {
    json j = {{"model", config_arg}, {"sent_bytes", total}, {"expert_bytes", experts}, {"rates", rates->source}};
    if (changed >= 0) j["changed_fraction"] = changed;
    for (const Projection& p : out) {
      json gpus = json::object();
      for (const auto& [name, l] : p.gpus)
        gpus[name] = {{"in", l.in}, {"out", l.out}, {"kept", l.kept}, {"quantized", l.quantized}, {"built", l.built}};
      j[p.mode] = {{"seconds", p.seconds},   {"limit_seconds", p.limit},   {"link_seconds", p.link},
                   {"work_seconds", p.work}, {"commit_seconds", p.commit}, {"fill_seconds", p.fill},
                   {"cpu_seconds", p.cpu},   {"busiest", p.busiest},       {"gpus", gpus}};
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("# wsync-plan: %s (%s), %zu sent tensors, %.2f GB per sync (%.2f GB of routed experts)\n",
              config_arg.c_str(), ArchitectureName(config->arch).data(), sent->size(), total / kGB, experts / kGB);
  std::printf("# trainer: %s; engines: %d x TP %d / EP %d; NIC %.0f Gb/s per GPU; rates: %s%s\n",
              layout->DebugString().c_str(), engines, engine_tp, etp_engine, nic_gbps, rates->source.c_str(),
              cores > 0 ? absl::StrFormat("; one host of %d cores", cores).c_str() : "");
  auto row = [&](const char* what, auto fn) {
    std::printf("%-34s", what);
    for (const Projection& p : out) std::printf(" %14s", fn(p).c_str());
    std::printf("\n");
  };
  row("",
      [&](const Projection& p) { return p.mode == "delta" ? absl::StrFormat("delta %g%%", 100 * changed) : p.mode; });
  auto max_of = [](const Projection& p, const char* prefix, uint64_t Load::*f) {
    uint64_t m = 0;
    for (const auto& [name, l] : p.gpus)
      if (absl::StartsWith(name, prefix)) m = std::max(m, l.*f);
    return absl::StrFormat("%.3f GB", m / kGB);
  };
  auto senders = [](const Projection& p) {
    int n = 0;
    for (const auto& [name, l] : p.gpus) n += absl::StartsWith(name, "trainer") && l.built > 0;
    return absl::StrCat(n);
  };
  row("trainer GPUs sending to engines", senders);
  row("bytes out, busiest trainer GPU", [&](const Projection& p) { return max_of(p, "trainer", &Load::out); });
  row("bytes in, busiest trainer GPU", [&](const Projection& p) { return max_of(p, "trainer", &Load::in); });
  row("bytes in, busiest engine GPU", [&](const Projection& p) { return max_of(p, "engine", &Load::in); });
  row("bytes kept, busiest engine GPU", [&](const Projection& p) { return max_of(p, "engine", &Load::kept); });
  auto sec = [](double v) { return v < 0.1 ? absl::StrFormat("%.2f ms", v * 1e3) : absl::StrFormat("%.3f s", v); };
  row("link time, busiest GPU", [&](const Projection& p) { return sec(p.link); });
  row("own work, busiest GPU", [&](const Projection& p) { return sec(p.work); });
  row("pipeline fill", [&](const Projection& p) { return sec(p.fill); });
  row("commit (load into engine)", [&](const Projection& p) { return sec(p.commit); });
  if (cores > 0) row("all CPU work / cores", [&](const Projection& p) { return sec(p.cpu); });
  row("projected sync", [&](const Projection& p) { return sec(p.seconds); });
  row("physical limit", [&](const Projection& p) { return sec(p.limit); });
  row("projected / limit", [&](const Projection& p) { return absl::StrFormat("%.2fx", p.seconds / p.limit); });
  for (const Projection& p : out) std::printf("# %s: busiest %s\n", p.mode.c_str(), p.busiest.c_str());
  return 0;
}

}  // namespace
}  // namespace wsync::tools

int main(int argc, char** argv) { return wsync::tools::Main(argc, argv); }
