#include "trainer_agent/sync/rank_sync.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/bucket/space_staging.h"
#include "common/checksum.h"
#include "common/cuda_ipc.h"
#include "common/logging.h"
#include "common/memory_space.h"
#include "common/status.h"
#include "model/quant_target.h"
#include "trainer_agent/convert/expert_prune.h"
#include "trainer_agent/convert/hf_convert.h"
#include "trainer_agent/convert/shard_layout.h"
#include "trainer_agent/quantize/int4_quantizer.h"

namespace wsync::trainer_agent {
namespace {

constexpr uint64_t kRegionAlignment = 64;
constexpr size_t kMaxAgreedMessage = 4096;

uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// --- The opening agreement ----------------------------------------------------------------------

uint64_t Hash(absl::string_view text) {
  return Xxh3_64({reinterpret_cast<const std::byte*>(text.data()), text.size()});
}

// Where this rank's tensors are: its host, and for a CUDA device the physical GPU (its PCI bus id:
// two processes with different CUDA_VISIBLE_DEVICES number one GPU differently).
RankPlace PlaceOf(int device) {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  RankPlace p;
  p.host = Hash(name);
  p.device = device;
  if (device >= 0) {
    absl::StatusOr<std::string> bus = DevicePciBusId(device);
    p.gpu = Hash(bus.ok() ? *bus : absl::StrCat("cuda:", device));
  }
  return p;
}

struct StartRecord {
  int32_t code = 0;
  uint32_t message_bytes = 0;
  uint64_t fingerprint = 0;
  uint64_t host = 0;
  uint64_t gpu = 0;
  int32_t device = -1;
  int32_t reserved = 0;
};
static_assert(sizeof(StartRecord) == 40);

// Every rank learns every rank's opening status, and where its tensors are (`places`, by world
// rank); all return the same result.
absl::Status AgreeOnStart(comm::Communicator& world, const absl::Status& local, uint64_t fingerprint, RankPlace place,
                          const comm::CollectiveOptions& options, std::vector<RankPlace>* places) {
  const std::string message(local.message().substr(0, kMaxAgreedMessage));
  StartRecord mine;
  mine.code = static_cast<int32_t>(local.code());
  mine.message_bytes = static_cast<uint32_t>(message.size());
  mine.fingerprint = fingerprint;
  mine.host = place.host;
  mine.gpu = place.gpu;
  mine.device = place.device;
  std::vector<StartRecord> all(static_cast<size_t>(world.size()));
  comm::ConstBytes in{&mine, sizeof(mine)};
  comm::MutableBytes out{all.data(), all.size() * sizeof(StartRecord)};
  RETURN_IF_ERROR(Annotate(comm::Await(world.AllGather({&in, 1}, {&out, 1}, options)),
                           "agreeing with every rank that all shards opened"));
  std::vector<int> failed;
  for (int r = 0; r < world.size(); ++r)
    if (all[static_cast<size_t>(r)].code != 0) failed.push_back(r);
  if (failed.empty()) {
    for (int r = 1; r < world.size(); ++r)
      if (all[static_cast<size_t>(r)].fingerprint != all[0].fingerprint)
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", r,
            " runs a different weight source config or sync options than rank 0 (config.json, "
            "parallel.json, gather size, quantization config or expert map differ): the ranks would not agree on "
            "their collectives"));
    places->clear();
    for (const StartRecord& r : all) places->push_back({r.host, r.device, r.gpu});
    return absl::OkStatus();
  }
  std::vector<size_t> sizes(all.size());
  size_t total = 0;
  for (size_t r = 0; r < all.size(); ++r) total += sizes[r] = all[r].message_bytes;
  std::string messages(total, '\0');
  if (total > 0) {
    comm::ConstBytes min{message.data(), message.size()};
    comm::MutableBytes mout{messages.data(), messages.size()};
    RETURN_IF_ERROR(
        Annotate(comm::Await(world.AllGatherV(min, mout, sizes, options)), "gathering the ranks' opening errors"));
  }
  const int first = failed.front();
  size_t offset = 0;
  for (int r = 0; r < first; ++r) offset += sizes[static_cast<size_t>(r)];
  std::string text = absl::StrCat("rank ", first, " cannot take part in the sync: ",
                                  absl::string_view(messages).substr(offset, sizes[static_cast<size_t>(first)]));
  if (failed.size() > 1) {
    std::vector<int> others(failed.begin() + 1, failed.begin() + std::min<size_t>(failed.size(), 9));
    absl::StrAppend(&text, " (", failed.size() - 1, " more rank(s) failed too: ", absl::StrJoin(others, ", "),
                    failed.size() > 9 ? ", ..." : "", ")");
  }
  return absl::Status(static_cast<absl::StatusCode>(all[static_cast<size_t>(first)].code), text);
}

// --- Gather schedule ----------------------------------------------------------------------------

// One parameter of a batch. Regions are 64-byte aligned.
struct Item {
  int index = 0;          // into RankShard::params / tensors
  int ordinal = 0;        // experts: position among the rank's expert parameters
  bool pruned = false;    // experts: this rank's own expert is pruned (its block is not filled)
  bool gathered = false;  // dense: all-gathered over TP; experts: always (see the phase)
  bool identity = false;  // dense: the all-gather's rank order is the full layout (no merge)
  bool int4 = false;      // experts: quantized by their holders; the gathers carry INT4 (Int4ExpertPlan)
  int owner = 0;          // dense: the TP rank that converts and sends it (0, the source, unless spread)
  uint64_t local_bytes = 0;
  uint64_t full_bytes = 0;  // after the TP / ETP merge
  uint64_t block = 0;       // experts: one EP member's bytes in the EP gather (full_bytes or INT4)
  uint64_t weight = 0;      // bytes counted against gather_bytes when batching
  uint64_t offset = 0;      // region in the batch buffer (dense: TP output; experts: EP output)
  uint64_t region = 0;
  uint64_t etp_offset = 0;  // experts with ETP > 1: region of the ETP output
  uint64_t etp_region = 0;  // full_bytes, or ETP x the INT4 shard block (Int4ExpertPlan::by_shard)
};
struct Batch {
  std::vector<Item> items;
  uint64_t bytes = 0;      // of the batch buffer
  uint64_t etp_bytes = 0;  // of the ETP buffer
};

// Consecutive items while their aligned weights fit `limit` (an item heavier than that goes
// alone). The batch buffer starts with `header` bytes, the ETP buffer with `etp_header` bytes
// (the members' status records).
std::vector<Batch> MakeBatches(std::vector<Item> items, uint64_t limit, uint64_t header, uint64_t etp_header) {
  std::vector<Batch> out;
  Batch cur;
  cur.bytes = header;
  cur.etp_bytes = etp_header;
  uint64_t weight = 0;
  for (Item& it : items) {
    if (!cur.items.empty() && it.weight > 0 && AlignUp(weight, kRegionAlignment) + it.weight > limit) {
      out.push_back(std::move(cur));
      cur = Batch();
      cur.bytes = header;
      cur.etp_bytes = etp_header;
      weight = 0;
    }
    weight = AlignUp(weight, kRegionAlignment) + it.weight;
    it.offset = AlignUp(cur.bytes, kRegionAlignment);
    cur.bytes = it.offset + it.region;
    it.etp_offset = AlignUp(cur.etp_bytes, kRegionAlignment);
    cur.etp_bytes = it.etp_offset + it.etp_region;
    cur.items.push_back(it);
  }
  if (!cur.items.empty()) out.push_back(std::move(cur));
  return out;
}

// A member's outcome for one expert batch, gathered with the batch (ETP and EP): the merger and
// the stage source learn that a peer's block is not valid (and why) instead of using it.
constexpr uint64_t kStatusRecordBytes = 1024;
struct MemberStatus {
  int32_t code = 0;  // absl::StatusCode; 0: the member's blocks of this batch are valid
  int32_t world_rank = -1;
  uint32_t message_bytes = 0;
  uint32_t reserved = 0;
  char message[kStatusRecordBytes - 16] = {};
};
static_assert(sizeof(MemberStatus) == kStatusRecordBytes);

// True when group rank r's shard is bytes [r*L, (r+1)*L) of the full tensor for every r: the
// all-gather output, in rank order, is then the full tensor itself.
bool IsIdentityLayout(const MegatronParam& p, uint64_t local_bytes) {
  for (int r = 0; r < p.group_size; ++r) {
    const auto copies = ShardCopies(p, r);
    if (copies.size() != 1) return false;
    const StridedCopy& c = copies[0];
    const bool contiguous = c.count == 1 || (c.local_stride == c.bytes && c.full_stride == c.bytes);
    if (!contiguous || c.local_offset != 0 || static_cast<uint64_t>(c.count * c.bytes) != local_bytes ||
        static_cast<uint64_t>(c.full_offset) != static_cast<uint64_t>(r) * local_bytes)
      return false;
  }
  return true;
}

// Keeps memory that a failed MPI operation may still touch alive until the process exits
// (comm/mpi/mpi_communicator.h: MPI cannot cancel a collective).
void LeakForFailedCollectives(Buffer b) {
  if (b.size() > 0) new Buffer(std::move(b));  // NOLINT: deliberate leak
}

}  // namespace

uint64_t SyncWorkspace::bytes() const {
  return slots_[0].size() + slots_[1].size() + etp_.size() + scratch_.size() + hf_.size();
}

// --- One rank's sync ----------------------------------------------------------------------------

class RankSync {
 public:
  RankSync(const WeightSource& src, TrainerComms& comms, comm::BucketSink* sink, const SyncOptions& o)
      : src_(src),
        layout_(src.layout()),
        comms_(comms),
        sink_(sink),
        o_(o),
        ws_(o.workspace != nullptr ? *o.workspace : own_workspace_),
        slots_(ws_.slots_),
        etp_buffer_(ws_.etp_),
        scratch_(ws_.scratch_),
        hf_scratch_(ws_.hf_) {}

  absl::StatusOr<SyncReport> Run();

 private:
  absl::Status Prepare();  // everything local that can fail, before the agreement
  // Prepare's steps. The communicators, options and sink fit the layout (kInvalidArgument).
  absl::Status CheckSetup() const;
  absl::Status OpenShard();  // this rank's shard (afresh), its memory space, the INT4 quantizer
  // The expert parameters of every EP member (member_experts_), where this rank needs them.
  absl::Status PlanMemberExperts();
  // The dense and expert items of the shard (the gathers' sizes); `expert_ordinal`: experts seen.
  absl::Status MakeItems(std::vector<Item>& dense, std::vector<Item>& experts, int& expert_ordinal);
  // Which experts their holders quantize (int4_plans_), and their INT4 blocks' sizes in the gathers.
  absl::Status PlanInt4Experts(std::vector<Item>& experts, int expert_ordinal);
  void MakeAllBatches(std::vector<Item> dense, std::vector<Item> experts);  // dense_, experts_
  // Prepare's last step: the gather buffers and the bucket builder (after the agreement for a
  // device shard).
  absl::Status Allocate();
  // After the agreement: the gathers' communicators: the host groups, or (`on_device`,
  // DecideGathers) the NCCL groups of the same members on the ranks' GPUs (`places`, agreed).
  absl::Status ChooseGatherComms(const std::vector<RankPlace>& places, bool on_device);
  void RunDense();
  void RunExperts();
  // RunExperts' steps, per batch of experts (double-buffered over slots_).
  void IssueExpertBatch(size_t j, int slot, std::unique_ptr<comm::Work>& pending);
  void QuantizeEtpShards(const Batch& b);  // INT4 by shard: each ETP rank quantizes its own shard
  void GatherEtp(const Batch& b);
  void MergeExperts(const Batch& b, int slot);
  void IssueEpGather(const Batch& b, int slot, std::unique_ptr<comm::Work>& pending);
  void CompleteExpertBatch(size_t j, int slot);
  const Int4ExpertPlan& PlanOf(const Item& it) const { return int4_plans_[static_cast<size_t>(it.ordinal)]; }
  void Fail(const absl::Status& s) {
    if (!s.ok() && failure_.ok()) failure_ = s;
  }
  bool converting() const { return emitter_ && failure_.ok(); }
  void Wait(std::unique_ptr<comm::Work>& w);
  absl::StatusOr<std::unique_ptr<comm::Work>> AllGather(comm::Communicator& c, const std::vector<comm::ConstBytes>& in,
                                                        const std::vector<comm::MutableBytes>& out);
  absl::Status Emit(const MegatronParam& p, const TensorView& full);  // ToHf + quantize / copy into buckets
  absl::Status WriteStatusRecord(std::span<std::byte> record) const;  // into a gather buffer
  // The records of a gather's `count` members; `mine` is skipped. `group`: "EP" or "ETP".
  absl::Status CheckRecords(std::span<const std::byte> records, int count, int mine, absl::string_view group) const;
  absl::Status EnsureBuffer(Buffer& b, uint64_t bytes);

  const WeightSource& src_;
  const ParallelLayout& layout_;
  TrainerComms& comms_;
  comm::BucketSink* sink_;
  const SyncOptions& o_;
  comm::Communicator* tp_ = nullptr;  // the gathers' groups (ChooseGatherComms)
  comm::Communicator* etp_ = nullptr;
  comm::Communicator* ep_ = nullptr;

  int me_ = 0, stage_ = 0;
  bool source_ = false;
  bool spread_ = false;         // SyncOptions::spread_senders
  bool emitter_ = false;        // sends: the stage source, or any of StageSenders when spread
  bool dense_member_ = false;   // in the stage source's TP group
  bool expert_member_ = false;  // in the stage's expert block (edp == 0)
  bool int4_members_ = false;   // expert member, INT4 config, experts gathered: INT4 experts quantized by their holders
  bool host_copies_ = false;    // DecideGathers' kHostCopies: device shards are copied to the host
  uint64_t gather_limit_ = 0;
  RankShard shard_;
  std::vector<Batch> dense_, experts_;
  // EP member m's expert params (source; every expert-block rank when experts may be INT4)
  std::vector<std::vector<MegatronParam>> member_experts_;
  std::optional<Int4Quantizer> int4_;       // with a quantization config
  std::vector<Int4ExpertPlan> int4_plans_;  // per expert ordinal (used where Item::int4)
  SyncWorkspace own_workspace_;
  SyncWorkspace& ws_;
  std::array<Buffer, 2>& slots_;
  Buffer& etp_buffer_;
  Buffer& scratch_;
  Buffer& hf_scratch_;
  MemorySpace space_ = MemorySpace::Host();        // of the shard's tensors, the HF copies and the buckets
  std::optional<comm::SpaceStagingSink> staging_;  // the buckets' space -> the sink's, where they differ
  std::optional<comm::BucketBuilder> builder_;
  absl::Status failure_;
  bool comm_failed_ = false;
  SyncReport report_;
};

absl::Status RankSync::EnsureBuffer(Buffer& b, uint64_t bytes) {
  if (bytes == 0 || (b.size() >= bytes && MemorySpace::Of(b) == space_)) return absl::OkStatus();
  b = Buffer();
  ASSIGN_OR_RETURN(b, space_.Allocate(bytes));
  return absl::OkStatus();
}

absl::Status RankSync::ChooseGatherComms(const std::vector<RankPlace>& places, bool on_device) {
  tp_ = comms_.tp.get();
  etp_ = comms_.etp.get();
  ep_ = comms_.ep.get();
  if (!on_device) return absl::OkStatus();
  std::vector<int> devices;
  for (const RankPlace& p : places) devices.push_back(p.device);
  RETURN_IF_ERROR(Annotate(EnsureDeviceComms(comms_, devices, dense_member_, expert_member_, o_.collective),
                           "forming the device gathers' groups"));
  if (comms_.device.tp) tp_ = comms_.device.tp.get();
  if (comms_.device.etp) etp_ = comms_.device.etp.get();
  if (comms_.device.ep) ep_ = comms_.device.ep.get();
  return absl::OkStatus();
}

namespace {

// A host copy of a device shard (the gathers run on the host: DecideGathers' kHostCopies). The
// original backing is kept with the copy.
absl::StatusOr<RankShard> HostCopyOf(const RankShard& shard) {
  const MemorySpace from = MemorySpace::Cuda(shard.cuda_device);
  uint64_t total = 0;
  for (const TensorView& t : shard.tensors) total = AlignUp(total, kRegionAlignment) + t.nbytes();
  ASSIGN_OR_RETURN(Buffer copy, MemorySpace::Host().Allocate(std::max<uint64_t>(total, 1)));
  RankShard out;
  out.global_rank = shard.global_rank;
  out.params = shard.params;
  uint64_t at = 0;
  for (const TensorView& t : shard.tensors) {
    at = AlignUp(at, kRegionAlignment);
    std::span<std::byte> dst = copy.span().subspan(at, t.nbytes());
    RETURN_IF_ERROR(Annotate(from.CopyToHost(dst.data(), t.data(), t.nbytes()),
                             absl::StrCat("copying rank ", shard.global_rank, "'s tensors to host memory")));
    out.tensors.emplace_back(t.dtype(), t.shape(), dst);
    at += t.nbytes();
  }
  out.backing = std::make_shared<std::pair<Buffer, std::shared_ptr<const void>>>(std::move(copy), shard.backing);
  return out;
}

}  // namespace

absl::Status RankSync::Prepare() {
  RETURN_IF_ERROR(CheckSetup());
  // Experts that are INT4 targets are quantized by the EP member that holds them.
  // FP8 experts travel in bf16 to the emitter, which quantizes them (quantize/int4_quantizer.h).
  int4_members_ =
      o_.quant != nullptr && !o_.quant->is_fp8() && (layout_.ep() > 1 || layout_.etp() > 1) && expert_member_;
  if ((emitter_ || int4_members_) && o_.quant != nullptr) RETURN_IF_ERROR(o_.quant->CheckSupported());
  RETURN_IF_ERROR(OpenShard());
  RETURN_IF_ERROR(PlanMemberExperts());
  std::vector<Item> dense, experts;
  int expert_ordinal = 0;
  RETURN_IF_ERROR(MakeItems(dense, experts, expert_ordinal));
  if (int4_members_) RETURN_IF_ERROR(PlanInt4Experts(experts, expert_ordinal));
  MakeAllBatches(std::move(dense), std::move(experts));
  // A device shard allocates once every rank's place is agreed (Run: the sync may fall back to host
  // copies, and the training GPU should not pay for buffers it will not use).
  return space_.host() ? Allocate() : absl::OkStatus();
}

absl::Status RankSync::CheckSetup() const {
  if (comms_.tp == nullptr || comms_.etp == nullptr || comms_.ep == nullptr)
    return absl::InvalidArgumentError("RunRankSync: TrainerComms without its tp / etp / ep communicators");
  if (comms_.world->size() != layout_.world_size())
    return absl::InvalidArgumentError(absl::StrCat("the world has ", comms_.world->size(),
                                                   " ranks, the source's layout ", layout_.world_size(), " (",
                                                   layout_.DebugString(), ")"));
  const DenseCoord d = layout_.Dense(me_);
  const ExpertCoord e = layout_.Expert(me_);
  if (comms_.tp->size() != layout_.tp() || comms_.tp->rank() != d.tp || comms_.etp->size() != layout_.etp() ||
      comms_.etp->rank() != e.etp || comms_.ep->size() != layout_.ep() || comms_.ep->rank() != e.ep)
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", me_, ": communicators tp ", comms_.tp->rank(), "/", comms_.tp->size(), ", etp ",
                     comms_.etp->rank(), "/", comms_.etp->size(), ", ep ", comms_.ep->rank(), "/", comms_.ep->size(),
                     " do not match the layout (tp ", d.tp, "/", layout_.tp(), ", etp ", e.etp, "/", layout_.etp(),
                     ", ep ", e.ep, "/", layout_.ep(), "; ", layout_.DebugString(), ")"));
  if (o_.bucket_bytes == 0) return absl::InvalidArgumentError("SyncOptions.bucket_bytes must be > 0");
  if (emitter_ && sink_ == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("rank ", me_, " is ", source_ ? "the source" : "a sender",
                                                   " of stage ", stage_, " but has no sink"));
  if (!emitter_ && sink_ != nullptr)
    return absl::InvalidArgumentError(absl::StrCat("rank ", me_, " does not send stage ", stage_, " (sent by rank(s) ",
                                                   absl::StrJoin(StageSenders(layout_, stage_, spread_), ", "),
                                                   ") but was given a sink"));
  return absl::OkStatus();
}

absl::Status RankSync::OpenShard() {
  // Prepare runs again (with host_copies_) when the gathers must run on the host: start afresh.
  builder_.reset();
  staging_.reset();
  int4_.reset();
  member_experts_.clear();
  int4_plans_.clear();
  dense_.clear();
  experts_.clear();
  space_ = MemorySpace::Host();
  report_.cuda_device = -1;
  ASSIGN_OR_RETURN(shard_, src_.OpenRank(me_, o_.version));
  if (host_copies_ && shard_.cuda_device >= 0) {
    ASSIGN_OR_RETURN(shard_, HostCopyOf(shard_));
  }
  if (o_.expert_map != nullptr) RETURN_IF_ERROR(PruneExperts(src_.model(), *o_.expert_map, shard_.params));
  // The device stages: the shard is CUDA memory; gathers (NCCL groups, ChooseGatherComms), merges,
  // conversion, INT4 kernels and buckets run there.
  if (shard_.cuda_device >= 0) {
    space_ = MemorySpace::Cuda(shard_.cuda_device);
    report_.cuda_device = shard_.cuda_device;
  }
  if (o_.quant != nullptr) {
    int4_.emplace(Int4Options{o_.quant, o_.quant_variant, o_.quant_threads, space_, o_.awq_arith});
    int4_->set_quantized_base(o_.quantized_base);
    int4_->set_quant_memo(o_.quant_memo);
  }
  return absl::OkStatus();
}

absl::Status RankSync::PlanMemberExperts() {
  // EP members' plans: their global expert ids (the source converts every member's experts; with
  // INT4 experts every member decides, from the same plans, which of them it quantizes; with an
  // expert map every member learns which items some member keeps).
  const bool any_expert =
      std::any_of(shard_.params.begin(), shard_.params.end(), [](const MegatronParam& p) { return p.is_expert; });
  if (expert_member_ && any_expert && (emitter_ || int4_members_ || o_.expert_map != nullptr)) {
    std::vector<const MegatronParam*> mine;
    for (const MegatronParam& p : shard_.params)
      if (p.is_expert) mine.push_back(&p);
    for (int member : layout_.EpGroup(me_)) {
      ASSIGN_OR_RETURN(std::vector<MegatronParam> plan, PlanRank(src_.model(), layout_, src_.parallel(), member));
      if (o_.expert_map != nullptr) RETURN_IF_ERROR(PruneExperts(src_.model(), *o_.expert_map, plan));
      std::vector<MegatronParam> ex;
      for (MegatronParam& p : plan)
        if (p.is_expert) ex.push_back(std::move(p));
      if (ex.size() != mine.size())
        return absl::InternalError(absl::StrCat("EP member rank ", member, " holds ", ex.size(),
                                                " expert parameters, rank ", me_, " ", mine.size()));
      for (size_t k = 0; k < ex.size(); ++k)
        if (ex[k].local_name != mine[k]->local_name || ex[k].local_shape != mine[k]->local_shape)
          return absl::InternalError(absl::StrCat("EP member rank ", member, " expert parameter ", k, " is ",
                                                  ex[k].local_name, ", rank ", me_, "'s ", mine[k]->local_name));
      member_experts_.push_back(std::move(ex));
    }
  }
  return absl::OkStatus();
}

absl::Status RankSync::MakeItems(std::vector<Item>& dense, std::vector<Item>& experts, int& expert_ordinal) {
  // Dense items (the stage source's TP group gathers TP-sharded parameters) and expert items.
  for (size_t i = 0; i < shard_.params.size(); ++i) {
    const MegatronParam& p = shard_.params[i];
    Item it;
    it.index = static_cast<int>(i);
    it.local_bytes = shard_.tensors[i].nbytes();
    if (!p.is_expert) {
      if (!p.sent) continue;  // the tied output-layer copy: never sent, so never gathered
      it.gathered = p.kind != ShardKind::kReplicated && p.group_size > 1;
      if (it.gathered && p.group_size != comms_.tp->size())
        return absl::InternalError(
            absl::StrCat(p.global_name, ": group of ", p.group_size, ", TP communicator of ", comms_.tp->size()));
      it.full_bytes = it.gathered ? it.local_bytes * static_cast<uint64_t>(p.group_size) : it.local_bytes;
      it.region = it.gathered ? it.full_bytes : 0;
      it.identity = it.gathered && IsIdentityLayout(p, it.local_bytes);
      dense.push_back(it);
    } else {
      if (p.group_size != comms_.etp->size())
        return absl::InternalError(absl::StrCat(p.global_name, ": expert-TP group of ", p.group_size,
                                                ", ETP communicator of ", comms_.etp->size()));
      it.gathered = true;
      it.full_bytes = it.local_bytes * static_cast<uint64_t>(layout_.etp());
      it.block = it.full_bytes;
      it.region = it.full_bytes * static_cast<uint64_t>(layout_.ep());
      it.etp_region = it.full_bytes;
      it.weight = it.region;
      it.ordinal = expert_ordinal++;
      it.pruned = p.pruned;
      if (o_.expert_map != nullptr) {
        const bool kept_somewhere = std::any_of(member_experts_.begin(), member_experts_.end(), [&](const auto& m) {
          return !m[static_cast<size_t>(it.ordinal)].pruned;
        });
        if (!kept_somewhere) continue;  // no EP member keeps it: not gathered at all
      }
      experts.push_back(it);
    }
  }
  for (Item& it : dense) it.weight = it.region;
  return absl::OkStatus();
}

absl::Status RankSync::PlanInt4Experts(std::vector<Item>& experts, int expert_ordinal) {
  // Which experts their holders quantize (the same decision on every member), and the sizes of
  // their INT4 blocks in the ETP and EP gathers.
  if (int4_members_) {
    int4_plans_.resize(static_cast<size_t>(expert_ordinal));
    for (Item& it : experts) {
      std::vector<const MegatronParam*> on_members;
      for (const std::vector<MegatronParam>& member : member_experts_)
        on_members.push_back(&member[static_cast<size_t>(it.ordinal)]);
      ASSIGN_OR_RETURN(
          std::optional<Int4ExpertPlan> plan,
          int4_->PlanExpert(src_.model(), shard_.params[static_cast<size_t>(it.index)], on_members, layout_.etp()));
      if (!plan) continue;
      it.int4 = true;
      it.block = plan->block_bytes;
      it.region = it.block * static_cast<uint64_t>(layout_.ep());
      if (plan->by_shard && layout_.etp() > 1) it.etp_region = plan->local_block * static_cast<uint64_t>(layout_.etp());
      int4_plans_[static_cast<size_t>(it.ordinal)] = std::move(*plan);
    }
  }
  return absl::OkStatus();
}

void RankSync::MakeAllBatches(std::vector<Item> dense, std::vector<Item> experts) {
  const uint64_t header = layout_.ep() > 1 ? kStatusRecordBytes * static_cast<uint64_t>(layout_.ep()) : 0;
  const uint64_t etp_header = layout_.etp() > 1 ? kStatusRecordBytes * static_cast<uint64_t>(layout_.etp()) : 0;
  if (dense_member_) dense_ = MakeBatches(std::move(dense), gather_limit_, 0, 0);
  // Spread senders: each dense parameter to the least loaded TP rank so far (by its full bytes),
  // in plan order; every member computes the same owners from the same plan.
  if (spread_ && dense_member_) {
    std::vector<uint64_t> load(static_cast<size_t>(layout_.tp()), 0);
    for (Batch& b : dense_)
      for (Item& it : b.items) {
        it.owner = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
        load[static_cast<size_t>(it.owner)] += std::max<uint64_t>(it.full_bytes, 1);
      }
  }
  if (expert_member_) experts_ = MakeBatches(std::move(experts), gather_limit_, header, etp_header);
}

absl::Status RankSync::Allocate() {
  // Device buckets go to a device data plane (nccl) on the same GPU: a copy between two GPUs
  // would not be ordered after the kernels that filled the bucket.
  if (!space_.host() && emitter_ && !sink_->space().host() && sink_->space() != space_)
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", me_, "'s tensors are in the memory of ", space_.Name(), " and its nccl data plane is on ",
                     sink_->space().Name(), ": start the trainer agent with --cuda-device ", space_.cuda_device(),
                     " (the GPU of the rank's training process)"));
  // Buffers (uninitialized: no page is touched before the first gather writes it).
  uint64_t slot_bytes = 0, etp_bytes = 0, scratch_bytes = 0;
  for (const Batch& b : dense_) {
    bool any = false;
    for (const Item& it : b.items) {
      any = any || it.gathered;
      if (emitter_ && it.owner == comms_.tp->rank() && it.gathered && !it.identity)
        scratch_bytes = std::max(scratch_bytes, it.full_bytes);
    }
    if (any) slot_bytes = std::max(slot_bytes, b.bytes);
  }
  const bool expert_merger = layout_.Expert(me_).etp == 0;  // merges ETP shards / joins the EP gather
  const bool experts_gathered = layout_.ep() > 1 || layout_.etp() > 1;
  for (const Batch& b : experts_) {
    if (experts_gathered && expert_merger) slot_bytes = std::max(slot_bytes, b.bytes);
    if (layout_.etp() > 1) etp_bytes = std::max(etp_bytes, b.etp_bytes);
    for (const Item& it : b.items)  // ETP-merged in bf16 before this member quantizes it
      if (it.int4 && !int4_plans_[static_cast<size_t>(it.ordinal)].by_shard && layout_.etp() > 1 && expert_merger)
        scratch_bytes = std::max(scratch_bytes, it.full_bytes);
  }
  for (Buffer& s : slots_) RETURN_IF_ERROR(EnsureBuffer(s, slot_bytes));
  RETURN_IF_ERROR(EnsureBuffer(etp_buffer_, etp_bytes));
  RETURN_IF_ERROR(EnsureBuffer(scratch_, scratch_bytes));
  // ToHf's gathered tensors (a fused QKV's q part, ...): at most a full parameter plus alignment,
  // sized now so that nothing is allocated (or freed) beside the sync's NCCL operations.
  if (emitter_) {
    uint64_t hf_bytes = 0;
    for (const MegatronParam& p : shard_.params)
      hf_bytes = std::max<uint64_t>(
          hf_bytes, static_cast<uint64_t>(NumBytes(p.dtype, p.full_shape).value_or(0)) + 256 * p.hf_names.size());
    RETURN_IF_ERROR(EnsureBuffer(hf_scratch_, hf_bytes));
  }

  if (emitter_) {
    comm::BucketBuilderOptions bo;
    bo.bucket_bytes = o_.bucket_bytes;
    bo.version = o_.version;
    bo.pp_stage = static_cast<uint32_t>(stage_);
    bo.space = space_;
    comm::BucketSink* sink = sink_;
    // Buckets built in one space and sent from another (device stages -> a host data plane, host
    // stages -> the NCCL data plane) cross once per bucket.
    if (space_ != sink_->space()) sink = &staging_.emplace(*sink_, space_);
    builder_.emplace(*sink, bo);
  }
  return absl::OkStatus();
}

void RankSync::Wait(std::unique_ptr<comm::Work>& w) {
  if (w == nullptr) return;
  const absl::Time t0 = absl::Now();
  absl::Status s = w->Wait();
  report_.gather += absl::Now() - t0;
  w.reset();
  if (!s.ok()) {
    comm_failed_ = true;
    Fail(s);
  }
}

absl::StatusOr<std::unique_ptr<comm::Work>> RankSync::AllGather(comm::Communicator& c,
                                                                const std::vector<comm::ConstBytes>& in,
                                                                const std::vector<comm::MutableBytes>& out) {
  if (in.empty()) return std::unique_ptr<comm::Work>();
  ++report_.gather_calls;
  for (const comm::MutableBytes& b : out) report_.gather_bytes += b.nbytes;
  const absl::Time t0 = absl::Now();
  auto w = c.AllGather(in, out, o_.collective);
  report_.gather += absl::Now() - t0;
  if (!w.ok()) comm_failed_ = true;
  return w;
}

absl::Status RankSync::WriteStatusRecord(std::span<std::byte> record) const {
  MemberStatus st;
  st.code = static_cast<int32_t>(failure_.code());
  st.world_rank = me_;
  const absl::string_view msg = failure_.message().substr(0, sizeof(st.message));
  st.message_bytes = static_cast<uint32_t>(msg.size());
  std::memcpy(st.message, msg.data(), msg.size());
  return space_.Copy(record.data(), &st, sizeof(st));  // the gather buffers are in the shard's space
}

absl::Status RankSync::CheckRecords(std::span<const std::byte> records, int count, int mine,
                                    absl::string_view group) const {
  std::vector<MemberStatus> all(static_cast<size_t>(count));  // one copy of every record (device memory)
  RETURN_IF_ERROR(space_.CopyToHost(all.data(), records.data(), all.size() * sizeof(MemberStatus)));
  for (int m = 0; m < count; ++m) {
    if (m == mine) continue;
    const MemberStatus& st = all[static_cast<size_t>(m)];
    if (st.code == 0) continue;
    const absl::StatusCode code = st.code > 0 && st.code <= static_cast<int32_t>(absl::StatusCode::kUnauthenticated)
                                      ? static_cast<absl::StatusCode>(st.code)
                                      : absl::StatusCode::kInternal;
    const absl::string_view msg(st.message, std::min<size_t>(st.message_bytes, sizeof(st.message)));
    return absl::Status(code, absl::StrCat(group, " rank ", m, " (world rank ", st.world_rank,
                                           ") could not produce its experts: ", msg));
  }
  return absl::OkStatus();
}

absl::Status RankSync::Emit(const MegatronParam& p, const TensorView& full) {
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::vector<model::HfTensor>> hf = ToHf(src_.model(), p, full, space_, &hf_scratch_);
  report_.convert += absl::Now() - t0;
  if (!hf.ok()) return hf.status();
  for (const model::HfTensor& t : *hf) {
    report_.hf_bytes += t.view.nbytes();
    if (o_.quant != nullptr && model::IsQuantTarget(t.name, t.view.shape(), *o_.quant)) {
      RETURN_IF_ERROR(int4_->QuantizeInto(*builder_, t.name, t.view));
    } else {
      RETURN_IF_ERROR(builder_->Add(t.name, t.view));
      report_.copied_bytes += t.view.nbytes();
    }
  }
  return absl::OkStatus();
}

// TP all-gathers of the non-expert parameters, double-buffered; the source converts batch k
// while batch k+1 is on the wire.
void RankSync::RunDense() {
  std::array<std::unique_ptr<comm::Work>, 2> pending;
  auto issue = [&](size_t j, int slot) {
    std::vector<comm::ConstBytes> in;
    std::vector<comm::MutableBytes> out;
    for (const Item& it : dense_[j].items) {
      if (!it.gathered) continue;
      const TensorView& t = shard_.tensors[static_cast<size_t>(it.index)];
      in.push_back({t.data(), t.nbytes()});
      out.push_back({slots_[slot].data() + it.offset, it.region});
    }
    auto w = AllGather(*tp_, in, out);
    if (w.ok())
      pending[slot] = std::move(*w);
    else
      Fail(w.status());
  };
  auto complete = [&](size_t j, int slot) {
    Wait(pending[slot]);
    if (!converting()) return;
    for (const Item& it : dense_[j].items) {
      if (it.owner != comms_.tp->rank()) continue;  // another TP rank sends it (spread senders)
      const MegatronParam& p = shard_.params[static_cast<size_t>(it.index)];
      TensorView full = shard_.tensors[static_cast<size_t>(it.index)];
      if (it.gathered) {
        std::span<const std::byte> region(slots_[slot].data() + it.offset, it.region);
        if (it.identity) {
          full = TensorView(p.dtype, p.full_shape, region);
        } else {
          std::vector<TensorView> shards;
          for (int r = 0; r < p.group_size; ++r)
            shards.emplace_back(p.dtype, p.local_shape, region.subspan(r * it.local_bytes, it.local_bytes));
          MutableTensorView merged(p.dtype, p.full_shape, scratch_.span().subspan(0, it.full_bytes));
          const absl::Time t0 = absl::Now();
          absl::Status s = MergeShards(p, shards, merged, space_);
          report_.convert += absl::Now() - t0;
          if (!s.ok()) return Fail(s);
          full = merged;
        }
      }
      if (absl::Status s = Emit(p, full); !s.ok()) return Fail(s);
    }
  };
  if (dense_.empty()) return;
  issue(0, 0);
  for (size_t j = 0; j < dense_.size(); ++j) {
    if (j + 1 < dense_.size()) issue(j + 1, static_cast<int>((j + 1) % 2));
    complete(j, static_cast<int>(j % 2));
  }
}

// Routed experts: [ETP all-gather + merge into this rank's block] then an EP all-gather among
// the etp = 0 ranks, in place. INT4 items (Item::int4, Int4ExpertPlan) are quantized before the
// gathers: by every ETP rank on its own shard (by_shard; the ETP gather carries INT4 and the
// merger merges INT4), or by the merger after a bf16 ETP merge. Both gathers carry the members'
// status records. Double-buffered like the dense phase.
void RankSync::RunExperts() {
  if (experts_.empty()) return;
  std::array<std::unique_ptr<comm::Work>, 2> pending;
  IssueExpertBatch(0, 0, pending[0]);
  for (size_t j = 0; j < experts_.size(); ++j) {
    if (j + 1 < experts_.size()) {
      const int next = static_cast<int>((j + 1) % 2);
      IssueExpertBatch(j + 1, next, pending[static_cast<size_t>(next)]);
    }
    const int slot = static_cast<int>(j % 2);
    Wait(pending[static_cast<size_t>(slot)]);
    CompleteExpertBatch(j, slot);
  }
}

// Batch j's gathers: the ETP gather (and merges) and, on a merger, the EP gather into `slot`,
// left in flight in `pending`.
void RankSync::IssueExpertBatch(size_t j, int slot, std::unique_ptr<comm::Work>& pending) {
  const Batch& b = experts_[j];
  const bool merger = layout_.Expert(me_).etp == 0;
  if (layout_.etp() > 1) {
    // Shards quantized where they live, into this rank's block of the ETP output (in place).
    if (int4_members_ && failure_.ok()) QuantizeEtpShards(b);
    GatherEtp(b);
  }
  // The merger's part: ETP merges, and the INT4 items not quantized by shard.
  if (merger && failure_.ok() && (layout_.etp() > 1 || int4_members_)) MergeExperts(b, slot);
  if (merger && layout_.ep() > 1 && !spread_)  // spread senders: each member sends its own experts, no EP gather
    IssueEpGather(b, slot, pending);
}

void RankSync::QuantizeEtpShards(const Batch& b) {
  const int etp = layout_.etp();
  const ExpertCoord coord = layout_.Expert(me_);
  const uint64_t own_etp = static_cast<uint64_t>(coord.etp);
  for (const Item& it : b.items) {
    if (!it.int4 || !PlanOf(it).by_shard || it.pruned) continue;
    const Int4ExpertPlan& plan = PlanOf(it);
    std::byte* mine = etp_buffer_.data() + it.etp_offset + own_etp * plan.local_block;
    absl::Status s = int4_->QuantizeExpert(
        shard_.params[static_cast<size_t>(it.index)], shard_.tensors[static_cast<size_t>(it.index)], plan,
        /*shard=*/true, {mine, plan.local_block}, absl::StrCat("ETP shard ", coord.etp, " of ", etp));
    if (!s.ok()) return Fail(s);
  }
}

// The ETP all-gather of the batch (with the members' status records), waited for; the merger checks
// the records.
void RankSync::GatherEtp(const Batch& b) {
  const int etp = layout_.etp();
  const ExpertCoord coord = layout_.Expert(me_);
  const uint64_t own_etp = static_cast<uint64_t>(coord.etp);
  std::span<std::byte> records = etp_buffer_.span().subspan(0, kStatusRecordBytes * static_cast<uint64_t>(etp));
  Fail(WriteStatusRecord(records.subspan(own_etp * kStatusRecordBytes, kStatusRecordBytes)));
  std::vector<comm::ConstBytes> in = {{records.data() + own_etp * kStatusRecordBytes, kStatusRecordBytes}};
  std::vector<comm::MutableBytes> out = {{records.data(), records.size()}};
  for (const Item& it : b.items) {
    std::byte* region = etp_buffer_.data() + it.etp_offset;
    if (it.int4 && PlanOf(it).by_shard) {
      in.push_back({region + own_etp * PlanOf(it).local_block, PlanOf(it).local_block});
    } else {
      const TensorView& t = shard_.tensors[static_cast<size_t>(it.index)];
      in.push_back({t.data(), t.nbytes()});
    }
    out.push_back({region, it.etp_region});
  }
  std::unique_ptr<comm::Work> w;
  auto issued = AllGather(*etp_, in, out);
  if (issued.ok())
    w = std::move(*issued);
  else
    Fail(issued.status());
  Wait(w);
  if (coord.etp == 0 && failure_.ok()) Fail(CheckRecords(records, etp, coord.etp, "ETP"));
}

// On the merger: each kept expert of the batch into this member's block of `slot`: its ETP shards
// merged (bf16 or INT4), quantized when it is INT4 and was not quantized by shard.
void RankSync::MergeExperts(const Batch& b, int slot) {
  const int etp = layout_.etp();
  const uint64_t own = static_cast<uint64_t>(layout_.Expert(me_).ep);
  const absl::Time t0 = absl::Now();
  absl::Duration quantizing;
  for (const Item& it : b.items) {
    if (it.pruned) continue;  // its block travels unfilled; nobody reads it
    const MegatronParam& p = shard_.params[static_cast<size_t>(it.index)];
    std::span<std::byte> block = slots_[slot].span().subspan(it.offset + own * it.block, it.block);
    std::span<const std::byte> region(etp_buffer_.data() + it.etp_offset, it.etp_region);
    absl::Status s;
    if (it.int4 && etp == 1) {
      const Int4ExpertPlan& plan = PlanOf(it);
      const absl::Duration q0 = int4_->stats().quantize;
      s = int4_->QuantizeExpert(p, shard_.tensors[static_cast<size_t>(it.index)], plan, /*shard=*/false, block,
                                "by its holder");
      quantizing += int4_->stats().quantize - q0;
    } else if (it.int4 && PlanOf(it).by_shard) {
      s = MergeInt4Shards(PlanOf(it), region, block, space_);
    } else if (etp > 1) {
      std::vector<TensorView> shards;
      for (int r = 0; r < etp; ++r)
        shards.emplace_back(p.dtype, p.local_shape, region.subspan(r * it.local_bytes, it.local_bytes));
      std::span<std::byte> dst = it.int4 ? scratch_.span().subspan(0, it.full_bytes) : block;
      s = MergeShards(p, shards, MutableTensorView(p.dtype, p.full_shape, dst), space_);
      if (s.ok() && it.int4) {
        const Int4ExpertPlan& plan = PlanOf(it);
        const absl::Duration q0 = int4_->stats().quantize;
        s = int4_->QuantizeExpert(p, TensorView(p.dtype, p.full_shape, dst), plan, /*shard=*/false, block,
                                  "merged from its ETP shards");
        quantizing += int4_->stats().quantize - q0;
      }
    }
    if (!s.ok()) {
      Fail(s);
      break;
    }
  }
  report_.convert += absl::Now() - t0 - quantizing;
}

// The EP all-gather among the mergers of the batch's blocks in `slot` (in place), with the members'
// status records; left in flight in `pending`.
void RankSync::IssueEpGather(const Batch& b, int slot, std::unique_ptr<comm::Work>& pending) {
  const int etp = layout_.etp(), ep = layout_.ep();
  const uint64_t own = static_cast<uint64_t>(layout_.Expert(me_).ep);
  std::span<std::byte> records = slots_[slot].span().subspan(0, kStatusRecordBytes * static_cast<uint64_t>(ep));
  Fail(WriteStatusRecord(records.subspan(own * kStatusRecordBytes, kStatusRecordBytes)));
  std::vector<comm::ConstBytes> in = {{records.data() + own * kStatusRecordBytes, kStatusRecordBytes}};
  std::vector<comm::MutableBytes> out = {{records.data(), records.size()}};
  for (const Item& it : b.items) {
    std::byte* region = slots_[slot].data() + it.offset;
    if (etp > 1 || it.int4) {
      in.push_back({region + own * it.block, it.block});  // in place
    } else {
      const TensorView& t = shard_.tensors[static_cast<size_t>(it.index)];
      in.push_back({t.data(), t.nbytes()});
    }
    out.push_back({region, it.region});
  }
  auto w = AllGather(*ep_, in, out);
  if (w.ok())
    pending = std::move(*w);
  else
    Fail(w.status());
}

// After batch j's gathers (waited for): the merger checks the EP records and emits every member's
// kept experts (spread senders: its own).
void RankSync::CompleteExpertBatch(size_t j, int slot) {
  const int etp = layout_.etp(), ep = layout_.ep();
  const ExpertCoord coord = layout_.Expert(me_);
  // Experts are sent by a merger (etp = 0): a TP peer sending dense parameters holds no full expert.
  if (!converting() || coord.etp != 0) return;
  if (ep > 1 && !spread_) {
    absl::Status s = CheckRecords(slots_[slot].span().subspan(0, kStatusRecordBytes * static_cast<uint64_t>(ep)), ep,
                                  coord.ep, "EP");
    if (!s.ok()) return Fail(s);
  }
  for (int m = 0; m < ep; ++m) {
    if (spread_ && m != coord.ep) continue;  // the other members send theirs
    for (const Item& it : experts_[j].items) {
      const MegatronParam& mine = shard_.params[static_cast<size_t>(it.index)];
      const MegatronParam& p = member_experts_[static_cast<size_t>(m)][static_cast<size_t>(it.ordinal)];
      if (p.pruned) continue;
      std::span<const std::byte> block = slots_[slot].span().subspan(it.offset + m * it.block, it.block);
      absl::Status s;
      if (it.int4) {
        s = int4_->EmitExpert(*builder_, p, PlanOf(it), block);
      } else {
        TensorView full = shard_.tensors[static_cast<size_t>(it.index)];
        // The block holds the expert after the EP gather, or after this member's ETP merge.
        if ((ep > 1 && !spread_) || etp > 1) full = TensorView(mine.dtype, mine.full_shape, block);
        s = Emit(p, full);
      }
      if (!s.ok()) return Fail(s);
    }
  }
}

absl::StatusOr<SyncReport> RankSync::Run() {
  const absl::Time start = absl::Now();
  if (comms_.world == nullptr) return absl::InvalidArgumentError("RunRankSync: TrainerComms.world is null");
  me_ = comms_.world->rank();
  if (me_ < 0 || me_ >= layout_.world_size())
    return absl::InvalidArgumentError(
        absl::StrCat("world rank ", me_, " is outside the source's layout (", layout_.DebugString(), ")"));
  stage_ = layout_.Dense(me_).pp;
  source_ = layout_.IsStageSource(me_);
  spread_ = o_.spread_senders;
  const DenseCoord d = layout_.Dense(me_);
  dense_member_ = d.dp == 0 && d.cp == 0;
  expert_member_ = layout_.Expert(me_).edp == 0;
  {
    const std::vector<int> senders = StageSenders(layout_, stage_, spread_);
    emitter_ = std::find(senders.begin(), senders.end(), me_) != senders.end();
  }
  report_.source = emitter_;
  gather_limit_ = o_.gather_bytes > 0 ? o_.gather_bytes : o_.bucket_bytes;

  const absl::Status local = Prepare();
  const std::string fingerprint_text =
      absl::StrCat(src_.config_json(), "\n", SourceParallelToJson(src_.parallel()), "\n", gather_limit_, "\n",
                   QuantFingerprint(o_.quant, o_.quant_variant, o_.awq_arith), "\n",
                   o_.expert_map != nullptr ? o_.expert_map->Canonical() : "experts: all", "\n",
                   spread_ ? "senders: spread" : "senders: the stage source");
  const uint64_t fingerprint =
      Xxh3_64({reinterpret_cast<const std::byte*>(fingerprint_text.data()), fingerprint_text.size()});
  std::vector<RankPlace> places;
  const RankPlace place = PlaceOf(local.ok() ? space_.cuda_device() : -1);
  RETURN_IF_ERROR(AgreeOnStart(*comms_.world, local, fingerprint, place, o_.collective, &places));
  ASSIGN_OR_RETURN(const GatherDecision gathers, DecideGathers(layout_, places));
  if (gathers.space == GatherSpace::kHostCopies) {
    // Every rank decided the same: all prepare again on host copies, and agree again.
    static std::atomic<bool> said{false};
    if (me_ == 0 && !said.exchange(true))
      WSYNC_LOG(WARNING) << "the TP / EP gathers run on the host (" << layout_.DebugString() << "): " << gathers.why
                         << "; the ranks on GPUs copy their tensors to host memory at each sync";
    host_copies_ = true;
    const absl::Status again = Prepare();
    RETURN_IF_ERROR(AgreeOnStart(*comms_.world, again, fingerprint, PlaceOf(-1), o_.collective, &places));
  } else if (std::any_of(places.begin(), places.end(), [](const RankPlace& p) { return p.device >= 0; })) {
    // Some rank's shard is on a GPU (every rank knows it): those allocate now; all agree again.
    const absl::Status allocated = space_.host() ? absl::OkStatus() : Allocate();
    RETURN_IF_ERROR(AgreeOnStart(*comms_.world, allocated, fingerprint, place, o_.collective, &places));
  }
  RETURN_IF_ERROR(ChooseGatherComms(places, gathers.space == GatherSpace::kDevice));
  report_.open = absl::Now() - start;

  if (dense_member_) RunDense();
  if (expert_member_) RunExperts();
  if (emitter_ && failure_.ok()) {
    Fail(builder_->Finish());
  }
  const Int4Stats int4 = int4_ ? int4_->stats() : Int4Stats();
  report_.quantize = int4.quantize;
  report_.quantized_bytes = int4.quantized_bytes;
  report_.copied_bytes += int4.copied_bytes;
  report_.hf_bytes += int4.hf_bytes;
  report_.quant_groups = int4.groups;
  report_.reused_groups = int4.reused_groups;
  report_.undigested_groups = int4.undigested_groups;
  if (builder_) {
    const comm::BucketBuilderStats& st = builder_->stats();
    report_.bucket = st.copy + int4.copy;
    report_.send_wait = st.send_wait;
    report_.bytes = st.bytes;
    report_.buckets = st.buckets;
    report_.tensors = st.tensors;
    report_.peak_bucket_bytes = st.peak_bucket_bytes;
  }
  if (staging_) report_.staging = staging_->stats().copy;
  // Device work still reading the shard (a failed sync's last copies) ends before its lease does.
  if (!space_.host()) Fail(Annotate(space_.Synchronize(), "finishing the device stages"));
  if (comm_failed_ && !space_.host()) {
    // An NCCL gather failed: its communicator was aborted (NCCL no longer touches the buffers), and
    // its groups are formed anew at the next sync.
    comms_.device.stale = true;
  } else if (comm_failed_) {
    for (Buffer& b : slots_) LeakForFailedCollectives(std::move(b));
    LeakForFailedCollectives(std::move(etp_buffer_));
    if (shard_.backing) new std::shared_ptr<const void>(shard_.backing);  // NOLINT: send buffers
  }
  report_.total = absl::Now() - start;
  if (!failure_.ok())
    return Annotate(failure_,
                    absl::StrCat("sync version ", o_.version, ", rank ", me_,
                                 emitter_ ? absl::StrCat(" (stage ", stage_, source_ ? " source)" : " sender)") : ""));
  return report_;
}

absl::StatusOr<GatherDecision> DecideGathers(const ParallelLayout& layout, absl::Span<const RankPlace> places) {
  if (places.size() != static_cast<size_t>(layout.world_size()))
    return absl::InvalidArgumentError(
        absl::StrCat(places.size(), " rank places for a layout of ", layout.world_size(), " ranks"));
  if (layout.tp() == 1 && layout.ep() == 1 && layout.etp() == 1) return GatherDecision{GatherSpace::kNone, ""};
  std::vector<int> on_device, on_host;
  for (size_t r = 0; r < places.size(); ++r)
    (places[r].device >= 0 ? on_device : on_host).push_back(static_cast<int>(r));
  if (on_device.empty()) return GatherDecision{GatherSpace::kHost, ""};
  if (!on_host.empty()) {
    auto some = [](const std::vector<int>& v) {
      const std::vector<int> head(v.begin(), v.begin() + static_cast<ptrdiff_t>(std::min<size_t>(v.size(), 8)));
      return absl::StrCat(absl::StrJoin(head, ", "), v.size() > 8 ? ", ..." : "");
    };
    return GatherDecision{GatherSpace::kHostCopies,
                          absl::StrCat("rank(s) ", some(on_device), " hold their tensors on GPUs and rank(s) ",
                                       some(on_host), " in host memory")};
  }
  // NCCL refuses two members of a group on one GPU ("duplicate GPU"). Every group is checked, so
  // that every rank decides the same.
  for (int r = 0; r < layout.world_size(); ++r)
    for (const std::vector<int>& group : {layout.TpGroup(r), layout.EtpGroup(r), layout.EpGroup(r)})
      for (size_t i = 0; i < group.size(); ++i)
        for (size_t j = i + 1; j < group.size(); ++j) {
          const RankPlace& a = places[static_cast<size_t>(group[i])];
          const RankPlace& b = places[static_cast<size_t>(group[j])];
          if (a.host == b.host && a.gpu == b.gpu)
            return GatherDecision{GatherSpace::kHostCopies,
                                  absl::StrCat("ranks ", group[i], " and ", group[j],
                                               " hold their tensors on the same GPU (cuda:", a.device,
                                               " of one host) and gather together, and NCCL needs one GPU per member")};
        }
  return GatherDecision{GatherSpace::kDevice, ""};
}

std::vector<int> StageSenders(const ParallelLayout& layout, int stage, bool spread) {
  const int source = layout.StageSourceRank(stage);
  std::vector<int> out = {source};
  if (spread) {
    for (int r : layout.TpGroup(source)) out.push_back(r);
    for (int r : layout.EpGroup(source)) out.push_back(r);  // the source's etp = edp = 0: the mergers
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  }
  return out;
}

absl::StatusOr<SyncReport> RunRankSync(const WeightSource& src, TrainerComms& comms, comm::BucketSink* sink,
                                       const SyncOptions& options) {
  RankSync sync(src, comms, sink, options);
  return sync.Run();
}

}  // namespace wsync::trainer_agent
