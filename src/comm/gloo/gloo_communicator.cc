#include "comm/gloo/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/gloo/link_monitor.h"
#include "comm/rendezvous.h"
#include "comm/store/store.h"
#include "common/status.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

namespace wsync::comm {
namespace {

constexpr absl::Duration kLinkGrace = absl::Milliseconds(500);

std::chrono::milliseconds ToMillis(absl::Duration d) {
  if (d == absl::InfiniteDuration()) return std::chrono::hours(24 * 365);
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d + absl::Microseconds(999))));
}

// Gloo's rendezvous interface over a wsync Store, under a key prefix. Gloo expects exceptions.
class GlooStore : public gloo::rendezvous::Store {
 public:
  // `cancelled` (may be empty) is polled while waiting for peers' keys (comm/rendezvous.h).
  GlooStore(comm::Store* store, std::string prefix, absl::Duration timeout, std::function<bool()> cancelled)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout), cancelled_(std::move(cancelled)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Throw(store_->Set(prefix_ + key, std::string(data.begin(), data.end())));
  }
  std::vector<char> get(const std::string& key) override {
    Throw(WaitUnlessCancelled(*store_, {prefix_ + key}, timeout_, cancelled_, "connecting the mesh"));
    auto v = store_->Get(prefix_ + key, timeout_);
    Throw(v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, ToMillis(timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    Throw(WaitUnlessCancelled(*store_, full, absl::Milliseconds(timeout.count()), cancelled_, "connecting the mesh"));
  }
  bool was_cancelled() const { return cancelled_hit_; }

 private:
  void Throw(const absl::Status& s) {
    if (absl::IsCancelled(s)) cancelled_hit_ = true;
    if (!s.ok()) throw gloo::IoException(std::string(s.ToString()));
  }
  comm::Store* store_;
  std::string prefix_;
  absl::Duration timeout_;
  std::function<bool()> cancelled_;
  bool cancelled_hit_ = false;
};

}  // namespace

// The unbound buffers of the running operation, registered so that Interrupt() can release their
// waits. On failure, the connections are closed before the buffers are destroyed.
class GlooCommunicator::InFlight {
 public:
  InFlight(GlooCommunicator* owner, const std::vector<void*>& data, const std::vector<size_t>& sizes) : owner_(owner) {
    for (size_t i = 0; i < data.size(); ++i) {
      buffers_.push_back(sizes[i] > 0 ? owner->context_->createUnboundBuffer(data[i], sizes[i]) : nullptr);
    }
    ack_in_index_ = buffers_.size();
    buffers_.push_back(owner->context_->createUnboundBuffer(&ack_in_, 1));
    buffers_.push_back(owner->context_->createUnboundBuffer(&ack_out_, 1));
    absl::MutexLock lock(&owner_->inflight_mu_);
    for (auto& b : buffers_) {
      if (b) owner_->inflight_.push_back(b.get());
    }
  }
  ~InFlight() {
    {
      absl::MutexLock lock(&owner_->inflight_mu_);
      owner_->inflight_.clear();
    }
    if (failed_) owner_->CloseConnections();
  }
  gloo::transport::UnboundBuffer& operator[](size_t i) { return *buffers_[i]; }

  // The link acknowledgement that makes a lost successor visible to a sender (see Ring()).
  size_t ack_in() const { return ack_in_index_; }
  size_t ack_out() const { return ack_in_index_ + 1; }
  // Which links the rest of the operation still depends on: a neighbour that finished its part
  // and left is no failure.
  void Needs(bool prev, bool next) {
    need_prev_ = prev;
    need_next_ = next;
  }

  // A wait returns false when Abort() or the link monitor woke it (or a stale wake-up of another
  // wait): check why and wait again. Once a needed link is reported lost, the wait gets a short
  // grace (bytes the peer wrote before leaving may still be in flight on Gloo's own connection);
  // if it expires, Gloo throws and the caller reports the lost link.
  absl::Status WaitRecv(const OpContext& ctx, size_t i) {
    for (;;) {
      RETURN_IF_ERROR(Check(ctx));
      if (buffers_[i]->waitRecv(ToMillis(WaitLimit(ctx)))) return absl::OkStatus();
    }
  }
  absl::Status WaitSend(const OpContext& ctx, size_t i) {
    for (;;) {
      RETURN_IF_ERROR(Check(ctx));
      if (buffers_[i]->waitSend(ToMillis(WaitLimit(ctx)))) return absl::OkStatus();
    }
  }
  absl::Duration WaitLimit(const OpContext& ctx) {
    const bool lost = !owner_->LinkStatus(need_prev_, need_next_).ok();
    return lost ? std::min(ctx.Remaining(), kLinkGrace) : ctx.Remaining();
  }
  absl::Status Check(const OpContext& ctx) {
    absl::Status s = ctx.Check();
    return s.ok() ? s : Fail(s);
  }
  // A Gloo exception: a timeout if the deadline has passed, else a lost peer.
  absl::Status FromException(const OpContext& ctx, const char* what) {
    if (ctx.Aborted()) return Fail(absl::AbortedError("aborted"));
    absl::Status link = owner_->LinkStatus(need_prev_, need_next_);
    if (!link.ok()) return Fail(link);
    if (ctx.Expired()) return Fail(absl::DeadlineExceededError(what));
    return Fail(absl::UnavailableError(absl::StrCat("lost a peer: ", what)));
  }
  absl::Status Fail(absl::Status s) {
    failed_ = true;
    return s;
  }

 private:
  GlooCommunicator* owner_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> buffers_;
  size_t ack_in_index_ = 0;
  bool need_prev_ = true;
  bool need_next_ = true;
  char ack_in_ = 0;
  char ack_out_ = 1;
  bool failed_ = false;
};

absl::StatusOr<std::unique_ptr<Communicator>> GlooCommunicator::Create(const GroupOptions& options) {
  const std::string where =
      absl::StrCat("forming gloo group \"", options.name, "\" as rank ", options.rank, "/", options.size);
  if (options.store == nullptr) return absl::InvalidArgumentError(absl::StrCat(where, ": no rendezvous store"));
  if (options.name.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": the group needs a name"));
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": rank out of range"));
  }
  // Gloo writes with writev(2): a peer that died must give EPIPE (-> kUnavailable), not a SIGPIPE
  // that kills this process. Process-wide, as every network daemon does.
  std::signal(SIGPIPE, SIG_IGN);
  Store& store = *options.store;
  const absl::Time deadline = absl::Now() + options.join_timeout;

  RETURN_IF_ERROR(Annotate(
      JoinGroup(store, options.name, options.rank, options.size, options.host, options.join_timeout, options.cancelled),
      where));

  // Connect the full mesh through the same store.
  const absl::Duration remaining = std::max(deadline - absl::Now(), absl::Seconds(1));
  auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
  GlooStore gstore(&store, absl::StrCat(options.name, "/mesh/"), remaining, options.cancelled);
  try {
    gloo::transport::tcp::attr attr(options.host.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    context->setTimeout(ToMillis(remaining));
    context->connectFullMesh(gstore, device);
    context->setTimeout(ToMillis(options.default_timeout));
  } catch (const std::exception& e) {
    if (gstore.was_cancelled()) return absl::CancelledError(absl::StrCat(where, ": connecting the mesh was cancelled"));
    return absl::UnavailableError(absl::StrCat(where, ": connecting the mesh failed: ", e.what()));
  }
  auto monitor = LinkMonitor::Create(store, absl::StrCat(options.name, "/link/"), options.rank, options.size,
                                     options.host, std::max(deadline - absl::Now(), absl::Seconds(1)));
  if (!monitor.ok()) return Annotate(monitor.status(), absl::StrCat(where, ": connecting the ring links"));
  auto comm = std::unique_ptr<GlooCommunicator>(new GlooCommunicator(options, std::move(context), std::move(*monitor)));
  comm->StartWorker();
  return std::unique_ptr<Communicator>(std::move(comm));
}

GlooCommunicator::GlooCommunicator(const GroupOptions& options, std::shared_ptr<gloo::Context> context,
                                   std::unique_ptr<LinkMonitor> monitor)
    : QueuedCommunicator(options.name, options.rank, options.size, options.default_timeout),
      options_(options),
      context_(std::move(context)),
      monitor_(std::move(monitor)) {
  monitor_->Start([this](LinkMonitor::Link link, const std::string& what) {
    {
      absl::MutexLock lock(&inflight_mu_);
      (link == LinkMonitor::Link::kPrev ? prev_lost_ : next_lost_) =
          absl::UnavailableError(absl::StrCat("lost a peer: ", what));
    }
    WakeWaits();
  });
}

GlooCommunicator::~GlooCommunicator() { Shutdown().IgnoreError(); }

absl::StatusOr<std::unique_ptr<Communicator>> GlooCommunicator::Split(int color, int key, std::string name) {
  const std::string where = absl::StrCat("splitting gloo group \"", group(), "\" into \"", name, "\" (color ", color,
                                         ", key ", key, ") as rank ", rank());
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": the subgroup needs a name"));
  const int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * static_cast<size_t>(size()));
  ConstBytes in{mine, sizeof(mine)};
  MutableBytes out{all.data(), all.size() * sizeof(int32_t)};
  RETURN_IF_ERROR(Annotate(Await(AllGather({&in, 1}, {&out, 1}, CollectiveOptions{})), where));
  std::vector<std::pair<int32_t, int>> members;  // (key, rank) of this color
  for (int r = 0; r < size(); ++r)
    if (all[2 * static_cast<size_t>(r)] == color) members.emplace_back(all[2 * static_cast<size_t>(r) + 1], r);
  std::sort(members.begin(), members.end());
  GroupOptions sub = options_;
  sub.name = absl::StrCat(group(), "/", name);
  sub.size = static_cast<int>(members.size());
  sub.rank = static_cast<int>(std::find(members.begin(), members.end(), std::make_pair(key, rank())) - members.begin());
  ASSIGN_OR_RETURN(auto comm, Create(sub));
  return comm;
}

absl::Status GlooCommunicator::LinkStatus(bool need_prev, bool need_next) {
  absl::MutexLock lock(&inflight_mu_);
  if (need_prev && !prev_lost_.ok()) return prev_lost_;
  if (need_next && !next_lost_.ok()) return next_lost_;
  return absl::OkStatus();
}

void GlooCommunicator::WakeWaits() {
  absl::MutexLock lock(&inflight_mu_);
  for (auto* b : inflight_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

void GlooCommunicator::Interrupt() {
  WakeWaits();
  // Close now, also when nothing is in flight, so that the peers see kUnavailable at once rather
  // than wait out their timeouts.
  CloseConnections();
}

void GlooCommunicator::OnBroken() { CloseConnections(); }

void GlooCommunicator::CloseConnections() {
  absl::MutexLock close(&close_mu_);
  {
    absl::MutexLock lock(&inflight_mu_);
    if (closed_) return;
    closed_ = true;
  }
  monitor_->Close();  // not under inflight_mu_: the monitor's callback takes it
  try {
    context_->closeConnections();
  } catch (const std::exception&) {
    // Already broken: nothing more to release.
  }
}

absl::Status GlooCommunicator::ReleaseBackend() {
  CloseConnections();
  return absl::OkStatus();
}

// Gloo wakes a pending waitRecv when its connection fails, but not always a waitSend whose data is
// still queued for a peer that died. So every link carries a one-byte acknowledgement: a member
// acks its predecessor once it has received everything, and a sender waits for its successor's
// ack (a receive, which fails properly) before it waits for its own sends.
absl::Status GlooCommunicator::DoBroadcast(const OpContext& ctx, absl::Span<const MutableBytes> buffers, int root) {
  const int n = size();
  const uint64_t slot = context_->nextSlot();
  const uint64_t ack_slot = context_->nextSlot();
  if (n == 1) return absl::OkStatus();
  const int pos = (rank() - root + n) % n;
  const int prev = (rank() - 1 + n) % n;
  const int next = (rank() + 1) % n;
  const bool has_prev = pos != 0;
  const bool has_next = pos != n - 1;

  std::vector<void*> data;
  std::vector<size_t> sizes;
  std::vector<Block> pieces;
  for (size_t i = 0; i < buffers.size(); ++i) {
    data.push_back(buffers[i].data);
    sizes.push_back(buffers[i].nbytes);
    for (size_t off = 0; off < buffers[i].nbytes; off += kPieceBytes) {
      pieces.push_back({i, off, std::min(kPieceBytes, buffers[i].nbytes - off)});
    }
  }
  if (pieces.empty()) return absl::OkStatus();
  InFlight io(this, data, sizes);
  io.Needs(has_prev, has_next);
  RETURN_IF_ERROR(io.Check(ctx));
  try {
    if (has_next) io[io.ack_in()].recv(next, ack_slot);
    std::vector<int> sends(buffers.size(), 0);
    if (!has_prev) {
      for (const Block& p : pieces) {
        io[p.buffer].send(next, slot, p.offset, p.nbytes);
        ++sends[p.buffer];
      }
    } else {
      size_t posted = 0;
      for (size_t k = 0; k < pieces.size(); ++k) {
        for (; posted < pieces.size() && posted < k + kWindow; ++posted) {
          io[pieces[posted].buffer].recv(prev, slot, pieces[posted].offset, pieces[posted].nbytes);
        }
        RETURN_IF_ERROR(io.WaitRecv(ctx, pieces[k].buffer));
        if (has_next) {
          io[pieces[k].buffer].send(next, slot, pieces[k].offset, pieces[k].nbytes);
          ++sends[pieces[k].buffer];
        }
      }
      io[io.ack_out()].send(prev, ack_slot);
      io.Needs(false, has_next);
    }
    if (has_next) RETURN_IF_ERROR(io.WaitRecv(ctx, io.ack_in()));
    io.Needs(false, false);
    for (size_t i = 0; i < buffers.size(); ++i) {
      for (int c = 0; c < sends[i]; ++c) RETURN_IF_ERROR(io.WaitSend(ctx, i));
    }
    // The acknowledgement to the predecessor: if the predecessor is lost before it took the byte,
    // the send may stay queued (see above), so its loss ends this wait after the grace instead of
    // the op timeout. A predecessor that took the ack and then left completed the send already.
    io.Needs(has_prev, false);
    if (has_prev) RETURN_IF_ERROR(io.WaitSend(ctx, io.ack_out()));
  } catch (const std::exception& e) {
    return io.FromException(ctx, e.what());
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::Ring(const OpContext& ctx, const std::vector<void*>& buffers,
                                    const std::vector<size_t>& sizes, const std::vector<std::vector<Block>>& send,
                                    const std::vector<std::vector<Block>>& recv) {
  const uint64_t slot = context_->nextSlot();
  const uint64_t ack_slot = context_->nextSlot();
  const int n = size();
  if (n == 1) return absl::OkStatus();
  const int prev = (rank() - 1 + n) % n;
  const int next = (rank() + 1) % n;
  InFlight io(this, buffers, sizes);
  RETURN_IF_ERROR(io.Check(ctx));
  try {
    io[io.ack_in()].recv(next, ack_slot);
    std::vector<int> sends(buffers.size(), 0);
    for (size_t s = 0; s < send.size(); ++s) {
      for (const Block& b : recv[s]) {
        if (b.nbytes > 0) io[b.buffer].recv(prev, slot, b.offset, b.nbytes);
      }
      for (const Block& b : send[s]) {
        if (b.nbytes == 0) continue;
        io[b.buffer].send(next, slot, b.offset, b.nbytes);
        ++sends[b.buffer];
      }
      for (const Block& b : recv[s]) {
        if (b.nbytes > 0) RETURN_IF_ERROR(io.WaitRecv(ctx, b.buffer));
      }
    }
    io[io.ack_out()].send(prev, ack_slot);
    io.Needs(false, true);
    RETURN_IF_ERROR(io.WaitRecv(ctx, io.ack_in()));
    io.Needs(false, false);
    for (size_t i = 0; i < buffers.size(); ++i) {
      for (int c = 0; c < sends[i]; ++c) RETURN_IF_ERROR(io.WaitSend(ctx, i));
    }
    io.Needs(true, false);  // the acknowledgement to the predecessor, as in DoBroadcast
    RETURN_IF_ERROR(io.WaitSend(ctx, io.ack_out()));
  } catch (const std::exception& e) {
    return io.FromException(ctx, e.what());
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::DoAllGather(const OpContext& ctx, absl::Span<const ConstBytes> inputs,
                                           absl::Span<const MutableBytes> outputs) {
  const int n = size();
  std::vector<void*> data;
  std::vector<size_t> sizes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto* own = static_cast<char*>(outputs[i].data) + inputs[i].nbytes * rank();
    if (inputs[i].nbytes > 0 && own != inputs[i].data) std::memmove(own, inputs[i].data, inputs[i].nbytes);
    data.push_back(outputs[i].data);
    sizes.push_back(outputs[i].nbytes);
  }
  std::vector<std::vector<Block>> send(n - 1), recv(n - 1);
  for (int s = 0; s + 1 < n; ++s) {
    const int send_block = (rank() - s + n) % n;
    const int recv_block = (rank() - s - 1 + n) % n;
    for (size_t i = 0; i < inputs.size(); ++i) {
      send[s].push_back({i, inputs[i].nbytes * send_block, inputs[i].nbytes});
      recv[s].push_back({i, inputs[i].nbytes * recv_block, inputs[i].nbytes});
    }
  }
  return Ring(ctx, data, sizes, send, recv);
}

absl::Status GlooCommunicator::DoAllGatherV(const OpContext& ctx, ConstBytes input, MutableBytes output,
                                            absl::Span<const size_t> bytes_per_rank) {
  const int n = size();
  std::vector<size_t> offsets(n, 0);
  for (int r = 1; r < n; ++r) offsets[r] = offsets[r - 1] + bytes_per_rank[r - 1];
  auto* own = static_cast<char*>(output.data) + offsets[rank()];
  if (input.nbytes > 0 && own != input.data) std::memmove(own, input.data, input.nbytes);
  std::vector<std::vector<Block>> send(n - 1), recv(n - 1);
  for (int s = 0; s + 1 < n; ++s) {
    const int sb = (rank() - s + n) % n;
    const int rb = (rank() - s - 1 + n) % n;
    send[s].push_back({0, offsets[sb], bytes_per_rank[sb]});
    recv[s].push_back({0, offsets[rb], bytes_per_rank[rb]});
  }
  return Ring(ctx, {output.data}, {output.nbytes}, send, recv);
}

absl::Status GlooCommunicator::DoBarrier(const OpContext& ctx) {
  std::vector<char> bytes(size(), 1);
  ConstBytes in{&bytes[rank()], 1};
  MutableBytes out{bytes.data(), bytes.size()};
  return DoAllGather(ctx, absl::MakeConstSpan(&in, 1), absl::MakeConstSpan(&out, 1));
}

}  // namespace wsync::comm
