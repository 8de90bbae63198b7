#include "comm/bucket/device_staging.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "common/status.h"

namespace wsync::comm {

DeviceStagingSink::DeviceStagingSink(BucketSink& inner, int max_free_device)
    : inner_(inner), max_free_device_(static_cast<size_t>(std::max(max_free_device, 0))) {}

absl::Status DeviceStagingSink::Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) {
  if (data.device() < 0) return inner_.Send(std::move(manifest), std::move(data), nbytes);
  if (nbytes > data.size())
    return absl::InvalidArgumentError(absl::StrCat("bucket ", manifest.index(), " of stage ", manifest.pp_stage(), ": ",
                                                   nbytes, " bytes from a ", data.size(), "-byte device buffer"));
  const absl::Time t0 = absl::Now();
  Buffer host = inner_.Recycle(nbytes);
  if (host.size() < nbytes || host.device() >= 0) {
    host = Buffer();
    ASSIGN_OR_RETURN(host, AllocatePinnedBuffer(std::max<uint64_t>(nbytes, 1)));
  }
  RETURN_IF_ERROR(Annotate(MemorySpace::Of(data).CopyToHost(host.data(), data.data(), nbytes),
                           absl::StrCat("staging bucket ", manifest.index(), " of stage ", manifest.pp_stage(),
                                        " from CUDA device ", data.device())));
  stats_.copy += absl::Now() - t0;
  ++stats_.buckets;
  stats_.bytes += nbytes;
  if (free_device_.size() < max_free_device_) free_device_.push_back(std::move(data));
  return inner_.Send(std::move(manifest), std::move(host), nbytes);
}

Buffer DeviceStagingSink::Recycle(uint64_t min_bytes) {
  for (size_t i = 0; i < free_device_.size(); ++i) {
    if (free_device_[i].size() < min_bytes) continue;
    Buffer b = std::move(free_device_[i]);
    free_device_.erase(free_device_.begin() + static_cast<std::ptrdiff_t>(i));
    return b;
  }
  return Buffer();  // the inner sink's host buffers stay with it, for the staging copies
}

}  // namespace wsync::comm
