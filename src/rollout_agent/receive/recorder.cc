#include "rollout_agent/receive/recorder.h"

#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <random>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/bucket/stream.h"
#include "common/logging.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace wsync::rollout_agent {
namespace fs = std::filesystem;

namespace {

constexpr char kSyncKey[] = "wsync_sync";

absl::Status FsError(const std::error_code& ec, absl::string_view what) {
  return ::wsync::ErrnoToStatus(ec.value(), what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Recorder>> Recorder::Start(const std::string& dir, uint64_t version,
                                                          const std::string& sync_key) {
  if (sync_key.empty() || sync_key.find('/') != std::string::npos || sync_key.find('\n') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("recording: bad sync key '", sync_key, "' (empty, '/' or newline)"));
  }
  std::unique_ptr<Recorder> r(new Recorder());
  std::random_device rd;
  r->dir_ = dir;
  r->version_ = version;
  r->sync_key_ = sync_key;
  r->final_dir_ = (fs::path(dir) / absl::StrCat("v", version)).string();
  r->partial_dir_ = (fs::path(dir) / absl::StrFormat(".v%d.partial-%s-%08x", version, sync_key, rd())).string();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return FsError(ec, absl::StrCat("creating the record directory ", dir));
  if (!fs::create_directory(r->partial_dir_, ec) || ec) {
    return FsError(ec ? ec : std::make_error_code(std::errc::file_exists), absl::StrCat("creating ", r->partial_dir_));
  }
  return r;
}

bool Recorder::PeerPublished() const {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(final_dir_, ec)) {
    if (e.path().extension() != ".safetensors") continue;
    auto file = SafetensorsFile::Open(e.path().string());
    if (!file.ok()) return false;
    auto it = file->metadata().find(kSyncKey);
    return it != file->metadata().end() && it->second == sync_key_;
  }
  return !ec;  // an empty recording: nothing to tell apart, nothing to replace
}

Recorder::~Recorder() {
  if (!done_) Discard();
}

absl::Status Recorder::WriteBucket(const v1::BucketManifest& m, const std::byte* data) const {
  if (m.entries_size() == 0) return absl::OkStatus();
  SafetensorsWriter writer;
  for (const v1::BucketEntry& e : m.entries()) {
    if (e.has_block()) {
      return absl::UnimplementedError(absl::StrCat("recording ", e.tensor().name(),
                                                   ": blocks of a sharded sync are not recorded (whole tensors only)"));
    }
    if (e.has_delta()) {
      return absl::UnimplementedError(absl::StrCat(
          "recording ", e.tensor().name(), ": the deltas of a delta sync are not recorded (whole tensors only)"));
    }
    if (e.nbytes() != e.total_nbytes()) {
      return absl::UnimplementedError(
          absl::StrCat("recording ", e.tensor().name(), ": split tensors are not recorded"));
    }
    ASSIGN_OR_RETURN(const DType dtype, comm::FromProto(e.tensor().dtype()));
    Shape shape(e.tensor().shape().begin(), e.tensor().shape().end());
    ASSIGN_OR_RETURN(TensorView view,
                     TensorView::Make(dtype, std::move(shape), {data + e.offset(), static_cast<size_t>(e.nbytes())},
                                      e.tensor().name()));
    RETURN_IF_ERROR(writer.Add(e.tensor().name(), view));
  }
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("wsync_version", absl::StrCat(m.version()));
  writer.SetMetadata("wsync_pp_stage", absl::StrCat(m.pp_stage()));
  writer.SetMetadata("wsync_bucket", absl::StrCat(m.index()));
  writer.SetMetadata(kSyncKey, sync_key_);
  const std::string path =
      (fs::path(partial_dir_) / absl::StrFormat("pp%u-%05u.safetensors", m.pp_stage(), m.index())).string();
  return Annotate(writer.Write(path), absl::StrCat("recording stage ", m.pp_stage(), " bucket ", m.index()));
}

absl::Status Recorder::Finish() {
  if (done_) return absl::OkStatus();
  std::error_code ec;
  std::string old;
  if (fs::exists(final_dir_, ec)) {
    if (PeerPublished()) {
      WSYNC_LOG(INFO) << "recording: " << final_dir_ << " was published during this sync by another agent sharing "
                      << dir_ << "; keeping it";
      Discard();
      return absl::OkStatus();
    }
    old = (fs::path(dir_) / absl::StrCat(".v", version_, ".old-", sync_key_, "-", getpid())).string();
    fs::remove_all(old, ec);
    fs::rename(final_dir_, old, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      return FsError(ec, absl::StrCat("moving the older recording ", final_dir_, " aside"));
    }
  }
  fs::rename(partial_dir_, final_dir_, ec);
  if (ec && (ec == std::errc::directory_not_empty || ec == std::errc::file_exists) && PeerPublished()) {
    Discard();  // a peer published between our check and our rename
    ec.clear();
  }
  if (!old.empty()) {
    std::error_code e;
    fs::remove_all(old, e);
    if (e) WSYNC_LOG(WARNING) << "could not remove the replaced recording " << old << ": " << e.message();
  }
  if (ec) return FsError(ec, absl::StrCat("publishing the recording ", final_dir_));
  done_ = true;
  return absl::OkStatus();
}

void Recorder::Discard() {
  if (done_) return;
  std::error_code ec;
  fs::remove_all(partial_dir_, ec);
  if (ec) WSYNC_LOG(WARNING) << "could not remove the partial recording " << partial_dir_ << ": " << ec.message();
  done_ = true;
}

}  // namespace wsync::rollout_agent
