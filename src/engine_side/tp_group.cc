#include "engine_side/tp_group.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "common/logging.h"

namespace wsync::engine_side {
namespace {

constexpr absl::Duration kRetry = absl::Milliseconds(200);

std::string InstanceId() {
  std::random_device rd;
  return absl::StrCat(absl::Hex(static_cast<uint32_t>(rd()), absl::kZeroPad8),
                      absl::Hex(static_cast<uint32_t>(rd()), absl::kZeroPad8));
}

// Sleeps `d` in short steps; false when cancelled meanwhile.
bool Pause(absl::Duration d, const std::function<bool()>& cancelled) {
  const absl::Time until = absl::Now() + d;
  while (absl::Now() < until) {
    if (cancelled && cancelled()) return false;
    absl::SleepFor(std::min(absl::Milliseconds(50), until - absl::Now()));
  }
  return !(cancelled && cancelled());
}

}  // namespace

void RunTpGroup(EngineCore* core, comm::Store* store, const TpGroupOptions& o, const std::function<bool()>& cancelled) {
  const std::string base = absl::StrCat("wsync-engine/", o.engine_id, "/tp");
  const std::string epoch_key = absl::StrCat(base, "/epoch");
  const std::string instance = o.tp_rank == 0 ? InstanceId() : "";
  std::string last;  // the token this rank last formed (or skipped)
  int failures = 0;
  for (int n = 1; !(cancelled && cancelled()); ++n) {
    // 1. The epoch to form.
    std::string token;
    if (o.tp_rank == 0) {
      token = absl::StrCat(instance, "-", n);
      if (absl::Status s = store->Set(epoch_key, token); !s.ok()) {  // rank 0's own memory store
        core->GroupFailed(s);
        if (!Pause(kRetry, cancelled)) return;
        continue;
      }
    } else {
      absl::StatusOr<std::string> t = store->Get(epoch_key, absl::Seconds(1));
      if (!t.ok() || *t == last) {
        if (!Pause(kRetry, cancelled)) return;
        continue;
      }
      token = *std::move(t);
      if (store->Get(absl::StrCat(base, "/", token, "/formed"), absl::ZeroDuration()).ok()) {
        last = token;  // formed without this process (its previous life): wait for the next one
        continue;
      }
    }
    const std::string group = absl::StrCat(base, "/", token);

    // 2. Form it.
    absl::Status s = store->Set(absl::StrCat(group, "/address/", o.tp_rank), o.address);
    comm::GroupOptions g;
    g.store = store;
    g.name = group;
    g.rank = o.tp_rank;
    g.size = o.tp_size;
    g.host = o.host;
    g.join_timeout = o.join_timeout;
    g.default_timeout = o.default_timeout;
    g.cancelled = cancelled;
    absl::StatusOr<std::unique_ptr<comm::Communicator>> comm =
        s.ok() ? comm::CreateGroup(comm::Backend::kGloo, g) : absl::StatusOr<std::unique_ptr<comm::Communicator>>(s);
    absl::StatusOr<std::string> leader =
        comm.ok() ? store->Get(absl::StrCat(group, "/address/0"), absl::Seconds(30)) : comm.status();
    if (comm.ok() && leader.ok() && o.tp_rank == 0) {
      if (absl::Status f = store->Set(absl::StrCat(group, "/formed"), "1"); !f.ok()) leader = f;
    }
    last = token;
    if (!comm.ok() || !leader.ok()) {
      if (cancelled && cancelled()) return;
      const absl::Status err = comm.ok() ? leader.status() : comm.status();
      if (failures++ % 10 == 0) WSYNC_LOG(ERROR) << "TP group " << group << " not formed (retrying): " << err;
      core->GroupFailed(err);
      if (comm.ok()) (void)(*comm)->Shutdown();
      if (!Pause(kRetry, cancelled)) return;
      continue;
    }
    failures = 0;
    WSYNC_LOG(INFO) << "TP group " << group << " formed (" << o.tp_size << " ranks); rank 0 at " << *leader;
    core->AttachGroup(*std::move(comm), *std::move(leader));

    // 3. Serve until it breaks, then let go of it.
    absl::Status why;
    if (!core->AwaitBroken(cancelled, &why)) return;
    WSYNC_LOG(WARNING) << "TP group " << group << " broke (" << why << "); re-forming";
    core->DetachGroup(why);
  }
}

}  // namespace wsync::engine_side
