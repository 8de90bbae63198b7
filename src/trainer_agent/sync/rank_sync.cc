#include "trainer_agent/sync/rank_sync.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/checksum.h"
#include "common/status.h"
#include "trainer_agent/convert/hf_convert.h"
#include "trainer_agent/convert/shard_layout.h"
#include "trainer_agent/quantize/quant_select.h"

namespace wsync::sync {
namespace {

using convert::MegatronParam;
using convert::ShardKind;

constexpr uint64_t kRegionAlignment = 64;
constexpr size_t kMaxAgreedMessage = 4096;

uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// --- The opening agreement ----------------------------------------------------------------------

struct StartRecord {
  int32_t code = 0;
  uint32_t message_bytes = 0;
  uint64_t fingerprint = 0;
};
static_assert(sizeof(StartRecord) == 16);

// Every rank learns every rank's opening status; all return the same result.
absl::Status AgreeOnStart(Communicator& world, const absl::Status& local, uint64_t fingerprint,
                          const CollectiveOptions& options) {
  const std::string message(local.message().substr(0, kMaxAgreedMessage));
  StartRecord mine;
  mine.code = static_cast<int32_t>(local.code());
  mine.message_bytes = static_cast<uint32_t>(message.size());
  mine.fingerprint = fingerprint;
  std::vector<StartRecord> all(static_cast<size_t>(world.size()));
  ConstBytes in{&mine, sizeof(mine)};
  MutableBytes out{all.data(), all.size() * sizeof(StartRecord)};
  RETURN_IF_ERROR(Annotate(Await(world.AllGather({&in, 1}, {&out, 1}, options)),
                           "agreeing with every rank that all shards opened"));
  std::vector<int> failed;
  for (int r = 0; r < world.size(); ++r)
    if (all[static_cast<size_t>(r)].code != 0) failed.push_back(r);
  if (failed.empty()) {
    for (int r = 1; r < world.size(); ++r)
      if (all[static_cast<size_t>(r)].fingerprint != all[0].fingerprint)
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", r, " runs a different weight source config or sync options than rank 0 (config.json, "
            "parallel.json or gather size differ): the ranks would not agree on their collectives"));
    return absl::OkStatus();
  }
  std::vector<size_t> sizes(all.size());
  size_t total = 0;
  for (size_t r = 0; r < all.size(); ++r) total += sizes[r] = all[r].message_bytes;
  std::string messages(total, '\0');
  if (total > 0) {
    ConstBytes min{message.data(), message.size()};
    MutableBytes mout{messages.data(), messages.size()};
    RETURN_IF_ERROR(Annotate(Await(world.AllGatherV(min, mout, sizes, options)),
                             "gathering the ranks' opening errors"));
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
  int index = 0;            // into RankShard::params / tensors
  int ordinal = 0;          // experts: position among the rank's expert parameters
  bool gathered = false;    // dense: all-gathered over TP; experts: always (see the phase)
  bool identity = false;    // dense: the all-gather's rank order is the full layout (no merge)
  uint64_t local_bytes = 0;
  uint64_t full_bytes = 0;  // after the TP / ETP merge
  uint64_t offset = 0;      // region in the batch buffer (dense: TP output; experts: EP output)
  uint64_t region = 0;
  uint64_t etp_offset = 0;  // experts with ETP > 1: region of the ETP output (full_bytes)
};
struct Batch {
  std::vector<Item> items;
  uint64_t bytes = 0;      // of the batch buffer
  uint64_t etp_bytes = 0;  // of the ETP buffer
};

std::vector<Batch> MakeBatches(std::vector<Item> items, uint64_t limit) {
  std::vector<Batch> out;
  Batch cur;
  for (Item& it : items) {
    const uint64_t start = AlignUp(cur.bytes, kRegionAlignment);
    if (!cur.items.empty() && it.region > 0 && start + it.region > limit) {
      out.push_back(std::move(cur));
      cur = Batch();
    }
    it.offset = AlignUp(cur.bytes, kRegionAlignment);
    cur.bytes = it.offset + it.region;
    it.etp_offset = AlignUp(cur.etp_bytes, kRegionAlignment);
    cur.etp_bytes = it.etp_offset + it.full_bytes;
    cur.items.push_back(it);
  }
  if (!cur.items.empty()) out.push_back(std::move(cur));
  return out;
}

// True when group rank r's shard is bytes [r*L, (r+1)*L) of the full tensor for every r: the
// all-gather output, in rank order, is then the full tensor itself.
bool IsIdentityLayout(const MegatronParam& p, uint64_t local_bytes) {
  for (int r = 0; r < p.group_size; ++r) {
    const auto copies = convert::ShardCopies(p, r);
    if (copies.size() != 1) return false;
    const convert::StridedCopy& c = copies[0];
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
  return slots_[0].size() + slots_[1].size() + etp_.size() + scratch_.size();
}

// --- One rank's sync ----------------------------------------------------------------------------

class RankSync {
 public:
  RankSync(const source::WeightSource& src, TrainerComms& comms, BucketSink* sink, const SyncOptions& o)
      : src_(src), layout_(src.layout()), comms_(comms), sink_(sink), o_(o),
        ws_(o.workspace != nullptr ? *o.workspace : own_workspace_),
        slots_(ws_.slots_), etp_buffer_(ws_.etp_), scratch_(ws_.scratch_) {}

  absl::StatusOr<SyncReport> Run();

 private:
  absl::Status Prepare();         // everything local that can fail, before the agreement
  void RunDense();
  void RunExperts();
  void Fail(const absl::Status& s) {
    if (!s.ok() && failure_.ok()) failure_ = s;
  }
  bool converting() const { return source_ && failure_.ok(); }
  void Wait(std::unique_ptr<Work>& w);
  absl::StatusOr<std::unique_ptr<Work>> AllGather(Communicator& c, const std::vector<ConstBytes>& in,
                                                  const std::vector<MutableBytes>& out);
  absl::Status Emit(const MegatronParam& p, const TensorView& full);  // ToHf + quantize / copy into buckets
  absl::Status QuantizeIntoBucket(const std::string& name, const TensorView& w);
  absl::Status EnsureBuffer(Buffer& b, uint64_t bytes);

  const source::WeightSource& src_;
  const ParallelLayout& layout_;
  TrainerComms& comms_;
  BucketSink* sink_;
  const SyncOptions& o_;

  int me_ = 0, stage_ = 0;
  bool source_ = false;
  bool dense_member_ = false;   // in the stage source's TP group
  bool expert_member_ = false;  // in the stage's expert block (edp == 0)
  uint64_t gather_limit_ = 0;
  source::RankShard shard_;
  std::vector<Batch> dense_, experts_;
  std::vector<std::vector<MegatronParam>> member_experts_;  // source: EP member m's expert params
  SyncWorkspace own_workspace_;
  SyncWorkspace& ws_;
  std::array<Buffer, 2>& slots_;
  Buffer& etp_buffer_;
  Buffer& scratch_;
  std::optional<BucketBuilder> builder_;
  absl::Status failure_;
  bool comm_failed_ = false;
  SyncReport report_;
};

absl::Status RankSync::EnsureBuffer(Buffer& b, uint64_t bytes) {
  if (b.size() >= bytes || bytes == 0) return absl::OkStatus();
  b = Buffer();
  ASSIGN_OR_RETURN(b, Buffer::Allocate(bytes));
  return absl::OkStatus();
}

absl::Status RankSync::Prepare() {
  if (comms_.tp == nullptr || comms_.etp == nullptr || comms_.ep == nullptr)
    return absl::InvalidArgumentError("RunRankSync: TrainerComms without its tp / etp / ep communicators");
  if (comms_.world->size() != layout_.world_size())
    return absl::InvalidArgumentError(absl::StrCat("the world has ", comms_.world->size(), " ranks, the source's layout ",
                                                   layout_.world_size(), " (", layout_.DebugString(), ")"));
  const DenseCoord d = layout_.Dense(me_);
  const ExpertCoord e = layout_.Expert(me_);
  if (comms_.tp->size() != layout_.tp() || comms_.tp->rank() != d.tp || comms_.etp->size() != layout_.etp() ||
      comms_.etp->rank() != e.etp || comms_.ep->size() != layout_.ep() || comms_.ep->rank() != e.ep)
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", me_, ": communicators tp ", comms_.tp->rank(), "/", comms_.tp->size(), ", etp ", comms_.etp->rank(), "/",
        comms_.etp->size(), ", ep ", comms_.ep->rank(), "/", comms_.ep->size(), " do not match the layout (tp ", d.tp,
        "/", layout_.tp(), ", etp ", e.etp, "/", layout_.etp(), ", ep ", e.ep, "/", layout_.ep(), "; ",
        layout_.DebugString(), ")"));
  if (o_.bucket_bytes == 0) return absl::InvalidArgumentError("SyncOptions.bucket_bytes must be > 0");
  if (source_ && sink_ == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("rank ", me_, " is the source of stage ", stage_, " but has no sink"));
  if (!source_ && sink_ != nullptr)
    return absl::InvalidArgumentError(absl::StrCat("rank ", me_, " is not a stage source (stage ", stage_,
                                                   " is sent by rank ", layout_.StageSourceRank(stage_),
                                                   ") but was given a sink"));
  if (source_ && o_.quant != nullptr) RETURN_IF_ERROR(o_.quant->CheckInt4Supported());

  ASSIGN_OR_RETURN(shard_, src_.OpenRank(me_, o_.version));

  // Dense items: the stage source's TP group gathers TP-sharded parameters.
  std::vector<Item> dense, experts;
  for (size_t i = 0; i < shard_.params.size(); ++i) {
    const MegatronParam& p = shard_.params[i];
    Item it;
    it.index = static_cast<int>(i);
    it.local_bytes = shard_.tensors[i].nbytes();
    if (!p.is_expert) {
      if (!p.sent) continue;  // the tied output-layer copy: never sent, so never gathered
      it.gathered = p.kind != ShardKind::kReplicated && p.group_size > 1;
      if (it.gathered && p.group_size != comms_.tp->size())
        return absl::InternalError(absl::StrCat(p.global_name, ": group of ", p.group_size, ", TP communicator of ",
                                                comms_.tp->size()));
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
      it.region = it.full_bytes * static_cast<uint64_t>(layout_.ep());
      it.ordinal = static_cast<int>(experts.size());
      experts.push_back(it);
    }
  }
  if (dense_member_) dense_ = MakeBatches(std::move(dense), gather_limit_);
  if (expert_member_) experts_ = MakeBatches(std::move(experts), gather_limit_);

  // Buffers (uninitialized: no page is touched before the first gather writes it).
  uint64_t slot_bytes = 0, etp_bytes = 0, scratch_bytes = 0;
  for (const Batch& b : dense_) {
    bool any = false;
    for (const Item& it : b.items) {
      any = any || it.gathered;
      if (source_ && it.gathered && !it.identity) scratch_bytes = std::max(scratch_bytes, it.full_bytes);
    }
    if (any) slot_bytes = std::max(slot_bytes, b.bytes);
  }
  const bool expert_merger = layout_.Expert(me_).etp == 0;  // merges ETP shards / joins the EP gather
  const bool experts_gathered = layout_.ep() > 1 || layout_.etp() > 1;
  for (const Batch& b : experts_) {
    if (experts_gathered && expert_merger) slot_bytes = std::max(slot_bytes, b.bytes);
    if (layout_.etp() > 1) etp_bytes = std::max(etp_bytes, b.etp_bytes);
  }
  for (Buffer& s : slots_) RETURN_IF_ERROR(EnsureBuffer(s, slot_bytes));
  RETURN_IF_ERROR(EnsureBuffer(etp_buffer_, etp_bytes));
  RETURN_IF_ERROR(EnsureBuffer(scratch_, scratch_bytes));

  // The source converts every EP member's experts: their plans give the global expert ids.
  if (source_ && !experts_.empty()) {
    std::vector<const MegatronParam*> mine;
    for (const MegatronParam& p : shard_.params)
      if (p.is_expert) mine.push_back(&p);
    for (int member : layout_.EpGroup(me_)) {
      ASSIGN_OR_RETURN(std::vector<MegatronParam> plan,
                       convert::PlanRank(src_.model(), layout_, src_.parallel(), member));
      std::vector<MegatronParam> ex;
      for (MegatronParam& p : plan)
        if (p.is_expert) ex.push_back(std::move(p));
      if (ex.size() != mine.size())
        return absl::InternalError(absl::StrCat("EP member rank ", member, " holds ", ex.size(),
                                                " expert parameters, the stage source ", mine.size()));
      for (size_t k = 0; k < ex.size(); ++k)
        if (ex[k].local_name != mine[k]->local_name || ex[k].local_shape != mine[k]->local_shape)
          return absl::InternalError(absl::StrCat("EP member rank ", member, " expert parameter ", k, " is ",
                                                  ex[k].local_name, ", the stage source's ", mine[k]->local_name));
      member_experts_.push_back(std::move(ex));
    }
  }
  if (source_) {
    BucketBuilderOptions bo;
    bo.bucket_bytes = o_.bucket_bytes;
    bo.version = o_.version;
    bo.pp_stage = static_cast<uint32_t>(stage_);
    builder_.emplace(*sink_, bo);
  }
  return absl::OkStatus();
}

void RankSync::Wait(std::unique_ptr<Work>& w) {
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

absl::StatusOr<std::unique_ptr<Work>> RankSync::AllGather(Communicator& c, const std::vector<ConstBytes>& in,
                                                          const std::vector<MutableBytes>& out) {
  if (in.empty()) return std::unique_ptr<Work>();
  ++report_.gather_calls;
  for (const MutableBytes& b : out) report_.gather_bytes += b.nbytes;
  const absl::Time t0 = absl::Now();
  auto w = c.AllGather(in, out, o_.collective);
  report_.gather += absl::Now() - t0;
  if (!w.ok()) comm_failed_ = true;
  return w;
}

absl::Status RankSync::QuantizeIntoBucket(const std::string& name, const TensorView& w) {
  const QuantizationConfig& q = *o_.quant;
  absl::string_view prefix = name;
  if (!absl::ConsumeSuffix(&prefix, ".weight"))
    return absl::InvalidArgumentError(absl::StrCat("cannot quantize \"", name, "\": not a *.weight tensor"));
  absl::StatusOr<kernels::QuantizedShapes> shapes =
      kernels::QuantizedShapesFor(w, q.group_size, kernels::PackFormat::kCompressedTensors);
  if (!shapes.ok()) return Annotate(shapes.status(), absl::StrCat("quantizing \"", name, "\" (", w.DebugString(), ")"));
  const BucketBuilder::Pending pending[3] = {
      {absl::StrCat(prefix, ".weight_packed"), DType::kI32, shapes->packed},
      {absl::StrCat(prefix, ".weight_scale"), w.dtype(), shapes->scales},
      {absl::StrCat(prefix, ".weight_shape"), DType::kI64, Shape{2}},
  };
  ASSIGN_OR_RETURN(std::vector<MutableTensorView> dst, builder_->Reserve(pending));
  kernels::QuantizeOptions ko;
  ko.group_size = q.group_size;
  ko.variant = o_.quant_variant;
  ko.format = kernels::PackFormat::kCompressedTensors;
  ko.num_threads = o_.quant_threads;
  const absl::Time t0 = absl::Now();
  absl::Status s = kernels::QuantizeInt4(w, dst[0], dst[1], ko);
  report_.quantize += absl::Now() - t0;
  if (!s.ok()) return Annotate(s, absl::StrCat("quantizing \"", name, "\""));
  const int64_t nk[2] = {w.dim(0), w.dim(1)};
  std::memcpy(dst[2].data(), nk, sizeof(nk));
  report_.quantized_bytes += w.nbytes();
  return absl::OkStatus();
}

absl::Status RankSync::Emit(const MegatronParam& p, const TensorView& full) {
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::vector<convert::HfTensor>> hf = convert::ToHf(src_.model(), p, full);
  report_.convert += absl::Now() - t0;
  if (!hf.ok()) return hf.status();
  for (const convert::HfTensor& t : *hf) {
    report_.hf_bytes += t.view.nbytes();
    if (o_.quant != nullptr && quantize::IsQuantTarget(t.name, t.view.shape(), *o_.quant)) {
      RETURN_IF_ERROR(QuantizeIntoBucket(t.name, t.view));
    } else {
      RETURN_IF_ERROR(builder_->Add(t.name, t.view));
    }
  }
  return absl::OkStatus();
}

// TP all-gathers of the non-expert parameters, double-buffered; the source converts batch k
// while batch k+1 is on the wire.
void RankSync::RunDense() {
  std::array<std::unique_ptr<Work>, 2> pending;
  auto issue = [&](size_t j, int slot) {
    std::vector<ConstBytes> in;
    std::vector<MutableBytes> out;
    for (const Item& it : dense_[j].items) {
      if (!it.gathered) continue;
      const TensorView& t = shard_.tensors[static_cast<size_t>(it.index)];
      in.push_back({t.data(), t.nbytes()});
      out.push_back({slots_[slot].data() + it.offset, it.region});
    }
    auto w = AllGather(*comms_.tp, in, out);
    if (w.ok()) pending[slot] = std::move(*w);
    else Fail(w.status());
  };
  auto complete = [&](size_t j, int slot) {
    Wait(pending[slot]);
    if (!converting()) return;
    for (const Item& it : dense_[j].items) {
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
          absl::Status s = convert::MergeShards(p, shards, merged);
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
// the etp = 0 ranks, in place. Double-buffered like the dense phase.
void RankSync::RunExperts() {
  const int etp = layout_.etp(), ep = layout_.ep();
  const ExpertCoord coord = layout_.Expert(me_);
  const bool merger = coord.etp == 0;
  std::array<std::unique_ptr<Work>, 2> pending;
  auto issue = [&](size_t j, int slot) {
    const Batch& b = experts_[j];
    if (etp > 1) {
      std::vector<ConstBytes> in;
      std::vector<MutableBytes> out;
      for (const Item& it : b.items) {
        const TensorView& t = shard_.tensors[static_cast<size_t>(it.index)];
        in.push_back({t.data(), t.nbytes()});
        out.push_back({etp_buffer_.data() + it.etp_offset, it.full_bytes});
      }
      std::unique_ptr<Work> w;
      auto issued = AllGather(*comms_.etp, in, out);
      if (issued.ok()) w = std::move(*issued);
      else Fail(issued.status());
      Wait(w);
      if (merger && failure_.ok()) {
        const absl::Time t0 = absl::Now();
        for (const Item& it : b.items) {
          const MegatronParam& p = shard_.params[static_cast<size_t>(it.index)];
          std::span<const std::byte> region(etp_buffer_.data() + it.etp_offset, it.full_bytes);
          std::vector<TensorView> shards;
          for (int r = 0; r < etp; ++r)
            shards.emplace_back(p.dtype, p.local_shape, region.subspan(r * it.local_bytes, it.local_bytes));
          MutableTensorView dst(p.dtype, p.full_shape,
                                slots_[slot].span().subspan(it.offset + coord.ep * it.full_bytes, it.full_bytes));
          if (absl::Status s = convert::MergeShards(p, shards, dst); !s.ok()) {
            Fail(s);
            break;
          }
        }
        report_.convert += absl::Now() - t0;
      }
    }
    if (merger && ep > 1) {
      std::vector<ConstBytes> in;
      std::vector<MutableBytes> out;
      for (const Item& it : b.items) {
        std::byte* region = slots_[slot].data() + it.offset;
        if (etp > 1) {
          in.push_back({region + coord.ep * it.full_bytes, it.full_bytes});  // in place
        } else {
          const TensorView& t = shard_.tensors[static_cast<size_t>(it.index)];
          in.push_back({t.data(), t.nbytes()});
        }
        out.push_back({region, it.region});
      }
      auto w = AllGather(*comms_.ep, in, out);
      if (w.ok()) pending[slot] = std::move(*w);
      else Fail(w.status());
    }
  };
  auto complete = [&](size_t j, int slot) {
    Wait(pending[slot]);
    if (!converting()) return;
    for (int m = 0; m < ep; ++m) {
      for (const Item& it : experts_[j].items) {
        const MegatronParam& mine = shard_.params[static_cast<size_t>(it.index)];
        const MegatronParam& p = member_experts_[static_cast<size_t>(m)][static_cast<size_t>(it.ordinal)];
        TensorView full = shard_.tensors[static_cast<size_t>(it.index)];
        if (ep > 1 || etp > 1)
          full = TensorView(mine.dtype, mine.full_shape,
                            slots_[slot].span().subspan(it.offset + m * it.full_bytes, it.full_bytes));
        if (absl::Status s = Emit(p, full); !s.ok()) return Fail(s);
      }
    }
  };
  if (experts_.empty()) return;
  issue(0, 0);
  for (size_t j = 0; j < experts_.size(); ++j) {
    if (j + 1 < experts_.size()) issue(j + 1, static_cast<int>((j + 1) % 2));
    complete(j, static_cast<int>(j % 2));
  }
}

absl::StatusOr<SyncReport> RankSync::Run() {
  const absl::Time start = absl::Now();
  if (comms_.world == nullptr) return absl::InvalidArgumentError("RunRankSync: TrainerComms.world is null");
  me_ = comms_.world->rank();
  if (me_ < 0 || me_ >= layout_.world_size())
    return absl::InvalidArgumentError(absl::StrCat("world rank ", me_, " is outside the source's layout (",
                                                   layout_.DebugString(), ")"));
  stage_ = layout_.Dense(me_).pp;
  source_ = layout_.IsStageSource(me_);
  report_.source = source_;
  const DenseCoord d = layout_.Dense(me_);
  dense_member_ = d.dp == 0 && d.cp == 0;
  expert_member_ = layout_.Expert(me_).edp == 0;
  gather_limit_ = o_.gather_bytes > 0 ? o_.gather_bytes : o_.bucket_bytes;

  const absl::Status local = Prepare();
  const std::string fingerprint_text =
      absl::StrCat(src_.config_json(), "\n", convert::SourceParallelToJson(src_.parallel()), "\n", gather_limit_);
  const uint64_t fingerprint =
      Xxh3_64({reinterpret_cast<const std::byte*>(fingerprint_text.data()), fingerprint_text.size()});
  RETURN_IF_ERROR(AgreeOnStart(*comms_.world, local, fingerprint, o_.collective));
  report_.open = absl::Now() - start;

  if (dense_member_) RunDense();
  if (expert_member_) RunExperts();
  if (source_ && failure_.ok()) {
    Fail(builder_->Finish());
  }
  if (builder_) {
    const BucketBuilderStats& st = builder_->stats();
    report_.bucket = st.copy;
    report_.send_wait = st.send_wait;
    report_.bytes = st.bytes;
    report_.buckets = st.buckets;
    report_.tensors = st.tensors;
    report_.peak_bucket_bytes = st.peak_bucket_bytes;
  }
  if (comm_failed_) {
    for (Buffer& b : slots_) LeakForFailedCollectives(std::move(b));
    LeakForFailedCollectives(std::move(etp_buffer_));
    if (shard_.backing) new std::shared_ptr<const void>(shard_.backing);  // NOLINT: send buffers
  }
  report_.total = absl::Now() - start;
  if (!failure_.ok())
    return Annotate(failure_, absl::StrCat("sync version ", o_.version, ", rank ", me_,
                                           source_ ? absl::StrCat(" (stage ", stage_, " source)") : ""));
  return report_;
}

absl::StatusOr<SyncReport> RunRankSync(const source::WeightSource& src, TrainerComms& comms, BucketSink* sink,
                                       const SyncOptions& options) {
  RankSync sync(src, comms, sink, options);
  return sync.Run();
}

}  // namespace wsync::sync
