// Recording of what one sync delivers (rollout agent --record-dir): every received HF tensor,
// exactly as received (name, dtype, shape, bytes; INT4 as weight_packed / weight_scale /
// weight_shape), as safetensors files, one per bucket: DIR/v{version}/pp{stage}-{index:05d}.safetensors.
//
// A reader never sees a half-written version: the files are written into a hidden partial
// directory DIR/.v{version}.partial-{tag}/ (each file itself atomically, SafetensorsWriter), and
// Finish() renames that directory to DIR/v{version} once the version is committed (an older
// recording of the same version number, from an earlier sync, is replaced). Discard() (or the
// destructor) removes the partial directory of a sync that failed. Several agents may share DIR
// (the agents of one sync receive the same buckets): the first to publish v{version} during the
// sync wins and the others drop their identical copy (a v{version} written after this recorder
// started is taken to be a peer's recording of the same sync).
// Every file carries metadata {"format": "pt", "wsync_version", "wsync_pp_stage", "wsync_bucket"}.
//
// Errors: file-system failures via ErrnoToStatus / std::filesystem codes naming the path;
// kUnimplemented for a split entry (a tensor spread over several buckets is not recorded).
// Thread-safety: WriteBucket may be called concurrently (different buckets); Finish / Discard
// must not run concurrently with WriteBucket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "wsync/v1/tensor.pb.h"

namespace wsync::rollout {

class Recorder {
 public:
  // Creates the partial directory (and DIR itself if missing); a stale partial directory of the
  // same version and tag is removed first. `tag` tells concurrent writers apart (e.g. the sync id).
  static absl::StatusOr<std::unique_ptr<Recorder>> Start(const std::string& dir, uint64_t version,
                                                         const std::string& tag);
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
  std::string dir_, partial_dir_, final_dir_;
  uint64_t version_ = 0;
  std::filesystem::file_time_type started_;
  bool done_ = false;
};

}  // namespace wsync::rollout
