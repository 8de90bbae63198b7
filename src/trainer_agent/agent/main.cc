// wsync-trainer-agent: launched by mpirun beside the Megatron ranks, same world size and rank
// order. Rank 0 hosts the coordinator. See trainer_agent.h and deploy/mpirun/.
//
//   mpirun -np 4 wsync-trainer-agent --source dir:/ckpt/megatron --coordinator 127.0.0.1:7070
//       [--coordinator-listen 0.0.0.0:7070] [--data-host ADDR] [--metrics-host ADDR --metrics-port P]
//       [--quant-config quant.json] [--expert-map map.json] [--bucket-mib 512] [--backend gloo|shm|nccl|cuda-ipc]
//       [--token-file F]
//   mpirun -np 4 wsync-trainer-agent --source shm:job42 ...   (the training processes register
//       their tensors through libwsync_trainer_client; see src/trainer_client/README.md)
//   wsync-trainer-agent --world-size 4 --rank R --world-store HOST:PORT ...   (one process per rank,
//       started by a launcher without mpirun: python/wsync/ray.py)
#include <csignal>
#include <cstdio>

#include "CLI/CLI.hpp"
#include "common/config.h"
#include "common/logging.h"
#include "model/expert_map.h"
#include "trainer_agent/agent/trainer_agent.h"

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

// How syncs reach the rollout agents: --backend, --cuda-device, --delivery, --delta.
void AddDataPlaneOptions(CLI::App& app, wsync::trainer_agent::TrainerAgentOptions& o) {
  app.add_option("--backend", o.backend,
                 "Trainer -> rollout data plane: gloo (TCP), shm (colocated: every rollout agent on the trainer's "
                 "host, one shared-memory segment, no network), nccl (GPU) or cuda-ipc (colocated on GPUs: the "
                 "ring in one CUDA allocation shared by IPC, buckets device to device)")
      ->check(CLI::IsMember({"gloo", "shm", "nccl", "cuda-ipc"}));
  app.add_option(
      "--cuda-device", o.cuda_device,
      "The GPU this rank's device data plane (nccl, cuda-ipc) sends from (default: the GPU of the training process's "
      "tensors when the device stages read them in place, else the local rank, from "
      "OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or LOCAL_RANK, modulo the GPUs visible)");
  app.add_option("--delivery", o.delivery,
                 "How syncs that do not choose (wsyncctl sync --delivery) reach the agents: broadcast (every agent "
                 "receives every byte of its stage) or sharded (every agent receives only the blocks its engine "
                 "rank keeps, one stream per group of like ranks; docs/sync.md)")
      ->check(CLI::IsMember({"broadcast", "sharded"}))
      ->capture_default_str();
  app.add_option("--delta", o.delta,
                 "Syncs that do not choose (wsyncctl sync --delta): off (every byte), auto (only the change since the "
                 "version the engines hold, when the trainer and every engine hold it, else every byte) or on (the "
                 "same; engines not on that version sit the sync out and copy it from a peer after). Broadcast "
                 "delivery, host buckets (docs/sync.md \"Delta sync\")")
      ->check(CLI::IsMember({"off", "auto", "on"}))
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("wsync-trainer-agent: the trainer side of wsync (one per Megatron rank, under mpirun)");
  wsync::trainer_agent::TrainerAgentOptions o;
  std::string quant_file, expert_map_file;
  uint64_t bucket_mib = 512;
  double sync_timeout_s = 600;
  wsync::RpcSecurityOptions sec;
  app.add_option("--source", o.source,
                 "Weight source: dir:PATH (a Megatron source directory, re-read every sync) or shm:NAME (the live "
                 "training process of each rank shares its tensors through libwsync_trainer_client; the agent "
                 "waits for it to register)")
      ->required();
  app.add_option("--coordinator", o.coordinator,
                 "Coordinator address as every rank and rollout agent dials it (rank 0 listens there unless "
                 "--coordinator-listen)");
  app.add_option("--coordinator-listen", o.coordinator_listen,
                 "What rank 0 binds for the coordinator, e.g. 0.0.0.0:7070 (default: --coordinator)");
  app.add_option("--data-host", o.data_host,
                 "Address this rank's data-plane (Gloo) endpoints listen on (default: the local address facing the "
                 "coordinator)");
  app.add_option("--metrics-host", o.metrics_host, "Address of the Prometheus endpoint")->capture_default_str();
  AddDataPlaneOptions(app, o);
  app.add_option("--bucket-mib", bucket_mib, "Bucket size in MiB")->check(CLI::Range(1, 1 << 16));
  app.add_option("--quant-config", quant_file,
                 "The engines' quantization config (compressed-tensors, AWQ or FP8 object, or a config.json holding "
                 "one), checked against what the engines declare; default: the one the engines declare "
                 "(docs/engine-formats.md)");
  app.add_option("--expert-map", expert_map_file,
                 "Expert pruning: a JSON map {\"num_experts\": E, \"layers\": {\"<layer>\": [kept ids]}}; only kept "
                 "experts are sent, under their compact ids, and the routers are sliced (docs/expert-pruning.md)");
  app.add_option("--quant-threads", o.quant_threads, "Threads for INT4 quantization (0: all cores)");
  app.add_option("--reuse-pause-below", o.reuse_pause_below,
                 "Delta syncs: quantize a block without digests for a while when its last comparison reused under "
                 "this share of its quantization groups (0: never; docs/sync.md)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--sync-timeout", sync_timeout_s, "Bound on one sync, seconds")->check(CLI::PositiveNumber);
  app.add_option("--token-file", sec.token_file, "Bearer token for every RPC (else $WSYNC_TOKEN)");
  app.add_option("--tls-cert", sec.tls_cert_file, "TLS certificate of the coordinator");
  app.add_option("--tls-key", sec.tls_key_file, "TLS key");
  app.add_option("--tls-ca", sec.tls_ca_file, "CA for client certificates / of the servers");
  std::string bucket_mac = "auto";
  app.add_option("--bucket-mac", bucket_mac,
                 "Authenticate every bucket with a per-sync key (GMAC; docs/bucket_format.md): on, off, or auto (on "
                 "when RPCs carry a token)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--metrics-port", o.metrics_port, "Prometheus /metrics on --metrics-host:PORT (0: any; default off)");
  app.add_option("--address-file", o.address_file, "Rank 0 writes the coordinator's bound address here");
  o.state_dir = "wsync-state";
  app.add_option("--state-dir", o.state_dir,
                 "Rank 0 keeps the coordinator's durable state here (versions, timings, the fleet, a commit in "
                 "progress; coordinator-state.json), so that a trainer job started again with the same command "
                 "continues where it stopped; relative to rank 0's working directory; one coordinator per directory "
                 "(locked); \"none\": in memory only (docs/sync.md)")
      ->capture_default_str();
  app.add_option("--world-size", o.world_size,
                 "Ranks of a world started without mpirun (one agent per training process, e.g. by wsync.ray): "
                 "they form it over Gloo through rank 0's store (--rank, --world-store); default: the mpirun world")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--rank", o.world_rank, "This agent's rank in a --world-size world (the training process's rank)");
  app.add_option("--world-store", o.world_store,
                 "HOST:PORT of the store a --world-size world forms through: rank 0 binds it, the others dial it");
  double world_join_s = 120;
  app.add_option("--world-join-timeout", world_join_s, "Seconds for every rank of a --world-size world to join")
      ->check(CLI::PositiveNumber);
  bool host_stages = false;
  app.add_flag("--host-stages", host_stages,
               "shm: sources whose training processes hold CUDA tensors: copy them to the host and convert / "
               "quantize there, instead of the device stages (the CUDA kernels, buckets in device memory)");
  CLI11_PARSE(app, argc, argv);
  o.device_stages = !host_stages;
  if (o.state_dir == "none") o.state_dir.clear();

  o.bucket_bytes = bucket_mib << 20;
  o.sync_timeout = absl::Seconds(sync_timeout_s);
  o.world_join_timeout = absl::Seconds(world_join_s);
  if (!quant_file.empty()) {
    auto q = wsync::LoadQuantizationConfig(quant_file);
    if (!q.ok()) {
      std::fprintf(stderr, "wsync-trainer-agent: %s\n", q.status().ToString().c_str());
      return 2;
    }
    o.quant = *q;
  }
  if (!expert_map_file.empty()) {
    auto m = wsync::model::LoadExpertMap(expert_map_file);
    if (!m.ok()) {
      std::fprintf(stderr, "wsync-trainer-agent: %s\n", m.status().ToString().c_str());
      return 2;
    }
    o.expert_map = *m;
  }
  auto s = wsync::LoadRpcSecurity(sec);
  if (!s.ok()) {
    std::fprintf(stderr, "wsync-trainer-agent: %s\n", s.status().ToString().c_str());
    return 2;
  }
  o.security = *s;
  o.bucket_mac = *wsync::ResolveBucketMac(bucket_mac, o.security);  // checked by CLI11 above
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  absl::Status st = wsync::trainer_agent::RunTrainerAgent(o, &g_stop);
  if (!st.ok()) {
    WSYNC_LOG(ERROR) << st;
    std::fprintf(stderr, "wsync-trainer-agent: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
