#include "comm/bucket/space_staging.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_ipc.h"
#include "common/memory_space.h"
#include "common/status.h"

namespace wsync::comm {

SpaceStagingSink::SpaceStagingSink(BucketSink& inner, MemorySpace from, int max_free)
    : inner_(inner), from_(from), max_free_(static_cast<size_t>(std::max(max_free, 0))) {}

absl::Status SpaceStagingSink::Send(v1::BucketManifest manifest, Buffer data, uint64_t nbytes) {
  const MemorySpace to = inner_.space(), of = MemorySpace::Of(data);
  if (of == to) return inner_.Send(std::move(manifest), std::move(data), nbytes);
  if (nbytes > data.size())
    return absl::InvalidArgumentError(absl::StrCat("bucket ", manifest.index(), " of stage ", manifest.pp_stage(), ": ",
                                                   nbytes, " bytes from a ", data.size(), "-byte ", of.Name(),
                                                   " buffer"));
  const absl::Time t0 = absl::Now();
  Buffer out = inner_.Recycle(nbytes);
  if (out.size() < nbytes || MemorySpace::Of(out) != to) {
    out = Buffer();
    ASSIGN_OR_RETURN(out, to.host() ? AllocatePinnedBuffer(std::max<uint64_t>(nbytes, 1))
                                    : to.Allocate(std::max<uint64_t>(nbytes, 1)));
  }
  // Synchronous, whichever the direction: the builder refills `data` as soon as Recycle hands it
  // back, so the copy must have read it by then.
  absl::Status copied;
  if (to.host()) {
    copied = of.CopyToHost(out.data(), data.data(), nbytes);
  } else if (of.host()) {
    copied = CopyHostToDevice(out.data(), data.data(), nbytes, to.cuda_device());
  } else {  // between two GPUs: after the source's work, and done before the source is refilled
    copied = of.Synchronize();
    if (copied.ok()) copied = to.Copy(out.data(), data.data(), nbytes);
    if (copied.ok()) copied = to.Synchronize();
  }
  RETURN_IF_ERROR(Annotate(copied, absl::StrCat("staging bucket ", manifest.index(), " of stage ", manifest.pp_stage(),
                                                " from ", of.Name(), " to ", to.Name())));
  stats_.copy += absl::Now() - t0;
  ++stats_.buckets;
  stats_.bytes += nbytes;
  if (free_.size() < max_free_) free_.push_back(std::move(data));
  return inner_.Send(std::move(manifest), std::move(out), nbytes);
}

Buffer SpaceStagingSink::Recycle(uint64_t min_bytes) {
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i].size() < min_bytes) continue;
    Buffer b = std::move(free_[i]);
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
    return b;
  }
  return Buffer();
}

}  // namespace wsync::comm
