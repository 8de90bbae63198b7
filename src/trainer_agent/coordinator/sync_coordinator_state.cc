// SyncCoordinator's durable state: the lock on the state directory, the state file
// (DIR/coordinator-state.json: versions, the next sync id and version, the published and committing
// versions, the fleet, the finished syncs' timings) and the history kept in memory.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "trainer_agent/coordinator/sync_coordinator.h"
#include "trainer_agent/coordinator/sync_coordinator_internal.h"

namespace wsync::trainer_agent {

using coordinator_internal::CopyDeltaFigures;
using coordinator_internal::kKeptTimings;
using coordinator_internal::kKeptVersions;

// A coordinator runs for as many syncs as the training job takes (tens of thousands): it keeps the
// newest kKeptVersions attempts (`wsyncctl versions`) and the newest kKeptTimings finished syncs'
// records (timings, members), as the state file does, so its memory does not grow with them.
void SyncCoordinator::PruneHistory() {
  if (versions_.size() > kKeptVersions)
    versions_.erase(versions_.begin(), versions_.end() - static_cast<std::ptrdiff_t>(kKeptVersions));
  size_t finished = 0;
  for (const auto& [id, rec] : syncs_) finished += rec.finished ? 1 : 0;
  for (auto it = syncs_.begin(); it != syncs_.end() && finished > kKeptTimings;) {
    if (it->second.finished) {  // std::map: oldest sync ids first
      it = syncs_.erase(it);
      --finished;
    } else {
      ++it;
    }
  }
}

namespace {

std::string StatePath(const std::string& dir) { return dir + "/coordinator-state.json"; }

absl::Status WriteDurably(const std::string& dir, const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("writing ", tmp));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      unlink(tmp.c_str());
      return ErrnoToStatus(err, absl::StrCat("writing ", tmp));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = fsync(fd) == 0;
  const int err = errno;
  close(fd);
  if (!synced || rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = synced ? errno : err;
    unlink(tmp.c_str());
    return ErrnoToStatus(e, absl::StrCat("replacing ", path));
  }
  if (const int d = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); d >= 0) {
    fsync(d);  // the rename itself
    close(d);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SyncCoordinator::LoadState() {
  if (opts_.state_dir.empty()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(opts_.state_dir, ec);
  if (ec)
    return absl::PermissionDeniedError(
        absl::StrCat("creating the state directory ", opts_.state_dir, ": ", ec.message()));
  // One coordinator per state directory: a second job started on it (a forgotten one still running,
  // a test beside another) would overwrite the first's numbers. The lock goes with the process.
  const std::string lock_path = opts_.state_dir + "/coordinator.lock";
  const int lock_fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) return ErrnoToStatus(errno, absl::StrCat("opening ", lock_path));
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    if (auto t = ReadTextFile(lock_path); t.ok()) holder = std::string(absl::StripAsciiWhitespace(*t));
    close(lock_fd);
    if (err != EWOULDBLOCK) return ErrnoToStatus(err, absl::StrCat("locking ", lock_path));
    return absl::FailedPreconditionError(absl::StrCat(
        "the state directory ", opts_.state_dir, " is in use by another coordinator (", holder.empty() ? "?" : holder,
        "): one trainer job per --state-dir; stop the other job, or give this one its own --state-dir"));
  }
  if (ftruncate(lock_fd, 0) == 0) {
    const std::string me = absl::StrCat("pid ", getpid(), "\n");
    (void)!write(lock_fd, me.data(), me.size());
  }
  if (state_lock_fd_ >= 0) close(state_lock_fd_);
  state_lock_fd_ = lock_fd;
  const std::string path = StatePath(opts_.state_dir);
  if (!std::filesystem::exists(path)) {
    WSYNC_LOG(INFO) << "coordinator state: none in " << opts_.state_dir << " yet; versions start at 1";
    return absl::OkStatus();
  }
  auto text = ReadTextFile(path);
  if (!text.ok())
    return absl::FailedPreconditionError(absl::StrCat("coordinator state ", path, ": ", text.status().message()));
  v1::CoordinatorState st;
  google::protobuf::util::JsonParseOptions jo;
  if (auto parsed = google::protobuf::util::JsonStringToMessage(*text, &st, jo); !parsed.ok())
    return absl::FailedPreconditionError(absl::StrCat("coordinator state ", path, " is not valid (", parsed.ToString(),
                                                      "); fix it or move it away to start afresh"));
  absl::MutexLock lock(&mu_);
  published_ = st.published();
  next_version_ = std::max<uint64_t>({st.next_version(), st.published() + 1, 1});
  next_sync_id_ = std::max<uint64_t>(st.next_sync_id(), 1);
  last_error_ = st.last_error();
  versions_.assign(st.versions().begin(), st.versions().end());
  for (v1::VersionRecord& v : versions_)
    if (v.outcome().empty()) v.set_outcome(v.ok() ? "done" : "failed");  // a state file from before outcomes
  for (const v1::VersionRecord& v : versions_) next_sync_id_ = std::max(next_sync_id_, v.sync_id() + 1);
  for (const v1::TimingsReply& t : st.timings()) {
    SyncRecord& rec = syncs_[t.sync_id()];
    rec.id = t.sync_id();
    rec.version = t.version();
    rec.finished = true;
    rec.phase = "done";
    CopyDeltaFigures(t, &rec.delta_figures);
    if (!t.delivery().empty()) {
      auto d = plan::ParseDelivery(t.delivery());
      if (d.ok()) rec.delivery = *d;
    }
    for (const v1::VersionRecord& v : versions_) {
      if (v.sync_id() != t.sync_id()) continue;
      rec.phase = v.outcome();
      rec.error = v.error();
    }
    for (const v1::PhaseTiming& p : t.phases()) rec.phases.push_back({p.phase(), p.seconds(), p.bytes()});
    next_sync_id_ = std::max(next_sync_id_, rec.id + 1);
  }
  rolling_forward_ = st.rolling_forward();
  for (const v1::FleetEngineState& f : st.fleet()) {
    FleetEngine& e = fleet_[f.engine_id()];
    e.tp_size = std::max<uint32_t>(f.tp_size(), 1);
    e.removed = f.removed();
  }
  if (st.committing_sync_id() != 0 && st.committing_version() > published_) {
    // The previous coordinator stopped during this sync's commit: some engines may hold the version,
    // every agent has it prepared. Roll them all forward to it (the reaper tells each one behind).
    recover_sync_ = st.committing_sync_id();
    rolling_forward_ = std::max(rolling_forward_, st.committing_version());
    v1::VersionRecord vr;
    vr.set_version(st.committing_version());
    vr.set_sync_id(st.committing_sync_id());
    vr.set_ok(false);
    vr.set_outcome("rolling_forward");
    vr.set_error(
        "the coordinator stopped during this sync's commit: the engines roll forward to it from their staging");
    versions_.push_back(vr);
    last_error_ = vr.error();
    WSYNC_LOG(WARNING) << "sync " << recover_sync_ << " was committing version " << st.committing_version()
                       << " when the previous coordinator stopped: every engine rolls forward to it from its "
                          "agent's staging, and it is published as soon as one reports it";
  }
  if (rolling_forward_ <= published_) rolling_forward_ = 0;
  RefreshVersions();
  WSYNC_LOG(INFO) << "coordinator state from " << path << ": version " << published_ << " published, "
                  << versions_.size() << " attempts; the next sync is " << next_sync_id_ << ", version "
                  << next_version_ << "; a fleet of " << fleet_.size() << " engine(s)";
  return absl::OkStatus();
}

absl::Status SyncCoordinator::SaveState() {
  if (opts_.state_dir.empty()) return absl::OkStatus();
  v1::CoordinatorState st;
  st.set_next_version(next_version_);
  st.set_next_sync_id(next_sync_id_);
  st.set_published(published_);
  st.set_last_error(last_error_);
  st.set_committing_sync_id(committing_sync_);
  st.set_committing_version(committing_version_);
  st.set_rolling_forward(rolling_forward_);
  for (const auto& [id, e] : fleet_) {
    v1::FleetEngineState* f = st.add_fleet();
    f->set_engine_id(id);
    f->set_tp_size(e.tp_size);
    f->set_removed(e.removed);
  }
  const size_t first = versions_.size() > kKeptVersions ? versions_.size() - kKeptVersions : 0;
  for (size_t i = first; i < versions_.size(); ++i) *st.add_versions() = versions_[i];
  std::vector<const SyncRecord*> done;
  for (const auto& [id, rec] : syncs_)
    if (rec.finished) done.push_back(&rec);
  std::sort(done.begin(), done.end(), [](const SyncRecord* a, const SyncRecord* b) { return a->id < b->id; });
  for (size_t i = done.size() > kKeptTimings ? done.size() - kKeptTimings : 0; i < done.size(); ++i) {
    v1::TimingsReply* t = st.add_timings();
    t->set_version(done[i]->version);
    t->set_sync_id(done[i]->id);
    t->set_delivery(std::string(plan::DeliveryName(done[i]->delivery)));
    CopyDeltaFigures(done[i]->delta_figures, t);
    for (const PhaseTime& p : done[i]->phases) {
      v1::PhaseTiming* pt = t->add_phases();
      pt->set_phase(p.phase);
      pt->set_seconds(p.seconds);
      pt->set_bytes(p.bytes);
    }
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions po;
  po.add_whitespace = true;
  absl::Status s;
  if (auto printed = google::protobuf::util::MessageToJsonString(st, &json, po); !printed.ok())
    s = absl::InternalError(printed.ToString());
  if (s.ok()) s = WriteDurably(opts_.state_dir, StatePath(opts_.state_dir), json);
  if (!s.ok()) WSYNC_LOG(ERROR) << "saving the coordinator state in " << opts_.state_dir << ": " << s;
  return s;
}

}  // namespace wsync::trainer_agent
