#include "trainer_agent/agent/trainer_agent.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "comm/bucket/broadcast_sink.h"
#include "comm/communicator.h"
#include "comm/store/store.h"
#include "common/buffer_pool.h"
#include "common/grpc_status.h"
#include "common/heap.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/net.h"
#include "common/status.h"
#include "common/units.h"
#include "kernels/dispatch.h"
#include "model/expert_map.h"
#include "plan/delivery_plan.h"
#include "plan/sharded_sink.h"
#include "trainer_agent/coordinator/coordinator.h"
#include "trainer_agent/coordinator/sync_keys.h"
#include "trainer_agent/gather/trainer_comms.h"
#include "trainer_agent/quantize/int4_quantizer.h"
#include "trainer_agent/source/dir_source.h"
#include "trainer_agent/source/shm_source.h"
#include "trainer_agent/sync/delta_sink.h"
#include "trainer_agent/sync/rank_sync.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::trainer_agent {
namespace {

// Whether the data plane `backend` moves device memory (nccl, cuda-ipc): its bucket buffers are device
// memory that is not freed while a sync's transfers run (comm/communicator.h, MovesDeviceMemory).
bool MovesDeviceMemory(const std::string& backend) {
  const absl::StatusOr<comm::Backend> b = comm::ParseBackend(backend);
  return b.ok() && comm::MovesDeviceMemory(*b);
}

enum : uint32_t { kSync = 1, kStop = 2 };

// The GPU the device data plane (nccl, cuda-ipc) of this rank uses: `chosen` (--cuda-device) when set, else the GPU
// its training process's tensors are read from in place (`resident`, the device stages: the
// buckets are built there), else the rank's local index on its host (the launcher's) modulo the
// GPUs it sees, the usual one GPU per local rank.
int DataPlaneDevice(int chosen, int resident) {
  if (chosen >= 0) return chosen;
  if (resident >= 0) return resident;
  int local = 0;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"}) {
    if (const char* v = std::getenv(var); v != nullptr && absl::SimpleAtoi(v, &local) && local >= 0) break;
    local = 0;
  }
  absl::StatusOr<int> devices = kernels::CudaDeviceCount();
  return devices.ok() && *devices > 0 ? local % *devices : 0;
}

// The command rank 0 broadcasts to every rank (a fixed-size POD).
struct Command {
  uint32_t type = 0;
  uint32_t num_agents = 0;
  uint64_t sync_id = 0;
  uint64_t version = 0;
  uint64_t timeout_ms = 0;
  char backend[16] = {};
  uint32_t sharded = 0;     // 1: sharded delivery; the receiver groups follow in a second Broadcast
  uint32_t num_groups = 0;  // receiver groups (sharded)
  uint32_t bucket_mac = 0;  // 1: buckets are authenticated with bucket_mac_key (comm/bucket/bucket_mac.h)
  char bucket_mac_key[comm::kBucketMacKeyBytes] = {};
  uint32_t quant_json_bytes = 0;  // SyncPlan::engine_quant_json, in a Broadcast after the groups
  // Delta delivery (SyncPlan::keep_delta_base, delta_base): 1: the stage sources keep a base and
  // send deltas from delta_base (0: in full); the receiver groups follow as in a sharded sync.
  uint32_t delta = 0;
  uint64_t delta_base = 0;
};

// One receiver group of a sharded sync (SyncPlan::receiver_groups, group_agents), broadcast after
// the Command.
struct GroupDesc {
  int32_t tp_size = 1, tp_rank = 0, ep_size = 1, agents = 0;
  int32_t mtp_draft = 0;  // 1: its engines serve the NextN draft too (EngineParallel::mtp_draft)
};

// Every rank adds 1 to its counter in the coordinator's store every kBeatPeriod, from a thread of its
// own: a rank whose counter stands still for a whole sync timeout is stopped or hung, and the sync's
// timeout error names it (a rank blocked in a collective behind it keeps beating).
constexpr absl::Duration kBeatPeriod = absl::Milliseconds(500);
std::string RankBeatKey(int rank) { return absl::StrCat("trainer/alive/", rank); }

// One rank's outcome, gathered to every rank after a sync.
struct RankResult {
  int32_t code = 0;
  int32_t source = 0;
  char message[464] = {};
  double seconds[7] = {};  // open, gather, convert, quantize, bucket, send_wait, total
  uint64_t bytes = 0, buckets = 0, tensors = 0;
  // A stage source of a delta sync (DeltaSink): the version its base holds now (0: none), and
  // what it sent (DeltaStats).
  uint64_t delta_held = 0, tensor_bytes = 0, sent_bytes = 0, delta_items = 0, changed_items = 0;
  // Quantization groups done or reused, reused, and done without digests (SyncReport).
  uint64_t quant_groups = 0, reused_groups = 0, undigested_groups = 0;
};
static_assert(sizeof(RankResult) % 8 == 0, "a POD gathered byte-wise");

constexpr const char* kPhaseNames[7] = {"open",   "gather",    "convert",      "quantize",
                                        "bucket", "send_wait", "trainer_total"};

// Rank 0's side of the command channel: the coordinator's sync thread hands a plan over and
// waits; the main loop broadcasts it and reports back.
class CommandChannel final : public TrainerSide {
 public:
  CommandChannel(int world, int stages, std::vector<int> senders)
      : world_(world), stages_(stages), senders_(std::move(senders)) {}
  int num_stages() const override { return stages_; }
  int num_senders(int stage) const override { return senders_[static_cast<size_t>(stage)]; }
  int world_size() const override { return world_; }

  // Hands the plan to the main loop and waits for its result until plan.deadline. A sync given up
  // on keeps running on the ranks (draining); its late result is dropped, and the next plan waits
  // in `pending_` until the main loop is free, so two syncs never run on the ranks at once.
  absl::StatusOr<TrainerReport> RunSync(const SyncPlan& plan) override {
    const std::vector<int64_t> beats_before = Beats();
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError("the trainer agents are shutting down");
    pending_ = plan;
    waiting_for_ = plan.sync_id;
    result_.reset();
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return result_.has_value() || closed_; };
    mu_.AwaitWithDeadline(absl::Condition(&done), plan.deadline);
    if (!result_.has_value()) {
      waiting_for_ = 0;
      const bool queued = pending_.has_value();
      pending_.reset();  // not yet picked up: it never starts
      if (closed_) return absl::UnavailableError("the trainer agents shut down during the sync");
      mu_.Unlock();  // the store calls below take time
      const std::string silent = SilentRanks(beats_before, Beats());
      mu_.Lock();
      return absl::DeadlineExceededError(absl::StrCat(
          silent, queued ? "the trainer ranks were still finishing an earlier sync when this one's timeout passed"
                         : "the trainer ranks did not finish the transfer within the sync's timeout (they finish it "
                           "in the background; the next sync waits for them)"));
    }
    // The error or the report, each taken out on its own (moving the whole StatusOr out of the
    // optional trips GCC 12's -Wmaybe-uninitialized at -O2).
    if (!result_->ok()) {
      absl::Status error = result_->status();
      result_.reset();
      return error;
    }
    TrainerReport report = std::move(**result_);
    result_.reset();
    return report;
  }

  uint64_t draining_sync() override {
    absl::MutexLock lock(&mu_);
    return running_ != waiting_for_ ? running_ : 0;
  }
  absl::Status AwaitIdle(absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0 || closed_; };
    mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
    if (closed_) return absl::UnavailableError("the trainer agents are shutting down");
    if (running_ != 0)
      return absl::DeadlineExceededError(
          absl::StrCat("the trainer ranks were still running sync ", running_,
                       " (given up on after its timeout) a whole sync timeout later; a rank may be hung (its "
                       "trainer agent's log and `wsyncctl status` name the ranks that stopped beating)"));
    return absl::OkStatus();
  }

  // Main loop: the next plan, or nullopt after `poll` without one.
  std::optional<SyncPlan> Next(absl::Duration poll) {
    absl::MutexLock lock(&mu_);
    auto has = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_.has_value(); };
    mu_.AwaitWithTimeout(absl::Condition(&has), poll);
    auto p = std::move(pending_);
    pending_.reset();
    if (p) running_ = p->sync_id;
    return p;
  }
  void Complete(uint64_t sync_id, absl::StatusOr<TrainerReport> r) {
    absl::MutexLock lock(&mu_);
    if (running_ == sync_id) running_ = 0;
    if (sync_id != waiting_for_) {
      WSYNC_LOG(WARNING) << "sync " << sync_id << " finished on the trainer ranks after its timeout: "
                         << (r.ok() ? absl::OkStatus() : r.status());
      return;
    }
    result_ = std::move(r);
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  // Where every rank's liveness counter is (RankBeat); set once the store exists.
  void SetStore(comm::Store* store) {
    absl::MutexLock lock(&mu_);
    store_ = store;
  }

 private:
  // Every rank's liveness counter now (-1: unreadable).
  std::vector<int64_t> Beats() {
    comm::Store* store = nullptr;
    {
      absl::MutexLock lock(&mu_);
      store = store_;
    }
    std::vector<int64_t> beats(static_cast<size_t>(world_), -1);
    if (store == nullptr) return beats;
    for (int r = 0; r < world_; ++r) {
      auto v = store->Add(RankBeatKey(r), 0);
      if (v.ok()) beats[static_cast<size_t>(r)] = *v;
    }
    return beats;
  }
  // "trainer rank R sent no liveness beat during the sync (stopped or hung); " for each rank whose
  // counter did not move between the two samples (a whole sync timeout apart).
  std::string SilentRanks(const std::vector<int64_t>& before, const std::vector<int64_t>& after) const {
    std::vector<std::string> silent;
    for (size_t r = 0; r < before.size(); ++r) {
      if (before[r] >= 0 && after[r] >= 0 && after[r] == before[r]) silent.push_back(absl::StrCat(r));
    }
    if (silent.empty()) return "";
    return absl::StrCat("trainer rank", silent.size() > 1 ? "s " : " ", absl::StrJoin(silent, ", "),
                        silent.size() > 1 ? " were" : " was",
                        " silent for the whole sync (no liveness beat: stopped or hung); ");
  }

  const int world_, stages_;
  const std::vector<int> senders_;  // per stage, spread senders (sharded delivery)
  comm::Store* store_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Mutex mu_;
  std::optional<SyncPlan> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::StatusOr<TrainerReport>> result_ ABSL_GUARDED_BY(mu_);
  uint64_t waiting_for_ ABSL_GUARDED_BY(mu_) = 0;  // the sync RunSync waits for (0: none)
  uint64_t running_ ABSL_GUARDED_BY(mu_) = 0;      // the sync the ranks are running (0: none)
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

void SetMessage(RankResult& r, const absl::Status& s) {
  r.code = static_cast<int32_t>(s.code());
  const std::string m(s.message());
  std::strncpy(r.message, m.c_str(), sizeof(r.message) - 1);
}

absl::Status FromResult(const RankResult& r, int rank) {
  return absl::Status(static_cast<absl::StatusCode>(r.code), absl::StrCat("trainer rank ", rank, ": ", r.message));
}

// Every rank: OK only if every rank's `s` is OK; else the first failing rank's error.
absl::Status Vote(comm::Communicator& world, const absl::Status& s, const comm::CollectiveOptions& options = {}) {
  RankResult mine;
  if (!s.ok()) SetMessage(mine, s);
  std::vector<RankResult> all(world.size());
  comm::ConstBytes in{&mine, sizeof(mine)};
  comm::MutableBytes out{all.data(), all.size() * sizeof(RankResult)};
  RETURN_IF_ERROR(comm::Await(world.AllGather({&in, 1}, {&out, 1}, options)));
  for (int r = 0; r < world.size(); ++r) {
    if (all[r].code != 0) return FromResult(all[r], r);
  }
  return absl::OkStatus();
}

class Agent {
 public:
  Agent(const TrainerAgentOptions& o, std::unique_ptr<comm::Communicator> world) : opts_(o), world_(std::move(world)) {}

  absl::Status Init(const std::atomic<bool>* stop) {
    absl::Status s;
    const WeightSource* src = nullptr;
    std::optional<DirSource> dir_source;
    if (absl::StartsWith(opts_.source, "dir:")) {
      dir_ = opts_.source.substr(4);
      auto d = DirSource::Open(dir_);
      s = d.status();
      if (d.ok()) dir_source = std::move(*d);
      src = dir_source ? &*dir_source : nullptr;
    } else if (absl::StartsWith(opts_.source, "shm:")) {
      // The training process of this rank registers its tensors (trainer_client); wait for it.
      auto shm = ShmSource::Start({.name = opts_.source.substr(4),
                                   .rank = world_->rank(),
                                   .world_size = world_->size(),
                                   .device_stages = opts_.device_stages,
                                   // TP / EP gathers on the GPUs need NCCL groups (EnsureDeviceComms)
                                   .device_gathers = comm::BackendCompiledIn(comm::Backend::kNccl)});
      s = shm.status();
      if (shm.ok()) {
        shm_ = std::move(*shm);
        s = shm_->WaitForRegistration(absl::InfiniteDuration(), stop);
        if (s.ok()) src = shm_.get();
      }
    } else {
      s = absl::InvalidArgumentError(
          absl::StrCat("unsupported weight source \"", opts_.source, "\" (dir:PATH or shm:NAME)"));
    }
    // Every rank must agree before the first collective that needs the layout (the Splits).
    if (s.ok() && src->parallel().world_size != world_->size()) {
      s = absl::InvalidArgumentError(absl::StrCat(src->Describe(), ": parallel.json says world_size ",
                                                  src->parallel().world_size, " but the world has ", world_->size(),
                                                  " ranks (mpirun -np, or --world-size)"));
    }
    RETURN_IF_ERROR(Vote(*world_, s));
    layout_ = std::make_unique<ParallelLayout>(src->layout());
    stages_ = src->parallel().pp;
    ASSIGN_OR_RETURN(comms_, MakeTrainerComms(*world_, *layout_));
    return absl::OkStatus();
  }

  absl::Status Run(const std::atomic<bool>* stop) {
    std::unique_ptr<Coordinator> coordinator;
    std::unique_ptr<CommandChannel> channel;
    if (world_->rank() == 0) {
      std::vector<int> senders;
      for (int p = 0; p < stages_; ++p) senders.push_back(static_cast<int>(StageSenders(*layout_, p, true).size()));
      channel = std::make_unique<CommandChannel>(world_->size(), stages_, std::move(senders));
      CoordinatorOptions co;
      co.listen = opts_.coordinator_listen.empty() ? opts_.coordinator : opts_.coordinator_listen;
      ASSIGN_OR_RETURN(const HostPort dial, SplitHostPort(opts_.coordinator));
      co.advertise_host = dial.host;
      co.security = opts_.security;
      co.backend = opts_.backend;
      ASSIGN_OR_RETURN(co.delivery, plan::ParseDelivery(opts_.delivery));
      ASSIGN_OR_RETURN(co.delta, ParseDeltaMode(opts_.delta));
      co.sync_timeout = opts_.sync_timeout;
      co.metrics = &MetricsRegistry::Global();
      co.state_dir = opts_.state_dir;
      co.bucket_mac = opts_.bucket_mac;
      ASSIGN_OR_RETURN(coordinator, Coordinator::Start(co, channel.get()));
      if (!opts_.address_file.empty()) {
        std::ofstream(opts_.address_file) << coordinator->address() << "\n";
      }
      std::printf("coordinator listening on %s\n", coordinator->address().c_str());
      std::fflush(stdout);
    }
    // Every rank reaches the store at the address rank 0 actually bound (the flag may say port 0).
    char address[256] = {};
    if (coordinator) std::strncpy(address, coordinator->address().c_str(), sizeof(address) - 1);
    comm::MutableBytes ab{address, sizeof(address)};
    RETURN_IF_ERROR(Annotate(comm::Await(world_->Broadcast({&ab, 1}, 0)), "sharing the coordinator's address"));
    store_ = comm::GrpcStoreClient::Connect(address, absl::Seconds(30), opts_.security);
    data_host_ = opts_.data_host;
    if (data_host_.empty()) {  // each rank's own address towards the coordinator
      auto facing = LocalAddressFacing(address);
      if (!facing.ok())
        return Annotate(facing.status(), "choosing the data-plane address facing the coordinator (give --data-host)");
      data_host_ = *facing;
    }
    WSYNC_LOG(INFO) << "coordinator at " << address << "; data plane on " << data_host_;
    std::jthread beat([this](std::stop_token st) {
      const std::string key = RankBeatKey(world_->rank());
      while (!st.stop_requested()) {
        (void)store_->Add(key, 1);  // a failure (coordinator gone) shows as silence; nothing to do here
        for (absl::Time until = absl::Now() + kBeatPeriod; !st.stop_requested() && absl::Now() < until;)
          absl::SleepFor(absl::Milliseconds(50));
      }
    });
    if (channel) channel->SetStore(store_.get());
    if (shm_) {
      const std::string coordinator = address;
      shm_->SetSyncRequester([this, coordinator](uint64_t version, bool wait, absl::Duration timeout) {
        return RequestSync(coordinator, version, wait, timeout);
      });
    }
    const comm::CollectiveOptions forever{absl::InfiniteDuration()};
    for (;;) {
      Command cmd;
      std::optional<SyncPlan> plan;
      if (world_->rank() == 0) {
        while (!plan && !stop->load()) plan = channel->Next(absl::Milliseconds(200));
        if (plan) {
          cmd.type = kSync;
          cmd.num_agents = static_cast<uint32_t>(plan->num_agents);
          cmd.sync_id = plan->sync_id;
          cmd.version = plan->version;
          cmd.timeout_ms = static_cast<uint64_t>(absl::ToInt64Milliseconds(plan->timeout));
          std::strncpy(cmd.backend, plan->backend.c_str(), sizeof(cmd.backend) - 1);
          cmd.sharded = plan->delivery == plan::Delivery::kSharded ? 1 : 0;
          cmd.num_groups = static_cast<uint32_t>(plan->receiver_groups.size());
          if (plan->bucket_mac_key.size() == sizeof(cmd.bucket_mac_key)) {
            cmd.bucket_mac = 1;
            std::memcpy(cmd.bucket_mac_key, plan->bucket_mac_key.data(), sizeof(cmd.bucket_mac_key));
          }
          cmd.quant_json_bytes = static_cast<uint32_t>(plan->engine_quant_json.size());
          cmd.delta = plan->keep_delta_base ? 1 : 0;
          cmd.delta_base = plan->delta_base;
        } else {
          cmd.type = kStop;
        }
      }
      comm::MutableBytes cb{&cmd, sizeof(cmd)};
      RETURN_IF_ERROR(Annotate(comm::Await(world_->Broadcast({&cb, 1}, 0, forever)), "command channel"));
      if (cmd.type == kStop) break;
      std::vector<GroupDesc> groups(cmd.num_groups);
      if (cmd.num_groups > 0) {
        if (world_->rank() == 0) {
          for (size_t g = 0; g < groups.size(); ++g) {
            const auto& p = plan->receiver_groups[g];
            groups[g] = {p.tp_size, p.tp_rank, p.ep_size, plan->group_agents[g], p.mtp_draft ? 1 : 0};
          }
        }
        comm::MutableBytes gb{groups.data(), groups.size() * sizeof(GroupDesc)};
        RETURN_IF_ERROR(Annotate(comm::Await(world_->Broadcast({&gb, 1}, 0, forever)), "command channel (groups)"));
      }
      std::string engine_quant(cmd.quant_json_bytes, '\0');
      if (cmd.quant_json_bytes > 0) {
        if (world_->rank() == 0) engine_quant = plan->engine_quant_json;
        comm::MutableBytes qb{engine_quant.data(), engine_quant.size()};
        RETURN_IF_ERROR(
            Annotate(comm::Await(world_->Broadcast({&qb, 1}, 0, forever)), "command channel (quantization)"));
      }
      auto report = RunSync(cmd, groups, engine_quant);
      // The sync's NCCL groups are gone: the device buckets kept during it can be freed now.
      if (MovesDeviceMemory(opts_.backend)) bucket_pool_.Trim();
      if (world_->rank() == 0) channel->Complete(cmd.sync_id, std::move(report));
      RequestHeapTrim();  // between syncs: what this one freed goes back to the kernel (common/heap.h)
    }
    if (channel) channel->Close();
    WSYNC_LOG(INFO) << "stopping";
    return absl::OkStatus();
  }

 private:
  // This rank's data-plane side of a sync: a stage's broadcast sink, or its sharded sink and plan.
  struct StageSinks {
    std::unique_ptr<comm::BroadcastSink> broadcast;     // broadcast delivery
    std::shared_ptr<const plan::ShardPlan> shard_plan;  // sharded delivery: the plan and its sink
    std::unique_ptr<plan::ShardedSink> sharded;         // (delta delivery: the receivers' layouts)
    std::unique_ptr<DeltaSink> delta;                   // delta delivery: in front of `broadcast`
    std::vector<DeltaSink*> group_deltas;               // sharded delta delivery: owned by `sharded`
    comm::BucketSink* out() const {
      if (sharded) return sharded.get();
      if (delta) return delta.get();
      return broadcast.get();
    }
  };

  // Sharded delivery on a sender of the stage (index `sender` of StageSenders): the plan over the
  // receiver groups (the engine layouts of the model it sends, with its quantization) and one
  // data-plane group per receiver group, named ShardGroupName, of 1 + its agents.
  // `make_sink(name, size)` forms one group.
  template <typename MakeSink>
  absl::Status MakeShardedSink(const Command& cmd, const std::vector<GroupDesc>& groups, const WeightSource& src,
                               int stage, int sender, MakeSink& make_sink, StageSinks* out) {
    RETURN_IF_ERROR(Annotate(PlanReceivers(groups, src, "sharded delivery"), "sharded delivery"));
    out->shard_plan = plan_;
    std::vector<std::unique_ptr<comm::BucketSink>> sinks;
    std::vector<comm::BroadcastSink*> raw;
    // Delta delivery: each group's stream through a DeltaSink of its own, over the blocks cut for
    // that group, with a base per receiver layout (what this rank last sent that group).
    std::map<std::string, DeltaBase> bases;
    for (size_t g = 0; g < groups.size() && cmd.delta; ++g) {
      const std::string key = GroupKey(groups[g]);
      auto kept = shard_bases_.extract(key);
      bases[key] = kept.empty() ? DeltaBase() : std::move(kept.mapped());
    }
    shard_bases_ = std::move(bases);  // the bases of layouts no longer sent to: their memory back
    for (size_t g = 0; g < groups.size(); ++g) {
      auto made = make_sink(ShardGroupName(cmd.sync_id, stage, sender, static_cast<int>(g)), groups[g].agents + 1);
      if (!made.ok()) {
        out->group_deltas.clear();  // owned by `sinks`, gone with it
        return Annotate(made.status(),
                        absl::StrCat("stage ", stage, " data-plane group of receiver group ", g, " (engine TP rank ",
                                     groups[g].tp_rank, " of ", groups[g].tp_size, ")"));
      }
      raw.push_back(made->get());
      if (cmd.delta && (*made)->space().host()) {
        auto d =
            std::make_unique<DeltaSink>(std::move(*made), shard_bases_[GroupKey(groups[g])],
                                        std::vector{&plan_->layout(static_cast<int>(g))}, cmd.delta_base, cmd.version);
        out->group_deltas.push_back(d.get());
        sinks.push_back(std::move(d));
      } else {
        sinks.push_back(std::move(*made));
      }
    }
    if (cmd.delta && out->group_deltas.empty() && !groups.empty()) {
      WSYNC_LOG(WARNING) << "sync " << cmd.sync_id << ": deltas are sent from host buckets only; this one's are in "
                         << raw[0]->space().Name() << ": sent in full";
      shard_bases_.clear();
    }
    out->sharded = std::make_unique<plan::ShardedSink>(out->shard_plan.get(), std::move(sinks), std::move(raw));
    return absl::OkStatus();
  }

  // A receiver group's engine-rank layout, naming its delta base (sharded delivery).
  static std::string GroupKey(const GroupDesc& g) {
    return absl::StrCat(g.tp_size, "/", g.tp_rank, "/", g.ep_size, g.mtp_draft ? "/mtp-draft" : "");
  }

  // plan_: the engine layouts of the receiver groups (of the model it sends, with its quantization),
  // for sharded and delta delivery.
  // `what` names the delivery in the log line.
  absl::Status PlanReceivers(const std::vector<GroupDesc>& groups, const WeightSource& src, const char* what) {
    std::vector<engine_model::EngineParallel> parallel;
    for (const GroupDesc& g : groups) parallel.push_back({g.tp_size, g.tp_rank, g.ep_size, g.mtp_draft != 0});
    const std::optional<QuantizationConfig>& q = sync_quant_;
    // The plan is computed once and kept while the receiver groups, the model and the quantization
    // stay the same (the membership decides the groups): building one engine layout per group
    // costs about a second for a 1T model.
    std::string key =
        absl::StrCat(src.config_json(), "\n", QuantFingerprint(q ? &*q : nullptr, kernels::QuantVariant::kQat), "\n",
                     opts_.expert_map ? opts_.expert_map->Canonical() : "experts: all");
    for (const GroupDesc& g : groups)
      absl::StrAppend(&key, "\n", g.tp_size, "/", g.tp_rank, "/", g.ep_size, g.mtp_draft ? "/mtp-draft" : "");
    if (plan_ == nullptr || key != plan_key_) {
      // Expert pruning: the engines serve the pruned model, so their layouts are its layouts.
      std::optional<ModelConfig> pruned;
      if (opts_.expert_map) {
        auto json = model::PrunedConfigJson(src.config_json(), *opts_.expert_map, "the pruned model");
        auto parsed = json.ok() ? ParseModelConfig(*json, "the pruned model") : json.status();
        if (!parsed.ok()) return parsed.status();
        pruned = std::move(*parsed);
      }
      const absl::Time t0 = absl::Now();
      auto p = plan::ShardPlan::Create(pruned ? *pruned : src.model(), q ? &*q : nullptr, parallel);
      if (!p.ok()) return p.status();
      plan_ = std::make_shared<const plan::ShardPlan>(std::move(*p));
      plan_key_ = std::move(key);
      WSYNC_LOG(INFO) << what << ": planned " << groups.size() << " receiver groups in "
                      << absl::FormatDuration(absl::Now() - t0) << " (kept until the groups or the model change)";
    }
    return absl::OkStatus();
  }

  // One sync on this rank: 1. the source and the stage groups, voted on; 2. the sync itself;
  // 3. every rank's result to every rank (rank 0 reports them to the coordinator).
  absl::StatusOr<TrainerReport> RunSync(const Command& cmd, const std::vector<GroupDesc>& groups,
                                        const std::string& engine_quant) {
    const int rank = world_->rank();
    const int stage = layout_->Dense(rank).pp;
    const int sender = SenderIndex(cmd, rank, stage);
    LogSyncStart(cmd, groups, stage, sender);
    const absl::Duration timeout = absl::Milliseconds(cmd.timeout_ms);
    // The world's collectives of a sync wait for the slowest rank, and a stage source legitimately
    // spends a bounded time elsewhere first: up to join_timeout forming its data-plane group (before
    // the vote), up to `timeout` in a failing data-plane operation and then the rest of its share,
    // drained without sending (before the results). A world collective that timed out first would
    // break the trainer job's communicator for good, so theirs are longer (still bounded).
    const absl::Duration join_timeout = std::min(timeout, absl::Minutes(2));
    const comm::CollectiveOptions vote_bound{join_timeout + absl::Seconds(30)};
    const comm::CollectiveOptions results_bound{2 * timeout + absl::Minutes(1)};

    // 1. Re-read the source (dir:) and form the stage groups; vote.
    std::optional<DirSource> dir_source;
    const WeightSource* src = shm_.get();
    absl::Status s = OpenSyncSource(cmd, engine_quant, &dir_source, &src);
    StageSinks sinks;
    if (s.ok() && sender >= 0) s = MakeStageSinks(cmd, groups, *src, stage, sender, join_timeout, &sinks);
    s = Vote(*world_, s, vote_bound);

    // 2. The sync itself.
    RankResult mine;
    mine.source = sender >= 0;
    if (s.ok()) {
      SendStage(cmd, *src, sinks, mine);
    } else {
      SetMessage(mine, s);
    }
    sinks.delta.reset();
    sinks.broadcast.reset();
    sinks.group_deltas.clear();
    sinks.sharded.reset();

    // 3. Results to every rank.
    return GatherResults(cmd, mine, results_bound);
  }

  // Sharded delivery spreads the stage over its senders (StageSenders): this rank's index there;
  // broadcast delivery: 0 on the stage source. -1: this rank sends nothing.
  int SenderIndex(const Command& cmd, int rank, int stage) const {
    const bool is_source = layout_->IsStageSource(rank);
    int sender = is_source ? 0 : -1;
    if (cmd.sharded) {
      const std::vector<int> senders = StageSenders(*layout_, stage, true);
      auto at = std::find(senders.begin(), senders.end(), rank);
      sender = at == senders.end() ? -1 : static_cast<int>(at - senders.begin());
    }
    return sender;
  }

  void LogSyncStart(const Command& cmd, const std::vector<GroupDesc>& groups, int stage, int sender) const {
    const bool is_source = layout_->IsStageSource(world_->rank());
    WSYNC_LOG(INFO) << "sync " << cmd.sync_id << " (version " << cmd.version << ")"
                    << (sender >= 0
                            ? absl::StrCat(": ", is_source ? "source" : absl::StrCat("sender ", sender), " of stage ",
                                           stage, " for ", cmd.num_agents, " agents",
                                           cmd.sharded ? absl::StrCat(" in ", groups.size(), " receiver groups") : "")
                            : "")
                    << (opts_.expert_map ? absl::StrCat(", experts pruned to ", opts_.expert_map->kept(), " of ",
                                                        opts_.expert_map->num_experts, " per layer")
                                         : "");
  }

  // The sync's weight source (the shm: source, or the dir: source re-read into `dir_source`) and
  // quantization (sync_quant_: SyncQuantization of --quant-config and what the engines declare).
  absl::Status OpenSyncSource(const Command& cmd, const std::string& engine_quant, std::optional<DirSource>* dir_source,
                              const WeightSource** src) {
    if (!shm_) {
      auto d = DirSource::Open(dir_);
      if (!d.ok()) return d.status();
      *dir_source = std::move(*d);
      *src = &**dir_source;
    }
    absl::StatusOr<std::optional<QuantizationConfig>> q = SyncQuantization(opts_.quant, engine_quant);
    if (!q.ok()) return q.status();
    sync_quant_ = *std::move(q);
    if (world_->rank() == 0)
      WSYNC_LOG(INFO) << "sync " << cmd.sync_id << ": " << (sync_quant_ ? sync_quant_->Describe() : "bf16")
                      << (opts_.quant ? " (--quant-config, what the engines declare)" : " (as the engines declare)");
    return absl::OkStatus();
  }

  // One data-plane group (and sink) of `size` ranks named `name`, this rank its rank 0.
  absl::StatusOr<std::unique_ptr<comm::BroadcastSink>> MakeGroupSink(const Command& cmd, const std::string& name,
                                                                     int size, absl::Duration join_timeout) {
    const absl::Duration timeout = absl::Milliseconds(cmd.timeout_ms);
    comm::GroupOptions g;
    g.store = store_.get();
    g.name = name;
    g.rank = 0;
    g.size = size;
    g.host = data_host_;
    g.cuda_device = DataPlaneDevice(opts_.cuda_device, shm_ != nullptr ? shm_->resident_device() : -1);
    g.join_timeout = join_timeout;
    g.default_timeout = timeout;
    // A sync the coordinator gave up on: its agents have aborted and will never join.
    g.cancelled = [store = store_.get(), key = SyncAbandonedKey(cmd.sync_id)] {
      absl::StatusOr<int64_t> v = store->Add(key, 0);
      return v.ok() && *v > 0;
    };
    ASSIGN_OR_RETURN(const comm::Backend backend, comm::ParseBackend(cmd.backend));
    std::optional<comm::BucketMac> mac;
    if (cmd.bucket_mac) {
      ASSIGN_OR_RETURN(mac, comm::BucketMac::ForStream({cmd.bucket_mac_key, sizeof(cmd.bucket_mac_key)}, name));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> comm, comm::CreateGroup(backend, g));
    return std::make_unique<comm::BroadcastSink>(std::move(comm), store_.get(), SyncProgressPrefix(cmd.sync_id),
                                                 comm::CollectiveOptions{timeout}, &bucket_pool_, std::move(mac));
  }

  // A sender's data-plane groups of the sync: the stage's one group (broadcast), or one per
  // receiver group (sharded).
  absl::Status MakeStageSinks(const Command& cmd, const std::vector<GroupDesc>& groups, const WeightSource& src,
                              int stage, int sender, absl::Duration join_timeout, StageSinks* sinks) {
    auto make_sink = [&](const std::string& name, int size) { return MakeGroupSink(cmd, name, size, join_timeout); };
    if (cmd.sharded) {
      delta_base_ = DeltaBase();  // the broadcast base: its memory back
      if (!cmd.delta) shard_bases_.clear();
      return MakeShardedSink(cmd, groups, src, stage, sender, make_sink, sinks);
    }
    shard_bases_.clear();
    auto made = make_sink(SyncGroupName(cmd.sync_id, stage), static_cast<int>(cmd.num_agents) + 1);
    if (!made.ok()) return Annotate(made.status(), absl::StrCat("stage ", stage, " data-plane group"));
    sinks->broadcast = std::move(*made);
    return MakeDeltaSink(cmd, groups, src, sinks);
  }

  // Delta delivery (DeltaSink) in front of a host broadcast sink: deltas from cmd.delta_base (the
  // base this rank keeps across syncs, delta_base_), summed for each receiver group's layout. A
  // sync without it drops the base (its memory back; the next delta sync starts in full).
  absl::Status MakeDeltaSink(const Command& cmd, const std::vector<GroupDesc>& groups, const WeightSource& src,
                             StageSinks* sinks) {
    if (!cmd.delta || !sinks->broadcast->space().host()) {
      if (cmd.delta)
        WSYNC_LOG(WARNING) << "sync " << cmd.sync_id << ": deltas are sent from host buckets only; this one is "
                           << sinks->broadcast->space().Name() << ": sent in full";
      delta_base_ = DeltaBase();
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(Annotate(PlanReceivers(groups, src, "delta delivery"), "delta delivery"));
    sinks->shard_plan = plan_;
    std::vector<const engine_model::EngineLayout*> receivers;
    for (int g = 0; g < plan_->num_groups(); ++g) receivers.push_back(&plan_->layout(g));
    sinks->delta =
        std::make_unique<DeltaSink>(*sinks->broadcast, delta_base_, std::move(receivers), cmd.delta_base, cmd.version);
    return absl::OkStatus();
  }

  // What this rank's DeltaSinks sent (broadcast: one; sharded: one per receiver group) into `mine`,
  // and logged; the version every one of its bases holds now (0 if any holds none).
  void NoteDeltas(const Command& cmd, const StageSinks& sinks, SyncReport& report, RankResult& mine) const {
    std::vector<const DeltaSink*> all(sinks.group_deltas.begin(), sinks.group_deltas.end());
    if (sinks.delta) all.push_back(sinks.delta.get());
    if (all.empty()) return;
    DeltaStats d;
    for (const DeltaSink* s : all) {
      const DeltaStats& one = s->stats();
      d.entries += one.entries;
      d.delta_entries += one.delta_entries;
      d.tensor_bytes += one.tensor_bytes;
      d.sent_bytes += one.sent_bytes;
      d.items += one.items;
      d.changed_items += one.changed_items;
    }
    uint64_t held = cmd.version, base_bytes = delta_base_.bytes();
    for (const auto& [key, base] : shard_bases_) base_bytes += base.bytes();
    if (sinks.delta && delta_base_.version() != cmd.version) held = 0;
    for (const auto& [key, base] : shard_bases_)
      if (!sinks.group_deltas.empty() && base.version() != cmd.version) held = 0;
    if (sinks.sharded)  // what left this rank: the groups' cut bytes, less what their deltas saved
      report.bytes -= std::min(report.bytes, d.tensor_bytes - d.sent_bytes);
    mine.delta_held = held;
    mine.tensor_bytes = d.tensor_bytes;
    mine.sent_bytes = d.sent_bytes;
    mine.delta_items = d.items;
    mine.changed_items = d.changed_items;
    WSYNC_LOG(INFO)
        << "sync " << cmd.sync_id << ": " << d.delta_entries << " of " << d.entries
        << (sinks.sharded ? " blocks" : " tensors") << " as deltas from version " << cmd.delta_base << ", "
        << FormatBytes(d.sent_bytes) << " of " << FormatBytes(d.tensor_bytes) << " sent (" << d.changed_items << " of "
        << d.items << " elements changed); " << report.reused_groups << " of " << report.quant_groups
        << " quantization groups (INT4 groups, FP8 blocks or rows, AWQ units) reused, not quantized (inputs "
           "unchanged), "
        << report.undigested_groups
        << " quantized without digests (paused where reuse did not pay: --reuse-pause-below); the bases hold "
        << FormatBytes(base_bytes) << ", the quantization memo " << FormatBytes(quant_memo_.bytes());
  }

  // RunRankSync into this rank's sinks; its times and counts (or its error) into `mine`.
  void SendStage(const Command& cmd, const WeightSource& src, const StageSinks& sinks, RankResult& mine) {
    const absl::Duration timeout = absl::Milliseconds(cmd.timeout_ms);
    SyncOptions so;
    so.version = cmd.version;
    so.bucket_bytes = opts_.bucket_bytes;
    so.quant = sync_quant_ ? &*sync_quant_ : nullptr;
    so.quant_threads = opts_.quant_threads;
    so.expert_map = opts_.expert_map ? &*opts_.expert_map : nullptr;
    // The TP/EP gathers wait for peers that may be stuck up to `timeout` in a failing data-plane
    // operation (then drain): longer than that, or the failure would break these communicators.
    so.collective = comm::CollectiveOptions{timeout + absl::Minutes(1)};
    so.workspace = &workspace_;
    so.spread_senders = cmd.sharded != 0;
    so.quantized_base = sinks.delta ? &delta_base_ : nullptr;
    if (!cmd.delta) quant_memo_.Clear();  // only delta syncs keep it: its memory back
    quant_memo_.set_pause_below(opts_.reuse_pause_below);
    so.quant_memo = cmd.delta ? &quant_memo_ : nullptr;
    auto report = RunRankSync(src, comms_, sinks.out(), so);
    if (report.ok() && sinks.broadcast && !sinks.broadcast->status().ok()) report = sinks.broadcast->status();
    if (report.ok() && sinks.sharded && !sinks.sharded->status().ok()) report = sinks.sharded->status();
    if (report.ok() && sinks.sharded) {
      // What left this rank: every group's share (the builder's bytes are the full buckets).
      report->bytes = 0;
      for (uint64_t b : sinks.sharded->group_bytes()) report->bytes += b;
    }
    if (report.ok()) {
      mine.quant_groups = report->quant_groups;
      mine.reused_groups = report->reused_groups;
      mine.undigested_groups = report->undigested_groups;
      NoteDeltas(cmd, sinks, *report, mine);
    }
    if (!report.ok()) {
      SetMessage(mine, report.status());
      return;
    }
    const absl::Duration d[7] = {report->open,   report->gather,    report->convert, report->quantize,
                                 report->bucket, report->send_wait, report->total};
    for (int i = 0; i < 7; ++i) mine.seconds[i] = absl::ToDoubleSeconds(d[i]);
    mine.bytes = report->bytes;
    mine.buckets = report->buckets;
    mine.tensors = report->tensors;
    if (report->source && report->cuda_device >= 0)
      WSYNC_LOG(INFO) << "sync " << cmd.sync_id << ": stage source on cuda:" << report->cuda_device << " ("
                      << report->quantized_bytes << " bytes through the CUDA INT4 kernels, "
                      << absl::FormatDuration(report->staging) << " staging " << report->bytes
                      << (report->staging > absl::ZeroDuration() ? " bucket bytes to the host)"
                                                                 : " bucket bytes, sent from the device)");
  }

  // Every rank's result to every rank: the first rank's error (in rank order), else the report
  // (the slowest stage source's phases, the sums of the counts).
  absl::StatusOr<TrainerReport> GatherResults(const Command& cmd, const RankResult& mine,
                                              const comm::CollectiveOptions& results_bound) {
    std::vector<RankResult> all(world_->size());
    comm::ConstBytes in{&mine, sizeof(mine)};
    comm::MutableBytes out{all.data(), all.size() * sizeof(RankResult)};
    RETURN_IF_ERROR(comm::Await(world_->AllGather({&in, 1}, {&out, 1}, results_bound)));
    for (int r = 0; r < world_->size(); ++r) {
      if (all[r].code != 0) return FromResult(all[r], r);
    }
    TrainerReport report;
    for (int i = 0; i < 7; ++i) {
      PhaseTime p{kPhaseNames[i], 0, 0};
      for (const auto& r : all) {
        if (r.source) p.seconds = std::max(p.seconds, r.seconds[i]);  // stages run in parallel
      }
      report.phases.push_back(p);
    }
    report.delta_held = cmd.delta ? cmd.version : 0;
    for (const auto& r : all) {
      report.bytes += r.bytes;
      report.buckets += r.buckets;
      report.tensors += r.tensors;
      report.quant_groups += r.quant_groups;  // the stage sources' and the experts' holders'
      report.reused_groups += r.reused_groups;
      report.undigested_groups += r.undigested_groups;
      if (!r.source) continue;
      if (r.delta_held != cmd.version) report.delta_held = 0;  // every stage source must hold it
      report.tensor_bytes += r.tensor_bytes;
      report.sent_bytes += r.sent_bytes;
      report.delta_items += r.delta_items;
      report.changed_items += r.changed_items;
    }
    report.phases.back().bytes = report.bytes;
    WSYNC_LOG(INFO) << "sync " << cmd.sync_id << " done on this rank: " << FormatBytes(mine.bytes) << " (" << mine.bytes
                    << " bytes) sent in " << mine.seconds[6] << " s";
    return report;
  }

  // A training process's sync request (shm: source), forwarded to the coordinator: TriggerSync
  // (queued behind a running sync; requests for the same version coalesce), then, with `wait`,
  // WatchSync until the sync has ended.
  absl::StatusOr<SyncRequestResult> RequestSync(const std::string& coordinator, uint64_t version, bool wait,
                                                absl::Duration timeout) {
    const absl::Duration bound = std::min(timeout, absl::Hours(24));
    auto stub = v1::Coordinator::NewStub(MakeChannel(coordinator, opts_.security));
    grpc::ClientContext ctx;
    PrepareContext(&ctx, opts_.security, std::min(bound, absl::Seconds(30)));
    v1::TriggerSyncRequest req;
    req.set_version(version);
    req.set_wait_if_busy(true);
    v1::TriggerSyncReply reply;
    RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub->TriggerSync(&ctx, req, &reply)), "requesting a sync"));
    SyncRequestResult result{reply.sync_id(), reply.version(), reply.coalesced()};
    WSYNC_LOG(INFO) << "the training process asked for version " << version << ": sync " << result.sync_id
                    << (result.coalesced ? " (already requested)" : " queued");
    if (!wait) return result;
    grpc::ClientContext wctx;
    PrepareContext(&wctx, opts_.security, bound);
    v1::WatchSyncRequest w;
    w.set_sync_id(result.sync_id);
    auto reader = stub->WatchSync(&wctx, w);
    v1::SyncEvent e, last;
    while (reader->Read(&e)) last = e;
    RETURN_IF_ERROR(Annotate(FromGrpcStatus(reader->Finish()), absl::StrCat("watching sync ", result.sync_id)));
    if (last.phase() == "partial") {  // the version is published; the engines left behind catch up
      WSYNC_LOG(WARNING) << "sync " << result.sync_id << " (version " << result.version
                         << ") was committed on part of the fleet: " << last.error();
    } else if (last.phase() != "done") {
      return absl::AbortedError(absl::StrCat("sync ", result.sync_id, " (version ", result.version, ") ",
                                             last.phase().empty() ? "did not finish" : last.phase(), ": ",
                                             last.error()));
    }
    return result;
  }

  TrainerAgentOptions opts_;
  std::unique_ptr<comm::Communicator> world_;
  std::unique_ptr<ShmSource> shm_;  // shm: source (else dir_ is re-read every sync)
  std::string dir_;
  std::unique_ptr<ParallelLayout> layout_;
  int stages_ = 1;
  TrainerComms comms_;
  SyncWorkspace workspace_;  // gather buffers kept across syncs
  // Sharded delivery: the plan of the last sharded sync, and what it was made for.
  std::shared_ptr<const plan::ShardPlan> plan_;
  std::string plan_key_;
  DeltaBase delta_base_;  // delta delivery on a stage source: what it last sent (sync/delta_sink.h)
  // Sharded delta delivery on a sender: what it last sent each receiver layout (GroupKey).
  std::map<std::string, DeltaBase> shard_bases_;
  QuantMemo quant_memo_;  // delta syncs: what this rank quantized where no delta base holds it (QuantMemo)
  std::optional<QuantizationConfig> sync_quant_;  // the running sync's (SyncQuantization)
  // Bucket buffers (stage sources only): two on the wire + the one being built. Kept across syncs,
  // except over nccl: device buffers, none freed while the sync's groups run (a cudaFree waits for
  // the whole device), all of them after it.
  BufferPool bucket_pool_{3, nullptr, /*keep_until_trim=*/MovesDeviceMemory(opts_.backend)};
  std::unique_ptr<comm::Store> store_;
  std::string data_host_;  // Run(): --data-host, else the address facing the coordinator
};

}  // namespace

namespace {

// The world of a launcher without mpirun (TrainerAgentOptions::world_size): a Gloo group through the
// store rank 0 serves. Owns the store (and rank 0's server), which the world's Splits use too: it
// must outlive every communicator made from it.
struct StoreWorld {
  std::unique_ptr<comm::MemoryStore> memory;  // rank 0
  std::unique_ptr<comm::StoreServer> server;  // rank 0
  std::unique_ptr<comm::Store> client;        // the other ranks
  comm::Store* store = nullptr;
};

absl::StatusOr<std::unique_ptr<comm::Communicator>> FormStoreWorld(const TrainerAgentOptions& o, StoreWorld& w,
                                                                   const std::atomic<bool>* stop) {
  if (o.world_rank < 0 || o.world_rank >= o.world_size || o.world_store.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("a world of ", o.world_size, " ranks without mpirun needs --rank (0 to ", o.world_size - 1,
                     "; got ", o.world_rank, ") and --world-store HOST:PORT (rank 0 serves it)"));
  RETURN_IF_ERROR(SplitHostPort(o.world_store).status());
  if (o.world_rank == 0) {
    w.memory = std::make_unique<comm::MemoryStore>();
    auto server = comm::StoreServer::Start(w.memory.get(), o.world_store, o.security);
    if (!server.ok())
      return Annotate(server.status(), absl::StrCat("rank 0 serving the world's store on ", o.world_store));
    w.server = std::move(*server);
    w.store = w.memory.get();
  } else {
    // Rank 0 may start later than this rank: the first calls wait for it up to the join timeout.
    w.client =
        comm::GrpcStoreClient::Connect(o.world_store, std::max(absl::Seconds(30), o.world_join_timeout), o.security);
    w.store = w.client.get();
  }
  comm::GroupOptions g;
  g.store = w.store;
  g.name = "world";
  g.rank = o.world_rank;
  g.size = o.world_size;
  g.host = o.data_host;
  if (g.host.empty()) {
    auto facing = LocalAddressFacing(o.world_store);
    if (!facing.ok())
      return Annotate(facing.status(), "choosing the address facing the world's store (give --data-host)");
    g.host = *facing;
  }
  g.join_timeout = o.world_join_timeout;
  g.default_timeout = o.sync_timeout;
  g.cancelled = [stop] { return stop != nullptr && stop->load(); };
  WSYNC_LOG(INFO) << "rank " << o.world_rank << " of " << o.world_size << ": forming the world through "
                  << (o.world_rank == 0 ? "its store on " : "rank 0's store at ") << o.world_store;
  return comm::CreateGroup(comm::Backend::kGloo, g);
}

}  // namespace

absl::Status RunTrainerAgent(const TrainerAgentOptions& options, const std::atomic<bool>* stop) {
  StoreWorld store_world;  // before the world: its Splits form their groups through the store
  std::unique_ptr<comm::Communicator> world;
  if (options.world_size > 0) {
    ASSIGN_OR_RETURN(world, FormStoreWorld(options, store_world, stop));
  } else {
    comm::MpiOptions mo;
    mo.default_timeout = options.sync_timeout;
    ASSIGN_OR_RETURN(world, comm::CreateMpiWorld(mo));
  }
  SetLogIdentity("trainer", world->rank());
  Agent agent(options, std::move(world));
  absl::Status s = agent.Init(stop);
  if (!s.ok()) return s;
  std::unique_ptr<MetricsServer> metrics;
  if (options.metrics_port >= 0) {
    metrics = std::make_unique<MetricsServer>(&MetricsRegistry::Global());
    RETURN_IF_ERROR(metrics->Start(options.metrics_host, options.metrics_port));
  }
  return agent.Run(stop);
}

}  // namespace wsync::trainer_agent
