// Recording of what one sync delivers (rollout agent --record-dir): every received HF tensor,
// exactly as received (name, dtype, shape, bytes; INT4 as weight_packed / weight_scale /
// weight_shape), as safetensors files, one per bucket: DIR/v{version}/pp{stage}-{index:05d}.safetensors.
//
// A reader never sees a half-written version: the files are written into a hidden partial
// directory DIR/.v{version}.partial-{tag}/ (each file itself atomically, SafetensorsWriter), and
// Finish() renames that directory to DIR/v{version} once the version is committed (an older
// recording of the same version number, from an earlier sync, is replaced). Discard() (or the
// destructor) removes the partial directory of a sync that failed. Several agents may share DIR
// (the agents of one sync receive the same buckets): the first to publish v{version} wins and the
// others drop their identical copy. Every file names its sync in its metadata (the coordinator's
// sync key: random run id + sync id), so a peer's recording of the same sync is told apart from an
// older recording of the same version number by content, not by timestamps.
// Every file carries metadata {"format": "pt", "wsync_version", "wsync_pp_stage", "wsync_bucket",
// "wsync_sync"}.
//
// Errors: file-system failures via ErrnoToStatus / std::filesystem codes naming the path;
// kUnimplemented for a split, block or delta entry (a tensor spread over several buckets, the block
// of a sharded sync or the delta of a delta sync is not recorded; the coordinator records full
// broadcast syncs only).
// Thread-safety: WriteBucket may be called concurrently (different buckets); Finish / Discard
// must not run concurrently with WriteBucket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::rollout_agent {

class Recorder {
 public:
  // Creates the partial directory DIR/.v{version}.partial-{sync_key}-{random} (and DIR itself if
  // missing). kInvalidArgument for an empty sync_key or one with '/' or a newline.
  static absl::StatusOr<std::unique_ptr<Recorder>> Start(const std::string& dir, uint64_t version,
                                                         const std::string& sync_key);
  ~Recorder();  // Discard() unless Finish() succeeded

  // Writes the bucket's entries (views into `data`, manifest.nbytes bytes) to one file. A bucket
  // without entries writes nothing.
  absl::Status WriteBucket(const v1::BucketManifest& manifest, const std::byte* data) const;
  // Publishes the recording as DIR/v{version}.
  absl::Status Finish();
  // Removes the partial directory. Idempotent.
  void Discard();

  const std::string& final_dir() const { return final_dir_; }
  const std::string& partial_dir() const { return partial_dir_; }

 private:
  Recorder() = default;
  // True when DIR/v{version} holds a recording of this sync (its files' metadata name sync_key_).
  bool PeerPublished() const;

  std::string dir_, partial_dir_, final_dir_, sync_key_;
  uint64_t version_ = 0;
  bool done_ = false;
};

}  // namespace wsync::rollout_agent
