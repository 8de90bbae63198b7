// wsync-rollout-agent: the agent beside one engine rank (see rollout_agent.h and README.md).
//
//   wsync-rollout-agent [--listen 127.0.0.1:0] [--address-file F] [--coordinator HOST:PORT]
//                       [--advertise-address HOST:PORT] [--data-host ADDR] [--cuda-device N]
//                       [--staging host|device] [--pause-for-whole-sync] [--record-dir DIR] [--token-file F]
//                       [--tls-cert F --tls-key F]
//                       [--tls-ca F]
//                       [--metrics-host ADDR] [--metrics-port P] [--heartbeat-ms MS] ...
//
// Prints "listening on HOST:PORT" (and "metrics on HOST:PORT" with --metrics-port) on stdout once
// serving. SIGINT / SIGTERM: abort an active sync (the engine continues on its previous version),
// leave the coordinator, exit 0.
// Exit codes: 0 clean shutdown, 1 start-up failure (the message says why), 2 bad command line.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/rpc_security.h"
#include "kernels/dispatch.h"
#include "rollout_agent/agent/rollout_agent.h"

namespace wsync::rollout_agent {
namespace {

absl::Status WriteAddressFile(const std::string& path, const std::string& address) {
  const std::string tmp = absl::StrCat(path, ".tmp-", getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << address << "\n";
    if (!f.good()) return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  return absl::OkStatus();
}

// The command line: the agent's options and what the binary itself serves.
struct Flags {
  std::string listen = "127.0.0.1:0", address_file, log_level;
  RpcSecurityOptions sec_opts;
  AgentOptions o;
  int metrics_port = -1;
  std::string metrics_host = "127.0.0.1";
  int64_t heartbeat_ms = 2000, engine_timeout_ms = 10000, flush_deadline_ms = 30000, sync_timeout_ms = 300000;
  std::string staging = "host";
  std::string bucket_mac = "auto";
};

// Declares every flag on `app`, writing into `f`.
void AddFlags(CLI::App& app, Flags& f) {
  app.add_option("--listen", f.listen, "address of the RolloutAgent service (port 0 picks one)")->capture_default_str();
  app.add_option("--address-file", f.address_file, "write the bound HOST:PORT to this file (atomically)");
  app.add_option("--advertise-address", f.o.advertise_address,
                 "the address the coordinator should call (default: the bound address; for a wildcard --listen "
                 "such as 0.0.0.0:PORT, the local address facing --coordinator)");
  app.add_option("--data-host", f.o.data_host,
                 "address the data-plane (Gloo) endpoints listen on, reachable from the trainer's stage sources "
                 "(default: the local address facing --coordinator; 127.0.0.1 without one)");
  app.add_option("--coordinator", f.o.coordinator, "the coordinator's address: join it and send heartbeats");
  app.add_option("--cuda-device", f.o.cuda_device,
                 "the GPU that syncs over nccl receive on (default: the device of the engine's CUDA parameters; "
                 "required for an engine whose parameters are in host memory)");
  app.add_option("--staging", f.staging,
                 "where the staging (the next version, received while the engine serves) lives: host (page-locked "
                 "for a CUDA engine) or device (the GPU of the engine's params: loaded and repacked there, nothing "
                 "crosses the host link; costs that GPU a second copy of the rank's weights, docs/gpu.md)")
      ->check(CLI::IsMember({"host", "device"}));
  app.add_flag("--pause-for-whole-sync", f.o.pause_whole_sync,
               "pause the engine at the start of every sync instead of only for its commit (the engine then "
               "serves nothing while the sync is gathered, sent and staged)");
  app.add_option("--record-dir", f.o.record_dir,
                 "record every committed version as received under DIR/v{version}/ (syncs that ask for it)");
  app.add_option("--token-file", f.sec_opts.token_file, "bearer token file (default: $WSYNC_TOKEN; none: no auth)");
  app.add_option("--tls-cert", f.sec_opts.tls_cert_file, "server certificate (PEM)");
  app.add_option("--tls-key", f.sec_opts.tls_key_file, "server key (PEM)");
  app.add_option("--tls-ca", f.sec_opts.tls_ca_file, "CA for client certificates, and of the engine / coordinator");
  app.add_option(
         "--bucket-mac", f.bucket_mac,
         "refuse syncs whose buckets are not authenticated (on), accept them (off), or auto: on when RPCs carry "
         "a token (docs/bucket_format.md)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--metrics-port", f.metrics_port, "serve Prometheus metrics on this port (0 picks one; -1 off)")
      ->capture_default_str();
  app.add_option("--metrics-host", f.metrics_host, "address of the metrics endpoint")->capture_default_str();
  app.add_option("--heartbeat-ms", f.heartbeat_ms, "heartbeat period to the coordinator")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{10}, int64_t{3600000}));
  app.add_option("--engine-timeout-ms", f.engine_timeout_ms, "deadline of each call to the engine")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{3600000}));
  app.add_option("--flush-deadline-ms", f.flush_deadline_ms, "how long a refused Flush is retried")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{3600000}));
  app.add_option("--sync-timeout-ms", f.sync_timeout_ms, "bound of a sync whose BeginSync carries no timeout_ms")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{86400000}));
  app.add_option("--load-threads", f.o.load_threads, "tensors of a bucket loaded at once (0: min(4, cores))")
      ->capture_default_str();
  app.add_option("--repack-threads", f.o.repack_threads, "threads of the Marlin repack (0: all cores)")
      ->capture_default_str();
  app.add_option("--log-level", f.log_level, "debug | info | warning | error (default: $WSYNC_LOG_LEVEL or info)");
}

// Turns the parsed flags into f.o (log level, security, durations). 0, else the exit code: 1 for a
// start-up failure (logged), 2 for a bad command line.
int ResolveOptions(Flags& f) {
  SetLogIdentity("rollout", -1);
  f.o.device_staging = f.staging == "device";
  if (f.o.device_staging && !kernels::CudaCompiledIn()) {
    WSYNC_LOG(ERROR) << "--staging device: this binary was built without CUDA (a device staging needs the GPU "
                        "kernels); use --staging host";
    return 1;
  }
  if (!ApplyLogLevelFlag(f.log_level)) return 2;
  auto sec = LoadRpcSecurity(f.sec_opts);
  if (!sec.ok()) {
    WSYNC_LOG(ERROR) << sec.status();
    return 1;
  }
  f.o.security = *sec;
  f.o.require_bucket_mac = *ResolveBucketMac(f.bucket_mac, f.o.security);  // checked by CLI11 above
  f.o.heartbeat = absl::Milliseconds(f.heartbeat_ms);
  f.o.engine_rpc_timeout = absl::Milliseconds(f.engine_timeout_ms);
  f.o.flush_deadline = absl::Milliseconds(f.flush_deadline_ms);
  f.o.default_sync_timeout = absl::Milliseconds(f.sync_timeout_ms);
  f.o.set_log_identity = true;
  return 0;
}

// Serves until SIGINT / SIGTERM: the agent, the metrics endpoint, the address file. The exit code.
int Serve(Flags& f) {
  // Signals are taken by sigwait() below; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  MetricsRegistry registry;
  f.o.metrics = &registry;
  auto server = AgentServer::Start(f.listen, f.o);
  if (!server.ok()) {
    WSYNC_LOG(ERROR) << server.status();
    return 1;
  }
  std::unique_ptr<MetricsServer> metrics;
  if (f.metrics_port >= 0) {
    metrics = std::make_unique<MetricsServer>(&registry);
    absl::Status ms = metrics->Start(f.metrics_host, f.metrics_port);
    if (!ms.ok()) {
      WSYNC_LOG(ERROR) << "metrics endpoint: " << ms;
      return 1;
    }
  }
  if (!f.address_file.empty()) {
    absl::Status as = WriteAddressFile(f.address_file, (*server)->address());
    if (!as.ok()) {
      WSYNC_LOG(ERROR) << "--address-file: " << as;
      return 1;
    }
  }
  std::printf("listening on %s\n", (*server)->address().c_str());
  if (metrics) std::printf("metrics on %s:%d\n", f.metrics_host.c_str(), metrics->port());
  std::fflush(stdout);
  WSYNC_LOG(INFO) << "rollout agent listening on " << (*server)->address()
                  << (f.o.coordinator.empty() ? "" : absl::StrCat(", coordinator ", f.o.coordinator))
                  << (f.o.record_dir.empty() ? "" : absl::StrCat(", recording to ", f.o.record_dir))
                  << (f.o.security.token.empty() ? ", no auth (loopback development)" : ", token auth")
                  << (f.o.security.tls() ? ", TLS" : "");

  int sig = 0;
  sigwait(&signals, &sig);
  WSYNC_LOG(INFO) << "signal " << sig << ": shutting down";
  (*server)->Shutdown();
  if (metrics) metrics->Stop();
  return 0;
}

int Run(int argc, char** argv) {
  CLI::App app{
      "wsync-rollout-agent: receives weight syncs for one engine rank, loads them into the engine's "
      "memory in its own TP layout, repacks INT4 to Marlin and commits versions"};
  Flags f;
  AddFlags(app, f);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (const int rc = ResolveOptions(f); rc != 0) return rc;
  return Serve(f);
}

}  // namespace
}  // namespace wsync::rollout_agent

int main(int argc, char** argv) { return wsync::rollout_agent::Run(argc, argv); }
