// wsync-ref-engine: the CPU reference rollout engine, one process per engine TP rank.
//
//   wsync-ref-engine --model DIR_OR_CONFIG [--checkpoint DIR] [--quant-config FILE|none]
//                    [--tp-size T --tp-rank R --tp-store HOST:PORT] [--ep-size EP] [--mtp-draft]
//                    [--engine-id ID] [--listen 127.0.0.1:0] [--address-file F] [--agent ADDR | --agent-file F]
//                    [--token-file F] [--tls-cert F --tls-key F] [--tls-ca F]
//
// Start-up: allocates the rank's parameters (EngineLayout engine form) in one shared-memory
// segment, loads --checkpoint into it (version 0) or starts with NO_WEIGHTS, serves the
// RolloutEngine service on --listen (prints "listening on HOST:PORT"), registers with --agent
// (and again whenever the agent restarts), and with T > 1 forms the engine's own Gloo TP group
// through the store rank 0 hosts on --tp-store (rank 0 prints "tp-store on HOST:PORT").
// SIGINT / SIGTERM: clean shutdown (rank 0 also stops the other ranks), the segment is unlinked.
// Exit codes: 0 after a clean shutdown, 1 when start-up fails (the error is printed), 2 for bad flags.
// README.md beside this file documents every flag and behaviour.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "common/config.h"
#include "common/cuda_ipc.h"
#include "common/logging.h"
#include "common/rpc_security.h"
#include "common/status.h"
#include "engine_memory/param_arena.h"
#include "engine_model/engine_layout.h"
#include "engine_side/checkpoint.h"
#include "engine_side/core.h"
#include "engine_side/registration.h"
#include "engine_side/server.h"
#include "engine_side/tp_group.h"
#include "ref_engine/ref_core.h"

namespace wsync::ref_engine {
using engine_side::AgentRegistrar;
using engine_side::CheckpointOptions;
using engine_side::CheckpointStats;
using engine_side::EngineCore;
using engine_side::EngineCoreOptions;
using engine_side::EngineServer;
using engine_side::LoadCheckpoint;
using engine_side::RegistrarOptions;
using engine_side::RunTpGroup;
using engine_side::TpGroupOptions;

namespace {

struct Flags {
  std::string model, checkpoint, quant_config, quant_variant = "qat";
  int tp_size = 1, tp_rank = 0, ep_size = 1;
  bool mtp_draft = false;
  std::string engine_id = "ref-engine";
  std::string listen = "127.0.0.1:0", address_file, agent, agent_file;
  std::string tp_store, tp_host = "127.0.0.1";
  RpcSecurityOptions sec;
  std::string log_level;
  double hold_timeout_s = 600, version_wait_s = 10, tp_join_timeout_s = 300, tp_idle_timeout_s = 30;
  int heartbeat_ms = 1000, agent_poll_ms = 2000, threads = 0, test_step_delay_ms = 0;
  std::string param_memory = "shm";  // "shm" or "cuda:N"
  int cuda_device = -1;              // parsed from param_memory
};

// One-shot "please shut down", from a signal or from rank 0.
class ShutdownLatch {
 public:
  void Request(absl::string_view why) {
    absl::MutexLock lock(&mu_);
    if (!requested_) WSYNC_LOG(INFO) << "shutting down: " << why;
    requested_ = true;
  }
  bool requested() const {
    absl::MutexLock lock(&mu_);
    return requested_;
  }
  void Wait() const {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&requested_));
  }

 private:
  mutable absl::Mutex mu_;
  bool requested_ = false;
};

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    if (!f.good()) return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return ErrnoToStatus(errno, absl::StrCat("rename to ", path));
  return absl::OkStatus();
}

// The quantization config the engine serves: --quant-config none / FILE / the model's own.
// Returns {config or nullopt, its JSON object text ("" for bf16)}.
absl::StatusOr<std::pair<std::optional<QuantizationConfig>, std::string>> ResolveQuantization(
    const Flags& f, const std::string& config_path, const std::string& config_text) {
  if (f.quant_config == "none") return std::make_pair(std::optional<QuantizationConfig>(), std::string());
  std::string source = config_path, text = config_text;
  if (!f.quant_config.empty()) {
    source = f.quant_config;
    ASSIGN_OR_RETURN(text, ReadTextFile(f.quant_config));
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  if (j.contains("quantization_config")) {
    j = j["quantization_config"];
  } else if (f.quant_config.empty()) {
    return std::make_pair(std::optional<QuantizationConfig>(), std::string());  // the model is bf16
  }
  const std::string object = j.dump();
  ASSIGN_OR_RETURN(QuantizationConfig q, ParseQuantizationConfig(object, source));
  RETURN_IF_ERROR(Annotate(q.CheckSupported(), source));
  return std::make_pair(std::optional<QuantizationConfig>(std::move(q)), object);
}

// SIGINT / SIGTERM, blocked in every thread (Block() runs before any thread starts), taken by one
// watcher thread that requests shutdown on the latch. Joined on destruction.
class SignalWatcher {
 public:
  static sigset_t Block() {
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    return signals;
  }
  SignalWatcher(sigset_t signals, ShutdownLatch* latch)
      : thread_([this, signals, latch] {
          while (!done_.load()) {
            timespec ts{0, 200'000'000};
            const int sig = sigtimedwait(&signals, nullptr, &ts);
            if (sig == SIGINT || sig == SIGTERM) latch->Request(sig == SIGINT ? "SIGINT" : "SIGTERM");
          }
        }) {}
  ~SignalWatcher() {
    done_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// What the engine serves and where its parameters live: the model and quantization configs, the
// rank's layout and its registered parameter memory (plus, for a device arena, the host mirror the
// CPU forward pass reads).
struct EngineMemory {
  std::string config_text, quant_json;
  ModelConfig config;
  EngineRank rank;
  std::unique_ptr<engine_model::EngineLayout> layout;  // the arena refers to it: not moved
  std::unique_ptr<engine_memory::ParamArena> arena;
  std::unique_ptr<engine_model::OwnedEngineWeights> mirror;

  engine_model::EngineWeights* weights() { return &arena->weights(); }
  engine_model::EngineWeights* host_weights() { return mirror ? &mirror->weights() : weights(); }
};

absl::StatusOr<EngineMemory> AllocateEngineMemory(const Flags& f) {
  EngineMemory m;
  const std::string model = f.model.empty() ? f.checkpoint : f.model;
  std::string config_path = model;
  if (std::ifstream(model + "/config.json").good()) config_path = model + "/config.json";
  ASSIGN_OR_RETURN(m.config_text, ReadTextFile(config_path));
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(m.config_text, config_path));
  ASSIGN_OR_RETURN(auto quant, ResolveQuantization(f, config_path, m.config_text));
  m.config.quantization = std::move(quant.first);
  m.quant_json = std::move(quant.second);
  const QuantizationConfig* qptr = m.config.quantization ? &*m.config.quantization : nullptr;
  m.rank.tp_size = f.tp_size;
  m.rank.tp_rank = f.tp_rank;
  m.rank.ep_size = f.ep_size;
  m.rank.mtp_draft = f.mtp_draft;
  ASSIGN_OR_RETURN(engine_model::EngineLayout layout, engine_model::EngineLayout::Create(m.config, qptr, m.rank));
  m.layout = std::make_unique<engine_model::EngineLayout>(std::move(layout));
  // The registered parameter memory: a shm segment, or (--param-memory cuda:N) one CUDA allocation
  // that the rollout agent repacks into on the device. This engine computes on the CPU, so a device
  // arena has a host mirror: the checkpoint is loaded there and uploaded, and every Prepare (a new
  // version, after the agent wrote the device) copies each param back into it before serving.
  if (f.cuda_device < 0) {  // the segments of earlier lives of this rank that were killed
    absl::StatusOr<std::vector<std::string>> stale = engine_memory::ReclaimStaleShmSegments(f.engine_id, f.tp_rank);
    if (!stale.ok()) WSYNC_LOG(WARNING) << "looking for stale shm segments: " << stale.status();
    for (const std::string& name : stale.ok() ? *stale : std::vector<std::string>{})
      WSYNC_LOG(INFO) << "removed the shm segment /" << name << " of a killed earlier process of this rank";
  }
  ASSIGN_OR_RETURN(m.arena, f.cuda_device >= 0 ? engine_memory::ParamArena::CreateOnDevice(*m.layout, f.cuda_device)
                                               : engine_memory::ParamArena::Create(
                                                     *m.layout, engine_memory::UniqueShmName(f.engine_id, f.tp_rank)));
  if (m.arena->on_device()) {
    ASSIGN_OR_RETURN(m.mirror, engine_model::OwnedEngineWeights::Allocate(*m.layout));
  }
  WSYNC_LOG(INFO) << "engine " << f.engine_id << " tp rank " << f.tp_rank << "/" << f.tp_size << " ep " << f.ep_size
                  << ": " << ArchitectureName(m.config.arch) << (qptr ? " INT4" : " bf16") << ", "
                  << m.layout->params().size() << " params, " << m.arena->size() << " bytes in " << m.arena->where()
                  << (m.mirror ? " (host mirror for the CPU forward pass)" : "");
  return m;
}

// The rank's EngineCore over `m`: the forward pass reads the host weights (a device param copied
// into its mirror at each lookup).
absl::StatusOr<std::unique_ptr<EngineCore>> CreateCore(const Flags& f, EngineMemory& m) {
  EngineCoreOptions copts;
  copts.engine_id = f.engine_id;
  copts.hold_timeout = absl::Seconds(f.hold_timeout_s);
  copts.version_wait = absl::Seconds(f.version_wait_s);
  copts.heartbeat = absl::Milliseconds(f.heartbeat_ms);
  copts.idle_timeout = absl::Seconds(f.tp_idle_timeout_s);
  copts.step_delay = absl::Milliseconds(f.test_step_delay_ms);
  EngineModelOptions mo;
  mo.prepare_threads = f.threads;
  engine_model::EngineWeights* weights = m.weights();
  engine_model::EngineWeights* host_weights = m.host_weights();
  ParamLookup lookup = [weights, host_weights](absl::string_view name) -> absl::StatusOr<TensorView> {
    ASSIGN_OR_RETURN(MutableTensorView v, weights->View(name));
    const engine_model::EngineBuffer* b = weights->Find(name);
    if (!b->on_device()) return TensorView(v);
    ASSIGN_OR_RETURN(MutableTensorView host, host_weights->View(name));
    RETURN_IF_ERROR(CopyDeviceToHost(host.data(), v.data(), v.nbytes(), b->cuda_device));
    return TensorView(host);
  };
  return CreateEngineCore(m.config, m.rank, lookup, copts, mo);
}

// --checkpoint into the host weights (uploaded to a device arena), served as version 0.
absl::Status LoadStartupCheckpoint(const Flags& f, EngineMemory& m, EngineCore* core) {
  const absl::Time start = absl::Now();
  CheckpointOptions co;
  co.num_threads = f.threads;
  co.variant = f.quant_variant == "slime" ? kernels::QuantVariant::kSlime : kernels::QuantVariant::kQat;
  ASSIGN_OR_RETURN(CheckpointStats stats, LoadCheckpoint(f.checkpoint, *m.layout, *m.host_weights(), co));
  if (m.mirror) {
    for (const engine_model::EngineBuffer& b : m.weights()->buffers()) {
      RETURN_IF_ERROR(Annotate(CopyHostToDevice(b.data, m.host_weights()->Find(b.name)->data, b.nbytes, b.cuda_device),
                               absl::StrCat("uploading ", b.name)));
    }
  }
  RETURN_IF_ERROR(core->PrepareInitial(0, absl::StrCat("checkpoint ", f.checkpoint)));
  WSYNC_LOG(INFO) << "loaded checkpoint " << f.checkpoint << ": " << stats.files << " files, " << stats.tensors
                  << " tensors, " << stats.quantized << " quantized at load, " << stats.skipped << " skipped, in "
                  << absl::FormatDuration(absl::Now() - start) << "; serving version 0";
  return absl::OkStatus();
}

// The TP group's rendezvous store (T > 1): rank 0 hosts it on --tp-store (and prints its port), the
// others connect. `store` is null for T = 1.
struct TpStore {
  comm::MemoryStore memory;
  std::unique_ptr<comm::StoreServer> server;
  std::unique_ptr<comm::GrpcStoreClient> client;
  comm::Store* store = nullptr;
};

absl::Status StartTpStore(const Flags& f, const RpcSecurity& sec, TpStore& t) {
  if (f.tp_size <= 1) return absl::OkStatus();
  if (f.tp_rank != 0) {
    t.client = comm::GrpcStoreClient::Connect(f.tp_store, absl::Seconds(30), sec);
    t.store = t.client.get();
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(t.server, comm::StoreServer::Start(&t.memory, f.tp_store, sec));
  const size_t colon = f.tp_store.rfind(':');
  std::printf("tp-store on %s:%d\n", f.tp_store.substr(0, colon).c_str(), t.server->port());
  std::fflush(stdout);
  t.store = &t.memory;
  return absl::OkStatus();
}

// Registers the rank with its rollout agent (--agent / --agent-file), again whenever the agent
// restarts; null when neither flag is given.
std::unique_ptr<AgentRegistrar> StartRegistrar(const Flags& f, const RpcSecurity& sec, const EngineMemory& m,
                                               EngineCore* core, const std::string& address) {
  if (f.agent.empty() && f.agent_file.empty()) return nullptr;
  RegistrarOptions ro;
  ro.agent_address = f.agent;
  ro.agent_address_file = f.agent_file;
  ro.security = sec;
  ro.poll = absl::Milliseconds(f.agent_poll_ms);
  ro.on_registered = [core](const v1::RegisterEngineReply& r) { core->HoldForCatchUp(r.catch_up_version()); };
  engine_memory::ParamArena* arena = m.arena.get();
  return AgentRegistrar::Start(ro, [&f, &m, arena, core, address] {
    v1::RegisterEngineRequest req;
    req.set_engine_id(f.engine_id);
    req.set_tp_size(static_cast<uint32_t>(f.tp_size));
    req.set_tp_rank(static_cast<uint32_t>(f.tp_rank));
    req.set_ep_size(static_cast<uint32_t>(f.ep_size));
    req.set_model_config_json(m.config_text);
    req.set_quantization_config_json(m.quant_json);
    req.set_engine_address(address);
    req.set_version(core->version());
    arena->FillParams(req.mutable_params());
    return req;
  });
}

int Run(const Flags& f) {
  const sigset_t signals = SignalWatcher::Block();  // before any thread: only the watcher takes them
  SetLogIdentity("engine", f.tp_rank);
  if (!ApplyLogLevelFlag(f.log_level)) return 2;
  engine_memory::InstallShmCrashCleanup();
  ShutdownLatch latch;
  SignalWatcher watcher(signals, &latch);
  auto fail = [](const absl::Status& s) {
    WSYNC_LOG(ERROR) << s;
    std::fprintf(stderr, "wsync-ref-engine: %s\n", s.ToString().c_str());
    return 1;
  };

  absl::StatusOr<EngineMemory> memory = AllocateEngineMemory(f);
  if (!memory.ok()) return fail(memory.status());
  absl::StatusOr<std::unique_ptr<EngineCore>> core = CreateCore(f, *memory);
  if (!core.ok()) return fail(core.status());
  if (!f.checkpoint.empty()) {
    if (absl::Status s = LoadStartupCheckpoint(f, *memory, core->get()); !s.ok()) return fail(s);
  } else {
    WSYNC_LOG(INFO) << "no checkpoint: NO_WEIGHTS until the first sync";
  }
  absl::StatusOr<RpcSecurity> sec = LoadRpcSecurity(f.sec);
  if (!sec.ok()) return fail(sec.status());
  TpStore tp_store;
  if (absl::Status s = StartTpStore(f, *sec, tp_store); !s.ok()) return fail(s);

  absl::StatusOr<std::unique_ptr<EngineServer>> server = EngineServer::Start(core->get(), f.listen, *sec);
  if (!server.ok()) return fail(server.status());
  const std::string address = (*server)->address();
  std::printf("listening on %s\n", address.c_str());
  std::fflush(stdout);
  WSYNC_LOG(INFO) << "RolloutEngine listening on " << address;
  if (!f.address_file.empty()) {
    if (absl::Status s = WriteFileAtomically(f.address_file, address + "\n"); !s.ok()) return fail(s);
  }
  (*core)->SetShutdownCallback([&latch] { latch.Request("tp rank 0 stopped the engine"); });

  std::thread former;
  if (f.tp_size > 1) {
    TpGroupOptions g;
    g.engine_id = f.engine_id;
    g.tp_rank = f.tp_rank;
    g.tp_size = f.tp_size;
    g.host = f.tp_host;
    g.address = address;
    g.join_timeout = absl::Seconds(f.tp_join_timeout_s);
    former = std::thread([&latch, g, store = tp_store.store, c = core->get()] {
      RunTpGroup(c, store, g, [&latch] { return latch.requested(); });
    });
  }
  std::unique_ptr<AgentRegistrar> registrar = StartRegistrar(f, *sec, *memory, core->get(), address);

  latch.Wait();
  if (registrar) registrar->Stop();
  if (former.joinable()) former.join();
  (*core)->Shutdown();
  (*server)->Shutdown(absl::Milliseconds(500));  // the core already failed every held request
  WSYNC_LOG(INFO) << "stopped; releasing " << memory->arena->where();
  return 0;
}

}  // namespace
}  // namespace wsync::ref_engine

int main(int argc, char** argv) {
  wsync::ref_engine::Flags f;
  CLI::App app{"wsync-ref-engine: the CPU reference rollout engine (one process per engine TP rank)"};
  app.add_option("--model", f.model, "HF config.json, or a directory holding one (default: --checkpoint)");
  app.add_option("--checkpoint", f.checkpoint,
                 "HF checkpoint directory (config.json + *.safetensors) served as version 0; none: NO_WEIGHTS "
                 "until the first sync");
  app.add_option("--quant-config", f.quant_config,
                 "quantization_config (INT4 or FP8; the object, or a config.json holding one), or 'none' "
                 "for bf16 (default: the model config's, else bf16)");
  app.add_option("--quant-variant", f.quant_variant, "INT4 scale rounding for bf16 weights quantized at load")
      ->check(CLI::IsMember({"qat", "slime"}));
  app.add_option("--tp-size", f.tp_size, "engine tensor-parallel size")->check(CLI::Range(1, 1024));
  app.add_option("--tp-rank", f.tp_rank, "this process's TP rank")->check(CLI::Range(0, 1023));
  app.add_option("--ep-size", f.ep_size, "MoE expert parallelism inside the TP group")->check(CLI::Range(1, 1024));
  app.add_flag("--mtp-draft", f.mtp_draft,
               "also hold the checkpoint's MTP layer model.layers.{L}.* as SGLang's NextN draft model does "
               "(speculative decoding); every sync must then deliver it");
  app.add_option("--engine-id", f.engine_id, "engine name, the same on every TP rank");
  app.add_option("--listen", f.listen, "RolloutEngine address (port 0 picks one)");
  app.add_option("--address-file", f.address_file, "write the bound HOST:PORT here");
  app.add_option("--agent", f.agent, "this rank's rollout agent (register and re-register)");
  app.add_option("--agent-file", f.agent_file,
                 "the file this rank's rollout agent writes its address to (its --address-file): re-read "
                 "before every registration, so an agent restarted on another port is found again");
  app.add_option("--tp-store", f.tp_store,
                 "TP rendezvous: rank 0 serves a store here (port 0 picks one), other ranks connect to it");
  app.add_option("--tp-host", f.tp_host, "address this rank's Gloo TP endpoint listens on");
  app.add_option("--token-file", f.sec.token_file, "bearer token (default $WSYNC_TOKEN; none: no auth)");
  app.add_option("--tls-cert", f.sec.tls_cert_file, "TLS certificate (server; client for mutual TLS)");
  app.add_option("--tls-key", f.sec.tls_key_file, "TLS private key");
  app.add_option("--tls-ca", f.sec.tls_ca_file, "TLS CA (server: of clients, then required; client: of servers)");
  app.add_option("--log-level", f.log_level, "debug|info|warning|error (default $WSYNC_LOG_LEVEL or info)");
  app.add_option("--hold-timeout-s", f.hold_timeout_s, "longest a Generate waits while paused (HOLD)");
  app.add_option("--version-wait-s", f.version_wait_s, "longest the TP ranks may disagree on the weight version");
  app.add_option("--heartbeat-ms", f.heartbeat_ms, "rank 0's idle heartbeat to the other ranks");
  app.add_option("--tp-idle-timeout-s", f.tp_idle_timeout_s, "a rank's longest silence from rank 0");
  app.add_option("--tp-join-timeout-s", f.tp_join_timeout_s,
                 "how long one formation of the TP group waits for every rank (then it starts over)");
  app.add_option("--agent-poll-ms", f.agent_poll_ms, "how often to check that the agent still knows us");
  app.add_option("--threads", f.threads, "threads for loading, repacking and preparing weights (0: all cores)");
  app.add_option("--test-step-delay-ms", f.test_step_delay_ms, "tests only: sleep before every forward pass")
      ->group("");
  app.add_option("--param-memory", f.param_memory,
                 "where the registered parameters live: shm (POSIX shared memory) or cuda:N (CUDA device N, "
                 "registered by IPC handle; the rollout agent repacks on the device)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  auto usage = [](const std::string& msg) {
    std::fprintf(stderr, "wsync-ref-engine: %s\n", msg.c_str());
    return 2;
  };
  if (f.model.empty() && f.checkpoint.empty()) return usage("--model or --checkpoint is required");
  absl::StatusOr<int> param_device = wsync::engine_memory::ParseParamMemory(f.param_memory);
  if (!param_device.ok()) return usage(absl::StrCat("--", param_device.status().message()));
  f.cuda_device = *param_device;
  if (f.tp_rank >= f.tp_size) return usage(absl::StrCat("--tp-rank ", f.tp_rank, " must be < --tp-size ", f.tp_size));
  if (f.tp_size > 1 && f.tp_store.empty()) return usage("--tp-size > 1 needs --tp-store");
  if (f.heartbeat_ms <= 0 || f.tp_idle_timeout_s * 1000 <= 2 * f.heartbeat_ms)
    return usage("--tp-idle-timeout-s must exceed two --heartbeat-ms periods");
  return wsync::ref_engine::Run(f);
}
