// wsync-selfcheck: checks that this build and machine can run wsync, and prints what it found.
//
// It exercises the pieces that exist end to end on real data: the embedded default model config
// (parse + validate), safetensors write -> mmap read -> bit-exact compare on a bf16 tensor of
// --mib MiB (with throughput next to a memcpy of the same bytes), exact bf16 conversions, the
// Prometheus endpoint on loopback, and CUDA availability. Exit code 0 only if every check passed.
#include <httplib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/default_model.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/safetensors.h"
#include "common/tensor.h"
#include "kernels/dispatch.h"

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Report {
  int failed = 0;
  void Row(const char* check, bool ok, const std::string& detail) {
    std::printf("  %-28s %-5s %s\n", check, ok ? "ok" : "FAIL", detail.c_str());
    if (!ok) ++failed;
  }
};

int Run(int mib, const std::string& workdir) {
  Report r;
  std::printf("wsync self-check\n\n");

  auto cfg = ParseModelConfig(kDefaultModelConfigJson, "embedded default config");
  if (cfg.ok()) {
    const auto& c = *cfg;
    int moe_layers = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.IsMoeLayer(l);
    r.Row(
        "default model config", true,
        absl::StrFormat("%s: %d layers (%d MoE, %d experts, top-%d), hidden %d, heads %d/%d, vocab %d", c.architecture,
                        c.num_hidden_layers, moe_layers, c.moe->num_experts, c.moe->num_experts_per_tok, c.hidden_size,
                        c.num_attention_heads, c.num_key_value_heads, c.vocab_size));
    const auto& q = *c.quantization;
    auto sup = q.CheckInt4Supported();
    r.Row("quantization_config", sup.ok(),
          sup.ok() ? absl::StrFormat("INT%d symmetric, group %d, %d ignore rules; experts quantized: %s, router: %s",
                                     q.num_bits, q.group_size, q.ignore.size(),
                                     q.IsIgnored("model.layers.0.mlp.experts.0.up_proj.weight") ? "no" : "yes",
                                     q.IsIgnored("model.layers.0.mlp.gate.weight") ? "ignored" : "QUANTIZED (bad)")
                   : std::string(sup.message()));
  } else {
    r.Row("default model config", false, std::string(cfg.status().message()));
  }

  // bf16 conversions: every pattern round-trips.
  int bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const bool nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
    if (!nan && F32ToBF16(BF16ToF32(h)) != h) ++bad;
  }
  r.Row("bf16 <-> fp32", bad == 0, absl::StrFormat("65536 patterns, %d mismatches", bad));

  // safetensors round trip through the file system and mmap.
  const int64_t rows = static_cast<int64_t>(mib) * 1024 * 1024 / 2 / 4096;
  auto w = Tensor::Empty(DType::kBF16, Shape{rows, 4096});
  if (!w.ok()) {
    r.Row("safetensors round trip", false, std::string(w.status().message()));
  } else {
    std::mt19937 rng(1);
    uint16_t* p = w->data_as<uint16_t>();
    const size_t n = static_cast<size_t>(rows) * 4096;
    for (size_t i = 0; i < n; ++i) p[i] = F32ToBF16(std::normal_distribution<float>(0.f, 0.02f)(rng));
    const std::string path = workdir + "/wsync-selfcheck.safetensors";
    SafetensorsWriter writer;
    (void)writer.Add("model.layers.0.mlp.experts.0.up_proj.weight", w->view());
    auto t0 = Clock::now();
    auto ws = writer.Write(path);
    auto t1 = Clock::now();
    auto f = SafetensorsFile::Open(path);
    bool same = false;
    double read_s = 0;
    if (f.ok()) {
      const auto* e = f->Find("model.layers.0.mlp.experts.0.up_proj.weight");
      auto t2 = Clock::now();
      same = e && e->view.nbytes() == w->nbytes() && std::memcmp(e->view.data(), w->view().data(), w->nbytes()) == 0;
      read_s = Seconds(t2, Clock::now());
    }
    auto copy = Buffer::AllocateZeroed(w->nbytes());  // pages touched: time the copy, not page faults
    auto t3 = Clock::now();
    if (copy.ok()) std::memcpy(copy->data(), w->view().data(), w->nbytes());
    const double memcpy_s = Seconds(t3, Clock::now());
    const double gb = static_cast<double>(w->nbytes()) / 1e9;
    unlink(path.c_str());
    r.Row("safetensors round trip", ws.ok() && f.ok() && same,
          !ws.ok()  ? std::string(ws.message())
          : !f.ok() ? std::string(f.status().message())
                    : absl::StrFormat("%d MiB bf16: write %.2f GB/s, mmap read+compare %.2f GB/s, memcpy %.2f GB/s, "
                                      "bit-exact: %s",
                                      mib, gb / Seconds(t0, t1), gb / read_s, gb / memcpy_s, same ? "yes" : "NO"));
  }

  // Metrics endpoint on loopback.
  MetricsRegistry registry;
  (void)registry.GetGauge("wsync_selfcheck_ok", "1 when the self-check ran.").value()->Set(1);
  MetricsServer server(&registry);
  auto ms = server.Start("127.0.0.1", 0);
  bool scraped = false;
  if (ms.ok()) {
    httplib::Client client("127.0.0.1", server.port());
    auto res = client.Get("/metrics");
    scraped = res && res->status == 200 && res->body.find("wsync_selfcheck_ok 1") != std::string::npos;
  }
  r.Row("metrics endpoint", ms.ok() && scraped,
        ms.ok() ? absl::StrFormat("served and scraped on 127.0.0.1:%d", server.port()) : std::string(ms.message()));
  server.Stop();

  auto gpus = kernels::CudaDeviceCount();
  r.Row("CUDA", gpus.ok(),
        gpus.ok() ? absl::StrFormat("compiled in: %s; devices: %d%s", kernels::CudaCompiledIn() ? "yes" : "no", *gpus,
                                    *gpus == 0 ? " (GPU paths skip; CPU paths run)" : "")
                  : std::string(gpus.status().message()));

  std::printf("\n%s: %d check(s) failed\n", r.failed ? "FAILED" : "OK", r.failed);
  return r.failed ? 1 : 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  CLI::App app{"wsync-selfcheck: verify that this build and machine can run wsync"};
  int mib = 64;
  std::string workdir = "/tmp";
  if (const char* t = std::getenv("TMPDIR")) workdir = t;
  app.add_option("--mib", mib, "Size of the safetensors round-trip tensor in MiB")->check(CLI::Range(1, 16384));
  app.add_option("--workdir", workdir, "Directory for the temporary file")->check(CLI::ExistingDirectory);
  CLI11_PARSE(app, argc, argv);
  wsync::SetLogIdentity("selfcheck", -1);
  return wsync::Run(mib, workdir);
}
